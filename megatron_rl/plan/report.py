"""One layout's plan (:func:`make_plan`: memory, step time, colocated phases) and its
human-readable report (:func:`format_plan`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from megatron_rl.plan.inputs import GIB, RECOMPUTE, PlanInputs
from megatron_rl.plan.lengths import (
    LengthSample,
    PaddingCost,
    micro_batch_budget,
    padding_costs,
    sample_for,
)
from megatron_rl.plan.memory import (
    active_params,
    actor_breakdown,
    checkpoint_host_bytes,
    colocated_phases,
    server_breakdown,
    stage_expert_params,
    stage_params,
    total_params,
)
from megatron_rl.plan.rollout_time import RolloutCost, rollout_cost, step_totals, sync_seconds
from megatron_rl.plan.step_time import (
    ALLTOALL,
    CP_KV,
    alltoall_bytes,
    cp_kv_bytes,
    step_seconds,
    swap_seconds,
)

ROLLOUT = "rollout (one generation round)"
SYNC = "weight sync"


@dataclass
class Plan:
    inputs: PlanInputs
    stage: int
    actor: dict[str, float]
    server: dict[str, Any] | None
    seconds: dict[str, float] = field(default_factory=dict)
    colocated: dict[str, float] | None = None  # bytes per phase on a shared GPU (colocate)
    lengths: LengthSample | None = None  # the response lengths the batching modes are priced on
    batching: list[tuple[PaddingCost, dict[str, float]]] = field(default_factory=list)
    rollout: RolloutCost | None = None  # the generation round at the sample's lengths

    def totals(self, seconds: dict[str, float] | None = None) -> tuple[float, float]:
        """``(synchronous, asynchronous)`` seconds per step of ``seconds`` (default: the step
        table): every phase in sequence, or generation overlapping the actor's phases."""
        sec = self.seconds if seconds is None else seconds
        actor = sum(v for k, v in sec.items() if k not in (ROLLOUT, SYNC))
        return step_totals(actor, sec.get(ROLLOUT, 0.0), sec.get(SYNC, 0.0))

    @property
    def colocated_peak(self) -> float:
        """The shared GPU's peak: the largest phase (phases take turns, they do not add)."""
        return max(self.colocated.values()) if self.colocated else 0.0

    @property
    def actor_total(self) -> float:
        return sum(self.actor.values())

    @property
    def actor_fits(self) -> bool:
        return self.actor_total <= self.inputs.gpu_mem_gb * GIB

    @property
    def fits(self) -> bool:
        if self.colocated:
            return self.colocated_peak <= self.inputs.gpu_mem_gb * GIB and \
                self.server["weights_fit"]
        return self.actor_fits and (self.server is None or self.server["weights_fit"])

    @property
    def layout(self) -> str:
        x = self.inputs
        return (f"TP{x.tp}xPP{x.pp}" + (f"xCP{x.cp}" if x.cp > 1 else "") + f"xDP{x.dp}"
                + (f"xEP{x.ep}" if x.model.is_moe else ""))


def make_plan(x: PlanInputs) -> Plan:
    """The estimate for one layout."""
    x.validate()
    stage, items = actor_breakdown(x)
    server = server_breakdown(x) if x.servers else None
    sample = sample_for(x)
    roll = rollout_cost(x, sample) if x.servers else None
    roll_s = None if roll is None else roll.seconds
    seconds = step_seconds(x, rollout_s=roll_s)
    colocated = None
    if x.colocate and server is not None:
        colocated = colocated_phases(x, stage, items, server)
        seconds["colocation swaps (host<->device)"] = swap_seconds(x, stage)
    if sync := sync_seconds(x):
        seconds[SYNC] = sync
    costs = padding_costs(sample, x.prompt_len, micro_batch_budget(x),
                          rows_per_rank=x.n_micro * x.micro_batch_size)
    batching = [(c, {**step_seconds(x, c, rollout_s=roll_s), **({SYNC: sync} if sync else {})})
                for c in costs]
    return Plan(x, stage, items, server, seconds, colocated, sample, batching, roll)


def _gib(b: float) -> str:
    if b < 0.1 * GIB:
        return f"{b / 1024 ** 2:8.2f} MiB"
    return f"{b / GIB:8.2f} GiB"


def _fmt_s(s: float) -> str:
    return f"{s / 60:.1f} min" if s >= 120 else f"{s:.2f} s"


