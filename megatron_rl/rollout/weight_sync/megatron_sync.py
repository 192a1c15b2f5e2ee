"""One verified weight sync from the live Megatron actor to an SGLang fleet.

Collective over the model-parallel group of DP replica 0 (other replicas hold the same weights
and return at once). Phases, each ending with an all-gather of errors so every rank raises
together instead of hanging:

1. coordinator (global rank 0): health check, ``begin`` (pause + flush on every server);
2. every rank streams its stage's HF buckets (``iter_hf_weight_buckets(broadcast_pp=False)``:
   gathered once per TP group); TP rank 0 of each stage sends them, stages in parallel;
3. the actor's log-probs of the probe sequence (last stage; a collective forward while the
   parameters are still on the device);
4. coordinator: ``commit`` (load / set version / flush); then ``hooks.after_send()`` on every
   rank (colocation: the actor's parameters leave the device and the servers get their KV cache
   and CUDA graphs back, :mod:`megatron_rl.run.colocation`); then ``resume`` (continue
   generation: a paused server answers no probe; the synchronous trainer sends no rollout
   meanwhile);
5. the coordinator compares every server's ``/weights_checker`` checksum (where servers have
   it); every sender spot-checks its tensors with ``/get_weights_by_name`` (when
   ``spot_checks`` > 0); the probe sequence's
   actor log-probs (last stage) are compared with every server's: the mean gap over the probe
   tokens must be within ``probe_tolerance`` (logged per sync as ``weight_sync_probe_gap``);
   any failure raises on every rank; the engine's weight version is set.

``hooks`` (optional) is any object with ``before_send()`` and ``after_send()``, each called
exactly once per attempt on every rank of the job (DP replicas other than 0 included, which call
them without waiting for replica 0's send): ``after_send`` may wait for every rank on the host
group (colocation does, before the servers resume), ``before_send`` must not.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from megatron_rl.rollout.weight_sync import strategy_class
from megatron_rl.rollout.weight_sync.common import (
    ProbeGap,
    SyncStrategy,
    WeightSyncError,
    checksum_disagreement,
    probe_servers,
    probe_tokens,
    weights_checksums,
    worst_gap,
)

_SENDERS: dict[tuple, SyncStrategy] = {}


def fleet_plan(engine, generate: bool = True) -> dict | None:
    """What every rank needs to know about the fleet (rank 0), None for other engines. The
    fleet's health check first (``generate=False``: servers whose KV cache is released, checked
    by their process only; the probe generates once they have it back)."""
    if engine is None or getattr(engine, "sync", None) is None:
        return None
    from megatron_rl.rollout.weight_sync import sync_targets

    engine.fleet.check_health(generate=generate)
    s = engine.sync
    urls = sync_targets(engine.fleet)
    adapter = None  # actor.lora.sync=adapter: base weights only where a server lacks them
    if getattr(engine, "adapter_sync", False):
        from megatron_rl.rollout.weight_sync.lora_adapter import ADAPTER_NAME

        adapter = {"name": ADAPTER_NAME,
                   "base": any(u not in engine.lora_base_urls for u in urls)}
    return {"strategy": s.name, "urls": urls, "sync_dir": s.sync_dir, "adapter": adapter,
            "model_path": s.model_path, "spots": s.spots_per_send, "server_tp": s.server_tp,
            "sender_address": getattr(s, "address_override", None),
            "gpus": list(getattr(s, "gpus", None) or []),
            "probe_length": engine.probe_length, "probe_tolerance": engine.probe_tolerance,
            "quantization": s.quantization, "scale_fmt": s.scale_fmt}


def _agree(err: str | None, group) -> list[str]:
    """Every rank's error of this phase, on every rank (also a barrier)."""
    box: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(box, err, group=group)
    return [e for e in box if e]


