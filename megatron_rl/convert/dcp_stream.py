"""Write a megatron ``torch_dist`` checkpoint tensor by tensor, without building the model.

megatron's ``dist_checkpointing.save`` takes a whole model stage as one state dict, so converting
with it holds a full stage (plus copies) at once. The ``torch_dist`` format is a PyTorch DCP
checkpoint: data files holding one ``torch.save`` blob per stored chunk, a pickled ``.metadata``
(global shape, dtype and chunk list of every key, and where each chunk's bytes are), megatron's
``metadata.json`` and ``common.pt``. This module writes exactly that, one chunk at a time:

* layer tensors are stored under megatron's stacked keys (``decoder.layers.<name>`` of global shape
  ``[L, ...]``, norms under their Transformer Engine names), one ``[1, ...]`` chunk per layer, as a
  save at PP = L would; whole tensors (embedding, final norm, output layer) as one chunk;
* each linear layer's ``_extra_state`` object (``[None]`` for the local spec, keyed
  ``.../_extra_state/shard_<layer>_<L>``) is written as megatron does.

The result loads with ``dist_checkpointing.load`` at any TP/PP (each rank reads the chunk overlaps
it needs). Several writer processes may split the tensors: writer ``r`` writes ``__<r>_0.distcp``
and returns its :class:`DcpPart`; the parts are merged and written by one of them
(:func:`write_dcp_metadata`).
"""

from __future__ import annotations

import io
import json
import os
import pickle
import uuid
from dataclasses import dataclass, field

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

MEGATRON_METADATA = {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                     "common_backend": "torch", "common_backend_version": 1}
# Modules of a decoder layer (local spec) whose ``_extra_state`` megatron stores.
EXTRA_STATE_MODULES = ("self_attention.linear_qkv", "self_attention.linear_proj",
                       "mlp.linear_fc1", "mlp.linear_fc2")


@dataclass
class DcpPart:
    """What one writer stored: per key its global shape/dtype (None: a bytes object) and chunk
    offsets, and where each chunk's bytes are."""

    tensors: dict[str, tuple[tuple[int, ...], torch.dtype]] = field(default_factory=dict)
    chunks: dict[str, list[tuple[tuple[int, ...], tuple[int, ...]]]] = field(default_factory=dict)
    objects: list[str] = field(default_factory=list)
    storage: list[tuple[str, tuple[int, ...] | None, str, int, int]] = field(default_factory=list)


class DcpStreamWriter:
    """Appends chunks to one data file; nothing is kept after a chunk is written."""

    def __init__(self, out_dir: str, writer_rank: int = 0):
        os.makedirs(out_dir, exist_ok=True)
        self.file_name = f"__{writer_rank}_0.distcp"
        self._f = open(os.path.join(out_dir, self.file_name), "wb")
        self.part = DcpPart()
        self.bytes = 0

    def add_chunk(self, key: str, global_shape: tuple[int, ...], offsets: tuple[int, ...],
                  chunk: torch.Tensor) -> None:
        """Store ``chunk`` (contiguous, CPU) at ``offsets`` of the global tensor ``key``."""
        chunk = chunk.detach().contiguous()
        if chunk.untyped_storage().nbytes() != chunk.numel() * chunk.element_size():
            chunk = chunk.clone()  # torch.save writes the whole storage of a view
        known = self.part.tensors.setdefault(key, (tuple(global_shape), chunk.dtype))
        if known != (tuple(global_shape), chunk.dtype):
            raise ValueError(f"{key}: chunks disagree on global shape/dtype")
        start = self._f.tell()
        torch.save(chunk, self._f)
        length = self._f.tell() - start
        self.part.chunks.setdefault(key, []).append((tuple(offsets), tuple(chunk.shape)))
        self.part.storage.append((key, tuple(offsets), self.file_name, start, length))
        self.bytes += chunk.numel() * chunk.element_size()

    def add_object(self, key: str, obj) -> None:
        """Store a pickled object (megatron ``ShardedObject``; ``key`` is its unique key)."""
        buf = io.BytesIO()
        torch.save(obj, buf)
        start = self._f.tell()
        self._f.write(buf.getbuffer())
        self.part.objects.append(key)
        self.part.storage.append((key, None, self.file_name, start, self._f.tell() - start))

    def close(self) -> DcpPart:
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        return self.part


def write_dcp_metadata(out_dir: str, parts: list[DcpPart]) -> None:
    """Merge the writers' parts into ``.metadata``; write megatron's ``metadata.json`` and
    ``common.pt`` (an empty common state, as a model-only save has)."""
    sd_meta: dict = {}
    storage: dict = {}
    for part in parts:
        for key, (shape, dtype) in part.tensors.items():
            entry = sd_meta.setdefault(key, TensorStorageMetadata(
                properties=TensorProperties(dtype=dtype), size=torch.Size(shape), chunks=[]))
            entry.chunks += [ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s))
                             for o, s in part.chunks[key]]
        for key in part.objects:
            sd_meta[key] = BytesStorageMetadata()
        for key, offsets, fname, start, length in part.storage:
            idx = MetadataIndex(fqn=key, offset=None if offsets is None else torch.Size(offsets))
            storage[idx] = _StorageInfo(fname, start, length)
    for key, entry in sd_meta.items():
        if isinstance(entry, TensorStorageMetadata):
            covered = sum(torch.Size(c.sizes).numel() for c in entry.chunks)
            if covered != entry.size.numel():
                raise ValueError(f"{key}: chunks cover {covered} of {entry.size.numel()} elements")
    meta = Metadata(state_dict_metadata=sd_meta, storage_data=storage,
                    storage_meta=StorageMeta(checkpoint_id=out_dir, save_id=str(uuid.uuid4())),
                    version="1.0.0")
    with open(os.path.join(out_dir, ".metadata"), "wb") as f:
        pickle.dump(meta, f)
    torch.save({}, os.path.join(out_dir, "common.pt"))
    with open(os.path.join(out_dir, "metadata.json"), "w") as f:
        json.dump(MEGATRON_METADATA, f)
