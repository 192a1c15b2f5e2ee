"""Family registry and Hugging Face ``config.json`` handling.

One module per family (:mod:`.qwen2`, :mod:`.qwen3`, :mod:`.qwen3_moe`, :mod:`.llama`) provides
``MAPPING`` (a :class:`~megatron_rl.convert.common.FamilyMapping`), ``check_hf_config``,
``check_model_config`` and ``hf_config``.
"""

from __future__ import annotations

import json
import os
from types import ModuleType
from typing import Any, Mapping

from megatron_rl.convert import llama, qwen2, qwen3, qwen3_moe
from megatron_rl.convert.common import ConvertError, FamilyMapping
from megatron_rl.models.config import ModelConfig, ModelConfigError

FAMILY_MODULES: dict[str, ModuleType] = {"qwen2": qwen2, "qwen3": qwen3,
                                         "qwen3_moe": qwen3_moe, "llama": llama}
ARCHITECTURES: dict[str, str] = {arch: fam for fam, mod in FAMILY_MODULES.items()
                                 for arch in mod.MAPPING.architectures}
SUPPORTED = ", ".join(sorted(ARCHITECTURES))


def family_module(family: str) -> ModuleType:
    """The mapping module of ``family``."""
    try:
        return FAMILY_MODULES[family]
    except KeyError:
        raise ConvertError(f"model family {family!r} is not supported (supported: "
                           f"{', '.join(FAMILY_MODULES)})") from None


def mapping_for(cfg: ModelConfig) -> FamilyMapping:
    """The tensor mapping of ``cfg``'s family, after checking the config fits that HF family."""
    mod = family_module(cfg.family)
    mod.check_model_config(cfg)
    return mod.MAPPING


def family_of_hf_config(hf: Mapping[str, Any]) -> str:
    """Family of an HF config dict, from ``architectures`` (or ``model_type`` when absent)."""
    archs = hf.get("architectures") or []
    if archs:
        arch = archs[0]
        if arch not in ARCHITECTURES:
            raise ConvertError(f"architecture {arch!r} is not supported (supported: {SUPPORTED})")
        return ARCHITECTURES[arch]
    model_type = hf.get("model_type")
    if model_type not in FAMILY_MODULES:
        raise ConvertError(f"config.json has no 'architectures' and model_type={model_type!r} is "
                           f"not supported (supported architectures: {SUPPORTED})")
    return model_type


def normalize_hf_config(hf: Mapping[str, Any]) -> dict[str, Any]:
    """Copy of ``hf`` with a top-level ``rope_theta`` (transformers >= 5 nests it in
    ``rope_parameters``); raises for RoPE scaling, which the megatron model does not implement."""
    out = dict(hf)
    rope = out.get("rope_parameters") or out.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", None):
        raise ConvertError(f"config.json rope_type={rope_type!r} (RoPE scaling) is not supported "
                           "(supported: 'default')")
    if "rope_theta" not in out and "rope_theta" in rope:
        out["rope_theta"] = rope["rope_theta"]
    return out


def model_config_from_hf(hf: Mapping[str, Any]) -> tuple[ModelConfig, FamilyMapping]:
    """Validated :class:`ModelConfig` and family mapping of an HF config dict."""
    family = family_of_hf_config(hf)
    hf = normalize_hf_config(hf)
    mod = FAMILY_MODULES[family]
    mod.check_hf_config(hf)
    try:
        cfg = ModelConfig.from_hf_dict(hf)
    except (ModelConfigError, KeyError) as exc:
        raise ConvertError(f"config.json cannot be read as {family}: {exc}") from exc
    return cfg, mapping_for(cfg)


def read_hf_config(hf_dir: str) -> tuple[dict[str, Any], ModelConfig, FamilyMapping]:
    """``(raw config.json dict, ModelConfig, mapping)`` of an HF checkpoint directory."""
    path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(path):
        raise ConvertError(f"{hf_dir} has no config.json (expected a Hugging Face checkpoint "
                           "directory with config.json and *.safetensors)")
    with open(path) as f:
        raw = json.load(f)
    cfg, mapping = model_config_from_hf(raw)
    return raw, cfg, mapping


def hf_config_dict(cfg: ModelConfig, dtype: str = "float32") -> dict[str, Any]:
    """A ``config.json`` for ``cfg`` that transformers 4.x and 5.x both read."""
    mapping = mapping_for(cfg)
    out: dict[str, Any] = {
        "architectures": list(mapping.architectures[:1]), "model_type": mapping.model_type,
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "max_position_embeddings": cfg.max_position_embeddings, "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "tie_word_embeddings": cfg.tie_word_embeddings, "hidden_act": "silu",
        "initializer_range": cfg.init_method_std, "attention_dropout": 0.0, "use_cache": True,
        "torch_dtype": dtype, "dtype": dtype,
    }
    out.update(FAMILY_MODULES[cfg.family].hf_config(cfg))
    return out
