"""RAGEN's two early-stopping conditions as a small stateful, checkpointable class.

(A) Reward-variance collapse. Only *successful* steps count (a batch was trained, i.e. it
    survived the sampling filters; steps that trained nothing are ignored: they neither count
    nor break a streak). The baseline is the mean of the in-group reward std (the mean over
    groups of the Bessel std, e.g. :func:`megatron_rl.rollout.filters.mean_in_group_std` of the
    generated batch) over the first ``rv_baseline_steps`` (10) successful steps. After that, a
    successful step with std < ``rv_ratio`` (0.1) × baseline extends the low streak, any other
    resets it; stop when the streak reaches ``rv_patience`` (10). A zero baseline (no variance at
    all from the start) disables (A) rather than stopping at once.
(B) Validation collapse. Each validation's success rate (fraction in [0, 1]) < ``val_threshold``
    (0.01) extends the low streak, any other resets it; stop when it reaches ``val_patience`` (5).

Metrics (logged every call): ``early_stopped/reward_variance_collapse`` and
``early_stopped/validation_collapse`` (0/1, 1 once that condition fired),
``early_stopped/rv_baseline`` (nan until set), ``early_stopped/rv_low_streak``,
``early_stopped/val_low_streak``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class EarlyStopDecision:
    stop: bool
    reason: str | None
    metrics: dict = field(default_factory=dict)


REASON_RV = "reward_variance_collapse"
REASON_VAL = "validation_collapse"


class EarlyStopper:
    def __init__(self, enabled: bool = True, rv_enabled: bool = True, rv_baseline_steps: int = 10,
                 rv_ratio: float = 0.1, rv_patience: int = 10, val_enabled: bool = True,
                 val_threshold: float = 0.01, val_patience: int = 5):
        self.enabled = enabled
        self.rv_enabled = rv_enabled
        self.rv_baseline_steps = int(rv_baseline_steps)
        self.rv_ratio = float(rv_ratio)
        self.rv_patience = int(rv_patience)
        self.val_enabled = val_enabled
        self.val_threshold = float(val_threshold)
        self.val_patience = int(val_patience)
        self._baseline_values: list[float] = []
        self.rv_baseline: float | None = None
        self.rv_low_streak = 0
        self.val_low_streak = 0
        self.stopped_reason: str | None = None

    # ------------------------------------------------------------------------------------------
    def metrics(self) -> dict:
        return {
            f"early_stopped/{REASON_RV}": float(self.stopped_reason == REASON_RV),
            f"early_stopped/{REASON_VAL}": float(self.stopped_reason == REASON_VAL),
            "early_stopped/rv_baseline": (math.nan if self.rv_baseline is None
                                          else self.rv_baseline),
            "early_stopped/rv_low_streak": float(self.rv_low_streak),
            "early_stopped/val_low_streak": float(self.val_low_streak),
        }

    def _decision(self) -> EarlyStopDecision:
        return EarlyStopDecision(self.stopped_reason is not None, self.stopped_reason,
                                 self.metrics())

    def _stop(self, reason: str) -> None:
        if self.enabled and self.stopped_reason is None:
            self.stopped_reason = reason

    # ------------------------------------------------------------------------------------------
    def update_train(self, in_group_std: float, trained: bool = True) -> EarlyStopDecision:
        """Call once per training step with the mean in-group reward std of the step."""
        if not trained or not self.rv_enabled or in_group_std is None \
                or math.isnan(in_group_std):
            return self._decision()
        x = float(in_group_std)
        if self.rv_baseline is None:
            self._baseline_values.append(x)
            if len(self._baseline_values) >= self.rv_baseline_steps:
                self.rv_baseline = sum(self._baseline_values) / len(self._baseline_values)
            return self._decision()
        if self.rv_baseline > 0 and x < self.rv_ratio * self.rv_baseline:
            self.rv_low_streak += 1
        else:
            self.rv_low_streak = 0
        if self.rv_low_streak >= self.rv_patience:
            self._stop(REASON_RV)
        return self._decision()

    def update_val(self, success_rate: float) -> EarlyStopDecision:
        """Call after each validation with its success rate in [0, 1]."""
        if not self.val_enabled:
            return self._decision()
        if float(success_rate) < self.val_threshold:
            self.val_low_streak += 1
        else:
            self.val_low_streak = 0
        if self.val_low_streak >= self.val_patience:
            self._stop(REASON_VAL)
        return self._decision()

    # ------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"baseline_values": list(self._baseline_values), "rv_baseline": self.rv_baseline,
                "rv_low_streak": self.rv_low_streak, "val_low_streak": self.val_low_streak,
                "stopped_reason": self.stopped_reason}

    def load_state_dict(self, state: dict) -> None:
        self._baseline_values = [float(v) for v in state["baseline_values"]]
        self.rv_baseline = state["rv_baseline"]
        self.rv_low_streak = int(state["rv_low_streak"])
        self.val_low_streak = int(state["val_low_streak"])
        self.stopped_reason = state["stopped_reason"]
