"""The rollout phase priced from the response-length distribution, the weight sync, and the
step total with and without asynchronous rollouts (``rollout.max_staleness``).

Decode model (docs/planning.md, "Rollout and asynchronous steps"): a server runs its share of
a generation round's requests with ``slots`` of them in flight (continuous batching: a slot
freed by a finished request takes the next queued one). Each decode step emits one token for
every running request and costs the same however many slots are busy: decode is
memory-bound (every step reads the weights and the KV cache), which is what the low rollout
MFU stands for, so a step is priced as ``slots`` tokens at that MFU. The round's decode time is
then the number of steps until the server's last request ends (the makespan of the schedule):
with every request in flight at once, the longest response; with a queue, the busy slots'
sums plus the tail set by the longest responses at the end. At the cap (every response at
``max_new_tokens``) it is the FLOP estimate of the padded model. Prompts are prefilled at the
same MFU (compute-bound, no length effect).

Asynchronous rollouts (``max_staleness >= 1``) overlap generation with the actor's passes:
a step takes ``max(rollout, actor) + sync`` instead of ``rollout + actor + sync``.
"""

from __future__ import annotations

import heapq
import random
from dataclasses import dataclass
from typing import Sequence

from megatron_rl.plan.inputs import PlanInputs
from megatron_rl.plan.lengths import LengthSample
from megatron_rl.plan.memory import (
    expert_layer_params,
    kv_bytes_per_token,
    layer_params,
    server_breakdown,
    total_params,
)


def decode_steps(lengths: Sequence[int], slots: int) -> int:
    """Decode steps until the last of ``lengths`` (response tokens, served in this order) ends
    on one server with ``slots`` requests in flight: each freed slot takes the next request."""
    ends = [0] * max(1, min(slots, len(lengths)))
    for n in lengths:
        heapq.heappush(ends, heapq.heappop(ends) + int(n))
    return max(ends)


@dataclass(frozen=True)
class RolloutCost:
    """One server's share of a generation round and its time (seconds)."""

    requests: int  # requests per server
    slots: int  # requests in flight per server
    steps: int  # decode steps of the round at the sample's lengths
    steps_at_cap: int  # the same with every response at the cap
    longest: int  # the longest response of the server's requests
    prefill_s: float
    decode_s: float
    decode_at_cap_s: float

    @property
    def seconds(self) -> float:
        return self.prefill_s + self.decode_s

    @property
    def seconds_at_cap(self) -> float:
        return self.prefill_s + self.decode_at_cap_s


def _token_flops(x: PlanInputs, context: float, head: bool = True) -> float:
    """FLOPs of one token attending over ``context`` tokens (active parameters, causal
    attention coefficient and output head as in :func:`~megatron_rl.plan.step_time.
    step_flops`); ``head``: its logits are computed (a generated token; a prefilled prompt
    token needs none)."""
    m = x.model
    split, rep = layer_params(m)
    experts = expert_layer_params(m) * m.num_experts_per_tok // m.num_experts if m.is_moe else 0
    body = m.num_hidden_layers * (split + rep + experts)
    attn_coef = 2 * m.num_hidden_layers * m.num_attention_heads * m.kv_channels
    return 2 * body + attn_coef * context + (2 * m.vocab_size * m.hidden_size if head else 0)


def server_slots(x: PlanInputs, mean_response: float) -> int:
    """Requests in flight per server: the configured concurrency (``rollout.sglang.
    max_running_requests``, else the server's share of the round), bounded by the KV pool at
    the sample's mean context (prompt + mean response; shorter responses admit more)."""
    share = -(-x.rollout_responses // max(x.servers, 1))
    conc = x.concurrency or share
    pool = server_breakdown(x)["kv_pool"]
    kv_fit = int(
        pool // (kv_bytes_per_token(x.model, x.server_tp) * (x.prompt_len + mean_response))
    )
    return max(1, min(conc, share, kv_fit))


def rollout_cost(x: PlanInputs, sample: LengthSample) -> RolloutCost:
    """One generation round on one server: its ``ceil(R / servers)`` requests' lengths taken
    evenly over ``sample``'s sorted lengths (stratified: the tail is in every round), in a
    seeded random order, scheduled on :func:`server_slots` slots."""
    share = -(-x.rollout_responses // max(x.servers, 1))
    slots = server_slots(x, sample.mean)
    ordered = sorted(sample.lengths)
    lengths = [ordered[int((i + 0.5) * len(ordered) / share)] for i in range(share)]
    random.Random(0).shuffle(lengths)
    steps = decode_steps(lengths, slots)
    at_cap = -(-share // slots) * sample.cap
    rate = x.server_tp * x.peak_tflops * 1e12 * x.rollout_mfu  # one server's FLOP/s
    step = slots * _token_flops(x, x.prompt_len + sample.mean) / rate
    step_cap = slots * _token_flops(x, x.prompt_len + sample.cap) / rate
    prefill = share * x.prompt_len * _token_flops(x, x.prompt_len, head=False) / rate
    return RolloutCost(
        share, slots, steps, at_cap, max(lengths), prefill, steps * step, at_cap * step_cap
    )


def sync_seconds(x: PlanInputs) -> float:
    """One weight sync into a separate fleet: every server GPU receives its ``1 / server_tp``
    of the bf16 weights over its NIC (``inter_node_gbps``), all servers at once (a broadcast);
    0 without servers or when colocated (the sync stays on the GPU)."""
    if not x.servers or x.colocate:
        return 0.0
    return total_params(x.model) * 2 / x.server_tp / (x.inter_node_gbps * 1e9)


def step_totals(actor_s: float, rollout_s: float, sync_s: float) -> tuple[float, float]:
    """``(synchronous, asynchronous)`` seconds per step: phases in sequence, and generation
    overlapped with the actor (``max_staleness >= 1``): the slower side plus the sync."""
    return actor_s + rollout_s + sync_s, max(actor_s, rollout_s) + sync_s
