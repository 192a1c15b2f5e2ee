"""MoE routing replay (issue 27 item 5, docs/moe.md): the rollout engine's routed experts
(embedded engine, our ``serve`` as real SGLang returns them, the client), and the actor's
``actor.routing_replay`` r2 / r3 over megatron-core's ``RouterReplay``.

One spawned single-rank job checks the actor (R3 routes like the engine, R2's update routes like
the old pass, and without replay both differ); a slow two-rank job checks R3's layer and row
mapping under PP2 and DP2xEP2; the rest runs in-process.
"""

from __future__ import annotations

import pytest
import torch

from megatron_rl.models.config import get_preset

transformers = pytest.importorskip("transformers")

PRESET = "tiny-qwen3-moe"


def _direct_routing(model, ids: list[int]) -> torch.Tensor:
    """``[len(ids), layers, k]`` top-k ids of one plain HF forward (sorted per token)."""
    from megatron_rl.rollout.routed_experts import moe_gates

    rec: list[torch.Tensor] = []
    hooks = [g.register_forward_hook(lambda _m, _a, o: rec.append(o[2])) for g in
             moe_gates(model)]
    with torch.no_grad():
        model(input_ids=torch.tensor([ids]))
    for h in hooks:
        h.remove()
    return torch.stack(rec, 1).sort(-1).values.int()


@pytest.mark.parametrize("per_request", [False, True])
def test_engine_returns_the_routing_of_every_token(per_request):
    """Batched (left-padded) and per-request generation: one row per token run through the model
    (prompt + response - 1), int32, equal to a direct HF forward's routing; off by default."""
    from megatron_rl.rollout.embedded import EmbeddedEngine
    from megatron_rl.rollout.engine import SamplingParams

    cfg = get_preset(PRESET)
    torch.manual_seed(0)
    eng = EmbeddedEngine(cfg, eos_id=1, pad_id=0, per_request_seed=per_request,
                         return_routed_experts=True)
    out = eng.generate([[5, 6, 7, 8, 9], [10, 11]], SamplingParams(n=2, max_new_tokens=5), seed=3)
    for c in (c for g in out for c in g):
        ids = c.prompt_ids + c.response_ids
        r = c.routed_experts
        assert r.dtype == torch.int32
        assert r.shape == (len(ids) - 1, cfg.num_hidden_layers, cfg.num_experts_per_tok)
        assert torch.equal(r.sort(-1).values, _direct_routing(eng.model, ids[:-1]))
    eng.return_routed_experts = False
    (c,), _ = eng.generate([[5, 6, 7], [8]], SamplingParams(n=1, max_new_tokens=2), seed=3)
    assert c.routed_experts is None


def test_capture_records_only_its_own_thread():
    """A server runs several requests' forwards on one model: a capture ignores other threads."""
    import threading

    from megatron_rl.rollout.embedded import build_hf_model
    from megatron_rl.rollout.routed_experts import RoutingCapture

    model = build_hf_model(get_preset(PRESET))
    cap = RoutingCapture(model)
    with cap.active(), torch.no_grad():
        t = threading.Thread(target=lambda: model(input_ids=torch.tensor([[4, 5, 6]])))
        t.start()
        t.join()
        assert cap.calls == []
        model(input_ids=torch.tensor([[4, 5]]))
    assert [tuple(c.shape) for c in cap.calls] == [(2, 4, 2)]


