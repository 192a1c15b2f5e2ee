"""Asynchronous rollouts (``rollout.max_staleness``): the staleness filter, the producer's
gate/queue/close and resume state, and weight updates with requests in flight on each engine:
our ``serve`` (SGLang 0.5.21's rules: pause ``abort`` -> the client re-queues from scratch;
pause ``in_place`` -> partial rollout with per-token ``weight_versions`` spans) and the embedded
engine (an update waits for the running generate call)."""

import threading
import time

import pytest
import torch

from megatron_rl.config.sections import SGLangSection
from megatron_rl.models.config import get_preset
from megatron_rl.rollout.async_rollout import (
    AsyncProducer,
    filter_stale,
    sample_version,
    token_staleness,
)
from megatron_rl.rollout.embedded import EmbeddedEngine, build_hf_model
from megatron_rl.rollout.engine import SamplingParams
from megatron_rl.rollout.fleet import Fleet, http_json
from megatron_rl.rollout.serve import version_spans
from megatron_rl.rollout.sglang_client import (
    SGLangEngine,
    completion_from_response,
    generate_request,
)
from megatron_rl.rollout.weight_sync import make_strategy, push_single_process

EOS = 1  # the `server` fixture's end-of-sequence id (conftest.py)


def _rec(uid, version, tv=None):
    r = {"uid": uid, "weight_version": version}
    if tv is not None:
        r["token_versions"] = tv
    return r


def test_filter_stale_hand_vectors():
    # step 5, K = 1: versions 4 and 5 pass; group 2 has one sample of version 3 -> dropped whole;
    # group 3's sample is partial: its oldest token is version 3 -> stale
    recs = [_rec(0, 5), _rec(0, 4), _rec(1, 4), _rec(1, 4), _rec(2, 4), _rec(2, 3),
            _rec(3, 5, tv=[3, 3, 5]), _rec(3, 5)]
    kept, m = filter_stale(recs, 5, 1)
    assert [r["uid"] for r in kept] == [0, 0, 1, 1]
    lags = [0, 1, 1, 1, 1, 2, 2, 0]
    assert m["rollout/dropped_stale"] == 4.0
    assert m["rollout/staleness_max"] == 2.0
    assert m["rollout/staleness_mean"] == pytest.approx(sum(lags) / 8)
    assert sample_version(_rec(9, 7, tv=[6, 7])) == 6
    kept, m = filter_stale(recs, 5, 2)  # K = 2: everything passes
    assert len(kept) == 8 and m["rollout/dropped_stale"] == 0.0


def test_partial_token_staleness_hand_vectors():
    """``rollout_version`` is read: per-token staleness over the valid response tokens."""
    versions = torch.tensor([[-1, 3, 3, 5, -1], [-1, 4, 5, -1, -1], [-1, 2, -1, -1, -1]])
    mask = torch.tensor([[0, 1, 1, 1, 0], [0, 1, 1, 0, 0], [0, 0, 0, 0, 0]], dtype=torch.bool)
    m = token_staleness(versions, mask, 5)  # lags 2, 2, 0, 1, 0; row 2's version 2 is padding
    assert m == {"rollout/token_staleness_mean": 1.0, "rollout/token_staleness_max": 2.0}


def test_partial_async_take_records_lengths_and_reports_short_batch(tmp_path, capsys):
    """The async path writes ``response_lengths.json`` as the synchronous one does (the
    responses trained on), and a group dropped as stale after dynamic sampling filled
    the batch is counted (``rollout/dropped_stale_groups``) and printed, not silent."""
    import json

    from megatron_rl.config.load import load_config
    from megatron_rl.run.driver import RolloutDriver

    cfg = load_config(None, [f"output_dir={tmp_path}", "rollout.max_staleness=1",
                             "trainer.train_batch_size=2", "rollout.max_new_tokens=64"])

    def produce(j):  # step 2, K = 1: group 1 has a sample of version 0 -> stale
        recs = [{"uid": 0, "weight_version": 1, "response_ids": [5] * 3},
                {"uid": 0, "weight_version": 1, "response_ids": [5] * 10},
                {"uid": 1, "weight_version": 1, "response_ids": [5] * 20},
                {"uid": 1, "weight_version": 0, "response_ids": [5] * 63}]
        return recs, {}

    drv = RolloutDriver.__new__(RolloutDriver)
    drv.cfg = cfg
    drv.producer = AsyncProducer(produce, lambda: {"pos": 0}, 2, 3, max_staleness=1, version=1)
    records, metrics = drv._take_async(2)
    assert [r["uid"] for r in records] == [0, 0]
    assert metrics["rollout/dropped_stale_groups"] == 1.0
    assert metrics["rollout/dropped_stale"] == 2.0
    assert "1 stale group(s) dropped; training on 1 prompt(s)" in capsys.readouterr().out
    hist = json.loads((tmp_path / "response_lengths.json").read_text())
    assert hist["cap"] == 64 and sum(hist["counts"]) == 2  # bins of width 1: the kept 3, 10
    assert [b for b, c in enumerate(hist["counts"]) if c] == [3, 10]
    drv.producer.close()


