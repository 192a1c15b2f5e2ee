"""Our ``serve`` (SGLang's HTTP subset around a transformers model, in-process on loopback), the
SGLang client against it, and the weight sync strategies into it. Quick: no router, one server.
The fleet with the real ``sglang-router`` is in ``test_sglang_fleet.py``."""

import json
import os
import threading
import time
from pathlib import Path

import pytest
import torch

from megatron_rl.config.sections import SGLangSection
from megatron_rl.models.config import get_preset
from megatron_rl.rollout.embedded import EmbeddedEngine, build_hf_model
from megatron_rl.rollout.engine import SamplingParams
from megatron_rl.rollout.fleet import Fleet, ServerError, http_json
from megatron_rl.rollout.sampling import teacher_forced_logprobs
from megatron_rl.rollout.serve import ServeState, make_server
from megatron_rl.rollout.sglang_client import SGLangEngine, generate_request
from megatron_rl.rollout.weight_sync import make_strategy, push_single_process
from megatron_rl.rollout.weight_sync.common import probe_check, probe_tokens

EOS = 1




def _engine(url, tmp_path, strategy="from_disk") -> SGLangEngine:
    s = SGLangSection(servers=[url], router_url=url)
    fleet = Fleet(s, "preset:tiny", EOS, str(tmp_path / "logs"))
    fleet.workers = {url: "direct"}  # no router in this quick test: requests go to the server
    eng = SGLangEngine(fleet, EOS, concurrency=4)
    eng.sync = make_strategy(strategy, fleet, str(tmp_path / "sync"))
    return eng


def test_generate_shapes_seed_and_logprobs(server):
    url, state = server
    req = generate_request([5, 6, 7], SamplingParams(max_new_tokens=6, temperature=0.9),
                           [EOS], seed=11, rid="r1")
    a = http_json("POST", url + "/generate", req)
    b = http_json("POST", url + "/generate", {**req, "rid": "r2"})
    assert a["output_ids"] == b["output_ids"] and a["meta_info"]["id"] == "r1"
    meta = a["meta_info"]
    assert meta["finish_reason"]["type"] in ("stop", "length")
    assert meta["completion_tokens"] == len(a["output_ids"]) == len(meta["output_token_logprobs"])
    assert [t for _, t, _ in meta["output_token_logprobs"]] == a["output_ids"]
    # log-probs are those of the temperature-scaled distribution at each step (teacher forced)
    with torch.no_grad():
        logits = state.model(input_ids=torch.tensor([[5, 6, 7] + a["output_ids"]])).logits[0]
    lp = torch.log_softmax(logits[2:-1].float() / 0.9, -1)
    want = lp.gather(-1, torch.tensor(a["output_ids"])[:, None])[:, 0]
    got = torch.tensor([x for x, _, _ in meta["output_token_logprobs"]])
    assert torch.allclose(got, want, atol=1e-4)
    batch = http_json("POST", url + "/generate", {"input_ids": [[5, 6], [7, 8, 9]],
                                                  "sampling_params": {"max_new_tokens": 2}})
    assert isinstance(batch, list) and len(batch) == 2
    with pytest.raises(ServerError, match="400"):
        http_json("POST", url + "/generate", {"text": "hi"})


def test_info_endpoints(server):
    url, _ = server
    assert http_json("GET", url + "/health") is None
    http_json("GET", url + "/health_generate")
    info = http_json("GET", url + "/get_model_info")
    assert info["is_generation"] and info["model_type"] == "qwen2"
    assert "weight_version" in http_json("GET", url + "/server_info")
    assert http_json("POST", url + "/flush_cache").startswith("Cache flushed")


