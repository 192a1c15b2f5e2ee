"""Hugging Face safetensors checkpoint -> megatron ``dist_checkpointing`` checkpoint.

No model is built: each writer process reads one HF tensor (or the few it fuses, QKV and
gate/up) at a time, makes the canonical tensor and appends it to its data file of a megatron
``torch_dist`` checkpoint (:mod:`.dcp_stream`); rank 0 then writes the merged metadata. The
checkpoint is megatron's own layout-free format, so it loads at any TP/PP layout
(:func:`load_megatron_checkpoint`). Peak memory per process is about one tensor (plus what the
imports take), far below one safetensors shard.

Beside megatron's files the output holds ``megatron_rl_convert.json`` (model config and the
original ``config.json``) and ``hf_assets/`` (tokenizer files), which the reverse conversion uses.
"""

from __future__ import annotations

import os
import time
from typing import Callable, Iterator, Mapping

import torch

from megatron_rl.convert.ckpt_format import ASSETS, checkpoint_index, write_sidecar
from megatron_rl.convert.common import (
    ConvertError,
    FamilyMapping,
    TensorMap,
    hf_shapes,
    peak_rss_bytes,
    to_canonical,
)
from megatron_rl.convert.hf_io import HFCheckpoint, copy_assets
from megatron_rl.convert.registry import read_hf_config
from megatron_rl.models.config import ModelConfig, ModelConfigError, validate_for_layout
from megatron_rl.util.progress import Progress

Log = Callable[[str], None]





def _ignorable(name: str, cfg: ModelConfig) -> bool:
    """HF tensors that carry no weights of ours: RoPE caches, and ``lm_head`` when tied."""
    return name.endswith("rotary_emb.inv_freq") or (
        cfg.tie_word_embeddings and name == "lm_head.weight")


def validate_hf_checkpoint(ckpt: HFCheckpoint, cfg: ModelConfig,
                           mapping: FamilyMapping) -> list[TensorMap]:
    """Check names and shapes of every HF tensor against ``cfg`` (headers only, no data read).

    Raises :class:`ConvertError` for missing tensors, unexpected tensors, or a shape mismatch
    (naming the tensor, the checkpoint's shape and the shape config.json implies).
    """
    maps = mapping.tensor_maps(cfg)
    expected: dict[str, tuple[int, ...]] = {}
    for m in maps:
        expected.update(hf_shapes(m, cfg))
    present = set(ckpt.names())
    missing = [n for n in expected if n not in present]
    if missing:
        raise ConvertError(f"{ckpt.path}: {len(missing)} tensor(s) missing for "
                           f"{mapping.architectures[0]}: {missing[:5]}"
                           f"{' ...' if len(missing) > 5 else ''}")
    extra = sorted(n for n in present - set(expected) if not _ignorable(n, cfg))
    if extra:
        raise ConvertError(f"{ckpt.path}: {len(extra)} unexpected tensor(s) for "
                           f"{mapping.architectures[0]} with this config.json: {extra[:5]}"
                           f"{' ...' if len(extra) > 5 else ''}")
    for name, shape in expected.items():
        got = ckpt.info[name].shape
        if got != shape:
            raise ConvertError(f"shape mismatch for tensor {name!r}: checkpoint has "
                               f"{list(got)}, config.json implies {list(shape)}")
    return maps


