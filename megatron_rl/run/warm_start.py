"""Initial weights of a fresh run: ``model.init_weights``, or a supervised warm start (from the
model's checkpoint when it has one), or the model's checkpoint (``model.hf_path`` /
``model.megatron_ckpt``: a weight source each rank loads its own shard from), or the seeded init;
and the frozen reference policy's weights for KL terms (saved with the run so that a
resumed run finds the same reference)."""

from __future__ import annotations

import functools
import json
import os

import torch
import torch.distributed as dist

from megatron_rl.config.sections import RunConfig


def initial_weights(cfg: RunConfig, tokenizer, train_rows, make_actor) -> tuple[dict | None, list]:
    """``(initial weights or None, SFT log)`` for a fresh run (SPMD over all ranks). The weights
    are a canonical full state dict, or a weight source (``load_into(model)``) that each rank
    loads its own shard from."""
    from megatron_rl.convert.model_source import weight_source
    from megatron_rl.run.sft import run_sft

    if cfg.model.init_weights:
        return torch.load(cfg.model.init_weights, weights_only=True), []
    source = weight_source(cfg.model)
    if cfg.sft.steps > 0:
        if source is not None:  # the SFT actor starts from the checkpoint too
            make_actor = functools.partial(_with_state, make_actor, source)
        return run_sft(cfg, tokenizer, train_rows, make_actor)
    return source, []


def _with_state(make_actor, state, *args, **kwargs):
    kwargs.setdefault("full_state", state)
    return make_actor(*args, **kwargs)


def reference_weights(run_dir: str, needed: bool, init_state, resuming: bool) -> dict | None:
    """Initial weights of the frozen reference policy (KL term only). A fresh run with a warm
    start writes them to ``run_dir/reference_weights.pt`` (a weight source: where it reads from,
    ``reference_source.json``) so that a resumed run finds them."""
    if not needed:
        return None
    path = os.path.join(run_dir, "reference_weights.pt")
    src_path = os.path.join(run_dir, "reference_source.json")
    if not resuming:
        if dist.get_rank() == 0 and init_state is not None:
            if hasattr(init_state, "describe"):
                with open(src_path + ".tmp", "w") as f:
                    json.dump(init_state.describe(), f)
                os.replace(src_path + ".tmp", src_path)
            else:
                torch.save(init_state, path + ".tmp")
                os.replace(path + ".tmp", path)
        return init_state
    dist.barrier()
    if os.path.exists(src_path):
        from megatron_rl.convert.model_source import source_from_description

        with open(src_path) as f:
            return source_from_description(json.load(f))
    return torch.load(path, weights_only=True) if os.path.exists(path) else None
