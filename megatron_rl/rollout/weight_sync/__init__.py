"""Weight sync strategies, actor -> SGLang servers, one module per strategy (the slime layout).

- :mod:`.from_disk`: each sender writes its buckets as safetensors on shared storage; the
  coordinator posts ``/update_weights_from_disk`` to every server.
- :mod:`.from_tensor`: colocated. Each bucket is flattened once; servers receive a handle, not
  the bytes (CUDA IPC through SGLang's serializer on GPU; a ``/dev/shm`` file on CPU).
- :mod:`.from_distributed`: a process group between each sender and every server
  (``/init_weights_update_group``), then ``/update_weights_from_distributed`` per bucket with
  names/dtypes/shapes while the sender broadcasts the tensors (NCCL on GPU, gloo on CPU).

Around a sync (:mod:`.common`): pause generation and flush the cache (bounded retries), open
SGLang's weight-update session (tensor, distributed), send (every PP stage's sender in parallel),
close the session, set the weight version, continue generation, verify (a probe sequence whose
engine log-probs must match the actor's; every server's ``/weights_checker`` checksum equal where
servers have it; optional ``/get_weights_by_name`` spot checks).
"""

from __future__ import annotations

from typing import Iterable

from megatron_rl.rollout.weight_sync.common import (
    SyncStrategy,
    WeightSyncError,
    checksum_disagreement,
    weights_checksums,
)

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
    """Strategy ``name`` pushing to ``fleet``'s current servers. Each server's TP size (payloads
    per server, ranks in a weight group) is read from its ``/server_info`` when a sync needs it:
    started and attached servers alike."""
    s = getattr(fleet, "s", None)
    strat = strategy_class(name)(list(fleet.urls), sync_dir, sender,
                                 model_path=getattr(fleet, "model_path", None))
    strat.gpus = list(getattr(s, "gpus", None) or [])
    return strat


def push_single_process(engine, buckets: Iterable[Bucket], version: int,
                        retries: int = 1) -> str:
    """One-process sync (no Megatron groups): pause, send, commit, continue. Returns a summary.

    A sync that fails because servers died is retried on the survivors (after the health check
    removed the dead ones from the router, with a log line) and on their restarted replacements
    when ``buckets`` can be iterated again (a list); otherwise, or when no server died, the
    error is raised. Restarted servers that received this sync rejoin the router after it."""
    from megatron_rl.rollout.fleet import ServerError

    strat = engine.sync
    reusable = isinstance(buckets, (list, tuple))
    for attempt in range(retries + 1):
        strat.urls = sync_targets(engine.fleet)
        try:
            sent = _push_once(strat, buckets, version)
            break
        except (WeightSyncError, ServerError) as exc:
            dead = engine.fleet.check_health()
            if not dead or not reusable or attempt == retries:
                raise
            print(f"[weight_sync] v{version}: {dead} died during the sync ({exc}); removed "
                  f"from the router, retrying on {sync_targets(engine.fleet)}", flush=True)
    errors = strat.spot_check() + checksum_disagreement(weights_checksums(strat.urls))
    if errors:
        raise RuntimeError(f"weight sync v{version} failed its checks: {errors}")
    engine.weight_version = version
    rejoin(engine.fleet, strat.urls, version)
    if strat.quantization and hasattr(engine, "note_sync"):
        engine.note_sync({"time/weight_quant": strat.quant_s, "weight_sync_bytes": float(sent)})
    return f"{strat.name} v{version}: {sent} bytes"


def sync_targets(fleet) -> list[str]:
    """The servers a sync must reach: registered + restarted ones (:meth:`Fleet.sync_targets`)."""
    targets = getattr(fleet, "sync_targets", None)
    return targets() if targets is not None else list(fleet.urls)


def rejoin(fleet, urls: list[str], version: int) -> None:
    """Put restarted servers that took part in the verified sync ``version`` back in the router
    (a failure to register one is only reported: the others keep serving)."""
    if getattr(fleet, "rejoin", None) is None:
        return
    try:
        fleet.rejoin(urls, version)
    except Exception as exc:  # noqa: BLE001
        print(f"[fleet] warning: a restarted server could not rejoin the router: {exc}",
              flush=True)


def _push_once(strat: SyncStrategy, buckets, version: int) -> int:
    try:
        strat.begin(version)
        sent = strat.send(buckets, version)
        strat.commit(version)
    finally:
        strat.resume()
    return sent