def test_partial_sample_versions_gate_and_correction_hand_vectors():
    """A partial rollout's tokens [3, 3, 4, 4] at step 5: the gate counts its oldest token
    (staleness 2: dropped at K = 1, kept at K = 2), the per-token metrics count every token, the
    batch carries the versions, and each correction reads each token against its own behaviour
    log-prob: old_logp = -1 everywhere, rollout_logp = [-1.5, -0.9 | -1.2, -1.0] (versions
    3, 3 | 4, 4) -> rho = exp([0.5, -0.1, 0.2, 0.0]) = [1.6487, 0.9048, 1.2214, 1.0]."""
    from megatron_rl.loss.rollout_correction import CorrectionBounds, compute_correction
    from megatron_rl.rollout.collect import records_to_batch

    rec = {"uid": 0, "weight_version": 4, "token_versions": [3, 3, 4, 4], "prompt_ids": [7, 8],
           "response_ids": [5, 6, 9, 1], "logprobs": [-1.5, -0.9, -1.2, -1.0], "reward": 1.0,
           "acc": 1.0, "finished": True}
    other = {**rec, "token_versions": None, "weight_version": 5, "reward": 0.0}
    kept, m = filter_stale([rec, other], 5, 1)
    assert kept == [] and m["rollout/dropped_stale"] == 2.0  # the group goes whole
    kept, m = filter_stale([rec, other], 5, 2)
    assert len(kept) == 2 and m["rollout/staleness_max"] == 2.0
    assert m["rollout/partial_samples"] == 1.0
    batch = records_to_batch([rec], "grpo", 0, 1, versions=True)
    assert batch["rollout_version"][0].tolist() == [-1, -1, 3, 3, 4, 4]
    assert token_staleness(batch["rollout_version"], batch["rollout_version"] >= 0, 5) == {
        "rollout/token_staleness_mean": 1.5, "rollout/token_staleness_max": 2.0}  # 2, 2, 1, 1
    old = torch.full((1, 4), -1.0)
    mu = torch.tensor([[-1.5, -0.9, -1.2, -1.0]])
    mask = torch.ones(1, 4, dtype=torch.bool)
    b = CorrectionBounds(threshold=1.5)
    rho = [1.6487213, 0.9048374, 1.2214028, 1.0]
    w = {mode: compute_correction(old, mu, mask, mode, b).weight[0].tolist()
         for mode in ("tis", "mis", "icepop", "seq_mask_tis")}
    assert w["tis"] == pytest.approx([1.5, rho[1], rho[2], 1.0])  # min(rho, 1.5)
    assert w["mis"] == pytest.approx([0.0, rho[1], rho[2], 1.0])  # band [1/1.5, 1.5]
    assert w["icepop"] == pytest.approx(rho)  # band [0.5, 5]: every token kept
    # geometric mean exp(mean(0.5, -0.1, 0.2, 0)) = exp(0.15) = 1.1618 > 1.001: row rejected
    assert w["seq_mask_tis"] == [0.0, 0.0, 0.0, 0.0]


