"""Weight sync, actor -> rollout engine, after every optimizer step."""

from __future__ import annotations

import torch.distributed

from megatron_rl.parallel.runtime import broadcast_object


def sync_weights(actor, engine, bucket_mb: int, version: int, hooks=None) -> str | None:
    """Stream HF-named buckets out of the Megatron actor into the engine.

    Collective over the model-parallel group of DP replica 0 only (the engine's rank is there);
    the other replicas hold identical weights and skip the gathers entirely, except, with MoE
    expert parallelism, the ranks holding the experts replica 0 gathers. Returns the engine's
    checksum on the engine's rank, None elsewhere. ``hooks`` (``before_send()`` /
    ``after_send()``, each once on every rank; colocation) run around the send (with
    ``hooks.servers_generate`` False the servers' KV cache is released until ``after_send``: the
    fleet's health check before the sync checks their processes only): for an
    SGLang fleet ``after_send`` comes after the weights are loaded and before the probe (see
    :mod:`megatron_rl.rollout.weight_sync.megatron_sync`), for other engines after the update.
    """

    from megatron_rl.convert.stream import iter_hf_weight_buckets, serves_expert_gathers
    from megatron_rl.parallel.runtime import first_replica
    from megatron_rl.rollout.weight_sync.megatron_sync import fleet_plan

    # an SGLang fleet: its strategy (rollout.sglang.weight_sync), verified, every stage sending
    generate = getattr(hooks, "servers_generate", True)  # False: KV cache released (colocated)
    plan = broadcast_object(fleet_plan(engine, generate) if torch.distributed.get_rank() == 0
                            else None)
    if plan is not None:
        return sync_fleet_retrying(actor, engine, plan, bucket_mb, version, hooks=hooks)
    if hooks is not None:
        hooks.before_send()
    out = None
    if not first_replica():  # DP replicas > 0 and CP ranks > 0 hold copies
        if serves_expert_gathers(actor.model):
            for _ in iter_hf_weight_buckets(actor.model, bucket_mb * 2**20, broadcast_pp=True):
                pass
    else:
        buckets = iter_hf_weight_buckets(actor.model, bucket_mb * 2**20, broadcast_pp=True)
        if engine is not None:
            sent = [0]
            out = engine.update_weights(counted(as_engine_dtype(buckets, engine), sent), version)
            note_sync_bytes(engine, sent[0])
        else:
            for _ in buckets:
                pass
    if hooks is not None:
        hooks.after_send()
    return out


def counted(buckets, box: list):
    """The buckets unchanged, adding their bytes to ``box[0]`` as they pass."""
    for bucket in buckets:
        box[0] += sum(t.numel() * t.element_size() for _, t in bucket)
        yield bucket


def note_sync_bytes(engine, nbytes: int) -> None:
    """Record the bytes of the last weight sync: ``rollout/weight_sync_bytes`` in the step's
    metrics where the engine reports sync metrics, else ``engine.last_sync_bytes``."""
    engine.last_sync_bytes = nbytes
    if hasattr(engine, "note_sync"):
        engine.note_sync({"weight_sync_bytes": float(nbytes)})


def as_engine_dtype(buckets, engine):
    """The buckets with every tensor in the engine's weight dtype (``engine.weight_dtype``, when
    it has one): a bf16 actor streams bf16 to a bf16 engine and fp32 to an fp32 one, so the
    sender does the one cast instead of the engine receiving a wider copy."""
    dtype = getattr(engine, "weight_dtype", None)
    if dtype is None:
        yield from buckets
        return
    for bucket in buckets:
        yield [(n, t if t.dtype == dtype else t.to(dtype)) for n, t in bucket]


def sync_fleet_retrying(actor, engine, plan: dict, bucket_mb: int, version: int,
                        retries: int = 1, hooks=None) -> str | None:
    """:func:`~megatron_rl.rollout.weight_sync.megatron_sync.sync_fleet`, run again on the
    surviving servers when servers died during it (the coordinator's health check removed them
    from the router and restarted them; a log line says so), restarted servers included; those
    rejoin the router after the verified sync. Every rank takes the same decision (broadcast from
    rank 0), so all retry or all raise: no step is lost to a dead server."""
    from megatron_rl.rollout.weight_sync import rejoin
    from megatron_rl.rollout.weight_sync.common import WeightSyncError
    from megatron_rl.rollout.weight_sync.megatron_sync import fleet_plan, sync_fleet

    rank0 = torch.distributed.get_rank() == 0
    for attempt in range(retries + 1):
        err, out = None, None
        try:
            out = sync_fleet(actor, engine, plan, bucket_mb, version, hooks=hooks)
        except WeightSyncError as exc:
            err = exc
        decision = None
        if rank0:
            try:
                dead = engine.fleet.check_health() if err is not None else []
            except Exception as exc:  # noqa: BLE001 - every server dead: raise on all ranks
                dead, err = [], WeightSyncError(f"{err}; {exc}")
            decision = "ok" if err is None else ("retry" if dead and attempt < retries
                                                 else "raise")
            if decision == "retry":
                print(f"[weight_sync] v{version}: {dead} died during the sync ({err}); "
                      f"removed from the router, retrying on {engine.fleet.urls} and the "
                      "restarted servers", flush=True)
        decision = broadcast_object(decision)
        if decision == "ok":
            if rank0:  # restarted servers got this verified sync: back in the router
                rejoin(engine.fleet, plan["urls"], version)
            return out
        if decision == "raise":
            raise err or WeightSyncError(f"weight sync v{version} failed on another rank")
        plan = broadcast_object(fleet_plan(engine) if rank0 else None)
    raise AssertionError("unreachable")
