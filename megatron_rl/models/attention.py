"""Core attention on ``torch.nn.functional.scaled_dot_product_attention`` for megatron's local
layer spec (used whenever Transformer Engine is absent).

Megatron's local ``DotProductAttention`` materialises ``[B, heads, S, S]`` scores and, with
``masked_softmax_fusion``, needs a compiled extension the megatron-core wheel does not ship.
:class:`SDPAttention` takes the same constructor and ``forward`` arguments and calls PyTorch SDPA
instead: FlashAttention / memory-efficient kernels on GPU (O(S) memory, fp32 softmax statistics
inside the kernel). Causal masking comes from ``is_causal``; grouped-query attention from
``enable_gqa`` (no repeated K/V copies). Attention dropout follows the config (0 for the actor).

On CPU tensors (tests, tiny CPU runs) the module computes attention in megatron's own operation
order (``baddbmm`` scores, fp32 softmax, ``bmm``), bit-identical to ``DotProductAttention``, so
CPU results and seeded CPU training trajectories do not depend on which attention is built;
``use_sdpa_on_cpu = True`` runs the SDPA kernel there too (the tests compare the two).

Packed rows (megatron-core ``PackedSeqParams`` with ``qkv_format='thd'``, see
:mod:`megatron_rl.actor.packing`): ``query [T, heads/TP, D]`` -> ``[T, heads/TP * D]``, causal
within each ``cu_seqlens`` segment and never across (:meth:`SDPAttention._packed`).

Context parallelism (``parallel.cp`` > 1, padded rows): each rank holds two chunks of every row;
:meth:`SDPAttention._cp` all-gathers K/V over the CP group (backward: reduce-scatter of dK/dV)
and masks causally on global positions -- exact, on CPU/gloo and CUDA/NCCL alike. With
Transformer Engine, megatron's ``TEDotProductAttention`` runs TE's own CP attention with
``cp_comm_type`` ``"p2p"`` (ring exchange of K/V, overlapped with compute; set in
:func:`megatron_rl.models.builder.make_transformer_config`).

Shapes: ``query [Sq, B, heads/TP, D]``, ``key``/``value [Sk, B, groups/TP, D]`` ->
``context [Sq, B, heads/TP * D]``, all on the inputs' device and dtype.
"""

from __future__ import annotations

import functools
import inspect
import math
from typing import Any, Callable

import torch
import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule

try:  # FlashAttention's variable-length kernel (torch >= 2.9, CUDA)
    from torch.nn.attention.varlen import varlen_attn as _varlen_attn
except ImportError:  # pragma: no cover - older torch
    _varlen_attn = None


