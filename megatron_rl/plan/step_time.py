"""The planner's step time: FLOPs of generation, old/ref passes and the update at a stated MFU
(an MoE model's FLOPs from its active parameters), an MoE actor's expert-parallel all-to-all,
a context-parallel actor's K/V exchange, and the host<->device swap time of a colocated step
(other communication is not modelled)."""

from __future__ import annotations

import dataclasses

from megatron_rl.plan.inputs import HOST_LINK_GBPS, PlanInputs
from megatron_rl.plan.lengths import PaddingCost
from megatron_rl.plan.memory import (
    actor_state_bytes,
    expert_layer_params,
    layer_params,
    resident_frozen_bytes,
)


def swap_seconds(x: PlanInputs, stage: int) -> float:
    """Host<->device copy time of one colocated step: the actor's parameters, fp32 gradients
    and optimizer state, and a device-resident reference or teacher, leave and come back once
    (each way at ``HOST_LINK_GBPS``)."""
    moved = sum(actor_state_bytes(x, stage).values()) + resident_frozen_bytes(x, stage)
    return 2 * moved / (HOST_LINK_GBPS * 1e9)


def step_flops(x: PlanInputs, cost: PaddingCost | None = None) -> dict[str, float]:
    """FLOPs of one RL step: rollout (prefill + decode), old-policy (and reference, and
    distillation teacher) forward,
    training forward + backward (+ recomputation). Padded lengths (an upper bound), or the actor
    passes' tokens and attention of ``cost`` (per row: :func:`megatron_rl.plan.lengths.
    padding_costs`; the response tokens the head scores are then the sample's, not the cap)."""
    m = x.model
    split, rep = layer_params(m)
    active_experts = expert_layer_params(m) * m.num_experts_per_tok // m.num_experts \
        if m.is_moe else 0
    body = m.num_hidden_layers * (split + rep + active_experts)  # active parameters
    attn_coef = 2 * m.num_hidden_layers * m.num_attention_heads * m.kv_channels  # causal
    head = 2 * m.vocab_size * m.hidden_size
    n = x.responses_per_step
    toks, resp = n * x.seq_len, n * x.response_len
    attn_all = toks * attn_coef * x.seq_len  # every token attends over the padded length
    if cost is not None:
        toks, attn_all = n * cost.tokens, n * cost.attn * attn_coef
        resp = n * cost.response_tokens
    fwd = toks * 2 * body + attn_all + resp * head
    recompute = {"none": 0.0, "selective": attn_all, "full": toks * 2 * body + attn_all}
    gen = x.rollout_responses * x.seq_len
    out = {"rollout (one generation round)": gen * (2 * body + attn_coef * x.seq_len)
           + x.rollout_responses * x.response_len * head,
           "old-policy log-probs": fwd,
           # backward: input gradients + weight gradients (LoRA: no weight gradients of the
           # frozen base; the adapters' are negligible)
           "train (fwd + bwd)": (2 if x.lora_rank > 0 else 3) * fwd + recompute[x.recompute]
           + resp * head}  # head recompute
    if x.use_ref:
        out["reference log-probs"] = fwd
    if x.teacher is not None:  # the teacher's forward over the same tokens
        as_teacher = dataclasses.replace(x, model=x.teacher, teacher=None, use_ref=False, ep=1)
        out["teacher log-probs"] = step_flops(as_teacher, cost)["old-policy log-probs"]
    return out


ALLTOALL = "MoE all-to-all (EP)"  # dispatch + combine of every pass


