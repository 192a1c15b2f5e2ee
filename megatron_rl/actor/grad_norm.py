"""A gradient norm that does not depend on the TP x PP layout (up to float64 rounding).

megatron-core's ``get_grad_norm_fp32`` sums squared fp32 norms per rank and all-reduces them over
the model-parallel group, so the norm's last bits depend on how the parameters are split into
stages and shards. With gradient clipping active, that norm scales every gradient, and the
difference feeds into training: measured on the tiny DAPO recipe, TP1xPP2 drifted from TP1xPP1
by up to 1e-6 relative within 10 steps while its gradients were bit-identical
(``python -m megatron_rl repro``).

Here every squared element is accumulated in float64 (an fp32 square is exact in float64, and the
sum's rounding is ~1e-16 relative), chunk by chunk so no full float64 copy of a gradient exists;
the per-rank sums are all-reduced in float64. The clip coefficient derived from it is then the
same fp32 number at every layout except with a ~1e-9 chance per step.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

CHUNK = 1 << 22  # elements per float64 chunk (32 MiB)


def _sum_squares(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Sum of squares of all elements of ``grads`` as a float64 scalar on ``device``."""
    total = torch.zeros((), dtype=torch.float64, device=device)
    for g in grads:
        flat = g.detach().reshape(-1)
        for part in flat.split(CHUNK):
            total += part.double().square().sum()
    return total


def layout_invariant_grad_norm(grads_for_norm, norm_type: float = 2,
                               grad_stats_parallel_group=None) -> float:
    """Drop-in for megatron's ``get_grad_norm_fp32`` (2-norm; other norms go to megatron's)."""
    from megatron.core.optimizer import clip_grads

    if float(norm_type) != 2.0:
        return clip_grads.get_grad_norm_fp32(grads_for_norm, norm_type,
                                             grad_stats_parallel_group)
    if isinstance(grads_for_norm, torch.Tensor):
        grads_for_norm = [grads_for_norm]
    dp_group = None  # megatron FSDP (DTensor grads) shards over data parallel too
    for g in grads_for_norm:
        dp_group = clip_grads.get_data_parallel_group_if_dtensor(g, dp_group)
    grads = [clip_grads.to_local_if_dtensor(g) for g in grads_for_norm]
    if grads:
        device = grads[0].device
    elif torch.cuda.is_available() and dist.get_backend(grad_stats_parallel_group) == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    total = _sum_squares(grads, device)
    if dp_group is not None:
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=dp_group)
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=grad_stats_parallel_group)
    return math.sqrt(float(total))


def install() -> None:
    """Make megatron's optimizers (``MegatronOptimizer``, ``ChainedOptimizer``) use
    :func:`layout_invariant_grad_norm` for the norm they log and clip with. Idempotent."""
    import megatron.core.optimizer.optimizer as mopt

    mopt.get_grad_norm_fp32 = layout_invariant_grad_norm
