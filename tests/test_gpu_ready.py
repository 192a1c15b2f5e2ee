"""GPU readiness (issue 21): the CUDA/NCCL decisions and fixes that a CPU test can check.

Pure decision functions (backend, tolerance, ...) are tested on tables; the host-group timeout with
two real gloo processes. GPU-only halves live in tests/test_gpu.py (``-m gpu``).
"""

from __future__ import annotations

import time

import pytest
import torch

from megatron_rl.parallel.launch import spawn
from megatron_rl.parallel.runtime import (
    DistEnv,
    ParallelConfigError,
    local_world_size,
    resolve_backend,
)


# ---- item 1: backend choice ----------------------------------------------------------------------
@pytest.mark.parametrize("req,local,gpus,want", [
    ("auto", 1, 1, "nccl"), ("auto", 4, 8, "nccl"), ("auto", 4, 0, "gloo"),
    ("gloo", 4, 1, "gloo"), ("gloo", 1, 0, "gloo"), ("nccl", 2, 2, "nccl"),
])
def test_resolve_backend(req, local, gpus, want):
    assert resolve_backend(req, local, gpus) == want


def test_more_ranks_than_gpus_is_refused_with_the_fix():
    with pytest.raises(ParallelConfigError) as e:
        resolve_backend("auto", 4, 1)
    msg = str(e.value)
    assert "4 ranks on this node but only 1 visible GPU" in msg
    assert "parallel.backend: gloo" in msg and "at most 1 rank(s) per node" in msg
    with pytest.raises(ParallelConfigError, match="4 ranks on this node but only 2"):
        resolve_backend("nccl", 4, 2)


def test_nccl_without_gpus_and_unknown_backend_are_refused():
    with pytest.raises(ParallelConfigError, match="parallel.backend=nccl needs CUDA GPUs"):
        resolve_backend("nccl", 1, 0)
    with pytest.raises(ParallelConfigError, match=r"parallel.backend='mpi' is not one of"):
        resolve_backend("mpi", 1, 1)


def _denv(world: int, local_rank: int = 0, source: str = "torchrun") -> DistEnv:
    return DistEnv(rank=local_rank, world_size=world, local_rank=local_rank,
                   master_addr="h", master_port=1, source=source)


def test_local_world_size_per_node():
    assert local_world_size(_denv(16), {"LOCAL_WORLD_SIZE": "8"}) == 8
    assert local_world_size(_denv(16, source="slurm"),
                            {"SLURM_TASKS_PER_NODE": "4(x2),8", "SLURM_NODEID": "2"}) == 8
    assert local_world_size(_denv(4), {}) == 4  # one node
    assert local_world_size(_denv(16, local_rank=9), {"LOCAL_WORLD_SIZE": "8"}) == 10


def test_backend_env_var_and_gloo_hide_cuda(monkeypatch):
    from megatron_rl.parallel import runtime

    monkeypatch.setenv(runtime.BACKEND_ENV, "gloo")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert runtime.choose_backend("auto") == "gloo"
    import os
    assert os.environ["CUDA_VISIBLE_DEVICES"] == ""


def test_local_spawn_refuses_before_starting_ranks(monkeypatch):
    from megatron_rl.cli import app as cli

    monkeypatch.delenv("MRL_PARALLEL_BACKEND", raising=False)
    assert cli.local_spawn_env("gloo", 4) == {"CUDA_VISIBLE_DEVICES": ""}
    from megatron_rl.parallel import backend

    monkeypatch.setattr(backend, "visible_gpu_count", lambda: 1)  # a 1-GPU machine's answer
    with pytest.raises(ParallelConfigError, match="4 ranks on this node but only 1"):
        cli.local_spawn_env("auto", 4)
    assert cli.local_spawn_env("auto", 1) == {}
    assert cli.local_spawn_env("gloo", 4) == {"CUDA_VISIBLE_DEVICES": ""}


def test_visible_gpu_count_is_torchs_count(monkeypatch):
    """The launcher counts GPUs without importing torch where no GPU driver exists; the answer
    is torch's wherever it runs (0 with CUDA_VISIBLE_DEVICES empty)."""
    from megatron_rl.parallel.backend import visible_gpu_count

    assert visible_gpu_count() == torch.cuda.device_count()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert visible_gpu_count() == 0