class LazyCanonicalState(Mapping[str, torch.Tensor]):
    """Canonical full tensors made on demand from an HF checkpoint.

    ``state[name]`` reads the HF tensor(s) of ``name`` from disk and fuses them (QKV interleave,
    ``[gate; up]``); only the last one is kept, so a consumer that visits names one at a time (as
    :func:`megatron_rl.models.weights.load_full_state_dict` does) holds one full tensor at a time.
    """

    def __init__(self, ckpt: HFCheckpoint, maps: list[TensorMap], cfg: ModelConfig,
                 dtype: torch.dtype | None = None, log: Log | None = None,
                 log_every_s: float = 10.0):
        self._ckpt, self._cfg, self._dtype, self._log = ckpt, cfg, dtype, log
        self._maps = {m.canonical: m for m in maps}
        self._last: tuple[str, torch.Tensor] | None = None
        self.loaded = 0
        self.bytes = 0
        self._t0 = self._t_log = time.monotonic()
        self._log_every_s = log_every_s

    def __getitem__(self, name: str) -> torch.Tensor:
        if self._last is not None and self._last[0] == name:
            return self._last[1]
        self._last = None  # drop the previous tensor before reading the next
        tmap = self._maps[name]
        full = to_canonical(tmap, [self._ckpt.get(n) for n in tmap.hf], self._cfg)
        if self._dtype is not None:
            full = full.to(self._dtype)
        self._last = (name, full)
        self.loaded += 1
        self.bytes += full.numel() * full.element_size()
        self._progress()
        return full

    def _progress(self) -> None:
        now = time.monotonic()
        if self._log and now - self._t_log >= self._log_every_s:
            self._t_log = now
            self._log(f"[hf->megatron] {self.loaded} tensors, {self.bytes / 2**30:.2f} GiB read "
                      f"in {now - self._t0:.0f}s, peak RSS {peak_rss_bytes() / 2**30:.2f} GiB")

    def __contains__(self, name: object) -> bool:
        return name in self._maps

    def __iter__(self) -> Iterator[str]:
        return iter(self._maps)

    def __len__(self) -> int:
        return len(self._maps)


def save_megatron_checkpoint(model: torch.nn.Module, out_dir: str) -> None:
    """``dist_checkpointing.save`` of the model's sharded state dict. Collective over all ranks."""
    from megatron.core import dist_checkpointing

    from megatron_rl.util.sync_save import use_in_process_results_queue

    os.makedirs(out_dir, exist_ok=True)
    # On CPU, megatron_rl.parallel.cpu_compat (enabled by init_parallel) covers the
    # torch.cuda.synchronize() that dist_checkpointing's save calls.
    use_in_process_results_queue()
    dist_checkpointing.save(model.sharded_state_dict(), out_dir)


def load_megatron_checkpoint(model: torch.nn.Module, ckpt_dir: str) -> None:
    """Load a ``dist_checkpointing`` checkpoint into this rank's model (any TP/PP layout).
    Collective over all ranks."""
    from megatron.core import dist_checkpointing

    state = dist_checkpointing.load(model.sharded_state_dict(), ckpt_dir)
    model.load_state_dict(state, strict=True)


def build_uninitialized_model(cfg: ModelConfig, params_dtype: torch.dtype) -> torch.nn.Module:
    """This rank's model stage with uninitialised weights (they are all loaded next).

    megatron-core skips ``set_tensor_model_parallel_attributes`` on weights when
    ``perform_initialization=False`` (``tensor_parallel/layers.py``), and the resharding code reads
    those attributes, so they are set here from the layer type.
    """
    from megatron.core.tensor_parallel import layers

    from megatron_rl.models.builder import build_gpt_model

    model = build_gpt_model(cfg, params_dtype=params_dtype, perform_initialization=False)
    dims = ((layers.VocabParallelEmbedding, 0), (layers.ColumnParallelLinear, 0),
            (layers.RowParallelLinear, 1))
    for module in model.modules():
        weight = getattr(module, "weight", None)
        for cls, dim in dims:
            if isinstance(module, cls) and weight is not None and not getattr(
                    weight, "tensor_model_parallel", False):
                layers.set_tensor_model_parallel_attributes(weight, True, dim, 1)
    return model


def _resolve_dtype(name: str | None, ckpt: HFCheckpoint) -> torch.dtype:
    if name is None:
        return ckpt.main_dtype()
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if name not in dtypes:
        raise ConvertError(f"dtype={name!r} is not supported (supported: {', '.join(dtypes)})")
    return dtypes[name]


