"""Wall time and validation accuracy of the main job with several optimizer steps per RL step
against one on-policy update per step, measured side by side (runs interleaved A, B, A, B, ...).

    python tools/bench_updates_per_step.py [--steps 60] [--repeats 1] [--config CONFIG]

A: the recipe as written (``examples/tiny_dapo.yaml``: four mini-batches of 32 of 128 responses).
B: one update per step (``actor.mini_batch_size=0 actor.micro_batch_size=64 optim.lr=0.001``,
the recipe before it took several). Prints each run's ``wall_s`` and ``val_acc_end`` and the
ratio of the mean wall times (A / B). Numbers depend on the machine and its load: compare only
within one run of this tool.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ONE_UPDATE = ("actor.mini_batch_size=0", "actor.micro_batch_size=64", "optim.lr=0.001")
SUMMARY = re.compile(r"summary: val_acc_start=([\d.]+) val_acc_end=([\d.]+) wall_s=([\d.]+)")


def run(config: str, steps: int, out: str, extra: tuple[str, ...]) -> dict:
    """One training run; its summary line as numbers."""
    cmd = [sys.executable, "-m", "megatron_rl", "train", config, f"output_dir={out}",
           f"trainer.total_steps={steps}", f"trainer.test_freq={steps}",
           f"trainer.save_freq={steps}", "trainer.plots=false", *extra]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": ROOT})
    m = SUMMARY.search(res.stdout)
    if res.returncode != 0 or m is None:
        raise SystemExit(f"run failed ({' '.join(extra) or 'recipe'}):\n{res.stdout[-2000:]}"
                         f"{res.stderr[-2000:]}")
    return {"val_start": float(m[1]), "val_end": float(m[2]), "wall_s": float(m[3])}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="examples/tiny_dapo.yaml")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--repeats", type=int, default=1)
    args = p.parse_args(argv)
    variants = {"A recipe": (), "B one update": ONE_UPDATE}
    walls: dict[str, list[float]] = {k: [] for k in variants}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            for name, extra in variants.items():
                r = run(args.config, args.steps, os.path.join(tmp, f"{i}_{len(walls[name])}"
                                                                   f"_{name[0]}"), extra)
                walls[name].append(r["wall_s"])
                print(f"[bench] {name:13s} run {i + 1}: wall_s {r['wall_s']:.1f}  val_acc "
                      f"{r['val_start']:.3f} -> {r['val_end']:.3f}", flush=True)
    mean = {k: sum(v) / len(v) for k, v in walls.items()}
    print(f"wall_ratio A/B = {mean['A recipe'] / mean['B one update']:.2f} "
          f"(A {mean['A recipe']:.1f} s, B {mean['B one update']:.1f} s, "
          f"{args.repeats} run(s) each, {args.steps} steps)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
