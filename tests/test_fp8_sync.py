"""``rollout.sglang.quantization: fp8`` end to end on CPU with our ``serve``: every weight sync
strategy sends the layers SGLang quantises as block FP8 + ``weight_scale_inv`` and the rest
unchanged, the server then holds exactly the dequantised weights; the probe after a sync of the
real Megatron actor compares against the FP8 expectation (the actor's weights quantised and
dequantised), so a correct FP8 sync passes and a missed one fails; the rollout log-prob
mismatch shows the FP8 gap; the config is checked at load."""

import copy
import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_rl.config.sections import SGLangSection
from megatron_rl.models.config import get_preset
from megatron_rl.rollout.embedded import build_hf_model
from megatron_rl.rollout.fleet import Fleet, http_json, wait_healthy
from megatron_rl.rollout.fp8 import fp8_round_trip, is_quantized
from megatron_rl.rollout.sampling import teacher_forced_logprobs
from megatron_rl.rollout.sglang_client import SGLangEngine
from megatron_rl.rollout.weight_sync import make_strategy, push_single_process
from megatron_rl.rollout.weight_sync.common import probe_check, probe_tokens

EOS = 1
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CFG = dataclasses.replace(get_preset("tiny"), init_method_std=0.2)  # log-probs -14..-2


def _engine(url: str, tmp: Path, strategy: str) -> SGLangEngine:
    s = SGLangSection(servers=[url], router_url=url)
    fleet = Fleet(s, "preset:tiny", EOS, str(tmp / "logs"))
    fleet.workers = {url: "direct"}  # no router: requests go to the server
    eng = SGLangEngine(fleet, EOS, concurrency=2)
    eng.sync = make_strategy(strategy, fleet, str(tmp / "sync"))
    eng.sync.quantization = "fp8"
    return eng


def _fp8_model(model: torch.nn.Module) -> torch.nn.Module:
    """What an FP8 server computes with: the quantised layers round-tripped."""
    out = copy.deepcopy(model)
    with torch.no_grad():
        for n, p in out.named_parameters():
            if is_quantized(n):
                p.copy_(fp8_round_trip(p))
    return out


def _checksum(model: torch.nn.Module) -> str:
    """What ``serve``'s ``/weights_checker`` hashes: every parameter's name and bytes."""
    import hashlib

    h = hashlib.sha256()
    for name, p in sorted(model.named_parameters()):
        h.update(name.encode())
        h.update(p.detach().contiguous().reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def test_every_strategy_sends_fp8_and_the_server_holds_the_round_trip(tmp_path):
    """One ``serve`` process; from_disk, from_tensor (process_vm_readv) and from_distributed
    (gloo: FP8 travels as its bytes) each send the quantised layers as FP8 + scales (about half
    of bf16's bytes) and the rest as sent; the server then holds bit for bit the round-tripped
    weights (checksum); its probe log-probs equal the FP8 expectation's (fp32 on both sides) and
    differ from the unquantised model's by the FP8 gap; the quantisation time is reported as
    ``time/weight_quant``."""
    from megatron_rl.rollout.weight_sync.from_distributed import free_port

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "megatron_rl", "serve", "--preset", "tiny",
                             "--port", str(port), "--eos-id", str(EOS)],
                            env={**os.environ, "PYTHONPATH": ROOT})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, 120, proc)
        for seed, strategy in enumerate(["from_disk", "from_tensor", "from_distributed"]):
            eng = _engine(url, tmp_path, strategy)
            model, sd = _bf16_model(seed)
            try:
                summary = push_single_process(eng, [sd[i:i + 6] for i in range(0, len(sd), 6)],
                                              version=seed + 1)
            finally:
                getattr(eng.sync, "close", lambda: None)()
            want = _fp8_model(model)
            got = http_json("POST", url + "/weights_checker", {"action": "checksum"})
            assert got["per_engine_checksum"] == _checksum(want), strategy
            m = eng.pop_metrics()
            assert m["time/weight_quant"] > 0.0, m
            q_bf16 = sum(t.numel() * 2 for n, t in sd if is_quantized(n))
            rest = sum(t.numel() * 4 for n, t in sd if not is_quantized(n))
            q_sent = m["rollout/weight_sync_bytes"] - rest
            assert q_sent <= 0.55 * q_bf16 and f"{int(m['rollout/weight_sync_bytes'])} bytes" \
                in summary, (strategy, q_sent / q_bf16)
        ids = probe_tokens(CFG.vocab_size, 32)
        gap, errors = probe_check([url], ids, teacher_forced_logprobs(want, ids), 1e-4)
        assert not errors, errors
        fp8_gap, _ = probe_check([url], ids, teacher_forced_logprobs(model, ids), 1e-4)
        assert fp8_gap > 100 * max(gap, 1e-6), (gap, fp8_gap)
    finally:
        proc.terminate()
        proc.wait(30)


