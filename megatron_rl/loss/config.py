"""Loss configuration: the loss parameters (:mod:`megatron_rl.loss.params`) validated once with
errors that name the field, and the published presets of each algorithm
(:func:`LossConfig.for_algorithm`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

from megatron_rl.loss.params import (
    AGG_MODES,
    COV_STAT_SOURCES,
    KL_TYPES,
    ROLLOUT_CORRECTION_DENOMINATORS,
    ROLLOUT_CORRECTIONS,
    LossConfigError,
    LossParams,
)
from megatron_rl.loss.registry import get_policy_loss


@dataclass(frozen=True)
class LossConfig(LossParams):
    """All loss settings (ALGORITHMS.md section in brackets).

    Ratios named ``*_ratio`` for Clip-Cov / KL-Cov are **fractions** of the global valid-token
    count (verl convention: 2e-4 means 0.02 %), never percentages.
    """

    def validate(self) -> LossConfig:
        """Raise :class:`LossConfigError` for any out-of-range value; return ``self``."""
        spec = get_policy_loss(self.policy_loss)
        _choice("loss_agg_mode", self.loss_agg_mode, AGG_MODES)
        _choice("kl_loss_type", self.kl_loss_type, KL_TYPES)
        _choice("cov_stat_source", self.cov_stat_source, COV_STAT_SOURCES)
        _choice("rollout_correction", self.rollout_correction, ROLLOUT_CORRECTIONS)
        _choice("rollout_correction_denominator", self.rollout_correction_denominator,
                ROLLOUT_CORRECTION_DENOMINATORS)
        _open_low("rollout_correction_threshold", self.rollout_correction_threshold, 1.0,
                  "(1, inf)")
        _band("icepop_low", "icepop_high", self.icepop_low, self.icepop_high, 0.0)
        _band("seq_mask_low", "seq_mask_high", self.seq_mask_low, self.seq_mask_high, None)
        max_low = math.inf if spec.name == "cispo" else 1.0
        _range("clip_ratio_low", self.clip_ratio_low, 0.0, max_low, "[0, 1] ([0, inf) for cispo)")
        _range("clip_ratio_high", self.clip_ratio_high, 0.0, math.inf, "[0, inf)")
        _open_low("clip_ratio_c", self.clip_ratio_c, 1.0, "(1, inf)")
        _open_low("log_ratio_clamp", self.log_ratio_clamp, 0.0, "(0, inf)")
        for name in ("clip_cov_ratio", "kl_cov_ratio", "diagnostic_top_frac"):
            _frac(name, getattr(self, name))
        if not self.clip_cov_lb < self.clip_cov_ub:
            raise LossConfigError(f"clip_cov_lb ({self.clip_cov_lb}) must be < clip_cov_ub "
                                  f"({self.clip_cov_ub})")
        _range("kl_cov_coef", self.kl_cov_coef, 0.0, math.inf, "[0, inf)")
        _open_low("gspo_log_ratio_max", self.gspo_log_ratio_max, 0.0, "(0, inf)")
        _range("positive_nll_coef", self.positive_nll_coef, 0.0, math.inf, "[0, inf)")
        if not 0.0 < self.aspo_entropy_quantile < 1.0:
            raise LossConfigError(f"aspo_entropy_quantile must be in (0, 1), got "
                                  f"{self.aspo_entropy_quantile}")
        for name in ("aspo_eps_low_entropy", "aspo_eps_high_entropy"):
            _range(name, getattr(self, name), 0.0, 1.0, "[0, 1]")
        for name in ("aspo_c_pos", "aspo_c_neg"):
            _open_low(name, getattr(self, name), 1.0, "(1, inf)")
        for name in ("gmpo_clip_low", "gmpo_clip_high", "sapo_tau_pos", "sapo_tau_neg",
                     "dppo_kl_delta_low", "dppo_kl_delta_high"):
            _open_low(name, getattr(self, name), 0.0, "(0, inf)")
        for name in ("dppo_tv_delta_low", "dppo_tv_delta_high"):
            _range(name, getattr(self, name), 0.0, 1.0, "[0, 1] (a probability change)")
        _open_low("dppo_ratio_cap", self.dppo_ratio_cap, 1.0, "(1, inf]")
        _range("dppo_sq_log_ratio_coef", self.dppo_sq_log_ratio_coef, 0.0, math.inf, "[0, inf)")
        _bapo_checks(self)
        _siren_checks(self)
        if not 0.0 <= self.erc_low < 1.0 < self.erc_high:
            raise LossConfigError(f"erc_low/erc_high must satisfy 0 <= erc_low < 1 < erc_high, got "
                                  f"{self.erc_low}/{self.erc_high}")
        if self.erc and not spec.token_level:
            raise LossConfigError(f"erc=True needs a token-level policy_loss; {spec.name!r} is "
                                  "sequence-level (use 'gspo_token')")
        _range("kl_loss_coef", self.kl_loss_coef, 0.0, math.inf, "[0, inf)")
        _range("distill_loss_coef", self.distill_loss_coef, 0.0, math.inf, "[0, inf)")
        coeff = self.entropy_coeff
        if not isinstance(coeff, (int, float)) or not math.isfinite(coeff):
            raise LossConfigError(f"entropy_coeff={self.entropy_coeff!r}; allowed: a finite float")
        if self.loss_scale_factor is not None:
            _open_low("loss_scale_factor", self.loss_scale_factor, 0.0, "(0, inf) or None")
        return self

    @staticmethod
    def for_algorithm(name: str, **overrides: object) -> LossConfig:
        """Published defaults of one algorithm (see ``PRESETS``), then ``overrides``; validated."""
        if name not in PRESETS:
            raise LossConfigError(f"unknown algorithm preset {name!r}; valid: {sorted(PRESETS)}")
        known = {f.name for f in fields(LossConfig)}
        bad = sorted(set(overrides) - known)
        if bad:
            raise LossConfigError(f"unknown LossConfig field(s) {bad}; valid: {sorted(known)}")
        return replace(LossConfig(**PRESETS[name]), **overrides).validate()


INF = math.inf  # clip_ratio_c = inf: no dual clip; log_ratio_clamp = inf: no log-ratio clamp

# Published settings of each named recipe (ALGORITHMS.md section and the reference code in the
# comments). A preset overrides every LossConfig default its recipe does not have: the generic
# defaults are verl's ``compute_policy_loss_vanilla`` (dual clip c = 3, log-ratio clamp +-20), so
# recipes whose reference loss is plain PPO-clip set both to ``inf``. tests/test_presets.py checks
# each preset's effective settings against this list of sources.
PRESETS: dict[str, dict] = {
    # §1: verl compute_policy_loss_vanilla + actor.yaml (eps 0.2/0.2, c = 3, clamp 20, token-mean)
    "ppo": dict(policy_loss="ppo"),
    # §3.1: the original GRPO objective (DeepSeekMath Eq. 3, restated in DAPO Eq. 5): plain
    # PPO-clip, sample-level loss (seq-mean-token-mean, verl docs/algo/grpo.md), KL in the loss
    # (verl docs/algo/grpo.md: use_kl_loss=True, kl_loss_coef 0.001, low_var_kl); no dual clip.
    "grpo": dict(policy_loss="ppo", loss_agg_mode="seq-mean-token-mean", use_kl_loss=True,
                 clip_ratio_c=INF, log_ratio_clamp=INF),
    # §3.2: Dr.GRPO reference code (sail-sg/oat PPOLearner): plain PPO-clip (no dual clip, no
    # clamp), per-sequence token sum / constant C then mean over sequences, no KL (beta = 0).
    # C = the max response length: a run config sets loss_scale_factor=rollout.max_new_tokens
    "dr_grpo": dict(policy_loss="ppo", loss_agg_mode="seq-mean-token-sum-norm",
                    clip_ratio_c=INF, log_ratio_clamp=INF),
    # §2.1: DAPO recipe run_dapo_qwen2.5_32b.sh on verl's vanilla loss (clamp 20 kept)
    "dapo": dict(policy_loss="ppo", clip_ratio_high=0.28, clip_ratio_c=10.0),
    # §5: verl compute_policy_loss_gspo + test_gspo_3b_math.sh (no dual clip / clamp in the loss)
    "gspo": dict(policy_loss="gspo", clip_ratio_low=3e-4, clip_ratio_high=4e-4,
                 loss_agg_mode="seq-mean-token-mean"),
    "gspo_token": dict(policy_loss="gspo_token", clip_ratio_low=3e-4, clip_ratio_high=4e-4,
                       loss_agg_mode="seq-mean-token-mean"),
    # §6: verl compute_policy_loss_cispo (clamp 20) + run_cispo_qwen2_5_0_5b_gsm8k.sh
    "cispo": dict(policy_loss="cispo", clip_ratio_low=10.0, clip_ratio_high=0.2),
    # §7: KlearReasoner compute_gppo_loss (c = 10, no clamp) + paper §4, positive_loss_coeff 0.1
    "gppo": dict(policy_loss="gppo", clip_ratio_high=0.28, clip_ratio_c=10.0,
                 positive_nll_coef=0.1),
    # §8: Archer2.0 compute_policy_loss_archer (clamp 20, c_pos = c_neg = 3, quantile 0.8,
    # widths 0.2/0.4) + run_archer2.0_qwen2.5_1.5b_code.sh (KL loss 0.001 low_var_kl)
    "aspo": dict(policy_loss="aspo", use_kl_loss=True, kl_loss_coef=0.001),
    # §4: Entropy-Mechanism recipe/dapo/*_clip_cov.sh, *_kl_cov.sh (the loss has no dual clip
    # and no clamp; c = 10 is what the scripts pass and is unused by these losses)
    "clip_cov": dict(policy_loss="clip_cov", clip_ratio_low=1.0, clip_ratio_high=1.0,
                     clip_ratio_c=10.0),
    "kl_cov": dict(policy_loss="kl_cov", kl_cov_ratio=2e-4, kl_cov_coef=1.0, clip_ratio_c=10.0),
    # §9: Kwai-Klear/ERC recipe/dapo/*erc_1_05.sh: grpo_erc = DAPO + ERC (eps 0.2/0.28, c = 10),
    # gppo_erc = GPPO + ERC (eps 0.2/0.2, c = 10), both with the 0.1 positive NLL; ERC code clamps
    "dapo_erc": dict(policy_loss="ppo", clip_ratio_high=0.28, clip_ratio_c=10.0, erc=True,
                     positive_nll_coef=0.1),
    "gppo_erc": dict(policy_loss="gppo", clip_ratio_c=10.0, erc=True, positive_nll_coef=0.1),
    # §10.2: lime-RL/DCPO compute_policy_loss_dcpo (dynamic bounds + dual clip c = 10; its
    # log-ratio clamp is commented out) + run_dcpo.sh (eps 0.2/0.28)
    "dcpo": dict(policy_loss="dcpo", clip_ratio_high=0.28, clip_ratio_c=10.0,
                 log_ratio_clamp=INF),
    # §10.1: Skywork-OR1 dp_actor + or1_scripts/train/*.sh: plain PPO-clip, eps 0.2, token-mean,
    # no KL, no dual clip and no log-ratio clamp (A = -1, r = 5 gives loss 5 and gradient 5);
    # the adaptive entropy controller is added by the trainer (run.setup.entropy_controller)
    "skywork_or1": dict(policy_loss="ppo", clip_ratio_c=INF, log_ratio_clamp=INF),
}

# The 2025-26 losses (docs/losses-2025.md); defaults of their fields are the references' own.
PRESETS.update({
    "gmpo": dict(policy_loss="gmpo", loss_agg_mode="seq-mean-token-mean"),
    "sapo": dict(policy_loss="sapo", loss_agg_mode="seq-mean-token-mean"),
    "dppo_tv": dict(policy_loss="dppo_tv"),
    "dppo_kl": dict(policy_loss="dppo_kl"),
    # BAPO: WooooDyy/BAPO recipe/bapo/config/bapo_trainer.yaml (target 1, low 0.6 -> 0.8,
    # high 1.2 -> 2.0, steps 0.05) on verl's vanilla loss (c = 3, clamp 20, token-mean)
    "bapo": dict(policy_loss="bapo"),
    # SIREN: Linn3a/siren exp_scripts/siren.sh (PPO-clip eps 0.28, entropy_coeff 0.005 on the
    # self-anchored term, mask_ratio 0.8) on verl's vanilla loss (c = 3, clamp 20)
    "siren": dict(policy_loss="ppo", clip_ratio_low=0.28, clip_ratio_high=0.28,
                  siren_coef=0.005),
})


def _bapo_checks(cfg: LossParams) -> None:
    """BAPO's search ranges: ``0 < low_start <= low_max <= 1 <= high_start <= high_max``,
    steps and target ``>= 0``, ``eps > 0``."""
    if not 0.0 < cfg.bapo_low_start <= cfg.bapo_low_max <= 1.0:
        raise LossConfigError(f"bapo_low_start/bapo_low_max must satisfy 0 < start <= max <= 1, "
                              f"got {cfg.bapo_low_start}/{cfg.bapo_low_max}")
    if not 1.0 <= cfg.bapo_high_start <= cfg.bapo_high_max < math.inf:
        raise LossConfigError(f"bapo_high_start/bapo_high_max must satisfy 1 <= start <= max < "
                              f"inf, got {cfg.bapo_high_start}/{cfg.bapo_high_max}")
    for name in ("bapo_low_step", "bapo_high_step", "bapo_target"):
        _range(name, getattr(cfg, name), 0.0, math.inf, "[0, inf)")
    _open_low("bapo_eps", cfg.bapo_eps, 0.0, "(0, inf)")


def _siren_checks(cfg: LossParams) -> None:
    """SIREN: ``siren_coef >= 0``, ``0 < siren_quantile < 1``, ``siren_anchor`` None or >= 0."""
    _range("siren_coef", cfg.siren_coef, 0.0, math.inf, "[0, inf)")
    if not isinstance(cfg.siren_quantile, (int, float)) or not 0.0 < cfg.siren_quantile < 1.0:
        raise LossConfigError(f"siren_quantile={cfg.siren_quantile!r} is out of range; "
                              "allowed: (0, 1)")
    if not isinstance(cfg.siren_top_p, (int, float)) or not 0.0 < cfg.siren_top_p <= 1.0:
        raise LossConfigError(f"siren_top_p={cfg.siren_top_p!r} is out of range; allowed: (0, 1] "
                              "(1 = full-vocabulary entropy)")
    if cfg.siren_top_p < 1.0 and cfg.siren_coef <= 0:
        raise LossConfigError(f"siren_top_p={cfg.siren_top_p} needs siren_coef > 0 (it masks "
                              "SIREN's entropies)")
    if cfg.siren_anchor is not None:
        _range("siren_anchor", cfg.siren_anchor, 0.0, math.inf, "[0, inf) or None")


def _choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise LossConfigError(f"{name}={value!r} is not valid; allowed: {list(allowed)}")


def _range(name: str, value: float, lo: float, hi: float, allowed: str) -> None:
    if not isinstance(value, (int, float)) or math.isnan(value) or not lo <= value <= hi:
        raise LossConfigError(f"{name}={value!r} is out of range; allowed: {allowed}")


def _open_low(name: str, value: float, lo: float, allowed: str) -> None:
    if not isinstance(value, (int, float)) or math.isnan(value) or not value > lo:
        raise LossConfigError(f"{name}={value!r} is out of range; allowed: {allowed}")


def _frac(name: str, value: float) -> None:
    if not isinstance(value, (int, float)) or math.isnan(value) or not 0.0 < value <= 1.0:
        raise LossConfigError(f"{name}={value!r} is out of range; allowed: (0, 1] (a fraction of "
                              "the global valid-token count, not a percentage)")


def _band(lo_name: str, hi_name: str, lo: float, hi: float, lo_min: float | None) -> None:
    """A keep-band ``[lo, hi]`` around ratio 1: ``lo`` in ``[lo_min, 1]`` (``(0, 1]`` when
    ``lo_min`` is None), ``hi >= 1`` (may be inf), ``lo < hi``."""
    low_text = "(0, 1]" if lo_min is None else f"[{lo_min:g}, 1]"
    for name, v in ((lo_name, lo), (hi_name, hi)):
        if not isinstance(v, (int, float)) or math.isnan(v):
            raise LossConfigError(f"{name}={v!r} is not a number")
    if not ((lo > 0.0 if lo_min is None else lo >= lo_min) and lo <= 1.0):
        raise LossConfigError(f"{lo_name}={lo!r} is out of range; allowed: {low_text} "
                              "(a ratio at or below 1: on-policy tokens, ratio 1, must be kept)")
    if not hi >= 1.0:
        raise LossConfigError(f"{hi_name}={hi!r} is out of range; allowed: [1, inf] (a ratio at "
                              "or above 1: on-policy tokens, ratio 1, must be kept)")
    if not lo < hi:
        raise LossConfigError(f"{lo_name} ({lo}) must be < {hi_name} ({hi})")
