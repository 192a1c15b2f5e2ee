"""megatron ``dist_checkpointing`` checkpoint -> Hugging Face sharded safetensors + config.json.

No model is built and megatron is not imported: megatron's ``torch_dist`` format is a PyTorch DCP
checkpoint whose keys stack all layers along a leading axis (``decoder.layers.<name>`` of shape
``[L, ...]``, local-spec norms under their Transformer Engine names). Its metadata fixes
every shape, a shard plan is made up front (consecutive whole tensors up to ``max_shard_bytes``),
and each output shard is produced by one DCP read of exactly the layer slices it holds, split
into HF tensors and written. Peak memory is about one output shard plus one tensor.

Distributed: with ``world_size`` processes (e.g. ``torchrun --nproc-per-node N``, rank and world
read from ``RANK``/``WORLD_SIZE``) rank r writes shards r, r+N, ...; rank 0 also writes the index,
``config.json`` and the tokenizer assets. Ranks never talk to each other (DCP reads without a
process group), so they may run on different machines sharing a filesystem.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from megatron_rl.convert.ckpt_format import ASSETS, checkpoint_index, read_sidecar
from megatron_rl.convert.common import (
    ConvertError,
    FamilyMapping,
    TensorMap,
    canonical_shape,
    peak_rss_bytes,
    to_hf,
)
from megatron_rl.convert.hf_io import (
    copy_assets,
    plan_shards,
    shard_file_names,
    write_index,
    write_shard,
)
from megatron_rl.convert.registry import hf_config_dict, mapping_for, model_config_from_hf
from megatron_rl.models.config import ModelConfig
from megatron_rl.util.progress import Progress

Log = Callable[[str], None]
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class CkptTensor:
    """Where one canonical tensor lives in the checkpoint: its key, and its index along the
    key's leading axes (``lead``: ``()``, ``(layer,)``, or ``(layer, expert)`` for MoE experts;
    ``stack`` the sizes of those axes)."""

    tmap: TensorMap
    key: str
    lead: tuple[int, ...]
    stack: tuple[int, ...]
    shape: tuple[int, ...]
    dtype: torch.dtype

    def nbytes(self, dtype: torch.dtype | None = None) -> int:
        """Bytes of the tensor stored as ``dtype`` (None: as in the checkpoint)."""
        size = torch.empty((), dtype=dtype or self.dtype).element_size()
        return torch.Size(self.shape).numel() * size


class _SlicePlanner(DefaultLoadPlanner):
    """DCP load planner reading, for each requested key, one chunk ``(offsets, sizes)`` of the
    stored global tensor into the state dict's buffer of shape ``sizes`` (e.g. one layer of a
    ``decoder.layers.*`` tensor that stacks all layers)."""

    def __init__(self, chunks: dict[str, tuple[tuple[int, ...], tuple[int, ...]]]):
        super().__init__()
        self._chunks = chunks

    def create_local_plan(self) -> LoadPlan:
        items = []
        for key, (offsets, sizes) in self._chunks.items():
            chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
            items += create_read_items_for_chunk_list(
                key, self.metadata.state_dict_metadata[key], [chunk])
        return LoadPlan(items)

    def lookup_tensor(self, index) -> torch.Tensor:
        # Our buffers are plain tensors holding exactly the requested chunk; DCP's read items
        # address them with chunk-relative ``dest_offsets``.
        return self.state_dict[index.fqn]


def read_checkpoint_metadata(ckpt_dir: str) -> dict[str, Any]:
    """``{key: TensorStorageMetadata}`` of a megatron ``torch_dist`` checkpoint (no data read)."""
    cfg_path = os.path.join(ckpt_dir, "metadata.json")
    if not os.path.isfile(cfg_path):
        raise ConvertError(f"{ckpt_dir} is not a megatron dist_checkpointing checkpoint "
                           "(no metadata.json)")
    with open(cfg_path) as f:
        backend = json.load(f).get("sharded_backend")
    if backend != "torch_dist":
        raise ConvertError(f"{ckpt_dir}: sharded_backend={backend!r} is not supported "
                           "(supported: 'torch_dist')")
    meta = FileSystemReader(ckpt_dir).read_metadata().state_dict_metadata
    return {k: v for k, v in meta.items() if isinstance(v, TensorStorageMetadata)}


def load_tensors(ckpt_dir: str, items: list[CkptTensor]) -> list[torch.Tensor]:
    """Read exactly ``items`` from the checkpoint: per stacked key, the box of layers (and
    experts) the items span (consecutive items of the checkpoint order span a contiguous range of
    each key).

    Uses torch DCP without a process group, so concurrent converter processes never talk.
    """
    lows: dict[str, list[int]] = {}
    highs: dict[str, list[int]] = {}
    for it in items:
        lo, hi = lows.setdefault(it.key, list(it.lead)), highs.setdefault(it.key, list(it.lead))
        for d, i in enumerate(it.lead):
            lo[d], hi[d] = min(lo[d], i), max(hi[d], i)
    state: dict[str, torch.Tensor] = {}
    chunks: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {}
    for it in items:
        if it.key in chunks:
            continue
        lo, hi = lows[it.key], highs[it.key]
        offsets = (*lo, *(0,) * len(it.shape))
        sizes = (*(h - l + 1 for l, h in zip(lo, hi, strict=True)), *it.shape)  # noqa: E741
        chunks[it.key] = (offsets, sizes)
        state[it.key] = torch.empty(sizes, dtype=it.dtype)
    dcp.load(state, storage_reader=FileSystemReader(ckpt_dir), planner=_SlicePlanner(chunks),
             no_dist=True)
    return [state[it.key][tuple(i - lo for i, lo in zip(it.lead, lows[it.key], strict=True))]
            for it in items]


def resolve_model_config(ckpt_dir: str, hf_config: dict | None = None,
                         preset: str | None = None) -> tuple[ModelConfig, dict | None]:
    """Model config of a checkpoint: an explicit HF config dict, a preset name, or the sidecar
    written by the HF->megatron conversion. Returns ``(cfg, original HF config or None)``."""
    from megatron_rl.models.config import get_preset

    if hf_config is not None:
        return model_config_from_hf(hf_config)[0], hf_config
    if preset is not None:
        return get_preset(preset), None
    side = read_sidecar(ckpt_dir)
    if side is None:
        raise ConvertError(f"{ckpt_dir} has no megatron_rl_convert.json; pass the model config "
                           "(an HF config.json or a model preset)")
    return ModelConfig(**side["model_config"]), side.get("hf_config")


def _key_prefix(meta: dict[str, Any]) -> str:
    """The model's key prefix ("" or "model."); the shortest one, since a training checkpoint
    also holds optimizer states under longer prefixes ("optimizer.state.exp_avg.model.")."""
    found = [key[: -len("decoder.final_layernorm.weight")] for key in meta
             if key.endswith("decoder.final_layernorm.weight")]
    if found:
        return min(found, key=len)
    raise ConvertError("checkpoint holds no 'decoder.final_layernorm.weight': not a megatron "
                       "GPT model checkpoint")


def locate_tensors(meta: dict[str, Any], cfg: ModelConfig,
                   mapping: FamilyMapping) -> list[CkptTensor]:
    """Match every tensor map of ``cfg`` to a checkpoint key, checking global shapes.

    Raises :class:`ConvertError` for missing or unexpected model tensors and shape mismatches.
    """
    prefix = _key_prefix(meta)
    located, used = [], set()
    n_layers = cfg.num_hidden_layers
    for tmap in mapping.tensor_maps(cfg):
        key, lead = checkpoint_index(tmap.canonical, prefix)
        if key not in meta:
            raise ConvertError(f"checkpoint has no tensor {key!r} (needed for {tmap.canonical!r})")
        shape = canonical_shape(tmap.canonical, cfg)
        stack = (n_layers, cfg.num_experts)[:len(lead)]
        want = (*stack, *shape)
        got = tuple(meta[key].size)
        if got != want:
            raise ConvertError(f"shape mismatch for tensor {key!r}: checkpoint has {list(got)}, "
                               f"the model config implies {list(want)}")
        used.add(key)
        located.append(CkptTensor(tmap, key, lead, stack, shape, meta[key].properties.dtype))
    model_keys = {k for k in meta if k.startswith(tuple(f"{prefix}{p}" for p in (
        "embedding.", "decoder.", "output_layer.")))}
    extra = sorted(model_keys - used)
    if extra:
        raise ConvertError(f"checkpoint has {len(extra)} model tensor(s) this config does not "
                           f"have: {extra[:5]}")
    return located


def convert_megatron_to_hf(ckpt_dir: str, out_dir: str, *, hf_config: dict | None = None,
                           preset: str | None = None, dtype: str | None = None,
                           max_shard_bytes: int = 2 * 2**30, rank: int | None = None,
                           world_size: int | None = None, log: Log = print) -> dict:
    """Write ``out_dir`` (safetensors shards, index, config.json, assets) from ``ckpt_dir``.

    ``dtype`` (None: as stored) casts the written tensors. ``rank``/``world_size`` default to the
    ``RANK``/``WORLD_SIZE`` environment. Returns stats: ``shards`` written by this rank, ``bytes``,
    ``wall_s``, ``peak_rss``, ``max_shard_bytes`` (largest written).
    """
    t0 = time.monotonic()
    rank = int(os.environ.get("RANK", "0")) if rank is None else rank
    world_size = int(os.environ.get("WORLD_SIZE", "1")) if world_size is None else world_size
    cfg, raw_hf = resolve_model_config(ckpt_dir, hf_config, preset)
    mapping = mapping_for(cfg)
    if dtype is not None and dtype not in _DTYPES:
        raise ConvertError(f"dtype={dtype!r} is not supported (supported: {', '.join(_DTYPES)})")
    out_dtype = _DTYPES.get(dtype) if dtype else None
    os.makedirs(out_dir, exist_ok=True)
    meta = read_checkpoint_metadata(ckpt_dir)
    items = locate_tensors(meta, cfg, mapping)
    shards = plan_shards([it.nbytes(out_dtype) for it in items], max_shard_bytes)
    names = shard_file_names(len(shards))
    stored = str(items[0].dtype).replace("torch.", "") if out_dtype is None else dtype
    if rank == 0:
        _write_metadata(out_dir, items, shards, names, out_dtype, cfg, raw_hf, stored,
                        ckpt_dir, log)
    written, nbytes, biggest = [], 0, 0
    mine = range(rank, len(shards), world_size)
    bar = Progress(len(mine), "megatron->hf", unit="shards", enabled=rank == 0, min_s=2.0)
    for s in mine:
        chunk = [items[i] for i in shards[s]]
        loaded = load_tensors(ckpt_dir, chunk)
        tensors = []
        for it, full in zip(chunk, loaded, strict=True):
            for name, t in to_hf(it.tmap, full, cfg):
                tensors.append((name, t if out_dtype is None else t.to(out_dtype)))
        size = write_shard(os.path.join(out_dir, names[s]), tensors)
        del tensors, loaded
        written.append(names[s])
        nbytes += size
        biggest = max(biggest, size)
        log(f"[megatron->hf] rank {rank}: wrote {names[s]} ({size / 2**20:.1f} MiB, "
            f"{len(chunk)} tensors), {time.monotonic() - t0:.1f}s, peak RSS "
            f"{peak_rss_bytes() / 2**30:.2f} GiB")
        bar.update(info=f"{nbytes / 2**30:.2f} GiB written")
    bar.close()
    return {"rank": rank, "shards": written, "bytes": nbytes, "max_shard_bytes": biggest,
            "wall_s": time.monotonic() - t0, "peak_rss": peak_rss_bytes()}


def _write_metadata(out_dir: str, items: list[CkptTensor], shards: list[list[int]],
                    names: list[str], out_dtype: torch.dtype | None, cfg: ModelConfig,
                    raw_hf: dict | None, dtype: str, ckpt_dir: str, log: Log) -> None:
    """Index, config.json and assets (rank 0)."""
    weight_map = {hf: names[s] for s, idx in enumerate(shards) for i in idx
                  for hf in items[i].tmap.hf}
    write_index(out_dir, weight_map, sum(it.nbytes(out_dtype) for it in items))
    config = dict(raw_hf) if raw_hf else hf_config_dict(cfg, dtype)
    config["torch_dtype"] = dtype
    if "dtype" in config or not raw_hf:
        config["dtype"] = dtype
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    copy_assets(os.path.join(ckpt_dir, ASSETS), out_dir, log)
    log(f"[megatron->hf] {len(items)} tensors in {len(shards)} shard(s) -> {out_dir}")