def _sender(plan: dict, stage: int, coordinator: SyncStrategy | None) -> SyncStrategy:
    if coordinator is not None:
        s = coordinator
    else:
        key = (plan["strategy"], stage, plan["sync_dir"])
        if key not in _SENDERS:
            _SENDERS[key] = strategy_class(plan["strategy"])(
                plan["urls"], plan["sync_dir"], stage, model_path=plan["model_path"],
                spots_per_send=plan["spots"], server_tp=plan["server_tp"])
        s = _SENDERS[key]
    s.urls, s.sender, s.spots_per_send = list(plan["urls"]), stage, plan["spots"]
    s.gpus = plan.get("gpus", [])
    s.quantization, s.scale_fmt = plan.get("quantization"), plan.get("scale_fmt", "float32")
    if hasattr(s, "address_override"):
        s.address_override = plan.get("sender_address")
    return s


def _send_all(sender: SyncStrategy | None, buckets, version: int) -> tuple[int, str | None]:
    """Drain ``buckets`` (collective) while the sender pushes them; (bytes, error). Each bucket is
    dropped before the next one is made (the stream then holds one bucket at a time)."""
    total, err = 0, None
    if sender is not None:
        buckets = sender.wire_buckets(buckets)  # fp8: quantised bucket by bucket, here
        sender.spots = []
        try:
            sender.start_send(version)
        except Exception as exc:  # noqa: BLE001
            err = f"stage {sender.sender}: {exc!r}"
    for bucket in buckets:
        if sender is not None and err is None:
            try:
                sender._remember_spots(bucket)
                sender.send_bucket(bucket, version)
                total += sum(t.numel() * t.element_size() for _, t in bucket)
            except Exception as exc:  # noqa: BLE001 - every rank raises after the all-gather
                err = f"stage {sender.sender}: {exc!r}"
        del bucket  # before the stream makes the next one
    if sender is not None:  # also after an error: releases files and pending posts
        try:
            sender.finish_send(version)
        except Exception as exc:  # noqa: BLE001
            err = err or f"stage {sender.sender}: {exc!r}"
    return total, err


def actor_probe_logprobs(actor, ids: list[int]) -> list[float] | None:
    """The actor's ``log p(ids[t] | ids[<t])``, t >= 1, at temperature 1 (the model's own
    distribution; the servers' teacher-forced ``input_token_logprobs`` are unscaled): a
    collective forward over the model-parallel group; host floats on the last stage, None
    elsewhere."""
    rows = max(1, actor.cfg.micro_batch_size)
    tokens = torch.tensor([ids] * rows, dtype=torch.long)
    mask = torch.ones_like(tokens, dtype=torch.bool)
    mask[:, 0] = False
    out = actor.logprobs({"tokens": tokens, "mask": mask}, compute_entropy=False, temperature=1.0)
    if out is None:
        return None
    return out["logp"][0, 1:].detach().float().cpu().tolist()


def _actor_probe(actor, plan: dict, last_sender: bool) -> tuple[list[int], list[float] | None]:
    """``(probe ids, the actor's log-probs of them)`` (a collective forward on every rank, run
    while the parameters are on the device; the log-probs on the last stage's sender, None
    elsewhere or when the probe is off)."""
    n = plan["probe_length"]
    if n <= 1:
        return [], None
    ids = probe_tokens(actor.model_cfg.vocab_size, n)
    if plan.get("quantization") == "fp8":  # what FP8 servers compute with
        from megatron_rl.rollout.fp8 import fp8_actor_weights

        with fp8_actor_weights(actor.model, plan.get("scale_fmt", "float32")):
            ref = actor_probe_logprobs(actor, ids)
    else:
        ref = actor_probe_logprobs(actor, ids)
    return ids, (ref if last_sender else None)


def _engine_probe(plan: dict, ids: list[int], ref: list[float] | None
                  ) -> tuple[ProbeGap, str | None]:
    """Every server's probe log-probs against the actor's ``ref`` (where this rank has them):
    the worst :class:`ProbeGap` and the servers over ``probe_tolerance`` (mean gap); with
    adapter-only LoRA sync the servers compute with the loaded adapter."""
    if ref is None:
        return ProbeGap(0.0, 0.0), None
    lora = (plan.get("adapter") or {}).get("name")
    gap, errors = probe_servers(plan["urls"], ids, ref, plan["probe_tolerance"], lora)
    return gap, "; ".join(errors) or None


