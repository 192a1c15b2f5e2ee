"""Actor offload/onload for colocation: parameters, gradients and optimizer state leave the
device between update and rollout, and come back bit for bit.

It works on tensor *storages*, not on tensors: every storage the actor reaches on its device is
copied byte for byte into its slice of one host buffer per group (:class:`HostBuffer`: exactly the
sum of the group's storages at 256-byte aligned offsets, page-locked when CUDA is available;
allocated once and reused every step while the group's total stays the same) and then resized to
0 bytes, which frees its device memory while every tensor that
views it -- megatron DDP's ``param_data``/``grad_data`` buffers, the parameters and ``main_grad``
views into them, bucket views, the optimizer's fp32 main parameters and Adam moments -- stays the
same Python object. Onload resizes each storage back and copies the bytes in. Nothing is rebuilt,
so megatron's bucket views and the optimizer's parameter references stay valid, and a tensor
touched while offloaded fails loudly (its storage has 0 bytes) instead of reading stale memory.

Three groups, offloaded together or separately (the colocated loop keeps the parameters on the
device for the weight sync while gradients and optimizer state are already gone):

- ``grads``: DDP ``grad_data`` buffers, every parameter's ``main_grad`` and ``.grad``;
- ``params``: everything else reachable from the DDP-wrapped model (and a resident reference
  model): parameters, DDP ``param_data`` buffers, module buffers and tensor attributes;
- ``optimizer``: everything else reachable from the optimizer: Adam moments, step counters, fp32
  main parameters and their gradients, loss-scaler tensors.
"""

from __future__ import annotations

import types
import weakref
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

import torch

GROUPS = ("params", "grads", "optimizer")
_SKIP = (str, bytes, int, float, bool, complex, type(None), torch.dtype, torch.device,
         types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType,
         type)


def reachable_tensors(*roots: Any) -> Iterator[torch.Tensor]:
    """Every tensor reachable from ``roots`` through attributes, containers, module
    parameters/buffers/submodules and tensor ``__dict__`` entries (e.g. ``main_grad``). Each
    object is visited once; functions, methods, modules and classes are not entered."""
    seen: set[int] = set()
    stack = list(roots)
    while stack:
        obj = stack.pop()
        if isinstance(obj, _SKIP) or id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            yield obj
            stack.extend(getattr(obj, "__dict__", {}).values())
            continue
        if isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
        else:
            stack.extend(getattr(obj, "__dict__", {}).values())
            for name in getattr(type(obj), "__slots__", ()):
                if hasattr(obj, name):
                    stack.append(getattr(obj, name))


def storage_key(t: torch.Tensor) -> int:
    """Identity of ``t``'s storage (stable while it lives, also across resizes)."""
    return t.untyped_storage()._cdata


def device_storages(tensors: Iterable[torch.Tensor], device: torch.device,
                    exclude: set[int] | None = None) -> dict[int, torch.UntypedStorage]:
    """The distinct non-empty storages on ``device``'s type of ``tensors``, keyed by
    :func:`storage_key`, minus the keys in ``exclude``."""
    out: dict[int, torch.UntypedStorage] = {}
    for t in tensors:
        if t.device.type != device.type or t.is_meta:
            continue
        st = t.untyped_storage()
        k = st._cdata
        if st.nbytes() == 0 or k in out or exclude and k in exclude:
            continue
        out[k] = st
    return out


def actor_groups(ddp: torch.nn.Module, optimizer, device: torch.device,
                 extra_models: Iterable[torch.nn.Module] = ()
                 ) -> dict[str, dict[int, torch.UntypedStorage]]:
    """The ``grads``/``params``/``optimizer`` storages (module docstring) on ``device``; a
    storage belongs to the first group that claims it in that order."""
    params = [p for m in (ddp, *extra_models) for p in m.parameters()]
    grad_tensors = [b.grad_data for b in _ddp_buffers(ddp) if b.grad_data is not None]
    grad_tensors += [g for p in params for g in (getattr(p, "main_grad", None), p.grad)
                     if isinstance(g, torch.Tensor)]
    grads = device_storages(grad_tensors, device)
    taken = set(grads)
    model = device_storages(reachable_tensors(ddp, *extra_models), device, taken)
    taken |= set(model)
    opt = device_storages(reachable_tensors(optimizer), device, taken)
    return {"params": model, "grads": grads, "optimizer": opt}


def _ddp_buffers(ddp) -> list:
    return list(getattr(ddp, "buffers", []) or []) + \
        list(getattr(ddp, "expert_parallel_buffers", []) or [])


