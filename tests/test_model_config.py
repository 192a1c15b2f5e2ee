"""Model configs: presets, HF mapping and validation errors."""

import pytest
import torch

from megatron_rl.models.config import (
    PRESETS,
    ModelConfig,
    ModelConfigError,
    get_preset,
    validate_for_layout,
)
from megatron_rl.models.weights import shard_for_rank, unshard


def test_presets_valid():
    for name, cfg in PRESETS.items():
        assert cfg.kv_channels > 0, name
    assert get_preset("tiny").qkv_bias and not get_preset("tiny").qk_layernorm
    assert get_preset("tiny-qwen3").qk_layernorm and not get_preset("tiny-qwen3").qkv_bias
    assert not get_preset("tiny-llama").qkv_bias and get_preset("tiny-llama").tie_word_embeddings


def test_unknown_preset_lists_known():
    with pytest.raises(ModelConfigError, match="known: .*tiny"):
        get_preset("gpt5")


def test_from_hf_dict():
    hf = {"model_type": "qwen3", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 96,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "head_dim": 32, "rope_theta": 1e6, "rms_norm_eps": 1e-6, "tie_word_embeddings": True}
    cfg = ModelConfig.from_hf_dict(hf)
    assert cfg.family == "qwen3" and cfg.qk_layernorm and cfg.kv_channels == 32
    with pytest.raises(ModelConfigError, match="model_type='gpt2' is not supported"):
        ModelConfig.from_hf_dict({**hf, "model_type": "gpt2"})


@pytest.mark.parametrize("field,value,needle", [
    ("family", "gpt2", "model.family='gpt2' is not one of"),
    ("hidden_size", 0, "model.hidden_size must be a positive integer"),
    ("num_key_value_heads", 3, "must be a multiple of model.num_key_value_heads"),
])
def test_bad_fields(field, value, needle):
    with pytest.raises(ModelConfigError, match=needle):
        get_preset("tiny").replace(**{field: value})


def test_layout_errors():
    cfg = get_preset("tiny").replace(vocab_size=257)
    with pytest.raises(ModelConfigError, match="vocab_size=257 is not divisible by "
                                               "tensor_parallel_size=2"):
        validate_for_layout(cfg, 2, 1)
    with pytest.raises(ModelConfigError, match="num_hidden_layers=4 is not divisible by "
                                               "pipeline_parallel_size=3"):
        validate_for_layout(get_preset("tiny"), 1, 3)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_fc1_shard_roundtrip(tp):
    gate = torch.arange(8 * 3).reshape(8, 3).float()
    up = -gate
    full = torch.cat([gate, up])
    name = "decoder.layers.0.mlp.linear_fc1.weight"
    parts = [shard_for_rank(name, full, True, 0, tp, r) for r in range(tp)]
    for r, p in enumerate(parts):  # megatron's local layout: [gate_r; up_r]
        assert torch.equal(p, torch.cat([gate.chunk(tp)[r], up.chunk(tp)[r]]))
    assert torch.equal(unshard(name, parts, 0), full)
    if tp > 1:  # negative control: a plain slice would mix gate and up rows
        assert not torch.equal(parts[0], full.chunk(tp)[0])