def test_partial_pause_mode_by_server_version():
    """``retract`` only where the server reports per-token versions (SGLang >= 0.5.21, compared
    as numbers: 0.5.3 is older) and the run keeps partial rollouts; ``abort`` otherwise."""
    from megatron_rl.rollout.weight_sync.common import pause_mode_for, release_tuple

    assert release_tuple("0.5.21.post1") == (0, 5, 21) and release_tuple("serve") == ()
    assert [pause_mode_for(v, True) for v in ("0.5.21", "0.5.21.post1", "0.5.22rc0", "0.6.0",
                                              "0.5.20", "0.5.3", "megatron_rl-serve", "")] == \
        ["retract"] * 4 + ["abort"] * 4
    assert pause_mode_for("0.5.21", False) == "abort"


def test_version_spans_follow_sglang_0_5_21():
    # compute_weight_version_spans of sglang/srt/utils/weight_versions.py, by hand
    assert version_spans([], "3", 5) == [{"version": "3", "start": 0, "end": 5}]
    assert version_spans([("1", 2), ("2", 4)], "3", 6) == [
        {"version": "1", "start": 0, "end": 2}, {"version": "2", "start": 2, "end": 4},
        {"version": "3", "start": 4, "end": 6}]
    # no token between two changes: the middle version owns nothing and is skipped
    assert version_spans([("1", 2), ("2", 2)], "3", 3) == [
        {"version": "1", "start": 0, "end": 2}, {"version": "3", "start": 2, "end": 3}]
    meta = {"weight_version": "4", "weight_versions": [{"version": "3", "start": 0, "end": 1},
                                                      {"version": "4", "start": 1, "end": 3}],
            "output_token_logprobs": [[-0.1, 5, None], [-0.2, 6, None], [-0.3, 7, None]],
            "finish_reason": {"type": "length"}}
    comp, v = completion_from_response([2], {"meta_info": meta})
    assert v == 4 and comp.weight_version == 4 and comp.token_versions == [3, 4, 4]


class _Loader:
    """A deterministic prompt source with the loader's state interface."""

    def __init__(self, pos=0):
        self.pos = pos

    def next_batch(self):
        self.pos += 2
        return [self.pos - 2, self.pos - 1]

    def state_dict(self):
        return {"pos": self.pos}


def test_producer_gate_queue_resume_and_close():
    loader, seen, versions = _Loader(), [], {}
    box = {"version": 0}

    def produce(j):
        rows = loader.next_batch()
        seen.append(j)
        versions[j] = box["version"]
        return [{"uid": j, "rows": rows, "weight_version": box["version"]}], {"m": float(j)}

    p = AsyncProducer(produce, loader.state_dict, 0, 6, max_staleness=1, version=0)
    time.sleep(0.3)
    assert seen == [0, 1]  # gate: batch j starts at version >= j - 1
    trained, ckpt = [], None
    for s in range(3):
        item, qm = p.take(s)
        kept, sm = filter_stale(item.records, s, 1)
        trained.append((s, item.records[0]["rows"]))
        assert sm["rollout/dropped_stale"] == 0
        if s == 0:
            assert qm["rollout/queue_depth"] == 2.0  # batches 0 and 1 were ready
        ckpt = item.loader_state  # what a checkpoint after step s stores
        box["version"] = s + 1
        p.published(s + 1)
    time.sleep(0.3)
    assert max(seen) == 4  # version 3 published: batches up to 4 exist, batch 5 waits
    assert p.close() == 2  # batches 3 and 4 were queued: abandoned, never trained
    assert not p.thread.is_alive()
    # resume from the checkpoint of step 2: the loader continues after batch 2, so batch 3 gets
    # exactly the prompts the lost batch 3 had, and nothing trained is drawn again
    loader2 = _Loader(**ckpt)
    assert loader2.next_batch() == [6, 7]
    assert [rows for _, rows in trained] == [[0, 1], [2, 3], [4, 5]]
    assert versions[0] == versions[1] == 0 and versions[2] >= 1  # gated on version 1


def test_producer_error_reaches_the_trainer():
    def produce(j):
        raise ValueError("reward server down")

    p = AsyncProducer(produce, lambda: None, 0, 3, max_staleness=1, version=0)
    with pytest.raises(ValueError, match="reward server down"):
        p.take(0)




def _engine(url, tmp_path) -> SGLangEngine:
    s = SGLangSection(servers=[url], router_url=url)
    fleet = Fleet(s, "preset:tiny", EOS, str(tmp_path / "logs"))
    fleet.workers = {url: "direct"}  # one server, no router: requests go to it
    eng = SGLangEngine(fleet, EOS, concurrency=8)
    eng.sync = make_strategy("from_disk", fleet, str(tmp_path / "sync"))
    eng.sync.flush_wait_s = 0.1
    return eng


