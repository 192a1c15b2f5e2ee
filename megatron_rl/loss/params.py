"""The loss parameters: every knob of every algorithm in ``ALGORITHMS.md`` (no hard-coded
constants in the loss functions), their allowed named values, and the error a bad value raises.

The loss functions read a :class:`LossParams`; :class:`megatron_rl.loss.config.LossConfig` is the
same fields with validation and the published presets of each algorithm.
"""

from __future__ import annotations

from dataclasses import dataclass

AGG_MODES = (
    "token-mean",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",  # Dr.GRPO reference: per-sequence sum / C, then mean over sequences
    "token-sum-norm",  # verl's "seq-mean-token-sum-norm": total sum / C, no division by #sequences
)
KL_TYPES = ("k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl",
            "k1+", "kl+", "abs+", "k3+", "low_var_kl+", "k2+", "mse+")
COV_STAT_SOURCES = ("prepass", "old_logp")
ROLLOUT_CORRECTIONS = ("none", "tis", "mis", "icepop", "seq_mask_tis")  # loss/rollout_correction.py
# token-mean denominator under rejection (loss/rollout_correction.py): all valid tokens | kept ones
ROLLOUT_CORRECTION_DENOMINATORS = ("all", "kept")


class LossConfigError(ValueError):
    """A loss config value is out of range; the message names the field and the allowed values."""


@dataclass(frozen=True)
class LossParams:
    """All loss settings (ALGORITHMS.md section in brackets).

    Ratios named ``*_ratio`` for Clip-Cov / KL-Cov are **fractions** of the global valid-token
    count (verl convention: 2e-4 means 0.02 %), never percentages.
    """


    policy_loss: str = "ppo"
    loss_agg_mode: str = "token-mean"  # [0]
    loss_scale_factor: float | None = None  # C of the *-sum-norm modes [0]; None -> global max T
    # PPO-family clip [1, 2.1, 7, 10.2]
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float = 3.0  # dual clip, must be > 1; inf = no dual clip
    log_ratio_clamp: float = 20.0  # inf = no clamp
    # Clip-Cov / KL-Cov [4]
    clip_cov_ratio: float = 2e-4
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 2e-4
    kl_cov_coef: float = 1.0
    cov_stat_source: str = "prepass"  # "prepass" (exact) | "old_logp" (exact only for 1st update)
    cov_seed: int = 0
    # GSPO [5]
    gspo_log_ratio_max: float = 10.0
    # GPPO positive-sample NLL [7]
    positive_nll_coef: float = 0.0
    # ASPO [8]
    aspo_entropy_quantile: float = 0.8
    aspo_eps_low_entropy: float = 0.2  # clip width of tokens with entropy <= per-seq quantile
    aspo_eps_high_entropy: float = 0.4  # clip width of the top-entropy tokens
    aspo_c_pos: float = 3.0
    aspo_c_neg: float = 3.0
    # GMPO (loss/gmpo.py): token log-ratio clip [-gmpo_clip_low, gmpo_clip_high] (log space)
    gmpo_clip_low: float = 0.4  # GMPO: lower log-ratio clip (log space, > 0)
    gmpo_clip_high: float = 0.4  # GMPO: upper log-ratio clip (log space, > 0)
    # SAPO (loss/sapo.py): soft-gate temperatures for A > 0 / A <= 0
    sapo_tau_pos: float = 1.0  # SAPO: gate temperature for A > 0 (> 0)
    sapo_tau_neg: float = 1.05  # SAPO: gate temperature for A <= 0 (> 0)
    # DPPO (loss/dppo.py): divergence thresholds, truncated-IS cap, prime-rl's (log r)^2 coef
    dppo_tv_delta_low: float = 0.15  # DPPO-TV: max fall q - p of pi(token) when A <= 0
    dppo_tv_delta_high: float = 0.15  # DPPO-TV: max rise p - q of pi(token) when A > 0
    dppo_kl_delta_low: float = 0.05  # DPPO-KL: binary-KL bound on a fall when A <= 0
    dppo_kl_delta_high: float = 0.05  # DPPO-KL: binary-KL bound on a rise when A > 0
    dppo_ratio_cap: float = 20.0  # DPPO: cap C on the ratio in -A*min(r, C) (> 1)
    dppo_sq_log_ratio_coef: float = 0.0  # DPPO: coefficient of an extra (log r)^2 term
    # BAPO (loss/bapo.py): explicit ratio bounds searched per mini-batch (reference defaults)
    bapo_target: float = 1.0  # BAPO: minimum pos/neg contribution ratio the search aims for
    bapo_low_start: float = 0.6  # BAPO: first lower ratio bound (in (0, 1])
    bapo_low_max: float = 0.8  # BAPO: largest lower ratio bound (>= bapo_low_start, <= 1)
    bapo_low_step: float = 0.05  # BAPO: lower-bound increment (0: fixed)
    bapo_high_start: float = 1.2  # BAPO: first upper ratio bound (>= 1)
    bapo_high_max: float = 2.0  # BAPO: largest upper ratio bound (>= bapo_high_start)
    bapo_high_step: float = 0.05  # BAPO: upper-bound increment (0: fixed)
    bapo_eps: float = 1e-8  # BAPO: added to the negative sum in pos/neg
    # SIREN (loss/siren.py): self-anchored regulariser on the peak-entropy tokens
    siren_coef: float = 0.0  # SIREN: weight of (H_S - H_anchor)^2 added to the loss (0 = off)
    siren_quantile: float = 0.8  # SIREN: tokens above this entropy quantile of the mini-batch
    siren_anchor: float | None = None  # SIREN: fixed anchor entropy; None = the first step's H_S
    siren_top_p: float = 1.0  # SIREN: H_t over the top-p vocabulary nucleus (1 = full vocab)
    # ERC gate [9]
    erc: bool = False
    erc_low: float = 0.95
    erc_high: float = 1.05
    # KL to reference [11]
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    # on-policy distillation as a loss term (loss/distill.py): coef * mean 1/2 (logp - teacher)^2
    distill_loss_coef: float = 0.0  # set by teacher.mode: loss (teacher.coef); 0 = off
    # entropy bonus [10.1]; the adaptive controller overrides it when passed to compute_loss
    entropy_coeff: float = 0.0
    # entropy-dynamics diagnostic [12]
    diagnostic_top_frac: float = 2e-4
    # off-policy correction (loss/rollout_correction.py): none | tis | mis | icepop | seq_mask_tis
    rollout_correction: str = "none"
    rollout_correction_threshold: float = 2.0  # C: tis min(rho, C), mis band [1/C, C], seq cap
    icepop_low: float = 0.5  # icepop: tokens with rho < icepop_low get weight 0 (>= 0, <= 1)
    icepop_high: float = 5.0  # icepop: tokens with rho > icepop_high get weight 0 (>= 1)
    seq_mask_low: float = 0.999  # seq_mask_tis: rows with geometric-mean rho below are dropped
    seq_mask_high: float = 1.001  # seq_mask_tis: rows with geometric-mean rho above are dropped
    rollout_correction_denominator: str = "all"  # all: rejected tokens stay in means; kept: leave