def _format_batching(p: Plan) -> list[str]:
    """Actor phases priced padded vs token budget vs packed on the response lengths."""
    if p.lengths is None or not p.batching:
        return []
    x, s = p.inputs, p.lengths
    overlap = p.rollout is not None and not x.colocate
    steps = (f" {'step sync':>10} {'step async':>11}" if overlap else "")
    lines = ["", f"actor passes by batching, response lengths: {s.source}; mean "
                 f"{s.mean:.0f} tokens = {s.mean / s.cap:.0%} of the cap "
                 f"(token budget {micro_batch_budget(x)} tokens per micro-batch):",
             "  (one DP rank's mini-batch at a time; the head scores the sample's response "
             "tokens)",
             f"  {'batching':<14} {'tokens/row':>10} {'pad':>6} {'old-logp':>10} "
             f"{'train':>10} {'actor total':>12} {'vs padded':>10}{steps}"]
    base = None
    for cost, sec in p.batching:
        old = sec.get("old-policy log-probs", 0.0) + sec.get("reference log-probs", 0.0)
        total = sum(v for k, v in sec.items() if k not in (ROLLOUT, SYNC))
        base = base or total
        sync_t, async_t = p.totals(sec)
        tail = f" {_fmt_s(sync_t):>10} {_fmt_s(async_t):>11}" if overlap else ""
        lines.append(f"  {cost.mode:<14} {cost.tokens:>10.0f} {cost.pad_fraction:>6.1%} "
                     f"{_fmt_s(old):>10} {_fmt_s(sec['train (fwd + bwd)']):>10} "
                     f"{_fmt_s(total):>12} {total / base:>9.2f}x{tail}")
    if overlap:
        lines.append("  (step sync: actor + rollout + weight sync in sequence, max_staleness 0; "
                     "step async: max(rollout, actor) + sync, max_staleness >= 1)")
    return lines


def _rollout_lines(p: Plan) -> list[str]:
    """How the generation round was priced from the response lengths (empty without servers)."""
    r, s = p.rollout, p.lengths
    if r is None or s is None:
        return []
    return [f"  rollout at the response lengths ({s.source.split(' (')[0]}): per server "
            f"{r.requests} requests, {r.slots} in flight (KV pool at the mean context), "
            f"{r.steps} decode steps, the longest response {r.longest} tokens; every response "
            f"at the cap: {r.steps_at_cap} steps, {_fmt_s(r.seconds_at_cap)}"]


def _moe_lines(p: Plan) -> list[str]:
    """An MoE model's active parameters and one GPU's dense / expert split (empty if dense)."""
    x, m = p.inputs, p.inputs.model
    if not m.is_moe:
        return []
    experts = stage_expert_params(m, x.pp, x.ep)
    dense = stage_params(m, x.tp, x.pp, p.stage, x.ep) - experts
    shard = "sharded" if x.distributed_optimizer else "not sharded (distributed optimizer off)"
    return [f"  mixture of experts: {active_params(m) / 1e9:.2f}B active params per token "
            f"({m.num_experts_per_tok} of {m.num_experts} experts, FFN "
            f"{m.moe_intermediate_size}); total {total_params(m) / 1e9:.2f}B",
            f"  per actor GPU (stage {p.stage}): {dense / 1e9:.3f}B dense params (optimizer "
            f"state {shard} over DP {x.dp}), {experts / 1e9:.3f}B expert params = "
            f"{m.num_experts // x.ep} experts x {m.num_hidden_layers // x.pp} layers (EP "
            f"{x.ep}; optimizer state {shard} over expert-DP {x.expert_dp} = TP x DP / EP)"]


