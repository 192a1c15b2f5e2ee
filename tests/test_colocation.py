"""Colocation (``rollout.sglang.colocate``): actor offload/onload, server release/resume, the
colocated loop, config rules.

The actor tests run a real megatron-core actor at TP2 over gloo (2 processes), with the standard
optimizer in fp32 and the distributed optimizer in bf16:

- offload then onload restores every byte of every tensor the actor reaches (parameters, DDP
  param/grad buffers and ``main_grad`` views, fp32 main parameters, Adam moments and steps);
- while offloaded, the device-accounting spy (a CPU stand-in for ``torch.cuda.memory_allocated``,
  :mod:`megatron_rl.testing.device_accounting`) finds 0 bytes of the actor on the device, and a
  forward pass fails loudly instead of reading freed memory;
- a training step after the round trip equals the same step of an actor never offloaded, bit for
  bit (weights and metrics).
"""

from __future__ import annotations

import os

import pytest
import torch

from megatron_rl.models.config import get_preset
from megatron_rl.parallel.launch import spawn
from megatron_rl.plan.inputs import PlanInputs

CASES = (("fp32", False), ("bf16", True))  # (precision, use_distributed_optimizer)


def _actor(precision: str, dist_opt: bool):
    from test_actor_layout import loss_config

    from megatron_rl.actor.actor import Actor
    from megatron_rl.actor.optim import OptimConfig
    from megatron_rl.actor.train_step import ActorConfig
    from megatron_rl.models.config import get_preset

    return Actor(get_preset("tiny"), ActorConfig(micro_batch_size=2, precision=precision),
                 OptimConfig(lr=1e-3, adam_eps=1e-6, clip_grad=1.0,
                             use_distributed_optimizer=dist_opt),
                 loss_config(), total_steps=3, seed=7)


def _step(actor, batch: dict, step: int) -> list:
    b = dict(batch)
    actor.add_old_logprobs(b)
    return actor.update(b, step)


