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
    servers listen on consecutive ports), below the kernel's ephemeral range
    (``ip_local_port_range``): a port of that range, free when chosen, can be handed to any
    socket bound to port 0 or connecting out (the ranks' gloo sockets, HTTP clients) before the
    server binds it, and the server then fails with ``Address already in use``."""
    import random

    low = ephemeral_low()
    rng = random.Random()
    for _ in range(200):
        p = rng.randrange(10000, max(10001, low - n))
        if all(port_free(p + i, host) for i in range(n)):
            return p
    raise RuntimeError("no free port block")


def ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (32768 where it cannot be read)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


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
