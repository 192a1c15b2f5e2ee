"""Process and port helpers shared by the multi-process tests and ``tools/chaos.py``."""

from __future__ import annotations

import socket


def port_free(port: int, host: str = "127.0.0.1") -> bool:
    """Whether ``port`` can be bound on ``host`` right now."""
    with socket.socket() as s:
        try:
            s.bind((host, port))
            return True
        except OSError:
            return False


def free_port_block(n: int, host: str = "127.0.0.1") -> int:
    """A port ``p`` with ``p .. p+n-1`` all free on ``host`` right now (a router and its
    servers listen on consecutive ports)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind((host, 0))
            p = s.getsockname()[1]
        if p + n < 65535 and all(port_free(p + i, host) for i in range(n)):
            return p
    raise RuntimeError("no free port block")


def alive(procs) -> list[int]:
    """Pids of the ``psutil.Process`` objects in ``procs`` that still run (zombies excluded)."""
    import psutil

    left = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                left.append(p.pid)
        except psutil.Error:
            pass
    return left