def prepare(hf_dir: str, out_dir: str | None, tp: int, pp: int, dtype: str | None = None
            ) -> tuple[dict, ModelConfig, FamilyMapping, HFCheckpoint, list[TensorMap],
                       torch.dtype]:
    """Every check that needs no process group: config, layout, tensor names and shapes."""
    raw, cfg, mapping = read_hf_config(hf_dir)
    try:
        validate_for_layout(cfg, tp, pp)
    except ModelConfigError as exc:
        raise ConvertError(str(exc)) from exc
    ckpt = HFCheckpoint(hf_dir)
    maps = validate_hf_checkpoint(ckpt, cfg, mapping)
    if out_dir is not None and os.path.isdir(out_dir) and os.listdir(out_dir):
        raise ConvertError(f"output directory {out_dir} is not empty")
    return raw, cfg, mapping, ckpt, maps, _resolve_dtype(dtype, ckpt)


def extra_state_keys(cfg: ModelConfig) -> list[str]:
    """The ``_extra_state`` object keys megatron's ``sharded_state_dict`` of ``cfg`` holds (local
    spec): the linear layers of every decoder layer; with MoE, each expert's instead of the dense
    MLP's (``.../shard_{layer}.{expert}_{layers}.{experts}``)."""
    from megatron_rl.convert.dcp_stream import EXTRA_STATE_MODULES

    n, e = cfg.num_hidden_layers, cfg.num_experts
    mods = [m for m in EXTRA_STATE_MODULES if not (cfg.is_moe and m.startswith("mlp."))]
    keys = [f"decoder.layers.{mod}._extra_state/shard_{layer}_{n}"
            for layer in range(n) for mod in mods]
    if cfg.is_moe:
        keys += [f"decoder.layers.mlp.experts.experts.{fc}._extra_state/shard_{layer}.{x}_{n}.{e}"
                 for layer in range(n) for x in range(e) for fc in ("linear_fc1", "linear_fc2")]
    return keys


def stream_tensors(hf_dir: str, out_dir: str, cfg: ModelConfig, maps: list[TensorMap],
                   ckpt: HFCheckpoint, params_dtype: torch.dtype, writer_rank: int = 0,
                   world: int = 1, log: Log | None = None):
    """Write this writer's share (every ``world``-th tensor) of the checkpoint's chunks; returns
    its :class:`~megatron_rl.convert.dcp_stream.DcpPart`. Holds one canonical tensor (and the HF
    tensors it is fused from) at a time."""
    from megatron_rl.convert.dcp_stream import DcpStreamWriter

    n_layers = cfg.num_hidden_layers
    writer = DcpStreamWriter(out_dir, writer_rank)
    state = LazyCanonicalState(ckpt, maps, cfg, params_dtype, log)
    bar = Progress(len(range(writer_rank, len(maps), world)), "hf->megatron", unit="tensors",
                   enabled=writer_rank == 0, min_s=2.0)
    for i, tmap in enumerate(maps):
        if i % world != writer_rank:
            continue
        full = state[tmap.canonical]
        key, lead = checkpoint_index(tmap.canonical)
        stack = (n_layers, cfg.num_experts)[:len(lead)]  # [layers(, experts)] axes of the key
        writer.add_chunk(key, (*stack, *full.shape), lead + (0,) * full.dim(),
                         full.reshape((1,) * len(lead) + tuple(full.shape)))
        state._last = None  # noqa: SLF001 - drop the tensor before reading the next
        del full
        bar.update(info=f"{state.bytes / 2**30:.2f} GiB read")
    for j, key in enumerate(extra_state_keys(cfg)):
        if (len(maps) + j) % world == writer_rank:
            writer.add_object(key, [None])
    bar.close()
    return writer.close(), state


