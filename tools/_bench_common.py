"""Helpers shared by the benchmark scripts in ``tools/`` (imported as a sibling module)."""


def rss_kib(field: str) -> int:
    """A memory field of ``/proc/self/status`` in KiB (e.g. ``VmRSS``, ``VmHWM``)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS counter (VmHWM) to the current RSS; False if unsupported."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False
