"""SLURM host lists and task counts, without SLURM: ``node[01-04],gpu7`` -> host names.

Torch-free, so that shell scripts can use it too::

    python -m megatron_rl.parallel.hostlist 'gpu[001-003]'    # one host per line
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys


def expand_hostlist(nodelist: str, use_scontrol: bool = True) -> list[str]:
    """Host names of a SLURM node list, in order: ``"node[01-03],gpu7"`` ->
    ``["node01", "node02", "node03", "gpu7"]``. Asks ``scontrol show hostnames`` when it is
    installed and answers, else parses the syntax itself (ranges keep their zero padding; several
    bracket groups in one name expand as a product)."""
    nodelist = nodelist.strip()
    if not nodelist:
        raise ValueError("empty SLURM node list")
    if use_scontrol and shutil.which("scontrol"):
        try:
            out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True,
                                 text=True, timeout=10, check=True).stdout.split()
            if out:
                return out
        except (subprocess.SubprocessError, OSError):
            pass  # no reachable slurm.conf (e.g. outside the cluster): parse it ourselves
    return [host for item in _split_top_level(nodelist) for host in _expand_one(item)]


def _split_top_level(text: str) -> list[str]:
    """Split at commas outside brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += (ch == "[") - (ch == "]")
        if depth < 0 or depth > 1:
            raise ValueError(f"malformed SLURM node list {text!r}")
        if ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise ValueError(f"malformed SLURM node list {text!r} (unclosed '[')")
    parts.append(text[start:])
    return [p for p in (s.strip() for s in parts) if p]


def _expand_one(name: str) -> list[str]:
    """Expand the bracket groups of one host expression (``"r[1-2]n[01-02]"`` -> 4 names)."""
    m = re.search(r"\[([^\]]*)\]", name)
    if m is None:
        return [name]
    head, tail = name[:m.start()], name[m.end():]
    return [head + num + rest for num in _expand_ranges(m.group(1), name)
            for rest in _expand_one(tail)]


def _expand_ranges(spec: str, name: str) -> list[str]:
    """``"01-03,7"`` -> ``["01", "02", "03", "7"]`` (zero padding of the range's start kept)."""
    out = []
    for part in spec.split(","):
        lo, _, hi = part.strip().partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            raise ValueError(f"malformed range {part!r} in SLURM node list {name!r}")
        if not hi:
            out.append(lo)
            continue
        if int(hi) < int(lo):
            raise ValueError(f"descending range {part!r} in SLURM node list {name!r}")
        out.extend(str(i).zfill(len(lo)) for i in range(int(lo), int(hi) + 1))
    return out


def tasks_per_node(spec: str) -> list[int]:
    """SLURM's compressed task counts per node: ``"4(x2),3"`` -> ``[4, 4, 3]`` ([] if empty)."""
    out: list[int] = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part)
        if m is None:
            raise ValueError(f"malformed SLURM tasks-per-node {spec!r}")
        out.extend([int(m.group(1))] * int(m.group(2) or 1))
    return out


def main(argv: list[str] | None = None) -> int:
    """Print the hosts of each node list given on the command line, one per line."""
    args = sys.argv[1:] if argv is None else argv
    if not args:
        print("usage: python -m megatron_rl.parallel.hostlist NODELIST...", file=sys.stderr)
        return 2
    try:
        for nodelist in args:
            print("\n".join(expand_hostlist(nodelist)))
    except ValueError as exc:
        print(f"hostlist: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