def alltoall_bytes(x: PlanInputs, cost: PaddingCost | None = None) -> float:
    """Bytes one actor GPU sends to the other ranks of its expert-parallel group in one step
    (megatron's ``alltoall`` token dispatcher): per layer of its stage and per pass direction,
    its tokens' ``num_experts_per_tok`` routed copies of the hidden state go out (dispatch) and
    come back (combine), ``(ep - 1) / ep`` of them to other ranks (uniform routing). Directions:
    the old-policy (and reference) forward, the update's forward and backward, and the
    recomputed forward under full recomputation. Tokens: this rank's share of the step's rows
    (``/ dp``; ``/ tp`` too: each TP rank dispatches its slice, models/moe_tp.py), padded to
    the cap or at ``cost``'s tokens per row. 0 for a dense model or ``ep == 1``."""
    m = x.model
    if not m.is_moe or x.ep == 1:
        return 0.0
    per_row = cost.tokens if cost is not None else x.seq_len
    tokens = x.responses_per_step * per_row / (x.dp * x.tp)
    one = tokens * m.num_experts_per_tok * m.hidden_size * (4 if x.precision == "fp32" else 2)
    directions = 1 + int(x.use_ref) + 2 + int(x.recompute == "full")
    return 2 * directions * (m.num_hidden_layers // x.pp) * one * (x.ep - 1) / x.ep


def alltoall_seconds(x: PlanInputs, cost: PaddingCost | None = None) -> float:
    """:func:`alltoall_bytes` over the links: the expert-parallel group is ``ep`` consecutive
    ranks (megatron-core's expert rank order with expert TP 1), so ``min(ep, gpus_per_node) - 1``
    peers share the node (NVLink, ``intra_node_gbps``) and the rest are on other nodes
    (``inter_node_gbps``); both links run at once, the slower share sets the time."""
    b = alltoall_bytes(x, cost)
    if not b:
        return 0.0
    local = min(x.ep, x.gpus_per_node) - 1
    remote = x.ep - 1 - local
    return max(b * local / (x.ep - 1) / (x.intra_node_gbps * 1e9),
               b * remote / (x.ep - 1) / (x.inter_node_gbps * 1e9))


CP_KV = "CP K/V exchange"  # the context-parallel attention's gather (fwd) / reduce-scatter (bwd)


def cp_kv_bytes(x: PlanInputs, cost: PaddingCost | None = None) -> float:
    """Bytes one actor GPU receives from the other ranks of its CP group in one step: per layer
    of its stage and per pass direction, the ``(cp - 1) / cp`` of each row's K and V
    (``2 x groups x D / TP`` per token) held elsewhere: gathered in every forward (old-policy,
    reference, update, and the recomputed one under full recomputation), reduce-scattered as
    dK/dV in the backward. Rows: this DP rank's share of the step. 0 at CP 1."""
    if x.cp == 1:
        return 0.0
    m = x.model
    per_row = cost.tokens if cost is not None else x.seq_len
    kv = 2 * m.num_key_value_heads * m.kv_channels / x.tp * (4 if x.precision == "fp32" else 2)
    rows = x.responses_per_step / x.dp
    directions = 1 + int(x.use_ref) + 2 + int(x.recompute == "full")
    return directions * (m.num_hidden_layers // x.pp) * rows * per_row * kv * (x.cp - 1) / x.cp


def cp_kv_seconds(x: PlanInputs, cost: PaddingCost | None = None) -> float:
    """:func:`cp_kv_bytes` over one link: megatron orders ranks TP, then CP, so a CP group spans
    ``tp x cp`` consecutive ranks: NVLink (``intra_node_gbps``) while that fits a node, the
    inter-node link otherwise. Not overlapped with compute (Transformer Engine's ring exchange
    overlaps it: an upper bound there)."""
    b = cp_kv_bytes(x, cost)
    if not b:
        return 0.0
    gbps = x.intra_node_gbps if x.tp * x.cp <= x.gpus_per_node else x.inter_node_gbps
    return b / (gbps * 1e9)


def step_seconds(x: PlanInputs, cost: PaddingCost | None = None,
                 rollout_s: float | None = None) -> dict[str, float]:
    """Seconds per phase at the stated MFUs (actor phases include the pipeline bubble; an MoE
    actor's all-to-all is not overlapped with compute); ``cost``: see :func:`step_flops`;
    ``rollout_s``: the rollout priced from the response lengths
    (:func:`megatron_rl.plan.rollout_time.rollout_cost`), else every response at the cap."""
    fl = step_flops(x, cost)
    actor = x.actor_gpus * x.peak_tflops * 1e12 * x.mfu
    bubble = 1 + (x.pp - 1) / x.n_micro
    roll = "rollout (one generation round)"
    out = {k: v / actor * bubble for k, v in fl.items() if k != roll}
    if a2a := alltoall_seconds(x, cost):
        out[ALLTOALL] = a2a * bubble
    if kv := cp_kv_seconds(x, cost):
        out[CP_KV] = kv * bubble
    if x.servers:
        out[roll] = rollout_s if rollout_s is not None else fl[roll] / (
            x.servers * x.server_tp * x.peak_tflops * 1e12 * x.rollout_mfu)
    return out
