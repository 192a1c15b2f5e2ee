"""Real SGLang's rules, as our ``serve`` imitates them and as the trainer must follow them
(quick: in-process servers on loopback). Checks against the real ``sglang`` package are in
``test_sglang_real.py``."""

import socket
import threading
import time

import pytest
import torch

from megatron_rl.config.load import load_config
from megatron_rl.models.config import get_preset
from megatron_rl.rollout.embedded import build_hf_model
from megatron_rl.rollout.fleet import ServerError, http_json
from megatron_rl.rollout.serve import NEW_RULES, OLD_RULES, ServeState, make_server
from megatron_rl.rollout.weight_sync.common import (
    SyncStrategy,
    WeightSyncError,
    checksum_disagreement,
    flush_cache,
    weights_checksums,
)
from megatron_rl.rollout.weight_sync.from_distributed import routed_address, sender_address

EOS = 1


def _serve(preset: str = "tiny", rules: str = NEW_RULES, seed: int = 0):
    torch.manual_seed(seed)
    state = ServeState(build_hf_model(get_preset(preset)), f"preset:{preset}", EOS, 0, rules)
    srv = make_server(state, "127.0.0.1", 0)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{state.port}", state, srv


@pytest.fixture(scope="module")
def qwen():
    url, state, srv = _serve()
    yield url, state
    srv.shutdown()


def test_serve_refuses_tensor_and_distributed_updates_outside_a_session(qwen):
    url, state = qwen
    body = {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[128]],
            "group_name": "g", "flush_cache": False}
    with pytest.raises(ServerError, match="400.*must run between begin_weight_update"):
        http_json("POST", url + "/update_weights_from_distributed", body)
    with pytest.raises(ServerError, match="400.*must run between begin_weight_update"):
        http_json("POST", url + "/update_weights_from_tensor",
                  {"serialized_named_tensors": ["{}"], "load_format": "megatron_rl_shm"})
    http_json("POST", url + "/begin_weight_update", {})
    with pytest.raises(ServerError, match="400.*already open"):
        http_json("POST", url + "/begin_weight_update", {})
    http_json("POST", url + "/end_weight_update", {})
    with pytest.raises(ServerError, match="400.*no weight-update session"):
        http_json("POST", url + "/end_weight_update", {})
    state.rules = OLD_RULES  # SGLang <= 0.5.20: no sessions
    try:
        with pytest.raises(ServerError, match="404"):
            http_json("POST", url + "/begin_weight_update", {})
        with pytest.raises(ServerError, match="404"):
            http_json("POST", url + "/weights_checker", {"action": "checksum"})
    finally:
        state.rules = NEW_RULES


def test_session_is_opened_around_tensor_updates_and_skipped_on_old_servers(qwen):
    url, state = qwen
    for rules in (NEW_RULES, OLD_RULES):
        state.rules = rules
        strat = SyncStrategy([url], "/nonexistent")
        strat.needs_session = True
        strat.begin(1)
        assert state.session == (rules == NEW_RULES)
        assert (url in strat.no_session) == (rules == OLD_RULES)
        strat.commit(1)
        strat.resume()
        assert not state.session
    state.rules = NEW_RULES


def test_flush_is_refused_while_requests_run_and_retried_until_they_drain(qwen):
    url, state = qwen
    box = {}
    th = threading.Thread(target=lambda: box.update(r=http_json("POST", url + "/generate", {
        "input_ids": [3, 4], "rid": "busy", "sampling_params": {"max_new_tokens": 100000,
                                                                "ignore_eos": True}})))
    th.start()
    while not state.inflight:
        time.sleep(0.05)
    with pytest.raises(ServerError, match="400"):  # real SGLang's rule: not while running
        http_json("POST", url + "/flush_cache")
    with pytest.raises(WeightSyncError, match="refused 3 times"):
        flush_cache(url, retries=2, wait_s=0.1, timeout_s=0.1)
    threading.Timer(1.0, lambda: http_json("POST", url + "/abort_request",
                                           {"rid": "busy"})).start()
    t0 = time.monotonic()
    flush_cache(url, retries=20, wait_s=0.5, timeout_s=0.0)  # retried until the abort landed
    assert time.monotonic() - t0 >= 0.5
    th.join(30)
    assert box["r"]["meta_info"]["finish_reason"]["type"] == "abort"
    # ?timeout= (SGLang >= 0.5.21) waits for idle by itself
    th = threading.Thread(target=lambda: http_json("POST", url + "/generate", {
        "input_ids": [3, 4], "rid": "busy2", "sampling_params": {"max_new_tokens": 100000,
                                                                 "ignore_eos": True}}))
    th.start()
    while not state.inflight:
        time.sleep(0.05)
    threading.Timer(0.5, lambda: http_json("POST", url + "/abort_request",
                                           {"rid": "busy2"})).start()
    http_json("POST", url + "/flush_cache?timeout=30")
    th.join(30)