def test_pause_blocks_and_abort_ends_requests(server):
    url, _ = server
    http_json("POST", url + "/pause_generation", {"mode": "abort"})
    box = {}
    th = threading.Thread(target=lambda: box.update(r=http_json("POST", url + "/generate", {
        "input_ids": [3, 4], "sampling_params": {"max_new_tokens": 2, "ignore_eos": True}})))
    th.start()
    time.sleep(0.5)
    assert "r" not in box  # waits while paused
    http_json("POST", url + "/continue_generation")
    th.join(30)
    assert box["r"]["meta_info"]["completion_tokens"] == 2
    th = threading.Thread(target=lambda: box.update(a=http_json("POST", url + "/generate", {
        "input_ids": [3, 4], "rid": "long", "sampling_params": {"max_new_tokens": 100000,
                                                                "ignore_eos": True}})))
    th.start()
    time.sleep(0.5)
    http_json("POST", url + "/abort_request", {"rid": "long"})
    th.join(30)
    assert box["a"]["meta_info"]["finish_reason"]["type"] == "abort"


def test_client_matches_embedded_per_request_seed(server, tmp_path):
    """The same (weights, prompts, seed) give the same samples through HTTP as in process."""
    url, state = server
    emb = EmbeddedEngine(get_preset("tiny"), EOS, 0, per_request_seed=True)
    emb.model.load_state_dict(state.model.state_dict())
    eng = _engine(url, tmp_path)
    params = SamplingParams(n=3, max_new_tokens=5, temperature=1.0, top_p=0.9)
    prompts = [[5, 6, 7], [8, 9], [10]]
    got = eng.generate(prompts, params, seed=42)
    want = emb.generate(prompts, params, seed=42)
    for g, w in zip(got, want):
        assert [c.response_ids for c in g] == [c.response_ids for c in w]
        for c, d in zip(g, w):
            assert c.finished == d.finished
            assert torch.allclose(torch.tensor(c.logprobs), torch.tensor(d.logprobs), atol=1e-5)
    assert eng.pop_metrics()["rollout/offpolicy_lag"] == 0.0


def test_stop_when_aborts_leftovers_and_drops_partial_groups(server, tmp_path):
    url, _ = server
    eng = _engine(url, tmp_path)
    eng.concurrency = 2
    params = SamplingParams(n=2, max_new_tokens=4)
    out = eng.generate([[5], [6], [7], [8], [9], [10]], params, seed=1,
                       stop_when=lambda i, g: True)  # the first complete group is enough
    sizes = [len(g) for g in out]
    assert sizes.count(2) >= 1 and set(sizes) <= {0, 2} and sizes.count(0) >= 3


def _random_buckets(seed: int):
    torch.manual_seed(seed)
    other = build_hf_model(get_preset("tiny"))
    sd = [(n, p.detach().clone()) for n, p in other.named_parameters()]
    return other, [sd[i:i + 5] for i in range(0, len(sd), 5)]


@pytest.mark.parametrize("rules", ["0.5.21", "0.5.20"])
@pytest.mark.parametrize("strategy", ["from_disk", "from_tensor", "from_tensor/shm"])
def test_weight_sync_strategies_load_exact_weights(server, tmp_path, strategy, rules):
    url, state = server
    state.rules = rules  # SGLang >= 0.5.21 (sessions) or older
    strategy, _, transport = strategy.partition("/")
    eng = _engine(url, tmp_path, strategy)
    if transport:
        eng.sync.transport = transport
    other, buckets = _random_buckets({"from_disk": 1, "from_tensor": 2,
                                      "from_distributed": 3}[strategy])
    try:
        push_single_process(eng, buckets, version=7)
        push_single_process(eng, buckets, version=7)  # again: reused buffers / mappings
    finally:
        state.rules = "0.5.21"
        if strategy == "from_tensor":
            eng.sync.close()
    if strategy == "from_tensor":  # which transport carried the buckets
        assert eng.sync._vm is (None if transport else True)
        assert bool(state.shm_maps.maps) == (transport == "shm")
    assert not state.session and not eng.sync.sessions
    for (n, p), (n2, q) in zip(other.named_parameters(), state.model.named_parameters()):
        assert n == n2 and torch.equal(p, q), n
    assert http_json("GET", url + "/get_model_info")["weight_version"] == "7"
    ids = probe_tokens(get_preset("tiny").vocab_size, 12)
    worst, errors = probe_check([url], ids, teacher_forced_logprobs(other, ids), 1e-4)
    assert not errors and worst <= 1e-4
    _, bad = probe_check([url], ids, [x + 1e-2 for x in teacher_forced_logprobs(other, ids)], 1e-4)
    assert bad  # the probe does catch a mismatch


