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
    """One ``serve`` process; from_disk, from_tensor (process_vm_readv and shared memory) and
    from_distributed (gloo: FP8 travels as its bytes) each send the quantised layers as FP8 +
    scales (about half of bf16's bytes) and the rest as sent; the server then holds bit for bit
    the round-tripped weights (checksum), its probe log-probs equal the FP8 expectation's
    (fp32 on both sides) and differ from the unquantised model's by the FP8 gap; the
    quantisation time is reported as ``time/weight_quant``."""
    from megatron_rl.rollout.weight_sync.from_distributed import free_port

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "megatron_rl", "serve", "--preset", "tiny",
                             "--port", str(port), "--eos-id", str(EOS)],
                            env={**os.environ, "PYTHONPATH": ROOT})
    url = f"http://127.0.0.1:{port}"
    ids = probe_tokens(CFG.vocab_size, 32)
    try:
        wait_healthy(url, 120, proc)
        for seed, strategy in enumerate(["from_disk", "from_tensor", "from_tensor/shm",
                                         "from_distributed"]):
            name, _, transport = strategy.partition("/")
            eng = _engine(url, tmp_path, name)
            if transport:
                eng.sync.transport = transport
            torch.manual_seed(seed)
            model = build_hf_model(CFG)
            sd = [(n, p.detach().to(torch.bfloat16).float()) for n, p in model.named_parameters()]
            with torch.no_grad():  # bf16-representable weights, as a bf16 actor's
                for (_, p), (_, t) in zip(model.named_parameters(), sd):
                    p.copy_(t)
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
            gap, errors = probe_check([url], ids, teacher_forced_logprobs(want, ids), 1e-4)
            assert not errors, (strategy, errors)
            fp8_gap, _ = probe_check([url], ids, teacher_forced_logprobs(model, ids), 1e-4)
            assert fp8_gap > 100 * max(gap, 1e-6), (strategy, gap, fp8_gap)
    finally:
        proc.terminate()
        proc.wait(30)
