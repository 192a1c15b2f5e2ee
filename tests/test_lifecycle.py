"""Process lifecycle of ``python -m megatron_rl train``: a stop signal to the launcher ends every
rank and helper within the stated bound and leaves no partial checkpoint (the run then resumes);
a dead rank stops the job naming it; one live trainer per run directory (a stale lock is taken
over); the fault-injection campaign's quick subset survives."""

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from megatron_rl.parallel.lifecycle import (
    STOP_BOUND_S,
    RunDirBusy,
    RunLock,
    StopSignal,
    describe_exit,
    stop_signals,
)
from megatron_rl.testing.procs import alive

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "PYTHONPATH": ROOT}

HOLDER = """
import sys, time
from megatron_rl.parallel.lifecycle import RunLock
RunLock(sys.argv[1]).acquire()
print("held", flush=True)
time.sleep(600)
"""


def test_describe_exit_and_stop_signals():
    assert describe_exit(-9) == "killed by SIGKILL" and describe_exit(3) == "exit code 3"
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        with pytest.raises(StopSignal) as info, stop_signals():
            os.kill(os.getpid(), sig)
            time.sleep(5)  # the handler raises long before this ends
        assert info.value.signum == sig
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # handlers restored


def test_second_trainer_refused_and_stale_lock_taken_over(tmp_path):
    run_dir = str(tmp_path / "run")
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, run_dir], stdout=subprocess.PIPE,
                              text=True, env=ENV)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunDirBusy, match=f"live trainer \\(pid {holder.pid} on "):
            RunLock(run_dir).acquire()
        res = subprocess.run([sys.executable, "-m", "megatron_rl", "train",
                              f"output_dir={run_dir}"], cwd=ROOT, env=ENV, capture_output=True,
                             text=True, timeout=300)
        assert res.returncode == 2, res.stdout + res.stderr
        assert f"run directory {run_dir} is in use by a live trainer (pid {holder.pid}" in \
            res.stderr
        assert not os.path.exists(os.path.join(run_dir, "checkpoints"))  # started nothing
    finally:
        holder.kill()
        holder.wait()
    # the kernel released the dead holder's lock; its record is still in the file
    lock = RunLock(run_dir).acquire()
    try:
        assert lock.taken_over["pid"] == holder.pid
        assert json.loads(open(lock.path).read())["pid"] == os.getpid()
    finally:
        lock.release()
    assert open(lock.path).read() == ""  # a clean release leaves no stale record
    again = RunLock(run_dir).acquire()
    assert again.taken_over is None
    again.release()


