"""The SDPA core attention of the local layer spec (issue 10) against megatron's own
``DotProductAttention`` (the [B, heads, S, S] reference), GQA and MHA, fp32 and bf16, forward
and backward; and the builder uses it without Transformer Engine. Layout invariance and HF-logit
parity of whole models built with it: tests/test_model_layout.py, tests/test_convert.py,
tests/test_hf_models.py."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.parallel.launch import spawn


def _attention_worker() -> dict:
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_rl.models.attention import SDPAttention
    from megatron_rl.models.builder import build_gpt_model, make_transformer_config
    from megatron_rl.models.config import ModelConfig, get_preset
    from megatron_rl.parallel import runtime

    runtime.init_parallel(tp=1, pp=1, timeout_s=120)
    out = {}
    for name, heads, groups in (("gqa", 8, 2), ("mha", 4, 4)):
        cfg = ModelConfig(family="qwen2", vocab_size=64, hidden_size=16 * heads,
                          intermediate_size=64, num_hidden_layers=1, num_attention_heads=heads,
                          num_key_value_heads=groups, max_position_embeddings=64)
        tcfg = make_transformer_config(cfg)
        ref = DotProductAttention(tcfg, 1, AttnMaskType.causal, "self")
        new = SDPAttention(tcfg, 1, AttnMaskType.causal, "self")
        g = torch.Generator().manual_seed(0)
        s, b, d = 12, 3, 16
        q = torch.randn(s, b, heads, d, generator=g, requires_grad=True)
        k = torch.randn(s, b, groups, d, generator=g, requires_grad=True)
        v = torch.randn(s, b, groups, d, generator=g, requires_grad=True)
        grads = {}
        for label, mod in (("ref", ref), ("sdpa", new)):
            o = mod(q, k, v, None)
            (gq, gk, gv) = torch.autograd.grad((o * o).sum(), (q, k, v))
            grads[label] = (o.detach(), gq, gk, gv)
        out[name] = max(float((x - y).abs().max()) for x, y in zip(grads["ref"], grads["sdpa"]))
        out[name + "_shape"] = tuple(grads["sdpa"][0].shape)
        with torch.no_grad():  # bf16 inputs: same kernel contract, bf16 rounding
            o16 = new(q.bfloat16(), k.bfloat16(), v.bfloat16(), None)
        out[name + "_bf16"] = float((o16.float() - grads["ref"][0]).abs().max())
        out[name + "_bf16_dtype"] = str(o16.dtype)
    model = build_gpt_model(get_preset("tiny"), seed=0)
    out["used"] = sorted({type(m).__name__ for m in model.modules()
                          if "Attention" in type(m).__name__})
    runtime.shutdown()
    return out


@pytest.fixture(scope="module")
def result():
    (out,) = spawn(_attention_worker, 1, (), timeout_s=200)
    return out


@pytest.mark.parametrize("kind", ["gqa", "mha"])
def test_sdpa_matches_megatron_dot_product_attention(result, kind):
    assert result[kind] < 1e-5, result
    heads = 8 if kind == "gqa" else 4
    assert result[kind + "_shape"] == (12, 3, heads * 16)
    assert result[kind + "_bf16_dtype"] == "torch.bfloat16"
    assert result[kind + "_bf16"] < 5e-2, result  # bf16 inputs: ~3 significant digits


def test_builder_uses_sdpa_without_transformer_engine(result):
    assert "SDPAttention" in result["used"] and "DotProductAttention" not in result["used"]


def test_causal_mask_is_applied():
    """Negative control: a future token changes nothing before it (causality), and non-causal
    attention would see it."""
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 6, 8, generator=g) for _ in range(3))
    k2, v2 = k.clone(), v.clone()
    k2[..., -1, :] += 5.0
    v2[..., -1, :] += 5.0
    causal = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    causal2 = F.scaled_dot_product_attention(q, k2, v2, is_causal=True)
    assert torch.equal(causal[..., :-1, :], causal2[..., :-1, :])
    full = F.scaled_dot_product_attention(q, k2, v2)
    assert not torch.allclose(full[..., :-1, :], causal[..., :-1, :])