def _base_only(model, on: bool):
    """Adapters off inside the block when ``on`` (the stream then yields the base weights)."""
    import contextlib

    if not on:
        return contextlib.nullcontext()
    from megatron_rl.models.lora import adapters_disabled

    return adapters_disabled(model)


def _hook(hooks, name: str) -> str | None:
    """``hooks.<name>()`` (when there are hooks); its error as a string."""
    if hooks is None:
        return None
    try:
        getattr(hooks, name)()
    except Exception as exc:  # noqa: BLE001 - every rank raises after the all-gather
        return f"{name} on rank {dist.get_rank()}: {exc!r}"
    return None


def _send_adapter(actor, coord: SyncStrategy | None, plan: dict, version: int
                  ) -> tuple[int, str | None]:
    """Adapter-only LoRA sync (:mod:`.lora_adapter`): every stage's adapters gathered (collective
    over the model-parallel group), written as a PEFT directory and loaded into every server by
    the coordinator. ``(bytes, error)`` on the coordinator, ``(0, None)`` elsewhere."""
    from megatron_rl.models.lora import gather_full_adapters
    from megatron_rl.rollout.weight_sync.lora_adapter import (
        adapter_dir,
        load_adapter,
        write_adapter,
    )

    full = gather_full_adapters(actor.model)
    if coord is None:
        return 0, None
    try:
        dtype = next(p.dtype for p in actor.model.parameters())
        path = adapter_dir(plan["sync_dir"], version)
        sent = write_adapter({n: t.to(dtype) for n, t in full.items()}, actor.lora,
                             actor.model_cfg, path)
        load_adapter(list(plan["urls"]), path, coord.lora_checked, plan["adapter"]["name"])
    except Exception as exc:  # noqa: BLE001 - every rank raises after the all-gather
        return 0, f"adapter: {exc!r}"
    return sent, None