@pytest.mark.parametrize("override,needle", [
    ("parallel.backend=mpi", "parallel.backend='mpi' is not one of"),
    ("parallel.host_timeout_s=0", "parallel.host_timeout_s must be > 0"),
    ("parallel.timeout_s=-1", "parallel.timeout_s must be > 0"),
])
def test_parallel_section_is_checked_at_load(override, needle):
    from megatron_rl.config.errors import ConfigError
    from megatron_rl.config.load import load_config

    with pytest.raises(ConfigError, match=needle.replace("(", r"\(")):
        load_config(None, [override])


# ---- item 2: host-group timeout vs update-collective timeout ------------------------------------
def _timeout_worker(delay_s: float) -> dict:
    import torch.distributed as dist

    from megatron_rl.parallel import runtime

    runtime.init_parallel(tp=1, pp=1, timeout_s=3, host_timeout_s=120)
    rank = dist.get_rank()
    if rank == 0:
        time.sleep(delay_s)  # "rank 0 generates a long rollout"
    got = runtime.broadcast_object("batch" if rank == 0 else None)
    from megatron_rl.run.driver import dp_rank_table, scatter_rows

    table = dp_rank_table()
    if rank == 0:
        time.sleep(delay_s)  # the step batch goes to each rank as its DP rows: same host group
    rows, _, _ = scatter_rows({"tokens": torch.arange(4).view(2, 2)} if rank == 0 else None,
                              None, table, 2, 0)
    # a device-group collective with one late rank must fail after the short timeout
    if rank == 0:
        time.sleep(delay_s)
    t0 = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1))
        late = "completed"
    except Exception as exc:  # noqa: BLE001 - the timeout is what we look for
        late = type(exc).__name__
    out = {"got": got, "rows": rows["tokens"].tolist(), "late": late,
           "waited": time.monotonic() - t0}
    runtime.shutdown()
    return out


@pytest.mark.slow
def test_host_group_outlives_the_update_timeout():
    outs = spawn(_timeout_worker, 2, (8.0,), timeout_s=300)
    assert [o["got"] for o in outs] == ["batch", "batch"]  # waited 8 s > timeout_s=3
    assert [o["rows"] for o in outs] == [[[0, 1]], [[2, 3]]]  # its DP rows, after 8 s too
    assert outs[1]["late"] != "completed" and outs[1]["waited"] < 8.0, outs


# ---- item 3: probe tolerance from the precisions ----------------------------------------------
@pytest.mark.parametrize("overrides,want", [
    ([], 1e-4),  # CPU: fp32 actor, our fp32 `serve`
    (["actor.precision=bf16"], 0.25),  # the mean gap over the probe (docs/gpu.md)
    (["rollout.sglang.launcher=sglang"], 0.25),  # SGLang serves in bf16
    (["actor.precision=fp16"], 0.05),
    (["actor.precision=bf16", "rollout.sglang.probe_tolerance=0.3"], 0.3),  # explicit wins
])
def test_probe_tolerance_default_follows_precision(overrides, want):
    from megatron_rl.config.load import load_config
    from megatron_rl.rollout.sglang_client import probe_tolerance_of

    cfg = load_config(None, ["rollout.engine=sglang", *overrides])
    assert cfg.rollout.sglang.probe_tolerance == (0.3 if "0.3" in str(overrides) else None)
    assert probe_tolerance_of(cfg) == want


# ---- item 4: the SFT actor is gone before the RL actor is built ---------------------------------
def _sft_free_worker() -> dict:
    from megatron_rl.config.load import load_config
    from megatron_rl.parallel import runtime

    runtime.init_parallel(tp=1, pp=1, timeout_s=120)
    out = {}
    for distopt in ("false", "true"):
        cfg = load_config(None, ["sft.steps=1", "sft.batch_size=2", "actor.micro_batch_size=1",
                                 f"optim.use_distributed_optimizer={distopt}"])
        out[distopt] = _sft_free_once(cfg)
    runtime.shutdown()
    return out


