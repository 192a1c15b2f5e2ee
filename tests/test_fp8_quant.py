"""Block FP8 (128x128 e4m3, per-block ``weight_scale_inv``) as SGLang's ``fp8`` quantization
loads it: our quantiser and dequantiser equal SGLang 0.5.21's own reference functions bit for
bit (run in the project's SGLang venv on our tensors), our payload loads through SGLang's fp8
linear layers, and the list of quantised layers."""

import os
import subprocess

import pytest
import torch

from megatron_rl.rollout.fp8 import (
    ceil_to_ue8m0,
    dequantize_block_fp8,
    dequantize_pairs,
    fp8_round_trip,
    is_quantized,
    quantization_config,
    quantize_block_fp8,
    quantize_bucket,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _weights() -> dict[str, torch.Tensor]:
    """Shapes that are and are not multiples of 128, a zero block (amax clamped), large and
    tiny values, bf16 and fp32."""
    g = torch.Generator().manual_seed(5)
    w = {"aligned": torch.randn(256, 384, generator=g).to(torch.bfloat16),
         "ragged": (torch.randn(200, 72, generator=g) * 3).to(torch.bfloat16),
         "ragged_both": (torch.randn(130, 260, generator=g) * 1e-3).to(torch.bfloat16),
         "fp32": torch.randn(129, 128, generator=g) * 50}
    z = torch.randn(256, 256, generator=g)
    z[:128, 128:] = 0  # one all-zero block
    z[128:, :128] *= 1e-6  # one block under the 1e-4 amax clamp
    w["zero_block"] = z.to(torch.bfloat16)
    return w


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def test_quantiser_by_hand():
    """One 2x2 tensor (one padded block): scale = amax / 448, values = w / scale rounded to
    e4m3 (nearest, ties to even); UE8M0 rounds the scale up to a power of two."""
    w = torch.tensor([[1.0, -2.0], [0.5, 448.0 * 2]])
    q, s = quantize_block_fp8(w)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32 and s.shape == (1, 1)
    assert s.item() == 2.0 and q.float().tolist() == [[0.5, -1.0], [0.25, 448.0]]
    assert torch.equal(dequantize_block_fp8(q, s, torch.float32), w)
    q8, s8 = quantize_block_fp8(torch.tensor([[3.0, 448.0 * 3]]), "ue8m0")
    assert s8.item() == 4.0 and q8.float().tolist() == [[0.75, 320.0]]  # 336: a tie, to even
    assert ceil_to_ue8m0(torch.tensor([0.3, 1.0, 1.5])).tolist() == [0.5, 1.0, 2.0]
    with pytest.raises(ValueError, match="2-D"):
        quantize_block_fp8(torch.ones(3))


def test_scale_shapes_and_round_trip_error():
    """``[ceil(n/128), ceil(k/128)]`` scales; the round trip stays within e4m3's relative step
    (2^-3 of each block's amax at most) and keeps dtype and shape."""
    w = _weights()["ragged_both"]
    q, s = quantize_block_fp8(w)
    assert q.shape == w.shape and s.shape == (2, 3)
    r = fp8_round_trip(w)
    assert r.dtype == w.dtype and r.shape == w.shape
    assert (r.float() - w.float()).abs().max() <= w.float().abs().max() / 8


def test_quantised_layers_are_sglangs_list():
    """Linear projections yes (attention, dense/shared/routed MLP); embeddings, lm_head, norms,
    the MoE router and shared-expert gate, biases no."""
    yes = ["model.layers.0.self_attn.q_proj.weight", "model.layers.3.self_attn.o_proj.weight",
           "model.layers.1.mlp.gate_proj.weight", "model.layers.1.mlp.down_proj.weight",
           "model.layers.2.mlp.experts.17.up_proj.weight",
           "model.layers.2.mlp.shared_expert.gate_proj.weight"]
    no = ["model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
          "model.layers.0.input_layernorm.weight", "model.layers.0.self_attn.q_norm.weight",
          "model.layers.0.self_attn.q_proj.bias", "model.layers.2.mlp.gate.weight",
          "model.layers.2.mlp.shared_expert_gate.weight"]
    assert all(is_quantized(n) for n in yes) and not any(is_quantized(n) for n in no)


def test_bucket_pairs_weight_and_scale_and_receiver_dequantises():
    """A bucket keeps each FP8 weight next to its scale; the receiver side turns them back into
    the round-tripped weight and passes the rest through; an unpaired half raises."""
    g = torch.Generator().manual_seed(0)
    bucket = [("model.embed_tokens.weight", torch.randn(10, 4, generator=g)),
              ("model.layers.0.self_attn.q_proj.weight", torch.randn(8, 4, generator=g)),
              ("model.layers.0.self_attn.q_proj.bias", torch.randn(8, generator=g))]
    out = quantize_bucket(bucket)
    assert [n for n, _ in out] == ["model.embed_tokens.weight",
                                   "model.layers.0.self_attn.q_proj.weight",
                                   "model.layers.0.self_attn.q_proj.weight_scale_inv",
                                   "model.layers.0.self_attn.q_proj.bias"]
    assert out[0][1] is bucket[0][1] and out[1][1].dtype == torch.float8_e4m3fn
    back = dict(dequantize_pairs(reversed(out), torch.float32))  # any order
    assert torch.equal(back["model.layers.0.self_attn.q_proj.weight"],
                       fp8_round_trip(bucket[1][1]))
    assert torch.equal(back["model.embed_tokens.weight"], bucket[0][1])
    with pytest.raises(ValueError, match="without their weight_scale_inv"):
        list(dequantize_pairs(out[:2], torch.float32))


def _payload(a: dict, scale_fmt: str) -> dict:
    """Our FP8 tensors of one layer (HF names), shapes of ``a``."""
    g = torch.Generator().manual_seed(9)
    shapes = {"self_attn.q_proj": (a["heads"] * a["head_dim"], a["hidden"]),
              "self_attn.k_proj": (a["kv_heads"] * a["head_dim"], a["hidden"]),
              "self_attn.v_proj": (a["kv_heads"] * a["head_dim"], a["hidden"]),
              "self_attn.o_proj": (a["hidden"], a["heads"] * a["head_dim"]),
              "mlp.gate_proj": (a["ffn"], a["hidden"]), "mlp.up_proj": (a["ffn"], a["hidden"]),
              "mlp.down_proj": (a["hidden"], a["ffn"])}
    bucket = [(f"model.layers.0.{m}.weight", torch.randn(*s, generator=g).to(torch.bfloat16))
              for m, s in shapes.items()]
    return dict(bucket), dict(quantize_bucket(bucket, scale_fmt))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_equals_sglang_reference_bit_for_bit(tmp_path):
    """SGLang 0.5.21's own functions (its venv, a subprocess) on our tensors: its float32-scale
    and UE8M0 quantisers produce the same bytes as ours, its ``block_quant_dequant`` the same
    values as our dequantisation; our payload loaded by the weight loaders of its fp8
    ``QKVParallelLinear`` / ``MergedColumnParallelLinear`` / ``RowParallelLinear`` lands
    byte for byte in their ``weight`` / ``weight_scale_inv`` and dequantises to the fused bf16
    weights we sent (ragged last blocks of a 200-wide hidden size included)."""
    from megatron_rl.testing.sglang_env import ensure

    python = str(ensure())
    weights = _weights()
    a = {"hidden": 200, "head_dim": 64, "heads": 4, "kv_heads": 2, "ffn": 384}
    _, payload = _payload(a, "float32")
    torch.save({"weights": weights, "payload": payload, "attn": a,
                "quantization_config": quantization_config()}, tmp_path / "in.pt")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    res = subprocess.run([python, "-m", "megatron_rl.testing.sglang_fp8_ref",
                          str(tmp_path / "in.pt"), str(tmp_path / "out.pt")], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    ref = torch.load(tmp_path / "out.pt")
    for name, w in weights.items():
        for fmt in ("float32", "ue8m0"):
            q, s = quantize_block_fp8(w, fmt)
            assert torch.equal(_bits(q), _bits(ref[f"{name}/{fmt}/q"])), (name, fmt)
            assert torch.equal(_bits(s), _bits(ref[f"{name}/{fmt}/s"])), (name, fmt)
            assert torch.equal(_bits(dequantize_block_fp8(q, s, w.dtype)),
                               _bits(ref[f"{name}/{fmt}/deq"])), (name, fmt)
    def deq(m):
        n = f"model.layers.0.{m}.weight"
        return dequantize_block_fp8(payload[n], payload[n + "_scale_inv"], torch.bfloat16)

    fused = {"qkv": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
             "o": ["self_attn.o_proj"], "gate_up": ["mlp.gate_proj", "mlp.up_proj"],
             "down": ["mlp.down_proj"]}
    for key, mods in fused.items():
        w = torch.cat([payload[f"model.layers.0.{m}.weight"] for m in mods])
        s = torch.cat([payload[f"model.layers.0.{m}.weight_scale_inv"] for m in mods])
        assert torch.equal(_bits(ref[f"load/{key}/weight"]), _bits(w)), key
        assert torch.equal(ref[f"load/{key}/weight_scale_inv"], s), key
        assert torch.equal(ref[f"load/{key}/deq"], torch.cat([deq(m) for m in mods])), key


@pytest.mark.gpu
def test_cuda_quantiser_equals_cpu_and_stays_on_the_device():
    """On the sender's GPU: the same bytes as on CPU (both scale formats, ragged shapes), the
    quantised bucket stays on the device, the receiver-side dequantisation agrees."""
    dev = torch.device("cuda")
    for name, w in _weights().items():
        for fmt in ("float32", "ue8m0"):
            q, s = quantize_block_fp8(w, fmt)
            qc, sc = quantize_block_fp8(w.to(dev), fmt)
            assert qc.device.type == "cuda" and sc.device.type == "cuda"
            assert torch.equal(_bits(qc.cpu()), _bits(q)) and torch.equal(sc.cpu(), s), (name, fmt)
            assert torch.equal(dequantize_block_fp8(qc, sc, w.dtype).cpu(),
                               dequantize_block_fp8(q, s, w.dtype)), (name, fmt)
    from megatron_rl.rollout.fp8 import quantize_buckets

    class Timer:
        seconds = 0.0

        def add_quant_time(self, s: float) -> None:
            self.seconds += s

    timer = Timer()
    bucket = [("model.layers.0.mlp.down_proj.weight", _weights()["aligned"].to(dev)),
              ("model.norm.weight", torch.ones(256, device=dev))]
    (out,) = list(quantize_buckets([bucket], "float32", timer))
    assert all(t.device.type == "cuda" for _, t in out) and len(out) == 3 and timer.seconds > 0
