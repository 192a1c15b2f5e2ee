"""Qwen2 / Qwen2.5 (``Qwen2ForCausalLM``): q/k/v projections carry a bias, o_proj does not."""

from __future__ import annotations

from typing import Any, Mapping

from megatron_rl.convert.common import COPY, FC1, QKV, ConvertError, FamilyMapping, require
from megatron_rl.models.config import ModelConfig

ATTN = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")

MAPPING = FamilyMapping(
    family="qwen2", model_type="qwen2", architectures=("Qwen2ForCausalLM",),
    layer_tensors=(
        ("input_layernorm.weight", ("input_layernorm.weight",), COPY),
        ("self_attention.linear_qkv.weight", tuple(f"{p}.weight" for p in ATTN), QKV),
        ("self_attention.linear_qkv.bias", tuple(f"{p}.bias" for p in ATTN), QKV),
        ("self_attention.linear_proj.weight", ("self_attn.o_proj.weight",), COPY),
        ("pre_mlp_layernorm.weight", ("post_attention_layernorm.weight",), COPY),
        ("mlp.linear_fc1.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight"), FC1),
        ("mlp.linear_fc2.weight", ("mlp.down_proj.weight",), COPY),
    ))


def check_hf_config(hf: Mapping[str, Any]) -> None:
    """Reject Qwen2 features the megatron model does not implement."""
    arch = "Qwen2ForCausalLM"
    require(hf, "hidden_act", ("silu",), "silu", arch)
    require(hf, "use_sliding_window", (False, None), False, arch)
    if hf.get("head_dim") not in (None, hf["hidden_size"] // hf["num_attention_heads"]):
        raise ConvertError(f"{arch}: head_dim={hf['head_dim']} must equal hidden_size / "
                           "num_attention_heads for Qwen2")


def check_model_config(cfg: ModelConfig) -> None:
    """The model config must describe a Qwen2 HF model (q/k/v bias, no q/k norm)."""
    if not cfg.qkv_bias or cfg.qk_layernorm:
        raise ConvertError(f"Qwen2ForCausalLM needs attention_bias=True and qk_norm=False, got "
                           f"attention_bias={cfg.qkv_bias}, qk_norm={cfg.qk_layernorm}")
    if cfg.kv_channels * cfg.num_attention_heads != cfg.hidden_size:
        raise ConvertError(f"Qwen2ForCausalLM needs head_dim = hidden_size / num_attention_heads, "
                           f"got head_dim={cfg.kv_channels}")


def hf_config(cfg: ModelConfig) -> dict[str, Any]:
    """Family-specific ``config.json`` fields."""
    return {"use_sliding_window": False, "sliding_window": None,
            "max_window_layers": cfg.num_hidden_layers}