def _sft_free_once(cfg) -> dict:
    import gc
    import weakref

    from megatron_rl.actor.precision import distributed_optimizers
    from megatron_rl.run import setup
    from megatron_rl.run.sft import run_sft

    refs = []
    kinds = []

    def make_actor(*args, **kwargs):
        actor = setup.make_actor(*args, **kwargs)
        # the model and optimizer: megatron's DDP grad hooks and the optimizer's scale_loss
        # (held by the model config) put them in reference cycles
        refs.append((weakref.ref(actor.model), weakref.ref(actor.optimizer)))
        kinds.append(bool(distributed_optimizers(actor.optimizer)))
        return actor

    gc.disable()  # only an explicit collection may free the cycles (deterministic test)
    try:
        run_sft(cfg, setup.make_tokenizer(cfg), [{"prompt": "1+1=", "answer": "2"}] * 4,
                make_actor)
        alive = [r() is not None for r in refs[0]]
    finally:
        gc.enable()
    return {"alive": alive, "built": len(refs), "distributed_optimizer": kinds[0]}


def test_sft_actor_is_freed_before_the_rl_actor():
    """With either optimizer (the warm start uses the run's ``optim.use_distributed_optimizer``)."""
    (out,) = spawn(_sft_free_worker, 1, (), timeout_s=300)
    assert out == {d: {"alive": [False, False], "built": 1, "distributed_optimizer": d == "true"}
                   for d in ("false", "true")}


# ---- item 6: fused head: cuBLAS probe on the device, label range on every device ----------------
def test_cublas_probe_makes_its_tensors_on_the_device():
    from megatron_rl.kernels import fused_head_triton as fht
    from megatron_rl.testing.device_spy import DeviceSpy

    fht._cublas_fp32_accumulate_ok.cache_clear()
    with DeviceSpy(device=torch.device("cpu")) as spy:
        ok = fht._cublas_fp32_accumulate_ok(torch.device("cpu"), torch.bfloat16)
    assert spy.violations == [], spy.report()
    assert isinstance(ok, bool)
    fht._cublas_fp32_accumulate_ok(torch.device("cpu"), torch.bfloat16)
    assert fht._cublas_fp32_accumulate_ok.cache_info().hits == 1  # probed once, not per call


def test_label_range_check_is_shared_by_the_fused_and_unfused_ops():
    from megatron_rl.kernels.fused_head import fused_linear_logprob_entropy
    from megatron_rl.ops.vocab_parallel import vocab_parallel_logprob_entropy

    h, w = torch.randn(3, 4), torch.randn(8, 4)
    bad = torch.tensor([0, 8, 1])
    for call in (lambda: fused_linear_logprob_entropy(h, w, bad, backend="torch"),
                 lambda: vocab_parallel_logprob_entropy(h @ w.t(), bad)):
        with pytest.raises(ValueError, match=r"labels out of range \[0, 8\) \(V_global"):
            call()


# ---- item 7: RNG states restored only onto the device type they were saved on -------------------
def _rng_worker() -> dict:
    from megatron.core import tensor_parallel

    from megatron_rl.actor import checkpoint as ck
    from megatron_rl.parallel import runtime

    runtime.init_parallel(tp=1, pp=1, timeout_s=120)
    tracker = tensor_parallel.get_cuda_rng_tracker()
    saved = ck._rng_state()
    before = {k: v.clone() for k, v in tracker.get_states().items()}
    gpu_saved = dict(saved, device="cuda", cuda=torch.zeros(16, dtype=torch.uint8),
                     tracker={k: torch.zeros(16, dtype=torch.uint8) for k in before})
    torch.rand(3)  # move the host generator on
    from_gpu = ck._set_rng_state(gpu_saved)
    host_restored = torch.equal(torch.get_rng_state(), saved["torch"])
    kept = all(torch.equal(tracker.get_states()[k], v) for k, v in before.items())
    old_cpu = {k: v for k, v in saved.items() if k != "device"}  # a checkpoint from before
    out = {"from_gpu": from_gpu, "host_restored": host_restored, "tracker_kept": kept,
           "device": saved["device"], "from_old_cpu": ck._set_rng_state(old_cpu)}
    runtime.shutdown()
    return out


