"""Hugging Face exports of a run's checkpoints.

A checkpoint ``RUN/checkpoints/step_0000009`` (megatron ``dist_checkpointing``) gets a sibling
directory ``RUN/checkpoints/step_0000009/hf`` holding ``config.json``, sharded safetensors with
their index, and the tokenizer files of the model directory: ``transformers`` loads it with
``AutoModelForCausalLM.from_pretrained``. The export reuses the model-free converter
(:func:`megatron_rl.convert.megatron_to_hf.convert_megatron_to_hf`): it reads exactly the layer
slices of one output shard at a time from the checkpoint on disk, so no rank holds more than one
shard; with ``W`` ranks, rank ``r`` writes shards ``r, r+W, ...``.

* During training: every checkpoint when ``trainer.export_hf`` is true (default: true when the
  model came from ``model.hf_path``) — :class:`ExportingActor` wraps :meth:`Actor.save`.
* Afterwards: ``python -m megatron_rl export RUN_DIR [--step N] --out DIR``.
"""

from __future__ import annotations

import os
import shutil
from typing import Callable

import torch.distributed as dist

from megatron_rl.actor.actor import Actor
from megatron_rl.config.sections import RunConfig

HF_SUBDIR = "hf"
PEFT_SUBDIR = "peft"  # LoRA runs: the PEFT adapter directory of each checkpoint
_DTYPES = ("float32", "bfloat16", "float16")


def export_enabled(cfg: RunConfig) -> bool:
    """``trainer.export_hf``, defaulting to true for a model from ``model.hf_path``."""
    from megatron_rl.convert.model_source import source_kind

    flag = cfg.trainer.export_hf
    return source_kind(cfg.model) == "hf" if flag is None else bool(flag)


def actor_class(cfg: RunConfig) -> type:
    """:class:`ExportingActor` (bound to ``cfg``) when exports are on, else :class:`Actor`."""
    if not export_enabled(cfg):
        return Actor
    return type("ExportingActor", (ExportingActor,), {"run_cfg": cfg})


class ExportingActor(Actor):
    """An actor whose every checkpoint also gets an HF export (``<checkpoint>/hf``)."""

    run_cfg: RunConfig

    def save(self, root: str, step: int, trainer_state: dict | None = None) -> str:
        path = super().save(root, step, trainer_state)
        self.wait_for_save()  # trainer.async_save: the export reads (and joins) the finished one
        if self.lora is not None:  # adapter-only checkpoint: export from the live actor
            export_lora(self, path, self.run_cfg)
            dist.barrier()
            return path
        export_checkpoint(path, self.run_cfg, os.path.join(path, HF_SUBDIR),
                          rank=dist.get_rank(), world_size=dist.get_world_size())
        dist.barrier()
        return path


def export_lora(actor: Actor, ckpt_dir: str, cfg: RunConfig) -> None:
    """A LoRA actor's exports next to its checkpoint (collective): ``<ckpt>/peft`` (PEFT adapter
    directory) and ``<ckpt>/hf`` (merged weights, with the tokenizer files)."""
    from megatron_rl.convert.hf_io import copy_assets
    from megatron_rl.convert.lora_export import export_merged_hf, export_peft
    from megatron_rl.convert.model_source import tokenizer_dir

    export_peft(actor, os.path.join(ckpt_dir, PEFT_SUBDIR), base_model=cfg.model.hf_path)
    out = export_merged_hf(actor, os.path.join(ckpt_dir, HF_SUBDIR))
    tok = tokenizer_dir(cfg.model)
    if out is not None and tok:
        copy_assets(tok, out, lambda _m: None)