def test_serve_returns_routed_experts_as_sglang_does():
    """``return_routed_experts`` is honoured only on a server started with
    ``--enable-return-routed-experts`` (else silently ignored, as SGLang does); the reply's
    ``meta_info.routed_experts`` is base64 int32 ``[seqlen - 1 - start, layers, k]``; a start
    beyond the prompt aborts the request; the client decodes it and refuses a reply without it."""
    from megatron_rl.rollout.routed_experts import decode
    from megatron_rl.rollout.serve import ServeState, build_model
    from megatron_rl.rollout.sglang_client import ServerError, completion_from_response

    cfg = get_preset(PRESET)
    shape = (cfg.num_hidden_layers, cfg.num_experts_per_tok)
    model, path = build_model(PRESET, None)
    prompt = [3, 4, 5, 6]
    sp = {"max_new_tokens": 4, "temperature": 1.0, "sampling_seed": 7}
    off, on = ServeState(model, path, None, 0), ServeState(model, path, None, 0,
                                                           enable_return_routed_experts=True)
    ask = {"input_ids": prompt, "sampling_params": sp, "return_routed_experts": True}
    assert "routed_experts" not in off.generate(ask)["meta_info"]
    assert "routed_experts" not in on.generate({**ask, "return_routed_experts": False})[
        "meta_info"]
    resp = on.generate(ask)
    ids = prompt + resp["output_ids"]
    full = decode(resp["meta_info"]["routed_experts"], *shape)
    assert torch.equal(full.sort(-1).values, _direct_routing(model, ids[:-1]))
    part = on.generate({**ask, "routed_experts_start_len": 2})["meta_info"]["routed_experts"]
    assert torch.equal(decode(part, *shape), full[2:])
    bad = on.generate({**ask, "routed_experts_start_len": 5})["meta_info"]
    assert bad["finish_reason"]["type"] == "abort"
    assert "routed_experts_start_len=5" in bad["finish_reason"]["message"]
    comp, _ = completion_from_response(prompt, resp, shape)
    assert torch.equal(comp.routed_experts, full)
    with pytest.raises(ServerError, match="--enable-return-routed-experts"):
        completion_from_response(prompt, off.generate(ask), shape)


def test_partial_r3_abort_at_the_last_token_keeps_routed_experts():
    """Partial rollouts on a server paused with ``abort`` (SGLang < 0.5.21): a request aborted
    exactly at ``max_new_tokens`` is not sent again; the sample keeps the routed experts of its
    aborted reply (every prompt and kept token), as a finished reply would carry them."""
    from megatron_rl.rollout.routed_experts import decode
    from megatron_rl.rollout.serve import ServeState, build_model
    from megatron_rl.rollout.sglang_client import Prefix, SGLangEngine

    cfg = get_preset(PRESET)
    shape = (cfg.num_hidden_layers, cfg.num_experts_per_tok)
    model, path = build_model(PRESET, None)
    state = ServeState(model, path, None, 0, enable_return_routed_experts=True)
    prompt = [3, 4, 5, 6]
    resp = state.generate({"input_ids": prompt, "return_logprob": True,
                           "return_routed_experts": True,
                           "sampling_params": {"max_new_tokens": 4, "temperature": 1.0,
                                               "sampling_seed": 7, "ignore_eos": True}})
    resp["meta_info"]["finish_reason"] = {"type": "abort", "message": "aborted"}  # the sync's
    eng = SGLangEngine(None, eos_id=1)
    eng.partial, eng.routed_shape = True, shape
    kept = Prefix()
    eng._keep_or_redo(kept, prompt, resp)
    assert kept.ids == resp["output_ids"] and len(kept.ids) == 4
    comp = kept.at_cap(prompt)
    full = decode(resp["meta_info"]["routed_experts"], *shape)
    assert comp.routed_experts is not None and torch.equal(comp.routed_experts, full)
    assert comp.routed_experts.shape[0] == len(prompt) + len(comp.response_ids) - 1


def test_routing_replay_config_errors():
    from megatron_rl.actor.train_step import ActorConfig, ActorConfigError
    from megatron_rl.config.errors import ConfigError
    from megatron_rl.config.load import load_config

    with pytest.raises(ActorConfigError, match=r"actor.routing_replay='r4' is not one of "
                                               r"\('none', 'r2', 'r3'\)"):
        ActorConfig(routing_replay="r4")
    with pytest.raises(ActorConfigError, match=r"actor.pack_sequences=True is not supported"):
        ActorConfig(routing_replay="r3", pack_sequences=True)
    with pytest.raises(ActorConfigError, match=r"actor.max_tokens_per_micro_batch=64 is not"):
        ActorConfig(routing_replay="r2", max_tokens_per_micro_batch=64)
    with pytest.raises(ActorConfigError, match=r"actor.recompute='full' is not supported"):
        ActorConfig(routing_replay="r2", recompute="full")
    with pytest.raises(ConfigError, match=r"actor.routing_replay='r2' needs a mixture-of-experts"):
        load_config(None, ["actor.routing_replay=r2"])
    with pytest.raises(ConfigError, match=r"is not one of"):
        load_config(None, [f"model.preset={PRESET}", "actor.routing_replay=R3"])
    assert load_config(None, [f"model.preset={PRESET}", "actor.routing_replay=r3"]
                       ).actor.routing_replay == "r3"
    with pytest.raises(ConfigError, match=r"not supported with parallel.tp=2"):
        load_config(None, [f"model.preset={PRESET}", "actor.routing_replay=r2", "parallel.tp=2",
                           "parallel.ep=2", "parallel.dp=1"])


