"""Fused linear head + vocab-parallel log-prob + entropy, without an ``[N, V_local]`` logits tensor.

Rank ``r`` of the tensor-parallel group holds ``weight = W[r*V_local:(r+1)*V_local]`` (``[V_local,
H]``) and the same response-token hidden states ``hidden [N, H]`` as every other TP rank. The
result equals :func:`megatron_rl.ops.vocab_parallel.vocab_parallel_logprob_entropy` applied to
``hidden @ weight.T`` (the logits in the input dtype, as megatron's ``output_layer`` returns them),
but the logits only ever exist as row chunks (:mod:`megatron_rl.kernels.fused_head_torch`: one
GEMM per chunk, then one fused elementwise pass). Per token, with the local statistics
``(m_r, s_r, a_r, zlab_r)`` of a shard::

    M    = max_r m_r                                        all-reduce MAX   ([N])
    S, A = sum_r rescale(s_r, a_r; m_r -> M), zlab = sum_r zlab_r
                                                            all-reduce SUM   ([N, 3], one call)
    lse = M + log S;   logp = zlab - lse;   H = log S - A / S;   mu = M + A / S

Two collectives in forward, exactly as the foundation op. Backward recomputes the logits chunk by
chunk and produces ``grad_hidden`` (``[N, H]``, input dtype, each chunk's rows written once) and
adds ``grad_weight`` (``[V_local, H]``) chunk by chunk in fp32; then **one all-reduce SUM of
grad_hidden over the TP group** (``reduce_hidden_grad=True``, the default). That is the collective
megatron's ``ColumnParallelLinear`` runs on its input's gradient
(``copy_to_tensor_model_parallel_region``), so pass the plain hidden states -- *not* ones already
wrapped by that function, or the gradient is summed twice (or pass ``reduce_hidden_grad=False``).

``grad_weight`` with ``use_main_grad=True`` and a weight carrying megatron DDP's fp32
``main_grad`` (:func:`main_grad_target`): the chunks' ``dlogits^T @ hidden`` are added straight into
``main_grad`` and the autograd gradient of ``weight`` is None -- no ``[V_local, H]`` buffer at all.
DDP's backward hook (``distributed_data_parallel.py``: ``main_grad.add_(param.grad)`` unless
``grad_added_to_main_grad``) then only adds what *other* uses of the parameter produced, e.g. the
input embedding's gradient when the output weight is tied to it; ``grad_added_to_main_grad`` is
deliberately left alone (setting it, as megatron's gradient_accumulation_fusion does, would drop
that embedding gradient). Without ``main_grad`` the gradient is accumulated in fp32 (in place for
fp32 weights; a transient fp32 ``[V_local, H]`` buffer cast at the end for bf16/fp16 weights).

Nothing is atomic and the chunk order is fixed: two backward passes give bit-equal gradients.
``ctx.save_for_backward(hidden, weight, label_col, lse, mu)``: the two inputs (no copies) plus
``[N]`` vectors. Transient: one ``[chunk, V_local]`` buffer in the input dtype.
"""

from __future__ import annotations

import sys
from typing import Tuple

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from megatron_rl.kernels import fused_head_torch as chunked
from megatron_rl.ops.vocab_parallel import VocabParallelSteps

__all__ = [
    "FusedLinearLogProbEntropy",
    "fused_linear_logprob_entropy",
    "main_grad_target",
    "resolve_backend",
    "triton_available",
]

_FP32 = torch.float32
BACKENDS = ("auto", "torch", "triton")


# --------------------------------------------------------------------------------------------
# Backend selection
# --------------------------------------------------------------------------------------------
def triton_available() -> bool:
    """True if the ``triton`` package imports (it may still need a GPU to run)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def resolve_backend(backend: str, device: torch.device) -> str:
    """``"auto"`` -> ``"triton"`` on a CUDA device with Triton installed, else ``"torch"``.

    ``"triton"`` on a CPU tensor needs ``TRITON_INTERPRET=1`` set before Triton is imported
    (interpreter mode, for tests).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "triton" if device.type == "cuda" and triton_available() else "torch"
    if backend == "triton" and not triton_available():
        raise RuntimeError("backend='triton' requested but the triton package is not installed")
    return backend


