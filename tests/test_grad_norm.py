"""The layout-invariant gradient norm: float64 sum of squares, and bit-identical pipeline-parallel
updates with gradient clipping active."""

from __future__ import annotations

import re

import pytest
import torch

from megatron_rl.actor.grad_norm import CHUNK, _sum_squares
from megatron_rl.parallel.launch import spawn


def test_sum_squares_is_float64_and_chunked():
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(CHUNK + 17, generator=g), torch.randn(3, 5, generator=g)]
    ref = sum(float((t.double() ** 2).sum()) for t in grads)
    got = _sum_squares(grads, torch.device("cpu"))
    assert got.dtype == torch.float64 and abs(float(got) - ref) <= 1e-12 * ref
    # a split of the same elements into different tensors (another TP/PP layout) agrees to
    # float64 rounding, far below one fp32 ulp
    flat = torch.cat([t.reshape(-1) for t in grads])
    split = _sum_squares(list(flat.split(1000)), torch.device("cpu"))
    assert abs(float(split) - float(got)) <= 1e-13 * ref


def _step_worker(tp: int, pp: int) -> dict:
    from megatron.core import parallel_state as ps

    from megatron_rl.actor.actor import Actor
    from megatron_rl.actor.optim import OptimConfig
    from megatron_rl.actor.train_step import ActorConfig
    from megatron_rl.cli.check import make_batch
    from megatron_rl.loss import LossConfig
    from megatron_rl.models.config import get_preset
    from megatron_rl.parallel import runtime

    runtime.init_parallel(tp=tp, pp=pp, dp=1, timeout_s=300)
    cfg = get_preset("tiny")
    actor = Actor(cfg, ActorConfig(micro_batch_size=4), OptimConfig(lr=1e-3, clip_grad=0.5),
                  LossConfig.for_algorithm("dapo"), total_steps=3, seed=1)
    (mb,) = make_batch(1, 8, 32, cfg.vocab_size, seed=0)
    mb["advantages"] = torch.randn(8, 1, generator=torch.Generator().manual_seed(0)) * mb["mask"]
    actor.add_old_logprobs(mb)
    metrics = actor.update(mb, 0)
    offset = ps.get_pipeline_model_parallel_rank() * cfg.num_hidden_layers // pp
    weights = {re.sub(r"layers\.(\d+)\.", lambda m: f"layers.{int(m.group(1)) + offset}.", n):
               p.detach().clone() for n, p in actor.model.named_parameters()}
    norm = metrics[-1]["actor/grad_norm"] if metrics else None
    runtime.shutdown()
    return {"weights": weights, "grad_norm": norm}


@pytest.mark.slow
def test_pipeline_parallel_update_is_bit_identical_with_clipping():
    (ref,) = spawn(_step_worker, 1, (1, 1), timeout_s=300)
    assert ref["grad_norm"] > 0.5  # clipping is active
    got: dict = {}
    norms = []
    for r in spawn(_step_worker, 2, (1, 2), timeout_s=300):
        got.update(r["weights"])
        norms.append(r["grad_norm"])
    assert set(got) == set(ref["weights"])
    for name, w in ref["weights"].items():
        assert torch.equal(w, got[name]), name
    # the logged norm agrees to float64 rounding (megatron's fp32 per-stage sums: ~1e-8)
    assert all(abs(n - ref["grad_norm"]) <= 1e-12 * ref["grad_norm"] for n in norms)