def sync_fleet(actor, engine, plan: dict, bucket_mb: int, version: int, hooks=None
               ) -> str | None:
    """The verified sync (module docstring); a summary on rank 0, None elsewhere. With
    adapter-only LoRA sync (``plan["adapter"]``) the base weights go (adapters off) only where a
    server lacks them, then the adapters are loaded (:mod:`.lora_adapter`)."""
    from megatron.core import parallel_state as ps

    from megatron_rl.convert.stream import iter_hf_weight_buckets, serves_expert_gathers
    from megatron_rl.parallel.runtime import first_replica

    adapter = plan.get("adapter")
    base = adapter is None or adapter["base"]  # the base (or merged) weights are sent
    if not first_replica():  # DP replicas > 0 and CP ranks > 0 hold copies
        err = _hook(hooks, "before_send")
        # MoE: replica 0's stream gathers our experts
        if base and serves_expert_gathers(actor.model):
            for _ in iter_hf_weight_buckets(actor.model, bucket_mb * 2**20, broadcast_pp=False):
                pass
        err = _hook(hooks, "after_send") or err
        if err:  # not a sync failure (rank 0 decides those): this rank's own state is wrong
            raise RuntimeError(f"weight sync v{version}: {err}")
        return None
    mp = ps.get_model_parallel_group()
    coord = engine.sync if dist.get_rank() == 0 else None
    t0 = time.perf_counter()
    err = _hook(hooks, "before_send")
    if coord is not None and err is None:
        coord.urls = list(plan["urls"])
        try:
            coord.begin(version, session=base)
        except Exception as exc:  # noqa: BLE001
            err = f"begin: {exc!r}"
    if errs := _agree(err, mp):
        _hook(hooks, "after_send")
        raise WeightSyncError(f"weight sync v{version}: {errs}")
    stage = ps.get_pipeline_model_parallel_rank()
    tp0 = ps.get_tensor_model_parallel_rank() == 0
    sender = _sender(plan, stage, coord if stage == 0 else None) if tp0 else None
    sent, err = 0, None
    if base:
        with _base_only(actor.model, adapter is not None):
            buckets = iter_hf_weight_buckets(actor.model, bucket_mb * 2**20, broadcast_pp=False)
            sent, err = _send_all(sender, buckets, version)
            del buckets
    errs = _agree(err, mp)
    if adapter is not None and not errs:
        extra, err = _send_adapter(actor, coord, plan, version)
        sent += extra
        errs = _agree(err, mp)
    ids, ref, local = [], None, []  # local: this rank's errors until the next agreement
    if not errs:
        try:  # while the actor's parameters are still on the device
            ids, ref = _actor_probe(actor, plan, tp0 and ps.is_pipeline_last_stage())
        except Exception as exc:  # noqa: BLE001
            local.append(f"probe on stage {stage}: {exc!r}")
    if not errs and not local and coord is not None:
        try:
            if base:
                coord.commit(version)
            else:  # adapter only: no base weights to load; the version, then a flush
                SyncStrategy.commit(coord, version)
        except Exception as exc:  # noqa: BLE001
            local.append(f"commit: {exc!r}")
    if herr := _hook(hooks, "after_send"):  # colocation: parameters out, KV cache back
        local.append(herr)
    # generation continues before the checks: a paused server answers no probe (as SGLang)
    if coord is not None:
        try:
            coord.resume()
        except Exception as exc:  # noqa: BLE001
            local.append(f"resume: {exc!r}")
        if not errs and not local:
            try:
                local += checksum_disagreement(weights_checksums(coord.urls))
            except Exception as exc:  # noqa: BLE001
                local.append(f"weights_checker: {exc!r}")
    errs = errs + _agree("; ".join(local) or None, mp)
    dt = time.perf_counter() - t0
    diffs: list = [(0.0, 0.0)] * dist.get_world_size(mp)
    if not errs:
        try:
            spot = "; ".join(sender.spot_check()) if sender is not None else ""
        except Exception as exc:  # noqa: BLE001 - every rank raises after the all-gather
            spot = f"spot check on stage {stage}: {exc!r}"
        try:
            worst, perr = _engine_probe(plan, ids, ref)
        except Exception as exc:  # noqa: BLE001
            worst, perr = ProbeGap(float("inf"), float("inf")), f"probe on stage {stage}: {exc!r}"
        errs = _agree("; ".join(e for e in (spot, perr) if e) or None, mp)
        dist.all_gather_object(diffs, tuple(worst), group=mp)
    byte_list: list = [None] * dist.get_world_size(mp)
    dist.all_gather_object(byte_list, (sent, sender.quant_s if sender is not None else 0.0),
                           group=mp)
    if errs:
        raise WeightSyncError(f"weight sync v{version} ({plan['strategy']}) failed: {errs}")
    if coord is None:
        return None
    total = sum(b for b, _ in byte_list)
    engine.weight_version = version
    if adapter is not None:  # the servers hold the base and the adapter: requests name it
        from megatron_rl.rollout.weight_sync.lora_adapter import prune_adapters

        engine.lora_base_urls.update(plan["urls"])
        engine.lora_name = adapter["name"]
        prune_adapters(plan["sync_dir"], version)
    gap = worst_gap(ProbeGap(*d) for d in diffs)
    metrics = {"weight_sync_probe_gap": gap.mean, "weight_sync_probe_max_diff": gap.max,
               "weight_sync_s": dt, "weight_sync_gbps": total / dt / 1e9,
               "weight_sync_bytes": float(total)}
    if plan.get("quantization"):  # the slowest stage's sender (stages quantise in parallel)
        metrics["time/weight_quant"] = max(q for _, q in byte_list)
    engine.note_sync(metrics)
    return f"{plan['strategy']} v{version}: {total} bytes in {dt:.2f}s, probe gap " \
           f"{gap.mean:.2e} (largest {gap.max:.2e})"
