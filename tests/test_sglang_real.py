"""Our trainer against the real ``sglang`` package (0.5.21, in its own cached venv built by
:mod:`megatron_rl.testing.sglang_env`; built on first use). Real SGLang code runs in the venv's
python (``tests/sglang_checks.py``):

- every request body the trainer sends (recorded from a real sync and rollout against our
  ``serve``) validates with SGLang's own request types, as FastAPI validates them;
- our ``from_tensor`` payload round-trips through SGLang's serializer bit-exact;
- our ``from_distributed`` sender meets ranks that join with SGLang's own
  ``init_custom_process_group`` over gloo, and a broadcast bucket arrives bit-exact.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from megatron_rl.config.sections import SGLangSection
from megatron_rl.models.config import get_preset
from megatron_rl.rollout import sglang_client
from megatron_rl.rollout.embedded import build_hf_model
from megatron_rl.rollout.engine import SamplingParams
from megatron_rl.rollout.fleet import Fleet, http_json, wait_healthy
from megatron_rl.rollout.sglang_client import SGLangEngine
from megatron_rl.rollout.weight_sync import (
    common,
    lora_adapter,
    make_strategy,
    push_single_process,
)
from megatron_rl.rollout.weight_sync.common import (
    WeightSyncError,
    engine_probe_logprobs,
    probe_tokens,
)
from megatron_rl.rollout.weight_sync.from_distributed import free_port
from megatron_rl.rollout.weight_sync.group import join_weight_group, leave_weight_group

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHECKS = os.path.join(ROOT, "tests", "sglang_checks.py")
EOS = 1


@pytest.fixture(scope="session")
def sglang_python() -> str:
    """The real-SGLang venv's interpreter (built once, cached; ~5.5 GB, minutes)."""
    from megatron_rl.testing.sglang_env import ensure

    return str(ensure())


def venv_env() -> dict:
    """Environment of a venv subprocess: our package importable, no trainer site-packages."""
    return {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}


def _result(out: str):
    line = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
    assert line, out[-3000:]
    return line[-1][len("RESULT "):]


def _record(monkeypatch) -> list:
    """Record every request the trainer's rollout and sync code sends (then send it)."""
    sent: list = []
    real = http_json

    def recording(method, url, body=None, timeout=30.0):
        path = "/" + url.split("/", 3)[3]
        sent.append([method, path, body])
        return real(method, url, body, timeout)

    monkeypatch.setattr(common, "http_json", recording)
    monkeypatch.setattr(sglang_client, "http_json", recording)
    monkeypatch.setattr(lora_adapter, "http_json", recording)
    return sent


LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _full_adapters(rank: int) -> dict:
    """Canonical full adapter tensors of the tiny preset (what ``gather_full_adapters`` returns
    for rank-``rank`` adapters on every target), random."""
    from megatron_rl.convert.common import FC1
    from megatron_rl.convert.registry import mapping_for
    from megatron_rl.models.lora_config import LORA_TARGETS as MODULES

    cfg = get_preset("tiny")
    hf = build_hf_model(cfg).state_dict()
    g = torch.Generator().manual_seed(0)
    out = {}
    for m in mapping_for(cfg).tensor_maps(cfg):
        if not m.canonical.endswith(".weight") or m.canonical.split(".")[-2] not in MODULES:
            continue
        prefix, shapes = m.canonical[: -len(".weight")], [hf[h].shape for h in m.hf]
        out[prefix + ".lora_A"] = torch.randn(rank, shapes[0][1], generator=g)
        if m.kind == FC1:
            out[prefix + ".lora_B_gate"] = torch.randn(shapes[0][0], rank, generator=g)
            out[prefix + ".lora_B_up"] = torch.randn(shapes[1][0], rank, generator=g)
        else:
            out[prefix + ".lora_B"] = torch.randn(sum(s[0] for s in shapes), rank, generator=g)
    return out


