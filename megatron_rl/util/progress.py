"""Progress of long-running commands, on stderr and on rank 0 only (no dependencies).

On a terminal (``stream.isatty()``) a bar is redrawn in place with ``\\r``; otherwise (logs, pipes,
SLURM output files) plain lines are printed every ``every_frac`` of the total and at least every
``every_s`` seconds, so a log shows the job is alive without flooding it. stdout is never written:
summary lines that scripts parse stay as they are.

``MRL_PROGRESS=0`` turns every progress display off; ``MRL_PROGRESS=1`` forces the plain lines
even where ``min_s`` would hold them back.

Example::

    with Progress(len(items), "convert", unit="tensors") as bar:
        for item in items:
            work(item)
            bar.update()
"""

from __future__ import annotations

import os
import sys
import time
from typing import Callable, Iterable, Iterator, TextIO, TypeVar

T = TypeVar("T")
ENV = "MRL_PROGRESS"
BAR_WIDTH = 24


def is_rank0() -> bool:
    """True unless this process is a rank other than 0 (``torch.distributed`` when it is
    initialised, else ``RANK`` / ``SLURM_PROCID`` of the environment)."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and getattr(dist, "is_available", lambda: False)() and \
            dist.is_initialized():
        return dist.get_rank() == 0
    return os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) == "0"


def _fmt_s(s: float) -> str:
    s = max(0.0, s)
    if s < 60:
        return f"{s:.0f}s"
    if s < 3600:
        return f"{int(s // 60)}m{int(s % 60):02d}s"
    return f"{int(s // 3600)}h{int(s % 3600 // 60):02d}m"


class Progress:
    """Progress of ``total`` units of work (``None``: unknown total, counts only).

    ``stream``: default ``sys.stderr``. ``enabled``: default rank 0 and ``MRL_PROGRESS != 0``.
    ``every_frac`` / ``every_s``: plain-line cadence off a terminal. ``min_s``: off a terminal,
    print nothing until the work has run this long (short tasks stay silent in logs).
    ``transient``: on a terminal, erase the bar when done (for bars inside a loop that prints
    its own lines, e.g. the trainer's steps). ``clock``: for tests.
    """

    def __init__(self, total: int | None, desc: str, *, unit: str = "", stream: TextIO | None
                 = None, enabled: bool | None = None, every_frac: float = 0.1,
                 every_s: float = 30.0, min_s: float = 0.0, transient: bool = False,
                 clock: Callable[[], float] = time.monotonic) -> None:
        env = os.environ.get(ENV, "")
        self.total, self.desc, self.unit = total, desc, unit
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = (is_rank0() if enabled is None else enabled) and env != "0"
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.every_frac, self.every_s = every_frac, every_s
        self.min_s = 0.0 if env == "1" else min_s
        self.transient, self.clock = transient, clock
        self.n = 0
        self.info = ""
        self.t0 = self._t_line = self._t_draw = clock()
        self._ticks = 0  # every_frac steps already reported
        self._drawn = 0  # width of the bar on screen (TTY)
        self._lines = 0  # plain lines printed
        self._closed = False

    # ---- updates ----------------------------------------------------------------------------
    def update(self, n: int = 1, info: str = "") -> None:
        """``n`` more units done; ``info``: a short note shown after the counts."""
        self.set(self.n + n, info)

    def set(self, n: int, info: str = "") -> None:
        """``n`` units done in all."""
        self.n = n
        if info:
            self.info = info
        if not self.enabled or self._closed:
            return
        now = self.clock()
        if self.tty:
            if now - self._t_draw >= 0.1 or self._finished():
                self._t_draw = now
                self._draw()
            return
        if now - self.t0 < self.min_s or self._finished():  # close() prints the last line
            return
        ticks = int(self.n / self.total / self.every_frac + 1e-9) if self.total else 0
        if ticks > self._ticks or now - self._t_line >= self.every_s:
            self._line(now)
            self._ticks = ticks

    def close(self) -> None:
        """The last line (plain) or the finished bar (TTY; erased when ``transient``)."""
        if self._closed:
            return
        self._closed = True
        if not self.enabled:
            return
        if self.tty:
            if self.transient:
                if self._drawn:
                    self.stream.write("\r" + " " * self._drawn + "\r")
            else:
                self._draw()
                self.stream.write("\n")
            self.stream.flush()
            return
        now = self.clock()
        if self._lines or now - self.t0 >= self.min_s:
            self._line(now, done=True)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, exc_type, *_exc) -> None:
        if exc_type is None:
            self.close()
            return
        if self.enabled and self.tty and self._drawn and not self._closed:
            self.stream.write("\n")  # keep the bar where it stopped; the error follows
        self._closed = True  # no "done" line for work that failed

    # ---- text -------------------------------------------------------------------------------
    def _finished(self) -> bool:
        return self.total is not None and self.n >= self.total

    def counts(self) -> str:
        """``"3/10 tensors (30%)"`` or ``"3 tensors"`` (unknown total)."""
        unit = f" {self.unit}" if self.unit else ""
        if not self.total:
            return f"{self.n}{unit}"
        return f"{self.n}/{self.total}{unit} ({100 * self.n / self.total:.0f}%)"

    def _times(self, now: float) -> str:
        el = now - self.t0
        text = f"{_fmt_s(el)} elapsed"
        if self.total and 0 < self.n < self.total:
            text += f", ~{_fmt_s(el / self.n * (self.total - self.n))} left"
        return text

    def _line(self, now: float, done: bool = False) -> None:
        self._t_line = now
        self._lines += 1
        tail = f"; {self.info}" if self.info else ""
        word = "done: " if done else ""
        self.stream.write(f"[{self.desc}] {word}{self.counts()}, {self._times(now)}{tail}\n")
        self.stream.flush()

    def _draw(self) -> None:
        now = self.clock()
        if self.total:
            fill = int(BAR_WIDTH * min(self.n, self.total) / self.total)
            bar = "[" + "#" * fill + "." * (BAR_WIDTH - fill) + "] "
        else:
            bar = ""
        tail = f" {self.info}" if self.info else ""
        text = f"{self.desc} {bar}{self.counts()} {self._times(now)}{tail}"
        pad = max(0, self._drawn - len(text))
        self.stream.write("\r" + text + " " * pad)
        self.stream.flush()
        self._drawn = len(text)


def progress(items: Iterable[T], desc: str, total: int | None = None, **kw) -> Iterator[T]:
    """Iterate ``items`` with a :class:`Progress` (``total``: ``len(items)`` when it has one)."""
    if total is None and hasattr(items, "__len__"):
        total = len(items)  # type: ignore[arg-type]
    with Progress(total, desc, **kw) as bar:
        for item in items:
            yield item
            bar.update()


def last_logged_step(run_dir: str) -> int:
    """The newest ``step`` in ``run_dir/metrics.jsonl`` (0 when none yet): the progress of a
    child training run, read from the end of its metrics file."""
    import json

    path = os.path.join(run_dir, "metrics.jsonl")
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 8192))
            lines = f.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return 0
    for line in reversed(lines):
        try:
            return int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            continue
    return 0