def _chunk_ops(backend: str, triton_tiles) -> chunked.ChunkOps:
    """The elementwise pass of ``backend`` (the chunk loop and GEMMs are shared)."""
    if backend == "triton":
        from megatron_rl.kernels.fused_head_triton import TritonChunkOps

        return TritonChunkOps(triton_tiles)
    return chunked.TorchChunkOps()


def main_grad_target(weight: torch.Tensor) -> torch.Tensor | None:
    """megatron DDP's fp32 ``weight.main_grad`` when present and shaped like ``weight``."""
    mg = getattr(weight, "main_grad", None)
    if isinstance(mg, torch.Tensor) and mg.shape == weight.shape and mg.dtype == _FP32 \
            and mg.device == weight.device:
        return mg
    return None


# --------------------------------------------------------------------------------------------
# Autograd function
# --------------------------------------------------------------------------------------------
class FusedLinearLogProbEntropy(torch.autograd.Function):
    """Thin autograd wrapper; see the module docstring for the math, collectives and memory."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, group,
                tp_size: int, vocab_start: int, temperature: float, compute_entropy: bool,
                entropy_grad: bool, reduce_hidden_grad: bool, backend: str,
                chunk_size: int | None, triton_tiles, use_main_grad: bool):
        label_col = chunked.local_label_index(labels, vocab_start, weight.size(0))
        ops = _chunk_ops(backend, triton_tiles)
        local = chunked.forward_stats(hidden, weight, label_col, temperature, compute_entropy,
                                      ops, chunk_size=chunk_size)

        # Collective 1: the max over the TP group.
        global_max = local.m.clone()
        if tp_size > 1:
            dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=group)

        # Collective 2: [S, (A), zlab] rescaled to the global max, one SUM for all of them.
        s, a = chunked.rescale_partials(local.m, local.s, local.a, global_max)
        packed = torch.stack([s, local.zlab] if a is None else [s, a, local.zlab], dim=1)
        if tp_size > 1:
            dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=group)

        n_stats = packed.size(1) - 1
        logp, lse, entropy, mu = VocabParallelSteps.logprob_entropy(
            global_max, packed[:, :n_stats], packed[:, n_stats])

        track_entropy = compute_entropy and entropy_grad
        # The whole memory story: the two inputs (no copies) + [N] vectors.
        ctx.save_for_backward(hidden, weight, label_col, lse, mu if track_entropy else None)
        ctx.track_entropy = track_entropy
        ctx.group, ctx.tp_size, ctx.reduce_hidden_grad = group, tp_size, reduce_hidden_grad
        ctx.temperature, ctx.ops, ctx.chunk_size = temperature, ops, chunk_size
        ctx.use_main_grad = use_main_grad
        ctx.set_materialize_grads(False)
        if entropy is not None and not entropy_grad:
            ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, label_col, lse, mu = ctx.saved_tensors
        if not ctx.track_entropy:
            grad_entropy = None
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        nones = (None,) * 12
        if (grad_logp is None and grad_entropy is None) or not (need_hidden or need_weight):
            return (None, None) + nones

        def fp32(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(_FP32).contiguous()

        main_grad = main_grad_target(weight) if ctx.use_main_grad and need_weight else None
        acc = None
        if main_grad is not None:
            acc = main_grad                                  # megatron DDP's fp32 buffer
        elif need_weight:
            acc = torch.zeros(weight.shape, dtype=_FP32, device=weight.device)
        grad_h = chunked.backward_grads(
            hidden, weight, label_col, lse, mu, fp32(grad_logp), fp32(grad_entropy),
            ctx.temperature, ctx.ops, need_hidden=need_hidden, wgrad_acc=acc,
            chunk_size=ctx.chunk_size)

        # Collective 3 (backward): each rank holds the part of dL/dhidden from its vocab shard.
        if grad_h is not None and ctx.tp_size > 1 and ctx.reduce_hidden_grad:
            dist.all_reduce(grad_h, op=dist.ReduceOp.SUM, group=ctx.group)
        grad_w = None if acc is None or main_grad is not None else acc.to(weight.dtype)
        return (grad_h, grad_w) + nones


# --------------------------------------------------------------------------------------------
# Public entry point
# --------------------------------------------------------------------------------------------
def _default_tp_group():
    """Megatron's TP group if megatron ``parallel_state`` is initialised, else None."""
    ps = sys.modules.get("megatron.core.parallel_state")
    if ps is not None and ps.model_parallel_is_initialized():
        return ps.get_tensor_model_parallel_group()
    return None


