"""A converted megatron checkpoint's own files and keys, shared by both directions of the
conversion: the sidecar ``megatron_rl_convert.json`` (model config, original HF config, dtype), the
``hf_assets`` folder (tokenizer and other HF files) and the ``dist_checkpointing`` key of each
canonical tensor name."""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict

from megatron_rl.models.config import ModelConfig

SIDECAR = "megatron_rl_convert.json"
ASSETS = "hf_assets"
_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
_EXPERT_RE = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.*)$")
# megatron's sharded_state_dict stores the local spec's norms under the Transformer Engine names.
_LOCAL_TO_CKPT = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
                  "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"}


def write_sidecar(out_dir: str, cfg: ModelConfig, hf_config: dict | None, dtype: str) -> None:
    """Write ``megatron_rl_convert.json`` (model config, original HF config, dtype)."""
    with open(os.path.join(out_dir, SIDECAR), "w") as f:
        json.dump({"model_config": asdict(cfg), "hf_config": hf_config, "dtype": dtype}, f,
                  indent=2)


def read_sidecar(ckpt_dir: str) -> dict | None:
    """The sidecar of a converted checkpoint, or None."""
    path = os.path.join(ckpt_dir, SIDECAR)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def checkpoint_key(canonical: str, prefix: str = "") -> tuple[str, int | None]:
    """Checkpoint key and layer of a canonical name (``decoder.layers.3.x`` -> ``decoder.layers.x``,
    layer 3)."""
    m = _LAYER_RE.match(canonical)
    if not m:
        return prefix + canonical, None
    rest = _LOCAL_TO_CKPT.get(m.group(2), m.group(2))
    return f"{prefix}decoder.layers.{rest}", int(m.group(1))


def checkpoint_index(canonical: str, prefix: str = "") -> tuple[str, tuple[int, ...]]:
    """Checkpoint key of a canonical name and its index along the key's leading axes: ``()`` for
    a global tensor, ``(layer,)`` for a layer tensor (all layers stacked), ``(layer, expert)`` for
    a routed expert's tensor (megatron stacks ``[layers, experts, ...]`` under
    ``decoder.layers.mlp.experts.experts.*``, global expert ids)."""
    m = _LAYER_RE.match(canonical)
    e = _EXPERT_RE.match(m.group(2)) if m else None
    if e:
        return (f"{prefix}decoder.layers.mlp.experts.experts.{e.group(2)}",
                (int(m.group(1)), int(e.group(1))))
    key, layer = checkpoint_key(canonical, prefix)
    return key, () if layer is None else (layer,)
