"""Synchronous vs asynchronous rollouts on the tiny main job with the ``serve`` fleet.

    python tools/bench_async.py [--steps 12] [--out /tmp/bench_async] [--no-pin]
                                [-- extra overrides]

Runs ``examples/tiny_dapo.yaml`` three times, one after the other on the same machine, with
``rollout.engine=sglang`` (our ``serve`` behind the real ``sglang-router``) and
``rollout.max_staleness`` 0, 1 and 2: the same steps, prompts per step and seeds, so the same
number of trained samples (a stale-dropped group would show as ``dropped``). From each run's
``metrics.jsonl``: wall time per step (between the first and last step's timestamps, warm start
and validation at start excluded), the time each side is busy (generation: ``rollout/gen_s`` of
the producer, or ``time/rollout`` when synchronous; training: the step's other phases) and the
final validation accuracy.

Separated resources (the default, ``--pin``): as on a cluster, where the rollout servers and
the trainer own different GPUs, the fleet (router and servers: every process under a
``megatron_rl.rollout.guard``) runs on the first CPU this process may use and the trainer's
ranks on the second (``os.sched_setaffinity`` on every thread; the trainer is started on its CPU
and a watcher moves the fleet's processes and threads to theirs as they appear). ``--no-pin``
lets both sides share every core: generation and training then slow each other down and the
measured speedup stays below the ideal by that contention.

The ideal speedup of overlapping the two sides is ``(gen + train) / max(gen, train)`` from the
synchronous run under the same pinning (the time ratio ``max / (gen + train)``, inverted).
``redone_tokens``: the ``rollout/redone_tokens`` metric (tokens generated again after a weight
sync's pause) summed over the ``K = 1`` and ``K = 2`` runs, ``n/a`` when the runs do not log it.
With fewer than 3 steps a run's time per step is its wall time over its steps (start-up
included: a smoke test, not a measurement). Last line:
``bench_async: speedup_1=<sync s/step / K=1 s/step> speedup_2=<...> ideal=<...>
redone_tokens=<...>``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN_KEYS = ("time/old_logp", "time/ref_logp", "time/update", "time/values", "time/weight_sync")


def free_port_block(n: int) -> int:
    """A base port with ``n`` free ports after it (router + servers)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n >= 65535:
            continue
        ok = True
        for p in range(base + 1, base + n):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", p))
                except OSError:
                    ok = False
                    break
        if ok:
            return base
    raise RuntimeError("no free port block")


GUARD = "megatron_rl.rollout.guard"  # every fleet process (router, servers) runs under one


def pin_cpus(pin: bool) -> tuple[set[int], set[int]] | None:
    """``(fleet CPUs, trainer CPUs)``: the first and second CPU this process may use; None
    without ``pin`` (everything shares every core)."""
    if not pin:
        return None
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        sys.exit(f"bench_async: --pin needs 2 CPUs, this process may use {cpus} (--no-pin)")
    return {cpus[0]}, {cpus[1]}


def _set_affinity(proc, cpus: set[int]) -> None:
    """Every thread of ``proc`` (a psutil process) on ``cpus``; a gone thread is skipped."""
    for t in proc.threads():
        try:
            if os.sched_getaffinity(t.id) != cpus:
                os.sched_setaffinity(t.id, cpus)
        except OSError:
            pass


def pin_tree(root: int, fleet: set[int], trainer: set[int]) -> int:
    """Put the fleet's processes below ``root`` (those under a :data:`GUARD`) on ``fleet`` and
    every other one on ``trainer``; returns the number of fleet processes."""
    import psutil

    try:
        procs = psutil.Process(root).children(recursive=True)
    except psutil.Error:
        return 0
    fleet_pids: set[int] = set()
    for p in procs:
        try:
            if any(GUARD in part for part in p.cmdline()):
                fleet_pids |= {p.pid} | {c.pid for c in p.children(recursive=True)}
        except psutil.Error:
            continue
    for p in procs:
        try:
            _set_affinity(p, fleet if p.pid in fleet_pids else trainer)
        except psutil.Error:
            continue
    return len(fleet_pids)


def run_pinned(cmd: list[str], env: dict, cpus: tuple[set[int], set[int]] | None
               ) -> tuple[subprocess.CompletedProcess, int]:
    """``cmd`` (the trainer, on the trainer CPUs) while a watcher pins the fleet it starts;
    the finished process and the most fleet processes seen pinned at once."""
    if cpus is None:
        return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env), 0
    fleet, trainer = cpus
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env,
                            preexec_fn=lambda: os.sched_setaffinity(0, trainer))
    seen = [0]
    done = threading.Event()

    def watch() -> None:
        while not done.wait(0.2):
            seen[0] = max(seen[0], pin_tree(proc.pid, fleet, trainer))

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    out, err = proc.communicate()
    done.set()
    watcher.join()
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err), seen[0]


