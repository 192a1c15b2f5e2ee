"""A device-discipline spy for tests: catches, on CPU, the code that would crash on a GPU.

On a CPU-only machine every tensor is on the CPU, so a tensor made without ``device=`` looks
right and a ``.item()`` costs nothing; on a GPU the same line makes a CPU tensor that meets CUDA
tensors (or an NCCL collective) and crashes, or stalls the stream once per micro-batch. The
:class:`DeviceSpy` (a ``TorchFunctionMode``) records, while active:

* **factory calls without a device**: ``torch.zeros/ones/empty/full/tensor/arange/rand*/eye/
  linspace/scalar_tensor`` (and ``as_tensor`` of non-tensor data) called from project code
  (files under ``roots``) without a ``device=`` argument -- exactly the lines behind the CUDA
  crashes of issue 10 (``torch.zeros(())`` in the update's NaN flags, ``torch.arange(S)`` for
  the position ids, ``torch.tensor([...])`` for the last-stage rank);
* **host syncs in the per-micro-batch path**: ``.item()``, ``.cpu()``, ``.tolist()``,
  ``.numpy()``, ``float()``/``int()``/``bool()`` of a tensor, called from project code while a
  frame named in ``micro_batch_functions`` is on the stack;
* **tensors on another device**: the result of every call made from project code whose device
  differs from ``device`` (the batch's).

``*_like`` / ``Tensor.new_*`` factories inherit their input's device and are not flagged; an
explicit ``device="cpu"`` is a stated host tensor and is accepted; a line commented
``# device-spy: ok (reason)`` is an audited exception.
"""

from __future__ import annotations

import linecache
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

FACTORIES = {torch.zeros, torch.ones, torch.empty, torch.full, torch.tensor, torch.arange,
             torch.rand, torch.randn, torch.randint, torch.eye, torch.linspace,
             torch.scalar_tensor, torch.as_tensor}
HOST_SYNCS = {"item", "cpu", "tolist", "numpy", "__float__", "__int__", "__bool__"}
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MICRO_BATCH_FUNCTIONS = ("forward_step", "loss_func", "collect")
#: A source line carrying this comment is an audited exception (e.g. a check that only runs for
#: CPU tensors); the reason must follow it on the line.
ALLOW_MARK = "device-spy: ok"
# megatron-core's own ``device="cuda"`` calls, redirected to the CPU by the compatibility layer.
_CPU_COMPAT = os.path.join(PACKAGE_ROOT, "parallel", "cpu_compat.py")


@dataclass
class Violation:
    kind: str  # "factory_without_device" | "host_sync" | "other_device"
    what: str
    where: str

    def __str__(self) -> str:
        return f"{self.kind}: {self.what} at {self.where}"


def _func_name(func: Any) -> str:
    return getattr(func, "__name__", None) or str(func)


@dataclass
class DeviceSpy(TorchFunctionMode):
    """Records :class:`Violation` s of project code (see module docstring)."""

    device: torch.device
    roots: tuple[str, ...] = (PACKAGE_ROOT,)
    micro_batch_functions: tuple[str, ...] = MICRO_BATCH_FUNCTIONS
    violations: list[Violation] = field(default_factory=list)
    calls: int = 0  # calls from project code seen (proves the spy was on the path)

    def __post_init__(self) -> None:
        super().__init__()
        self.device = torch.device(self.device)
        self.roots = tuple(os.path.abspath(r) for r in self.roots)

    # ---- stack inspection ---------------------------------------------------------------------
    def _project_caller(self) -> tuple[str | None, list[str]]:
        """``file:line`` of the innermost project frame that is the direct caller (frames of
        torch itself and of this module skipped), and the function names on the stack."""
        f = sys._getframe(1)
        caller = None
        names = []
        skip = (os.path.dirname(torch.__file__), os.path.abspath(__file__), _CPU_COMPAT)
        while f is not None:
            fn = os.path.abspath(f.f_code.co_filename)
            if caller is None and not fn.startswith(skip):
                if fn.startswith(self.roots):
                    if ALLOW_MARK in linecache.getline(fn, f.f_lineno):
                        return None, []  # an audited exception, marked on the line itself
                    caller = f"{os.path.relpath(fn, PACKAGE_ROOT)}:{f.f_lineno}"
                else:
                    return None, []  # called from a library (megatron, torch): not ours
            if caller is not None and fn.startswith(self.roots):
                names.append(f.f_code.co_name)
            f = f.f_back
        return caller, names

    # ---- the mode -----------------------------------------------------------------------------
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        caller, names = self._project_caller()
        if caller is not None:
            self.calls += 1
            self._check_call(func, args, kwargs, caller, names)
        out = func(*args, **kwargs)
        if caller is not None:
            self._check_outputs(func, out, caller)
        return out

    def _check_call(self, func, args, kwargs, caller: str, names: list[str]) -> None:
        name = _func_name(func)
        if func in FACTORIES and kwargs.get("device") is None:
            data_is_tensor = func is torch.as_tensor and args and isinstance(args[0],
                                                                            torch.Tensor)
            if not data_is_tensor:
                self.violations.append(Violation("factory_without_device", f"torch.{name}",
                                                 caller))
        if name in HOST_SYNCS and any(n in self.micro_batch_functions for n in names):
            self.violations.append(Violation("host_sync", f"Tensor.{name}", caller))

    def _check_outputs(self, func, out, caller: str) -> None:
        if _func_name(func) in HOST_SYNCS or _func_name(func) in ("to", "detach_", "copy_"):
            return  # a host copy is flagged above where it matters; explicit moves are allowed
        for t in _tensors(out):
            if t.device != self.device:
                self.violations.append(Violation(
                    "other_device", f"{_func_name(func)} -> {t.device}", caller))

    def report(self) -> str:
        """One line per distinct violation."""
        return "\n".join(sorted({str(v) for v in self.violations}))


def _tensors(out: Any) -> Iterable[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        yield out
    elif isinstance(out, (tuple, list)):
        for o in out:
            if isinstance(o, torch.Tensor):
                yield o


class CountHostSyncs(TorchDispatchMode):
    """Counts device→host syncs (``aten._local_scalar_dense``: ``.item()``, ``bool(t)``, …) in
    the ``with`` block: ``with CountHostSyncs() as c: ...; assert c.n == 0``."""

    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.n += 1
        return func(*args, **(kwargs or {}))