def convert_rank(hf_dir: str, out_dir: str, dtype: str | None = None,
                 log: Log | None = None) -> dict:
    """This rank's share of the conversion (streamed: every ``world``-th tensor, one at a time,
    no model built). Collective over the default group (the metadata is gathered to rank 0).
    Returns ``tensors`` written and ``bytes`` read on this rank."""
    import torch.distributed as dist

    from megatron_rl.convert.dcp_stream import write_dcp_metadata

    rank, world = dist.get_rank(), dist.get_world_size()
    raw, cfg, _, ckpt, maps, params_dtype = prepare(hf_dir, None, 1, 1, dtype)
    part, state = stream_tensors(hf_dir, out_dir, cfg, maps, ckpt, params_dtype, rank, world,
                                 log)
    parts: list = [None] * world
    dist.all_gather_object(parts, part)
    if rank == 0:
        write_dcp_metadata(out_dir, parts)
        write_sidecar(out_dir, cfg, raw, str(params_dtype).replace("torch.", ""))
        copy_assets(hf_dir, os.path.join(out_dir, ASSETS), log or (lambda _m: None))
    dist.barrier()
    if log:
        log(f"[hf->megatron] wrote {state.loaded} tensors, {state.bytes / 2**30:.3f} GiB")
    return {"tensors": state.loaded, "bytes": state.bytes}


def hf_to_megatron_worker(hf_dir: str, out_dir: str, tp: int, pp: int, dtype: str | None = None,
                          timeout_s: float = 3600.0, quiet: bool = False) -> dict:
    """One writer process of the conversion (spawned, or each torchrun/SLURM rank). ``tp`` and
    ``pp`` are only checked (the checkpoint loads at any layout). Returns this rank's stats
    (``tensors``, ``bytes``, ``wall_s``, ``peak_rss``)."""
    import torch.distributed as dist

    from megatron_rl.parallel import runtime

    t0 = time.monotonic()
    runtime.init_distributed(timeout_s=timeout_s)
    rank = dist.get_rank()
    log = None if quiet else (lambda m: print(f"[rank {rank}] {m}", flush=True))
    stats = convert_rank(hf_dir, out_dir, dtype, log)
    dist.destroy_process_group()
    return dict(stats, rank=rank, wall_s=time.monotonic() - t0, peak_rss=peak_rss_bytes())


def convert_hf_to_megatron(hf_dir: str, out_dir: str, tp: int = 1, pp: int = 1,
                           dtype: str | None = None, timeout_s: float = 3600.0,
                           log: Log = print) -> list[dict]:
    """Convert an HF checkpoint directory to a megatron ``dist_checkpointing`` checkpoint.

    Validates everything first in this process (including that the model splits at TPxPP),
    then streams the tensors into the checkpoint with ``tp*pp`` writer processes (every
    ``tp*pp``-th tensor each; peak memory per process is about one tensor, not a model stage): in
    place when this process is already one rank of a launched job (``WORLD_SIZE > 1`` from
    torchrun/SLURM; every rank must call this), else on freshly spawned local processes.
    ``dtype`` (None: the checkpoint's) is the stored dtype. Returns per-rank stats.
    """
    from megatron_rl.parallel.launch import spawn

    _, cfg, _, ckpt, maps, params_dtype = prepare(hf_dir, out_dir, tp, pp, dtype)
    log(f"[hf->megatron] {cfg.family}: {len(maps)} tensors, "
        f"{sum(i.nbytes for i in ckpt.info.values()) / 2**30:.3f} GiB in "
        f"{len(set(i.file for i in ckpt.info.values()))} file(s) -> {out_dir} "
        f"({params_dtype}, converted at TP{tp}xPP{pp})")
    os.makedirs(out_dir, exist_ok=True)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return [hf_to_megatron_worker(hf_dir, out_dir, tp, pp, dtype, timeout_s)]
    stats = spawn(hf_to_megatron_worker, tp * pp, (hf_dir, out_dir, tp, pp, dtype, timeout_s),
                  timeout_s=timeout_s)
    log(f"[hf->megatron] done in {max(s['wall_s'] for s in stats):.1f}s, peak RSS per rank "
        f"{max(s['peak_rss'] for s in stats) / 2**30:.2f} GiB")
    return stats