# --- the actor (one single-rank spawn) ----------------------------------------------------------
def _router_hooks(model, calls: list) -> list:
    """Each router call appends ``{global layer: [B*S, k] sorted ids}`` entries to ``calls``."""
    hooks = []
    for layer in model.decoder.layers:
        def hook(_m, _i, out, lid=int(layer.layer_number) - 1):
            ids = out[1].nonzero()[:, 1].reshape(out[1].shape[0], -1)  # routing_map, sorted
            calls.append((lid, ids.cpu()))
        hooks.append(layer.mlp.router.register_forward_hook(hook))
    return hooks


def _as_tokens(ids: torch.Tensor, layer: int) -> torch.Tensor:
    """Batch ``[B, S, L, k]`` -> megatron's token order ``[S*B, k]`` (sorted) for ``layer``."""
    t = ids[:, :, layer, :]
    return t.transpose(0, 1).reshape(-1, t.shape[-1]).sort(-1).values.long()


def _actor_worker() -> dict:
    from megatron_rl.actor.actor import Actor
    from megatron_rl.actor.optim import OptimConfig
    from megatron_rl.actor.routing_replay import KEY
    from megatron_rl.actor.train_step import ActorConfig
    from megatron_rl.loss import LossConfig
    from megatron_rl.parallel import runtime
    from megatron_rl.rollout.collect import pad_records
    from megatron_rl.rollout.embedded import EmbeddedEngine
    from megatron_rl.rollout.engine import SamplingParams
    from megatron_rl.rollout.sync import sync_weights

    runtime.init_parallel(timeout_s=120)
    cfg = get_preset(PRESET)
    layers = range(cfg.num_hidden_layers)

    def make(mode: str) -> Actor:
        return Actor(cfg, ActorConfig(micro_batch_size=2, mini_batch_size=2,
                                      routing_replay=mode),
                     OptimConfig(lr=3e-3), LossConfig.for_algorithm("dapo"), total_steps=2, seed=5)

    # R3: an engine whose routers are perturbed routes differently from the actor
    actor = make("r3")
    engine = EmbeddedEngine(cfg, eos_id=1, pad_id=0, return_routed_experts=True)
    sync_weights(actor, engine, 64, version=0)
    with torch.no_grad():
        for i, gate in enumerate(engine.model.model.layers):
            gate.mlp.gate.weight.add_(0.05 * torch.randn(gate.mlp.gate.weight.shape,
                                                         generator=torch.Generator()
                                                         .manual_seed(i)))
    prompts = [[3, 4, 5, 6, 7], [8, 9, 10], [11, 12, 13, 14], [15, 16]]
    comps = [c for g in engine.generate(prompts, SamplingParams(n=1, max_new_tokens=6), seed=1)
             for c in g]
    records = [{"prompt_ids": c.prompt_ids, "response_ids": c.response_ids,
                "logprobs": c.logprobs, "routed_experts": c.routed_experts,
                "reward": float(i % 2), "acc": float(i % 2)} for i, c in enumerate(comps)]
    batch = pad_records(records, 0, 2)
    batch["advantages"] = torch.tensor([-1.0, 1.0, -1.0, 1.0])[:, None] * batch["mask"]
    engine_ids = batch[KEY].clone()
    valid = engine_ids[..., 0, 0] >= 0  # [N, S]: positions the engine ran
    out = {}
    for replay in (True, False):  # r3 replays; the free pass is the negative control
        calls: list = []
        hooks = _router_hooks(actor.model, calls)
        if replay:
            actor.add_old_logprobs(batch)
        else:
            actor.logprobs(batch)
        for h in hooks:
            h.remove()
        same = []
        for b0, b1 in ((0, 2), (2, 4)):  # the two micro-batches, in call order
            got = dict(calls[:cfg.num_hidden_layers])
            calls = calls[cfg.num_hidden_layers:]
            v = valid[b0:b1].transpose(0, 1).reshape(-1)
            same += [torch.equal(got[lay][v], _as_tokens(engine_ids[b0:b1], lay)[v])
                     for lay in layers]
        out["r3_replay" if replay else "r3_free"] = all(same)
    del actor
    # R2 (and none): the second mini-batch's update forward runs after an optimizer step
    for mode in ("r2", "none"):
        actor = make(mode)
        b = {k: v.clone() for k, v in batch.items() if k != KEY}
        calls = []
        hooks = _router_hooks(actor.model, calls)
        actor.add_old_logprobs(b)
        old = calls[cfg.num_hidden_layers:]  # micro-batch 2 of the old pass
        calls.clear()
        actor.update(b, 0)
        for h in hooks:
            h.remove()
        upd = calls[cfg.num_hidden_layers:]  # mini-batch 2's forward
        out[f"{mode}_same"] = all(torch.equal(a[1], u[1]) for a, u in zip(old, upd))
        if mode == "r2":  # what the old pass recorded is what its routers chose
            out["r2_recorded"] = all(torch.equal(dict(old)[lay], _as_tokens(b[KEY][2:4], lay))
                                     for lay in layers)
        del actor
    runtime.shutdown()
    return out


