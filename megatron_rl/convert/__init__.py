"""Hugging Face <-> Megatron checkpoint conversion and the Megatron -> HF weight stream.

- :func:`convert_hf_to_megatron`: HF safetensors dir -> megatron ``dist_checkpointing`` checkpoint
  (loadable at any TP/PP layout with :func:`load_megatron_checkpoint`).
- :func:`convert_megatron_to_hf`: the reverse, model-free and shard by shard.
- :func:`iter_hf_weight_buckets`: HF-named full tensors from a live sharded model, bucketed by
  bytes (rollout weight sync).

Per-family name tables live in :mod:`.qwen2`, :mod:`.qwen3`, :mod:`.llama`.
"""

from megatron_rl.convert.common import ConvertError, TensorMap, merge_qkv, split_qkv
from megatron_rl.convert.hf_to_megatron import (
    convert_hf_to_megatron,
    load_megatron_checkpoint,
    save_megatron_checkpoint,
)
from megatron_rl.convert.megatron_to_hf import convert_megatron_to_hf
from megatron_rl.convert.registry import SUPPORTED, hf_config_dict, mapping_for, read_hf_config
from megatron_rl.convert.stream import iter_hf_weight_buckets

__all__ = [
    "ConvertError", "TensorMap", "merge_qkv", "split_qkv", "convert_hf_to_megatron",
    "load_megatron_checkpoint", "save_megatron_checkpoint", "convert_megatron_to_hf",
    "SUPPORTED", "hf_config_dict", "mapping_for", "read_hf_config", "iter_hf_weight_buckets",
]
