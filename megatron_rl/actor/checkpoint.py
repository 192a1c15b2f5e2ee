"""Atomic, reshardable checkpoints with megatron ``dist_checkpointing``.

Layout of a checkpoint root::

    ROOT/latest                  text file naming the newest complete checkpoint ("step_0000012")
    ROOT/step_0000012/           dist_checkpointing dir: model + optimizer (sharded, reshardable)
    ROOT/step_0000012/trainer.pt common state: step, scheduler, trainer/controller state, data pos
    ROOT/step_0000012/rng/rank_00003.pt   per-rank RNG states (restored when the layout is equal)

A save writes ``step_N.tmp`` first; only after every rank finished does rank 0 rename it and then
replace ``latest`` (write a temp file, ``os.replace``). A crash at any point leaves the previous
checkpoint and ``latest`` intact; stale ``*.tmp`` dirs are ignored and cleaned up on the next save.
"""

from __future__ import annotations

import os
import random
import shutil
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from megatron_rl.actor.distopt_compat import SHARDING_TYPE
from megatron_rl.chaos_hook import phase_begins

LATEST = "latest"


class CheckpointError(RuntimeError):
    """A checkpoint cannot be read or does not fit this run."""


def step_dir_name(step: int) -> str:
    return f"step_{step:07d}"


def latest_checkpoint(root: str) -> str | None:
    """Path of the newest complete checkpoint under ``root``, or None."""
    path = os.path.join(root, LATEST)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        name = f.read().strip()
    full = os.path.join(root, name)
    if not os.path.isdir(full):
        raise CheckpointError(f"{path} names {name!r} but {full} does not exist")
    return full


def _rng_state() -> dict[str, Any]:
    from megatron.core import tensor_parallel

    tracker = tensor_parallel.get_cuda_rng_tracker()
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(),
            "python": random.getstate(),
            "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
            "tracker": {k: v.clone() for k, v in tracker.get_states().items()}}


def _set_rng_state(state: dict[str, Any]) -> None:
    from megatron.core import tensor_parallel

    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _layout_key() -> tuple[int, int, int]:
    from megatron.core import parallel_state as ps

    return (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(),
            ps.get_data_parallel_world_size())


def _sharded_state(model, optimizer, is_loading: bool, main_from=None
                   ) -> tuple[dict, dict[int, torch.Tensor]]:
    """The model (its fp32 main weights when ``main_from`` is a mixed-precision optimizer) and
    the optimizer state, as megatron sharded state dicts; and the fp32 tensors the model part's
    half-precision params point at (``{}`` for fp32 actors)."""
    from megatron_rl.actor.precision import (
        distributed_optimizers,
        fresh_main_buffers,
        main_param_map,
        optimizer_main_tensors,
        point_sharded_at_main,
    )

    module = getattr(model, "module", model)
    model_sd = module.sharded_state_dict(prefix="model.")
    sd = {"model": model_sd}
    if optimizer is not None:
        # The distributed optimizer's format (ignored by the standard one): loadable at any
        # TP/PP/DP layout (megatron_rl/actor/distopt_compat.py).
        sd["optimizer"] = optimizer.sharded_state_dict(
            model_sd, is_loading=is_loading,
            metadata={"distrib_optim_sharding_type": SHARDING_TYPE})
    mains: dict[int, torch.Tensor] = {}
    if main_from is not None:
        if not distributed_optimizers(main_from):
            mains = main_param_map(main_from)
        elif is_loading:  # full fp32 weights land here; each rank then keeps its DP shard
            mains = fresh_main_buffers(main_from)
        else:  # the main weights megatron's fully_reshardable state already gathered
            mains = optimizer_main_tensors(main_from, sd["optimizer"])
        point_sharded_at_main(model_sd, main_from, mains)  # after the optimizer mapped params
    return sd, mains