def test_actor_replays_engine_and_old_pass_routing():
    """R3: the old-logp pass routes every token the engine ran exactly as the engine did (its
    routers were perturbed, so free routing differs); R2: the old pass records its routing and
    the update's forward after an optimizer step routes the same (without replay it differs)."""
    from megatron_rl.parallel.launch import spawn

    (res,) = spawn(_actor_worker, 1, (), timeout_s=300)
    assert res == {"r3_replay": True, "r3_free": False, "r2_same": True, "r2_recorded": True,
                   "none_same": False}, res


def _layout_worker() -> dict:
    """R3 under PP2 and DP2xEP2: every stage replays its own (global) layers, every DP rank its
    own rows, in the old-logp pass and in the update (two micro-batches each)."""
    from megatron.core import parallel_state as ps

    from megatron_rl.actor.actor import Actor
    from megatron_rl.actor.optim import OptimConfig
    from megatron_rl.actor.routing_replay import KEY
    from megatron_rl.actor.train_step import ActorConfig
    from megatron_rl.loss import LossConfig
    from megatron_rl.parallel import runtime

    cfg = get_preset(PRESET)
    n, seq, k = 4, 12, cfg.num_experts_per_tok
    g = torch.Generator().manual_seed(0)
    full = {"tokens": torch.randint(2, cfg.vocab_size, (n, seq), generator=g),
            "mask": torch.zeros(n, seq, dtype=torch.bool),
            KEY: torch.stack([torch.randperm(cfg.num_experts, generator=g)[:k] for _ in
                              range(n * seq * cfg.num_hidden_layers)]).view(
                n, seq, cfg.num_hidden_layers, k).int()}
    full["mask"][:, 4:] = True
    full["advantages"] = torch.tensor([1.0, -1.0, 0.5, -0.5])[:, None] * full["mask"]
    out = {}
    for pp, ep in ((2, 1), (1, 2)):
        runtime.init_parallel(pp=pp, ep=ep, timeout_s=120)
        dp, r = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        per = n // dp
        batch = {key: v[r * per:(r + 1) * per].clone() for key, v in full.items()}
        actor = Actor(cfg, ActorConfig(micro_batch_size=1, routing_replay="r3"),
                      OptimConfig(lr=1e-3), LossConfig.for_algorithm("dapo"), total_steps=1,
                      seed=3)
        calls: list = []
        hooks = _router_hooks(actor.model, calls)
        actor.add_old_logprobs(batch)
        actor.update(batch, 0)
        for h in hooks:
            h.remove()
        layers = sorted({lid for lid, _ in calls})
        ok = len(calls) == 2 * per * len(layers)  # (old pass + update) x micro-batches x layers
        for c, (lid, ids) in enumerate(calls):
            row = (c // len(layers)) % per
            ok = ok and torch.equal(ids, _as_tokens(batch[KEY][row:row + 1], lid))
        out[f"pp{pp}_ep{ep}_rank{torch.distributed.get_rank()}"] = (ok, layers)
        del actor
    runtime.shutdown()
    return out


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_r3_replays_global_layers_under_pp_and_ep():
    """Two ranks, two layouts in sequence (~25 s on the shared 2-core box: slow tier)."""
    from megatron_rl.parallel.launch import spawn

    res = {k: v for r in spawn(_layout_worker, 2, (), timeout_s=300) for k, v in r.items()}
    assert res == {"pp2_ep1_rank0": (True, [0, 1]), "pp2_ep1_rank1": (True, [2, 3]),
                   "pp1_ep2_rank0": (True, [0, 1, 2, 3]),
                   "pp1_ep2_rank1": (True, [0, 1, 2, 3])}, res


def test_r3_requests_reach_the_servers_past_the_router(tmp_path):
    """sglang-router re-serialises ``/generate`` bodies and drops ``return_routed_experts``
    (checked here on the real router: when a router version keeps it, this assertion fails and
    the client may go through the router again), so with r3 the client sends each request to a
    registered server itself; every sample then carries its routing."""
    pytest.importorskip("sglang_router")
    from transformers import AutoConfig

    from megatron_rl.config.sections import SGLangSection
    from megatron_rl.convert.registry import hf_config_dict
    from megatron_rl.rollout.engine import SamplingParams
    from megatron_rl.rollout.fleet import Fleet, http_json
    from megatron_rl.rollout.sglang_client import SGLangEngine
    from megatron_rl.testing.procs import free_port_block

    cfg = get_preset(PRESET)
    fields = hf_config_dict(cfg)
    AutoConfig.for_model(fields.pop("model_type"), **fields).save_pretrained(tmp_path / "model")
    s = SGLangSection(num_servers=1, router_port=free_port_block(2),
                      extra_args=["--enable-return-routed-experts"])
    fleet = Fleet(s, str(tmp_path / "model"), 1, str(tmp_path / "logs")).start()
    try:
        ask = {"input_ids": [3, 4, 5], "sampling_params": {"max_new_tokens": 2},
               "return_routed_experts": True}
        assert "routed_experts" in http_json("POST", fleet.urls[0] + "/generate", ask)["meta_info"]
        assert "routed_experts" not in http_json("POST", fleet.router_url + "/generate",
                                                 ask)["meta_info"]
        eng = SGLangEngine(fleet, 1, concurrency=2)
        eng.routed_shape = (cfg.num_hidden_layers, cfg.num_experts_per_tok)
        groups = eng.generate([[3, 4, 5], [6, 7]], SamplingParams(n=2, max_new_tokens=3), seed=1)
        for prompt, group in zip([[3, 4, 5], [6, 7]], groups):
            for c in group:
                assert c.routed_experts.shape == (len(prompt) + len(c.response_ids) - 1,
                                                  *eng.routed_shape)
    finally:
        fleet.stop()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_r3_run_through_a_serve_fleet(tmp_path):
    """Two RL steps of the tiny MoE with r3 on two of our ``serve`` servers behind the router:
    the SFT warm start (no routing to replay), per-expert weight syncs into the servers' fused
    experts, routing fetched past the router; fp32 engine and actor then agree on every token."""
    import json
    import os

    from megatron_rl.parallel.launch import spawn
    from megatron_rl.run.serial_runs import train_each
    from megatron_rl.testing.procs import free_port_block

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "run"
    jobs = [("r3", os.path.join(root, "examples", "tiny_dapo.yaml"),
             [f"output_dir={out}", f"model.preset={PRESET}", "parallel.tp=1", "parallel.pp=1",
              "trainer.total_steps=2", "trainer.test_freq=2", "sft.steps=2", "trainer.plots=false",
              "data.val_size=8", "rollout.dynamic_sampling=false", "rollout.engine=sglang",
              "rollout.sglang.num_servers=2", f"rollout.sglang.router_port={free_port_block(3)}",
              "rollout.sglang.weight_sync=from_tensor", "actor.routing_replay=r3"])]
    res = spawn(train_each, 1, (jobs,), timeout_s=550, env={"CUDA_VISIBLE_DEVICES": ""})[0]
    assert "error" not in res["r3"], res["r3"].get("error")
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    trained = [r for r in rows if "rollout/logp_mismatch_max" in r]
    assert len(trained) == 2 and all(r["rollout/logp_mismatch_max"] < 1e-4 for r in trained)