def test_partial_validation_requests_not_in_offpolicy_lag(server, tmp_path):
    """A validation/eval request (``SamplingParams.validation``) is not counted in
    ``rollout/offpolicy_lag``; a rollout request is."""
    url, _ = server
    http_json("POST", url + "/update_weight_version", {"new_version": "1"})
    eng = _engine(url, tmp_path)
    eng.weight_version = 3  # the trainer is two syncs ahead of this server
    eng.generate([[5, 6]], SamplingParams(n=2, max_new_tokens=2, validation=True), seed=1)
    assert "rollout/offpolicy_lag" not in eng.pop_metrics()
    eng.generate([[5, 6]], SamplingParams(n=1, max_new_tokens=2), seed=1)
    assert eng.pop_metrics()["rollout/offpolicy_lag"] == 2.0
    http_json("POST", url + "/update_weight_version", {"new_version": "default"})


def _wait(cond, timeout=30.0, what=lambda: ""):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out {what()}"
        time.sleep(0.01)


def test_serve_sync_with_requests_in_flight_requeues_them(server, tmp_path):
    """Pause (abort) -> sync -> continue while every request is in flight: each is re-queued
    from scratch and finishes under the new weights; none lost, none duplicated, and each equals
    what the new weights generate for its seed."""
    url, state = server
    eng = _engine(url, tmp_path)
    torch.manual_seed(1)
    new = [(n, t.detach().clone()) for n, t in build_hf_model(get_preset("tiny"))
           .named_parameters()]
    prompts, params = [[5, 6, 7], [8, 9], [10, 11, 12, 13]], SamplingParams(
        n=2, max_new_tokens=6, temperature=1.0)
    out: dict = {}
    state.lock.acquire()  # every request blocks at its first forward
    try:
        gen = threading.Thread(target=lambda: out.update(g=eng.generate(prompts, params,
                                                                        seed=3)))
        gen.start()
        _wait(lambda: len(state.inflight) == 6)
        sync = threading.Thread(target=lambda: out.update(s=push_single_process(eng, [new], 1)))
        sync.start()
        _wait(lambda: not state.running.is_set())  # paused: every abort event is set
    finally:
        state.lock.release()
    sync.join(60)
    gen.join(60)
    assert not sync.is_alive() and not gen.is_alive()
    groups = out["g"]
    assert out["s"].startswith("from_disk v1")
    assert [len(g) for g in groups] == [2, 2, 2]
    m = eng.pop_metrics()
    assert m["rollout/aborted_requeued"] == 6.0 and "rollout/request_retries" not in m
    assert all(c.weight_version == 1 and c.token_versions is None for g in groups for c in g), \
        [(c.weight_version, c.token_versions) for g in groups for c in g]
    again = eng.generate(prompts, params, seed=3)  # the new weights, same seeds
    assert [[c.response_ids for c in g] for g in groups] == \
        [[c.response_ids for c in g] for g in again]


def test_serve_pause_in_place_gives_partial_rollout_versions(server, tmp_path):
    """Pause in place: a running request keeps its tokens and continues under the new weights;
    the reply's spans (SGLang 0.5.21) say token 0 came from the old version, the rest from the
    new one, and the client turns them into per-token versions."""
    url, state = server
    http_json("POST", url + "/update_weight_version", {"new_version": "4"})
    body = generate_request([5, 6, 7], SamplingParams(max_new_tokens=5, temperature=1.0),
                            [], seed=9, rid="partial")
    body["sampling_params"]["ignore_eos"] = True
    out: dict = {}
    state.lock.acquire()
    try:
        th = threading.Thread(target=lambda: out.update(r=http_json("POST", url + "/generate",
                                                                    body)))
        th.start()
        _wait(lambda: "partial" in state.live)
        http_json("POST", url + "/pause_generation", {"mode": "in_place"})
    finally:
        state.lock.release()  # exactly one token is generated, then the request waits
    _wait(lambda: len(state.live["partial"][0].ids) == 1)
    time.sleep(0.1)
    assert len(state.live["partial"][0].ids) == 1  # paused between tokens
    http_json("POST", url + "/update_weight_version", {"new_version": "5"})
    http_json("POST", url + "/continue_generation", {})
    th.join(30)
    meta = out["r"]["meta_info"]
    assert meta["weight_version"] == "5"
    assert meta["weight_versions"] == [{"version": "4", "start": 0, "end": 1},
                                       {"version": "5", "start": 1, "end": 5}]
    comp, _ = completion_from_response([5, 6, 7], out["r"])
    assert comp.token_versions == [4, 5, 5, 5, 5]
    with pytest.raises(Exception, match="mode"):
        http_json("POST", url + "/pause_generation", {"mode": "later"})


