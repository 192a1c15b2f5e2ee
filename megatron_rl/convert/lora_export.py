"""Exports of a LoRA actor: a PEFT adapter directory or a merged Hugging Face directory.

- :func:`export_peft` writes ``adapter_config.json`` + ``adapter_model.safetensors`` in the
  ``peft`` package's LoRA format (``peft.PeftModel.from_pretrained(hf_base_model, DIR)`` loads it
  onto the HF base model). megatron's fused linears map to HF's split ones: the QKV adapter's
  ``A`` is shared by ``q_proj``/``k_proj``/``v_proj`` and its ``B`` is split like the fused
  weight's rows (per-query-group interleave undone); fc1's ``A`` is shared by ``gate_proj`` and
  ``up_proj``, which take ``lora_B_gate`` / ``lora_B_up``. The scaling ``lora_alpha / r`` is the
  actor's, so the PEFT model computes exactly ``W x + (alpha/r)·B A x`` per HF linear.
- :func:`export_merged_hf` writes ``config.json`` + safetensors shards with every adapted weight
  merged (``W + (alpha/r)·B·A``), streamed bucket by bucket from the live actor.

Both are collective over all ranks of the actor (every rank must call them); rank 0 writes.
"""

from __future__ import annotations

import json
import os
from typing import Mapping

import torch

from megatron_rl.models.config import ModelConfig
from megatron_rl.models.lora_config import LoraConfig

PEFT_PREFIX = "base_model.model."
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def _hf_targets(lora: LoraConfig, cfg: ModelConfig) -> dict[str, tuple[str, ...]]:
    """megatron module -> the HF module names it stands for (``cfg``'s family)."""
    from megatron_rl.convert.registry import mapping_for

    by_module: dict[str, tuple[str, ...]] = {}
    for m in mapping_for(cfg).tensor_maps(cfg):
        parts = m.canonical.split(".")
        if m.canonical.startswith("decoder.layers.0.") and parts[-1] == "weight" \
                and parts[-2] in lora.modules:
            by_module[parts[-2]] = tuple(h.split(".")[-2] for h in m.hf)
    return by_module


def peft_tensors(adapters: Mapping[str, torch.Tensor], cfg: ModelConfig
                 ) -> dict[str, torch.Tensor]:
    """PEFT-named tensors (``base_model.model.<hf module>.lora_A.weight`` ``[r, in]`` and
    ``...lora_B.weight`` ``[out, r]``) of canonical full adapter tensors
    (:func:`megatron_rl.models.lora.gather_full_adapters`)."""
    from megatron_rl.convert.common import FC1, QKV, split_qkv
    from megatron_rl.convert.registry import mapping_for

    index = {m.canonical: m for m in mapping_for(cfg).tensor_maps(cfg)}
    out: dict[str, torch.Tensor] = {}
    for name, a in adapters.items():
        if not name.endswith(".lora_A"):
            continue
        prefix = name[: -len(".lora_A")]
        m = index[prefix + ".weight"]
        mods = [PEFT_PREFIX + h[: -len(".weight")] for h in m.hf]
        if m.kind == QKV:
            bs = split_qkv(adapters[prefix + ".lora_B"], cfg)
        elif m.kind == FC1:
            bs = (adapters[prefix + ".lora_B_gate"], adapters[prefix + ".lora_B_up"])
        else:
            bs = (adapters[prefix + ".lora_B"],)
        for mod, b in zip(mods, bs, strict=True):
            out[mod + ".lora_A.weight"] = a.clone().contiguous()  # one copy per HF module
            out[mod + ".lora_B.weight"] = b.contiguous()
    return out


def peft_config(lora: LoraConfig, cfg: ModelConfig, base_model: str | None = None) -> dict:
    """The ``adapter_config.json`` fields of a LoRA adapter in ``peft``'s format."""
    targets = sorted({h for hs in _hf_targets(lora, cfg).values() for h in hs})
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora.rank,
            "lora_alpha": lora.alpha, "lora_dropout": lora.dropout,
            "target_modules": targets, "bias": "none", "fan_in_fan_out": False,
            "use_rslora": False, "use_dora": False, "init_lora_weights": True,
            "inference_mode": True, "modules_to_save": None,
            "base_model_name_or_path": base_model}


def export_peft(actor, out_dir: str, base_model: str | None = None) -> str | None:
    """Write the actor's adapters as a PEFT adapter directory (collective; rank 0 writes and
    returns ``out_dir``, other ranks None). ``base_model``: recorded as
    ``base_model_name_or_path``."""
    import torch.distributed as dist
    from safetensors.torch import save_file

    from megatron_rl.models.lora import gather_full_adapters

    if actor.lora is None:
        raise ValueError("export_peft: the actor has no adapters (actor.lora.rank is 0)")
    full = gather_full_adapters(actor.model)  # every stage's, on every model-parallel rank
    if dist.is_initialized() and dist.get_rank() != 0:
        return None
    os.makedirs(out_dir, exist_ok=True)
    save_file(peft_tensors(full, actor.model_cfg), os.path.join(out_dir, ADAPTER_WEIGHTS),
              metadata={"format": "pt"})
    with open(os.path.join(out_dir, ADAPTER_CONFIG), "w") as f:
        json.dump(peft_config(actor.lora, actor.model_cfg, base_model), f, indent=2)
    return out_dir


def export_merged_hf(actor, out_dir: str, shard_bytes: int = 2 * 2**30) -> str | None:
    """Write ``config.json`` + safetensors shards (with their index) of the merged weights
    (adapters folded into the base), one shard per streamed bucket of at most ``shard_bytes``:
    rank 0 holds one bucket at a time. Collective over all ranks; rank 0 writes and returns
    ``out_dir``, the others return None."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_rl.convert.hf_io import write_index, write_shard
    from megatron_rl.convert.registry import hf_config_dict
    from megatron_rl.convert.stream import iter_hf_weight_buckets

    writer = dist.get_rank() == 0 if dist.is_initialized() else True
    if writer:
        os.makedirs(out_dir, exist_ok=True)
    weight_map: dict[str, str] = {}
    total, dtype = 0, None
    if ps.get_data_parallel_rank() == 0:
        buckets = iter_hf_weight_buckets(actor.model, shard_bytes, broadcast_pp=True)
        for i, bucket in enumerate(buckets):
            if not writer:
                continue
            name = f"model-{i + 1:05d}.safetensors"
            total += write_shard(os.path.join(out_dir, name),
                                 [(n, t.detach().cpu()) for n, t in bucket])
            weight_map.update((n, name) for n, _ in bucket)
            dtype = bucket[0][1].dtype
    if writer:
        write_index(out_dir, weight_map, total)
        conf = hf_config_dict(actor.model_cfg)
        conf["torch_dtype"] = str(dtype).split(".")[-1]
        with open(os.path.join(out_dir, "config.json"), "w") as f:
            json.dump(conf, f, indent=2)
    if dist.is_initialized():
        dist.barrier()
    return out_dir if writer else None
