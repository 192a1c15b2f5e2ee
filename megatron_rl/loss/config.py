"""Loss configuration: one dataclass, validated once with errors that name the field.

Every knob of every algorithm in ``ALGORITHMS.md`` is a field here (no hard-coded constants in the
loss functions). :func:`LossConfig.for_algorithm` fills the published defaults of one algorithm.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

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


class LossConfigError(ValueError):
    """A loss config value is out of range; the message names the field and the allowed values."""


@dataclass(frozen=True)
class LossConfig:
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
    # ERC gate [9]
    erc: bool = False
    erc_low: float = 0.95
    erc_high: float = 1.05
    # KL to reference [11]
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    # entropy bonus [10.1]; the adaptive controller overrides it when passed to compute_loss
    entropy_coeff: float = 0.0
    # entropy-dynamics diagnostic [12]
    diagnostic_top_frac: float = 2e-4
    # training/inference mismatch correction (loss/rollout_correction.py): none | tis | mis
    rollout_correction: str = "none"
    rollout_correction_threshold: float = 2.0  # C of TIS min(rho, C) / MIS 1[1/C <= rho <= C]

    def validate(self) -> LossConfig:
        """Raise :class:`LossConfigError` for any out-of-range value; return ``self``."""
        from megatron_rl.loss.registry import get_policy_loss

        spec = get_policy_loss(self.policy_loss)
        _choice("loss_agg_mode", self.loss_agg_mode, AGG_MODES)
        _choice("kl_loss_type", self.kl_loss_type, KL_TYPES)
        _choice("cov_stat_source", self.cov_stat_source, COV_STAT_SOURCES)
        _choice("rollout_correction", self.rollout_correction, ("none", "tis", "mis"))
        _open_low("rollout_correction_threshold", self.rollout_correction_threshold, 1.0,
                  "(1, inf)")
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
        if not 0.0 <= self.erc_low < 1.0 < self.erc_high:
            raise LossConfigError(f"erc_low/erc_high must satisfy 0 <= erc_low < 1 < erc_high, got "
                                  f"{self.erc_low}/{self.erc_high}")
        if self.erc and not spec.token_level:
            raise LossConfigError(f"erc=True needs a token-level policy_loss; {spec.name!r} is "
                                  "sequence-level (use 'gspo_token')")
        _range("kl_loss_coef", self.kl_loss_coef, 0.0, math.inf, "[0, inf)")
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
    # the adaptive entropy controller is added by the trainer (run_setup.entropy_controller)
    "skywork_or1": dict(policy_loss="ppo", clip_ratio_c=INF, log_ratio_clamp=INF),
}

# The 2025-26 losses (docs/losses-2025.md); defaults of their fields are the references' own.
PRESETS.update({
    "gmpo": dict(policy_loss="gmpo", loss_agg_mode="seq-mean-token-mean"),
    "sapo": dict(policy_loss="sapo", loss_agg_mode="seq-mean-token-mean"),
    "dppo_tv": dict(policy_loss="dppo_tv"),
    "dppo_kl": dict(policy_loss="dppo_kl"),
})


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
