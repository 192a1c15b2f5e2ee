"""Core attention on ``torch.nn.functional.scaled_dot_product_attention`` for megatron's local
layer spec (used whenever Transformer Engine is absent).

Megatron's local ``DotProductAttention`` materialises ``[B, heads, S, S]`` scores and, with
``masked_softmax_fusion``, needs a compiled extension the megatron-core wheel does not ship.
:class:`SDPAttention` takes the same constructor and ``forward`` arguments and calls PyTorch SDPA
instead: FlashAttention / memory-efficient kernels on GPU (O(S) memory, fp32 softmax statistics
inside the kernel), the fused CPU or math kernel on CPU. Causal masking comes from
``is_causal``; grouped-query attention from ``enable_gqa`` (no repeated K/V copies). Attention
dropout follows the config (0 for the actor).

Shapes: ``query [Sq, B, heads/TP, D]``, ``key``/``value [Sk, B, groups/TP, D]`` ->
``context [Sq, B, heads/TP * D]``, all on the inputs' device and dtype.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule


class SDPAttention(MegatronModule):
    """Drop-in ``core_attention`` for the local spec (see module docstring)."""

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType,
                 attention_type: str, attention_dropout: float | None = None,
                 softmax_scale: float | None = None, cp_comm_type: str | None = None,
                 pg_collection: Any = None, **_unused: Any) -> None:
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise NotImplementedError("SDPAttention: context parallelism is not supported")
        if getattr(config, "softmax_type", "vanilla") != "vanilla":
            raise NotImplementedError(f"SDPAttention: softmax_type={config.softmax_type!r}")
        if pg_collection is not None and hasattr(pg_collection, "tp"):
            tp = pg_collection.tp.size()
        else:
            from megatron.core import parallel_state as ps

            tp = ps.get_tensor_model_parallel_world_size()
        self.attn_mask_type = attn_mask_type
        self.heads = config.num_attention_heads // tp
        self.groups = (config.num_query_groups or config.num_attention_heads) // tp
        self.head_dim = config.kv_channels
        scale = 1.0 / math.sqrt(self.head_dim) if softmax_scale is None else softmax_scale
        self.softmax_scale = scale  # query-key layer scaling cancels out when softmax is fp32
        self.dropout = config.attention_dropout if attention_dropout is None else \
            attention_dropout

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, attn_mask_type: AttnMaskType | None
                = None, attention_bias: torch.Tensor | None = None,
                packed_seq_params: Any = None, **_unused: Any) -> torch.Tensor:
        """``[Sq, B, h, D]`` x ``[Sk, B, g, D]`` -> ``[Sq, B, h*D]``. ``attention_mask`` (bool,
        True = masked, broadcastable to ``[B, h, Sq, Sk]``) overrides the causal default."""
        if packed_seq_params is not None or attention_bias is not None:
            raise NotImplementedError("SDPAttention: packed sequences / attention bias need TE")
        sq, b = query.shape[0], query.shape[1]
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [B, h|g, S, D]
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        attn_mask = None
        causal = mask_type == AttnMaskType.causal
        if attention_mask is not None:
            attn_mask, causal = ~attention_mask.bool(), False
        gqa = self.heads != self.groups
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, dropout_p=self.dropout if self.training else 0.0,
            is_causal=causal, scale=self.softmax_scale, enable_gqa=gqa)
        return out.permute(2, 0, 1, 3).reshape(sq, b, self.heads * self.head_dim)


def masked_softmax_extension_available() -> bool:
    """megatron's compiled fused-softmax extension (never shipped in the megatron-core wheel)."""
    import importlib.util

    return torch.cuda.is_available() and importlib.util.find_spec(
        "scaled_masked_softmax_cuda") is not None


def use_sdpa_core_attention(spec) -> None:
    """Point the self-attention of a layer ``ModuleSpec`` at :class:`SDPAttention` (in place)."""
    spec.submodules.self_attention.submodules.core_attention = SDPAttention