def _in_flight_with_one_token(url, state, eng, prompts, params, out):
    """Start ``eng.generate`` and return once every request has generated exactly one token
    and waits (paused in place): the state a weight sync then meets."""
    http_json("POST", url + "/update_weight_version", {"new_version": "4"})
    eng.weight_version = 4
    state.lock.acquire()  # every request blocks at its first forward
    try:
        gen = threading.Thread(target=lambda: out.update(g=eng.generate(prompts, params,
                                                                        seed=3)))
        gen.start()
        n = len(prompts) * params.n
        _wait(lambda: len(state.live) == n, timeout=300)  # a state, not a time (loaded boxes)
        http_json("POST", url + "/pause_generation", {"mode": "in_place"})
    finally:
        state.lock.release()  # each request generates one token, then waits between tokens
    _wait(lambda: all(len(r.ids) == 1 for r, _ in list(state.live.values())), timeout=300,
          what=lambda: [(r.ids, r.finish) for r, _ in state.live.values()])
    return gen


def _new_weights():
    torch.manual_seed(7)  # not the weights other tests of the module push
    return [(n, t.detach().clone()) for n, t in build_hf_model(get_preset("tiny"))
            .named_parameters()]


def _sync_mid_generation(url, state, eng, partial):
    """A weight sync (v4 -> v5) while 4 requests have one token each; the groups and metrics."""
    eng.partial = eng.sync.partial = partial
    prompts = [[5, 6, 7], [8, 9]]
    params = SamplingParams(n=2, max_new_tokens=6, temperature=1.0)
    out: dict = {}
    gen = _in_flight_with_one_token(url, state, eng, prompts, params, out)
    push_single_process(eng, [_new_weights()], 5)
    gen.join(60)
    assert not gen.is_alive()
    return out["g"], eng.pop_metrics()


def test_partial_rollout_retract_keeps_tokens_redone_zero(server, tmp_path):
    """``rollout.partial`` on an SGLang 0.5.21 server: the sync pauses with ``retract``; every
    request keeps its first token (version 4, its old log-prob) and continues under version 5
    from a KV cache recomputed under the new weights; nothing is redone or re-queued."""
    from megatron_rl.rollout.sampling import teacher_forced_logprobs

    url, state = server
    eng = _engine(url, tmp_path)
    old = [(n, t.detach().clone()) for n, t in state.model.named_parameters()]
    groups, m = _sync_mid_generation(url, state, eng, partial=True)
    assert eng.sync.pause_modes == {url: "retract"}
    assert m["rollout/redone_tokens"] == 0.0 and "rollout/aborted_requeued" not in m
    for c in (c for g in groups for c in g):
        n = len(c.response_ids)
        assert c.token_versions == [4] + [5] * (n - 1), c.token_versions
        seq = c.prompt_ids + c.response_ids
        new_lp = teacher_forced_logprobs(state.model, seq)[len(c.prompt_ids) - 1:]
        assert c.logprobs[1:] == pytest.approx(new_lp[1:], abs=1e-4)  # recomputed KV
        assert abs(c.logprobs[0] - new_lp[0]) > 1e-3  # token 0: the old weights' log-prob
    load = dict(old)
    with torch.no_grad():
        for name, p in state.model.named_parameters():
            p.copy_(load[name])  # the old weights give token 0's recorded log-prob
    for c in (c for g in groups for c in g):
        lp0 = teacher_forced_logprobs(state.model, c.prompt_ids + c.response_ids[:1])[-1]
        assert c.logprobs[0] == pytest.approx(lp0, abs=1e-4)


