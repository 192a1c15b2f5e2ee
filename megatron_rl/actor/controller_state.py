"""The adaptive entropy controller's state travels to every pipeline stage.

The controller is updated where the entropy is measured, on the last pipeline stage, but a
checkpoint's common state is written by global rank 0 (the first stage): before a save, every
rank takes the last stage's state, so a resume at any PP restores what the last stage had.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _host(state: dict) -> dict:
    return {k: (float(v) if isinstance(v, torch.Tensor) else v) for k, v in state.items()}


def last_stage_state(controller) -> dict:
    """The controller's ``state_dict`` as held by the last pipeline stage (host floats, the same
    on every rank afterwards; every stage's DP/TP replicas hold the same state since the entropy
    is all-reduced over DP); the other stages load it too. Collective over all ranks (host
    objects over the gloo host group)."""
    from megatron.core import parallel_state as ps

    from megatron_rl.parallel import runtime

    src = runtime.last_stage_rank()
    state = runtime.broadcast_object(
        _host(controller.state_dict()) if dist.get_rank() == src else None, src)
    if not ps.is_pipeline_last_stage():
        controller.load_state_dict(state)
    return state
