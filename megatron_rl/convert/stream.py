"""Stream HF-named full tensors out of a live, sharded megatron model, bucketed by a byte budget.

This is what rollout weight sync sends after each optimizer step. For each parameter of this rank's
pipeline stage, in order: all-gather its tensor-parallel shards (megatron's fc1 shard
``[gate_r; up_r]`` is re-laid out to ``[gate; up]``), split the canonical tensor into its HF
tensors (QKV per-group interleave -> ``q_proj``/``k_proj``/``v_proj``, fc1 -> ``gate_proj``/
``up_proj``), and add them to the current bucket; a bucket is yielded before it would exceed
``bucket_bytes``. A tensor bigger than the budget is yielded alone.

Pipeline ownership (``broadcast_pp``):

- ``False`` (default): **each stage yields its own tensors** (its layers; the first stage also
  the embedding, the last the final norm and untied ``lm_head``). The union over stages is the
  whole HF state dict; nothing crosses stages. Every TP rank of a stage yields the same buckets,
  so a sender usually acts on TP rank 0 of each stage. MoE experts are all-gathered over the
  expert-parallel group, so every rank of a stage yields every expert, named with its global
  expert id (``model.layers.L.mlp.experts.E.gate_proj.weight``).
- ``True``: every rank yields every tensor. Stages take turns in order; the owning stage
  broadcasts each bucket (names/shapes first, then the tensors) over the pipeline group.

LoRA: a weight with an adapter is sent merged, ``W + (alpha/rank)·B·A`` computed on each TP shard
before the gather (one shard-sized temporary), so every sync strategy sends merged weights.

Memory: one bucket plus one gathered tensor; there is never a full-model copy. At TP=1 a tensor
that needs no re-layout is yielded as a view of the live parameter (copy it if you keep it past
the next optimizer step). Names follow the HF checkpoint convention: no ``lm_head.weight`` when
embeddings are tied. Every rank of the model-parallel group must run the iterator to exhaustion
(it issues collectives).
"""

from __future__ import annotations

from typing import Iterable, Iterator

import torch
import torch.distributed as dist

from megatron_rl.convert.common import to_hf
from megatron_rl.convert.registry import mapping_for
from megatron_rl.models.config import ModelConfig
from megatron_rl.models.weights import (
    gather_experts,
    is_expert_name,
    iter_local_params,
    merged_shard,
    tp_info,
    unshard,
)

Bucket = list[tuple[str, torch.Tensor]]


def gather_tp(name: str, param: torch.Tensor, group) -> torch.Tensor:
    """Canonical full tensor of a (possibly TP-sharded) parameter, its LoRA adapter merged shard
    by shard (:func:`megatron_rl.models.weights.merged_shard`). Collective over ``group``."""
    partitioned, dim = tp_info(param)
    data = merged_shard(param)
    tp = dist.get_world_size(group) if dist.is_initialized() else 1
    if not partitioned or tp == 1:
        return data
    parts = [torch.empty_like(data) for _ in range(tp)]
    dist.all_gather(parts, data.contiguous(), group=group)
    return unshard(name, parts, dim)


def iter_stage_hf_tensors(model: torch.nn.Module, cfg: ModelConfig | None = None,
                          tp_group=None) -> Iterator[tuple[str, torch.Tensor]]:
    """``(hf_name, full tensor)`` for every parameter of this pipeline stage, one at a time."""
    from megatron.core import parallel_state as ps

    cfg = cfg or model.model_config
    index = {m.canonical: m for m in mapping_for(cfg).tensor_maps(cfg)}
    tp_group = tp_group or ps.get_tensor_model_parallel_group()
    for _, name, param in iter_local_params(model):
        if is_expert_name(name):  # every expert-parallel rank's expert in this slot
            for ename, tensor in gather_experts(model, name, param.detach()):
                yield from to_hf(index[ename], tensor, cfg)
            continue
        yield from to_hf(index[name], gather_tp(name, param, tp_group), cfg)


def bucketize(pairs: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[Bucket]:
    """Group consecutive tensors into buckets of at most ``bucket_bytes`` (an oversized tensor
    forms a bucket of its own)."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    bucket: Bucket = []
    used = 0
    for name, t in pairs:
        size = t.numel() * t.element_size()
        if bucket and used + size > bucket_bytes:
            yield bucket
            bucket, used = [], 0
        bucket.append((name, t))
        used += size
    if bucket:
        yield bucket


def _broadcast_stages(local: Iterator[Bucket], device: torch.device) -> Iterator[Bucket]:
    """Every stage's buckets on every rank: the owning stage broadcasts over the PP group."""
    from megatron.core import parallel_state as ps

    group = ps.get_pipeline_model_parallel_group()
    ranks = dist.get_process_group_ranks(group)
    me = ps.get_pipeline_model_parallel_rank()
    for stage, src in enumerate(ranks):
        if stage == me:
            for bucket in local:
                meta = [(n, tuple(t.shape), t.dtype) for n, t in bucket]
                dist.broadcast_object_list([meta], src=src, group=group)
                for _, t in bucket:
                    dist.broadcast(t.contiguous(), src=src, group=group)
                yield bucket
            dist.broadcast_object_list([None], src=src, group=group)
            continue
        while True:
            box: list = [None]
            dist.broadcast_object_list(box, src=src, group=group)
            if box[0] is None:
                break
            bucket = []
            for n, shape, dtype in box[0]:
                t = torch.empty(shape, dtype=dtype, device=device)
                dist.broadcast(t, src=src, group=group)
                bucket.append((n, t))
            yield bucket


def iter_hf_weight_buckets(model: torch.nn.Module, bucket_bytes: int = 512 * 2**20, *,
                           broadcast_pp: bool = False,
                           cfg: ModelConfig | None = None) -> Iterator[Bucket]:
    """Buckets of ``(hf_name, full tensor)`` from the live sharded model (see module docstring
    for ownership, memory and naming). Collective: all model-parallel ranks must exhaust it."""
    from megatron.core import parallel_state as ps

    local = bucketize(iter_stage_hf_tensors(model, cfg), bucket_bytes)
    if not broadcast_pp or ps.get_pipeline_model_parallel_world_size() == 1:
        yield from local
        return
    yield from _broadcast_stages(local, next(model.parameters()).device)


def serves_expert_gathers(model: torch.nn.Module) -> bool:
    """True on a rank outside data-parallel replica 0 that holds experts replica 0's stream
    gathers (MoE with ``ep > 1``: the expert-parallel group spans DP ranks). Such a rank must run
    :func:`iter_hf_weight_buckets` too (and drop what it yields) whenever replica 0 streams."""
    from megatron.core import parallel_state as ps

    cfg = getattr(model, "config", None)
    return bool(getattr(cfg, "num_moe_experts", None)) and \
        ps.get_expert_model_parallel_world_size() > 1 and \
        ps.get_data_parallel_rank() != 0 and ps.get_expert_data_parallel_rank() == 0
