"""Adapter-only LoRA weight sync (``actor.lora.sync: adapter``): our ``serve`` follows SGLang
0.5.21's LoRA endpoints (``/load_lora_adapter``, ``/unload_lora_adapter``, generate's
``lora_path``) and computes what the real ``peft`` package computes; the trainer's adapter sync
gives the same rollout log-probs as merged sync and sends about the adapter's bytes."""

import json
import os
import threading

import pytest
import torch

from megatron_rl.models.config import get_preset
from megatron_rl.rollout.embedded import build_hf_model
from megatron_rl.rollout.fleet import ServerError, http_json
from megatron_rl.rollout.serve import ServeState, make_server
from megatron_rl.rollout.serve_lora import NOT_ENABLED, ServedLora
from megatron_rl.rollout.weight_sync.common import engine_probe_logprobs, probe_tokens

EOS = 1
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _serve(model, lora: bool, max_rank: int = 8):
    state = ServeState(model, "preset:tiny", EOS, 0,
                       lora=ServedLora(model, lora, max_rank if lora else None,
                                       TARGETS if lora else None))
    srv = make_server(state, "127.0.0.1", 0)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{state.port}", srv


def _peft_dir(model, path: str, rank: int, seed: int, targets=("q_proj", "v_proj", "down_proj")):
    """A PEFT adapter with non-zero B (real ``peft``) on a copy of ``model``; returns the PEFT
    model (for reference log-probs)."""
    import copy

    import peft

    torch.manual_seed(seed)
    conf = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(targets),
                           init_lora_weights=False)
    pm = peft.get_peft_model(copy.deepcopy(model), conf).eval()
    pm.save_pretrained(path)
    return pm


def _tf_logp(model, ids: list[int]) -> list[float]:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].float()
    lp = torch.log_softmax(logits, -1)[:-1].gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    return lp.tolist()


def test_serve_lora_endpoints_follow_sglang_and_match_peft(tmp_path):
    torch.manual_seed(0)
    base = build_hf_model(get_preset("tiny")).eval()
    ids = probe_tokens(get_preset("tiny").vocab_size, 12)
    pm = _peft_dir(base, str(tmp_path / "a"), 4, 1)
    import shutil

    shutil.copytree(tmp_path / "a", tmp_path / "big")  # rank 16: over --max-lora-rank 8
    conf = json.loads((tmp_path / "big" / "adapter_config.json").read_text())
    (tmp_path / "big" / "adapter_config.json").write_text(json.dumps({**conf, "r": 16}))
    plain, srv0 = _serve(base, False)
    url, srv1 = _serve(base, True)
    try:
        # a server started without --enable-lora refuses LoRA (SGLang's messages, HTTP 400)
        with pytest.raises(ServerError, match="400") as e:
            http_json("POST", plain + "/load_lora_adapter",
                      {"lora_name": "a", "lora_path": str(tmp_path / "a")})
        assert json.loads(str(e.value).split("HTTP 400: ", 1)[1]) == {
            "success": False, "error_message": NOT_ENABLED, "loaded_adapters": None}
        with pytest.raises(ServerError, match="400.*LoRA is not enabled"):
            http_json("POST", plain + "/unload_lora_adapter", {"lora_name": "a"})
        with pytest.raises(ServerError, match="400.*but LoRA is not enabled"):
            engine_probe_logprobs(plain, ids, "a")
        assert http_json("GET", plain + "/server_info")["enable_lora"] is False
        assert http_json("GET", url + "/server_info")["enable_lora"] is True
        # a name never loaded; then a load, a second load of the name, a rank too large
        with pytest.raises(ServerError, match="400.*never been loaded: a"):
            engine_probe_logprobs(url, ids, "a")
        reply = http_json("POST", url + "/load_lora_adapter",
                          {"lora_name": "a", "lora_path": str(tmp_path / "a")})
        assert reply == {"success": True, "error_message": "",
                         "loaded_adapters": {"a": str(tmp_path / "a")}}
        with pytest.raises(ServerError, match="400.*Failed to load LoRA adapter a because it "
                                              "is already loaded"):
            http_json("POST", url + "/load_lora_adapter",
                      {"lora_name": "a", "lora_path": str(tmp_path / "a")})
        with pytest.raises(ServerError, match="400.*with rank 16 is incompatible"):
            http_json("POST", url + "/load_lora_adapter",
                      {"lora_name": "b", "lora_path": str(tmp_path / "big")})
        # with the adapter: peft's log-probs; without: the base model's (unchanged)
        with_a = engine_probe_logprobs(url, ids, "a")
        assert with_a == pytest.approx(_tf_logp(pm, ids), abs=1e-5)
        assert engine_probe_logprobs(url, ids) == pytest.approx(_tf_logp(base, ids), abs=1e-5)
        assert max(abs(x - y) for x, y in zip(with_a, _tf_logp(base, ids))) > 1e-3
        # unload; a second unload is refused; a request naming it loads it again from its path
        http_json("POST", url + "/unload_lora_adapter", {"lora_name": "a"})
        with pytest.raises(ServerError, match="400.*LoRA with name a does not exist"):
            http_json("POST", url + "/unload_lora_adapter", {"lora_name": "a"})
        assert engine_probe_logprobs(url, ids, "a") == pytest.approx(with_a, abs=1e-6)
    finally:
        srv0.shutdown()
        srv1.shutdown()


