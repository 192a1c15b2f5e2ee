"""Where a run's checkpoints are: ``ROOT/latest`` names the newest complete ``step_*`` directory.
Torch-free, so that the launcher's resume preflight imports no torch (the checkpoint format
itself is :mod:`megatron_rl.actor.checkpoint`)."""

from __future__ import annotations

import os

LATEST = "latest"


class CheckpointError(RuntimeError):
    """A checkpoint cannot be read or does not fit this run."""


def step_dir_name(step: int) -> str:
    return f"step_{step:07d}"


def latest_checkpoint(root: str) -> str | None:
    """Path of the newest complete checkpoint under ``root``, or None."""
    path = os.path.join(root, LATEST)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        name = f.read().strip()
    full = os.path.join(root, name)
    if not os.path.isdir(full):
        raise CheckpointError(f"{path} names {name!r} but {full} does not exist")
    return full
