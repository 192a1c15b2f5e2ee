"""In-job restart (``trainer.max_restarts``, :mod:`megatron_rl.parallel.restart`): the loop's
backoff, reasons and limit; the SLURM supervisor that reruns a failed ``srun`` step; and a 2-rank
``train`` whose rank 1 is SIGKILLed mid-update, restarted by the launcher from the newest
checkpoint, ending with every step logged once."""

import json
import os
import subprocess
import sys

import pytest

from megatron_rl.cli.restart import policy_for
from megatron_rl.config.errors import ConfigError
from megatron_rl.config.load import load_config
from megatron_rl.parallel.restart import (
    RESTART_ENV,
    RestartPolicy,
    RestartsExhausted,
    failure_reason,
    restart_count,
    run_with_restarts,
    supervise,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "PYTHONPATH": ROOT}


def test_restart_policy_backoff_and_config_validation():
    assert RestartPolicy().max_restarts == 0  # default: a failure ends the job, as before
    p = RestartPolicy(3, 5.0)
    assert [p.backoff(k) for k in (1, 2, 3)] == [5.0, 10.0, 20.0]
    assert RestartPolicy(20, 5.0).backoff(12) == 600.0  # capped
    cfg = load_config("examples/tiny_dapo.yaml", ["trainer.max_restarts=3",
                                                  "trainer.restart_backoff_s=0.5"])
    assert RestartPolicy.of(cfg.trainer) == RestartPolicy(3, 0.5)
    with pytest.raises(ConfigError, match="max_restarts"):
        load_config("examples/tiny_dapo.yaml", ["trainer.max_restarts=-1"])
    with pytest.raises(ConfigError, match="restart_backoff_s"):
        load_config("examples/tiny_dapo.yaml", ["trainer.restart_backoff_s=-2"])
    assert restart_count({RESTART_ENV: "2"}) == 2 and restart_count({}) == 0


def test_restart_loop_logs_each_reason_and_gives_up_with_a_clear_error():
    logged, slept, tries = [], [], []

    def attempt(k):
        tries.append(k)
        return None if k == 2 else f"rank 1 died (try {k})"

    assert run_with_restarts(attempt, RestartPolicy(3, 1.0), logged.append,
                             sleep=slept.append) == 2
    assert tries == [0, 1, 2] and slept == [1.0, 2.0]
    assert logged[0] == ("restart 1 of 3 in 1 s: rank 1 died (try 0); restarting the job from "
                         "the newest checkpoint")
    tries.clear()
    with pytest.raises(RestartsExhausted) as err:
        run_with_restarts(lambda k: tries.append(k) or "rank 0 timed out", RestartPolicy(1, 0),
                          logged.append, sleep=slept.append)
    assert tries == [0, 1]
    assert str(err.value) == ("the job failed 2 time(s), giving up after 1 restart(s) "
                              "(trainer.max_restarts=1): try 1: rank 0 timed out; try 2: rank 0 "
                              "timed out")
    tb = ("rank 0 of 2 failed:\nTraceback (most recent call last):\n  File x\n"
          "RuntimeError: Connection closed by peer")
    assert failure_reason(tb) == "rank 0 of 2 failed: RuntimeError: Connection closed by peer"


STEP = """
import os, sys
log = sys.argv[1]
with open(log, "a") as f:
    f.write(os.environ["MRL_RESTART"] + "\\n")
sys.exit(int(sys.argv[2]) if len(open(log).read().split()) <= int(sys.argv[3]) else 0)
"""


def test_restart_supervisor_reruns_a_failed_srun_step(tmp_path):
    """``python -m megatron_rl.cli.restart -- CMD``: CMD (here a stand-in for the srun step
    that exits 137 twice) is rerun with ``MRL_RESTART=k`` until it succeeds, within the limit;
    beyond it, exit 1 with the reasons; exit 2 (a refused launch) is not retried."""
    log, msgs = tmp_path / "tries", []
    step = [sys.executable, "-c", STEP, str(log), "137", "2"]
    assert supervise(step, RestartPolicy(2, 0), msgs.append) == 0
    assert log.read_text().split() == ["0", "1", "2"]
    assert msgs[1].startswith("[restart] restart 2 of 2 in 0 s: python") and \
        msgs[1].endswith("ended with exit code 137; restarting python step from the newest "
                         "checkpoint"), msgs
    log.unlink()
    msgs.clear()
    assert supervise(step, RestartPolicy(1, 0), msgs.append) == 1
    assert "giving up after 1 restart(s) (trainer.max_restarts=1)" in msgs[-1]
    log.unlink()
    assert supervise([sys.executable, "-c", STEP, str(log), "2", "5"], RestartPolicy(3, 0),
                     msgs.append) == 2
    assert log.read_text().split() == ["0"]
    # SIGTERM to the supervisor (scancel, preemption): passed on, never restarted, exit 143
    import signal
    import threading

    msgs.clear()
    timer = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM))
    timer.start()
    slow = [sys.executable, "-c", "import sys, time; time.sleep(60); sys.exit(1)"]
    assert supervise(slow, RestartPolicy(3, 0), msgs.append) == 128 + signal.SIGTERM
    timer.join()
    assert msgs == []  # no restart, no error
    cmd = ["srun", "-n2", sys.executable, "-m", "megatron_rl", "train", "examples/tiny_dapo.yaml",
           "trainer.max_restarts=4", "trainer.restart_backoff_s=1"]
    assert policy_for(cmd, None, None) == RestartPolicy(4, 1.0)
    assert policy_for(cmd, 1, None) == RestartPolicy(1, 1.0)


