"""The actor's settings (``actor:`` in the config): batching of the update and the numerical
guard. Torch-free, so that loading a config imports no torch."""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_rl.models.lora_config import LoraConfig

PRECISIONS = ("bf16", "fp16", "fp32")
RECOMPUTE = ("none", "selective", "full")
ROUTING_REPLAY_MODES = ("none", "r2", "r3")  # megatron_rl/actor/routing_replay.py


def validate_memory_fields(precision: str | None, recompute: str, offload_ref: bool | None,
                           error: type[Exception] = ValueError) -> None:
    """Raise ``error`` naming the field and its allowed values for a bad value."""
    if precision is not None and precision not in PRECISIONS:
        raise error(f"actor.precision={precision!r} is not one of {PRECISIONS} (or null for "
                    "bf16 with CUDA, fp32 on CPU)")
    if recompute not in RECOMPUTE:
        raise error(f"actor.recompute={recompute!r} is not one of {RECOMPUTE}")
    if offload_ref is not None and not isinstance(offload_ref, bool):
        raise error(f"actor.offload_ref={offload_ref!r} must be true, false or null")


class ActorConfigError(ValueError):
    """An actor config field has an invalid value."""


@dataclass(frozen=True)
class ActorConfig:
    """Batching of the update and the numerical guard."""

    micro_batch_size: int = 2  # sequences per micro-batch on one DP rank
    mini_batch_size: int = 0  # sequences per optimizer step, all DP ranks; 0 = the whole batch
    ppo_epochs: int = 1
    temperature: float = 1.0
    logprob_chunk_size: int | None = None
    max_consecutive_skips: int = 3
    fused_logprob_entropy: bool | None = None  # None: on when CUDA is available
    precision: str | None = None  # bf16 | fp16 | fp32; None: bf16 with CUDA, fp32 on CPU
    recompute: str = "none"  # none | selective | full (megatron activation recomputation)
    offload_ref: bool | None = None  # ref weights in pinned host RAM between passes; None: CUDA
    max_tokens_per_micro_batch: int = 0
    pack_sequences: bool = False  # one packed (THD) row per micro-batch (docs/packing.md)
    routing_replay: str = "none"  # none | r2 | r3: MoE expert routing replay (docs/moe.md)
    lora: LoraConfig = field(default_factory=LoraConfig)  # low-rank adapters (docs/lora.md)

    @property
    def use_fused_head(self) -> bool:
        """Whether the fused linear + log-prob + entropy head is used."""
        if self.fused_logprob_entropy is None:
            import torch

            return torch.cuda.is_available()
        return self.fused_logprob_entropy

    def __post_init__(self) -> None:
        for name in ("micro_batch_size", "ppo_epochs", "max_consecutive_skips"):
            if getattr(self, name) < 1:
                raise ActorConfigError(f"actor.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_tokens_per_micro_batch < 0:
            raise ActorConfigError(f"actor.max_tokens_per_micro_batch must be >= 0 (0 = row-count "
                                   f"micro-batches), got {self.max_tokens_per_micro_batch}")
        if self.mini_batch_size < 0:
            raise ActorConfigError(f"actor.mini_batch_size must be >= 0 (0 = whole batch), got "
                                   f"{self.mini_batch_size}")
        if self.routing_replay not in ROUTING_REPLAY_MODES:
            raise ActorConfigError(f"actor.routing_replay={self.routing_replay!r} is not one of "
                                   f"{ROUTING_REPLAY_MODES}")
        if self.routing_replay != "none":
            for name, bad in (("max_tokens_per_micro_batch", self.max_tokens_per_micro_batch),
                              ("pack_sequences", self.pack_sequences),
                              ("recompute", self.recompute == "full")):
                if bad:
                    raise ActorConfigError(
                        f"actor.routing_replay={self.routing_replay!r} works with padded "
                        f"row micro-batches without full recomputation; actor.{name}="
                        f"{getattr(self, name)!r} is not supported with it (set "
                        "actor.max_tokens_per_micro_batch=0, actor.pack_sequences=false, "
                        "actor.recompute none|selective, or actor.routing_replay=none)")
        if not self.temperature > 0:
            raise ActorConfigError(f"actor.temperature must be > 0, got {self.temperature}")
        validate_memory_fields(self.precision, self.recompute, self.offload_ref, ActorConfigError)