def _helpers_then_die(pid_file: str) -> None:
    """Rank 0 starts two helpers (a plain child, and a server under its guard in its own
    session, as the rollout fleet does) and waits in a barrier; rank 1 dies by SIGKILL once
    they run."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    if dist.get_rank() == 0:
        guard = [sys.executable, "-m", "megatron_rl.rollout.guard", str(os.getpid())]
        helpers = [subprocess.Popen(["sleep", "600"]),
                   subprocess.Popen([*guard, "sleep", "600"], start_new_session=True)]
        while not psutil.Process(helpers[1].pid).children():
            time.sleep(0.05)
        served = psutil.Process(helpers[1].pid).children()[0].pid
        with open(pid_file + ".tmp", "w") as f:
            f.write(" ".join(str(p) for p in [helpers[0].pid, helpers[1].pid, served]))
        os.replace(pid_file + ".tmp", pid_file)
        dist.barrier()  # never returns: rank 1 dies
    else:
        while not os.path.exists(pid_file):
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGKILL)


def test_dead_rank_stops_group_naming_it_and_no_helper_survives(tmp_path):
    from megatron_rl.parallel.launch import WorkerError, spawn

    pid_file = str(tmp_path / "helpers")
    with pytest.raises(WorkerError, match=r"rank 1 \(pid \d+\) died \(killed by SIGKILL\) "
                                          r"without a report"):
        spawn(_helpers_then_die, 2, (pid_file,), timeout_s=300)
    helpers = [psutil.Process(int(p)) for p in open(pid_file).read().split()
               if psutil.pid_exists(int(p))]
    deadline = time.monotonic() + STOP_BOUND_S
    while alive(helpers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(helpers)


TINY = ("sft.steps=3", "trainer.total_steps=3", "trainer.save_freq=1", "trainer.test_freq=3",
        "trainer.plots=false",
        "data.val_size=8", "rollout.dynamic_sampling=false")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sigterm_mid_checkpoint_stops_all_processes_then_resume_finishes(tmp_path):
    """TP1 x PP2: SIGTERM to the launcher while rank 0 is inside the checkpoint write of step 2
    (files written, not yet renamed). Every descendant is gone within the bound, the unfinished
    checkpoint is removed, a second trainer was refused meanwhile, and the resumed run finishes
    with each step logged once."""
    out = tmp_path / "run"
    marker = str(tmp_path / "chaos.jsonl")
    cmd = [sys.executable, "-m", "megatron_rl", "train", "examples/tiny_dapo.yaml",
           f"output_dir={out}", "parallel.tp=1", "parallel.pp=2", *TINY]
    env = {**ENV, "MRL_CHAOS_PHASE": marker, "MRL_CHAOS_HOLD": "1:checkpoint:0"}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 700
    while time.time() < deadline and proc.poll() is None:
        if os.path.exists(marker) and '"hold": true' in open(marker).read():
            break
        time.sleep(0.05)
    assert proc.poll() is None, proc.stdout.read()[-3000:]
    tree = psutil.Process(proc.pid).children(recursive=True)
    assert len(tree) >= 2  # the two ranks (and their helpers)
    assert json.loads(open(out / "run.lock").read())["pid"] == proc.pid
    second = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert second.returncode == 2 and "in use by a live trainer" in second.stderr
    assert (out / "checkpoints" / "step_0000001.tmp").is_dir()  # the write is under way
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    log = proc.communicate(timeout=STOP_BOUND_S)[0]
    while alive(tree) and time.monotonic() - t0 < STOP_BOUND_S:
        time.sleep(0.05)
    assert not alive(tree), f"left behind: {alive(tree)}"
    assert proc.returncode == 128 + signal.SIGTERM, log[-3000:]
    assert "stopped by SIGTERM" in log
    assert not list((out / "checkpoints").glob("*.tmp"))
    assert (out / "checkpoints" / "latest").read_text() == "step_0000000"
    res = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=700)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "resumed from checkpoint at step 1" in res.stdout
    steps = [json.loads(x)["step"] for x in open(out / "metrics.jsonl")]
    assert steps == [0, 1, 2, 3]  # validation at step 0, then each RL step once


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_chaos_quick_subset_survives(tmp_path):
    """``tools/chaos.py --quick``: kill -9 of one rank mid-update (the launcher names it), then of
    the launcher mid-weight-sync in the resumed run; each stop is checked on its own, and the run
    resumed once more ends with the uninterrupted run's metrics and bit-identical final
    checkpoint."""
    res = subprocess.run([sys.executable, "tools/chaos.py", "--quick", "--work",
                          str(tmp_path)], cwd=ROOT, env=ENV, capture_output=True, text=True,
                         timeout=1700)
    assert res.stdout.strip().splitlines()[-1] == "chaos: injected=2 survived=2", \
        res.stdout[-4000:] + res.stderr[-3000:]


def test_two_routers_on_one_machine_both_start(tmp_path):
    """The router's Prometheus exporter must not take a fixed port: a second fleet on the same
    machine (another run, a resumed run while an old router exits) would fail to start."""
    pytest.importorskip("sglang_router")
    from megatron_rl.parallel.launch import free_port
    from megatron_rl.rollout.fleet import router_command, wait_healthy

    procs = []
    try:
        for i in range(2):
            port = free_port()
            log = open(tmp_path / f"router{i}.log", "w")
            procs.append((subprocess.Popen(router_command("127.0.0.1", port), stdout=log,
                                           stderr=subprocess.STDOUT), port))
        for proc, port in procs:
            wait_healthy(f"http://127.0.0.1:{port}", 120, proc)
    finally:
        for proc, _ in procs:
            proc.terminate()
            proc.wait(timeout=30)


def test_cli_exit_now_keeps_output_exit_code_and_atexit(tmp_path):
    """``train``/``sft``/``eval`` end with ``os._exit`` (no interpreter teardown): what they
    printed to a pipe still arrives, the exit code is theirs, and ``atexit`` handlers still run."""
    from megatron_rl.cli.app import exit_now  # noqa: F401 - the helper under test exists

    flag = tmp_path / "atexit_ran"
    code = (f"import atexit, sys; atexit.register(lambda: open({str(flag)!r}, 'w').close()); "
            "from megatron_rl.cli.app import run; run()")
    ok = subprocess.run([sys.executable, "-c", code, "train", "--check",
                         "examples/tiny_dapo.yaml"], cwd=ROOT, env=ENV, capture_output=True,
                        text=True, timeout=300)
    assert ok.returncode == 0 and "config ok: examples/tiny_dapo.yaml" in ok.stdout, ok
    assert flag.exists()
    bad = subprocess.run([sys.executable, "-m", "megatron_rl", "train", "--check",
                          "examples/tiny_dapo.yaml", "parallel.tpp=2"], cwd=ROOT, env=ENV,
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "parallel.tpp" in bad.stderr, bad
