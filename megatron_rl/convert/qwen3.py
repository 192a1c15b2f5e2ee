"""Qwen3 (``Qwen3ForCausalLM``): per-head RMS norm of q and k (HF ``q_norm``/``k_norm`` ->
megatron ``q_layernorm``/``k_layernorm``), no attention bias, explicit ``head_dim``."""

from __future__ import annotations

from typing import Any, Mapping

from megatron_rl.convert.common import COPY, FC1, QKV, ConvertError, FamilyMapping, require
from megatron_rl.models.config import ModelConfig

ATTN = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")

MAPPING = FamilyMapping(
    family="qwen3", model_type="qwen3", architectures=("Qwen3ForCausalLM",),
    layer_tensors=(
        ("input_layernorm.weight", ("input_layernorm.weight",), COPY),
        ("self_attention.linear_qkv.weight", tuple(f"{p}.weight" for p in ATTN), QKV),
        ("self_attention.q_layernorm.weight", ("self_attn.q_norm.weight",), COPY),
        ("self_attention.k_layernorm.weight", ("self_attn.k_norm.weight",), COPY),
        ("self_attention.linear_proj.weight", ("self_attn.o_proj.weight",), COPY),
        ("pre_mlp_layernorm.weight", ("post_attention_layernorm.weight",), COPY),
        ("mlp.linear_fc1.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight"), FC1),
        ("mlp.linear_fc2.weight", ("mlp.down_proj.weight",), COPY),
    ))


def check_hf_config(hf: Mapping[str, Any]) -> None:
    """Reject Qwen3 features the megatron model does not implement."""
    arch = "Qwen3ForCausalLM"
    require(hf, "hidden_act", ("silu",), "silu", arch)
    require(hf, "use_sliding_window", (False, None), False, arch)
    # HF puts the bias on q/k/v *and* o_proj; megatron's add_qkv_bias covers q/k/v only.
    require(hf, "attention_bias", (False,), False, arch)


def check_model_config(cfg: ModelConfig) -> None:
    """The model config must describe a Qwen3 HF model (q/k norm, no bias)."""
    if cfg.qkv_bias or not cfg.qk_layernorm:
        raise ConvertError(f"Qwen3ForCausalLM needs attention_bias=False and qk_norm=True, got "
                           f"attention_bias={cfg.qkv_bias}, qk_norm={cfg.qk_layernorm}")


def hf_config(cfg: ModelConfig) -> dict[str, Any]:
    """Family-specific ``config.json`` fields."""
    return {"head_dim": cfg.kv_channels, "attention_bias": False, "use_sliding_window": False,
            "sliding_window": None, "max_window_layers": cfg.num_hidden_layers}
