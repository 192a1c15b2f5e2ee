"""Synchronous vs asynchronous rollouts on the tiny main job with the ``serve`` fleet.

    python tools/bench_async.py [--steps 12] [--out /tmp/bench_async] [-- extra overrides]

Runs ``examples/tiny_dapo.yaml`` three times, one after the other on the same machine, with
``rollout.engine=sglang`` (our ``serve`` behind the real ``sglang-router``) and
``rollout.max_staleness`` 0, 1 and 2: the same steps, prompts per step and seeds, so the same
number of trained samples (a stale-dropped group would show as ``dropped``). From each run's
``metrics.jsonl``: wall time per step (between the first and last step's timestamps, warm start
and validation at start excluded), the time each side is busy (generation: ``rollout/gen_s`` of
the producer, or ``time/rollout`` when synchronous; training: the step's other phases) and the
final validation accuracy.

The ideal speedup of overlapping the two sides is ``(gen + train) / max(gen, train)`` from the
synchronous run (the time ratio ``max / (gen + train)``, inverted). On a CPU box both sides share
the same cores: generation (the server processes) and training (the ranks) then slow each other
down, and the measured speedup stays below the ideal by that contention. Last line:
``bench_async: speedup_1=<sync s/step / K=1 s/step> speedup_2=<...> ideal=<...>``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
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


def run(k: int, out: str, steps: int, extra: list[str]) -> dict:
    """One training run with ``rollout.max_staleness=k``; its measurements."""
    cmd = [sys.executable, "-m", "megatron_rl", "train", "examples/tiny_dapo.yaml",
           f"output_dir={out}", f"trainer.total_steps={steps}", f"trainer.test_freq={steps}",
           f"trainer.save_freq={steps}", "trainer.plots=false", "rollout.engine=sglang",
           "rollout.sglang.num_servers=1", f"rollout.sglang.router_port={free_port_block(3)}",
           f"rollout.max_staleness={k}", *extra]
    env = {**os.environ, "PYTHONPATH": ROOT}
    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    if res.returncode != 0:
        sys.exit(f"bench_async: run K={k} failed:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    steps_rows = [r for r in rows if r.get("step", 0) >= 1 and "time/rollout" in r]
    # the last step also validates: steps 2 .. N-1 (timestamps logged at each step's end)
    span = steps_rows[-2]["time"] - steps_rows[0]["time"]
    per_step = span / max(1, len(steps_rows) - 2)
    steps_rows = steps_rows[1:-1]
    gen = [r.get("rollout/gen_s", r["time/rollout"]) for r in steps_rows]
    train = [sum(r.get(key, 0.0) for key in TRAIN_KEYS) for r in steps_rows]
    n = len(steps_rows)
    summary = [line for line in res.stdout.splitlines() if line.startswith("summary:")]
    return {"k": k, "s_per_step": per_step, "gen_s": sum(gen) / n, "train_s": sum(train) / n,
            "trainer_wait_s": sum(r["time/rollout"] for r in steps_rows) / n,
            "trained": sum(r.get("rollout/kept_responses", 0.0) for r in steps_rows),
            "dropped": sum(r.get("rollout/dropped_stale", 0.0) for r in steps_rows),
            "requeued": sum(r.get("rollout/aborted_requeued", 0.0) for r in steps_rows),
            "staleness_mean": sum(r.get("rollout/staleness_mean", 0.0) for r in steps_rows) / n,
            "val_acc": rows[-1].get("val/acc"), "summary": summary[-1] if summary else "",
            "wall_s": wall, "load": (load0 + os.getloadavg()[0]) / 2}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=12, help="RL steps per run")
    ap.add_argument("--out", default="/tmp/bench_async", help="output directory of the runs")
    ap.add_argument("extra", nargs="*", help="config overrides for every run (key=value)")
    a = ap.parse_args()
    results = []
    for k in (0, 1, 2):
        r = run(k, os.path.join(a.out, f"k{k}"), a.steps, a.extra)
        results.append(r)
        busy_gen = min(1.0, r["gen_s"] / r["s_per_step"])
        busy_train = min(1.0, r["train_s"] / r["s_per_step"])
        print(f"K={k}: {r['s_per_step']:.2f} s/step, generation {r['gen_s']:.2f} s "
              f"(busy {busy_gen:.0%}), training {r['train_s']:.2f} s (busy {busy_train:.0%}), "
              f"trainer waited {r['trainer_wait_s']:.2f} s/step, trained responses "
              f"{r['trained']:.0f}, dropped stale {r['dropped']:.0f}, re-queued "
              f"{r['requeued']:.0f}, staleness {r['staleness_mean']:.2f}, "
              f"final val acc {r['val_acc']}, machine load {r['load']:.1f}", flush=True)
    sync = results[0]
    ideal = (sync["gen_s"] + sync["train_s"]) / max(sync["gen_s"], sync["train_s"])
    # load drifts between runs on a shared machine: each run's step time over its own
    # generation time (what overlap can hide) is compared too, independent of the drift
    norm = [r["s_per_step"] / r["gen_s"] for r in results]
    print(f"step time / generation time: K=0 {norm[0]:.2f}, K=1 {norm[1]:.2f}, K=2 "
          f"{norm[2]:.2f} (load-independent speedups {norm[0] / norm[1]:.2f}, "
          f"{norm[0] / norm[2]:.2f})")
    print(f"ideal = (gen + train) / max(gen, train) = ({sync['gen_s']:.2f} + "
          f"{sync['train_s']:.2f}) / {max(sync['gen_s'], sync['train_s']):.2f} "
          f"(both sides share {os.cpu_count()} CPU cores here)")
    print(f"bench_async: speedup_1={sync['s_per_step'] / results[1]['s_per_step']:.2f} "
          f"speedup_2={sync['s_per_step'] / results[2]['s_per_step']:.2f} ideal={ideal:.2f}")


if __name__ == "__main__":
    main()