def _bytes_of(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """A host copy of each tensor's whole storage, as bytes."""
    from megatron_rl.actor.offload import _as_bytes

    return [_as_bytes(t.untyped_storage()).clone() for t in tensors]


def _roundtrip(precision: str, dist_opt: bool) -> dict:
    from test_actor_layout import make_global_batch

    from megatron_rl.actor.offload import ActorOffload
    from megatron_rl.models.weights import gather_full_state_dict
    from megatron_rl.testing.device_accounting import device_bytes, device_tensors

    batch = make_global_batch()
    batch.pop("old_noise")
    out: dict = {}
    # -- offloaded between step 0 and step 1, in the colocated loop's order -------------------
    actor = _actor(precision, dist_opt)
    hist = _step(actor, batch, 0)
    tensors = device_tensors(actor, "cpu")
    before = _bytes_of(tensors)
    out["bytes_before"] = device_bytes(actor, "cpu")
    off = ActorOffload(actor, "cpu")
    moved = off.offload(["grads", "optimizer"])  # after the update
    out["bytes_params_only"] = device_bytes(actor, "cpu")
    moved.update(off.offload(["params"]))  # after the weight sync
    out["moved"] = moved
    out["bytes_offloaded"] = device_bytes(actor, "cpu")  # during rollout
    try:
        actor.logprobs(dict(batch), compute_entropy=False)
        out["forward_while_offloaded"] = "ran"
    except RuntimeError as exc:
        out["forward_while_offloaded"] = str(exc)[:200]
    off.onload()
    after = _bytes_of(tensors)
    out["changed"] = sum(not torch.equal(a, b) for a, b in zip(before, after))
    out["compared"] = len(before)
    hist += _step(actor, batch, 1)
    out["state"] = gather_full_state_dict(actor.model)
    out["hist"] = hist
    # -- the same two steps, never offloaded -------------------------------------------------
    ref = _actor(precision, dist_opt)
    ref_hist = _step(ref, batch, 0) + _step(ref, batch, 1)
    out["ref_state"] = gather_full_state_dict(ref.model)
    out["ref_hist"] = ref_hist
    return out


def _worker() -> dict:
    """Every multi-rank check of this file in one 2-rank TP2 job (one process-group start)."""
    from megatron_rl.parallel import runtime

    runtime.init_parallel(tp=2, pp=1, dp=1, timeout_s=120)
    out = {case: _roundtrip(*case) for case in CASES}
    out["handoffs"] = _handoffs()
    out["stream"] = _stream_sender_pass()
    runtime.shutdown()
    return out


@pytest.fixture(scope="module")
def roundtrips() -> dict:
    ranks = spawn(_worker, 2, timeout_s=900)
    return {key: [r[key] for r in ranks] for key in ranks[0]}


@pytest.mark.parametrize("case", CASES, ids=["fp32-standard", "bf16-distopt"])
def test_offload_onload_is_bit_exact(roundtrips, case):
    for r in roundtrips[case]:
        assert r["compared"] > 10 and r["changed"] == 0
        assert set(r["moved"]) == {"params", "grads", "optimizer"}
        assert all(n > 0 for n in r["moved"].values())


@pytest.mark.parametrize("case", CASES, ids=["fp32-standard", "bf16-distopt"])
def test_nothing_of_the_actor_stays_on_the_device(roundtrips, case):
    for r in roundtrips[case]:
        assert r["bytes_before"] == sum(r["moved"].values())
        assert 0 < r["bytes_params_only"] < r["bytes_before"]
        assert r["bytes_offloaded"] == 0
        assert r["forward_while_offloaded"] != "ran"


@pytest.mark.parametrize("case", CASES, ids=["fp32-standard", "bf16-distopt"])
def test_training_after_onload_equals_never_offloaded(roundtrips, case):
    r = roundtrips[case][0]
    assert r["hist"] == r["ref_hist"]
    assert r["state"].keys() == r["ref_state"].keys()
    for k, v in r["state"].items():
        assert torch.equal(v, r["ref_state"][k]), k


# ---- our serve: SGLang's /release_memory_occupation and /resume_memory_occupation ------------
@pytest.fixture()
def server():
    """A fresh tiny ``serve`` per test (these tests release and resume its memory)."""
    from conftest import serve_tiny

    with serve_tiny() as s:
        yield s


def _gen(url: str, n: int = 4, **sp):
    from megatron_rl.rollout.fleet import http_json

    return http_json("POST", url + "/generate", {
        "input_ids": [5, 6, 7], "return_logprob": True,
        "sampling_params": {"max_new_tokens": n, "temperature": 1.0, "sampling_seed": 3, **sp}},
        timeout=120)


def test_serve_release_frees_weights_and_refuses_generation(server):
    from megatron_rl.rollout.fleet import ServerError, http_json
    from megatron_rl.rollout.memory_occupation import release_servers, resume_servers
    from megatron_rl.testing.device_accounting import device_bytes

    url, state = server
    first = _gen(url)
    held = device_bytes(state.model, "cpu")
    assert held > 0
    assert http_json("POST", url + "/release_memory_occupation", {"tags": None}) is None
    assert device_bytes(state.model, "cpu") == 0  # every weight storage is freed
    assert http_json("GET", url + "/server_info")["internal_states"][0]["memory_released"] == \
        ["cuda_graph", "kv_cache", "weights"]
    with pytest.raises(ServerError, match="HTTP 400.*memory released"):
        _gen(url)
    with pytest.raises(ServerError, match="HTTP 400.*weights released"):
        http_json("POST", url + "/update_weights_from_disk", {"model_path": "/nonexistent"})
    with pytest.raises(ServerError, match="HTTP 400.*must be one of"):  # an unknown tag
        resume_servers([url], ["bogus"])
    resume_servers([url])  # tags None: all three
    assert device_bytes(state.model, "cpu") == held
    p = next(state.model.parameters())
    assert not p.any()  # resumed weights hold nothing (zeros) until the next weight sync
    with pytest.raises(ServerError, match="HTTP 400.*not released"):
        resume_servers([url], ["weights"])
    # partial: the KV cache alone; the weights stay, generation waits for the resume
    release_servers([url], ["kv_cache"])
    assert device_bytes(state.model, "cpu") == held
    with pytest.raises(ServerError, match="HTTP 400.*kv_cache"):
        _gen(url)
    resume_servers([url], ["kv_cache"])
    assert first["meta_info"]["completion_tokens"] == 4


def test_serve_release_refused_while_a_request_runs(server):
    import threading
    import time

    from megatron_rl.rollout.fleet import ServerError, http_json

    url, state = server
    th = threading.Thread(target=_gen, args=(url, 100000), kwargs={"ignore_eos": True},
                          daemon=True)
    th.start()
    deadline = time.monotonic() + 60
    while not state.inflight and time.monotonic() < deadline:
        time.sleep(0.05)
    assert state.inflight
    with pytest.raises(ServerError, match="HTTP 400.*no ongoing request"):
        http_json("POST", url + "/release_memory_occupation", {})
    http_json("POST", url + "/abort_request", {"abort_all": True})
    th.join(60)
    assert http_json("POST", url + "/release_memory_occupation", {}) is None


def test_serve_weight_sync_after_resume_restores_exact_weights(server, tmp_path):
    from megatron_rl.config.sections import SGLangSection
    from megatron_rl.models.config import get_preset
    from megatron_rl.rollout.embedded import build_hf_model
    from megatron_rl.rollout.fleet import Fleet
    from megatron_rl.rollout.memory_occupation import release_servers, resume_servers
    from megatron_rl.rollout.sampling import teacher_forced_logprobs
    from megatron_rl.rollout.sglang_client import SGLangEngine
    from megatron_rl.rollout.weight_sync import make_strategy, push_single_process
    from megatron_rl.rollout.weight_sync.common import probe_check, probe_tokens

    url, state = server
    torch.manual_seed(5)
    other = build_hf_model(get_preset("tiny"))
    fleet = Fleet(SGLangSection(servers=[url], router_url=url), "preset:tiny", 1,
                  str(tmp_path / "logs"))
    fleet.workers = {url: "direct"}
    eng = SGLangEngine(fleet, 1, concurrency=2)
    eng.sync = make_strategy("from_tensor", fleet, str(tmp_path / "sync"))
    release_servers([url])
    resume_servers([url])
    push_single_process(eng, [list(other.state_dict().items())], version=3)
    for (n, p), (_, q) in zip(other.named_parameters(), state.model.named_parameters()):
        assert torch.equal(p, q), n
    ids = probe_tokens(get_preset("tiny").vocab_size, 12)
    worst, errors = probe_check([url], ids, teacher_forced_logprobs(other, ids), 1e-5)
    assert not errors


def test_colocated_sync_health_check_does_not_generate_while_kv_released(server, tmp_path):
    """During the colocated sync the servers' KV cache is released (a generation is refused,
    as it would run on released memory in SGLang): the sync's health check then checks the
    processes only and keeps the server; the probe generates after the KV cache is back."""
    from megatron_rl.config.sections import SGLangSection
    from megatron_rl.rollout.fleet import Fleet, ServerError, http_json
    from megatron_rl.rollout.memory_occupation import release_servers, resume_servers
    from megatron_rl.run.colocation import Colocation

    url, _ = server
    fleet = Fleet(SGLangSection(servers=[url], router_url=url), "preset:tiny", 1,
                  str(tmp_path / "logs"))
    fleet.workers = {url: "direct"}
    release_servers([url], ["kv_cache", "cuda_graph"])
    try:
        with pytest.raises(ServerError):
            http_json("GET", url + "/health_generate", timeout=10)
        assert Colocation.servers_generate is False  # what sync_weights reads from its hooks
        assert fleet.check_health(generate=False) == [] and fleet.urls == [url]
    finally:
        resume_servers([url], ["kv_cache", "cuda_graph"])
    assert fleet.check_health() == [] and fleet.urls == [url]


# ---- the colocated loop through our serve fleet and the real router --------------------------
@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_colocated_run_equals_separate_run(fleet_run, tmp_path):
    """One colocated server (the actor offloaded around each rollout, checkpoints in between)
    against the shared run on two separate servers: the same run, bit for bit (per-request
    seeds make the samples independent of the server that made them)."""
    from conftest import tiny_train

    from megatron_rl.testing.procs import free_port_block

    sep, _ = fleet_run
    colo, log = tiny_train(tmp_path / "colo", "rollout.engine=sglang",
                           "rollout.sglang.num_servers=1", "rollout.sglang.weight_sync=from_tensor",
                           f"rollout.sglang.router_port={free_port_block(2)}",
                           "rollout.sglang.colocate=true", "trainer.save_freq=1")
    assert "[colocation] rank 0 actor offloaded to the host: params" in log
    assert len(sep) == len(colo) == 4  # the start's validation + 3 steps
    assert any(r["actor/grad_norm"] > 0 for r in colo[1:])  # real updates to carry over
    for a, b in zip(sep, colo):
        volatile = ("time", "gpu/", "sys/", "rollout/weight_sync_")  # sys/: RSS, open fds
        keys = {k for k in a if not k.startswith(volatile) and k != "wall_s"}
        assert keys == {k for k in b if not k.startswith(volatile) and k != "wall_s"}
        for k in keys:
            assert a[k] == b[k], k  # bit for bit: the offload round trip is exact
    assert all("time/colocate_swap" in r for r in colo if "policy/pg_loss" in r)
    assert not any("time/colocate_swap" in r for r in sep)
    ckpts = [c for c in os.listdir(tmp_path / "colo" / "checkpoints") if c.startswith("step")]
    assert len(ckpts) >= 1  # saved between offloads (step 1), and the run went on


# ---- config rules ------------------------------------------------------------------------------
@pytest.mark.parametrize("overrides,match", [
    (["rollout.sglang.colocate=true"], "needs rollout.engine='sglang'"),
    (["rollout.engine=sglang", "rollout.sglang.colocate=true",
      "rollout.sglang.weight_sync=from_distributed"], "from_tensor"),
])
def test_colocation_config_errors(overrides, match):
    from megatron_rl.config.errors import ConfigError
    from megatron_rl.config.load import load_config

    with pytest.raises(ConfigError, match=match):
        load_config("examples/tiny_dapo.yaml", overrides)


def test_colocation_config_accepted_and_server_placement(monkeypatch):
    from megatron_rl.config.errors import ConfigError
    from megatron_rl.config.load import load_config
    from megatron_rl.config.sections import SGLangSection
    from megatron_rl.rollout.fleet import Fleet, server_command, server_gpus

    cfg = load_config("examples/tiny_dapo.yaml", [
        "rollout.engine=sglang", "rollout.sglang.launcher=sglang", "rollout.sglang.colocate=true",
        "rollout.sglang.weight_sync=from_tensor", "rollout.sglang.tp_size=2"])
    s = cfg.rollout.sglang
    assert "--enable-memory-saver" in server_command(s, 1, "/m", None)
    gae = load_config("examples/tiny_dapo.yaml", [  # the critic is offloaded too
        "rollout.engine=sglang", "rollout.sglang.colocate=true", "trainer.advantage=gae",
        "env.name=frozenlake"])
    assert gae.rollout.sglang.colocate and gae.trainer.advantage == "gae"
    assert "--enable-memory-saver" not in server_command(SGLangSection(launcher="sglang"), 1,
                                                         "/m", None)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert [server_gpus(s, i) for i in range(2)] == [["0", "1"], ["2", "3"]]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    assert [server_gpus(s, i) for i in range(2)] == [["4", "5"], ["6", "7"]]
    # a separate fleet keeps its own list; our CPU serve gets none
    assert server_gpus(SGLangSection(launcher="sglang", gpus=[6, 7], num_servers=2), 1) == ["7"]
    assert server_gpus(SGLangSection(colocate=True), 0) == []
    # SGLang on the CPU (--device cpu) needs no GPUs
    assert server_gpus(SGLangSection(launcher="sglang", extra_args=["--device", "cpu"]), 0) == []
    # SGLang servers on the trainer's GPUs without colocation: refused when they would start
    with pytest.raises(ConfigError, match="rollout.sglang.gpus.*rollout.sglang.colocate=true"):
        server_gpus(SGLangSection(launcher="sglang"), 0)
    with pytest.raises(ConfigError, match="rollout.sglang.gpus"):
        Fleet(SGLangSection(launcher="sglang", router_url="http://127.0.0.1:9"), "/m", 1,
              "/tmp/unused").start_server(0)
    load_config("examples/tiny_dapo.yaml", ["rollout.engine=sglang",  # a separate fleet: fine
                                            "rollout.sglang.launcher=sglang",
                                            "rollout.sglang.gpus=[2,3]"])


# ---- on a GPU: device memory really goes -------------------------------------------------------
def _cuda_worker() -> dict:
    from test_actor_layout import make_global_batch

    from megatron_rl.actor.offload import ActorOffload
    from megatron_rl.parallel import runtime
    from megatron_rl.testing.device_accounting import device_tensors

    runtime.init_parallel(tp=1, pp=1, timeout_s=300)
    batch = make_global_batch()
    batch.pop("old_noise")
    runtime.move_batch_(batch)
    actor = _actor("bf16", True)
    _step(actor, batch, 0)
    tensors = device_tensors(actor, "cuda")
    before = _bytes_of(tensors)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    off = ActorOffload(actor)
    moved = off.offload()
    left = torch.cuda.memory_allocated()
    pinned = all(s.host.is_pinned() for slots in off.store.slots.values() for s in slots)
    off.onload()
    same = all(torch.equal(a, b) for a, b in zip(before, _bytes_of(tensors)))
    runtime.shutdown()
    return {"held": held, "left": left, "moved": sum(moved.values()), "pinned": pinned,
            "same": same, "n": len(tensors)}


@pytest.mark.gpu
def test_cuda_offload_frees_device_memory_and_round_trips():
    r = spawn(_cuda_worker, 1, timeout_s=600)[0]
    assert r["pinned"] and r["same"] and r["n"] > 10
    # what is left is the batch and the allocator's rounding, far below what was moved
    assert r["held"] - r["left"] >= 0.95 * r["moved"]


# ---- the hand-offs of one colocated step, in order (1 rank, our serve in-process) ----------
def _log_handoffs(colo, released=None, kv_out: list | None = None) -> list:
    """Record, in order, the actor's offloads/onloads that moved something and (rank 0) the
    servers' release/resume requests: ``[("offload", groups) | ("release", tags) | ...]``. With
    ``released`` (another rank than 0), its parameters' offload is slow and appends to ``kv_out``
    whether the servers' KV cache was still released when it finished."""
    import time

    from megatron_rl.rollout import memory_occupation as mo

    events: list = []

    def spy(name: str, fn, arg: int):
        def call(*args, **kwargs):
            out = fn(*args, **kwargs)
            if arg < 0 and out:  # an actor move: the groups that moved
                events.append((name, sorted(out)))
            elif arg >= 0:  # a server request: its tags (None: all)
                events.append((name, args[arg] if args[arg] is None else list(args[arg])))
            return out
        return call

    colo.offload.offload = spy("offload", colo.offload.offload, -1)
    colo.offload.onload = spy("onload", colo.offload.onload, -1)
    if released is not None:  # after a rank's parameters left: the servers' KV cache still out?
        offload = colo.offload.offload

        def late_offload(groups=("params", "grads", "optimizer")):
            if list(groups) == ["params"]:
                time.sleep(0.3)  # a slow rank: rank 0 must wait for it before resuming
            out = offload(groups)
            if out and list(groups) == ["params"]:
                kv_out.append("kv_cache" in released())
            return out

        colo.offload.offload = late_offload
    mo.release_servers = spy("release", mo.release_servers, 1)
    mo.resume_servers = spy("resume", mo.resume_servers, 1)
    return events


def _handoffs() -> dict:
    import threading
    from types import SimpleNamespace

    from megatron_rl.config.load import load_config
    from megatron_rl.models.config import get_preset
    from megatron_rl.parallel import runtime
    from megatron_rl.rollout.embedded import build_hf_model
    from megatron_rl.rollout.fleet import http_json
    from megatron_rl.rollout.serve import ServeState, make_server
    from megatron_rl.run.colocation import Colocation
    from megatron_rl.testing.device_accounting import device_bytes

    rank0 = torch.distributed.get_rank() == 0
    srv = None
    if rank0:  # the engine lives on rank 0, as in the trainer
        state = ServeState(build_hf_model(get_preset("tiny")), "preset:tiny", 1, 0)
        srv = make_server(state, "127.0.0.1", 0)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
    url = runtime.broadcast_object(f"http://127.0.0.1:{state.port}" if rank0 else None)
    cfg = load_config("examples/tiny_dapo.yaml", ["rollout.engine=sglang",
                                                  "rollout.sglang.colocate=true",
                                                  "rollout.sglang.weight_sync=from_tensor"])
    actor = _actor("fp32", False)
    from test_actor_layout import make_global_batch
    from test_critic_layout import _critic
    from test_critic_layout import make_batch as critic_batch

    batch = make_global_batch()
    batch.pop("old_noise")
    _step(actor, batch, 0)
    full = device_bytes(actor, "cpu")
    critic = _critic(total_steps=2)  # a GAE critic moves with the actor
    critic.update(critic.add_advantages(critic_batch()), 0)
    values = critic.values(critic_batch())
    fleet = SimpleNamespace(urls=[url], check_health=lambda: [])  # after each full resume
    driver = SimpleNamespace(engine=SimpleNamespace(fleet=fleet) if rank0 else None)
    colo = Colocation(cfg, actor, driver, critic)
    seen: dict = {"full": full, "critic_full": device_bytes(critic, "cpu"), "critic": {}}

    def critic_bytes(tag: str) -> None:
        seen["critic"][tag] = device_bytes(critic, "cpu")

    def released() -> list:
        return http_json("GET", url + "/server_info")["internal_states"][0]["memory_released"]

    colo.before_engine_start()
    seen["start"] = device_bytes(actor, "cpu")
    critic_bytes("start")
    seen["kv_out_after_offload"] = []
    seen["events"] = events = _log_handoffs(colo, None if rank0 else released,
                                            seen["kv_out_after_offload"])

    def fake_sync(tag: str, hooks=None) -> None:  # the weight sync's steps (collective)
        if hooks is not None:
            hooks.before_send()
        seen[tag] = (device_bytes(actor, "cpu"), released(), colo.offload.offloaded_groups)
        critic_bytes(tag)
        events.append(("send", tag))
        runtime.broadcast_object(None)
        if hooks is not None:  # the weights are loaded; then the probe, with the KV cache
            hooks.after_send()
        runtime.broadcast_object(None)  # the sync's agreement before its probe
        seen[tag + "/probe"] = (device_bytes(actor, "cpu"), released())

    colo.sync(fake_sync, "first_sync")
    seen["rollout"] = (device_bytes(actor, "cpu"), released())
    runtime.broadcast_object(None)  # the rollout's batch broadcast
    critic_bytes("rollout")
    colo.after_rollout()
    seen["update"] = (device_bytes(actor, "cpu"), released())
    critic_bytes("update")
    seen["critic_values_kept"] = torch.equal(critic.values(critic_batch()), values)
    _step(actor, batch, 1)
    critic.update(critic.add_advantages(critic_batch()), 1)
    colo.sync(fake_sync, "sync")
    with colo.resident():
        seen["save"] = (device_bytes(actor, "cpu"), released(), colo.offload.offloaded_groups)
        critic_bytes("save")
        runtime.broadcast_object(None)  # the save is collective too
    seen["after_save"] = (device_bytes(actor, "cpu"), released())
    critic_bytes("after_save")
    runtime.broadcast_object(None)  # every rank has asked before the server stops
    if srv is not None:
        srv.shutdown()
    return seen


def test_colocated_handoffs_in_order(roundtrips):
    for s in roundtrips["handoffs"]:  # every rank, in step with rank 0's server calls
        assert s["start"] == 0  # offloaded before the servers start
        for tag in ("first_sync", "sync"):  # the send: parameters only, servers hold weights
            held, rel, groups = s[tag]
            assert 0 < held < s["full"] and groups == ["grads", "optimizer"]
            assert rel == ["cuda_graph", "kv_cache"]
            assert s[tag + "/probe"] == (0, [])  # the probe: actor gone, servers whole
        assert s["rollout"] == (0, [])  # rollout: nothing of the actor, servers whole
        assert s["update"] == (s["full"], ["cuda_graph", "kv_cache", "weights"])
        held, rel, groups = s["save"]  # a save: params + optimizer, servers drop the KV cache
        assert rel == ["kv_cache"] and groups == ["grads"] and 0 < held < s["full"]
        assert s["after_save"] == (0, [])
        c = s["critic"]  # the critic: on the device for values + update (bit-exact), and a save
        assert c["update"] == s["critic_full"] > 0 and s["critic_values_kept"]
        assert c["start"] == c["first_sync"] == c["rollout"] == c["sync"] == 0
        assert 0 < c["save"] < s["critic_full"] and c["after_save"] == 0


def test_colocated_sync_order_weights_send_offload_then_kv_cache(roundtrips):
    """The colocated sync in slime's and verl's order: the servers' weights come back (the
    first sync: freshly started servers release their KV cache and CUDA graphs instead), the
    actor's parameters come back, the weights are sent, the parameters leave, and only then the
    servers resume their KV cache and CUDA graphs."""
    kv = ["kv_cache", "cuda_graph"]
    for rank, s in enumerate(roundtrips["handoffs"]):
        ev = s["events"]
        n = 1 if rank == 0 else 0  # rank 0 talks to the servers

        def sync(tag: str, before: list, n: int = n) -> list:
            return [*before, ("send", tag), ("offload", ["params"]), *[("resume", kv)] * n]

        first = sync("first_sync", [*[("release", kv)] * n, ("onload", ["params"])])
        assert ev[:len(first)] == first
        rest = ev[len(first):]  # after the rollout: the servers release all, the actor returns
        assert rest[:n + 1] == [*[("release", ["kv_cache", "weights", "cuda_graph"])] * n,
                                ("onload", ["grads", "optimizer", "params"])]
        # the parameters stayed on the device since the update
        step = sync("sync", [("offload", ["grads", "optimizer"]), *[("resume", ["weights"])] * n])
        assert rest[n + 1:n + 1 + len(step)] == step
        if rank:  # a slow rank's parameters left before rank 0 resumed the KV cache (a barrier)
            assert s["kv_out_after_offload"] == [True, True]


# ---- from_tensor's buckets: one alive at a time, as the planner counts --------------------
def test_from_tensor_frees_each_colocated_bucket_after_its_request():
    """The CUDA-IPC path of ``from_tensor`` (torch codec, requests stubbed) keeps exactly one
    flattened bucket alive at every request and none after the send: a sender that kept each
    bucket until the probe held 1, 2, 3, ... (its whole weights at the end)."""
    from ipc_sender import sender_pass

    from megatron_rl.convert.stream import bucketize

    def gathered():
        for i in range(10):
            yield f"w{i}", torch.full((50_000,), float(i))

    run = sender_pass(bucketize(gathered(), 450_000))  # 2 tensors a bucket: 5 buckets
    assert run["err"] is None and run["sent"] == 10 * 200_000
    assert run["flats_at_post"] == [1] * 10 and run["flats_after"] == 0  # 2 servers x 5


def _stream_sender_pass() -> dict:
    """The real weight stream of a TP2 fp32 actor (``iter_hf_weight_buckets``, gathers) through
    the sync loop into ``from_tensor``'s CUDA-IPC path on TP rank 0 (requests stubbed): the
    peak of new bytes alive on each rank."""
    from ipc_sender import LiveBytes, sender_pass
    from megatron.core import parallel_state as ps

    from megatron_rl.convert.stream import iter_hf_weight_buckets

    actor = _actor("fp32", False)
    buckets = iter_hf_weight_buckets(actor.model, 2**20, broadcast_pp=False)
    if ps.get_tensor_model_parallel_rank() == 0:
        run = sender_pass(buckets)
    else:  # the other TP rank gathers with it
        live = LiveBytes()
        for b in buckets:
            live.probe()
            del b
        run = {"peak": live.peak, "err": None, "flats_at_post": [1], "sent": 0}
    return run


def test_colocated_sync_bucket_bytes_of_the_real_stream_within_the_plan(roundtrips):
    """The real stream at TP2 (gathered tensors) keeps no more than the planner's weight-sync
    buffers on either rank, and rank 0's sender one flattened bucket at a time."""
    from megatron_rl.plan.memory import sync_transient_bytes

    x = PlanInputs(model=get_preset("tiny"), tp=2, pp=1, dp=1, precision="fp32",
                   sync_bucket_mb=1, colocate=True)
    runs = roundtrips["stream"]
    assert runs[0]["err"] is None and runs[0]["sent"] == 657_536 * 4  # the whole tiny model
    assert set(runs[0]["flats_at_post"]) == {1}
    for run in runs:
        assert 2**20 < run["peak"] <= sync_transient_bytes(x)


# ---- host buffers of the offload: one exact buffer per group -------------------------------
class _Cudart:
    """Stand-in for ``torch.cuda.cudart()`` on a machine without CUDA: records page-locking."""

    calls: list = []

    class cudaError:  # noqa: N801 - the name torch's binding has
        success = 0

    @staticmethod
    def cudaHostRegister(ptr: int, size: int, flags: int) -> int:  # noqa: N802
        _Cudart.calls.append(("register", ptr, size))
        return 0

    @staticmethod
    def cudaHostUnregister(ptr: int) -> int:  # noqa: N802
        _Cudart.calls.append(("unregister", ptr))
        return 0

    @staticmethod
    def cudaGetErrorString(err: int) -> str:  # noqa: N802
        return f"error {err}"


@pytest.mark.parametrize("pin", [False, True])
def test_offload_pinned_pool_is_one_exact_buffer_per_group(monkeypatch, pin):
    """Each group's storages go to slices of ONE host buffer of exactly the sum of their sizes
    at 256-byte aligned offsets (torch's pinned allocator would round each allocation up to a
    power of two: up to 2x), reused while the group keeps its size; a group that grows (the
    optimizer's moments after the first step) gets one new exact buffer, the old one unlocked
    first. With ``pin`` every buffer is page-locked once (``cudaHostRegister``)."""
    from megatron_rl.actor.offload import StorageOffloader, aligned

    monkeypatch.setattr(torch.cuda, "cudart", lambda: _Cudart)
    _Cudart.calls = []
    g = torch.Generator().manual_seed(0)
    groups = {"params": [torch.randn(1000, generator=g), torch.randn(3, generator=g),
                         torch.arange(70_001)],
              "optimizer": [torch.randn(257, generator=g, dtype=torch.float64)]}
    store = StorageOffloader(pin=pin)

    def cycle(groups: dict) -> dict:
        want = {k: [t.clone() for t in ts] for k, ts in groups.items()}
        where = {}
        for k, ts in groups.items():
            store.offload(k, {i: t.untyped_storage() for i, t in enumerate(ts)})
            assert all(t.untyped_storage().nbytes() == 0 for t in ts)
            hosts = [s.host.untyped_storage() for s in store.slots[k]]
            exact = sum(aligned(w.untyped_storage().nbytes()) for w in want[k])
            assert {h.data_ptr() for h in hosts} == {hosts[0].data_ptr()}  # one buffer
            assert hosts[0].nbytes() == exact
            assert [s.host.data_ptr() - hosts[0].data_ptr() for s in store.slots[k]] == \
                [sum(aligned(w.untyped_storage().nbytes()) for w in want[k][:i])
                 for i in range(len(ts))]
            where[k] = (hosts[0].data_ptr(), exact)
        for k, ts in groups.items():
            store.onload(k)
            assert all(torch.equal(a, b) for a, b in zip(ts, want[k]))
        return where

    first = cycle(groups)
    assert cycle(groups) == cycle(groups) == first  # reused: no new buffer per step
    assert store.host_bytes() == sum(n for _, n in first.values())
    groups["optimizer"].append(torch.randn(5000, generator=g))  # the moments appear
    grown = cycle(groups)
    assert grown["params"] == first["params"] and grown["optimizer"][1] == 2304 + 20224
    if pin:
        (pp, pn), (op, on), (np_, nn) = first["params"], first["optimizer"], grown["optimizer"]
        assert _Cudart.calls == [("register", pp, pn), ("register", op, on), ("unregister", op),
                                 ("register", np_, nn)]
    else:
        assert _Cudart.calls == []


# ---- on a GPU: the colocated sender's peak and the pinned host bytes ------------------------
def _gpu_sender_worker(n: int, elems: int, bucket: int) -> dict:
    """``n`` fp32 "parameters" of ``elems`` each on the GPU; the sync loop streams fresh copies
    of them (TP-gathered tensors) in buckets of ``bucket`` bytes into ``from_tensor``'s CUDA-IPC
    path with torch's own IPC reductions; each request goes to a receiver process that opens
    the handle, copies the bytes, drops the handle and answers (SGLang's TP worker, without
    SGLang). The device memory the pass added at its peak, and what it left."""
    from ipc_sender import ipc_receiver, sender_pass

    from megatron_rl.convert.stream import bucketize

    ctx = torch.multiprocessing.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=ipc_receiver, args=(child,), daemon=True)
    proc.start()
    weights = [torch.full((elems,), float(i), device="cuda") for i in range(n)]
    got: list[int] = []

    def post(body: dict) -> dict:  # one server, TP 1: its payload, answered once released
        (payload,) = body["serialized_named_tensors"]
        conn.send(payload)
        got.append(conn.recv())
        return {"success": True}

    def gathered():
        for i, w in enumerate(weights):
            yield f"w{i}", w.clone()

    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    run = sender_pass(bucketize(gathered(), bucket), urls=("http://server",), post=post)
    torch.cuda.synchronize()
    out = {"peak": torch.cuda.max_memory_allocated() - base, "weights": base,
           "left": torch.cuda.memory_allocated() - base, "received": sum(got),
           "err": run["err"], "flats_at_post": run["flats_at_post"]}
    conn.send(None)
    proc.join(timeout=60)
    return out


