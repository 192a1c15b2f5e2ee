"""Hugging Face <-> Megatron checkpoint conversion and the Megatron -> HF weight stream.

- :func:`convert_hf_to_megatron`: HF safetensors dir -> megatron ``dist_checkpointing`` checkpoint
  (loadable at any TP/PP layout with :func:`load_megatron_checkpoint`).
- :func:`convert_megatron_to_hf`: the reverse, model-free and shard by shard.
- :func:`iter_hf_weight_buckets`: HF-named full tensors from a live sharded model, bucketed by
  bytes (rollout weight sync).

Per-family name tables live in :mod:`.qwen2`, :mod:`.qwen3`, :mod:`.llama`.
"""

from importlib import import_module
from typing import Any

# Names resolve on first use (PEP 562): importing one submodule, e.g. ``convert.model_source``
# during config validation, must not pull in torch.distributed.checkpoint and the converters.
_WHERE = {
    "ConvertError": "common", "TensorMap": "common", "merge_qkv": "common", "split_qkv": "common",
    "convert_hf_to_megatron": "hf_to_megatron", "load_megatron_checkpoint": "hf_to_megatron",
    "save_megatron_checkpoint": "hf_to_megatron", "convert_megatron_to_hf": "megatron_to_hf",
    "SUPPORTED": "registry", "hf_config_dict": "registry", "mapping_for": "registry",
    "read_hf_config": "registry", "iter_hf_weight_buckets": "stream",
}
__all__ = list(_WHERE)


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(import_module(f"megatron_rl.convert.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'megatron_rl.convert' has no attribute {name!r}")