def run(k: int, out: str, steps: int, extra: list[str],
        cpus: tuple[set[int], set[int]] | None = None) -> dict:
    """One training run with ``rollout.max_staleness=k``; its measurements."""
    cmd = [sys.executable, "-m", "megatron_rl", "train", "examples/tiny_dapo.yaml",
           f"output_dir={out}", f"trainer.total_steps={steps}", f"trainer.test_freq={steps}",
           f"trainer.save_freq={steps}", "trainer.plots=false", "rollout.engine=sglang",
           "rollout.sglang.num_servers=1", f"rollout.sglang.router_port={free_port_block(3)}",
           f"rollout.max_staleness={k}", *extra]
    env = {**os.environ, "PYTHONPATH": ROOT}
    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    res, fleet_procs = run_pinned(cmd, env, cpus)
    wall = time.perf_counter() - t0
    if res.returncode != 0:
        sys.exit(f"bench_async: run K={k} failed:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
    if cpus is not None and not fleet_procs:
        sys.exit(f"bench_async: run K={k}: no fleet process ({GUARD}) was seen to pin")
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    steps_rows = [r for r in rows if r.get("step", 0) >= 1 and "time/rollout" in r]
    if len(steps_rows) >= 3:
        # the last step also validates: steps 2 .. N-1 (timestamps logged at each step's end)
        span = steps_rows[-2]["time"] - steps_rows[0]["time"]
        per_step = span / max(1, len(steps_rows) - 2)
        steps_rows = steps_rows[1:-1]
    else:  # a smoke run: wall time per step, start-up included
        per_step = wall / max(1, len(steps_rows))
    gen = [r.get("rollout/gen_s", r["time/rollout"]) for r in steps_rows]
    train = [sum(r.get(key, 0.0) for key in TRAIN_KEYS) for r in steps_rows]
    n = len(steps_rows)
    summary = [line for line in res.stdout.splitlines() if line.startswith("summary:")]
    return {"k": k, "s_per_step": per_step, "gen_s": sum(gen) / n, "train_s": sum(train) / n,
            "trainer_wait_s": sum(r["time/rollout"] for r in steps_rows) / n,
            "trained": sum(r.get("rollout/kept_responses", 0.0) for r in steps_rows),
            "dropped": sum(r.get("rollout/dropped_stale", 0.0) for r in steps_rows),
            "requeued": sum(r.get("rollout/aborted_requeued", 0.0) for r in steps_rows),
            "redone": (sum(r.get("rollout/redone_tokens", 0.0) for r in rows)
                       if any("rollout/redone_tokens" in r for r in rows) else None),
            "fleet_procs": fleet_procs,
            "staleness_mean": sum(r.get("rollout/staleness_mean", 0.0) for r in steps_rows) / n,
            "val_acc": rows[-1].get("val/acc"), "summary": summary[-1] if summary else "",
            "wall_s": wall, "load": (load0 + os.getloadavg()[0]) / 2}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=12, help="RL steps per run")
    ap.add_argument("--out", default="/tmp/bench_async", help="output directory of the runs")
    ap.add_argument("--pin", action=argparse.BooleanOptionalAction, default=True,
                    help="fleet on one CPU, trainer ranks on another (default); --no-pin: "
                         "both share every core")
    ap.add_argument("extra", nargs="*", help="config overrides for every run (key=value)")
    a = ap.parse_args()
    cpus = pin_cpus(a.pin)
    where = ("both sides share the same CPU cores" if cpus is None else
             f"fleet on CPU {sorted(cpus[0])}, trainer ranks on CPU {sorted(cpus[1])}")
    print(f"bench_async: {a.steps} steps per run, {where}", flush=True)
    results = []
    for k in (0, 1, 2):
        r = run(k, os.path.join(a.out, f"k{k}"), a.steps, a.extra, cpus)
        results.append(r)
        busy_gen = min(1.0, r["gen_s"] / r["s_per_step"])
        busy_train = min(1.0, r["train_s"] / r["s_per_step"])
        print(f"K={k}: {r['s_per_step']:.2f} s/step, generation {r['gen_s']:.2f} s "
              f"(busy {busy_gen:.0%}), training {r['train_s']:.2f} s (busy {busy_train:.0%}), "
              f"trainer waited {r['trainer_wait_s']:.2f} s/step, trained responses "
              f"{r['trained']:.0f}, dropped stale {r['dropped']:.0f}, re-queued "
              f"{r['requeued']:.0f}, staleness {r['staleness_mean']:.2f}, "
              f"redone tokens {_redone(r['redone'])}, final val acc {r['val_acc']}, machine load "
              f"{r['load']:.1f}" + (f", {r['fleet_procs']} fleet processes pinned"
                                    if cpus else ""), flush=True)
    sync = results[0]
    ideal = (sync["gen_s"] + sync["train_s"]) / max(sync["gen_s"], sync["train_s"])
    # load drifts between runs on a shared machine: each run's step time over its own
    # generation time (what overlap can hide) is compared too, independent of the drift
    norm = [r["s_per_step"] / r["gen_s"] for r in results]
    print(f"step time / generation time: K=0 {norm[0]:.2f}, K=1 {norm[1]:.2f}, K=2 "
          f"{norm[2]:.2f} (load-independent speedups {norm[0] / norm[1]:.2f}, "
          f"{norm[0] / norm[2]:.2f})")
    print(f"ideal = (gen + train) / max(gen, train) = ({sync['gen_s']:.2f} + "
          f"{sync['train_s']:.2f}) / {max(sync['gen_s'], sync['train_s']):.2f} ({where})")
    redone = [r["redone"] for r in results[1:]]
    total = None if any(v is None for v in redone) else sum(redone)
    print(f"bench_async: speedup_1={sync['s_per_step'] / results[1]['s_per_step']:.2f} "
          f"speedup_2={sync['s_per_step'] / results[2]['s_per_step']:.2f} ideal={ideal:.2f} "
          f"redone_tokens={_redone(total)}")


def _redone(v: float | None) -> str:
    """``rollout/redone_tokens`` as printed: ``n/a`` when the runs do not log it."""
    return "n/a" if v is None else f"{v:.0f}"


if __name__ == "__main__":
    main()
