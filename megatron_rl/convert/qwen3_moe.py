"""Qwen3-MoE (``Qwen3MoeForCausalLM``): Qwen3 attention (q/k norm, no bias) with a mixture of
experts in every layer: router ``mlp.gate`` ``[E, H]`` -> megatron ``mlp.router``, expert ``e``'s
``gate_proj``/``up_proj``/``down_proj`` -> ``mlp.experts.local_experts.e.linear_fc1`` (``[gate;
up]``)/``linear_fc2`` with the global expert id ``e``. No shared experts."""

from __future__ import annotations

import re
from typing import Any, Mapping

import torch

from megatron_rl.convert import qwen3
from megatron_rl.convert.common import COPY, FC1, ConvertError, FamilyMapping, require
from megatron_rl.models.config import ModelConfig

ARCH = "Qwen3MoeForCausalLM"

MAPPING = FamilyMapping(
    family="qwen3_moe", model_type="qwen3_moe", architectures=(ARCH,),
    layer_tensors=tuple(row for row in qwen3.MAPPING.layer_tensors
                        if not row[0].startswith("mlp.")) + (
        ("mlp.router.weight", ("mlp.gate.weight",), COPY),),
    expert_tensors=(
        ("linear_fc1.weight", ("gate_proj.weight", "up_proj.weight"), FC1),
        ("linear_fc2.weight", ("down_proj.weight",), COPY),
    ))


def num_experts_of(hf: Mapping[str, Any]) -> int | None:
    """``num_experts`` (transformers 4.x) or ``num_local_experts`` (5.x) of a config dict."""
    return hf.get("num_experts") or hf.get("num_local_experts")


def check_hf_config(hf: Mapping[str, Any]) -> None:
    """Reject Qwen3-MoE features the megatron model does not implement."""
    qwen3.check_hf_config(hf)
    if not num_experts_of(hf):
        raise ConvertError(f"{ARCH}: config.json has no num_experts (or num_local_experts)")
    # Dense layers between MoE layers (mlp_only_layers, decoder_sparse_step > 1) are not built.
    require(hf, "decoder_sparse_step", (1,), 1, ARCH)
    require(hf, "mlp_only_layers", ([], None), [], ARCH)
    require(hf, "shared_expert_intermediate_size", (0, None), None, ARCH)


def check_model_config(cfg: ModelConfig) -> None:
    """The model config must describe a Qwen3-MoE HF model (q/k norm, no bias, experts)."""
    if cfg.qkv_bias or not cfg.qk_layernorm or not cfg.is_moe:
        raise ConvertError(f"{ARCH} needs attention_bias=False, qk_norm=True and num_experts > 0, "
                           f"got attention_bias={cfg.qkv_bias}, qk_norm={cfg.qk_layernorm}, "
                           f"num_experts={cfg.num_experts}")


def hf_config(cfg: ModelConfig) -> dict[str, Any]:
    """Family-specific ``config.json`` fields (both transformers 4.x and 5.x names)."""
    out = qwen3.hf_config(cfg)
    out.update({"num_experts": cfg.num_experts, "num_local_experts": cfg.num_experts,
                "num_experts_per_tok": cfg.num_experts_per_tok,
                "moe_intermediate_size": cfg.moe_intermediate_size,
                "norm_topk_prob": cfg.norm_topk_prob, "decoder_sparse_step": 1,
                "mlp_only_layers": [], "router_aux_loss_coef": cfg.moe_aux_loss_coeff,
                "output_router_logits": False})
    return out


_EXPERT_HF = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def fused_expert_view(params: Mapping[str, torch.Tensor], name: str) -> torch.Tensor | None:
    """The slice of a transformers >= 5 in-memory Qwen3-MoE model that holds checkpoint tensor
    ``name`` (``...mlp.experts.E.gate_proj.weight``): transformers 5 fuses the experts into
    ``mlp.experts.gate_up_proj [E, 2I, H]`` (gate rows first) and ``mlp.experts.down_proj
    [E, H, I]``. None when ``name`` is not an expert tensor or the model keeps per-expert
    modules."""
    m = _EXPERT_HF.match(name)
    if m is None:
        return None
    prefix, e, proj = m.group(1), int(m.group(2)), m.group(3)
    if proj == "down_proj":
        fused = params.get(f"{prefix}.down_proj")
        return None if fused is None else fused[e]
    fused = params.get(f"{prefix}.gate_up_proj")
    if fused is None:
        return None
    gate, up = fused[e].chunk(2, dim=0)
    return gate if proj == "gate_proj" else up


def per_expert_names(params: Mapping[str, torch.Tensor]) -> dict[str, list[str]]:
    """Fused expert parameter name -> the checkpoint tensor names it holds."""
    out: dict[str, list[str]] = {}
    for name, p in params.items():
        for fused, projs in (("gate_up_proj", ("gate_proj", "up_proj")),
                             ("down_proj", ("down_proj",))):
            if name.endswith(f".mlp.experts.{fused}"):
                prefix = name[: -len(fused) - 1]
                out[name] = [f"{prefix}.{e}.{proj}.weight" for e in range(p.shape[0])
                             for proj in projs]
    return out


def checkpoint_named_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """An in-memory transformers model's parameters by checkpoint names: besides the others, one
    tensor per MoE expert (a view into the fused expert tensors; writing it writes the model)."""
    params = dict(model.named_parameters())
    for parts in per_expert_names(params).values():
        params.update((n, fused_expert_view(params, n)) for n in parts)
    return params
