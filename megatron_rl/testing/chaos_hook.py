"""Phase markers for fault injection (``tools/chaos.py``); inert unless ``MRL_CHAOS_PHASE`` is set.

The trainer calls :func:`phase_begins` when a phase of a step begins (``rollout``, ``old_logp``,
``ref_logp``, ``update``, ``weight_sync``, ``validation``, and ``checkpoint`` once the new
checkpoint's files are written but before it is renamed into place). With ``MRL_CHAOS_PHASE=FILE``
every rank appends one JSON line ``{"step", "phase", "rank", "pid"}`` to FILE. With
``MRL_CHAOS_HOLD=STEP:PHASE:RANK`` that rank also writes ``"hold": true`` and waits there (until
``FILE.go`` exists, at most ``MRL_CHAOS_HOLD_S`` seconds, default 120) so that the injector
strikes while the other ranks are already inside the phase (typically blocked in its first
collective). Without the variable the call is one dictionary lookup.
"""

from __future__ import annotations

import json
import os
import time

ENV = "MRL_CHAOS_PHASE"
HOLD_ENV = "MRL_CHAOS_HOLD"
HOLD_S_ENV = "MRL_CHAOS_HOLD_S"


def phase_begins(phase: str, step: int) -> None:
    """Mark that ``phase`` of RL step ``step`` (0-based) begins on this rank (see module doc)."""
    path = os.environ.get(ENV)
    if path:
        _mark(path, phase, step)


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _mark(path: str, phase: str, step: int) -> None:
    rank = _rank()
    hold = os.environ.get(HOLD_ENV, "") == f"{step}:{phase}:{rank}"
    line = {"step": step, "phase": phase, "rank": rank, "pid": os.getpid(), "hold": hold}
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, (json.dumps(line) + "\n").encode())
    finally:
        os.close(fd)
    if hold:
        deadline = time.monotonic() + float(os.environ.get(HOLD_S_ENV, "120"))
        while not os.path.exists(path + ".go") and time.monotonic() < deadline:
            time.sleep(0.02)