def _bf16_model(seed: int) -> tuple[torch.nn.Module, list]:
    """A tiny model with bf16-representable fp32 weights (a bf16 actor's) and its HF tensors."""
    torch.manual_seed(seed)
    model = build_hf_model(CFG)
    sd = [(n, p.detach().to(torch.bfloat16).float()) for n, p in model.named_parameters()]
    with torch.no_grad():
        for (_, p), (_, t) in zip(model.named_parameters(), sd):
            p.copy_(t)
    return model, sd


def test_shared_memory_bucket_with_fp8_is_dequantised_on_load():
    """The ``from_tensor`` shared-memory fallback's receiver (``read_shm_into``) pairs each FP8
    weight with its scale out of the mapped bucket and loads the round trip; the other tensors
    are copied as they are."""
    from megatron_rl.rollout.fp8 import quantize_bucket
    from megatron_rl.rollout.serve import read_shm_into
    from megatron_rl.rollout.weight_sync.from_tensor import write_shm

    model, sd = _bf16_model(3)
    served = build_hf_model(CFG)
    path, _, meta = write_shm(quantize_bucket(sd))
    try:
        n = read_shm_into(served, {"path": path, "nbytes": os.path.getsize(path),
                                   "tensors": meta})
    finally:
        os.remove(path)
    assert n == len(sd) + sum(is_quantized(k) for k, _ in sd)
    assert _checksum(served) == _checksum(_fp8_model(model))


def _sync_fleet_fp8_worker(sync_dir: str, precision: str = "fp32") -> dict:
    """One rank: the tiny Megatron actor (``precision``: fp32 on CPU, bf16 on a GPU) synced by
    :func:`sync_fleet` to our ``serve`` (fp32, CPU) with FP8 (from_disk, the probe tolerance of
    the actor's precision): a correct sync; the actor moves and a sync whose server loads nothing
    (missed); one that sends the weights unquantised; a correct one again. Errors and metrics of
    each."""
    from conftest import serve_tiny
    from test_actor_layout import loss_config

    from megatron_rl.actor.actor import Actor
    from megatron_rl.actor.optim import OptimConfig
    from megatron_rl.actor.train_step import ActorConfig
    from megatron_rl.parallel import runtime
    from megatron_rl.rollout.sglang_client import default_probe_tolerance
    from megatron_rl.rollout.weight_sync.common import SyncStrategy, WeightSyncError
    from megatron_rl.rollout.weight_sync.megatron_sync import fleet_plan, sync_fleet

    runtime.init_parallel(tp=1, pp=1, timeout_s=120)
    actor = Actor(CFG, ActorConfig(micro_batch_size=1, precision=precision),
                  OptimConfig(lr=1e-3), loss_config(), total_steps=1, seed=7)
    out: dict = {"device": str(next(actor.model.parameters()).device)}
    with serve_tiny() as (url, state):
        eng = _engine(url, Path(sync_dir), "from_disk")
        eng.probe_length = 32
        eng.probe_tolerance = out["tol"] = default_probe_tolerance(precision, "fp32")
        load, wire = state.update_from_disk, SyncStrategy.wire_buckets

        def attempt(key: str, version: int) -> None:
            try:
                out[key] = sync_fleet(actor, eng, fleet_plan(eng), 1, version=version)
            except WeightSyncError as exc:
                out[key] = f"error: {exc}"
            out[key + "_metrics"] = eng.pop_metrics()

        attempt("correct", 1)
        with torch.no_grad():  # the actor moves (an optimizer step)
            for p in actor.model.parameters():
                p.add_(torch.randn_like(p) * 0.02)
        state.update_from_disk = lambda req: {"success": True, "message": "nothing loaded"}
        attempt("missed", 2)
        state.update_from_disk = load
        SyncStrategy.wire_buckets = lambda self, buckets: buckets  # bf16/fp32 sent, not FP8
        attempt("unquantised", 3)
        SyncStrategy.wire_buckets = wire
        before = [p.detach().clone() for p in actor.model.parameters()]
        attempt("correct_again", 4)
        out["restored"] = all(torch.equal(a, b.detach()) for a, b in  # after the FP8 probe
                              zip(before, actor.model.parameters()))
    runtime.shutdown()
    return out


