"""The real ``sglang-router`` (PyPI ``sglang-router``) in front of two of our ``serve`` processes
on loopback: a dead server costs no sample, and a short RL run through the fleet (weights pushed
and verified every step) gives the embedded engine's metrics for the same seed."""

import os
import signal

import psutil
import pytest
import torch

pytest.importorskip("sglang_router")

from megatron_rl.config.sections import SGLangSection  # noqa: E402
from megatron_rl.models.config import get_preset  # noqa: E402
from megatron_rl.rollout.embedded import EmbeddedEngine, build_hf_model  # noqa: E402
from megatron_rl.rollout.engine import SamplingParams  # noqa: E402
from megatron_rl.rollout.fleet import Fleet, http_json  # noqa: E402
from megatron_rl.rollout.sampling import teacher_forced_logprobs  # noqa: E402
from megatron_rl.rollout.sglang_client import SGLangEngine  # noqa: E402
from megatron_rl.rollout.weight_sync import make_strategy, push_single_process  # noqa: E402
from megatron_rl.rollout.weight_sync.common import probe_check, probe_tokens  # noqa: E402
from megatron_rl.testing.procs import free_port_block  # noqa: E402,F401 (used by other tests too)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EOS = 1


def _tiny_model_dir(path) -> str:
    from transformers import AutoConfig

    from megatron_rl.convert.registry import hf_config_dict

    fields = hf_config_dict(get_preset("tiny"))
    AutoConfig.for_model(fields.pop("model_type"), **fields).save_pretrained(str(path))
    return str(path)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_dead_server_loses_no_sample_and_is_restarted(tmp_path, capsys):
    """A server killed mid-rollout: no sample lost; it is restarted, gets the next sync's
    weights, rejoins the router at the current weight version and serves."""
    s = SGLangSection(num_servers=2, router_port=free_port_block(3))
    fleet = Fleet(s, _tiny_model_dir(tmp_path / "model"), EOS, str(tmp_path / "logs")).start()
    fleet_urls0 = list(fleet.urls)
    try:
        assert len(fleet.router_workers()) == 2
        eng = SGLangEngine(fleet, EOS, concurrency=4)
        eng.sync = make_strategy("from_disk", fleet, str(tmp_path / "sync"))
        torch.manual_seed(3)
        ref = build_hf_model(get_preset("tiny"))
        sd = [(n, p.detach().clone()) for n, p in ref.named_parameters()]
        push_single_process(eng, [sd], version=1)  # both servers now hold ref's weights
        ids = probe_tokens(get_preset("tiny").vocab_size, 16)
        worst, errors = probe_check(fleet.urls, ids, teacher_forced_logprobs(ref, ids), 1e-4)
        assert not errors and worst <= 1e-4
        emb = EmbeddedEngine(get_preset("tiny"), EOS, 0, per_request_seed=True)
        emb.model.load_state_dict(ref.state_dict())
        params = SamplingParams(n=4, max_new_tokens=12, temperature=1.0)
        prompts = [[5 + i, 6 + i, 7] for i in range(8)]
        victim = fleet.urls[1]
        killed = []

        def kill_once(i, group) -> bool:  # at the first complete group: kill server 1
            if not killed:
                serve = psutil.Process(fleet.procs[victim].pid).children()[0]
                serve.send_signal(signal.SIGKILL)
                killed.append(serve.pid)
            return False

        got = eng.generate(prompts, params, seed=9, stop_when=kill_once)
        want = emb.generate(prompts, params, seed=9)
        assert killed
        assert [len(g) for g in got] == [4] * 8  # no group shortened
        for g, w in zip(got, want):  # and every sample is what the dead server would have given
            assert [c.response_ids for c in g] == [c.response_ids for c in w]
        fleet.check_health()
        assert victim not in fleet.urls
        assert sorted(w["url"] for w in fleet.router_workers()) == sorted(fleet.urls)
        # the next rollout runs on the survivor alone (the restarted server is not routed to
        # before it holds the current weights)
        again = eng.generate(prompts[:2], params, seed=9)
        assert [c.response_ids for c in again[1]] == [c.response_ids for c in want[1]]
        # restarted at once on a new port; the next sync gives it the new weights, then it
        # rejoins the router
        (restarted,) = fleet.pending
        assert restarted != victim and fleet.restarts == {1: 1}
        torch.manual_seed(4)
        ref2 = build_hf_model(get_preset("tiny"))
        push_single_process(eng, [[(n, p.detach().clone()) for n, p in ref2.named_parameters()]],
                            version=2)
        assert sorted(fleet.urls) == sorted([fleet_urls0[0], restarted]) and not fleet.pending
        assert sorted(w["url"] for w in fleet.router_workers()) == sorted(fleet.urls)
        for u in fleet.urls:
            assert http_json("GET", u + "/get_model_info")["weight_version"] == "2"
        worst, errors = probe_check(fleet.urls, ids, teacher_forced_logprobs(ref2, ids), 1e-4)
        assert not errors and worst <= 1e-4
        # ... and serves (round robin over both): samples are the embedded ones
        emb.model.load_state_dict(ref2.state_dict())
        got2 = eng.generate(prompts, params, seed=11)
        assert [[c.response_ids for c in g] for g in got2] == \
            [[c.response_ids for c in g] for g in emb.generate(prompts, params, seed=11)]
        direct = http_json("POST", restarted + "/generate", {"input_ids": [5, 6, 7],
                           "sampling_params": {"max_new_tokens": 2, "ignore_eos": True}})
        assert direct["meta_info"]["weight_version"] == "2"
        out = capsys.readouterr().out
        assert f"[fleet] server 1 ({victim}) died; restarted as {restarted}" in out
        assert f"({restarted}) holds weight version 2; back in the router" in out
    finally:
        fleet.stop()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_multi_turn_episodes_through_router_match_embedded(tmp_path):
    """The multi-turn rollout (FrozenLake) runs through the same engine interface on the fleet:
    every episode's tokens, masks, log-probs and rewards equal the embedded engine's."""
    from megatron_rl.envs.frozenlake import FrozenLakeTextEnv
    from megatron_rl.rewards.tokenizer import ByteTokenizer
    from megatron_rl.rollout.multiturn import run_episodes

    tok = ByteTokenizer()
    s = SGLangSection(num_servers=2, router_port=free_port_block(3))
    fleet = Fleet(s, _tiny_model_dir(tmp_path / "model"), tok.eos_id,
                  str(tmp_path / "logs")).start()
    try:
        eng = SGLangEngine(fleet, tok.eos_id, concurrency=4)
        eng.sync = make_strategy("from_disk", fleet, str(tmp_path / "sync"))
        torch.manual_seed(5)
        ref = build_hf_model(get_preset("tiny"))
        push_single_process(eng, [[(n, p.detach().clone()) for n, p in ref.named_parameters()]],
                            version=1)
        emb = EmbeddedEngine(get_preset("tiny"), tok.eos_id, tok.pad_id, per_request_seed=True)
        emb.model.load_state_dict(ref.state_dict())

        def episodes(engine):
            return run_episodes(engine, tok, lambda: FrozenLakeTextEnv(size=3, success_rate=0.8),
                                [5, 6], 2, SamplingParams(max_new_tokens=3, temperature=1.0),
                                max_turns=3, gen_seed=1, max_total_tokens=512)

        got, want = episodes(eng), episodes(emb)
        assert len(got) == len(want) == 4
        assert max(r["turns"] for r in got) >= 2  # really multi-turn
        for g, w in zip(got, want):
            assert g["response_ids"] == w["response_ids"]
            assert g["response_mask"] == w["response_mask"]
            assert g["turn_rewards"] == w["turn_rewards"]
            assert g["logprobs"] == pytest.approx(w["logprobs"], abs=1e-5)
    finally:
        fleet.stop()


