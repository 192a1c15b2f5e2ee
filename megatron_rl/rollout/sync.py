"""Weight sync, actor -> rollout engine, after every optimizer step."""

from __future__ import annotations


def sync_weights(actor, engine, bucket_mb: int, version: int) -> str | None:
    """Stream HF-named buckets out of the Megatron actor into the engine.

    Collective over the model-parallel group of DP replica 0 only (the engine's rank is there);
    the other replicas hold identical weights and skip the gathers entirely. Returns the engine's
    checksum on the engine's rank, None elsewhere.
    """
    from megatron.core import parallel_state as ps

    from megatron_rl.convert.stream import iter_hf_weight_buckets

    if ps.get_data_parallel_rank() != 0:
        return None
    buckets = iter_hf_weight_buckets(actor.model, bucket_mb * 2**20, broadcast_pp=True)
    if engine is not None:
        return engine.update_weights(buckets, version)
    for _ in buckets:
        pass
    return None
