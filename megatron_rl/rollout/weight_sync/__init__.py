"""Weight sync strategies, actor -> SGLang servers, one module per strategy (the slime layout).

- :mod:`.from_disk`: each sender writes its buckets as safetensors on shared storage; the
  coordinator posts ``/update_weights_from_disk`` to every server.
- :mod:`.from_tensor`: colocated. Each bucket is flattened once; servers receive a handle, not
  the bytes (CUDA IPC through SGLang's serializer on GPU; a ``/dev/shm`` file on CPU).
- :mod:`.from_distributed`: a process group between each sender and every server
  (``/init_weights_update_group``), then ``/update_weights_from_distributed`` per bucket with
  names/dtypes/shapes while the sender broadcasts the tensors (NCCL on GPU, gloo on CPU).

Around a sync (:mod:`.common`): pause generation and flush the cache, send (every PP stage's
sender in parallel), set the weight version, verify (``/get_weights_by_name`` spot checks and a
probe sequence whose engine log-probs must match the actor's), continue generation.
"""

from __future__ import annotations

from typing import Iterable

from megatron_rl.rollout.weight_sync.common import SyncStrategy

Bucket = list


def strategy_class(name: str) -> type[SyncStrategy]:
    """The class of strategy ``name`` (``from_disk`` | ``from_tensor`` | ``from_distributed``)."""
    if name == "from_disk":
        from megatron_rl.rollout.weight_sync.from_disk import FromDisk
        return FromDisk
    if name == "from_tensor":
        from megatron_rl.rollout.weight_sync.from_tensor import FromTensor
        return FromTensor
    if name == "from_distributed":
        from megatron_rl.rollout.weight_sync.from_distributed import FromDistributed
        return FromDistributed
    raise ValueError(f"rollout.sglang.weight_sync={name!r} is not one of "
                     "('from_disk', 'from_tensor', 'from_distributed')")


def make_strategy(name: str, fleet, sync_dir: str, sender: int = 0) -> SyncStrategy:
    """Strategy ``name`` pushing to ``fleet``'s current servers."""
    s = getattr(fleet, "s", None)
    tp = s.tp_size if s is not None and s.launcher == "sglang" else 1
    return strategy_class(name)(list(fleet.urls), sync_dir, sender,
                                model_path=getattr(fleet, "model_path", None), server_tp=tp)


def push_single_process(engine, buckets: Iterable[Bucket], version: int) -> str:
    """One-process sync (no Megatron groups): pause, send, commit, continue. Returns a summary."""
    strat = engine.sync
    strat.urls = list(engine.fleet.urls)
    strat.begin(version)
    try:
        sent = strat.send(buckets, version)
        strat.commit(version)
        errors = strat.spot_check()
    finally:
        strat.resume()
    if errors:
        raise RuntimeError(f"weight sync v{version} failed its checks: {errors}")
    engine.weight_version = version
    return f"{strat.name} v{version}: {sent} bytes"
