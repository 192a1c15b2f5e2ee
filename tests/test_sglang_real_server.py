"""A real SGLang 0.5.21 server on CPU (transformers backend, its own cached venv) behind the real
``sglang-router``, driven by our fleet end to end: generation with log-probs, weight versions,
``from_disk`` and ``from_distributed`` (gloo, inside a weight-update session) syncs verified by
the probe, pause -> flush -> continue, a server killed mid-rollout, and a short RL run with
``rollout.engine: sglang`` that reports ``rollout/logp_mismatch``. One server is shared by the
module's tests (start-up takes ~25 s on an idle machine, 3 GB RSS)."""

import json
import os
import signal
import subprocess
import sys
import threading

import psutil
import pytest
import torch

pytest.importorskip("sglang_router")

from megatron_rl.config.sections import SGLangSection  # noqa: E402
from megatron_rl.models.config import get_preset  # noqa: E402
from megatron_rl.rollout.embedded import build_hf_model  # noqa: E402
from megatron_rl.rollout.engine import SamplingParams  # noqa: E402
from megatron_rl.rollout.fleet import Fleet, http_json  # noqa: E402
from megatron_rl.rollout.sampling import teacher_forced_logprobs  # noqa: E402
from megatron_rl.rollout.sglang_client import SGLangEngine  # noqa: E402
from megatron_rl.rollout.weight_sync import make_strategy, push_single_process  # noqa: E402
from megatron_rl.rollout.weight_sync.common import (  # noqa: E402
    flush_all,
    probe_check,
    probe_tokens,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EOS = 1
TOL = 1e-2  # fp32 weights on CPU; SGLang's torch_native attention (measured gap ~3e-3 with an
#   fp16 KV cache) vs transformers' eager
# the shared README's measured CPU recipe (no tokenizer; random weights until the first sync)
CPU_ARGS = ["--device", "cpu", "--attention-backend", "torch_native", "--disable-cuda-graph",
            "--max-total-tokens", "8192", "--model-impl", "transformers", "--load-format",
            "dummy", "--dtype", "float32"]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]


@pytest.fixture(scope="module")
def sglang_python() -> str:
    from megatron_rl.testing.sglang_env import ensure

    return str(ensure())


def _model_dir(path) -> str:
    from transformers import AutoConfig

    from megatron_rl.convert.registry import hf_config_dict

    fields = hf_config_dict(get_preset("tiny"))
    AutoConfig.for_model(fields.pop("model_type"), **fields).save_pretrained(str(path))
    return str(path)


@pytest.fixture(scope="module")
def fleet(sglang_python, tmp_path_factory):
    from test_sglang_fleet import free_port_block

    tmp = tmp_path_factory.mktemp("real_sglang")
    s = SGLangSection(launcher="sglang", python=sglang_python, num_servers=1,
                      router_port=free_port_block(2), mem_fraction_static=0.2,
                      extra_args=list(CPU_ARGS))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    f = Fleet(s, _model_dir(tmp / "model"), EOS, str(tmp / "logs"), startup_timeout_s=900)
    try:
        f.start()
    except Exception:
        for name in os.listdir(tmp / "logs"):
            print(name, open(tmp / "logs" / name).read()[-3000:])
        f.stop()
        raise
    yield f, tmp
    f.stop()


def _ref(seed: int):
    torch.manual_seed(seed)
    m = build_hf_model(get_preset("tiny"))
    return m, [(n, p.detach().clone()) for n, p in m.named_parameters()]


def _engine(f, tmp, strategy: str) -> SGLangEngine:
    eng = SGLangEngine(f, EOS, concurrency=4)
    eng.sync = make_strategy(strategy, f, str(tmp / "sync"))
    return eng


def test_generate_logprobs_versions_and_from_disk(fleet):
    f, tmp = fleet
    eng = _engine(f, tmp, "from_disk")
    ref, sd = _ref(11)
    push_single_process(eng, [sd[:5], sd[5:]], version=1)
    ids = probe_tokens(get_preset("tiny").vocab_size, 16)
    worst, errors = probe_check(f.urls, ids, teacher_forced_logprobs(ref, ids), TOL)
    assert not errors, errors
    out = eng.generate([[5, 6, 7], [9]], SamplingParams(n=2, max_new_tokens=6), seed=3)
    for prompt, group in zip([[5, 6, 7], [9]], out):
        for c in group:  # the engine's log-probs are the reference model's (temperature 1)
            want = teacher_forced_logprobs(ref, prompt + c.response_ids)[len(prompt) - 1:]
            assert c.logprobs == pytest.approx(want, abs=TOL)
    assert eng.pop_metrics()["rollout/offpolicy_lag"] == 0.0
    reply = http_json("POST", f.urls[0] + "/generate", {
        "input_ids": [3], "sampling_params": {"max_new_tokens": 1}})
    assert reply["meta_info"]["weight_version"] == "1"