def test_weights_by_name_is_refused_for_qwen_and_spot_checks_say_what_to_do(qwen):
    url, _ = qwen
    with pytest.raises(ServerError, match="400.*get_weights_by_name"):
        http_json("POST", url + "/get_weights_by_name", {"name": "model.norm.weight"})
    strat = SyncStrategy([url], "/nonexistent", spots_per_send=1)
    strat.spots = [("model.norm.weight", [1.0])]
    with pytest.raises(WeightSyncError, match="spot_checks=0"):
        strat.spot_check()
    assert load_config(None, ["rollout.engine=sglang"]).rollout.sglang.spot_checks == 0
    llama_url, _, srv = _serve("tiny-llama")
    try:
        w = http_json("POST", llama_url + "/get_weights_by_name",
                      {"name": "model.norm.weight", "truncate_size": 3})
        assert len(w) == 3
    finally:
        srv.shutdown()


def test_weights_checker_finds_the_server_that_missed_an_update():
    servers = [_serve("tiny-llama", seed=5) for _ in range(3)]
    old = _serve("tiny-llama", rules=OLD_RULES, seed=5)
    try:
        urls = [u for u, _, _ in servers]
        sums = weights_checksums(urls + [old[0]])
        assert sums[old[0]] is None  # older server: no /weights_checker, not checked
        assert len({sums[u] for u in urls}) == 1 and not checksum_disagreement(sums)
        with torch.no_grad():
            servers[2][1].model.model.norm.weight.add_(1e-3)
        bad = checksum_disagreement(weights_checksums(urls))
        assert len(bad) == 1 and bad[0].startswith(urls[2])
    finally:
        for _, _, srv in servers + [old]:
            srv.shutdown()


def test_sender_address_is_the_routed_interface_not_the_hosts_file(monkeypatch):
    assert sender_address(["http://127.0.0.1:1", "http://localhost:2"]) == "127.0.0.1"
    assert sender_address(["http://10.1.2.3:1"], override="10.9.9.9") == "10.9.9.9"
    remote = "192.0.2.77"  # TEST-NET-1: routed like any remote server, never contacted
    addr = routed_address(remote)
    if addr is None or addr.startswith("127."):
        pytest.skip("this machine has no route off the host")
    got = sender_address([f"http://{remote}:30001"])
    assert got == addr and not got.startswith("127.")
    with socket.socket() as s:  # an address of this machine that servers can connect to
        s.bind((got, 0))
    monkeypatch.setenv("MASTER_ADDR", remote)  # unresolvable servers: the MASTER_ADDR route
    assert sender_address(["http://no-such-host.invalid:1"]) == addr


@pytest.mark.gpu
def test_from_tensor_cuda_payload_per_tp_rank_kept_alive():
    """Each TP rank gets its own serialized handle of the flattened bucket (on its own GPU where
    the fleet placed it), with SGLang's device-UUID reductions, and every buffer is handed to the
    caller's list (``FromTensor`` drops them once the requests returned)."""
    pytest.importorskip("sglang")
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    from megatron_rl.rollout.weight_sync.from_tensor import FromTensor, tensor_update_bodies

    bucket = [("w", torch.randn(4, 4, device="cuda")), ("b", torch.randn(4, device="cuda"))]
    strat = FromTensor(["http://a", "http://b"], "/x", server_tp=2)
    strat.gpus = [0, 0, 0, 0]
    keep: list = []
    bodies = tensor_update_bodies(bucket, [strat.rank_devices(i, bucket[0][1].device)
                                           for i in range(2)], keep)
    assert len(bodies) == 2 and all(len(b["serialized_named_tensors"]) == 2 for b in bodies)
    assert len(keep) == 4 and all(t.is_cuda for t in keep)
    p = MultiprocessingSerializer.deserialize(bodies[1]["serialized_named_tensors"][1])
    got = dict(FlattenedTensorBucket(flattened_tensor=p["flattened_tensor"],
                                     metadata=p["metadata"]).reconstruct_tensors())
    assert all(torch.equal(got[n], t) for n, t in bucket)