def test_probe_expects_fp8_weights_passes_a_correct_sync_and_fails_missed_ones(tmp_path):
    """Through the trainer's sync (:func:`sync_fleet`, the real Megatron actor, FP8): the probe
    compares the server with the actor's weights quantised and dequantised, so a correct FP8
    sync passes at the fp32 tolerance (and the actor's own weights are back after the probe),
    a sync the server did not load fails, and so does one that sent unquantised weights (the
    FP8 gap is far over the tolerance); ``time/weight_quant`` is logged."""
    from megatron_rl.parallel.launch import spawn

    (res,) = spawn(_sync_fleet_fp8_worker, 1, (str(tmp_path),), timeout_s=300)
    _check_fp8_syncs(res)


def _check_fp8_syncs(res: dict) -> None:
    for key in ("correct", "correct_again"):
        assert not res[key].startswith("error"), res[key]
        m = res[key + "_metrics"]
        assert m["rollout/weight_sync_probe_gap"] <= res["tol"], m
        assert m["time/weight_quant"] > 0, m
    for key in ("missed", "unquantised"):
        assert "probe log-probs differ from the actor's" in res[key], (key, res[key])
    assert res["restored"]


@pytest.mark.gpu
def test_fp8_sync_of_a_bf16_cuda_actor(tmp_path):
    """The same on one GPU: a bf16 actor on CUDA quantises its buckets there and runs the FP8
    probe expectation there (our ``serve`` on the CPU receives them); the bf16 tolerance passes
    the correct syncs and fails the missed and the unquantised one. Real SGLang is not on the
    GPU test machine: the SGLang FP8 end to end (tokens/s FP8 vs bf16) is a campaign run."""
    from megatron_rl.parallel.launch import spawn

    (res,) = spawn(_sync_fleet_fp8_worker, 1, (str(tmp_path), "bf16"), timeout_s=600)
    print("FP8 probe gaps:", {k: res[k + "_metrics"].get("rollout/weight_sync_probe_gap")
                              for k in ("correct", "correct_again")})
    assert res["device"].startswith("cuda"), res
    _check_fp8_syncs(res)