FLEET_ONLY = ("rollout/offpolicy_lag", "rollout/offpolicy_lag_max", "rollout/weight_sync",
              "rollout/request_retries", "rollout/aborted_requests", "rollout/redone_tokens",
              "rollout/resumed_requests", "time/", "gpu/", "sys/")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_rl_run_through_router_matches_embedded(fleet_run, tmp_path):
    from conftest import tiny_train

    emb, _ = tiny_train(tmp_path / "emb")
    fl, fleet_out = fleet_run
    assert len(emb) == len(fl) >= 3
    for a, b in zip(emb, fl):
        keys = {k for k in a if not k.startswith(FLEET_ONLY) and k not in ("time", "wall_s")}
        assert keys == {k for k in b if not k.startswith(FLEET_ONLY) and k not in ("time",
                                                                                    "wall_s")}
        for k in keys:
            va, vb = a[k], b[k]
            if isinstance(va, float) and isinstance(vb, float):
                assert vb == pytest.approx(va, rel=1e-3, abs=1e-4), k
            else:
                assert va == vb, k
    trained = [r for r in fl if "rollout/offpolicy_lag" in r]
    assert trained and all(r["rollout/offpolicy_lag"] == 0.0 for r in trained)
    # every step's sync was verified: probe within 1e-4 (fp32) on both servers, its mean gap
    # (the number checked) logged per sync
    synced = [r for r in fl if "rollout/weight_sync_probe_max_diff" in r]
    assert len(synced) >= 2 and all(r["rollout/weight_sync_probe_max_diff"] <= 1e-4
                                    for r in synced)
    assert all(0.0 <= r["rollout/weight_sync_probe_gap"] <= r["rollout/weight_sync_probe_max_diff"]
               for r in synced)
    logs = os.listdir(fleet_out / "sglang" / "logs")
    assert sorted(logs) == ["router.log", "server0.log", "server1.log"]


