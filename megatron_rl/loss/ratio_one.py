"""Which parts of a loss act when the update's policy is the old policy (``r = pi/pi_old = 1``).

``old_logp`` is recomputed by the actor just before the update, so the first optimizer step of
every RL step sees ``r = 1`` at every token. A run with one on-policy update per step
(``actor.ppo_epochs = 1`` and one mini-batch: ``actor.mini_batch_size`` 0 or the whole batch)
never sees anything else: every mechanism that acts through the ratio (clips, gates, trust
regions, KL to the old policy, the entropy ratio of ERC) is inert there, and the loss reduces to
a policy gradient. :func:`inert_at_ratio_one` names those mechanisms for a loss configuration,
:func:`acting_at_ratio_one` the ones that act anyway. Imports no torch (config loading uses it).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RatioOneNote:
    """What a policy loss does at ``r = 1``: ``acts`` (its own mechanism still changes the
    gradient), the ``mechanism`` it adds to a policy gradient, and ``why``."""

    acts: bool
    mechanism: str
    why: str


# One entry per registered policy loss (tests/test_recipes_active.py checks that, and each entry
# against the loss's gradient at r = 1).
RATIO_ONE: dict[str, RatioOneNote] = {
    "ppo": RatioOneNote(False, "the ratio clip (clip_ratio_low/high) and dual clip",
                        "r = 1 lies inside [1-eps_low, 1+eps_high] and below c: no token is "
                        "clipped, the gradient is -A grad(logp)"),
    "dapo": RatioOneNote(False, "clip-higher (clip_ratio_high) and the dual clip",
                         "as ppo: r = 1 reaches neither bound"),
    "gspo": RatioOneNote(False, "the sequence-ratio clip",
                         "every sequence ratio is 1, inside the clip band: the gradient is the "
                         "sequence-mean policy gradient"),
    "gspo_token": RatioOneNote(False, "the sequence-ratio clip",
                               "as gspo: the sequence ratio is 1 for every sequence"),
    "cispo": RatioOneNote(False, "the clipped importance weight",
                          "the detached weight clip(r) is 1 for every token: REINFORCE"),
    "gppo": RatioOneNote(False, "the gradient-preserving clip",
                         "no token reaches a bound, so the bound-scaled gradient never applies"),
    "aspo": RatioOneNote(False, "the flipped ratio, entropy-quantile clip widths and soft dual "
                         "clip", "1/r and r are both 1 with gradient -A grad(logp); no token "
                         "reaches a bound of either width or a dual clip"),
    "clip_cov": RatioOneNote(True, "Clip-Cov's detached tokens",
                             "the covariance selection zeroes the gradient of a fraction of the "
                             "tokens whatever the ratio (its PPO clip part is inert at r = 1)"),
    "kl_cov": RatioOneNote(False, "the KL-Cov penalty coef*|logp - old_logp|",
                           "the penalty and its gradient are 0 where logp = old_logp: the loss "
                           "equals -A r, a policy gradient"),
    "dcpo": RatioOneNote(False, "the dynamic per-token clip bounds",
                         "r = 1 is inside every token's bounds"),
    "gmpo": RatioOneNote(False, "the log-space clip of the geometric-mean ratio",
                         "every log-ratio is 0, inside the clip: the sequence-mean policy "
                         "gradient"),
    "sapo": RatioOneNote(False, "the soft sigmoid gate",
                         "the gate's gradient weight 4 s(1-s) r is exactly 1 at r = 1"),
    "dppo_tv": RatioOneNote(False, "the total-variation trust region",
                            "pi = pi_old: every token is inside the region, none is masked"),
    "dppo_kl": RatioOneNote(False, "the binary-KL trust region",
                            "pi = pi_old: every token is inside the region, none is masked"),
    "bapo": RatioOneNote(False, "the adaptive ratio bounds (bapo_*) and the dual clip",
                         "every searched bound satisfies c_low <= 1 <= c_high: r = 1 reaches "
                         "neither bound, the gradient is -A grad(logp)"),
    "nll": RatioOneNote(True, "the supervised NLL", "it does not use the ratio"),
}

ERC_NOTE = RatioOneNote(False, "ERC's entropy-ratio gate (erc)",
                        "the current and old entropies are equal: rho = 1 is inside "
                        "(erc_low, erc_high) and no token is gated")


def inert_at_ratio_one(loss_cfg) -> list[str]:
    """Mechanisms of ``loss_cfg`` (a :class:`~megatron_rl.loss.LossConfig`) that act only
    through ``pi/pi_old`` and so do nothing in an on-policy update; empty when its policy loss
    acts at ``r = 1`` (Clip-Cov, NLL)."""
    note = RATIO_ONE[loss_cfg.policy_loss]
    if note.acts:
        return []
    return [note.mechanism] + ([ERC_NOTE.mechanism] if loss_cfg.erc else [])


def acting_at_ratio_one(loss_cfg) -> list[str]:
    """Terms of ``loss_cfg`` that change the gradient even at ``r = 1`` (besides -A grad(logp))."""
    out = []
    note = RATIO_ONE[loss_cfg.policy_loss]
    if note.acts:
        out.append(note.mechanism)
    if loss_cfg.positive_nll_coef > 0:
        out.append("the positive-sample NLL (positive_nll_coef)")
    if loss_cfg.use_kl_loss:
        out.append("the KL to the reference (use_kl_loss)")
    if loss_cfg.entropy_coeff:
        out.append("the entropy bonus (entropy_coeff)")
    if loss_cfg.siren_coef:
        out.append("the SIREN regulariser (siren_coef)")
    if loss_cfg.rollout_correction != "none":
        out.append(f"the rollout correction ({loss_cfg.rollout_correction})")
    return out


def updates_per_step(rows: int, mini_batch_size: int, ppo_epochs: int) -> int:
    """Optimizer steps of the actor in one RL step: ``ppo_epochs x rows / mini_batch_size``
    (``mini_batch_size`` 0 = the whole batch of ``rows`` responses)."""
    mini = mini_batch_size or rows
    return ppo_epochs * max(1, rows // mini)
