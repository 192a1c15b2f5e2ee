"""A CPU stand-in for device memory accounting, for the colocation tests.

On a GPU, "the actor left nothing on the device during rollout" is read from
``torch.cuda.memory_allocated()``. On a CPU-only machine every tensor is a host tensor, so this
spy counts instead the bytes of every live tensor storage reachable from an object (the actor)
on a given device type -- found through the garbage collector's referents (``gc.get_referents``),
a traversal independent of the one :mod:`megatron_rl.actor.offload` uses to decide what to move.
A storage resized to 0 bytes (offloaded) counts 0; host copies held elsewhere are not reachable
from the actor and are not counted.
"""

from __future__ import annotations

import gc
import types

import torch

_OPAQUE = (types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.CodeType,
           types.FrameType, type, str, bytes)


def device_tensors(root: object, device_type: str) -> list[torch.Tensor]:
    """Every tensor on ``device_type`` reachable from ``root`` by ``gc.get_referents`` (not
    entering modules, functions, classes or code objects: their globals are not the actor's)."""
    seen: set[int] = set()
    stack, found = [root], []
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, _OPAQUE):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if obj.device.type == device_type:
                found.append(obj)
            stack.extend(getattr(obj, "__dict__", {}).values())
        stack.extend(gc.get_referents(obj))
    return found


def device_bytes(root: object, device_type: str) -> int:
    """Bytes of the distinct storages on ``device_type`` reachable from ``root``."""
    storages = {}
    for t in device_tensors(root, device_type):
        st = t.untyped_storage()
        storages[st._cdata] = st.nbytes()
    return sum(storages.values())