# ---- the trainer's sync (the real Megatron actor, one rank) ------------------------------------
def _engine(url: str, tmp: str, adapter: bool):
    from megatron_rl.config.sections import SGLangSection
    from megatron_rl.rollout.fleet import Fleet
    from megatron_rl.rollout.sglang_client import SGLangEngine
    from megatron_rl.rollout.weight_sync import make_strategy

    fleet = Fleet(SGLangSection(servers=[url], router_url=url), "preset:tiny", EOS, tmp)
    fleet.workers = {url: "direct"}  # no router: requests go to the server
    eng = SGLangEngine(fleet, EOS, concurrency=2)
    eng.sync = make_strategy("from_disk", fleet, os.path.join(tmp, "sync"))
    eng.adapter_sync = eng.sync.adapter_sync = adapter
    eng.probe_length, eng.probe_tolerance = 24, 1e-4
    return eng


def _rollout(eng) -> list:
    from megatron_rl.rollout.engine import SamplingParams

    groups = eng.generate([[5, 6, 7], [9, 10]], SamplingParams(n=2, max_new_tokens=6), seed=3)
    return [(c.response_ids, c.logprobs) for g in groups for c in g]


def _adapter_sync_worker(root: str) -> dict:
    """Merged sync to one server, adapter-only sync to another (started with LoRA); rollouts from
    both after each of two syncs (the adapters move between them); adapter-only sync to the
    first server (no LoRA)."""
    from test_actor_layout import loss_config

    from megatron_rl.actor.actor import Actor
    from megatron_rl.actor.optim import OptimConfig
    from megatron_rl.actor.train_step import ActorConfig
    from megatron_rl.models.lora import adapter_params
    from megatron_rl.models.lora_config import LoraConfig
    from megatron_rl.parallel import runtime
    from megatron_rl.rollout.weight_sync.common import WeightSyncError
    from megatron_rl.rollout.weight_sync.lora_adapter import adapter_dir
    from megatron_rl.rollout.weight_sync.megatron_sync import fleet_plan, sync_fleet

    runtime.init_parallel(tp=1, pp=1, timeout_s=120)
    actor = Actor(get_preset("tiny"), ActorConfig(micro_batch_size=1,
                                                  lora=LoraConfig(rank=4, alpha=8.0)),
                  OptimConfig(lr=1e-3), loss_config(), total_steps=1, seed=7)
    out: dict = {"syncs": []}
    torch.manual_seed(1)
    servers = [_serve(build_hf_model(get_preset("tiny")), lora) for lora in (False, True)]
    merged, adapter, plain = (_engine(servers[i][0], os.path.join(root, k), a) for i, k, a in
                              ((0, "m", False), (1, "a", True), (0, "p", True)))
    try:
        for version in (1, 2):
            with torch.no_grad():  # trained adapters: B moves away from 0 between syncs
                for name, p, _ in adapter_params(actor.model):
                    if ".lora_B" in name:
                        p.add_(torch.randn_like(p) * 0.05)
            rec = {}
            for key, eng in (("merged", merged), ("adapter", adapter)):
                rec[key] = sync_fleet(actor, eng, fleet_plan(eng), 1, version=version)
                rec[key + "_bytes"] = eng.pop_metrics()["rollout/weight_sync_bytes"]
                rec[key + "_rollout"] = _rollout(eng)
            path = os.path.join(adapter_dir(os.path.join(root, "a", "sync"), version),
                                "adapter_model.safetensors")
            from safetensors.torch import load_file

            rec["adapter_file_bytes"] = sum(t.numel() * t.element_size()
                                            for t in load_file(path).values())
            rec["lora_path"] = adapter.lora_name
            out["syncs"].append(rec)
        try:
            sync_fleet(actor, plain, fleet_plan(plain), 1, version=1)
            out["plain"] = "no error"
        except WeightSyncError as exc:
            out["plain"] = str(exc)
    finally:
        for _, srv in servers:
            srv.shutdown()
    out["adapter_numel"] = sum(p.numel() for _, p, _ in adapter_params(actor.model))
    out["base_bytes"] = sum(p.numel() * p.element_size() for n, p in
                            actor.model.named_parameters() if ".lora_" not in n)
    runtime.shutdown()
    return out


@pytest.fixture(scope="module")
def adapter_syncs(tmp_path_factory) -> dict:
    from megatron_rl.parallel.launch import spawn

    root = tmp_path_factory.mktemp("lora_sync")
    return spawn(_adapter_sync_worker, 1, (str(root),), timeout_s=300)[0]