def test_config_is_checked_at_load_and_the_fleet_serves_a_block_fp8_dir(tmp_path):
    """``rollout.sglang.quantization``/``fp8_scale_fmt`` values and a contradicting
    ``--quantization`` in ``extra_args`` are refused at load; FP8 without a rollout correction
    gets the load-time note; the servers' model dir has SGLang's ``quantization_config`` and
    SGLang servers get ``--quantization fp8`` (+ a dummy first load where the given model dir
    holds bf16 weights)."""
    import json

    from megatron_rl.config.errors import ConfigError
    from megatron_rl.config.load import load_config
    from megatron_rl.config.validate import fp8_correction_note, validate_sglang_section
    from megatron_rl.rollout.sglang_client import fp8_fleet

    for bad, needle in ((dict(quantization="fp4"), "rollout.sglang.quantization='fp4'"),
                        (dict(quantization="fp8", fp8_scale_fmt="e8m0"), "fp8_scale_fmt"),
                        (dict(extra_args=["--quantization", "fp8"]), "--quantization fp8")):
        with pytest.raises(ConfigError, match=needle):
            validate_sglang_section(SGLangSection(**bad))
    validate_sglang_section(SGLangSection(quantization="fp8",
                                          extra_args=["--quantization=fp8"]))
    cfg = load_config("examples/tiny_dapo_fp8.yaml", [])
    assert cfg.rollout.sglang.quantization == "fp8" and fp8_correction_note(cfg) is None
    cfg = load_config("examples/tiny_dapo_fp8.yaml", ["loss.rollout_correction=none"])
    assert "rollout_correction=icepop" in fp8_correction_note(cfg)

    src = tmp_path / "hf"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    (src / "model.safetensors").write_bytes(b"")
    s, path = fp8_fleet(SGLangSection(launcher="sglang", quantization="fp8",
                                      fp8_scale_fmt="ue8m0"), str(src), str(tmp_path / "fp8"))
    conf = json.loads((Path(path) / "config.json").read_text())
    assert conf["model_type"] == "qwen2" and conf["quantization_config"] == {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
        "weight_block_size": [128, 128], "scale_fmt": "ue8m0"}
    assert s.extra_args == ["--quantization", "fp8", "--load-format", "dummy"]
    s, _ = fp8_fleet(SGLangSection(quantization="fp8", extra_args=["--threads", "1"]),
                     str(src), str(tmp_path / "fp8b"))
    assert s.extra_args == ["--threads", "1"]  # our serve: no SGLang flags


def test_planner_prices_fp8_rollout_weights_and_the_kv_cache_dtype():
    """The planner's server GPU with FP8 rollouts: the quantised matrices at 1 byte + one
    float32 scale per 128x128 block, embeddings / head / norms in bf16 (Qwen2.5-7B by hand);
    the KV cache follows the servers' ``--kv-cache-dtype`` (fp8: half), not the weights; both
    read from the config."""
    from megatron_rl.plan.inputs import PlanInputs, inputs_from_config
    from megatron_rl.plan.memory import server_breakdown, total_params

    m = get_preset("qwen2.5-7b")
    x = PlanInputs(model=m, servers=2, server_tp=2, responses_per_step=64)
    bf16 = server_breakdown(x)
    fp8 = server_breakdown(dataclasses.replace(x, server_quantization="fp8"))
    h, f, d, n = m.hidden_size, m.intermediate_size, m.kv_channels, m.num_hidden_layers
    quant = n * (h * (m.num_attention_heads + 2 * m.num_key_value_heads) * d
                 + m.num_attention_heads * d * h + 3 * h * f)
    want = (quant * (1 + 4 / 128**2) + (total_params(m) - quant) * 2) / 2
    assert fp8["weights"] == pytest.approx(want) and bf16["weights"] == total_params(m)
    assert fp8["weights_dtype"] == "fp8" and 0.5 < fp8["weights"] / bf16["weights"] < 0.6
    assert fp8["kv_per_token"] == bf16["kv_per_token"] and fp8["kv_pool"] > bf16["kv_pool"]
    kv8 = server_breakdown(dataclasses.replace(x, kv_cache_dtype="fp8_e4m3"))
    assert kv8["kv_per_token"] == bf16["kv_per_token"] / 2

    from megatron_rl.config.load import load_config

    cfg = load_config("examples/tiny_dapo_fp8.yaml",
                      ["rollout.sglang.extra_args=[--kv-cache-dtype, fp8_e5m2]"])
    got = inputs_from_config(cfg)
    assert got.server_quantization == "fp8" and got.kv_cache_dtype == "fp8_e5m2"