def save_checkpoint(root: str, step: int, model, optimizer, scheduler,
                    trainer_state: dict[str, Any] | None = None) -> str:
    """Save atomically; collective over all ranks. Returns the checkpoint path."""
    from megatron.core import dist_checkpointing

    rank = dist.get_rank()
    final = os.path.join(root, step_dir_name(step))
    tmp = final + ".tmp"
    if rank == 0:
        os.makedirs(root, exist_ok=True)
        for name in os.listdir(root):  # leftovers of a crashed save
            if name.endswith(".tmp"):
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)
        os.makedirs(tmp)
    dist.barrier()
    from megatron_rl.actor.precision import precision_of

    # The model part holds the fp32 main weights whatever the precision.
    sharded, _ = _sharded_state(model, optimizer, is_loading=False, main_from=optimizer)
    dist_checkpointing.save(sharded, tmp)
    os.makedirs(os.path.join(tmp, "rng"), exist_ok=True)
    torch.save(_rng_state(), os.path.join(tmp, "rng", f"rank_{rank:05d}.pt"))
    if rank == 0:
        torch.save({"step": step, "layout": _layout_key(), "precision": precision_of(model),
                    "scheduler": scheduler.state_dict() if scheduler is not None else None,
                    "trainer": trainer_state or {}}, os.path.join(tmp, "trainer.pt"))
    phase_begins("checkpoint", step)  # fault injection: files written, not yet renamed
    dist.barrier()
    if rank == 0:
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(tmp, final)
        pointer = os.path.join(root, LATEST + ".tmp")
        with open(pointer, "w") as f:
            f.write(step_dir_name(step))
            f.flush()
            os.fsync(f.fileno())
        os.replace(pointer, os.path.join(root, LATEST))
    dist.barrier()
    return final


def load_checkpoint(path: str, model, optimizer=None, scheduler=None,
                    restore_rng: bool = True) -> dict[str, Any]:
    """Load a checkpoint saved at any TP/PP/DP layout into this layout; collective.

    Returns ``{"step", "trainer", "rng_restored"}``. RNG states are restored only when the layout is
    unchanged (per-rank states do not map across layouts).
    """
    from megatron.core import dist_checkpointing

    meta_path = os.path.join(path, "trainer.pt")
    if not os.path.exists(meta_path):
        raise CheckpointError(f"{path} is not a megatron_rl checkpoint (no trainer.pt)")
    meta = torch.load(meta_path, weights_only=False)
    from megatron_rl.actor.precision import copy_main_to_model, precision_of, set_distopt_main

    saved_precision = meta.get("precision", "fp32")
    same_precision = saved_precision == precision_of(model)
    if optimizer is not None and not same_precision and dist.get_rank() == 0:
        print(f"[checkpoint] {path} was saved in {saved_precision}, this actor runs in "
              f"{precision_of(model)}: loading the fp32 weights; the optimizer moments restart",
              flush=True)
    load_opt = optimizer if same_precision else None
    # fp32 weights are read into the main params (mixed precision), then re-rounded.
    sd, mains = _sharded_state(model, load_opt, is_loading=True, main_from=optimizer)
    targets = {k: v.data for k, v in sd["model"].items()
               if isinstance(getattr(v, "data", None), torch.Tensor)}
    state = dist_checkpointing.load(sd, path)
    module = getattr(model, "module", model)
    module.load_state_dict(_strip_prefix(state["model"], "model."), strict=True)
    with torch.no_grad():  # the main params themselves (no-op when loaded in place)
        for k, t in targets.items():
            if k in state["model"] and t is not state["model"][k] and t.dtype == torch.float32:
                t.copy_(state["model"][k])
    if load_opt is not None:
        load_opt.load_state_dict(state["optimizer"])
    copy_main_to_model(optimizer)
    set_distopt_main(optimizer, mains)  # distributed optimizer: this rank's main shards
    if scheduler is not None and meta["scheduler"] is not None:
        scheduler.load_state_dict(meta["scheduler"])
    rng_ok = False
    if restore_rng and tuple(meta["layout"]) == _layout_key():
        rng_path = os.path.join(path, "rng", f"rank_{dist.get_rank():05d}.pt")
        if os.path.exists(rng_path):
            _set_rng_state(torch.load(rng_path, weights_only=False))
            rng_ok = True
    return {"step": meta["step"], "trainer": meta["trainer"], "rng_restored": rng_ok}


def _strip_prefix(sd: dict, prefix: str) -> dict:
    return {k[len(prefix):] if k.startswith(prefix) else k: v for k, v in sd.items()}