def test_partial_rollout_serve_flush_rules_follow_sglang_0_5_21(server, tmp_path):
    """SGLang 0.5.21's flush rules while paused (``Scheduler.flush_cache`` /
    ``SchedulerFlushWrapper``): ``in_place`` keeps requests running, so a flush is refused;
    ``retract`` moves them to the waiting queue, so a flush without a timeout succeeds, and one
    with ``?timeout=`` (which waits for an empty waiting queue) times out."""
    from megatron_rl.rollout.fleet import ServerError

    url, state = server
    eng = _engine(url, tmp_path)
    out: dict = {}
    gen = _in_flight_with_one_token(url, state, eng, [[5, 6, 7]],
                                    SamplingParams(n=2, max_new_tokens=4), out)
    with pytest.raises(ServerError, match="400"):
        http_json("POST", url + "/flush_cache")
    http_json("POST", url + "/pause_generation", {"mode": "retract"})
    assert http_json("POST", url + "/flush_cache").startswith("Cache flushed")
    with pytest.raises(ServerError, match="Timed out waiting for idle"):
        http_json("POST", url + "/flush_cache?timeout=0.2")
    http_json("POST", url + "/continue_generation", {})
    gen.join(60)
    assert [len(c.response_ids) >= 1 for c in out["g"][0]] == [True, True]


@pytest.mark.parametrize("partial", [True, False])
def test_partial_rollout_abort_resubmits_prefix_on_older_servers(server, tmp_path, partial):
    """A server without per-token versions (SGLang 0.5.20 rules) is paused with ``abort``:
    with ``rollout.partial`` the client sends each request again with its token appended to the
    prompt (nothing redone, versions [4, 5, ...]); without, from scratch (4 tokens redone, every
    token version 5)."""
    from megatron_rl.rollout.serve import OLD_RULES

    url, state = server
    eng = _engine(url, tmp_path)
    rules, state.rules = state.rules, OLD_RULES
    try:
        groups, m = _sync_mid_generation(url, state, eng, partial=partial)
    finally:
        state.rules = rules
    comps = [c for g in groups for c in g]
    assert [len(g) for g in groups] == [2, 2] and m["rollout/aborted_requeued"] == 4.0
    if partial:
        assert eng.sync.pause_modes == {url: "abort"}
        assert m["rollout/redone_tokens"] == 0.0 and m["rollout/resumed_requests"] == 4.0
        assert all(c.token_versions == [4] + [5] * (len(c.response_ids) - 1) for c in comps)
    else:
        assert m["rollout/redone_tokens"] == 4.0
        assert all(c.token_versions is None and c.weight_version == 5 for c in comps)
    assert all(len(c.response_ids) == len(c.logprobs) <= 6 for c in comps)


def test_embedded_update_waits_for_the_running_generate_call():
    """The embedded engine's policy: a weight update waits until the running generate call
    ends, so every completion has one version and none is lost."""
    eng = EmbeddedEngine(get_preset("tiny"), eos_id=EOS, pad_id=0)
    eng.weight_version = 0
    params = [(n, t.detach().clone() + 0.01) for n, t in eng.model.named_parameters()]
    out: dict = {}
    eng.lock.acquire()  # a generate call "running" (holds the engine)
    try:
        gen = threading.Thread(target=lambda: out.update(g=eng.generate(
            [[5, 6]], SamplingParams(n=2, max_new_tokens=3), seed=1)))
        upd = threading.Thread(target=lambda: eng.update_weights([params], 1))
        gen.start()
        time.sleep(0.05)
        upd.start()
        time.sleep(0.1)
        assert eng.weight_version == 0 and upd.is_alive()  # the update waits
    finally:
        eng.lock.release()
    gen.join(30)
    upd.join(30)
    assert eng.weight_version == 1
    assert [c.weight_version for c in out["g"][0]] in ([0, 0], [1, 1])