@pytest.mark.gpu
def test_gpu_colocated_sender_peak_is_weights_plus_the_plans_bucket_buffers():
    """On the GPU, with a real CUDA-IPC receiver: ``torch.cuda.max_memory_allocated`` over the
    sender's pass stays within the weights + the planner's sync buffers (a bucket, its flattened
    copy, the next gathered tensor) for 512 MiB sent in 64 MiB buckets, and everything is freed
    once the receiver dropped its handles (no block left in CUDA IPC's limbo). A sender that kept
    its buckets until the probe would add the whole 512 MiB."""
    from megatron_rl.plan.memory import sync_buffer_bytes

    n, elems, bucket = 16, 8 * 2**20, 64 * 2**20  # 16 x 32 MiB, two per bucket
    r = spawn(_gpu_sender_worker, 1, args=(n, elems, bucket), timeout_s=600)[0]
    assert r["err"] is None and r["received"] == n * elems * 4
    assert r["flats_at_post"] == [1] * (n // 2)
    assert r["peak"] <= sync_buffer_bytes(bucket, elems * 4, pp=1) + 2 * 2**20  # + rounding
    assert r["left"] == 0


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _host_allocator_bytes() -> int:
    """Bytes torch's pinned (caching host) allocator holds, where torch reports them."""
    stats = getattr(torch.cuda, "host_memory_stats", lambda: {})()
    return int(stats.get("allocated_bytes.current", 0))


def _gpu_pinned_worker() -> dict:
    """Storages of known sizes just above powers of two (the worst case of a power-of-two
    rounding) on the GPU, offloaded and onloaded three times: per cycle the bytes moved, the
    pinned host bytes (torch's host allocator + the offload's own page-locked buffers), the
    process's resident memory, whether every host slice is pinned and the round trip exact."""
    from megatron_rl.actor.offload import StorageOffloader

    gen = torch.Generator(device="cuda").manual_seed(0)
    sizes = [2**k + 2**(k - 3) for k in range(22, 30)]  # 4.5 MiB ... 576 MiB, 1.12 GiB in all
    tensors = [torch.empty(s, dtype=torch.uint8, device="cuda").random_(0, 256, generator=gen)
               for s in sizes]
    sums = [t.sum(dtype=torch.int64).item() for t in tensors]
    warm = StorageOffloader(pin=True)  # the copy paths and the CUDA host state, once
    small = torch.ones(2**20, dtype=torch.uint8, device="cuda")
    warm.offload("w", {0: small.untyped_storage()})
    warm.onload("w")
    torch.cuda.synchronize()
    rss0, host0 = _rss_bytes(), _host_allocator_bytes()
    store = StorageOffloader(pin=True)
    cycles = []
    for _ in range(3):
        moved = store.offload("params", {i: t.untyped_storage() for i, t in enumerate(tensors)})
        cycles.append({
            "moved": moved, "pinned": _host_allocator_bytes() - host0 + store.host_bytes(),
            "host_allocator": _host_allocator_bytes() - host0, "rss": _rss_bytes() - rss0,
            "all_pinned": all(s.host.is_pinned() for s in store.slots["params"]),
            "buffer": store.slots["params"][0].host.data_ptr()})
        store.onload("params")
        cycles[-1]["exact"] = [t.sum(dtype=torch.int64).item() for t in tensors] == sums
    return {"total": sum(sizes), "cycles": cycles}


@pytest.mark.gpu
def test_gpu_pinned_host_bytes_match_the_model_and_stay_flat():
    """Offloading 1.12 GiB of storages sized just above powers of two takes at most 1.05x their
    bytes of pinned host memory (torch's pinned allocator would take ~1.8x: it rounds every
    allocation up to a power of two), counted by torch's host allocator stats + the offload's
    page-locked buffers and seen in the process's resident memory; three offload/onload cycles
    reuse the same buffer and stay flat."""
    r = spawn(_gpu_pinned_worker, 1, timeout_s=600)[0]
    first = r["cycles"][0]
    for c in r["cycles"]:
        assert c["moved"] == r["total"] and c["exact"] and c["all_pinned"]
        assert c["pinned"] <= 1.05 * c["moved"]
        assert c["rss"] <= 1.05 * c["moved"] + 64 * 2**20
        assert c["buffer"] == first["buffer"]  # the same buffer, not a new one per cycle
        assert abs(c["host_allocator"] - first["host_allocator"]) <= 2**20
        assert abs(c["rss"] - first["rss"]) <= 32 * 2**20
