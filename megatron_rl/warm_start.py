"""Initial weights of a fresh run: ``model.init_weights``, or a supervised warm start, or the
seeded init; and the frozen reference policy's weights for KL terms (saved with the run so that a
resumed run finds the same reference)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from megatron_rl.config import RunConfig


def initial_weights(cfg: RunConfig, tokenizer, train_rows, make_actor) -> tuple[dict | None, list]:
    """``(canonical full state or None, SFT log)`` for a fresh run (SPMD over all ranks)."""
    from megatron_rl.sft import run_sft

    if cfg.model.init_weights:
        return torch.load(cfg.model.init_weights, weights_only=True), []
    if cfg.sft.steps > 0:
        return run_sft(cfg, tokenizer, train_rows, make_actor)
    return None, []


def reference_weights(run_dir: str, needed: bool, init_state, resuming: bool) -> dict | None:
    """Initial weights of the frozen reference policy (KL term only). A fresh run with a warm
    start writes them to ``run_dir/reference_weights.pt`` so that a resumed run finds them."""
    if not needed:
        return None
    path = os.path.join(run_dir, "reference_weights.pt")
    if not resuming:
        if dist.get_rank() == 0 and init_state is not None:
            torch.save(init_state, path + ".tmp")
            os.replace(path + ".tmp", path)
        return init_state
    dist.barrier()
    return torch.load(path, weights_only=True) if os.path.exists(path) else None