@pytest.mark.parametrize("per_request", [False, True])
def test_embedded_partial_rollout_update_between_decode_steps(per_request):
    """``rollout.partial`` on the embedded engine: an update that waits for a running generate
    call gets in at the third decode step (the test starts it there and waits until the engine
    reports it waiting); the call then goes on with its tokens kept, and each token carries the
    version whose weights computed it: batched, the logits of step t are recorded before the
    update can run (steps 0-2 of both rows old); per request, before each forward (steps 0-1
    of the first sample old, everything after new)."""
    eng = EmbeddedEngine(get_preset("tiny"), eos_id=EOS, pad_id=0, per_request_seed=per_request)
    eng.weight_version, eng.partial = 0, True
    params = [(n, t.detach().clone() + 0.01) for n, t in eng.model.named_parameters()]
    calls, upd = [0], []
    orig = eng.between_steps

    def between_steps():
        calls[0] += 1
        if calls[0] == 3:  # start the update and let it wait for the engine
            upd.append(threading.Thread(target=lambda: eng.update_weights([params], 1)))
            upd[0].start()
            _wait(lambda: eng._update_wanted.is_set(), timeout=300)
        orig()

    eng.between_steps = between_steps
    out = eng.generate([[5, 6]], SamplingParams(n=2, max_new_tokens=6), seed=1)
    upd[0].join(60)
    assert eng.weight_version == 1 and not upd[0].is_alive()
    old = [3, 3] if not per_request else [2, 0]  # old-version tokens of each sample
    for c, k in zip(out[0], old):
        n = len(c.response_ids)
        want = [0] * min(k, n) + [1] * max(0, n - k)
        assert (c.token_versions or [c.weight_version] * n) == want, (c.token_versions, want)
        assert len(c.logprobs) == n


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_one_step_off_run_killed_mid_way_resumes(tmp_path):
    """``max_staleness=1`` end to end (TP1 x PP2, embedded engine): every trained sample is at
    most one version old; a run SIGKILLed after its step-2 checkpoint (batches queued) resumes
    from it, regenerates the lost batches and logs every step exactly once."""
    import json
    import os
    import signal
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cmd = [sys.executable, "-m", "megatron_rl", "train", "examples/tiny_dapo.yaml",
           f"output_dir={tmp_path}", "parallel.tp=1", "parallel.pp=2", "trainer.total_steps=6",
           "trainer.test_freq=6", "trainer.save_freq=2", "trainer.train_batch_size=4",
           "rollout.n=4", "rollout.gen_batch_size=4", "rollout.dynamic_sampling=false",
           "rollout.val_n=1", "actor.micro_batch_size=8", "actor.mini_batch_size=8", "sft.steps=10",
           "data.val_size=8",
           "trainer.plots=false", "rollout.max_staleness=1"]
    env = {**os.environ, "PYTHONPATH": root}
    proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    latest = tmp_path / "checkpoints" / "latest"
    deadline = time.time() + 600
    while time.time() < deadline and proc.poll() is None:
        if latest.exists() and latest.read_text() == "step_0000001":
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the run finished before it could be killed"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    # the resume: the same command in place on two spawned ranks (as under torchrun)
    from conftest import run_cli

    (code, out, err), = run_cli(2, ["train", os.path.join(root, cmd[4]), *cmd[5:]],
                                timeout_s=600)
    assert code == 0, out[-3000:] + err[-3000:]
    assert "resumed from checkpoint" in out
    assert "rollout producer stopped" in out
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    trained = [r for r in rows if "rollout/staleness_max" in r]
    assert [r["step"] for r in trained] == [1, 2, 3, 4, 5, 6]
    assert all(r["rollout/staleness_max"] <= 1 and r["rollout/dropped_stale"] == 0
               for r in trained)
    assert any(r["rollout/staleness_max"] == 1 for r in trained)  # it did run ahead


def test_bad_max_staleness_is_refused_naming_the_field():
    from megatron_rl.config.errors import ConfigError
    from megatron_rl.config.load import load_config

    assert load_config(None, ["rollout.max_staleness=2"]).rollout.max_staleness == 2
    for bad in ("rollout.max_staleness=-1", "rollout.max_staleness=65"):
        with pytest.raises(ConfigError, match="rollout.max_staleness"):
            load_config(None, [bad])
    with pytest.raises(ConfigError, match="rollout.max_staleness=1.*env.name"):
        load_config(None, ["rollout.max_staleness=1", "env.name=frozenlake"])
    with pytest.raises(ConfigError, match="colocate"):
        load_config(None, ["rollout.max_staleness=1", "rollout.engine=sglang",
                           "rollout.sglang.colocate=true",
                           "rollout.sglang.weight_sync=from_tensor"])