@pytest.mark.timeout(1800)
def test_every_request_body_validates_with_sglang_types(sglang_python, tmp_path, monkeypatch):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "megatron_rl", "serve", "--preset", "tiny",
                             "--port", str(port), "--eos-id", str(EOS), "--enable-lora",
                             "--max-lora-rank", "4", "--lora-target-modules", *LORA_TARGETS],
                            env=venv_env())
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, 120, proc)
        sent = _record(monkeypatch)
        fleet = Fleet(SGLangSection(servers=[url], router_url=url), "preset:tiny", EOS,
                      str(tmp_path / "logs"))
        fleet.workers = {url: "direct"}
        eng = SGLangEngine(fleet, EOS, concurrency=2)
        torch.manual_seed(1)
        sd = [(n, p.detach().clone()) for n, p in build_hf_model(get_preset("tiny"))
              .named_parameters()]
        for strategy in ("from_disk", "from_distributed"):
            eng.sync = make_strategy(strategy, fleet, str(tmp_path / "sync"))
            push_single_process(eng, [sd[:4], sd[4:]], version=2)
        eng.sync.close()
        eng.generate([[5, 6], [7]], SamplingParams(n=2, max_new_tokens=3), seed=1,
                     stop_when=lambda i, g: True)  # /abort_request for leftovers
        engine_probe_logprobs(url, probe_tokens(256, 8))
        eng.sync.spots, eng.sync.spots_per_send = [("model.norm.weight", [1.0])], 1
        with pytest.raises(WeightSyncError):  # Qwen: 400, but the body is SGLang's
            eng.sync.spot_check()
        # adapter-only LoRA sync: our PEFT directory loaded (twice: unload + load), then
        # rollout and probe requests that name it
        from megatron_rl.models.lora_config import LoraConfig

        path = str(tmp_path / "adapter")
        lora_adapter.write_adapter(_full_adapters(4), LoraConfig(rank=4, alpha=8.0),
                                   get_preset("tiny"), path)
        for _ in range(2):
            lora_adapter.load_adapter([url], path, set())
        eng.lora_name = lora_adapter.ADAPTER_NAME
        eng.generate([[5, 6]], SamplingParams(n=1, max_new_tokens=3), seed=1)
        engine_probe_logprobs(url, probe_tokens(256, 8), eng.lora_name)
    finally:
        proc.terminate()
        proc.wait(30)
    (tmp_path / "bodies.json").write_text(json.dumps(sent))
    res = subprocess.run([sglang_python, CHECKS, "validate", str(tmp_path / "bodies.json")],
                         capture_output=True, text=True, env=venv_env(), timeout=1200)
    out = json.loads(_result(res.stdout + res.stderr))
    assert out["errors"] == []
    assert {"/generate", "/pause_generation", "/flush_cache", "/begin_weight_update",
            "/init_weights_update_group", "/update_weights_from_distributed",
            "/end_weight_update", "/update_weights_from_disk", "/update_weight_version",
            "/weights_checker", "/continue_generation", "/destroy_weights_update_group",
            "/abort_request", "/get_weights_by_name", "/load_lora_adapter",
            "/unload_lora_adapter"} <= set(out["routes"])
    # SGLang's LoRAConfig reads our adapter directory; its targets fit the server's
    assert out["lora"] == [{"r": 4, "lora_alpha": 8.0, "fits": True,
                            "targets": ["down_proj", "gate_up_proj", "o_proj", "qkv_proj"]}]
    assert out["tensor"] == {"ok": True, "load_format": "flattened_bucket",
                             "flush_cache": False}


@pytest.mark.timeout(900)
def test_sender_meets_sglang_init_custom_process_group(sglang_python, tmp_path):
    """Rank 0 is our sender (:func:`join_weight_group`); ranks 1, 2 are SGLang's own
    ``init_custom_process_group`` (as each TP rank of ``/init_weights_update_group``)."""
    g = torch.Generator().manual_seed(3)
    bucket = [("model.embed_tokens.weight", torch.randn(64, 16, generator=g)),
              ("lm_head.weight", torch.randn(64, 16, generator=g).to(torch.bfloat16)),
              ("model.norm.weight", torch.randn(16, generator=g).half())]
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps([[n, str(t.dtype).replace("torch.", ""), list(t.shape)]
                                for n, t in bucket]))
    port, world, group = free_port(), 3, "megatron_rl_stage0_g1"
    procs = [subprocess.Popen([sglang_python, CHECKS, "join", str(r), "127.0.0.1", str(port),
                               str(world), group, str(spec), str(tmp_path / f"r{r}.pt")],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=venv_env()) for r in (1, 2)]
    try:
        pg = join_weight_group("gloo", "127.0.0.1", port, world, 0, group)
        for _, t in bucket:
            pg.broadcast(t.contiguous(), 0).wait()
        leave_weight_group(pg)
        outs = [p.communicate(timeout=600)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for r, out in zip((1, 2), outs):
        assert _result(out) == "joined"
        got = torch.load(tmp_path / f"r{r}.pt")
        for n, t in bucket:
            assert got[n].dtype == t.dtype and torch.equal(got[n], t), (r, n)