def test_vm_bucket_from_another_process_is_refused(server):
    """A ``megatron_rl_vm`` bucket whose pid is not the sender's (the token read there differs)
    or unreadable is refused with the message the sender falls back on."""
    from megatron_rl.rollout.weight_sync.from_tensor import VM_UNAVAILABLE

    url, state = server
    state.session = True
    token = torch.arange(16, dtype=torch.uint8)
    p = next(state.model.parameters())
    for pid, want in ((os.getpid(), [0] * 16), (2**22 + 7, token.tolist())):
        blob = json.dumps({"pid": pid, "token": [token.data_ptr(), want], "tensors": [
            ["model.embed_tokens.weight", "float32", list(p.shape), p.data_ptr(),
             p.numel() * 4]]})
        with pytest.raises(ServerError, match=VM_UNAVAILABLE):
            http_json("POST", url + "/update_weights_from_tensor",
                      {"serialized_named_tensors": [blob], "load_format": "megatron_rl_vm"})
    state.session = False


def _checksum(model) -> str:
    """What ``serve``'s ``/weights_checker`` hashes: every parameter's name and bytes."""
    import hashlib

    h = hashlib.sha256()
    for name, p in sorted(model.named_parameters()):
        h.update(name.encode())
        h.update(p.detach().contiguous().reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


@pytest.mark.parametrize("rules", ["0.5.21", "0.5.20"])
def test_from_distributed_joins_through_sglang_rendezvous(tmp_path, rules):
    """A server process joins the sender's group the way SGLang's ranks do (a group name is
    registered once per process, so the server runs in its own process here, as in a fleet);
    then the same process takes a ``from_tensor`` sync out of this process's memory."""
    import os
    import subprocess
    import sys

    from megatron_rl.rollout.fleet import wait_healthy
    from megatron_rl.rollout.weight_sync.from_distributed import free_port

    port = free_port()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.Popen([sys.executable, "-m", "megatron_rl", "serve", "--preset", "tiny",
                             "--port", str(port), "--eos-id", str(EOS), "--sglang-rules", rules],
                            env={**os.environ, "PYTHONPATH": root})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, 120, proc)
        eng = _engine(url, tmp_path, "from_distributed")
        for version, seed in ((3, 5), (4, 6)):  # twice: a second sync reuses the group
            other, buckets = _random_buckets(seed)
            push_single_process(eng, buckets, version=version)
            got = http_json("POST", url + "/weights_checker", {"action": "checksum"}) \
                if rules == "0.5.21" else None
            if got is not None:
                assert got["per_engine_checksum"] == _checksum(other)
            ids = probe_tokens(get_preset("tiny").vocab_size, 12)
            worst, errors = probe_check([url], ids, teacher_forced_logprobs(other, ids), 1e-4)
            assert not errors and worst <= 1e-4
        assert (url in eng.sync.no_session) == (rules == "0.5.20")
        eng.sync.close()
        # the same server process, from_tensor: it copies the buckets out of this process
        tens = _engine(url, tmp_path, "from_tensor")
        other, buckets = _random_buckets(8)
        try:
            push_single_process(tens, buckets, version=5)
        finally:
            tens.sync.close()
        assert tens.sync._vm is True  # process_vm_readv, not the shared-memory fallback
        if rules == "0.5.21":
            got = http_json("POST", url + "/weights_checker", {"action": "checksum"})
            assert got["per_engine_checksum"] == _checksum(other)
        worst, errors = probe_check([url], ids, teacher_forced_logprobs(other, ids), 1e-4)
        assert not errors and worst <= 1e-4
    finally:
        proc.terminate()
        proc.wait(30)


