"""Which torch.distributed backend a run uses (``parallel.backend``), decided without importing
torch: the launcher and config loading use it before any rank starts."""

from __future__ import annotations

import os

BACKENDS = ("auto", "nccl", "gloo")
BACKEND_ENV = "MRL_PARALLEL_BACKEND"  # used when the caller passes None or "auto"


class ParallelConfigError(ValueError):
    """The requested parallel layout cannot run on this world."""


def resolve_backend(requested: str, local_world: int, cuda_count: int) -> str:
    """The backend to run: ``"nccl"`` or ``"gloo"`` (pure: no CUDA or environment access).

    ``requested`` is ``parallel.backend``: ``gloo`` always runs (CPU ranks); ``auto`` is NCCL when
    any GPU is visible and gloo otherwise; NCCL needs one visible GPU per rank of this node, so
    ``local_world > cuda_count`` is refused with the two ways out (gloo, or fewer ranks).
    """
    if requested not in BACKENDS:
        raise ParallelConfigError(f"parallel.backend={requested!r} is not one of {BACKENDS}")
    if requested == "gloo":
        return "gloo"
    if cuda_count == 0:
        if requested == "nccl":
            raise ParallelConfigError(
                "parallel.backend=nccl needs CUDA GPUs but none is visible; use "
                "parallel.backend: gloo (or auto) to run the ranks on the CPU")
        return "gloo"
    if local_world > cuda_count:
        raise ParallelConfigError(
            f"{local_world} ranks on this node but only {cuda_count} visible GPU(s): NCCL needs "
            f"one GPU per rank. Use parallel.backend: gloo (CPU ranks; {BACKEND_ENV}=gloo for "
            f"`check`, `convert` and the tests) or start at most {cuda_count} rank(s) per node "
            "(smaller parallel.tp x pp x dp, or more nodes)")
    return "nccl"


def gpu_driver_present() -> bool:
    """Whether this machine has an NVIDIA or ROCm GPU driver loaded (no torch import)."""
    return any(os.path.exists(p) for p in ("/dev/nvidiactl", "/proc/driver/nvidia", "/dev/kfd"))


def visible_gpu_count() -> int:
    """``torch.cuda.device_count()``; on a machine without a GPU driver
    (:func:`gpu_driver_present`), or with ``CUDA_VISIBLE_DEVICES`` empty, 0 without importing
    torch."""
    if os.environ.get("CUDA_VISIBLE_DEVICES") == "" or not gpu_driver_present():
        return 0
    import torch

    return torch.cuda.device_count()