def test_rng_restore_is_keyed_by_device():
    (out,) = spawn(_rng_worker, 1, (), timeout_s=300)
    assert out == {"from_gpu": False, "host_restored": True, "tracker_kept": True,
                   "device": "cpu", "from_old_cpu": True}


# ---- item 13: response positions found once per mini-batch, not per micro-batch -----------------
class _OpCounter(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts aten ops by name (a real dispatch mode; nothing is replaced)."""

    def __init__(self):
        super().__init__()
        self.counts: dict[str, int] = {}
        self.numels: dict[str, list[int]] = {}  # first argument's numel per call

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.counts[name] = self.counts.get(name, 0) + 1
        if args and isinstance(args[0], torch.Tensor):
            self.numels.setdefault(name, []).append(args[0].numel())
        return func(*args, **(kwargs or {}))


def _nonzero_worker() -> dict:
    import dataclasses

    from test_precision import _actor, _one_update

    from megatron_rl.parallel import runtime

    runtime.init_parallel(tp=1, pp=1, timeout_s=120)
    out = {}
    for micro in (1, 2):  # 4 and 2 micro-batches of the same 4-row mini-batch
        actor = _actor("fp32")
        actor.cfg = dataclasses.replace(actor.cfg, micro_batch_size=micro)
        with _OpCounter() as c:
            hist = _one_update(actor)
        out[micro] = {"nonzero": c.counts.get("nonzero", 0),
                      "nonzero_static": c.counts.get("nonzero_static", 0),
                      "loss": hist[-1]["actor/loss"]}
    runtime.shutdown()
    return out


def test_nonzero_once_per_minibatch_not_per_micro_batch():
    (out,) = spawn(_nonzero_worker, 1, (), timeout_s=300)
    assert out[1]["nonzero"] == out[2]["nonzero"], out  # independent of the micro-batch count
    assert out[1]["nonzero_static"] == out[2]["nonzero_static"] >= 1, out
    assert abs(out[1]["loss"] - out[2]["loss"]) < 1e-5, out


# ---- item 12: a spot check copies two rows, not the whole tensor --------------------------------
def test_spot_check_converts_only_two_rows():
    from megatron_rl.rollout.weight_sync.common import SyncStrategy

    s = SyncStrategy([], "/nonexistent", spots_per_send=1)  # spot checks are off by default
    w = torch.randn(1000, 64).bfloat16()  # a bf16 bucket tensor: .float() is a real copy
    with _OpCounter() as c:
        s._remember_spots([("w", w)])
    assert s.spots == [("w", w[:2].float().tolist())]
    assert c.counts.get("_to_copy") and max(c.numels["_to_copy"]) == 2 * 64, c.numels


# ---- item 16a: phase timers wait for the device ----------------------------------------------
def test_phase_timer_synchronizes_cuda(monkeypatch):
    from megatron_rl.metrics.step import Phases

    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: calls.append(1))
    ph = Phases(sync=True)
    with ph("update"):
        pass
    assert len(calls) == 2 and "time/update" in ph.times  # before and after the phase
    assert Phases().sync is (torch.cuda.is_available() and torch.cuda.is_initialized())


# ---- item 10: MRL_REQUIRE_GPU=1 turns the gpu tier's skips into failures -------------------------
@pytest.mark.parametrize("require,rc,word", [("", 0, "skipped"), ("1", 1, "errors")])
def test_require_gpu_turns_skips_into_failures(require, rc, word):
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "MRL_REQUIRE_GPU": require, "CUDA_VISIBLE_DEVICES": ""}
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "tests/test_gpu.py::test_out_of_range_labels_fail_on_cuda"],
                         cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == rc, res.stdout[-2000:]
    assert f"2 {word}" in res.stdout, res.stdout[-2000:]


# ---- item 9: trainer.deterministic ------------------------------------------------------------
def _deterministic_worker(on: bool) -> dict:
    import os

    from megatron_rl.config.load import load_config
    from megatron_rl.parallel import runtime
    from megatron_rl.run import setup

    cfg = load_config(None, [f"trainer.deterministic={str(on).lower()}"])
    setup.init_parallel(cfg)
    out = {"algos": torch.are_deterministic_algorithms_enabled(),
           "cublas": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
           "flash": torch.backends.cuda.flash_sdp_enabled(),
           "mem_efficient": torch.backends.cuda.mem_efficient_sdp_enabled(),
           "math": torch.backends.cuda.math_sdp_enabled(),
           "cudnn": torch.backends.cudnn.deterministic}
    runtime.shutdown()
    return out


def test_trainer_deterministic_switch():
    (on,) = spawn(_deterministic_worker, 1, (True,), timeout_s=300)
    assert on == {"algos": True, "cublas": ":4096:8", "flash": False, "mem_efficient": False,
                  "math": True, "cudnn": True}
    (off,) = spawn(_deterministic_worker, 1, (False,), timeout_s=300,
                   env={"CUBLAS_WORKSPACE_CONFIG": ""})
    assert off["algos"] is False and off["flash"] is True


# ---- item 8: MFU conventions and peaks by full device name ------------------------------------
def test_mfu_conventions_and_device_peaks():
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools",
                        "bench_actor_step.py")
    spec = importlib.util.spec_from_file_location("bench_actor_step", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    for name, tf in (("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0),
                     ("NVIDIA H100 NVL", 835.0), ("NVIDIA H200", 989.0),
                     ("NVIDIA A100-SXM4-80GB", 312.0), ("NVIDIA H100", None)):
        assert bench.peak_tflops_of(name) == tf, name
    from megatron_rl.models.config import get_preset

    cfg = get_preset("tiny")
    head = cfg.head_dim or cfg.hidden_size // cfg.num_attention_heads
    attn6 = 6 * cfg.num_hidden_layers * 32 * 32 * cfg.num_attention_heads * head * 2
    f6, f12 = bench.model_flops(cfg, 2, 32), bench.model_flops(cfg, 2, 32, attention_factor=12)
    assert f12 - f6 == attn6


# ---- item 5: the embedded engine generates on the actor's device in the actor's precision ------
def test_engine_placement():
    from megatron_rl.rollout.embedded import engine_placement

    cuda = torch.device("cuda", 0)
    assert engine_placement(None, torch.device("cpu")) == (torch.device("cpu"), torch.float32)
    assert engine_placement("bf16", cuda) == (cuda, torch.bfloat16)
    assert engine_placement("fp32", cuda) == (cuda, torch.float32)


def test_embedded_generate_makes_tensors_on_purpose():
    from megatron_rl.models.config import get_preset
    from megatron_rl.rollout.embedded import EmbeddedEngine
    from megatron_rl.rollout.engine import SamplingParams
    from megatron_rl.testing.device_spy import DeviceSpy

    engine = EmbeddedEngine(get_preset("tiny"), eos_id=1, pad_id=0, dtype=torch.float32)
    assert engine.device == torch.device("cpu") and engine.weight_dtype == torch.float32
    with DeviceSpy(device=torch.device("cpu")) as spy:
        out = engine.generate([[5, 6, 7], [8]], SamplingParams(n=2, max_new_tokens=3), seed=0)
    assert [len(g) for g in out] == [2, 2]
    mine = [v for v in spy.violations if "embedded.py" in v.where]
    assert mine == [], spy.report()


def test_ranks_fork_from_a_server_only_without_a_gpu_driver(monkeypatch):
    """A fork of a process whose imports initialised CUDA cannot use CUDA: where a GPU driver is
    present the ranks are spawned; elsewhere they fork from a server that imported torch once."""
    from megatron_rl.parallel import backend, launch

    monkeypatch.delenv(launch.START_METHOD_ENV, raising=False)
    monkeypatch.setattr(backend, "gpu_driver_present", lambda: True)
    assert launch.start_context().get_start_method() == "spawn"
    monkeypatch.setattr(backend, "gpu_driver_present", lambda: False)
    assert launch.start_context().get_start_method() == "forkserver"
    # Triton reads TRITON_INTERPRET when it is imported: such a group starts fresh interpreters
    assert launch.start_context(env={"TRITON_INTERPRET": "1"}).get_start_method() == "spawn"
    monkeypatch.setenv(launch.START_METHOD_ENV, "spawn")
    assert launch.start_context().get_start_method() == "spawn"
    monkeypatch.setenv(launch.START_METHOD_ENV, "fork")
    with pytest.raises(ValueError, match="not one of"):
        launch.start_context()
