"""Host resources of this process, logged every step (``sys/rss_mb``, ``sys/open_fds``) so that a
slow leak of memory or file descriptors shows in the metrics (rank 0's process)."""

from __future__ import annotations

import os


def rss_mb() -> float:
    """Resident set size of this process in MiB (``/proc/self/statm``; ru_maxrss elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # peak, KiB on Linux


def open_fds() -> int:
    """Open file descriptors of this process (-1 where /proc is unavailable)."""
    for d in ("/proc/self/fd", "/dev/fd"):
        try:
            return len(os.listdir(d)) - 1  # the listing's own descriptor
        except OSError:
            continue
    return -1


def host_stats() -> dict[str, float]:
    return {"sys/rss_mb": rss_mb(), "sys/open_fds": float(open_fds())}