class _KillOnIter(list):
    """Buckets that kill a server when the sync starts reading them (mid-sync)."""

    def __init__(self, items, kill) -> None:
        super().__init__(items)
        self.kill, self.done = kill, False

    def __iter__(self):
        if not self.done:
            self.done = True
            self.kill()
        return super().__iter__()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_server_killed_during_sync_is_restarted_and_the_sync_retried(tmp_path, capsys):
    """One server is killed while the sync reads the buckets, another (its replacement's
    neighbour) during the commit's /flush_cache: each time the sync is retried on the
    survivors and the restarted servers, which get the weights and rejoin the router."""
    from megatron_rl.rollout.weight_sync import common

    s = SGLangSection(num_servers=2, router_port=free_port_block(3))
    fleet = Fleet(s, _tiny_model_dir(tmp_path / "model"), EOS, str(tmp_path / "logs")).start()
    try:
        eng = SGLangEngine(fleet, EOS, concurrency=4)
        eng.sync = make_strategy("from_disk", fleet, str(tmp_path / "sync"))
        torch.manual_seed(7)
        ref = build_hf_model(get_preset("tiny"))
        victim = fleet.urls[1]

        def kill(url: str) -> None:
            psutil.Process(fleet.procs[url].pid).children()[0].send_signal(signal.SIGKILL)

        sd = [(n, p.detach().clone()) for n, p in ref.named_parameters()]
        push_single_process(eng, _KillOnIter([sd[:6], sd[6:]], lambda: kill(victim)), version=1)
        out = capsys.readouterr().out
        assert "died during the sync" in out
        assert victim not in fleet.urls and eng.weight_version == 1
        assert len(fleet.urls) == 2 and not fleet.pending  # restarted, synced, rejoined
        assert sorted(w["url"] for w in fleet.router_workers()) == sorted(fleet.urls)
        ids = probe_tokens(get_preset("tiny").vocab_size, 16)
        worst, errors = probe_check(fleet.urls, ids, teacher_forced_logprobs(ref, ids), 1e-4)
        assert not errors and worst <= 1e-4  # the survivor and the restarted one: new weights

        # killed during the flush after the weights were loaded (commit): real flush refused
        victim2, flushes = fleet.urls[0], []
        real_flush = common.flush_cache

        def flush_then_die(url, *a, **kw):
            flushes.append(url)
            if url == victim2 and flushes.count(url) == 2:  # begin's flush, then commit's
                kill(url)
            return real_flush(url, *a, **kw)

        common.flush_cache = flush_then_die
        try:
            torch.manual_seed(8)
            ref2 = build_hf_model(get_preset("tiny"))
            push_single_process(eng, [[(n, p.detach().clone())
                                       for n, p in ref2.named_parameters()]], version=2)
        finally:
            common.flush_cache = real_flush
        assert flushes.count(victim2) >= 2 and victim2 not in fleet.urls
        assert "died during the sync" in capsys.readouterr().out
        assert len(fleet.urls) == 2 and not fleet.pending and fleet.restarts == {0: 1, 1: 1}
        assert sorted(w["url"] for w in fleet.router_workers()) == sorted(fleet.urls)
        for u in fleet.urls:
            assert http_json("GET", u + "/get_model_info")["weight_version"] == "2"
        worst, errors = probe_check(fleet.urls, ids, teacher_forced_logprobs(ref2, ids), 1e-4)
        assert not errors and worst <= 1e-4
        got = eng.generate([[5, 6, 7]] * 4, SamplingParams(n=2, max_new_tokens=4), seed=1)
        assert [len(g) for g in got] == [2] * 4  # the run goes on
    finally:
        fleet.stop()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_startup_restarts_a_server_whose_port_was_taken(tmp_path, capsys):
    """Another process holds server 0's port (router_port + 1) when the fleet starts (as a
    socket given that port by the kernel between its choice and the bind would): the server
    exits with ``Address already in use``; the fleet starts it again on a free port instead of
    failing the run (the one-off ``serve`` start-up failure of the fault campaign)."""
    import socket

    s = SGLangSection(num_servers=1, router_port=free_port_block(2))
    taken = f"http://127.0.0.1:{s.router_port + 1}"
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", s.router_port + 1))
        squatter.listen()
        fleet = Fleet(s, _tiny_model_dir(tmp_path / "model"), EOS, str(tmp_path / "logs")).start()
        try:
            assert len(fleet.urls) == 1 and fleet.urls[0] != taken
            assert [w["url"] for w in fleet.router_workers()] == fleet.urls
            assert "already in use" in open(tmp_path / "logs" / "server0.log").read().lower()
            assert f"{taken} was taken by another process" in capsys.readouterr().out
        finally:
            fleet.stop()