def test_spot_check_catches_wrong_weights(tmp_path):
    torch.manual_seed(0)  # a Llama: SGLang's Qwen2/Qwen3 have no get_weights_by_name
    state = ServeState(build_hf_model(get_preset("tiny-llama")), "preset:tiny-llama", EOS, 0)
    srv = make_server(state, "127.0.0.1", 0)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{state.port}"
    try:
        eng = _engine(url, tmp_path, "from_disk")
        eng.sync.spots_per_send = 2
        torch.manual_seed(4)
        other = build_hf_model(get_preset("tiny-llama"))
        push_single_process(eng, [[(n, p.detach().clone()) for n, p in
                                   other.named_parameters()]], version=8)
        assert not eng.sync.spot_check()
        with torch.no_grad():
            dict(state.model.named_parameters())[eng.sync.spots[0][0]].add_(1.0)
        assert eng.sync.spot_check()
    finally:
        srv.shutdown()


def test_prefix_stop_rule_waits_for_the_complete_prefix():
    from megatron_rl.rewards.tokenizer import ByteTokenizer
    from megatron_rl.rollout.early_abort import prefix_stop_rule
    from megatron_rl.rollout.engine import Completion

    tok = ByteTokenizer()
    rows = [{"answer": str(i % 2)} for i in range(4)]

    def score(row, text):
        return float(text == row["answer"])

    def group(*texts):
        return [Completion([0], tok.encode(t)) for t in texts]

    stop = prefix_stop_rule(rows, tok, score, "acc", need=2)
    assert not stop(1, group("1", "0"))  # kept, but group 0 is not complete yet
    assert not stop(0, group("1", "1"))  # all wrong: prefix 0..1 holds 1 kept group
    assert not stop(3, group("1", "0"))  # kept, but group 2 is missing
    assert stop(2, group("0", "1"))  # prefix 0..3 complete with 3 kept >= 2
    assert prefix_stop_rule(rows, tok, score, "reward", need=2) is None


def test_sglang_config_section_and_errors():
    from megatron_rl.config.errors import ConfigError
    from megatron_rl.config.load import load_config

    cfg = load_config(None, ["rollout.engine=sglang",
                             "rollout.sglang.servers=[http://10.0.0.1:30001,http://h:30002]",
                             "rollout.sglang.gpus=[4,5]", "rollout.sglang.weight_sync=from_tensor"])
    assert cfg.rollout.sglang.servers == ["http://10.0.0.1:30001", "http://h:30002"]
    assert cfg.rollout.sglang.gpus == [4, 5]
    for bad, field in (("rollout.sglang.weight_sync=nccl", "weight_sync"),
                       ("rollout.sglang.servers=[localhost:1]", "servers"),
                       ("rollout.sglang.launcher=vllm", "launcher"),
                       ("rollout.sglang.concurrency=0", "concurrency"),
                       ("rollout.sglang.servers=3", "servers")):
        with pytest.raises(ConfigError, match=field):
            load_config(None, ["rollout.engine=sglang", bad])
    with pytest.raises(ConfigError, match="rollout.engine"):
        load_config(None, ["rollout.engine=vllm"])


def test_offpolicy_lag_is_measured_or_refused(server, tmp_path):
    url, _ = server
    http_json("POST", url + "/update_weight_version", {"new_version": "1"})
    eng = _engine(url, tmp_path)
    eng.weight_version = 3  # the trainer is two syncs ahead of this server
    eng.generate([[5, 6]], SamplingParams(n=2, max_new_tokens=2), seed=1)
    m = eng.pop_metrics()
    assert m["rollout/offpolicy_lag"] == 2.0 and m["rollout/offpolicy_lag_max"] == 2.0
    eng.max_offpolicy_lag, eng.max_retries = 1, 1
    with pytest.raises(ServerError, match="weight version 1"):
        eng.generate([[5, 6]], SamplingParams(n=1, max_new_tokens=2), seed=1)
    assert eng.pop_metrics()["rollout/stale_refused"] == 2.0