def format_plan(p: Plan, alternatives: bool = True) -> str:
    """The human-readable report of one plan."""
    x, m = p.inputs, p.inputs.model
    lines = [
        f"model: {m.family} {total_params(m) / 1e9:.2f}B params, {m.num_hidden_layers} layers, "
        f"hidden {m.hidden_size}, vocab {m.vocab_size}",
        *_moe_lines(p),
        f"actor: {p.layout} = {x.actor_gpus} GPUs ({x.gpu_mem_gb:g} GiB each), {x.precision}, "
        f"recompute {x.recompute}, distributed optimizer "
        f"{'on' if x.distributed_optimizer else 'off'}, device {x.device}",
        f"batch: {x.responses_per_step} responses x {x.seq_len} tokens ({x.prompt_len} prompt"
        f"{'' if x.prompt_len_from_config else ' (assumed; --prompt-len)'} + "
        f"{x.response_len} response), micro-batch {x.micro_batch_size} seq, {x.n_micro} "
        f"micro-batches per optimizer step per DP rank, head "
        f"{'fused' if x.fused_head else 'unfused'}",
        "",
        f"actor GPU, worst pipeline stage ({p.stage}):",
    ]
    lines += [f"  {k:<58} {_gib(v)}" for k, v in p.actor.items()]
    verdict = "fits" if p.actor_fits else "DOES NOT FIT"
    lines.append(f"  {'total':<58} {_gib(p.actor_total)}  / {x.gpu_mem_gb:g} GiB -> {verdict}")
    if host := checkpoint_host_bytes(x):
        lines.append(f"  {'host RAM per rank for checkpoints (fully_reshardable)':<58} "
                     f"{_gib(host)}")
    if alternatives:
        lines += ["", "  same layout, other settings (total per GPU):"]
        for dist_opt in (False, True):
            for rc in RECOMPUTE:
                alt = make_plan(dataclasses.replace(x, distributed_optimizer=dist_opt,
                                                    recompute=rc))
                lines.append(f"    distributed optimizer {'on ' if dist_opt else 'off'} "
                             f"recompute {rc:<9} {_gib(alt.actor_total)}  "
                             f"{'fits' if alt.actor_fits else 'DOES NOT FIT'}")
    if p.server is not None:
        s = p.server
        kv_label = f"KV for {s['concurrency']} requests x {x.seq_len} tokens"
        lines += ["", f"rollout: {x.servers} servers x TP{x.server_tp} = "
                      f"{x.servers * x.server_tp} GPUs, mem_fraction_static "
                      f"{x.server_mem_fraction}:",
                  f"  {'weights (' + s['weights_dtype'] + ') per GPU':<58} "
                  f"{_gib(s['weights'])}",
                  f"  {'KV pool per GPU (budget - weights)':<58} {_gib(s['kv_pool'])}",
                  f"  {'KV per token per GPU':<58} {s['kv_per_token'] / 1024:8.1f} KiB",
                  f"  {kv_label:<58} {_gib(s['kv_needed'])}",
                  f"  full-length requests in flight per server: {s['max_full_length_requests']} "
                  f"(configured {s['concurrency']})" + ("" if s["kv_fits"] else
                  " -> the server queues the rest (KV-bound; shorter responses admit more)"),
                  "  weights " + ("fit" if s["weights_fit"] else "DO NOT FIT") +
                  " in the static budget"]
    if p.colocated:
        lines += ["", "colocated (servers on the actor's GPUs, taking turns): one shared GPU per "
                      "phase"]
        lines += [f"  {k:<58} {_gib(v)}" for k, v in p.colocated.items()]
        gpu = x.gpu_mem_gb * GIB
        lines.append(f"  {'peak (max of the phases, not their sum)':<58} "
                     f"{_gib(p.colocated_peak)}  / {x.gpu_mem_gb:g} GiB -> "
                     f"{'fits' if p.colocated_peak <= gpu else 'DOES NOT FIT'}")
    sync_t, async_t = p.totals()
    comm = "no communication" if ALLTOALL not in p.seconds else (
        f"communication: the MoE all-to-all only ({alltoall_bytes(x) / GIB:.1f} GiB per GPU per "
        f"step leave the rank, {x.intra_node_gbps:g} GB/s in a node, {x.inter_node_gbps:g} GB/s "
        f"between nodes of {x.gpus_per_node} GPUs)")
    if CP_KV in p.seconds:
        comm = (f"communication: the CP K/V exchange only ({cp_kv_bytes(x) / GIB:.1f} GiB per GPU "
                f"per step, {x.intra_node_gbps:g} GB/s in a node, {x.inter_node_gbps:g} GB/s "
                f"between nodes of {x.gpus_per_node} GPUs, not overlapped)")
    priced = "actor passes padded to the cap (upper bound)" + (
        ", rollout at the response lengths" if p.rollout is not None else "")
    lines += ["", f"step time at MFU {x.mfu:.0%} (actor), {x.rollout_mfu:.0%} (rollout), "
                  f"{x.peak_tflops:g} TFLOP/s peak, {priced}, {comm}:"]
    lines += [f"  {k:<32} {_fmt_s(v)}" for k, v in p.seconds.items()]
    mine = " <- this config" if p.rollout is not None and not x.colocate else ""
    lines.append(f"  {'total, synchronous':<32} {_fmt_s(sync_t)}  (phases in sequence, "
                 f"max_staleness 0){mine if x.max_staleness == 0 else ''}")
    if p.rollout is not None and not x.colocate:
        lines.append(f"  {'total, asynchronous':<32} {_fmt_s(async_t)}  (max_staleness >= 1: "
                     f"max(rollout, actor) + sync){mine if x.max_staleness else ''}")
    lines += _rollout_lines(p)
    lines += _format_batching(p)
    lines.append(f"verdict: {p.layout} {'FITS' if p.fits else 'DOES NOT FIT'}")
    return "\n".join(lines)
