"""LoRA settings of the actor (``actor.lora`` in the config). Torch-free, so that loading a config
imports no torch. The adapters themselves are in :mod:`megatron_rl.models.lora`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

# megatron's tensor-parallel linears of a dense decoder layer: the attention's fused QKV
# (column-parallel) and output (row-parallel) projections, the MLP's fused gate/up
# (column-parallel) and down (row-parallel) projections.
LORA_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
# HF names accepted as aliases (q/k/v and gate/up are fused in megatron: one adapter each)
HF_ALIASES = {"q_proj": "linear_qkv", "k_proj": "linear_qkv", "v_proj": "linear_qkv",
              "o_proj": "linear_proj", "gate_proj": "linear_fc1", "up_proj": "linear_fc1",
              "down_proj": "linear_fc2"}


# how the rollout servers get the trained policy: "merged" weights W + (alpha/r)·B·A every sync,
# or "adapter": the base once, then only the adapters (SGLang's /load_lora_adapter)
LORA_SYNCS = ("merged", "adapter")


class LoraConfigError(ValueError):
    """An ``actor.lora`` field has an invalid value or cannot be combined with another option."""


@dataclass(frozen=True)
class LoraConfig:
    """Low-rank adapters ``W + (alpha/rank)·B·A`` on the decoder's linears; ``rank: 0`` = off."""

    rank: int = 0  # 0: no adapters (full fine-tuning)
    alpha: float = 16.0  # scaling = alpha / rank
    dropout: float = 0.0  # on the adapter's input, training passes only
    targets: list = field(default_factory=lambda: list(LORA_TARGETS))  # linear_qkv|proj|fc1|fc2
    sync: str = "merged"  # weight sync: merged full weights, or adapters only ([lora.md](lora.md))

    @property
    def enabled(self) -> bool:
        """Whether adapters are on (``rank >= 1``)."""
        return self.rank > 0

    @property
    def scaling(self) -> float:
        """``alpha / rank``: the factor of the low-rank product."""
        return self.alpha / self.rank if self.rank > 0 else 0.0

    @property
    def modules(self) -> tuple[str, ...]:
        """The megatron module names the adapters go on (aliases resolved), in canonical order."""
        want = {HF_ALIASES.get(t, t) for t in self.targets}
        return tuple(t for t in LORA_TARGETS if t in want)

    def __post_init__(self) -> None:
        if self.rank < 0:
            raise LoraConfigError(f"actor.lora.rank must be >= 1, got {self.rank}")
        if not self.alpha > 0:
            raise LoraConfigError(f"actor.lora.alpha must be > 0, got {self.alpha}")
        if not 0 <= self.dropout < 1:
            raise LoraConfigError(f"actor.lora.dropout must be in [0, 1), got {self.dropout}")
        allowed = LORA_TARGETS + tuple(HF_ALIASES)
        bad = [t for t in self.targets if t not in allowed]
        if bad:
            raise LoraConfigError(f"actor.lora.targets: unknown target(s) {bad}; allowed: "
                                  f"{list(LORA_TARGETS)} (or the HF names {list(HF_ALIASES)})")
        if not self.targets:
            raise LoraConfigError("actor.lora.targets is empty; allowed: "
                                  f"{list(LORA_TARGETS)}")
        if self.sync not in LORA_SYNCS:
            raise LoraConfigError(f"actor.lora.sync={self.sync!r} is not one of {LORA_SYNCS}")


def check_lora_rank(raw: Mapping[str, Any], lora: LoraConfig) -> None:
    """A rank given in ``actor.lora`` (``raw``: the merged config mapping) beside adapter
    settings of its own must be ``>= 1`` (rank 0, or leaving the section out, means no adapters).
    Raises :class:`LoraConfigError`."""
    actor_raw = raw.get("actor") if isinstance(raw.get("actor"), Mapping) else {}
    lora_raw = actor_raw.get("lora")
    if not isinstance(lora_raw, Mapping) or "rank" not in lora_raw or lora.enabled:
        return
    # a saved run's config.json lists the whole default section (rank 0 and default values):
    # that is "no adapters"; rank 0 beside any adapter setting of its own is a mistake
    default = LoraConfig()
    own = [k for k, v in lora_raw.items() if k != "rank" and hasattr(default, k)
           and _plain(getattr(default, k)) != _plain(v)]
    if own:
        raise LoraConfigError(f"actor.lora.rank must be >= 1, got {lora.rank} (remove the "
                              "actor.lora section to train all weights)")


def _plain(v: Any) -> Any:
    """A config value compared as plain data (tuples and lists alike)."""
    return list(v) if isinstance(v, (list, tuple)) else v


def lora_conflicts(cfg: Any, is_moe: bool = False) -> list[tuple[str, str]]:
    """``(option=value, reason)`` for every option set in ``cfg`` that LoRA does not support."""
    out = []
    m = cfg.model
    if is_moe:
        out.append(("a mixture-of-experts model", "adapters on routed experts are not supported "
                    "yet (dense models only)"))
    if getattr(m, "moe_grouped_gemm", False):
        out.append(("model.moe_grouped_gemm=true", "grouped-GEMM experts have no adapters"))
    if cfg.actor.offload_ref:
        out.append(("actor.offload_ref=true", "with LoRA the reference policy is the base model "
                    "itself (adapters off): there is no reference copy to offload; set "
                    "actor.offload_ref to null or false"))
    out += adapter_sync_conflicts(cfg)
    return out


def adapter_sync_conflicts(cfg: Any) -> list[tuple[str, str]]:
    """``(option=value, reason)`` for every option ``actor.lora.sync: adapter`` cannot run with."""
    if cfg.actor.lora.sync != "adapter":
        return []
    out = []
    why = ("actor.lora.sync=adapter loads the adapters into SGLang servers started with LoRA "
           "enabled (/load_lora_adapter)")
    if cfg.rollout.engine != "sglang":
        out.append((f"rollout.engine={cfg.rollout.engine}", why + "; the embedded engine takes "
                    "merged weights: set actor.lora.sync=merged or rollout.engine=sglang"))
    elif cfg.rollout.sglang.quantization:
        out.append((f"rollout.sglang.quantization={cfg.rollout.sglang.quantization}",
                    "FP8 rollouts quantise the merged weights; an adapter on an FP8 base is not "
                    "what the actor computes: set actor.lora.sync=merged"))
    return out
