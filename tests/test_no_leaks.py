"""No slow leaks (issue 28, item 5): 50 steps of the tiny job log rank 0's resident memory and open
file descriptors per step (``sys/rss_mb``, ``sys/open_fds``); growth past a stated bound fails.

A checkpoint and a validation run every 10 steps. Bounds, measured from step 15 (after the first
checkpoint and validation opened their lasting resources, e.g. a thread pool) to step 50 (four more
of each): open descriptors may not grow at all (+0), resident memory by at most 64 MiB."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS, WARM, RSS_BOUND_MB, FD_BOUND = 50, 15, 64.0, 0

RUN = ("examples/tiny_grpo.yaml", "parallel.tp=1", "parallel.pp=1", "parallel.dp=1",
       "sft.steps=0", "rollout.dynamic_sampling=false", "rollout.gen_batch_size=0",
       "rollout.n=4", "rollout.max_new_tokens=4", "trainer.train_batch_size=8",
       "actor.mini_batch_size=0", "actor.micro_batch_size=32", f"trainer.total_steps={STEPS}",
       "trainer.plots=false",
       "trainer.test_freq=10", "trainer.save_freq=10", "data.val_size=8",
       "early_stop.enabled=false", "trainer.resume=false")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_fifty_steps_no_leak(tmp_path):
    t0 = time.perf_counter()
    res = subprocess.run([sys.executable, "-m", "megatron_rl", "train", *RUN,
                          f"output_dir={tmp_path}"], cwd=ROOT, capture_output=True, text=True,
                         timeout=850)
    wall = time.perf_counter() - t0
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    rows = [json.loads(x) for x in open(tmp_path / "metrics.jsonl")]
    per_step = {r["step"]: r for r in rows if "sys/rss_mb" in r}
    assert sorted(per_step) == list(range(1, STEPS + 1))  # logged every step
    rss = [per_step[s]["sys/rss_mb"] for s in range(1, STEPS + 1)]
    fds = [per_step[s]["sys/open_fds"] for s in range(1, STEPS + 1)]
    assert all(r > 50 for r in rss) and all(f > 2 for f in fds)  # real measurements
    rss_growth, fd_growth = rss[-1] - rss[WARM - 1], fds[-1] - fds[WARM - 1]
    print(f"\n{STEPS} steps in {wall:.0f} s: rss {rss[0]:.0f} -> {rss[WARM - 1]:.0f} -> "
          f"{rss[-1]:.0f} MiB (growth after step {WARM}: {rss_growth:+.1f} MiB, bound "
          f"{RSS_BOUND_MB}); open fds {fds[0]:.0f} -> {fds[-1]:.0f} (growth after step {WARM}: "
          f"{fd_growth:+.0f}, bound {FD_BOUND})")
    assert fd_growth <= FD_BOUND, fds
    assert rss_growth <= RSS_BOUND_MB, rss
