"""Lazy reading and shard-by-shard writing of Hugging Face safetensors checkpoints.

Reading opens a file only for the tensor asked for (``safe_open``), so nothing but that tensor is
resident. Writing takes a precomputed shard plan, so every shard's file name is known up front and
several processes can each write their own shards (rank 0 writes the index).
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import torch

from megatron_rl.convert.common import ConvertError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
           "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16,
           "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}
# Files that are weights or configs we rewrite; everything else (tokenizer, generation config,
# chat template, ...) is an asset copied through unchanged.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".msgpack", ".h5")
_REWRITTEN = {INDEX, "pytorch_model.bin.index.json", "config.json"}


@dataclass(frozen=True)
class TensorInfo:
    """Header entry of one tensor: its file, dtype and shape."""

    file: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * torch.empty((), dtype=self.dtype).element_size()


def read_header(path: str) -> dict[str, dict]:
    """The JSON header of a safetensors file (no tensor data is read)."""
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    header.pop("__metadata__", None)
    return header


class HFCheckpoint:
    """Tensor index of an HF safetensors checkpoint directory; tensors are read on demand."""

    def __init__(self, path: str):
        self.path = path
        self.info: dict[str, TensorInfo] = {}
        for fname in self._weight_files():
            for name, entry in read_header(os.path.join(path, fname)).items():
                if entry["dtype"] not in _DTYPES:
                    raise ConvertError(f"{fname}: tensor {name!r} has unsupported dtype "
                                       f"{entry['dtype']}")
                self.info[name] = TensorInfo(fname, _DTYPES[entry["dtype"]],
                                             tuple(entry["shape"]))

    def _weight_files(self) -> list[str]:
        index = os.path.join(self.path, INDEX)
        if os.path.isfile(index):
            with open(index) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
            missing = [f for f in files if not os.path.isfile(os.path.join(self.path, f))]
            if missing:
                raise ConvertError(f"{self.path}: {len(missing)} shard(s) listed in {INDEX} are "
                                   f"missing: {missing[:5]} (an incomplete download or copy? "
                                   "fetch the missing files)")
            return files
        files = sorted(f for f in os.listdir(self.path) if f.endswith(".safetensors"))
        if not files:
            raise ConvertError(f"{self.path} has no *.safetensors files (only safetensors "
                               "checkpoints are supported; re-save with safe_serialization=True)")
        return files

    def names(self) -> list[str]:
        return list(self.info)

    def get(self, name: str) -> torch.Tensor:
        """Read one tensor from disk (the file is opened for this read only)."""
        from safetensors import safe_open

        if name not in self.info:
            raise ConvertError(f"missing tensor {name!r} in {self.path}")
        with safe_open(os.path.join(self.path, self.info[name].file), framework="pt") as f:
            return f.get_tensor(name)

    def main_dtype(self) -> torch.dtype:
        """The dtype holding most of the bytes (the checkpoint's dtype)."""
        by: dict[torch.dtype, int] = {}
        for info in self.info.values():
            by[info.dtype] = by.get(info.dtype, 0) + info.nbytes
        return max(by, key=by.get)

    def largest_file_bytes(self) -> int:
        return max(os.path.getsize(os.path.join(self.path, f)) for f in self._weight_files())


def shard_file_names(n: int) -> list[str]:
    """HF's shard naming: ``model-00001-of-00003.safetensors``."""
    return [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


def plan_shards(sizes: Sequence[int], max_shard_bytes: int) -> list[list[int]]:
    """Group consecutive items (by byte size) into shards of at most ``max_shard_bytes``; an item
    larger than the budget gets a shard of its own. Returns item indices per shard."""
    shards: list[list[int]] = []
    used = max_shard_bytes + 1
    for i, size in enumerate(sizes):
        if used + size > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(i)
        used += size
    return shards


def write_shard(path: str, tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
    """Write one safetensors file; returns its tensor bytes."""
    from safetensors.torch import save_file

    data = {name: t.contiguous() for name, t in tensors}
    save_file(data, path, metadata={"format": "pt"})
    return sum(t.numel() * t.element_size() for t in data.values())


def write_index(out_dir: str, weight_map: dict[str, str], total_size: int) -> None:
    """Write ``model.safetensors.index.json``."""
    with open(os.path.join(out_dir, INDEX), "w") as f:
        json.dump({"metadata": {"total_size": total_size}, "weight_map": weight_map}, f, indent=2)


def copy_assets(src: str, dst: str, log: Callable[[str], None] = print) -> list[str]:
    """Copy tokenizer and other non-weight files from ``src`` to ``dst``."""
    copied = []
    if not os.path.isdir(src):
        return copied
    os.makedirs(dst, exist_ok=True)
    for fname in sorted(os.listdir(src)):
        full = os.path.join(src, fname)
        if (os.path.isfile(full) and fname not in _REWRITTEN
                and not fname.endswith(_WEIGHT_SUFFIXES)):
            shutil.copy2(full, os.path.join(dst, fname))
            copied.append(fname)
    if copied:
        log(f"[convert] copied {len(copied)} asset file(s): {', '.join(copied)}")
    return copied
