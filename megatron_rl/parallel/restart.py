"""In-job restart: run a job's ranks again from the newest checkpoint when one of them fails.

When a rank or a process it started dies (an exit code, a signal, the out-of-memory killer) or a
rank fails (a gloo/NCCL timeout, an exception), the launcher stops every other rank and helper
and starts all ranks again, at most ``trainer.max_restarts`` times, waiting
``trainer.restart_backoff_s * 2 ** (k - 1)`` seconds (at most :data:`MAX_BACKOFF_S`) before the
k-th restart, and printing why each restart happens. The restarted ranks see
``MRL_RESTART=k`` (:data:`RESTART_ENV`) and resume from the newest complete checkpoint (also with
``trainer.resume=false``); ``metrics.jsonl`` then drops the rows after that checkpoint's step, so
each step is logged once.

- :func:`run_with_restarts`: the loop (shared by the local launcher and the SLURM supervisor);
- the local launcher (``python -m megatron_rl train``) runs it around its spawned rank group;
- under SLURM, ``python -m megatron_rl.cli.restart -- srun ... python -m megatron_rl train
  CONFIG ...`` (:func:`supervise`) runs it around the ``srun`` step inside the allocation
  (each try is a new step: a new rendezvous port); ``srun --kill-on-bad-exit=1`` stops the step
  when one task fails.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass
from typing import Callable, Sequence

RESTART_ENV = "MRL_RESTART"  # the restart count (0: the first try) the ranks see
MAX_BACKOFF_S = 600.0
NO_RESTART_CODES = (2,)  # usage / config errors and refused launches: a restart cannot help


class RestartsExhausted(RuntimeError):
    """The job failed again after ``max_restarts`` restarts; the message says why each try
    ended."""


@dataclass(frozen=True)
class RestartPolicy:
    """``max_restarts`` restarts at most; the k-th (1-based) after :meth:`backoff_s` seconds."""

    max_restarts: int = 0
    backoff_s: float = 5.0

    def backoff(self, k: int) -> float:
        """Seconds to wait before restart ``k`` (1-based): ``backoff_s * 2**(k-1)``, capped."""
        return min(MAX_BACKOFF_S, self.backoff_s * 2 ** max(0, k - 1))

    @classmethod
    def of(cls, trainer) -> RestartPolicy:
        """The policy of a config's ``trainer`` section."""
        return cls(int(trainer.max_restarts), float(trainer.restart_backoff_s))


def restart_count(environ=None) -> int:
    """This process's restart count (``MRL_RESTART``; 0 on the first try)."""
    value = (os.environ if environ is None else environ).get(RESTART_ENV, "0")
    return int(value) if value.isdigit() else 0


def failure_reason(message: str) -> str:
    """One line saying why a try ended: the first line of a launcher's message, plus the last
    line of a rank's traceback when there is one (``rank 0 of 2 failed: ... -> RuntimeError: ...``).
    """
    lines = [x.strip() for x in str(message).strip().splitlines() if x.strip()]
    if not lines:
        return "unknown failure"
    head, tail = lines[0], lines[-1]
    return head if len(lines) == 1 or "Traceback" not in message else f"{head} {tail}"


def run_with_restarts(attempt: Callable[[int], str | None], policy: RestartPolicy,
                      log: Callable[[str], None], what: str = "the job",
                      sleep: Callable[[float], None] = time.sleep) -> int:
    """Call ``attempt(k)`` for k = 0, 1, ... until it returns None (success); a returned string
    is why try k failed. Restarts at most ``policy.max_restarts`` times, logging the reason and
    the wait; then raises :class:`RestartsExhausted`. Returns the number of restarts made."""
    reasons: list[str] = []
    for k in range(policy.max_restarts + 1):
        reason = attempt(k)
        if reason is None:
            if k:
                log(f"{what} finished after {k} restart(s)")
            return k
        reasons.append(reason)
        if k == policy.max_restarts:
            break
        wait = policy.backoff(k + 1)
        log(f"restart {k + 1} of {policy.max_restarts} in {wait:.0f} s: {reason}; restarting "
            f"{what} from the newest checkpoint")
        sleep(wait)
    tries = "; ".join(f"try {i + 1}: {r}" for i, r in enumerate(reasons))
    raise RestartsExhausted(
        f"{what} failed {len(reasons)} time(s), giving up after {len(reasons) - 1} restart(s) "
        f"(trainer.max_restarts={policy.max_restarts}): {tries}")


# ---- SLURM (or any launcher command): rerun a command that fails ------------------------------

def supervise(cmd: Sequence[str], policy: RestartPolicy,
              log: Callable[[str], None] = print) -> int:
    """Run ``cmd`` (e.g. an ``srun`` step) until it exits 0, restarting it per ``policy`` with
    ``MRL_RESTART=k`` in its environment. Exit 2 of the command (a refused launch or config) is
    not retried; SIGTERM/SIGINT/SIGHUP to the supervisor are passed to the command and end the
    supervision (exit ``128 + signal``). Returns the exit code to leave with."""
    from megatron_rl.parallel.lifecycle import STOP_SIGNALS, describe_exit

    stopped: list[int] = []
    child: list[subprocess.Popen] = []

    def _forward(signum, _frame) -> None:
        stopped.append(signum)
        if child and child[0].poll() is None:
            child[0].send_signal(signum)

    def attempt(k: int) -> str | None:
        if stopped:
            raise _NoRestart(128 + stopped[0])
        proc = subprocess.Popen(list(cmd), env={**os.environ, RESTART_ENV: str(k)})
        child[:] = [proc]
        rc = proc.wait()
        if stopped:
            raise _NoRestart(128 + stopped[0])
        if rc == 0:
            return None
        if rc in NO_RESTART_CODES:
            raise _NoRestart(rc)
        return f"{os.path.basename(cmd[0])} ended with {describe_exit(rc)}"

    old = {s: signal.signal(s, _forward) for s in STOP_SIGNALS}
    try:
        run_with_restarts(attempt, policy, lambda m: log(f"[restart] {m}"),
                          what=f"{os.path.basename(cmd[0])} step",
                          sleep=lambda s: _sleep_unless(s, stopped))
    except _NoRestart as exc:
        if not stopped:
            log(f"[restart] {cmd[0]} exited with {exc.rc} (refused launch or config error); "
                "not restarted")
        return exc.rc
    except RestartsExhausted as exc:
        log(f"[restart] error: {exc}")
        return 1
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    return 0


def _sleep_unless(seconds: float, stopped: list[int]) -> None:
    """Sleep ``seconds``, or less once ``stopped`` is not empty (a stop signal came)."""
    end = time.monotonic() + seconds
    while not stopped and time.monotonic() < end:
        time.sleep(min(0.2, max(0.0, end - time.monotonic())))


class _NoRestart(Exception):
    def __init__(self, rc: int) -> None:
        super().__init__(rc)
        self.rc = rc