# ---- the weight-sync probe rule (mean gap over the probe, tolerance per precision) -------------
def _mixed(good: torch.nn.Module, other: torch.nn.Module, part: str | None = None) -> list:
    """``good``'s weights (one bucket), those whose name contains ``part`` taken from
    ``other``."""
    theirs = dict(other.named_parameters())
    return [(n, (theirs[n] if part is not None and part in n else p).detach().clone())
            for n, p in good.named_parameters()]


def test_probe_passes_a_correct_bf16_sync_and_fails_wrong_weights(server, tmp_path):
    """The probe rule at its defaults (``probe_length`` tokens, the bf16 tolerance): the actor
    scores the probe with bf16 kernels and the server (fp32) holds the same weights: a correct
    sync whose per-token gaps are bf16 rounding, up to ~0.4 on single tokens (the old rule, the
    largest gap <= 0.05, failed it). Syncs that load wrong weights fail: the previous weights
    (the sync missed), one layer not loaded, the output layer not loaded."""
    import copy
    import dataclasses

    from megatron_rl.rollout.sampling import teacher_forced_logprobs as tfl
    from megatron_rl.rollout.sglang_client import default_probe_tolerance

    url, state = server
    original = copy.deepcopy(state.model.state_dict())
    # sharper than the preset's init (std 0.2): random tokens at log-probs of -14 to -2, as in a
    # trained model, so bf16 rounding moves them as much as it does there
    cfg = dataclasses.replace(get_preset("tiny"), init_method_std=0.2)
    torch.manual_seed(21)
    actor = build_hf_model(cfg)
    torch.manual_seed(22)
    previous = build_hf_model(cfg)
    ids = probe_tokens(cfg.vocab_size, SGLangSection().probe_length)
    actor_logp = tfl(copy.deepcopy(actor).to(torch.bfloat16), ids)  # the actor's bf16 kernels
    tol = default_probe_tolerance("bf16", "bf16")
    eng = _engine(url, tmp_path)
    try:
        push_single_process(eng, [_mixed(actor, previous)], version=1)
        gap, errors = probe_check([url], ids, actor_logp, tol)
        assert not errors and 0.0 < gap <= tol / 2, (gap, errors)
        from megatron_rl.rollout.weight_sync.common import engine_probe_logprobs, probe_gap

        assert probe_gap(engine_probe_logprobs(url, ids), actor_logp).max > 0.05
        wrong = {"missed": _mixed(previous, actor),
                 "layer 2 not loaded": _mixed(actor, previous, "layers.2."),
                 "output layer not loaded": _mixed(actor, previous, "lm_head")}
        for version, (name, weights) in enumerate(wrong.items(), start=2):
            push_single_process(eng, [weights], version=version)
            gap, errors = probe_check([url], ids, actor_logp, tol)
            assert errors and gap > 2 * tol, (name, gap)
            assert "on average over 63 tokens" in errors[0]
    finally:
        with torch.no_grad():
            state.model.load_state_dict(original)


def test_probe_gap_statistic():
    """Mean and largest |gap|; a length mismatch or no tokens is infinite; NaN fails any
    tolerance; the worst of several servers keeps NaN."""
    import math

    from megatron_rl.rollout.weight_sync.common import (
        ProbeGap,
        probe_failure,
        probe_gap,
        worst_gap,
    )

    assert probe_gap([-1.0, -2.5, -3.0], [-1.5, -2.5, -2.0]) == ProbeGap(0.5, 1.0)
    assert probe_gap([-1.0], [-1.0, -2.0]) == ProbeGap(math.inf, math.inf)
    assert probe_gap([], []).mean == math.inf
    nan = probe_gap([float("nan"), -1.0], [-1.0, -1.0])
    assert probe_failure("u", nan, 10.0, 2) and probe_failure("u", ProbeGap(0.3, 2.0), 0.25, 2)
    assert probe_failure("u", ProbeGap(0.2, 2.0), 0.25, 2) is None  # one big token: passes
    assert math.isnan(worst_gap([ProbeGap(0.1, 0.2), nan]).mean)
    assert worst_gap([ProbeGap(0.1, 0.9), ProbeGap(0.3, 0.4)]) == ProbeGap(0.3, 0.9)


