"""Shared pytest hooks: ``gpu``-marked tests skip automatically where CUDA is unavailable; with
``MRL_REQUIRE_GPU=1`` (the GPU machine's runner sets it) they fail instead, so a GPU run that
silently lost its GPU cannot pass."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch

REQUIRE_GPU_VAR = "MRL_REQUIRE_GPU"
# The tests' process groups fork from one server that has the actor imported (parallel/launch.py)
os.environ.setdefault("MRL_FORKSERVER_PRELOAD", "megatron_rl.actor.actor")


def gpu_missing_action(environ=None) -> str:
    """``"fail"`` when ``MRL_REQUIRE_GPU=1``, else ``"skip"`` (for a gpu test without CUDA)."""
    env = os.environ if environ is None else environ
    return "fail" if env.get(REQUIRE_GPU_VAR) == "1" else "skip"


def pytest_runtest_setup(item):
    if "gpu" not in item.keywords or torch.cuda.is_available():
        return
    reason = "needs a CUDA GPU (torch.cuda.is_available() is False)"
    if gpu_missing_action() == "fail":
        pytest.fail(f"{reason} and {REQUIRE_GPU_VAR}=1", pytrace=False)
    pytest.skip(reason)


@contextlib.contextmanager
def serve_tiny():
    """Our ``serve`` of the tiny preset model (EOS id 1) in a thread on a free port:
    ``(base url, ServeState)`` while the block runs."""
    import threading

    from megatron_rl.models.config import get_preset
    from megatron_rl.rollout.embedded import build_hf_model
    from megatron_rl.rollout.serve import ServeState, make_server

    torch.manual_seed(0)
    state = ServeState(build_hf_model(get_preset("tiny")), "preset:tiny", 1, 0)
    srv = make_server(state, "127.0.0.1", 0)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{state.port}", state
    finally:
        srv.shutdown()


def make_preset_hf(out_dir: str, preset: str = "tiny", seed: int = 0) -> str:
    """A random HF model directory with a preset's architecture and no tokenizer files (the
    byte tokenizer of the tiny presets): e.g. a distillation teacher for a preset student."""
    from megatron_rl.models.config import get_preset
    from megatron_rl.rollout.embedded import build_hf_model

    torch.manual_seed(seed)
    build_hf_model(get_preset(preset)).save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="module")
def server():
    """:func:`serve_tiny`, one per test module."""
    with serve_tiny() as s:
        yield s


# ---- one short RL run through a real sglang-router fleet, shared by two test modules ------------
def tiny_train(out, *overrides: str, timeout: int = 800) -> tuple[list[dict], str]:
    """Three RL steps of the tiny recipe at TP1 x PP2 (per-request seeds: the samples do not
    depend on which server or batch served a request): ``(metrics rows, stdout)``. The CLI runs
    in place on two spawned ranks (:func:`run_cli`, as under torchrun)."""
    import json

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    argv = ["train", os.path.join(root, "examples", "tiny_dapo.yaml"),
            f"output_dir={out}", "parallel.tp=1", "parallel.pp=2", "trainer.total_steps=3",
            "trainer.plots=false", "trainer.test_freq=3", "trainer.save_freq=3",
            "trainer.train_batch_size=4", "rollout.n=4", "rollout.gen_batch_size=4",
            "rollout.dynamic_sampling=false", "rollout.val_n=1", "actor.micro_batch_size=8",
            "actor.mini_batch_size=8",
            "sft.steps=10", "data.val_size=8", "rollout.per_request_seed=true",
            "rollout.temperature=0.9", *overrides]
    (code, stdout, stderr), = run_cli(2, argv, timeout_s=timeout)
    assert code == 0, stdout[-3000:] + stderr[-3000:]
    return [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))], stdout


@pytest.fixture(scope="session")
def fleet_run(tmp_path_factory):
    """:func:`tiny_train` through two of our ``serve`` servers behind the real router, weights
    synced from tensors: ``(metrics rows, output dir)``."""
    from megatron_rl.testing.procs import free_port_block

    out = tmp_path_factory.mktemp("fleet_run")
    rows, _ = tiny_train(out, "rollout.engine=sglang", "rollout.sglang.num_servers=2",
                         f"rollout.sglang.router_port={free_port_block(3)}",
                         "rollout.sglang.weight_sync=from_tensor")
    return rows, out


# ---- CLI commands in spawned ranks (no launcher process, no interpreter start per command) ------
def cli_each(commands: list, port_dir: str) -> list[tuple[int, str, str]]:
    """``python -m megatron_rl ARGV`` for each ARGV of ``commands`` in turn, in this spawned rank:
    the spawn's torchrun variables (RANK, WORLD_SIZE, LOCAL_RANK) make ``train``/``sft``/``eval``
    run this rank in place, as under torchrun; every rank of the group runs every command, each
    command with a fresh rendezvous port (rank 0 picks it and leaves it in ``port_dir``).
    Returns ``(exit code, stdout, stderr)`` per command (-1 and the traceback in stderr for an
    exception); stops after the first exception."""
    import contextlib
    import io
    import time
    import traceback

    from megatron_rl.cli.app import main
    from megatron_rl.parallel import runtime
    from megatron_rl.parallel.launch import free_port

    results = []
    for i, argv in enumerate(commands):
        port_file = os.path.join(port_dir, f"port{i}")
        if os.environ["RANK"] == "0":
            with open(port_file + ".tmp", "w") as f:
                f.write(str(free_port()))
            os.replace(port_file + ".tmp", port_file)
        while not os.path.exists(port_file):
            time.sleep(0.05)
        os.environ["MASTER_PORT"] = open(port_file).read()
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(list(argv))
            except SystemExit as exc:  # argparse's usage errors
                code = exc.code if isinstance(exc.code, int) else 1
            except Exception:  # noqa: BLE001 - reported to the test
                code = -1
                err.write(traceback.format_exc())
                runtime.shutdown()
        results.append((code, out.getvalue(), err.getvalue()))
        if code == -1:
            break
    return results


def run_cli(world: int, *commands, timeout_s: float = 850,
            env: dict | None = None) -> list[tuple[int, str, str]]:
    """:func:`cli_each` on ``world`` spawned ranks (world = the commands' TP x PP x CP x DP):
    rank 0's ``(exit code, stdout, stderr)`` per command. The ranks fork from the test
    process's rank server, which has torch and megatron-core imported already; ``env``: more
    variables for them."""
    import shutil
    import tempfile

    from megatron_rl.parallel.launch import spawn

    port_dir = tempfile.mkdtemp(prefix="mrl_cli_ports_")
    try:
        return spawn(cli_each, world, (list(commands), port_dir), timeout_s=timeout_s,
                     env={"CUDA_VISIBLE_DEVICES": "", **(env or {})})[0]
    finally:
        shutil.rmtree(port_dir, ignore_errors=True)
