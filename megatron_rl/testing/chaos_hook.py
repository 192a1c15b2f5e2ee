"""Phase markers for fault injection (``tools/chaos.py``); inert unless ``MRL_CHAOS_PHASE`` is set.

The trainer calls :func:`phase_begins` when a phase of a step begins (``rollout``, ``old_logp``,
``ref_logp``, ``update``, ``weight_sync``, ``validation``, and ``checkpoint`` once the new
checkpoint's files are written but before it is renamed into place). With ``MRL_CHAOS_PHASE=FILE``
every rank appends one JSON line ``{"step", "phase", "rank", "pid"}`` to FILE. With
``MRL_CHAOS_HOLD=STEP:PHASE:RANK`` that rank also writes ``"hold": true`` and waits there (until
``FILE.go`` exists, at most ``MRL_CHAOS_HOLD_S`` seconds, default 120) so that the injector
strikes while the other ranks are already inside the phase (typically blocked in its first
collective). With ``MRL_CHAOS_KILL=STEP:PHASE:RANK[:TIMES]`` that rank SIGKILLs itself there
(after writing ``"kill": true``), at most TIMES times (default 1) over the restarts of a job (the
kills already in FILE are counted): a rank dying mid-step, for the in-job restart
(``trainer.max_restarts``). Without ``MRL_CHAOS_PHASE`` the call is one dictionary lookup.
"""

from __future__ import annotations

import json
import os
import signal
import time

ENV = "MRL_CHAOS_PHASE"
HOLD_ENV = "MRL_CHAOS_HOLD"
HOLD_S_ENV = "MRL_CHAOS_HOLD_S"
KILL_ENV = "MRL_CHAOS_KILL"


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
    here = f"{step}:{phase}:{rank}"
    hold = os.environ.get(HOLD_ENV, "") == here
    kill = _kill_due(path, here)
    line = {"step": step, "phase": phase, "rank": rank, "pid": os.getpid(), "hold": hold}
    if kill:
        line["kill"] = True
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, (json.dumps(line) + "\n").encode())
    finally:
        os.close(fd)
    if kill:
        os.kill(os.getpid(), signal.SIGKILL)
    if hold:
        deadline = time.monotonic() + float(os.environ.get(HOLD_S_ENV, "120"))
        while not os.path.exists(path + ".go") and time.monotonic() < deadline:
            time.sleep(0.02)


def _kill_due(path: str, here: str) -> bool:
    """``MRL_CHAOS_KILL`` names ``here`` (``STEP:PHASE:RANK``) and FILE holds fewer kills than
    its TIMES."""
    spec = os.environ.get(KILL_ENV, "")
    if not spec:
        return False
    parts = spec.split(":")
    if ":".join(parts[:3]) != here:
        return False
    times = int(parts[3]) if len(parts) > 3 else 1
    done = 0
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            done = sum('"kill": true' in x for x in f)
    return done < times