def _validate(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
              temperature: float, vocab_global: int, chunk_size: int | None) -> None:
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.size(1) != weight.size(1):
        raise ValueError(f"need hidden [N, H] and weight [V_local, H], got "
                         f"{tuple(hidden.shape)} and {tuple(weight.shape)}")
    if not hidden.is_floating_point() or hidden.dtype != weight.dtype:
        raise TypeError(f"hidden and weight must share one float dtype, got {hidden.dtype} "
                        f"and {weight.dtype}")
    if labels.is_floating_point() or labels.dtype == torch.bool \
            or tuple(labels.shape) != (hidden.size(0),):
        raise ValueError(f"labels must be integer [N] = [{hidden.size(0)}], got "
                         f"{labels.dtype} {tuple(labels.shape)}")
    if not isinstance(temperature, (int, float)) or not temperature > 0:
        raise ValueError(f"temperature must be a number > 0, got {temperature!r}")
    if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size must be a positive int or None, got {chunk_size!r}")
    from megatron_rl.ops.vocab_parallel import check_label_range

    check_label_range(labels, vocab_global)  # CUDA: an async device assert, no host sync


def fused_linear_logprob_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    group=None,
    *,
    temperature: float = 1.0,
    compute_entropy: bool = True,
    entropy_grad: bool = True,
    chunk_size: int | None = None,
    vocab_start: int | None = None,
    reduce_hidden_grad: bool = True,
    backend: str = "auto",
    triton_tiles=None,
    use_main_grad: bool = False,
) -> Tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-prob of ``labels`` and full-vocab entropy of ``softmax(hidden @ W.T / T)``.

    Args:
        hidden: ``[N, H]`` fp32/bf16/fp16 response-token hidden states, the same on every TP rank
            (plain tensor, not wrapped by megatron's ``copy_to_tensor_model_parallel_region``).
        weight: ``[V_local, H]`` this rank's vocab shard of the output weight (same dtype).
        labels: ``[N]`` integer global vocab ids in ``[0, V_local x TP)``.
        group: TP process group; default megatron's TP group if initialised, else None.
        temperature: ``T > 0``.
        compute_entropy: False returns ``None`` for the entropy (and skips its statistic).
        entropy_grad: False makes the entropy non-differentiable (no backward work for it).
        chunk_size: rows per chunk; None sizes the chunk buffer to ~8% of the ``[N, V_local]``
            logits (:func:`megatron_rl.kernels.fused_head_torch.auto_chunk_rows`).
        vocab_start: global id of this shard's first row of ``weight``; default
            ``tp_rank x V_local``.
        reduce_hidden_grad: all-reduce (SUM) ``grad_hidden`` over ``group`` in backward.
        backend: ``"auto"`` (Triton on CUDA if installed, else torch), ``"torch"``, ``"triton"``:
            which elementwise pass runs between the (shared) GEMMs.
        triton_tiles: optional :class:`megatron_rl.kernels.fused_head_triton.TritonTiles`.
        use_main_grad: add ``grad_weight`` straight into ``weight.main_grad`` (megatron DDP's
            fp32 buffer) when the weight has one; its autograd gradient is then None.

    Returns:
        ``(logp [N] fp32, entropy [N] fp32 or None)``. Gradients w.r.t. ``hidden`` and ``weight``
        come back in their dtype.
    """
    if group is None:
        group = _default_tp_group()
    tp_size = 1 if group is None else dist.get_world_size(group)
    tp_rank = 0 if group is None else dist.get_rank(group)
    _validate(hidden, weight, labels, temperature, weight.size(0) * tp_size, chunk_size)
    if vocab_start is None:
        vocab_start = tp_rank * weight.size(0)
    resolved = resolve_backend(backend, hidden.device)
    if resolved == "triton":
        if hidden.stride(-1) != 1 or not hidden.is_contiguous():
            hidden = hidden.contiguous()
        if weight.stride(-1) != 1:
            raise ValueError("backend='triton' needs a weight with unit stride along H")
    return FusedLinearLogProbEntropy.apply(
        hidden, weight, labels, group, tp_size, int(vocab_start), float(temperature),
        bool(compute_entropy), bool(entropy_grad), bool(reduce_hidden_grad), resolved,
        chunk_size, triton_tiles, bool(use_main_grad))
