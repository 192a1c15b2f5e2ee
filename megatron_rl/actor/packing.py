"""Sequence packing (THD layout) for the actor's forward passes.

A micro-batch of right-padded rows ``tokens/mask [B, S]`` is run as one packed row ``[1, T]``:
row ``b`` contributes its first ``L_b`` tokens, where ``L_b`` is one past its last response token
(its log-probs need nothing later: attention is causal; a row without response tokens contributes
none). ``T = sum(L_b)``, rounded up to ``multiple``, or to a length shared by all micro-batches of
a pipeline schedule (megatron's P2P buffers have one shape); the filler tokens form a segment of
their own, so they never reach a real sequence. Positions restart at 0 per sequence (RoPE), and
megatron-core's :class:`~megatron.core.packed_seq_params.PackedSeqParams` (``qkv_format='thd'``,
``cu_seqlens``) makes the attention document-causal: TE's fused attention, or
:class:`megatron_rl.models.attention.SDPAttention` without TE.

Only the model runs packed. The response head reads the packed hidden states at the response
positions and hands back per-token log-prob/entropy in the rows' ``[B, S]`` view, so every loss,
mask, advantage and statistic (token-level, sequence-level, Clip-Cov selections) is computed from
the same numbers as without packing. Those are elementwise ``[B, S]`` operations (no GEMM); the
model's FLOPs and activations follow ``T``.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from megatron.core.packed_seq_params import PackedSeqParams

from megatron_rl.actor.micro_batches import padding_metrics
from megatron_rl.actor.moe_padding import is_moe, packed_padding_mask
from megatron_rl.models.heads import response_logprob_entropy
from megatron_rl.models.response_tokens import response_indices

Tensor = torch.Tensor


@dataclass
class HostPackedSeqParams(PackedSeqParams):
    """:class:`PackedSeqParams` plus the segment lengths as host ints (attention loops over them
    without a device->host copy per layer) and ``cu_seqlens`` as a host (CPU int32) tensor."""

    seqlens: tuple[int, ...] = ()
    host_cu_seqlens: Tensor | None = None


def forward_params(params: HostPackedSeqParams, host_rope: bool) -> PackedSeqParams:
    """The packed params a model forward gets. ``host_rope``: megatron-core 0.16's unfused THD
    RoPE (``rope_utils._apply_rotary_pos_emb_thd``) reads ``cu_seqlens`` with ``.tolist()`` and
    compares its last entry in an ``if``: with device ``cu_seqlens`` two device->host syncs per
    call, for q and k, in every layer. It takes the *padded* ``cu_seqlens`` when they are set
    (``transformer/attention.py``), so these carry the host copy (equal to the unpadded ones:
    packing pads no sequence) and the RoPE runs without a sync; :class:`~megatron_rl.models.
    attention.SDPAttention` accepts that copy. TE's attention and fused RoPE need the device
    ``cu_seqlens``: ``host_rope`` False leaves the params unchanged."""
    host = params.host_cu_seqlens
    if not host_rope or host is None:
        return params
    return dataclasses.replace(params, cu_seqlens_q_padded=host, cu_seqlens_kv_padded=host)


def host_rope_model(model_chunk: torch.nn.Module) -> bool:
    """Whether ``model_chunk`` (possibly wrapped: DDP, Float16Module) runs the unfused RoPE with
    SDPAttention (``host_rope_cu_seqlens``, set by :func:`~megatron_rl.models.builder.
    build_gpt_model`)."""
    m = model_chunk
    while not hasattr(m, "host_rope_cu_seqlens") and hasattr(m, "module"):
        m = m.module
    return bool(getattr(m, "host_rope_cu_seqlens", False))


class PackingBackendError(ValueError):
    """The model's attention cannot run packed (THD) rows."""


