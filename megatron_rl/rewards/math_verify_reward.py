"""Math answers checked with ``math-verify``, and per-sample isolation of any reward function.

:func:`math_reward` parses the gold answer (:func:`parse_gold`: a bare LaTeX answer such as
``5\\sqrt{2}`` as one ``$...$`` expression, else as is) and the response with
``math_verify.parse`` and compares them with ``math_verify.verify``. math-verify's own
timeouts use ``SIGALRM``, which works only in the main thread and only with whole seconds;
so they are used (rounded up to whole seconds) when called from the main thread and switched
off elsewhere, where the caller's guard applies. Any exception or
timeout gives 0.0 and is counted in ``MATH_REWARD_STATS``.

:func:`score_batch` isolates ANY reward function ``fn(row, response) -> float`` per sample,
also used for user plug-ins:

* an exception → reward 0.0, counted in ``n_failed`` (the first few are logged);
* a non-finite or non-numeric return → 0.0, counted in ``n_failed``;
* a hang → after ``timeout_s`` the reward is 0.0, counted in ``n_timeout``.

Guards (``mode``):

* ``"thread"`` (default): each sample runs in its own daemon thread joined with a timeout. A
  timed-out call cannot be killed: its thread is abandoned and keeps running in the background
  until it returns (a CPU-bound infinite loop keeps costing CPU until the process exits). Works
  with any callable (lambdas, closures).
* ``"process"``: samples run one at a time in a forked worker process; on a timeout the worker
  is killed and a new one is forked, so a hang costs nothing afterwards. ``fn`` and rows must be
  picklable (module-level functions); otherwise this falls back to ``"thread"``. POSIX only.
"""

from __future__ import annotations

import logging
import math
import multiprocessing as mp
import pickle
import threading
from typing import Callable, Sequence

log = logging.getLogger(__name__)

MATH_REWARD_STATS = {"calls": 0, "failed": 0, "timeout": 0}


def math_reward(response: str, answer: str, timeout_s: float = 5.0) -> float:
    """1.0 if ``response`` is mathematically equivalent to ``answer`` (math-verify), else 0.0."""
    MATH_REWARD_STATS["calls"] += 1
    try:
        from math_verify import parse, verify
        from math_verify.errors import TimeoutException
    except ImportError as e:  # pragma: no cover
        raise ImportError("math_reward needs the math-verify package: "
                          "pip install math-verify") from e
    main = threading.current_thread() is threading.main_thread()
    t = max(1, math.ceil(timeout_s)) if (main and timeout_s and timeout_s > 0) else None
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    try:
        gold = parse_gold(str(answer), t)
        pred = parse(str(response), parsing_timeout=t)
        if not gold or not pred:
            return 0.0
        return 1.0 if verify(gold, pred, timeout_seconds=t) else 0.0
    except TimeoutException:
        MATH_REWARD_STATS["timeout"] += 1
        return 0.0
    except Exception:
        MATH_REWARD_STATS["failed"] += 1
        return 0.0


def parse_gold(answer: str, timeout: int | None = None) -> list:
    """math-verify's parse of a reference answer. A bare LaTeX answer (no ``$`` and no
    ``\\boxed``, e.g. ``5\\sqrt{2}``) is read as one math expression (``$...$``) first: parsed
    as free text, math-verify would take its first number (``5``); if that finds nothing, as is."""
    from math_verify import parse

    if "$" not in answer and "\\boxed" not in answer:
        gold = parse(f"${answer}$", parsing_timeout=timeout)
        if gold:
            return gold
    return parse(answer, parsing_timeout=timeout)


def math_reward_fn(row: dict, response: str) -> float:
    """:func:`math_reward` with the plug-in signature (uses ``row["answer"]``)."""
    return math_reward(response, row["answer"])


# ----------------------------------------------------------------------------------------------
class _Failed(Exception):
    pass


def _coerce(v) -> float:
    try:
        f = float(v)
    except (TypeError, ValueError) as e:
        raise _Failed(f"reward is not a number: {v!r}") from e
    if not math.isfinite(f):
        raise _Failed(f"reward is not finite: {f}")
    return f