def export_checkpoint(ckpt_dir: str, cfg: RunConfig, out_dir: str, rank: int = 0,
                      world_size: int = 1, max_shard_bytes: int = 2 * 2**30,
                      log: Callable[[str], None] = lambda _m: None) -> str:
    """Write the HF directory of checkpoint ``ckpt_dir`` of a run with config ``cfg``.

    Every one of the ``world_size`` callers writes its share of the shards into ``out_dir +
    '.tmp'``; the caller of rank 0 renames it to ``out_dir`` once all shards exist (a barrier
    between the two is the caller's when ranks are processes; with ``world_size == 1`` nothing
    else is needed). The dtype is the model directory's (``torch_dtype`` of its config.json),
    float32 for presets."""
    from megatron_rl.convert.hf_io import copy_assets
    from megatron_rl.convert.megatron_to_hf import convert_megatron_to_hf
    from megatron_rl.convert.model_source import DEFAULT_PRESET, hf_config_of, tokenizer_dir

    raw = hf_config_of(cfg.model)
    dtype = None
    if raw:
        dtype = raw.get("torch_dtype") or raw.get("dtype")
        dtype = dtype if dtype in _DTYPES else None
    tmp = out_dir + ".tmp"
    if rank == 0 and os.path.exists(tmp):
        shutil.rmtree(tmp)
    if world_size > 1:
        dist.barrier()
    convert_megatron_to_hf(ckpt_dir, tmp, hf_config=raw,
                           preset=None if raw else (cfg.model.preset or DEFAULT_PRESET),
                           dtype=dtype, max_shard_bytes=max_shard_bytes, rank=rank,
                           world_size=world_size, log=log)
    if world_size > 1:
        dist.barrier()
    if rank == 0:
        tok = tokenizer_dir(cfg.model)
        if tok:
            copy_assets(tok, tmp, log)
        if os.path.exists(out_dir):
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    return out_dir


def checkpoint_for_step(run_dir: str, step: int | None) -> str:
    """The checkpoint directory after ``step`` completed RL steps (None: the newest)."""
    from megatron_rl.actor.checkpoint import latest_checkpoint, step_dir_name

    root = os.path.join(run_dir, "checkpoints")
    if step is None:
        path = latest_checkpoint(root)
        if path is None:
            raise FileNotFoundError(f"no checkpoint under {root}")
        return path
    path = os.path.join(root, step_dir_name(step - 1))
    if not os.path.isdir(path):
        have = sorted(int(n[5:]) + 1 for n in os.listdir(root) if n.startswith("step_")
                      and not n.endswith(".tmp")) if os.path.isdir(root) else []
        raise FileNotFoundError(f"no checkpoint after step {step} in {root} (checkpoints exist "
                                f"after steps {have})")
    return path


def load_run_config(run_dir: str) -> RunConfig:
    """The :class:`RunConfig` a run saved in ``run_dir/config.json``."""
    import json

    from megatron_rl.config.load import _build

    path = os.path.join(run_dir, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{run_dir} is not a run directory (no config.json)")
    with open(path) as f:
        return _build(RunConfig, json.load(f), "")


def export_run(run_dir: str, step: int | None, out_dir: str, fmt: str = "hf") -> str:
    """``python -m megatron_rl export``: the HF directory of a run's checkpoint (one process).
    A LoRA run's checkpoints hold the adapters only; their exports were written at save time
    (``fmt``: ``hf`` the merged weights, ``peft`` the adapter directory) and are copied."""
    cfg = load_run_config(run_dir)
    ckpt = checkpoint_for_step(run_dir, step)
    if cfg.actor.lora.enabled:
        src = os.path.join(ckpt, PEFT_SUBDIR if fmt == "peft" else HF_SUBDIR)
        if not os.path.isdir(src):
            raise FileNotFoundError(f"{src} does not exist: a LoRA checkpoint holds the adapters "
                                    "only, and its exports are written when it is saved "
                                    "(trainer.export_hf: true)")
        if os.path.exists(out_dir):
            shutil.rmtree(out_dir)
        shutil.copytree(src, out_dir)
        return out_dir
    if fmt == "peft":
        raise ValueError(f"--format peft needs a LoRA run; {run_dir} trained all weights "
                         "(actor.lora.rank 0)")
    return export_checkpoint(ckpt, cfg, out_dir, log=print)