def row_lengths(mask: Tensor) -> Tensor:
    """``[B]`` int64 on ``mask``'s device: one past the last response token of each row (0 for a
    row without response tokens). ``mask [B, S]``."""
    cols = torch.arange(1, mask.shape[1] + 1, device=mask.device)
    return (mask.bool() * cols).amax(dim=1) if mask.shape[1] else mask.new_zeros(
        mask.shape[0], dtype=torch.long)


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def check_packing_backend(model: torch.nn.Module) -> None:
    """Raise :class:`PackingBackendError` unless every core attention of ``model`` handles packed
    rows (Transformer Engine's, or :class:`~megatron_rl.models.attention.SDPAttention`)."""
    from megatron_rl.models.attention import SDPAttention

    for name, mod in model.named_modules():
        if not name.endswith("core_attention"):
            continue
        cls = type(mod)
        if isinstance(mod, SDPAttention) or cls.__module__.startswith(
                ("megatron.core.extensions.transformer_engine", "transformer_engine")):
            continue
        raise PackingBackendError(
            f"actor.pack_sequences=true: attention backend {cls.__module__}.{cls.__name__} "
            f"({name}) cannot run packed (THD) rows and would attend across sequences. Build the "
            "model with Transformer Engine or the local spec's SDPAttention "
            "(megatron_rl.models.attention), or set actor.pack_sequences=false.")


@dataclass
class PackedMicroBatch:
    """One micro-batch as a packed row. Tensors on the micro-batch's device."""

    tokens: Tensor  # [1, T] int64
    position_ids: Tensor  # [1, T] int64, 0.. per sequence
    params: HostPackedSeqParams
    starts: Tensor  # [B] int64: packed offset of each row's first token
    shape: tuple[int, int]  # the rows' [B, S]
    used: int  # sum of the rows' lengths (T minus filler)


def pack_micro_batch(tokens: Tensor, lengths: Sequence[int], total: int,
                     seg_multiple: int = 1) -> PackedMicroBatch:
    """Pack the first ``lengths[b]`` tokens of each row of ``tokens [B, S]`` into ``[1, total]``
    (``total >= sum(lengths)``; the rest is one filler segment of token 0). ``seg_multiple``
    (context parallelism: ``2 x cp``): each row's segment is right-padded with token 0 to a
    multiple of it (``total`` must then be one too)."""
    dev = tokens.device
    bsz, seq = tokens.shape
    used = int(sum(lengths))
    seg_lens = [round_up(int(n), seg_multiple) for n in lengths]
    occupied = sum(seg_lens)
    if total < occupied:
        raise ValueError(f"packed length {total} < {occupied} valid (+ segment padding) tokens")
    lens = torch.tensor(list(lengths), dtype=torch.long, device=dev)
    seg_t = torch.tensor(seg_lens, dtype=torch.long, device=dev)
    starts = torch.cumsum(seg_t, 0) - seg_t
    rows = torch.repeat_interleave(torch.arange(bsz, device=dev), lens, output_size=used)
    cols = torch.arange(used, device=dev) - (torch.cumsum(lens, 0) - lens)[rows]
    filler = total - occupied
    packed = torch.zeros(1, total, dtype=tokens.dtype, device=dev)
    packed[0, starts[rows] + cols] = tokens[rows, cols]
    seg_rows = torch.repeat_interleave(torch.arange(bsz, device=dev), seg_t,
                                       output_size=occupied)
    seg_cols = torch.arange(occupied, device=dev) - starts[seg_rows]
    pos = torch.cat([seg_cols, torch.arange(filler, device=dev)]).unsqueeze(0)
    seqlens = tuple(n for n in seg_lens if n > 0) + ((filler,) if filler else ())
    cu_ints = (0, *itertools.accumulate(seqlens))
    cu = torch.tensor(cu_ints, dtype=torch.int32, device=dev)
    # the same on the host, for megatron's unfused RoPE (forward_params)
    host_cu = torch.tensor(cu_ints, dtype=torch.int32, device="cpu")  # device-spy: ok (host cu)
    longest = max(seqlens) if seqlens else 0
    params = HostPackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                 max_seqlen_q=longest, max_seqlen_kv=longest, seqlens=seqlens,
                                 host_cu_seqlens=host_cu)
    return PackedMicroBatch(packed, pos, params, starts, (bsz, seq), used)