def test_from_distributed_inside_a_session(fleet):
    f, tmp = fleet
    eng = _engine(f, tmp, "from_distributed")
    ref, sd = _ref(12)
    push_single_process(eng, [sd[:7], sd[7:]], version=2)
    assert not eng.sync.sessions and f.urls[0] not in eng.sync.no_session  # 0.5.21: sessions
    ids = probe_tokens(get_preset("tiny").vocab_size, 16)
    worst, errors = probe_check(f.urls, ids, teacher_forced_logprobs(ref, ids), TOL)
    assert not errors, errors
    # the real server refuses an update outside the session
    body = {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[128]],
            "group_name": eng.sync.group_name, "flush_cache": False}
    with pytest.raises(Exception, match="400.*begin_weight_update"):
        http_json("POST", f.urls[0] + "/update_weights_from_distributed", body)
    eng.sync.close()
    reply = http_json("POST", f.urls[0] + "/generate", {
        "input_ids": [3], "sampling_params": {"max_new_tokens": 1}})
    assert reply["meta_info"]["weight_version"] == "2"


def _stream_generate(url: str, body: dict, started: threading.Event, box: dict) -> None:
    """POST a streamed ``/generate``; set ``started`` at the first chunk (the server reports the
    request running), keep the last chunk in ``box["r"]``."""
    import urllib.request

    req = urllib.request.Request(url + "/generate", data=json.dumps({**body, "stream": True})
                                 .encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            box["r"] = json.loads(line[len("data:"):])
            started.set()
    started.set()


def test_pause_flush_continue(fleet):
    """Waits for states the server reports, never for time: the first streamed chunk says the
    request runs; ``retract`` stops it (it goes back to the waiting queue, so it cannot finish
    while we look); ``abort`` then ends it with finish_reason "abort" before its 400 tokens."""
    f, _ = fleet
    url = f.urls[0]
    box: dict = {}
    started = threading.Event()
    th = threading.Thread(target=_stream_generate, args=(url, {
        "input_ids": [3, 4], "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}},
        started, box))
    th.start()
    assert started.wait(300), "no streamed chunk from the real server"
    http_json("POST", url + "/pause_generation", {"mode": "retract"})
    http_json("POST", url + "/pause_generation", {"mode": "abort"})
    flush_all([url])  # bounded retries while the aborted request drains
    th.join(120)
    meta = box["r"]["meta_info"]
    assert meta["finish_reason"]["type"] == "abort", meta
    assert meta["completion_tokens"] < 400
    http_json("POST", url + "/continue_generation", {})
    r = http_json("POST", url + "/generate", {"input_ids": [3], "sampling_params": {
        "max_new_tokens": 2, "ignore_eos": True}})
    assert r["meta_info"]["completion_tokens"] == 2


def test_partial_rollout_across_sync_real_sglang(fleet):
    """``rollout.partial`` against SGLang 0.5.21: a sync while requests run pauses with
    ``retract``; nothing is aborted or redone, each reply's ``weight_versions`` spans split its
    tokens between v21 and v22, every token's log-prob is the one of the version that produced
    it (the KV cache was recomputed under v22), and the sentinel (streamed, known to be running
    at the sync) has tokens from both versions."""
    f, tmp = fleet
    url = f.urls[0]
    eng = _engine(f, tmp, "from_disk")
    eng.partial = eng.sync.partial = True
    ref21, sd21 = _ref(21)
    ref22, sd22 = _ref(22)
    push_single_process(eng, [sd21], version=21)
    eng.pop_metrics()
    prompt, out, box, started = [5, 6, 7], {}, {}, threading.Event()
    gen = threading.Thread(target=lambda: out.update(g=eng.generate(
        [prompt], SamplingParams(n=2, max_new_tokens=64, temperature=1.0), seed=5)))
    gen.start()
    sentinel = threading.Thread(target=_stream_generate, args=(url, {
        "input_ids": prompt, "sampling_params": {"max_new_tokens": 300, "ignore_eos": True}},
        started, box))
    sentinel.start()
    assert started.wait(300), "no streamed chunk from the real server"
    # the server reports the sentinel running: retracted now, it cannot finish before the sync
    http_json("POST", url + "/pause_generation", {"mode": "retract"})
    push_single_process(eng, [sd22], version=22)  # pauses (retract) again, syncs, continues
    gen.join(300)
    sentinel.join(300)
    assert eng.sync.pause_modes == {url: "retract"}
    m = eng.pop_metrics()
    assert m["rollout/redone_tokens"] == 0.0 and "rollout/aborted_requeued" not in m, m
    meta = box["r"]["meta_info"]
    assert meta["finish_reason"]["type"] == "length", meta
    spans = meta["weight_versions"]
    assert [s["version"] for s in spans] == ["21", "22"] and 0 < spans[0]["end"] < 300, spans
    for c in out["g"][0]:
        tv = c.token_versions or [c.weight_version] * len(c.response_ids)
        assert len(tv) == len(c.logprobs) == len(c.response_ids) and set(tv) <= {21, 22}
        seq = prompt + c.response_ids
        want = {v: teacher_forced_logprobs(r, seq)[len(prompt) - 1:]
                for v, r in ((21, ref21), (22, ref22))}
        assert c.logprobs == pytest.approx([want[v][i] for i, v in enumerate(tv)], abs=TOL)


def test_server_killed_mid_rollout_loses_no_sample(fleet):
    """A second server (our ``serve``) joins; the real server is killed during a rollout:
    every group comes back complete, the dead server leaves the router, is restarted, gets the
    next sync's weights and rejoins the router at that weight version."""
    f, tmp = fleet
    from megatron_rl.rollout.weight_sync.from_distributed import free_port

    port = free_port()
    backup = subprocess.Popen([sys.executable, "-m", "megatron_rl", "serve", "--model-path",
                               f.model_path, "--port", str(port), "--eos-id", str(EOS)],
                              env={**os.environ, "PYTHONPATH": ROOT})
    url = f"http://127.0.0.1:{port}"
    try:
        from megatron_rl.rollout.fleet import wait_healthy

        wait_healthy(url, 300, backup)
        f.add_worker(url)
        eng = _engine(f, tmp, "from_disk")
        _, sd = _ref(13)
        push_single_process(eng, [sd], version=3)
        victim = next(u for u in f.urls if u != url)
        killed = []

        def kill_once(i, group) -> bool:
            if not killed:
                proc = psutil.Process(f.procs[victim].pid)
                for p in proc.children(recursive=True):
                    p.send_signal(signal.SIGKILL)
                killed.append(victim)
            return False

        out = eng.generate([[5 + i, 7] for i in range(6)], SamplingParams(n=2, max_new_tokens=8),
                           seed=4, stop_when=kill_once)
        assert killed and [len(g) for g in out] == [2] * 6
        f.check_health()
        assert victim not in f.urls and victim in f.dead
        assert [w["url"] for w in f.router_workers()] == [url]
        # the real server was restarted; the next sync brings it to version 4, then it rejoins
        (restarted,) = f.pending
        ref4, sd4 = _ref(14)
        push_single_process(eng, [sd4], version=4)
        assert sorted(f.urls) == sorted([url, restarted]) and not f.pending
        assert sorted(w["url"] for w in f.router_workers()) == sorted(f.urls)
        reply = http_json("POST", restarted + "/generate", {
            "input_ids": [3], "sampling_params": {"max_new_tokens": 1}})
        assert reply["meta_info"]["weight_version"] == "4"
        ids = probe_tokens(get_preset("tiny").vocab_size, 16)
        worst, errors = probe_check([restarted], ids, teacher_forced_logprobs(ref4, ids), TOL)
        assert not errors, errors
    finally:
        if url in f.workers:
            f.remove_worker(url)
        backup.terminate()
        backup.wait(30)


def test_rl_steps_against_real_sglang(fleet, sglang_python, tmp_path):
    """Two RL steps of the CLI against the module's running SGLang server, attached through its
    router (``rollout.sglang.servers`` / ``router_url``: the run starts no server of its own)."""
    f, ftmp = fleet
    out = tmp_path / "run"
    args = "[" + ",".join(CPU_ARGS) + "]"
    cmd = [sys.executable, "-m", "megatron_rl", "train", "examples/tiny_dapo.yaml",
           f"output_dir={out}", "parallel.tp=1", "parallel.pp=1", "trainer.total_steps=2",
           "trainer.plots=false",
           "trainer.test_freq=100", "trainer.save_freq=100", "trainer.train_batch_size=4",
           "rollout.n=4", "rollout.gen_batch_size=4", "rollout.dynamic_sampling=false",
           "rollout.val_n=1", "actor.micro_batch_size=8", "actor.mini_batch_size=8", "sft.steps=2",
           "data.val_size=8",
           "rollout.engine=sglang", "rollout.sglang.launcher=sglang",
           f"rollout.sglang.python={sglang_python}",
           f"rollout.sglang.servers=[{','.join(f.urls)}]",
           f"rollout.sglang.router_url={f.router_url}",
           "rollout.sglang.mem_fraction_static=0.2",
           f"rollout.sglang.extra_args={args}", "rollout.sglang.weight_sync=from_distributed",
           f"rollout.sglang.probe_tolerance={TOL}"]
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1500, env=env)
    tail = "".join(open(d / n).read()[-2000:] for d in (out / "sglang" / "logs", ftmp / "logs")
                   if d.exists() for n in os.listdir(d))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:] + tail
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    trained = [r for r in rows if any(k.startswith("rollout/logp_mismatch") for k in r)]
    assert len(trained) >= 2
    for r in trained:
        mism = {k: v for k, v in r.items() if k.startswith("rollout/logp_mismatch")}
        assert all(abs(v) < 0.05 for v in mism.values() if isinstance(v, float)), mism
    synced = [r for r in rows if "rollout/weight_sync_probe_gap" in r]  # the mean gap checked
    assert synced and all(r["rollout/weight_sync_probe_gap"] <= TOL for r in synced)
    assert all(r["rollout/weight_sync_probe_max_diff"] >= r["rollout/weight_sync_probe_gap"]
               for r in synced)
