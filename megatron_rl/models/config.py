"""Model architecture configs for the supported families (Qwen2/Qwen2.5, Qwen3, Qwen3-MoE, Llama).

:class:`ModelConfig` is the one description of an architecture that the builder, the weight
resharding code and the HF conversion share. It maps 1:1 onto Hugging Face ``config.json`` fields
(:meth:`ModelConfig.from_hf_dict`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

FAMILIES = ("qwen2", "qwen3", "qwen3_moe", "llama")
MOE_FAMILIES = ("qwen3_moe",)


class ModelConfigError(ValueError):
    """A model config field has an invalid value."""


@dataclass(frozen=True)
class ModelConfig:
    """Decoder-only transformer shape. Field names follow Hugging Face where one exists."""

    family: str = "qwen2"
    vocab_size: int = 256
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    max_position_embeddings: int = 512
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool | None = None  # None: family default (qwen2: True, others: False)
    qk_norm: bool | None = None  # None: family default (qwen3: True, others: False)
    init_method_std: float = 0.02
    # Mixture of experts (family qwen3_moe; docs/moe.md). Every decoder layer is an MoE layer.
    num_experts: int = 0  # routed experts per layer (0: dense MLP)
    num_experts_per_tok: int = 0  # top-k experts per token
    moe_intermediate_size: int = 0  # FFN size of one expert
    norm_topk_prob: bool = True  # renormalise the top-k router probabilities to sum to 1
    moe_aux_loss_coeff: float = 0.0  # load-balancing loss coefficient (RL default: off)
    moe_z_loss_coeff: float = 0.0  # router z-loss coefficient (RL default: off)
    # Experts as Transformer Engine grouped GEMMs (megatron-core TEGroupedMLP) instead of one MLP
    # per expert (SequentialMLP); same canonical weights (models/weights.py). Needs TE + CUDA.
    moe_grouped_gemm: bool = False

    def __post_init__(self) -> None:
        validate_model_config(self)

    @property
    def kv_channels(self) -> int:
        """Per-head dimension."""
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def qkv_bias(self) -> bool:
        """Whether q/k/v projections carry a bias (Qwen2 family)."""
        return self.family == "qwen2" if self.attention_bias is None else self.attention_bias

    @property
    def qk_layernorm(self) -> bool:
        """Whether q and k are RMS-normalised per head (Qwen3 family)."""
        return self.family in ("qwen3", "qwen3_moe") if self.qk_norm is None else self.qk_norm

    @property
    def is_moe(self) -> bool:
        """Whether the MLP of every layer is a mixture of experts."""
        return self.num_experts > 0

    def replace(self, **changes: Any) -> ModelConfig:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_hf_dict(cls, hf: Mapping[str, Any]) -> ModelConfig:
        """Build from a Hugging Face ``config.json`` dict (Qwen2ForCausalLM, Qwen3ForCausalLM,
        LlamaForCausalLM)."""
        model_type = hf.get("model_type")
        family = {"qwen2": "qwen2", "qwen3": "qwen3", "qwen3_moe": "qwen3_moe",
                  "llama": "llama"}.get(model_type)
        if family is None:
            raise ModelConfigError(
                f"model_type={model_type!r} is not supported (supported: {', '.join(FAMILIES)})")
        heads = hf["num_attention_heads"]
        moe: dict[str, Any] = {}
        if family in MOE_FAMILIES:
            # The router's aux-loss coefficient of config.json is the pre-training value; RL keeps
            # its own default (model.moe_aux_loss_coeff, docs/moe.md).
            # transformers 5 writes num_local_experts, 4.x num_experts
            moe = dict(num_experts=int(hf.get("num_experts") or hf["num_local_experts"]),
                       num_experts_per_tok=int(hf["num_experts_per_tok"]),
                       moe_intermediate_size=int(hf["moe_intermediate_size"]),
                       norm_topk_prob=bool(hf.get("norm_topk_prob", True)))
        return cls(
            family=family, vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_hidden_layers=hf["num_hidden_layers"], num_attention_heads=heads,
            num_key_value_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim"),
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            # transformers >= 5 nests rope_theta in rope_parameters
            rope_theta=float(hf.get("rope_theta") or (hf.get("rope_parameters") or {}).get(
                "rope_theta", 10000.0)),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=hf.get("attention_bias", family == "qwen2"),
            qk_norm=family in ("qwen3", "qwen3_moe"), **moe)


def validate_model_config(cfg: ModelConfig) -> None:
    """Raise :class:`ModelConfigError` naming the field and the allowed values."""
    if cfg.family not in FAMILIES:
        raise ModelConfigError(f"model.family={cfg.family!r} is not one of {FAMILIES}")
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "num_key_value_heads", "max_position_embeddings"):
        val = getattr(cfg, name)
        if not isinstance(val, int) or val < 1:
            raise ModelConfigError(f"model.{name} must be a positive integer, got {val!r}")
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        raise ModelConfigError(
            f"model.num_attention_heads ({cfg.num_attention_heads}) must be a multiple of "
            f"model.num_key_value_heads ({cfg.num_key_value_heads})")
    if cfg.head_dim is None and cfg.hidden_size % cfg.num_attention_heads:
        raise ModelConfigError(
            f"model.hidden_size ({cfg.hidden_size}) must be divisible by "
            f"model.num_attention_heads ({cfg.num_attention_heads}) when head_dim is unset")
    if cfg.rope_theta <= 0 or cfg.rms_norm_eps <= 0:
        raise ModelConfigError("model.rope_theta and model.rms_norm_eps must be > 0")
    _validate_moe(cfg)


def _validate_moe(cfg: ModelConfig) -> None:
    moe_family = cfg.family in MOE_FAMILIES
    if cfg.moe_grouped_gemm and not moe_family:
        raise ModelConfigError(
            f"model.moe_grouped_gemm=true needs a mixture-of-experts model (model.family in "
            f"{MOE_FAMILIES}); this one is {cfg.family!r}: set model.moe_grouped_gemm=false")
    if moe_family != (cfg.num_experts > 0):
        raise ModelConfigError(
            f"model.num_experts={cfg.num_experts} does not fit model.family={cfg.family!r}: "
            f"families {MOE_FAMILIES} need num_experts >= 1, the others num_experts=0")
    if not moe_family:
        return
    for name in ("num_experts_per_tok", "moe_intermediate_size"):
        val = getattr(cfg, name)
        if not isinstance(val, int) or val < 1:
            raise ModelConfigError(f"model.{name} must be a positive integer, got {val!r}")
    if cfg.num_experts_per_tok > cfg.num_experts:
        raise ModelConfigError(
            f"model.num_experts_per_tok={cfg.num_experts_per_tok} must be <= "
            f"model.num_experts={cfg.num_experts}")
    for name in ("moe_aux_loss_coeff", "moe_z_loss_coeff"):
        val = getattr(cfg, name)
        if not isinstance(val, (int, float)) or val < 0:
            raise ModelConfigError(f"model.{name} must be a number >= 0, got {val!r}")


def validate_for_layout(cfg: ModelConfig, tp: int, pp: int, ep: int = 1) -> None:
    """Check that the model can be split ``tp`` ways in tensors, ``pp`` ways in layers and
    ``ep`` ways in experts."""
    checks = (("vocab_size", cfg.vocab_size, tp), ("num_attention_heads", cfg.num_attention_heads,
              tp), ("num_key_value_heads", cfg.num_key_value_heads, tp),
              ("intermediate_size", cfg.intermediate_size, tp))
    for name, val, div in checks:
        if val % div:
            raise ModelConfigError(
                f"model.{name}={val} is not divisible by tensor_parallel_size={tp}; choose a "
                f"tensor_parallel_size that divides it")
    if cfg.num_hidden_layers % pp:
        raise ModelConfigError(
            f"model.num_hidden_layers={cfg.num_hidden_layers} is not divisible by "
            f"pipeline_parallel_size={pp}")
    if not cfg.is_moe:
        if ep != 1:
            raise ModelConfigError(
                f"expert_parallel_size={ep} needs a mixture-of-experts model (model.family in "
                f"{MOE_FAMILIES}); a dense model takes expert_parallel_size=1")
        return
    if cfg.num_experts % ep:
        raise ModelConfigError(
            f"model.num_experts={cfg.num_experts} is not divisible by expert_parallel_size={ep}; "
            "choose an expert_parallel_size that divides it")
    if tp > 1 and ep == 1:
        raise ModelConfigError(
            f"tensor_parallel_size={tp} with a mixture-of-experts model needs "
            f"expert_parallel_size >= 2 (got {ep}): each TP rank routes its slice of the "
            "sequence, and at EP 1 megatron-core would reduce the experts' gradients over DP "
            "only (allowed: tensor_parallel_size=1, or an expert_parallel_size >= 2 that "
            "divides num_experts and tp x dp, docs/moe.md)")


PRESETS: dict[str, ModelConfig] = {
    # 4 KV groups so that TP=4 splits attention; 4 layers so that PP=2 and PP=4 split the stack.
    "tiny": ModelConfig(family="qwen2", vocab_size=256, hidden_size=128, intermediate_size=256,
                        num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                        max_position_embeddings=512, init_method_std=0.1),
    "tiny-qwen3": ModelConfig(family="qwen3", vocab_size=256, hidden_size=64,
                              intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                              init_method_std=0.1),
    "tiny-llama": ModelConfig(family="llama", vocab_size=256, hidden_size=64,
                              intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                              num_key_value_heads=2, max_position_embeddings=512,
                              rms_norm_eps=1e-5, tie_word_embeddings=True, init_method_std=0.1),
    # 8 experts, top-2: EP 1/2/4/8 split them; 4 layers so that PP=2 splits the stack.
    "tiny-qwen3-moe": ModelConfig(family="qwen3_moe", vocab_size=256, hidden_size=64,
                                  intermediate_size=128, num_hidden_layers=4,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                  max_position_embeddings=512, init_method_std=0.1,
                                  num_experts=8, num_experts_per_tok=2,
                                  moe_intermediate_size=32),
    # Real shapes (weights come from a converted checkpoint).
    "qwen2.5-0.5b": ModelConfig(family="qwen2", vocab_size=151936, hidden_size=896,
                                intermediate_size=4864, num_hidden_layers=24,
                                num_attention_heads=14, num_key_value_heads=2,
                                max_position_embeddings=32768, rope_theta=1000000.0,
                                tie_word_embeddings=True),
    "qwen2.5-1.5b": ModelConfig(family="qwen2", vocab_size=151936, hidden_size=1536,
                                intermediate_size=8960, num_hidden_layers=28,
                                num_attention_heads=12, num_key_value_heads=2,
                                max_position_embeddings=32768, rope_theta=1000000.0,
                                tie_word_embeddings=True),
    "qwen2.5-7b": ModelConfig(family="qwen2", vocab_size=152064, hidden_size=3584,
                              intermediate_size=18944, num_hidden_layers=28,
                              num_attention_heads=28, num_key_value_heads=4,
                              max_position_embeddings=32768, rope_theta=1000000.0),
    "qwen2.5-32b": ModelConfig(family="qwen2", vocab_size=152064, hidden_size=5120,
                               intermediate_size=27648, num_hidden_layers=64,
                               num_attention_heads=40, num_key_value_heads=8,
                               max_position_embeddings=32768, rope_theta=1000000.0,
                               rms_norm_eps=1e-5),
    # Qwen/Qwen3-8B's config.json (Qwen3ForCausalLM): 8.2B parameters, native context 40960
    "qwen3-8b": ModelConfig(family="qwen3", vocab_size=151936, hidden_size=4096,
                            intermediate_size=12288, num_hidden_layers=36,
                            num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                            max_position_embeddings=40960, rope_theta=1000000.0,
                            rms_norm_eps=1e-6),
    # Qwen/Qwen3-30B-A3B's config.json (Qwen3MoeForCausalLM, transformers 4.51): 30.5B parameters,
    # 3.3B active per token (the model card's numbers; `plan` prints both).
    "qwen3-30b-a3b": ModelConfig(family="qwen3_moe", vocab_size=151936, hidden_size=2048,
                                 intermediate_size=6144, num_hidden_layers=48,
                                 num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                                 max_position_embeddings=40960, rope_theta=1000000.0,
                                 rms_norm_eps=1e-6, num_experts=128, num_experts_per_tok=8,
                                 moe_intermediate_size=768, norm_topk_prob=True),
}


def get_preset(name: str) -> ModelConfig:
    """Return a named preset; the error lists the known names."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ModelConfigError(
            f"model preset {name!r} is unknown (known: {', '.join(sorted(PRESETS))})") from None
