"""The planner's step time: FLOPs of generation, old/ref passes and the update at a stated MFU,
and the host<->device swap time of a colocated step (communication is not modelled)."""

from __future__ import annotations

from megatron_rl.plan.inputs import HOST_LINK_GBPS, PlanInputs
from megatron_rl.plan.lengths import PaddingCost
from megatron_rl.plan.memory import layer_params, optimizer_state_bytes, stage_params


def swap_seconds(x: PlanInputs, stage: int) -> float:
    """Host<->device copy time of one colocated step: the actor's parameters, fp32 gradients
    and optimizer state leave and come back once (each way at ``HOST_LINK_GBPS``)."""
    n = stage_params(x.model, x.tp, x.pp, stage)
    state = optimizer_state_bytes(n, x)
    return 2 * sum(state.values()) / (HOST_LINK_GBPS * 1e9)


def step_flops(x: PlanInputs, cost: PaddingCost | None = None) -> dict[str, float]:
    """FLOPs of one RL step: rollout (prefill + decode), old-policy (and reference) forward,
    training forward + backward (+ recomputation). Padded lengths (an upper bound), or the actor
    passes' tokens and attention of ``cost`` (per row: :func:`megatron_rl.plan.lengths.
    padding_costs`; the response tokens the head scores are then the sample's, not the cap)."""
    m = x.model
    split, rep = layer_params(m)
    body = m.num_hidden_layers * (split + rep)
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
           "train (fwd + bwd)": 3 * fwd + recompute[x.recompute] + resp * head}  # head recompute
    if x.use_ref:
        out["reference log-probs"] = fwd
    return out


def step_seconds(x: PlanInputs, cost: PaddingCost | None = None) -> dict[str, float]:
    """Seconds per phase at the stated MFUs (actor phases include the pipeline bubble);
    ``cost``: see :func:`step_flops`."""
    fl = step_flops(x, cost)
    actor = x.actor_gpus * x.peak_tflops * 1e12 * x.mfu
    bubble = 1 + (x.pp - 1) / x.n_micro
    roll = "rollout (one generation round)"
    out = {k: v / actor * bubble for k, v in fl.items() if k != roll}
    if x.servers:
        out[roll] = fl[roll] / (x.servers * x.server_tp * x.peak_tflops * 1e12
                                          * x.rollout_mfu)
    return out
