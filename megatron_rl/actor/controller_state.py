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
    """The controller's ``state_dict`` as held by this rank's last pipeline stage (host floats,
    the same on every stage of the pipeline); the other stages load it too. Collective over
    the pipeline group."""
    from megatron.core import parallel_state as ps

    box = [_host(controller.state_dict()) if ps.is_pipeline_last_stage() else None]
    if ps.get_pipeline_model_parallel_world_size() > 1:
        dist.broadcast_object_list(box, src=ps.get_pipeline_model_parallel_last_rank(),
                                   group=ps.get_pipeline_model_parallel_group())
    if not ps.is_pipeline_last_stage():
        controller.load_state_dict(box[0])
    return box[0]