TINY = ("parallel.tp=1", "parallel.pp=2", "sft.steps=3", "trainer.total_steps=3",
        "trainer.save_freq=1", "trainer.test_freq=3", "trainer.plots=false", "data.val_size=8",
        "rollout.dynamic_sampling=false")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_restart_after_rank_killed_mid_update_logs_each_step_once(tmp_path):
    """TP1 x PP2, ``trainer.max_restarts=1``: rank 1 SIGKILLs itself at the start of step 2's
    update (after the checkpoint of step 1). The launcher names the dead rank, stops rank 0,
    restarts both from that checkpoint, and the job finishes by itself (exit 0) with each step
    logged once and the final checkpoint written."""
    out, marker = tmp_path / "run", tmp_path / "chaos.jsonl"
    env = {**ENV, "MRL_CHAOS_PHASE": str(marker), "MRL_CHAOS_KILL": "1:update:1"}
    res = subprocess.run([sys.executable, "-m", "megatron_rl", "train", "examples/tiny_dapo.yaml",
                          f"output_dir={out}", *TINY, "trainer.max_restarts=1",
                          "trainer.restart_backoff_s=0"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=800)
    log = res.stdout + res.stderr
    assert res.returncode == 0, log[-4000:]
    kills = [m for m in map(json.loads, marker.read_text().splitlines()) if m.get("kill")]
    assert len(kills) == 1 and kills[0]["rank"] == 1
    assert f"try 1 failed: rank 1 (pid {kills[0]['pid']}) died (killed by SIGKILL)" in log
    assert "restart 1 of 1 in 0 s: rank 1" in log
    assert "resumed from checkpoint at step 1" in log
    assert "finished after 1 restart(s)" in log and log.count("summary:") == 1
    steps = [json.loads(x)["step"] for x in open(out / "metrics.jsonl")]
    assert steps == [0, 1, 2, 3]  # validation at step 0, then each RL step once
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_0000002"


FORKSERVER = """
import multiprocessing as mp, os, sys
import multiprocessing.forkserver as fs
ctx = mp.get_context("forkserver")
ctx.set_forkserver_preload(sys.argv[1:])
p = ctx.Process(target=os.getpid)
p.start(); p.join()
print(fs._forkserver._forkserver_pid, flush=True)
os._exit(0)  # the launcher leaves (as exit_now or a SIGKILL would): the server sees EOF
"""


def test_restart_forkserver_ends_without_interpreter_teardown(tmp_path):
    """The rank forkserver outlived a restarted (or SIGKILLed) launcher by > 30 s on a loaded
    machine, in the teardown of the modules it preloaded. With ``forkserver_init`` preloaded
    first it leaves by ``os._exit`` after its ``atexit`` handlers: a module finalizer (the
    teardown) never runs. Without that module it does (the control)."""
    import psutil

    def server_run(preload: list[str]) -> bool:
        mark = tmp_path / f"mark{len(preload)}"
        env = {**ENV, "MRL_TEARDOWN_MARK": str(mark),
               "PYTHONPATH": os.pathsep.join([ROOT, os.path.join(ROOT, "tests")])}
        out = subprocess.run([sys.executable, "-c", FORKSERVER, *preload], env=env,
                             capture_output=True, text=True, timeout=120, check=True).stdout
        server = psutil.Process(int(out.split()[0]))
        try:
            server.wait(timeout=120)
        except psutil.NoSuchProcess:
            pass
        return mark.exists()

    assert server_run(["forkserver_teardown"])  # the control: teardown ran
    assert not server_run(["megatron_rl.parallel.forkserver_init", "forkserver_teardown"])
