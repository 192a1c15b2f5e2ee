"""``python -m megatron_rl.rollout.guard PARENT_PID CMD...``: run CMD and end it when the
parent process is gone or this guard is terminated, so a crashed trainer leaves no orphan
rollout server or router behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time


def alive(pid: int) -> bool:
    """Whether process ``pid`` still exists."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def descendants(pid: int) -> list:
    """Every process below ``pid`` (psutil handles; [] when psutil or the process is gone)."""
    try:
        import psutil

        return psutil.Process(pid).children(recursive=True)
    except Exception:  # noqa: BLE001
        return []


def main(argv: list[str]) -> int:
    parent, cmd = int(argv[0]), argv[1:]
    watch_ppid = os.getppid() == parent  # started by PARENT: also notice its exit as a zombie
    child = subprocess.Popen(cmd)

    def stop(*_args) -> None:
        tree = descendants(child.pid)  # SGLang's scheduler/detokenizer processes too
        if child.poll() is None:
            child.terminate()
            try:
                child.wait(timeout=10)
            except subprocess.TimeoutExpired:
                child.kill()
        for p in tree:
            try:
                p.kill()
            except Exception:  # noqa: BLE001 - already gone
                pass
        sys.exit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    while child.poll() is None:
        if not alive(parent) or (watch_ppid and os.getppid() != parent):
            stop()
        time.sleep(1.0)
    return child.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