def _call_in_thread(fn, row, resp, timeout_s):
    box: dict = {}

    def run():
        try:
            box["v"] = fn(row, resp)
        except BaseException as e:  # noqa: B036 - isolate everything
            box["e"] = e

    th = threading.Thread(target=run, daemon=True, name="reward-sample")
    th.start()
    th.join(timeout_s if timeout_s and timeout_s > 0 else None)
    if th.is_alive():
        return "timeout", None
    if "e" in box:
        return "error", box["e"]
    return "ok", box["v"]


def _worker_loop(conn, fn):
    from megatron_rl.parallel.lifecycle import die_with_parent

    die_with_parent()  # a SIGKILLed rank leaves no reward worker behind
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg is None:
            return
        row, resp = msg
        try:
            conn.send(("ok", fn(row, resp)))
        except BaseException as e:  # noqa: B036
            try:
                conn.send(("error", repr(e)))
            except Exception:
                return


class _ProcessGuard:
    def __init__(self, fn):
        self.fn = fn
        self.ctx = mp.get_context("fork")
        self.proc = None
        self.conn = None

    def _start(self):
        parent, child = self.ctx.Pipe()
        self.proc = self.ctx.Process(target=_worker_loop, args=(child, self.fn), daemon=True)
        self.proc.start()
        child.close()
        self.conn = parent

    def _kill(self):
        if self.proc is not None:
            self.proc.kill()
            self.proc.join(5)
        self.proc = self.conn = None

    def call(self, row, resp, timeout_s):
        if self.proc is None or not self.proc.is_alive():
            self._start()
        self.conn.send((row, resp))
        if self.conn.poll(timeout_s if timeout_s and timeout_s > 0 else None):
            try:
                return self.conn.recv()
            except EOFError:  # worker died (e.g. os._exit, segfault)
                self._kill()
                return "error", "reward worker process died"
        self._kill()
        return "timeout", None

    def close(self):
        if self.conn is not None:
            try:
                self.conn.send(None)
            except Exception:
                pass
        if self.proc is not None:
            self.proc.join(1)
            if self.proc.is_alive():
                self.proc.kill()
        self.proc = self.conn = None


def score_batch(fn: Callable[[dict, str], float], rows: Sequence[dict],
                responses: Sequence[str], timeout_s: float = 10.0, mode: str = "thread",
                max_logged: int = 3) -> tuple[list[float], int, int]:
    """``(rewards, n_failed, n_timeout)``: ``fn(rows[i], responses[i])`` for each sample, with
    failures and hangs isolated per sample (reward 0.0). ``timeout_s <= 0``: no timeout."""
    if len(rows) != len(responses):
        raise ValueError(f"score_batch: {len(rows)} rows but {len(responses)} responses")
    if mode not in ("thread", "process"):
        raise ValueError(f"score_batch: mode must be 'thread' or 'process', got {mode!r}")
    guard = None
    if mode == "process":
        try:
            pickle.dumps(fn)
            guard = _ProcessGuard(fn)
        except Exception as e:
            log.warning("score_batch: %r is not picklable (%s); using the thread guard", fn, e)
    rewards: list[float] = []
    n_failed = n_timeout = logged = 0
    try:
        for row, resp in zip(rows, responses):
            status, val = (guard.call(row, resp, timeout_s) if guard is not None
                           else _call_in_thread(fn, row, resp, timeout_s))
            if status == "ok":
                try:
                    rewards.append(_coerce(val))
                    continue
                except _Failed as e:
                    status, val = "error", e
            rewards.append(0.0)
            if status == "timeout":
                n_timeout += 1
                msg = f"timed out after {timeout_s}s"
            else:
                n_failed += 1
                msg = f"raised {val!r}"
            if logged < max_logged:
                logged += 1
                log.warning("reward function %s %s on response %r (reward 0.0)",
                            getattr(fn, "__name__", fn), msg, str(resp)[:80])
    finally:
        if guard is not None:
            guard.close()
    return rewards, n_failed, n_timeout