def test_lora_adapter_sync_gives_the_rollouts_of_merged_sync(adapter_syncs):
    """Same seeds, same tokens and log-probs (fp32: summation order only) from a server with the
    merged weights and one with the base + the loaded adapter; the probe passed on both."""
    for rec in adapter_syncs["syncs"]:
        assert rec["lora_path"] == "megatron_rl_policy"
        for (ids_m, lp_m), (ids_a, lp_a) in zip(rec["merged_rollout"], rec["adapter_rollout"],
                                                strict=True):
            assert ids_m == ids_a
            assert lp_a == pytest.approx(lp_m, abs=1e-5)
    first, second = adapter_syncs["syncs"]
    assert first["merged_rollout"] != second["merged_rollout"]  # the adapters moved


def test_lora_adapter_sync_sends_the_adapter_bytes(adapter_syncs):
    """``rollout/weight_sync_bytes``: the first sync sends the base weights (adapters off) and
    the adapter, later ones the adapter only; merged sync sends the full model every time."""
    first, second = adapter_syncs["syncs"]
    base = adapter_syncs["base_bytes"]
    assert first["merged_bytes"] == second["merged_bytes"] == base
    assert first["adapter_bytes"] == base + first["adapter_file_bytes"]
    assert second["adapter_bytes"] == second["adapter_file_bytes"]
    # PEFT's split modules repeat the fused QKV/fc1 A per HF module: at most 4x the adapter
    assert 4 * adapter_syncs["adapter_numel"] * 4 >= second["adapter_bytes"] \
        >= adapter_syncs["adapter_numel"] * 4
    assert second["adapter_bytes"] < base / 5


def test_lora_adapter_sync_names_a_server_without_lora(adapter_syncs):
    assert "was not started with LoRA enabled" in adapter_syncs["plain"]
    assert "--enable-lora" in adapter_syncs["plain"]


# ---- configuration and server arguments ---------------------------------------------------------
@pytest.mark.parametrize("overrides, message", [
    (["actor.lora.sync=adapter"], "actor.lora cannot be combined with rollout.engine=embedded"),
    (["actor.lora.sync=both"], "actor.lora.sync"),
    (["actor.lora.sync=adapter", "rollout.engine=sglang", "rollout.sglang.quantization=fp8"],
     "actor.lora cannot be combined with rollout.sglang.quantization=fp8"),
])
def test_lora_sync_config_errors_name_the_option(overrides, message):
    from megatron_rl.config.errors import ConfigError
    from megatron_rl.config.load import load_config

    with pytest.raises(ConfigError) as exc:
        load_config(None, ["actor.lora.rank=4", *overrides])
    assert message in str(exc.value)


@pytest.mark.parametrize("launcher", ["serve", "sglang"])
def test_lora_adapter_sync_starts_servers_with_sglang_lora_args(launcher):
    """Servers the fleet starts get ``--enable-lora --max-lora-rank R --lora-target-modules``
    (the HF modules of the adapters); our ``serve`` parses them as SGLang does."""
    import dataclasses

    from megatron_rl.cli.app import build_parser
    from megatron_rl.config.load import load_config
    from megatron_rl.rollout.fleet import server_command
    from megatron_rl.rollout.sglang_client import lora_fleet

    cfg = load_config(None, ["actor.lora.rank=4", "actor.lora.sync=adapter",
                             "actor.lora.targets=[linear_qkv,linear_fc2]", "rollout.engine=sglang",
                             f"rollout.sglang.launcher={launcher}"])
    s = lora_fleet(cfg.rollout.sglang, cfg)
    cmd = server_command(s, 30000, "/m", EOS)
    i = cmd.index("--enable-lora")
    assert cmd[i:] == ["--enable-lora", "--max-lora-rank", "4", "--lora-target-modules",
                       "down_proj", "k_proj", "q_proj", "v_proj"]
    assert lora_fleet(dataclasses.replace(s, extra_args=["--enable-lora"]), cfg).extra_args \
        == ["--enable-lora"]  # the user's own LoRA arguments are kept
    if launcher == "serve":
        args = build_parser().parse_args(cmd[3:])  # after "python -m megatron_rl"
        assert (args.enable_lora, args.max_lora_rank, args.lora_target_modules) == \
            (True, 4, ["down_proj", "k_proj", "q_proj", "v_proj"])


def test_lora_adapter_sync_pauses_in_abort_mode():
    """A retracted request keeps the adapter it started with and SGLang's unload waits for it:
    adapter-only sync pauses in ``abort`` mode even where partial rollouts would retract."""
    from megatron_rl.rollout.weight_sync.common import SyncStrategy

    s = SyncStrategy(["http://127.0.0.1:9"], "/nonexistent")
    s.partial, s.pause_modes["http://127.0.0.1:9"] = True, "retract"  # an SGLang 0.5.21 server
    assert s.pause_mode("http://127.0.0.1:9") == "retract"
    s.adapter_sync = True
    assert s.pause_mode("http://127.0.0.1:9") == "abort"
