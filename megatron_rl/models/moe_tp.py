"""Mixture-of-experts layers under tensor parallelism without model-wide sequence parallelism.

megatron-core 0.16 refuses to train an ``MoELayer`` at TP > 1 unless sequence parallelism is on
(``moe_layer.py``: each TP rank would otherwise dispatch the same tokens, and every expert would
see each token ``tp`` times). The actor keeps activations replicated over TP everywhere else
(its norms, head and attention do not take sequence-parallel inputs), so the ``MoELayer``
subclass of :func:`sequence_chunk_moe_layer` makes the MoE layer alone sequence-parallel: each TP
rank routes and dispatches its ``1 / tp`` slice of the sequence, and the layer's output is
all-gathered back to the replicated layout. The router weight, replicated over TP, then gets
each rank's share of its gradient; :func:`allreduce_tp_partial_grads` sums them over TP after
megatron's gradient sync (what megatron does for sequence-parallel norm weights). Experts need
EP > 1 here: their gradients are then reduced over the expert-data-parallel group, which holds
the other TP ranks' slices.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import torch

TP_PARTIAL_GRAD = "mrl_tp_partial_grad"  # param attribute: its grad is a TP rank's share


@functools.cache
def sequence_chunk_moe_layer() -> type:
    """The ``MoELayer`` subclass with :class:`_SequenceChunkMixin` (defined on first use:
    megatron's MoE modules are only imported for MoE models)."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    return type("SequenceChunkMoELayer", (_SequenceChunkMixin, MoELayer),
                {"__module__": __name__, "__doc__": _SequenceChunkMixin.__doc__})


class _SequenceChunkMixin:
    """``MoELayer`` over this TP rank's slice of the sequence (``[S, B, H]`` in and out,
    replicated over TP; ``S`` padded to a multiple of TP inside). Expert TP is 1."""

    def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
        config = copy.copy(config)
        config.sequence_parallel = True  # this layer only: its input is the rank's slice
        super().__init__(config, *args, **kwargs)
        # The router (replicated over TP) sees 1 / tp of the tokens on each rank. The experts'
        # gradients are complete after megatron's reduction over the expert-data-parallel group
        # (TP x DP / EP ranks, which holds the other TP ranks' slices); that needs EP > 1
        # (models/config.py: validate_for_layout), as megatron keeps EP-1 experts in the dense
        # buffer, reduced over DP only.
        for p in self.router.parameters():
            setattr(p, TP_PARTIAL_GRAD, True)

    def forward(self, hidden_states: torch.Tensor, padding_mask: torch.Tensor | None = None,
                **kwargs: Any):
        from megatron.core.tensor_parallel.mappings import (
            gather_from_sequence_parallel_region,
            scatter_to_sequence_parallel_region,
        )

        group = self.attn_tp_group
        tp = group.size()
        s = hidden_states.shape[0]
        pad = -s % tp
        if pad:  # zero rows: routed and computed, sliced off; their output gradient is zero
            hidden_states = torch.cat([hidden_states, hidden_states.new_zeros(
                (pad, *hidden_states.shape[1:]))])
        mine = scatter_to_sequence_parallel_region(hidden_states, group=group)
        if padding_mask is not None:  # [B, S], True = padding: this rank's columns (the rows
            # added above are padding too; megatron counts the valid ones over TP)
            padding_mask = torch.nn.functional.pad(padding_mask, (0, pad), value=True)
            padding_mask = padding_mask.chunk(tp, dim=1)[group.rank()]
        out, bias = super().forward(mine, padding_mask=padding_mask, **kwargs)
        # backward: each rank keeps its slice's gradient (the output is replicated over TP)
        full = gather_from_sequence_parallel_region(out, tensor_parallel_output_grad=False,
                                                    group=group)
        return full[:s], bias


def allreduce_tp_partial_grads(model_chunks: list[torch.nn.Module]) -> None:
    """Sum over the TP group the main gradients of parameters tagged :data:`TP_PARTIAL_GRAD`
    (one bucketed all-reduce; a no-op at TP 1). Call after the DP gradient sync."""
    from megatron.core import parallel_state as ps
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    if ps.get_tensor_model_parallel_world_size() == 1:
        return
    grads = [p.main_grad if hasattr(p, "main_grad") else p.grad
             for m in model_chunks for p in m.parameters()
             if getattr(p, TP_PARTIAL_GRAD, False) and p.requires_grad]
    grads = [g for g in grads if g is not None]
    if not grads:
        return
    flat = _flatten_dense_tensors([g.data for g in grads])
    torch.distributed.all_reduce(flat, group=ps.get_tensor_model_parallel_group())
    for g, synced in zip(grads, _unflatten_dense_tensors(flat, [g.data for g in grads])):
        g.data.copy_(synced)