@functools.cache
def varlen_keywords(fn: Callable) -> frozenset[str]:
    """Names ``fn`` accepts as keywords (its signature, inspected once per function)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # no introspectable signature: pass no keyword
        return frozenset()
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return frozenset(p.name for p in params if p.kind in kinds)


def varlen_call_kwargs(fn: Callable, scale: float, gqa: bool) -> dict[str, Any] | None:
    """Keywords of a causal ``varlen_attn`` call at ``scale`` (grouped-query when ``gqa``), or
    None when ``fn`` does not take them all: torch 2.9's ``varlen_attn`` has ``is_causal`` and
    no ``scale``/``window_size``, 2.10 and 2.11 have no ``enable_gqa`` (2.12 has all three).
    ``window_size=(-1, 0)``: every earlier token, none later (causal)."""
    kwargs: dict[str, Any] = {"scale": scale, "window_size": (-1, 0)}
    if gqa:
        kwargs["enable_gqa"] = True
    return kwargs if kwargs.keys() <= varlen_keywords(fn) else None


# CPU packed rows of short sequences (mean length <= PACKED_MASK_MEAN_LEN, at most
# PACKED_MASK_MAX_TOKENS tokens) use one document-causal mask: the per-sequence loop's Python
# overhead dominates there (64 sequences of ~10 tokens: the loop 1.45x the padded step time, the
# mask 1.3x); longer sequences use the loop (4 sequences of ~200 tokens: the mask 1.5x the loop's
# time, and its [heads, T, T] scores grow quadratically). tools/bench_packing.py measures both.
PACKED_MASK_MEAN_LEN = 64
PACKED_MASK_MAX_TOKENS = 4096


class SDPAttention(MegatronModule):
    """Drop-in ``core_attention`` for the local spec (see module docstring)."""

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType,
                 attention_type: str, attention_dropout: float | None = None,
                 softmax_scale: float | None = None, cp_comm_type: str | None = None,
                 pg_collection: Any = None, **_unused: Any) -> None:
        super().__init__(config=config)
        self.cp_group = None  # context parallelism: K/V gathered over this group (see _cp)
        if config.context_parallel_size != 1:
            self.cp_group = getattr(pg_collection, "cp", None)
            if self.cp_group is None:
                from megatron.core import parallel_state as ps

                self.cp_group = ps.get_context_parallel_group()
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
        self.use_sdpa_on_cpu = False
        self.packed_cpu_mode = "auto"  # auto | segments | mask (exact either way; see _packed)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, attn_mask_type: AttnMaskType | None
                = None, attention_bias: torch.Tensor | None = None,
                packed_seq_params: Any = None, **_unused: Any) -> torch.Tensor:
        """``[Sq, B, h, D]`` x ``[Sk, B, g, D]`` -> ``[Sq, B, h*D]``. ``attention_mask`` (bool,
        True = masked, broadcastable to ``[B, h, Sq, Sk]``) overrides the causal default."""
        if attention_bias is not None:
            raise NotImplementedError("SDPAttention: attention bias needs TE")
        if packed_seq_params is not None:
            if self.cp_group is not None:
                return self._packed_cp(query, key, value, packed_seq_params)
            return self._packed(query, key, value, packed_seq_params)
        if self.cp_group is not None:
            return self._cp(query, key, value, attention_mask)
        sq, b = query.shape[0], query.shape[1]
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [B, h|g, S, D]
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        attn_mask = None
        causal = mask_type == AttnMaskType.causal
        if attention_mask is not None:
            attn_mask, causal = ~attention_mask.bool(), False
        gqa = self.heads != self.groups
        if not q.is_cuda and not self.use_sdpa_on_cpu:
            return self._megatron_order(q, k, v, attn_mask, causal)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, dropout_p=self.dropout if self.training else 0.0,
            is_causal=causal, scale=self.softmax_scale, enable_gqa=gqa)
        return out.permute(2, 0, 1, 3).reshape(sq, b, self.heads * self.head_dim)

    def _packed(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                params: Any) -> torch.Tensor:
        """Packed (THD) rows: ``[T, h, D]`` x ``[T, g, D]`` -> ``[T, h*D]``, causal within each
        ``cu_seqlens`` segment, nothing across segments.

        CUDA, fp16/bf16, no dropout: ``torch.nn.attention.varlen.varlen_attn`` (FlashAttention's
        variable-length kernel) where the installed torch's takes ``scale``, ``window_size`` and,
        for GQA, ``enable_gqa`` (:func:`varlen_call_kwargs`). Otherwise one causal attention per
        segment (SDPA on CUDA). On CPU in megatron's operation order: per segment
        (``packed_cpu_mode = "segments"``) or with one ``[T, T]`` document-causal mask
        (``"mask"``; no per-segment Python loop, ``[h, T, T]`` scores); ``"auto"`` takes the mask
        for short sequences (:data:`PACKED_MASK_MEAN_LEN`).
        """
        if getattr(params, "qkv_format", "thd") != "thd":
            raise NotImplementedError(f"SDPAttention: qkv_format={params.qkv_format!r} "
                                      "(allowed: 'thd')")
        cu_q, cu_k = params.cu_seqlens_q, params.cu_seqlens_kv
        host = getattr(params, "host_cu_seqlens", None)  # the RoPE's host copy (packing.py)
        padded = (getattr(params, "cu_seqlens_q_padded", None),
                  getattr(params, "cu_seqlens_kv_padded", None))
        if (any(c is not None and c is not host for c in padded)
                or (cu_k is not cu_q and not torch.equal(cu_q, cu_k))):
            raise NotImplementedError("SDPAttention: packed rows need cu_seqlens_q == "
                                      "cu_seqlens_kv and no padded cu_seqlens")
        t = query.shape[0]
        gqa = self.heads != self.groups
        drop = self.dropout if self.training else 0.0
        varlen_kwargs = None
        if _varlen_attn is not None and self._varlen_eligible(query, drop):
            varlen_kwargs = varlen_call_kwargs(_varlen_attn, self.softmax_scale, gqa)
        if varlen_kwargs is not None:
            cu = cu_q.to(torch.int32)
            query, key, value = (x.contiguous() for x in (query, key, value))
            out = _varlen_attn(query, key, value, cu, cu, int(params.max_seqlen_q),
                               int(params.max_seqlen_kv), **varlen_kwargs)
            return out.reshape(t, self.heads * self.head_dim)
        seqlens = getattr(params, "seqlens", None) or tuple(
            int(n) for n in (cu_q[1:] - cu_q[:-1]).tolist() if n > 0)
        q, k, v = (x.unsqueeze(0).transpose(1, 2) for x in (query, key, value))  # [1, h|g, T, D]
        mode = self.packed_cpu_mode
        if mode == "auto":  # measured (tools/bench_packing.py): the mask wins for short rows
            short = t <= PACKED_MASK_MEAN_LEN * len(seqlens)
            mode = "mask" if short and t <= PACKED_MASK_MAX_TOKENS else "segments"
        if not q.is_cuda and not self.use_sdpa_on_cpu and mode == "mask":
            seg = torch.repeat_interleave(torch.arange(len(seqlens), device=q.device),
                                          torch.tensor(seqlens, device=q.device))
            keep = (seg[:, None] == seg[None, :]) & torch.ones(
                t, t, dtype=torch.bool, device=q.device).tril()
            return self._megatron_order(q, k, v, keep, False).reshape(t, -1)
        outs, start = [], 0
        for n in seqlens:
            s = slice(start, start + n)
            start += n
            qs, ks, vs = q[:, :, s], k[:, :, s], v[:, :, s]
            if not q.is_cuda and not self.use_sdpa_on_cpu:
                outs.append(self._megatron_order(qs, ks, vs, None, True).reshape(n, -1))
            else:
                o = F.scaled_dot_product_attention(qs, ks, vs, dropout_p=drop, is_causal=True,
                                                   scale=self.softmax_scale, enable_gqa=gqa)
                outs.append(o[0].transpose(0, 1).reshape(n, -1))
        return torch.cat(outs) if outs else query.new_zeros(0, self.heads * self.head_dim)

    def _cp(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
            attention_mask: torch.Tensor | None) -> torch.Tensor:
        """Context-parallel causal attention, exact: this CP rank's queries ``[S_loc, B, h, D]``
        (chunks ``r`` and ``2 CP - 1 - r`` of the row, :mod:`megatron_rl.parallel.
        context_parallel`) against every key/value of the row, all-gathered over the CP group
        into global order ``[S_loc * CP, B, g, D]`` (backward: a reduce-scatter of dK/dV), with
        the causal mask on global positions. Returns ``[S_loc, B, h*D]``; scores
        ``[B, h, S_loc, S_loc * CP]`` (1/CP of the unsplit ones)."""
        from megatron_rl.parallel.context_parallel import gather_sequence, local_positions

        if attention_mask is not None:
            raise NotImplementedError("SDPAttention: an explicit attention_mask with context "
                                      "parallelism (only causal rows are split)")
        cp = torch.distributed.get_world_size(self.cp_group)
        rank = torch.distributed.get_rank(self.cp_group)
        key, value = gather_sequence(key, self.cp_group), gather_sequence(value, self.cp_group)
        pos_q = local_positions(query.shape[0] * cp, cp, rank, query.device)
        return self.global_causal(query, key, value, pos_q)

    def _packed_cp(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   params: Any) -> torch.Tensor:
        """Packed (THD) rows under context parallelism, exact: every segment (length a multiple
        of ``2 CP``, ``params.seqlens``) is split as one row is (chunks ``r`` and ``2 CP - 1 - r``
        on rank ``r``); this rank's queries ``[T/CP, h, D]`` attend to all keys/values of the
        packed row, all-gathered over the CP group into packed order ``[T, g, D]``, causal within
        each segment on packed positions. Returns ``[T/CP, h*D]``."""
        from megatron_rl.parallel.context_parallel import (
            gather_sequence,
            local_positions,
            packed_gathered_order,
        )

        seqlens = tuple(getattr(params, "seqlens", ()) or ())
        if not seqlens:
            raise NotImplementedError("SDPAttention: packed rows with context parallelism need "
                                      "the segment lengths on the host (HostPackedSeqParams)")
        cp = torch.distributed.get_world_size(self.cp_group)
        rank = torch.distributed.get_rank(self.cp_group)
        dev = query.device
        order = packed_gathered_order(seqlens, cp, dev)
        key = gather_sequence(key, self.cp_group, order)  # [T, g, D]
        value = gather_sequence(value, self.cp_group, order)
        outs, q0, k0 = [], 0, 0
        for n in seqlens:  # one segment at a time: its local queries against its keys
            nq = n // cp
            pos_q = local_positions(n, cp, rank, dev)
            outs.append(self.global_causal(query[q0:q0 + nq].unsqueeze(1),
                                           key[k0:k0 + n].unsqueeze(1),
                                           value[k0:k0 + n].unsqueeze(1), pos_q))
            q0, k0 = q0 + nq, k0 + n
        return torch.cat(outs).reshape(query.shape[0], self.heads * self.head_dim)

    def global_causal(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      pos_q: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        """Queries ``[Sq, B, h, D]`` at global positions ``pos_q [Sq]`` (int64) against all
        keys/values ``[Sk, B, g, D]`` of the row (global order): query ``i`` sees keys
        ``0..pos_q[i]`` (or where ``keep [Sq, Sk]`` is True). Returns ``[Sq, B, h*D]``
        (megatron's operation order on CPU, SDPA with a boolean mask on CUDA or with
        ``use_sdpa_on_cpu``)."""
        sq, b, sk = query.shape[0], query.shape[1], key.shape[0]
        if keep is None:
            keep = pos_q[:, None] >= torch.arange(sk, device=query.device)[None, :]
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [B, h|g, S, D]
        if not q.is_cuda and not self.use_sdpa_on_cpu:
            return self._megatron_order(q, k, v, keep, False)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=keep, dropout_p=self.dropout if self.training else 0.0,
            scale=self.softmax_scale, enable_gqa=self.heads != self.groups)
        return out.permute(2, 0, 1, 3).reshape(sq, b, self.heads * self.head_dim)

    @staticmethod
    def _varlen_eligible(query: torch.Tensor, dropout: float) -> bool:
        """Whether the varlen kernel can take these packed rows: CUDA, fp16/bf16, no dropout
        (the keywords of the installed torch's ``varlen_attn`` are checked separately)."""
        return query.is_cuda and query.dtype in (torch.float16, torch.bfloat16) and dropout == 0

    def _megatron_order(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        keep: torch.Tensor | None, causal: bool) -> torch.Tensor:
        """``[B, h|g, S, D]`` inputs -> ``[Sq, B, h*D]``, computed as megatron's local
        ``DotProductAttention`` does (``[B, h, Sq, Sk]`` scores; CPU only)."""
        b, _, sq, d = q.shape
        sk, rep = k.shape[2], self.heads // self.groups
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        qf = q.reshape(b * self.heads, sq, d)
        kf = k.reshape(b * self.heads, sk, d)
        scores = torch.baddbmm(torch.empty(b * self.heads, sq, sk, dtype=q.dtype,
                                           device=q.device), qf, kf.transpose(1, 2), beta=0.0,
                               alpha=self.softmax_scale).view(b, self.heads, sq, sk)
        dtype = scores.dtype
        scores = scores.float()
        if keep is not None:
            scores = scores.masked_fill(~keep, -10000.0)
        elif causal:
            mask = torch.ones(sq, sk, dtype=torch.bool, device=q.device).triu(1)
            scores = scores.masked_fill(mask, -10000.0)
        probs = torch.softmax(scores, dim=-1).to(dtype)
        if self.training and self.dropout > 0:
            probs = F.dropout(probs, self.dropout)
        ctx = torch.bmm(probs.view(b * self.heads, sq, sk), v.reshape(b * self.heads, sk, d))
        return ctx.view(b, self.heads, sq, d).permute(2, 0, 1, 3).reshape(
            sq, b, self.heads * d)


def masked_softmax_extension_available() -> bool:
    """megatron's compiled fused-softmax extension (never shipped in the megatron-core wheel)."""
    import importlib.util

    return torch.cuda.is_available() and importlib.util.find_spec(
        "scaled_masked_softmax_cuda") is not None


def use_sdpa_core_attention(spec) -> None:
    """Point the self-attention of a layer ``ModuleSpec`` at :class:`SDPAttention` (in place)."""
    spec.submodules.self_attention.submodules.core_attention = SDPAttention