def _as_bytes(st: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over the whole of ``st`` (its current size)."""
    return torch.empty(0, dtype=torch.uint8, device=st.device).set_(st)


_ALIGN = 256  # bytes: every region of a flat buffer starts at a CUDA-friendly alignment


def aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to :data:`_ALIGN`."""
    return -(-nbytes // _ALIGN) * _ALIGN


def group_layout(sizes: list[int]) -> tuple[list[int], int]:
    """Byte offsets of storages of ``sizes`` bytes packed one after the other at 256-byte aligned
    offsets, and the buffer size they need: ``sum(aligned(n))``."""
    offsets, total = [], 0
    for n in sizes:
        offsets.append(total)
        total += aligned(n)
    return offsets, total


def _cudart_check(err, what: str) -> None:
    cudart = torch.cuda.cudart()
    if err != cudart.cudaError.success:
        raise RuntimeError(f"{what} failed: {cudart.cudaGetErrorString(err)}")


def _unregister(ptr: int) -> None:
    _cudart_check(torch.cuda.cudart().cudaHostUnregister(ptr), "cudaHostUnregister")


class HostBuffer:
    """One contiguous ``uint8`` host buffer of exactly ``nbytes`` bytes (host memory, not pinned
    memory from torch's caching host allocator: that one rounds every block up to a power of two
    and keeps freed blocks cached, up to 2x the bytes). With ``pin`` its pages are page-locked with
    ``cudaHostRegister`` (``tensor.is_pinned()`` is then true and copies to and from the device
    run asynchronously) and unlocked by :meth:`free` or when the buffer is collected."""

    def __init__(self, nbytes: int, pin: bool) -> None:
        self.nbytes = nbytes
        self.data: torch.Tensor | None = torch.empty(nbytes, dtype=torch.uint8, device="cpu")
        self.pinned = bool(pin and nbytes)
        self._unpin = None
        if self.pinned:
            ptr = self.data.data_ptr()
            _cudart_check(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0),
                          "cudaHostRegister")
            self._unpin = weakref.finalize(self, _unregister, ptr)
            self._unpin.atexit = False  # the process is going away: nothing to unlock

    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        """The bytes ``[offset, offset + nbytes)`` of the buffer (a view, no copy)."""
        assert self.data is not None, "HostBuffer used after free()"
        return self.data[offset:offset + nbytes]

    def free(self) -> None:
        """Unlock the pages and drop the buffer (its memory returns to the OS once no view of
        it is left)."""
        if self._unpin is not None:
            self._unpin()
        self.data = None


@dataclass
class _Slot:
    storage: torch.UntypedStorage
    nbytes: int
    host: torch.Tensor  # uint8 [nbytes]: this storage's slice of the group's HostBuffer


@dataclass
class StorageOffloader:
    """Offloads/onloads named groups of storages into one :class:`HostBuffer` per group, sliced
    into a view per storage; a group's buffer is reused while its total size stays the same, and
    replaced by one of the new exact size (the old one freed first) when it changes (the
    optimizer state after the first step)."""

    pin: bool = field(default_factory=torch.cuda.is_available)
    slots: dict[str, list[_Slot]] = field(default_factory=dict)
    buffers: dict[str, HostBuffer] = field(default_factory=dict)

    def offloaded(self, group: str) -> bool:
        return group in self.slots

    def host_bytes(self) -> int:
        """Bytes of every group's host buffer (what the offload holds in host memory)."""
        return sum(b.nbytes for b in self.buffers.values())

    def host_buffer(self, group: str, nbytes: int) -> HostBuffer:
        """The group's buffer of exactly ``nbytes`` bytes: the existing one when it has that size,
        else a new one (the old one freed before the new one is allocated)."""
        buf = self.buffers.get(group)
        if buf is not None and buf.nbytes == nbytes:
            return buf
        if buf is not None:
            del self.buffers[group]
            buf.free()
        buf = self.buffers[group] = HostBuffer(nbytes, self.pin)
        return buf

    def offload(self, group: str, storages: dict[int, torch.UntypedStorage]) -> int:
        """Copy every storage of ``group`` into its slice of the group's host buffer and free it on
        the device. Returns the bytes moved. The host copies are complete when this returns."""
        if group in self.slots:
            raise RuntimeError(f"offload group {group!r} is already offloaded")
        sts = list(storages.values())
        sizes = [st.nbytes() for st in sts]
        offsets, total = group_layout(sizes)
        buf = self.host_buffer(group, total)
        slots = [_Slot(st, n, buf.view(off, n)) for st, n, off in zip(sts, sizes, offsets)]
        for s in slots:
            s.host.copy_(_as_bytes(s.storage), non_blocking=buf.pinned)
        _synchronize(sts)
        for s in slots:
            s.storage.resize_(0)
        self.slots[group] = slots
        return sum(sizes)

    def onload(self, group: str) -> int:
        """Re-allocate every storage of ``group`` on its device and copy its bytes back."""
        slots = self.slots.pop(group, None)
        if slots is None:
            return 0
        pinned = self.buffers[group].pinned
        for s in slots:
            if s.storage.nbytes() != 0:
                raise RuntimeError(f"offload group {group!r}: a storage was re-allocated while "
                                   "offloaded (something used the actor between offload and "
                                   "onload)")
            s.storage.resize_(s.nbytes)
            _as_bytes(s.storage).copy_(s.host, non_blocking=pinned)
        _synchronize([s.storage for s in slots])
        return sum(s.nbytes for s in slots)


def _synchronize(storages: list[torch.UntypedStorage]) -> None:
    if any(st.device.type == "cuda" for st in storages):
        torch.cuda.synchronize()


class ActorOffload:
    """Offload/onload of one rank's :class:`~megatron_rl.actor.actor.Actor` (its DDP model,
    optimizer and a device-resident reference model or distillation teacher) or
    :class:`~megatron_rl.critic.critic.Critic` (its DDP model, value head and optimizer). Held
    outside the model."""

    def __init__(self, actor, device: torch.device | str | None = None) -> None:
        from megatron_rl.parallel.runtime import device as run_device

        self.actor = actor
        self.device = torch.device(device if device is not None else run_device())
        self.store = StorageOffloader()
        self.moved: dict[str, int] = {}

    def _groups(self) -> dict[str, dict[int, torch.UntypedStorage]]:
        a = self.actor
        # device-resident frozen models: the reference and the distillation teacher
        frozen = [m for m in (getattr(a, "ref_model", None), getattr(a, "teacher_model", None))
                  if m is not None]
        ref = frozen if frozen and not a.offload_ref else []
        return actor_groups(a.ddp, a.optimizer, self.device, ref)

    def offload(self, groups: Iterable[str] = GROUPS) -> dict[str, int]:
        """Offload ``groups`` (those not offloaded yet); bytes per group. Frees the CUDA cache
        so that colocated servers can take the memory."""
        todo = [g for g in groups if not self.store.offloaded(g)]
        if not todo:
            return {}
        wait = getattr(self.actor, "wait_for_save_copy", None)
        if wait is not None:  # an async checkpoint still copying these storages
            wait()
        found = self._groups()
        moved = {g: self.store.offload(g, found[g]) for g in todo}
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self.moved.update(moved)
        return moved

    def onload(self, groups: Iterable[str] = GROUPS) -> dict[str, int]:
        """Bring ``groups`` back (those offloaded); bytes per group."""
        return {g: self.store.onload(g) for g in groups if self.store.offloaded(g)}

    @property
    def offloaded_groups(self) -> list[str]:
        return [g for g in GROUPS if self.store.offloaded(g)]


class FrozenModelOffload:
    """A frozen model (the reference policy) whose weights live in host memory between passes.

    At construction every distinct storage of the model's parameters and buffers is packed, at
    256-byte aligned offsets, into ONE flat device buffer (a ``uint8`` storage that is created
    once and kept for the model's life: its tensors are re-pointed into it with ``set_``, so every
    parameter stays the same Python object and views that shared a storage still share it), and
    its bytes are copied once into a :class:`HostBuffer` of the same size (page-locked when CUDA
    is available).
    The weights never change, so:

    - :meth:`offload` only resizes the device buffer to 0 bytes (no copy back; its memory returns
      to the CUDA caching allocator for the update to use);
    - :meth:`onload` resizes it back and copies the host bytes in with one ``non_blocking`` copy
      (ordered on the current stream before the forward that reads it).

    Byte for byte, so the model computes exactly what it computed before it was offloaded. A
    weight touched while offloaded fails loudly (its storage has 0 bytes). The model starts
    offloaded.
    """

    def __init__(self, model: torch.nn.Module, pin: bool | None = None) -> None:
        tensors = [*model.parameters(), *model.buffers()]
        if not tensors:
            raise ValueError("FrozenModelOffload: the model has no parameters or buffers")
        self.device = tensors[0].device
        self.pin = torch.cuda.is_available() if pin is None else pin
        regions: dict[int, tuple[torch.UntypedStorage, int]] = {}  # key -> (storage, offset)
        total = 0
        for t in tensors:
            st = t.untyped_storage()
            if storage_key(t) not in regions:
                regions[storage_key(t)] = (st, total)
                total += aligned(st.nbytes())
        self.nbytes = total
        flat = torch.empty(total, dtype=torch.uint8, device=self.device)
        for st, off in regions.values():
            flat[off:off + st.nbytes()].copy_(_as_bytes(st))
        self.host_buffer = HostBuffer(total, self.pin)  # exact size (no power-of-two rounding)
        self.host = self.host_buffer.view(0, total)
        self.host.copy_(flat)
        self.storage = flat.untyped_storage()
        with torch.no_grad():
            for t in tensors:
                st, off = regions[storage_key(t)]
                item = t.element_size()
                t.set_(self.storage, off // item + t.storage_offset(), t.size(), t.stride())
        del flat
        self.onloaded = True
        self.offload()

    def offload(self) -> None:
        """Free the device copy (no data moves: the host copy is the weights)."""
        if self.onloaded:
            self.storage.resize_(0)
            self.onloaded = False

    def onload(self) -> None:
        """Re-allocate the device buffer and copy the weights in (non-blocking from pinned
        memory; stream-ordered before any kernel that reads them)."""
        if not self.onloaded:
            self.storage.resize_(self.nbytes)
            _as_bytes(self.storage).copy_(self.host, non_blocking=self.host_buffer.pinned)
            self.onloaded = True
