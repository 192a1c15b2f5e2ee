"""Llama (``LlamaForCausalLM``): no bias anywhere, optional tied embeddings, default RoPE only."""

from __future__ import annotations

from typing import Any, Mapping

from megatron_rl.convert.common import COPY, FC1, QKV, ConvertError, FamilyMapping, require
from megatron_rl.models.config import ModelConfig

ATTN = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")

MAPPING = FamilyMapping(
    family="llama", model_type="llama", architectures=("LlamaForCausalLM",),
    layer_tensors=(
        ("input_layernorm.weight", ("input_layernorm.weight",), COPY),
        ("self_attention.linear_qkv.weight", tuple(f"{p}.weight" for p in ATTN), QKV),
        ("self_attention.linear_proj.weight", ("self_attn.o_proj.weight",), COPY),
        ("pre_mlp_layernorm.weight", ("post_attention_layernorm.weight",), COPY),
        ("mlp.linear_fc1.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight"), FC1),
        ("mlp.linear_fc2.weight", ("mlp.down_proj.weight",), COPY),
    ))


def check_hf_config(hf: Mapping[str, Any]) -> None:
    """Reject Llama features the megatron model does not implement."""
    arch = "LlamaForCausalLM"
    require(hf, "hidden_act", ("silu",), "silu", arch)
    # attention_bias puts a bias on o_proj too, mlp_bias on all three MLP projections.
    require(hf, "attention_bias", (False,), False, arch)
    require(hf, "mlp_bias", (False,), False, arch)
    require(hf, "pretraining_tp", (1, None), 1, arch)


def check_model_config(cfg: ModelConfig) -> None:
    """The model config must describe a Llama HF model (no bias, no q/k norm)."""
    if cfg.qkv_bias or cfg.qk_layernorm:
        raise ConvertError(f"LlamaForCausalLM needs attention_bias=False and qk_norm=False, got "
                           f"attention_bias={cfg.qkv_bias}, qk_norm={cfg.qk_layernorm}")


def hf_config(cfg: ModelConfig) -> dict[str, Any]:
    """Family-specific ``config.json`` fields."""
    return {"head_dim": cfg.kv_channels, "attention_bias": False, "mlp_bias": False,
            "pretraining_tp": 1}
