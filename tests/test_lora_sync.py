"""Adapter-only LoRA weight sync (``actor.lora.sync: adapter``): our ``serve`` follows SGLang
0.5.21's LoRA endpoints (``/load_lora_adapter``, ``/unload_lora_adapter``, generate's
``lora_path``) and computes what the real ``peft`` package computes; the trainer's adapter sync
gives the same rollout log-probs as merged sync and sends about the adapter's bytes."""

import json
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
    _peft_dir(base, str(tmp_path / "big"), 16, 2)  # over --max-lora-rank 8
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
