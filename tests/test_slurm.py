"""``examples/tiny_slurm.sh`` on a real one-node SLURM (slurm-wlm + munge on loopback, see
``slurm_cluster.py``): ``sbatch --wait`` runs a tiny DAPO job with one srun task per rank, and a
second job that is cancelled mid-run and requeued resumes from its checkpoint.

Installs the packages with apt-get when they are missing (CI runs as root); skips only where
that is impossible. Kept short: 2 tasks (TP2), no SFT, 2-3 steps, few checkpoints (a save
(dist_checkpointing) costs more than a tiny step).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from slurm_cluster import LocalSlurm, SlurmUnavailable

from megatron_rl.parallel.hostlist import expand_hostlist

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "examples" / "tiny_slurm.sh"
# Overrides that make the tiny recipe a quick mechanics check: no SFT warm start, no dynamic
# sampling (a random policy rarely solves a prompt), a small validation set.
FAST = ["sft.steps=0", "rollout.dynamic_sampling=false", "data.val_size=8", "rollout.val_n=1",
        "trainer.plots=false",
        "trainer.test_freq=100"]
SUMMARY = re.compile(r"^summary: val_acc_start=\d\.\d{4} val_acc_end=\d\.\d{4} wall_s=[\d.]+$",
                     re.M)


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """A running one-node cluster. Skips only where SLURM cannot be had (not root: no apt-get
    install and no munged/slurmd); a cluster that fails to start is an error."""
    if os.geteuid() != 0:
        pytest.skip("a local SLURM (munged, slurmctld, slurmd) needs root")
    try:
        LocalSlurm.ensure_installed()
    except SlurmUnavailable as exc:
        pytest.skip(str(exc))
    cluster = LocalSlurm(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


def _submit(slurm: LocalSlurm, run_dir: Path, out: Path, steps: int, save_freq: int, wait: bool,
            timeout: float = 300) -> subprocess.CompletedProcess:
    # bash mode: the script submits itself (sbatch options pass through); 2 tasks (TP2)
    cmd = ["bash", str(SCRIPT), f"--output={out}", f"--chdir={REPO}",
           *(["--wait"] if wait else ["--parsable"]), *FAST]
    env = slurm.env(MRL_RUN_DIR=str(run_dir), MRL_STEPS=str(steps),
                    MRL_SAVE_FREQ=str(save_freq), MRL_PYTHON=sys.executable,
                    PYTHONPATH=str(REPO), MRL_NTASKS="2")
    env.pop("SLURM_JOB_ID", None)  # submit, even from inside an allocation
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"sbatch did not finish in {timeout}s\n{_read(out)}\n"
                             f"{slurm.logs()}") from None


def _read(path: Path) -> str:
    return path.read_text() if path.exists() else "(no output file)"


def _metric_steps(run_dir: Path) -> list[int]:
    with open(run_dir / "metrics.jsonl") as f:
        return [json.loads(line)["step"] for line in f if line.strip()]


def _wait_for(pred, timeout: float, what: str, context=lambda: "") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.3)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}\n{context()}")


def _state(slurm: LocalSlurm, job: str) -> str:
    state = slurm.job_state(job)
    if state is None:  # the controller purged it (MinJobAge): nothing left to check or requeue
        raise AssertionError(f"job {job} vanished from slurmctld\n{slurm.logs()}")
    return state


def test_hostlist_parser_agrees_with_scontrol(slurm):
    nodelist = "gpu[003-005,9],rack[1-2]-n[08-09],x"
    ref = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True,
                         text=True, env=slurm.env(), check=True).stdout.split()
    assert len(ref) == 9
    assert expand_hostlist(nodelist, use_scontrol=False) == ref


def test_tiny_slurm_reads_the_nodes_cpus(slurm):
    """Bash mode asks the real sinfo and picks a task count the node has CPUs for (a 2-CPU node
    would leave the 4-task job pending forever, reason PartitionConfig)."""
    env = {k: v for k, v in slurm.env(MRL_DRY_RUN="1").items() if not k.startswith("SLURM_J")}
    r = subprocess.run(["bash", str(SCRIPT), "sft.steps=0"], capture_output=True, text=True,
                       env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    cpus = os.cpu_count() or 1
    tasks = 4 if cpus >= 4 else 2 if cpus >= 2 else 1
    assert f"node CPUs {cpus}: {tasks} task(s)" in r.stderr, r.stderr
    assert r.stdout.startswith(f"+ sbatch --ntasks={tasks} ")


def test_sbatch_wait_runs_tiny_job(slurm, tmp_path):
    run_dir, out = tmp_path / "run", tmp_path / "job.out"
    r = _submit(slurm, run_dir, out, steps=2, save_freq=100, wait=True)  # saves the last step
    text = _read(out)
    assert r.returncode == 0, f"sbatch rc={r.returncode}\n{r.stderr}\n{text}\n{slurm.logs()}"
    assert "2 task(s), TP2 x PP1 x DP1" in text
    assert "launching" not in text  # every rank was an srun task, nothing spawned locally
    assert "[step 2/2]" in text and len(SUMMARY.findall(text)) == 1, text
    assert "[train] resumed" not in text
    assert _metric_steps(run_dir) == [0, 1, 2]
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_0000001"


def test_cancelled_and_requeued_job_resumes(slurm, tmp_path):
    run_dir, out, steps = tmp_path / "run", tmp_path / "job.out", 3
    # Checkpoints after steps 2 and 3: cancelled once the first exists, the job resumes at step 2.
    r = _submit(slurm, run_dir, out, steps=steps, save_freq=2, wait=False)
    assert r.returncode == 0, r.stderr
    job = r.stdout.strip().split(";")[0]
    latest = run_dir / "checkpoints" / "latest"
    _wait_for(latest.exists, 240, "the first checkpoint", lambda: _read(out))
    done_at_cancel = int(latest.read_text().strip().split("_")[1]) + 1
    assert subprocess.run(["scancel", job], env=slurm.env()).returncode == 0
    _wait_for(lambda: _state(slurm, job) == "CANCELLED", 180, "the cancel",
              lambda: f"state {slurm.job_state(job)}\n{_read(out)}{slurm.logs()}")
    # Eligible again after the credential lifetime (cred_expire=15 s in slurm_cluster.py).
    slurm.scontrol("requeue", job)
    _wait_for(lambda: _state(slurm, job) in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"), 300,
              "the requeued job to finish", lambda: _read(out) + slurm.logs())
    text = _read(out)
    assert (slurm.job_state(job), slurm.job_field(job, "ExitCode"),
            slurm.job_field(job, "Restarts")) == ("COMPLETED", "0:0", "1"), text + slurm.logs()
    assert "attempt 1 on" in text and "attempt 2 on" in text, text
    first, second = text.split("attempt 2 on", 1)
    assert "CANCELLED" in first and SUMMARY.search(first) is None
    m = re.search(r"^\[train\] resumed from checkpoint at step (\d+)$", second, re.M)
    assert m, text
    resumed = int(m.group(1))
    assert done_at_cancel <= resumed < steps
    trained_after = [int(s) for s in re.findall(rf"^\[step (\d+)/{steps}\]", second, re.M)]
    assert trained_after == list(range(resumed + 1, steps + 1)), text
    assert len(SUMMARY.findall(second)) == 1
    assert _metric_steps(run_dir) == list(range(steps + 1))  # every step logged exactly once
