"""Process lifecycle of a local job: stop signals, dead-parent watchdogs, the run-directory lock.

- :func:`stop_signals`: inside it, SIGTERM / SIGINT / SIGHUP raise :class:`StopSignal` in the
  main thread, so the launcher's ``finally`` stops every rank and helper (bounded by
  :data:`STOP_BOUND_S`) and exits ``128 + signal``.
- :func:`stop_tree`: terminate a set of processes and everything below them, then kill what is
  left, within a deadline.
- :func:`watch_parent`: a rank started by the local launcher kills its own process group (itself,
  reward workers, checkpoint writers) when the launcher disappears, even a SIGKILLed one.
- :func:`die_with_parent`: ``PR_SET_PDEATHSIG`` (Linux) for helper processes.
- :class:`RunLock`: an exclusive ``fcntl.flock`` on ``OUTPUT_DIR/run.lock`` (holder pid, host and
  command recorded in it); a second live trainer is refused with :class:`RunDirBusy`; a lock file
  left by a dead process is taken over (the kernel released its lock).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import socket
import sys
import threading
import time
from typing import Iterable, Iterator

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
STOP_BOUND_S = 30.0  # documented bound: stop signal -> no process of the job left
LOCK_NAME = "run.lock"
_PR_SET_PDEATHSIG = 1


class StopSignal(BaseException):
    """A stop signal reached the launcher; ``signum`` is the signal number. A BaseException so
    that ``except Exception`` blocks on the way do not swallow it."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"received {signal.Signals(signum).name}")
        self.signum = signum
        self.at = time.monotonic()


class RunDirBusy(RuntimeError):
    """Another live process holds the run directory's lock."""


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def describe_exit(code: int | None) -> str:
    """``multiprocessing`` exit code -> words: ``exit code 3``, ``killed by SIGKILL``."""
    if code is None:
        return "still running"
    return f"killed by {signal_name(-code)}" if code < 0 else f"exit code {code}"


@contextlib.contextmanager
def stop_signals(signals: Iterable[int] = STOP_SIGNALS) -> Iterator[None]:
    """Turn ``signals`` into :class:`StopSignal` in the main thread while inside the block (no-op
    outside the main thread, where handlers cannot be installed)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    fired: list[int] = []

    def _raise(signum, _frame):
        if not fired:  # a second signal must not interrupt the cleanup the first one started
            fired.append(signum)
            raise StopSignal(signum)

    old = {s: signal.signal(s, _raise) for s in signals}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def descendants(pid: int) -> list[int]:
    """Pids of every live process below ``pid`` (children first)."""
    import psutil

    try:
        return [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return []


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def stop_tree(pids: Iterable[int], term_wait_s: float = 10.0,
              kill_wait_s: float = 5.0) -> list[int]:
    """SIGTERM ``pids`` and all their descendants (looked up now), wait up to ``term_wait_s``,
    SIGKILL the survivors, wait up to ``kill_wait_s``. Returns the pids still alive (none in
    practice; a process stuck in uninterruptible I/O may outlive SIGKILL for a while)."""
    roots = list(pids)
    tree = list(dict.fromkeys([*roots, *(d for p in roots for d in descendants(p))]))
    for p in tree:
        _signal(p, signal.SIGTERM)
    left = _wait_gone(tree, term_wait_s)
    for p in left:
        _signal(p, signal.SIGKILL)
    return _wait_gone(left, kill_wait_s)


def _wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    left = [p for p in pids if _alive(p)]
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = [p for p in left if _alive(p)]
    return left


def remove_partial_checkpoints(run_dir: str) -> list[str]:
    """Delete the unfinished ``step_*.tmp`` checkpoint directories of a stopped run (the complete
    checkpoints and ``latest`` are untouched). Call only when no rank of the run is alive."""
    import glob
    import shutil

    doomed = sorted(glob.glob(os.path.join(run_dir, "*checkpoints", "step_*.tmp")))
    for d in doomed:
        shutil.rmtree(d, ignore_errors=True)
    return doomed


def die_with_parent(sig: int = signal.SIGKILL, parent: int | None = None) -> None:
    """Ask Linux to send ``sig`` to this process when its parent exits (``PR_SET_PDEATHSIG``);
    if ``parent`` (the expected parent pid) is already gone, send it now. No-op elsewhere."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except (OSError, AttributeError):
        return
    if parent is not None and os.getppid() != parent:
        os.kill(os.getpid(), sig)


def watch_parent(parent: int, interval_s: float = 0.5) -> threading.Thread:
    """Start a daemon thread that SIGKILLs this process's whole process group (this process and
    what it started in it) once ``parent`` is no longer its parent. Call in a process that leads
    its own group (``os.setpgid(0, 0)``)."""

    def _watch() -> None:
        while os.getppid() == parent:
            time.sleep(interval_s)
        os.killpg(os.getpgrp(), signal.SIGKILL)

    th = threading.Thread(target=_watch, name="mrl-parent-watchdog", daemon=True)
    th.start()
    return th


class RunLock:
    """Exclusive lock of a run directory (``fcntl.flock`` on ``run.lock``; released by the kernel
    when the holder exits, however it exits). ``acquire()`` raises :class:`RunDirBusy` naming the
    live holder; a lock file left by a dead holder is taken over (``taken_over`` holds its record).
    Local file systems only: ``flock`` is not reliable across nodes on every network file system."""

    def __init__(self, run_dir: str) -> None:
        self.run_dir = run_dir
        self.path = os.path.join(run_dir, LOCK_NAME)
        self.fd: int | None = None
        self.taken_over: dict | None = None

    def acquire(self) -> RunLock:
        import fcntl

        os.makedirs(self.run_dir, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_record(fd)
            os.close(fd)
            who = (f"pid {holder.get('pid')} on {holder.get('host')}, started "
                   f"{holder.get('started')}: {holder.get('command')}" if holder else
                   "another process")
            raise RunDirBusy(
                f"run directory {self.run_dir} is in use by a live trainer ({who}); wait for it "
                f"or stop it (kill -TERM {holder.get('pid', 'PID')}), or use another output_dir"
            ) from None
        old = _read_record(fd)
        self.taken_over = old or None
        record = {"pid": os.getpid(), "host": socket.gethostname(),
                  "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                  "command": " ".join(sys.argv)[:500]}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
        os.fsync(fd)
        self.fd = fd
        return self

    def release(self) -> None:
        """Empty the record (a clean exit leaves no stale holder) and unlock."""
        import fcntl

        if self.fd is None:
            return
        with contextlib.suppress(OSError):
            os.ftruncate(self.fd, 0)
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)
        self.fd = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _read_record(fd: int) -> dict:
    try:
        raw = os.pread(fd, 4096, 0).decode(errors="replace").strip()
        return json.loads(raw) if raw else {}
    except (OSError, ValueError):
        return {"pid": "?", "host": "?", "started": "?", "command": "(unreadable lock record)"}
