"""Memory and step-time planner: does a run config fit its GPUs, and at which TP x PP x DP layout.

``python -m megatron_rl plan CONFIG [--gpus N --gpu-mem-gb 80] [--search]`` prints, per GPU:

* the **actor** (worst pipeline stage): weights in the training dtype, fp32 main weights, fp32
  gradient buffer (megatron DDP reduces in fp32), Adam moments -- the last two sharded over DP with
  the distributed optimizer; activations of the micro-batches in flight (1F1B: the first stage
  holds ``min(pp, n_micro)``) with no / selective / full recomputation; the output head's working
  set (the fused kernel's row chunk, or the ``[tokens, V/TP]`` logits of the unfused op);
* the **reference model** (only when the loss has a KL term): resident weights, or none on the GPU
  when offloaded to CPU between its passes; none with LoRA (the base with adapters off); the
  **distillation teacher** (``teacher.engine: actor``) alike, with its own architecture;
* with LoRA (``actor.lora.rank``): the frozen base weights in the training dtype, and the main
  weights, gradients and Adam moments of the adapters only;
* one **rollout server** GPU (SGLang, ``server_tp`` GPUs per server): weights + the KV cache of the
  configured concurrency at full length, against the ``mem_fraction_static`` budget;
* with ``rollout.sglang.colocate`` (servers on the actor's GPUs, taking turns): each phase of the
  colocated step on one shared GPU -- rollout (the server's static budget), update (the actor;
  the server released), weight sync (the actor's parameters + the server's weights + the sync's
  buffers; its KV cache comes back only after the actor's parameters left) -- and their
  **peak**, not their sum, against the GPU; plus the time of the host<->device swaps;
* the step time from FLOPs at a stated MFU (communication is not modelled).

Every number is a closed-form estimate from the model shape (:class:`PlanInputs`); the README states
how far it is from the actor's measured memory (``tools/bench_plan_check.py``). Config fields that
only some builds have (``actor.precision``, ``actor.recompute``, ``actor.offload_ref``,
``rollout.sglang.*``) are read with defaults, and the CLI can override each of them.

This module: the parameter counts and the per-GPU memory of the actor, the rollout servers and
the colocated phases. The step time is :mod:`megatron_rl.plan.step_time`; one layout's plan and
its report :mod:`megatron_rl.plan.report`; the layout search :mod:`megatron_rl.plan.layout_search`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from megatron_rl.models.config import ModelConfig
from megatron_rl.plan.inputs import (
    GIB,
    MAX_CHUNK_ROWS,
    RUNTIME_RESERVE_GIB,
    SERVER_RESERVE_GIB,
    PlanInputs,
)


def layer_params(m: ModelConfig) -> tuple[int, int]:
    """(tensor-parallel-split, replicated) parameters of one transformer layer, experts excluded
    (:func:`expert_layer_params`): a dense layer's SwiGLU MLP is split; an MoE layer's router
    ``[E, H]`` is replicated."""
    d, h, f = m.kv_channels, m.hidden_size, m.intermediate_size
    q, kv = m.num_attention_heads * d, m.num_key_value_heads * d
    split = h * (q + 2 * kv) + q * h  # QKV, output projection
    split += (q + 2 * kv) if m.qkv_bias else 0
    replicated = 2 * h + (2 * d if m.qk_layernorm else 0)  # two RMSNorms (+ q/k norms)
    if m.is_moe:
        replicated += m.num_experts * h  # router
    else:
        split += 3 * h * f  # SwiGLU fc1 (2f) + fc2
    return split, replicated


def expert_layer_params(m: ModelConfig) -> int:
    """Parameters of all routed experts of one layer (SwiGLU fc1 ``[2F, H]`` + fc2 ``[H, F]``
    each); 0 for a dense model."""
    return m.num_experts * 3 * m.hidden_size * m.moe_intermediate_size


def _non_layer_params(m: ModelConfig) -> int:
    emb = m.vocab_size * m.hidden_size
    return m.hidden_size + emb * (1 if m.tie_word_embeddings else 2)  # final norm, emb, head


def total_params(m: ModelConfig) -> int:
    """All parameters of the model (tied embeddings counted once; every expert)."""
    split, rep = layer_params(m)
    return m.num_hidden_layers * (split + rep + expert_layer_params(m)) + _non_layer_params(m)


def active_params(m: ModelConfig) -> int:
    """Parameters one token runs through: the dense parts and ``num_experts_per_tok`` experts
    per layer (= :func:`total_params` for a dense model)."""
    if not m.is_moe:
        return total_params(m)
    split, rep = layer_params(m)
    experts = expert_layer_params(m) * m.num_experts_per_tok // m.num_experts
    return m.num_hidden_layers * (split + rep + experts) + _non_layer_params(m)


def stage_expert_params(m: ModelConfig, pp: int, ep: int = 1) -> int:
    """Expert parameters one GPU of a pipeline stage holds: its ``num_experts / ep`` experts of
    each of its layers (expert tensor parallelism is 1: experts are never split inside)."""
    return (m.num_hidden_layers // pp) * expert_layer_params(m) // ep


def stage_params(m: ModelConfig, tp: int, pp: int, stage: int, ep: int = 1) -> int:
    """Parameters one GPU of pipeline ``stage`` holds (its TP shard of the dense parts, its EP
    shard of the experts; megatron keeps a copy of the tied embedding on the last stage when
    ``pp > 1``)."""
    split, rep = layer_params(m)
    n = (m.num_hidden_layers // pp) * (split // tp + rep)
    emb = m.vocab_size // tp * m.hidden_size
    if stage == 0:
        n += emb
    if stage == pp - 1:
        n += m.hidden_size  # final norm
        if not m.tie_word_embeddings or pp > 1:
            n += emb
    return n + stage_expert_params(m, pp, ep)


def _dtype_bytes(precision: str) -> int:
    return 4 if precision == "fp32" else 2


def optimizer_state_bytes(params: int, x: PlanInputs, shard: int | None = None,
                          prefix: str = "") -> dict[str, float]:
    """Weights, fp32 main weights, fp32 gradients and Adam moments of ``params`` parameters; with
    the distributed optimizer the main weights and moments are sharded ``shard`` ways (default:
    DP x CP, megatron's data-parallel group with context parallelism; expert parameters: expert
    DP, :attr:`PlanInputs.expert_dp`). ``prefix`` names the item (``"expert "``)."""
    shard = (shard or x.dp * x.cp) if x.distributed_optimizer else 1
    w = _dtype_bytes(x.precision)
    return {
        f"{prefix}weights": params * w,
        f"{prefix}main weights (fp32)": 0.0 if x.precision == "fp32" else params * 4 / shard,
        f"{prefix}gradients (fp32)": params * 4.0,
        f"{prefix}Adam moments (fp32)": params * 8 / shard,
    }


def lora_layer_params(m: ModelConfig, rank: int, tp: int, targets) -> int:
    """Adapter parameters of one layer on one TP rank (docs/lora.md): a column-parallel target
    holds ``A [r, in]`` whole and ``B [out/tp, r]``, a row-parallel one ``A [r, in/tp]`` and
    ``B [out, r]`` whole."""
    h, f, d = m.hidden_size, m.intermediate_size, m.kv_channels
    qkv_out = (m.num_attention_heads + 2 * m.num_key_value_heads) * d
    shapes = {"linear_qkv": ("column", h, qkv_out), "linear_fc1": ("column", h, 2 * f),
              "linear_proj": ("row", m.num_attention_heads * d, h), "linear_fc2": ("row", f, h)}
    n = 0
    for t in targets:
        kind, fan_in, fan_out = shapes[t]
        n += rank * fan_in + fan_out // tp * rank if kind == "column" else \
            rank * fan_in // tp + fan_out * rank
    return n


def lora_state_bytes(x: PlanInputs, stage: int) -> dict[str, float]:
    """A LoRA actor's GPU of ``stage``: the frozen base weights (no gradient, no optimizer
    state) and the adapters with their weights, fp32 main copies, gradients and Adam moments."""
    base = stage_params(x.model, x.tp, x.pp, stage, x.ep)
    adapters = (x.model.num_hidden_layers // x.pp) * lora_layer_params(
        x.model, x.lora_rank, x.tp, x.lora_targets)
    items = {"weights (frozen base)": float(base * _dtype_bytes(x.precision))}
    items.update(optimizer_state_bytes(adapters, x, prefix="LoRA adapter "))
    return items


def actor_state_bytes(x: PlanInputs, stage: int) -> dict[str, float]:
    """Weights, gradients and optimizer state of one GPU of ``stage``: the dense parts sharded
    over DP, an MoE model's experts (its EP shard) over the expert-data-parallel group, as
    megatron-core's distributed optimizer does (one buffer per group). With LoRA
    (``x.lora_rank``): :func:`lora_state_bytes`."""
    if x.lora_rank > 0:
        return lora_state_bytes(x, stage)
    experts = stage_expert_params(x.model, x.pp, x.ep)
    dense = stage_params(x.model, x.tp, x.pp, stage, x.ep) - experts
    items = optimizer_state_bytes(dense, x, prefix="dense " if x.model.is_moe else "")
    if x.model.is_moe:
        items.update(optimizer_state_bytes(experts, x, shard=x.expert_dp, prefix="expert "))
    return items


def layer_activation_elems(x: PlanInputs) -> tuple[float, float]:
    """Saved-for-backward elements of one layer, without recomputation:
    (per token, per sequence). Attention is SDPA on both devices (models/attention.py: flash /
    fused kernels keep q, k, v, the output and log-sum-exp, no ``[S, S]`` scores), so the
    per-sequence term is zero; the devices differ in the norm and SwiGLU kernels.

    An MoE layer's MLP term, per token, is that of its ``k = num_experts_per_tok`` routed copies
    (each rank's experts receive ``k`` rows per local token on average; imbalance not modelled):
    the permuted expert input and the expert output kept for the probability-weighted combine
    (``2H`` each), the experts' SwiGLU (as dense, with ``F = moe_intermediate_size``), plus the
    router's fp32 logits and probabilities (``2E``). Experts are not split by TP; at TP > 1 each
    TP rank runs the MoE layer on its ``1 / tp`` of the tokens."""
    m, tp = x.model, x.tp
    h, f, d = m.hidden_size, m.intermediate_size, m.kv_channels
    q, kv = m.num_attention_heads * d, m.num_key_value_heads * d
    attn = (q + 2 * kv + q) / tp  # q, k, v + output (+ log-sum-exp, negligible)
    if x.device == "gpu":  # fused RMSNorm (input + output), fused SwiGLU
        norms = 2 * 2 * h
        swiglu = 3  # fc1 output (2f) + SwiGLU output (f)
    else:  # torch's composite RMSNorm (input, normalised, output), plain SwiGLU
        norms = 2 * 3 * h
        swiglu = 4  # fc1 output (2f), silu output (f), product (f)
    if m.is_moe:
        router = 2 * m.num_experts * 4 / _dtype_bytes(x.precision)  # fp32, in activation elems
        # at TP > 1 each TP rank routes its 1 / tp slice of the sequence (models/moe_tp.py)
        mlp = (m.num_experts_per_tok * (2 * h + swiglu * m.moe_intermediate_size) + router) / tp
    else:
        mlp = swiglu * f / tp
    return norms + attn + mlp, 0.0


def cp_gathered_kv_elems(x: PlanInputs) -> float:
    """Elements of the K/V a context-parallel layer gathers from the other CP ranks and keeps
    for its backward, per micro-batch: ``(cp - 1) / cp`` of the row's ``2 x groups x D / TP``
    per token (0 at CP 1; models/attention.py)."""
    m = x.model
    kv = 2 * m.num_key_value_heads * m.kv_channels / x.tp
    return x.micro_batch_size * x.seq_len * kv * (x.cp - 1) / x.cp


def activation_bytes(x: PlanInputs) -> dict[str, float]:
    """Activations of the first pipeline stage (the one with the most micro-batches in flight).
    Context parallelism: each rank holds ``1 / cp`` of every row's tokens, plus the K/V gathered
    from the other CP ranks (:func:`cp_gathered_kv_elems`)."""
    a = _dtype_bytes(x.precision)
    softmax_b = 4  # attention_softmax_in_fp32 (only for a per-sequence term)
    tokens = x.micro_batch_size * x.seq_len / x.cp
    per_tok, per_seq = layer_activation_elems(x)
    one_layer = (tokens * per_tok * a + x.micro_batch_size * per_seq * softmax_b
                 + cp_gathered_kv_elems(x) * a)
    layers = x.model.num_hidden_layers // x.pp
    in_flight = min(x.pp, x.n_micro)
    if x.recompute == "full":  # layer inputs kept, one layer re-materialised during backward
        kept = in_flight * layers * tokens * x.model.hidden_size * a
        return {"activations (layer inputs, full recompute)": kept,
                "recompute working set (1 layer)": one_layer}
    return {f"activations ({in_flight} micro-batch(es) x {layers} layers, recompute "
            f"{x.recompute})": in_flight * layers * one_layer}


def head_bytes(x: PlanInputs) -> dict[str, float]:
    """Output head of the last stage, one micro-batch: response rows only (``1 / cp`` of them
    per rank under context parallelism)."""
    m, a = x.model, _dtype_bytes(x.precision)
    rows = -(-x.micro_batch_size * x.response_len // x.cp)
    v_local = m.vocab_size // x.tp
    hidden_rows = rows * m.hidden_size * a
    if x.fused_head:
        chunk = min(rows, x.head_chunk or MAX_CHUNK_ROWS)
        return {"head: fused kernel chunk working set": hidden_rows + chunk * v_local * (a + 8)}
    chunk = min(rows, x.head_chunk or rows)
    # logits kept for backward + their gradient (input dtype) + fp32 working buffers per chunk;
    # autograd's output-layer weight gradient [V/TP, H] exists before it is added to main_grad
    # (the fused kernel adds straight into main_grad)
    return {"head: [tokens, V/TP] logits + grad": rows * v_local * 2 * a + 2 * chunk * v_local * 4
            + hidden_rows,
            "head: output-layer weight gradient (transient)": v_local * m.hidden_size * a}


def actor_breakdown(x: PlanInputs) -> tuple[int, dict[str, float]]:
    """(worst stage, bytes per item) of one actor GPU."""
    best: tuple[int, dict[str, float]] | None = None
    for stage in sorted({0, x.pp - 1}):
        items = actor_state_bytes(x, stage)
        if stage == 0:
            items.update(activation_bytes(x))
        if stage == x.pp - 1:
            if x.pp > 1:  # the last stage holds one micro-batch's activations
                items.update(activation_bytes(dataclasses.replace(x, n_micro=1, pp=x.pp)))
            items.update(head_bytes(x))
        if x.use_ref and x.lora_rank > 0:
            items["reference model (the base, adapters off: no copy)"] = 0.0
        elif x.use_ref:
            p = stage_params(x.model, x.tp, x.pp, stage, x.ep) * _dtype_bytes(x.precision)
            items["reference model" + (" (offloaded to CPU)" if x.offload_ref else "")] = (
                0.0 if x.offload_ref else p)
        if x.teacher is not None:  # on-policy distillation: another frozen model per stage
            p = stage_params(x.teacher, x.tp, x.pp, stage, 1) * _dtype_bytes(x.precision)
            items["distillation teacher" + (" (offloaded to CPU)" if x.offload_ref else "")] = (
                0.0 if x.offload_ref else p)
        if x.device == "gpu":
            items["runtime reserve (CUDA context, NCCL, fragmentation)"] = RUNTIME_RESERVE_GIB * GIB
        if best is None or sum(items.values()) > sum(best[1].values()):
            best = (stage, items)
    assert best is not None
    return best


def checkpoint_host_bytes(x: PlanInputs) -> float:
    """Host memory one rank of the worst stage needs to save or load a checkpoint with the
    distributed optimizer: megatron's ``fully_reshardable`` format gathers the fp32 main weights
    and both Adam moments of the rank's whole TP/PP shard over DP into host tensors (12 bytes per
    parameter); a half-precision actor's load also reads the model part's fp32 weights into full
    host buffers before each rank keeps its DP shard (4 more). 0 for the standard optimizer (each
    rank writes its own state as it is)."""
    if not x.distributed_optimizer:
        return 0.0
    per_param = 12.0 if x.precision == "fp32" else 16.0
    return max(stage_params(x.model, x.tp, x.pp, s, x.ep) for s in {0, x.pp - 1}) * per_param


def kv_bytes_per_token(m: ModelConfig, server_tp: int, kv_cache_dtype: str = "auto"
                       ) -> float:
    """K and V of all layers for one token on one server GPU (KV heads split over TP,
    replicated when TP exceeds them): bf16, or 1 byte each with an ``fp8*`` ``--kv-cache-dtype``
    (SGLang's KV cache follows that flag, not the weights' quantization)."""
    heads = max(1, m.num_key_value_heads // server_tp)
    elem = 1 if kv_cache_dtype.startswith("fp8") else 2
    return 2 * m.num_hidden_layers * heads * m.kv_channels * elem


def fp8_quantized_params(m: ModelConfig) -> int:
    """Parameters SGLang's ``fp8`` quantization serves as FP8 (:mod:`megatron_rl.rollout.fp8`):
    the attention projections and the dense / routed-expert MLP matrices; not the embeddings,
    ``lm_head``, norms, biases or routers."""
    d, h = m.kv_channels, m.hidden_size
    q, kv = m.num_attention_heads * d, m.num_key_value_heads * d
    per_layer = h * (q + 2 * kv) + q * h + expert_layer_params(m)
    if not m.is_moe:
        per_layer += 3 * h * m.intermediate_size
    return m.num_hidden_layers * per_layer


def server_weight_bytes(m: ModelConfig, quantization: str | None) -> float:
    """The served model's weight bytes: bf16, or with ``fp8`` 1 byte per quantised parameter
    plus one float32 scale per 128x128 block, bf16 for the rest."""
    total = total_params(m)
    if quantization != "fp8":
        return total * 2.0
    quant = fp8_quantized_params(m)
    return quant * (1 + 4 / (128 * 128)) + (total - quant) * 2.0


def server_breakdown(x: PlanInputs) -> dict[str, Any]:
    """One server GPU: weights (bf16 or FP8), the KV cache the configured concurrency needs (in
    the servers' KV dtype), the budget."""
    m = x.model
    weights = server_weight_bytes(m, x.server_quantization) / x.server_tp
    conc = x.concurrency or -(-x.rollout_responses // max(x.servers, 1))
    kv_tok = kv_bytes_per_token(m, x.server_tp, x.kv_cache_dtype)
    need = conc * x.seq_len * kv_tok
    budget = x.server_mem_fraction * x.gpu_mem_gb * GIB
    pool = max(budget - weights, 0.0)
    return {"weights": weights, "weights_dtype": "fp8" if x.server_quantization == "fp8"
            else "bf16", "kv_per_token": kv_tok, "concurrency": conc,
            "kv_needed": need, "kv_pool": pool,
            "max_full_length_requests": int(pool // (x.seq_len * kv_tok)),
            "weights_fit": weights < budget, "kv_fits": need <= pool}


def stream_tensor_bytes(x: PlanInputs) -> float:
    """The largest tensor the weight stream (:mod:`megatron_rl.convert.stream`) makes at once on
    a sender GPU, in the training dtype: a canonical tensor gathered over TP (the embedding /
    output layer ``[V, H]``, QKV, fc1 ``[2F, H]``, ...), or one MoE expert slot gathered over EP
    (``ep`` experts' fc1)."""
    m = x.model
    d, h = m.kv_channels, m.hidden_size
    q, kv = m.num_attention_heads * d, m.num_key_value_heads * d
    elems = [m.vocab_size * h, (q + 2 * kv) * h, q * h]
    if m.is_moe:
        elems += [m.num_experts * h, x.ep * 2 * m.moe_intermediate_size * h]
    else:
        elems += [2 * m.intermediate_size * h]
    return float(max(elems) * _dtype_bytes(x.precision))


def sync_transient_bytes(x: PlanInputs) -> float:
    """Bytes the colocated weight sync (``from_tensor``) holds on one shared GPU besides the
    actor's parameters and the server's weights: the bucket being sent and its flattened copy
    (each ``max(bucket, T)``: a tensor larger than ``rollout.weight_sync_bucket_mb`` is sent
    alone), the next tensor the stream has already gathered (``T``,
    :func:`stream_tensor_bytes`), and the flattened copy each other pipeline stage's sender puts
    on this GPU for a server rank here: ``(pp + 1) * max(bucket, T) + T``. Every buffer is freed
    once its request returns, so nothing grows with the number of buckets. (At TP 1 most tensors
    of a bucket are views of the parameters: the real figure is lower by up to a bucket.)"""
    return sync_buffer_bytes(x.sync_bucket_mb * 2**20, stream_tensor_bytes(x), x.pp)


def sync_buffer_bytes(bucket: float, tensor: float, pp: int) -> float:
    """:func:`sync_transient_bytes` for a bucket of ``bucket`` bytes, a largest streamed tensor
    of ``tensor`` bytes and ``pp`` pipeline stages: ``(pp + 1) * max(bucket, tensor) +
    tensor``."""
    return (pp + 1) * max(float(bucket), float(tensor)) + float(tensor)


def resident_frozen_bytes(x: PlanInputs, stage: int) -> float:
    """Device bytes on ``stage`` of the frozen models that stay on the GPU between their passes
    (``actor.offload_ref`` off): the reference policy (none with LoRA) and the distillation
    teacher. In colocation they leave and come back with the actor's parameters (one offload
    group, :class:`megatron_rl.actor.offload.ActorOffload`)."""
    if x.offload_ref:
        return 0.0
    n = 0
    if x.use_ref and x.lora_rank == 0:
        n += stage_params(x.model, x.tp, x.pp, stage, x.ep)
    if x.teacher is not None:
        n += stage_params(x.teacher, x.tp, x.pp, stage, 1)
    return float(n * _dtype_bytes(x.precision))


def colocated_phases(x: PlanInputs, stage: int, actor: dict[str, float],
                     server: dict[str, Any]) -> dict[str, float]:
    """Bytes on one shared GPU in each phase of the colocated step (megatron_rl/run/colocation.py):
    rollout = the server's static budget (weights + KV pool) + the trainer's runtime reserve
    (the actor is on the host); update = the actor's whole breakdown + a released server's
    reserve; weight sync = the actor's parameters (training dtype; a device-resident reference or
    teacher, :func:`resident_frozen_bytes`, comes back with them) + the server's weights (its KV
    cache and CUDA graphs stay released until the parameters have left) + a released server's
    reserve + the trainer's runtime reserve + the sync's buffers (:func:`sync_transient_bytes`;
    grads and optimizer state are already on the host)."""
    budget = server["weights"] + server["kv_pool"]
    reserve = RUNTIME_RESERVE_GIB * GIB if x.device == "gpu" else 0.0
    params = (stage_params(x.model, x.tp, x.pp, stage, x.ep) * _dtype_bytes(x.precision)
              + resident_frozen_bytes(x, stage))
    return {"rollout (server budget + trainer runtime)": budget + reserve,
            "update (actor + released server)": sum(actor.values()) + SERVER_RESERVE_GIB * GIB,
            "weight sync (actor params + server weights + sync buffers)":
                params + server["weights"] + SERVER_RESERVE_GIB * GIB + reserve
                + sync_transient_bytes(x)}