def _sync_fleet_probe_worker(sync_dir: str) -> dict:
    """One gloo rank: the tiny megatron actor synced to our ``serve`` by :func:`sync_fleet`
    (from_disk, fp32 both sides): a sync whose server skips layer 1's tensors (the sync loaded
    wrong weights), then a correct sync; the error, the summary and the engine's metrics."""
    from conftest import serve_tiny
    from test_actor_layout import loss_config

    from megatron_rl.actor.actor import Actor
    from megatron_rl.actor.optim import OptimConfig
    from megatron_rl.actor.train_step import ActorConfig
    from megatron_rl.parallel import runtime
    from megatron_rl.rollout.sglang_client import default_probe_tolerance
    from megatron_rl.rollout.weight_sync.common import WeightSyncError
    from megatron_rl.rollout.weight_sync.megatron_sync import fleet_plan, sync_fleet

    runtime.init_parallel(tp=1, pp=1, timeout_s=120)
    actor = Actor(get_preset("tiny"), ActorConfig(micro_batch_size=2), OptimConfig(lr=1e-3),
                  loss_config(), total_steps=1, seed=7)
    out: dict = {}
    with serve_tiny() as (url, state):
        eng = _engine(url, Path(sync_dir))
        eng.probe_length = SGLangSection().probe_length
        eng.probe_tolerance = default_probe_tolerance("fp32", "fp32")
        load = state.update_from_disk

        def skip_layer_1(req: dict) -> dict:
            kept = {n: p.detach().clone() for n, p in state.model.named_parameters()
                    if ".layers.1." in n}
            reply = load(req)
            with torch.no_grad():
                for n, p in state.model.named_parameters():
                    if n in kept:
                        p.copy_(kept[n])
            return reply

        state.update_from_disk = skip_layer_1
        try:
            sync_fleet(actor, eng, fleet_plan(eng), 1, version=1)
        except WeightSyncError as exc:
            out["wrong"] = str(exc)
        out["wrong_metrics"] = eng.pop_metrics()
        state.update_from_disk = load
        out["summary"] = sync_fleet(actor, eng, fleet_plan(eng), 1, version=2)
        out["metrics"] = eng.pop_metrics()
        out["version"] = eng.weight_version
    runtime.shutdown()
    return out


def test_sync_fleet_probe_fails_wrong_weights_and_logs_the_gap(tmp_path):
    """Through the trainer's sync (:func:`sync_fleet`, the real megatron actor): a sync whose
    server did not load one layer fails on the probe; a correct one passes and its probe gap
    reaches the rollout metrics (``rollout/weight_sync_probe_gap``, as in metrics.jsonl)."""
    from megatron_rl.parallel.launch import spawn

    (res,) = spawn(_sync_fleet_probe_worker, 1, (str(tmp_path),), timeout_s=300)
    assert "probe log-probs differ from the actor's" in res.get("wrong", ""), res
    assert "on average over 63 tokens" in res["wrong"]
    assert "rollout/weight_sync_probe_gap" not in res["wrong_metrics"]
    m = res["metrics"]
    assert 0.0 <= m["rollout/weight_sync_probe_gap"] <= m["rollout/weight_sync_probe_max_diff"]
    assert m["rollout/weight_sync_probe_max_diff"] <= 1e-4, m  # fp32 on both sides
    assert "probe gap" in res["summary"] and res["version"] == 2