class PackedMicroBatches:
    """All micro-batches of one schedule call, packed; one host sync (the row lengths).

    ``common``: pad every packed row to one length (pipeline parallelism: fixed P2P shapes);
    ``multiple``: round packed lengths up to it (e.g. the TP size for sequence parallelism).
    ``seq_length``/``micro_batch_size`` are what megatron's schedule is told.
    """

    micro_batch_size = 1

    def __init__(self, micro_batches: Sequence[dict], common: bool, multiple: int = 1,
                 device: torch.device | None = None, cp: int = 1) -> None:
        def dev(t: Tensor) -> Tensor:
            return t if device is None else t.to(device)

        self.masks = [dev(mb["mask"]) for mb in micro_batches]
        lens = torch.cat([row_lengths(m) for m in self.masks])
        flat = lens.tolist()  # the one host sync
        per, k = [], 0
        for m in self.masks:
            per.append(flat[k:k + m.shape[0]])
            k += m.shape[0]
        # context parallelism: every segment a multiple of 2 x cp, split per segment
        self.cp, seg = cp, (2 * cp if cp > 1 else 1)
        multiple = multiple * seg // math.gcd(multiple, seg)
        totals = [round_up(max(sum(round_up(n, seg) for n in p), 1), multiple) for p in per]
        if common:
            totals = [max(totals)] * len(totals)
        self.packs = [pack_micro_batch(dev(mb["tokens"]), p, t, seg)
                      for mb, p, t in zip(micro_batches, per, totals)]
        self.seq_length = max(totals)
        self._index: list[tuple[Tensor, Tensor]] | None = None
        self._local: dict[int, Tensor] = {}

    @property
    def used_tokens(self) -> int:
        """Valid tokens of all micro-batches."""
        return sum(p.used for p in self.packs)

    @property
    def processed_tokens(self) -> int:
        """Tokens the model runs (valid + filler)."""
        return sum(p.tokens.shape[1] for p in self.packs)

    def model_forward(self, model_chunk: torch.nn.Module, i: int, **kwargs: Any) -> Tensor:
        """Micro-batch ``i`` through ``model_chunk``: hidden states ``[T, 1, H]`` (last stage).
        MoE: the filler segment is padding for the router (:mod:`megatron_rl.actor.moe_padding`).
        On CUDA with the unfused RoPE the RoPE reads ``cu_seqlens`` on the host
        (:func:`forward_params`)."""
        p = self.packs[i]
        if is_moe(model_chunk):
            kwargs["padding_mask"] = packed_padding_mask(p.tokens.shape[1], p.used,
                                                         p.tokens.device)
        host_rope = p.tokens.is_cuda and host_rope_model(model_chunk)
        tokens, position_ids = p.tokens, p.position_ids
        if self.cp > 1:  # this CP rank's chunks of every segment; cu_seqlens stay global
            local = self.local_positions(i)
            tokens, position_ids = tokens[:, local], position_ids[:, local]
            if "padding_mask" in kwargs:
                kwargs["padding_mask"] = kwargs["padding_mask"][:, local]
        return model_chunk(tokens, position_ids, None,
                           packed_seq_params=forward_params(p.params, host_rope), **kwargs)

    def local_positions(self, i: int) -> Tensor:
        """Packed positions ``[T / cp]`` of micro-batch ``i`` this CP rank runs."""
        if i not in self._local:
            from megatron_rl.parallel.context_parallel import cp_rank, packed_local_positions

            p = self.packs[i]
            self._local[i] = packed_local_positions(p.params.seqlens, self.cp, cp_rank(),
                                                    p.tokens.device)
        return self._local[i]

    def index(self, i: int) -> tuple[Tensor, Tensor]:
        """``(b, t)`` response positions of micro-batch ``i`` in the rows' view (one host sync
        for all micro-batches, on first use)."""
        if self._index is None:
            self._index = response_indices(self.masks) if len(
                {m.shape for m in self.masks}) == 1 else [
                tuple(m.bool().nonzero(as_tuple=True)) for m in self.masks]
        return self._index[i]

    def logprob_entropy(self, head: torch.nn.Module, hidden: Tensor, i: int,
                        **head_kwargs: Any) -> tuple[Tensor, Tensor | None]:
        """Per-token log-prob/entropy of micro-batch ``i`` as ``[B, S]`` fp32 (zero outside the
        mask) from packed ``hidden [T, 1, H]``; same values as the unpacked head."""
        p = self.packs[i]
        b, t = self.index(i)
        pos = p.starts[b] + t  # packed position of each response token
        if self.cp > 1:
            return self._logprob_entropy_cp(head, hidden, i, b, t, pos, **head_kwargs)
        logp, ent = response_logprob_entropy(
            head, hidden, p.tokens, None, index=(torch.zeros_like(pos), pos), **head_kwargs)

        def unpack(x: Tensor | None) -> Tensor | None:
            if x is None:
                return None
            return x.new_zeros(p.shape).index_put((b, t), x[0, pos])

        return unpack(logp), unpack(ent)

    def _logprob_entropy_cp(self, head: torch.nn.Module, hidden: Tensor, i: int, b: Tensor,
                            t: Tensor, pos: Tensor, **head_kwargs: Any
                            ) -> tuple[Tensor, Tensor | None]:
        """Context parallelism: the response tokens whose predicting position (``pos - 1``) this
        rank holds, scored from its ``hidden [T/cp, 1, H]``; summed over CP into ``[B, S]``."""
        from megatron_rl.parallel.context_parallel import cp_group, sum_over_cp

        p = self.packs[i]
        local = self.local_positions(i)
        where = torch.full((p.tokens.shape[1],), -1, dtype=torch.long, device=pos.device)
        where[local] = torch.arange(local.numel(), device=pos.device)
        row = where[pos - 1]
        mine = (row >= 0).nonzero(as_tuple=True)[0]  # one host sync per micro-batch
        b, t, pos, row = b[mine], t[mine], pos[mine], row[mine]
        tok = p.tokens.new_zeros(1, local.numel() + 1)  # head convention: hidden[j] -> col j+1
        tok[0, row + 1] = p.tokens[0, pos]
        logp, ent = response_logprob_entropy(
            head, hidden, tok, None, index=(torch.zeros_like(row), row + 1), **head_kwargs)

        def unpack(x: Tensor | None) -> Tensor | None:
            if x is None:
                return None
            return sum_over_cp(x.new_zeros(p.shape).index_put((b, t), x[0, row + 1]),
                               cp_group())

        return unpack(logp), unpack(ent)


def token_counts(micro_batches: Sequence[dict], packed: PackedMicroBatches | None,
                 device: torch.device) -> Tensor:
    """``[3]`` float64 on ``device``: (valid tokens, processed tokens, micro-batches) of this rank
    (padded: every micro-batch runs ``B x S`` tokens). No host sync."""
    n = float(len(micro_batches))
    if packed is not None:
        return torch.tensor([packed.used_tokens, packed.processed_tokens, n],
                            dtype=torch.float64, device=device)
    used = sum(row_lengths(mb["mask"].to(device)).sum() for mb in micro_batches)
    processed = float(sum(mb["tokens"].numel() for mb in micro_batches))
    out = torch.tensor([0.0, processed, n], dtype=torch.float64, device=device)
    out[0] = used
    return out


def token_metrics(counts: Tensor) -> dict[str, float]:
    """``actor/pad_fraction`` and ``actor/tokens_per_micro_batch`` (defined by
    :func:`~megatron_rl.actor.micro_batches.padding_metrics`) from summed :func:`token_counts`
    (one host sync)."""
    return padding_metrics(*counts.tolist())
