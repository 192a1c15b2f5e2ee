"""Memory and step-time planner: does a run config fit its GPUs, and at which TP x PP x DP layout.

``python -m megatron_rl plan CONFIG [--gpus N --gpu-mem-gb 80] [--search]`` prints, per GPU:

* the **actor** (worst pipeline stage): weights in the training dtype, fp32 main weights, fp32
  gradient buffer (megatron DDP reduces in fp32), Adam moments -- the last two sharded over DP with
  the distributed optimizer; activations of the micro-batches in flight (1F1B: the first stage
  holds ``min(pp, n_micro)``) with no / selective / full recomputation; the output head's working
  set (the fused kernel's row chunk, or the ``[tokens, V/TP]`` logits of the unfused op);
* the **reference model** (only when the loss has a KL term): resident weights, or none on the GPU
  when offloaded to CPU between its passes;
* one **rollout server** GPU (SGLang, ``server_tp`` GPUs per server): weights + the KV cache of the
  configured concurrency at full length, against the ``mem_fraction_static`` budget;
* with ``rollout.sglang.colocate`` (servers on the actor's GPUs, taking turns): each phase of the
  colocated step on one shared GPU -- rollout (the server's static budget), update (the actor;
  the server released), weight sync (the actor's parameters + the resumed server) -- and their
  **peak**, not their sum, against the GPU; plus the time of the host<->device swaps;
* the step time from FLOPs at a stated MFU (communication is not modelled).

Every number is a closed-form estimate from the model shape (:class:`PlanInputs`); the README states
how far it is from the actor's measured memory (``tools/bench_plan_check.py``). Config fields that
only some builds have (``actor.precision``, ``actor.recompute``, ``actor.offload_ref``,
``rollout.sglang.*``) are read with defaults, and the CLI can override each of them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from megatron_rl.models.config import ModelConfig, ModelConfigError, validate_for_layout

GIB = 1024 ** 3
PRECISIONS = ("bf16", "fp16", "fp32")
RECOMPUTE = ("none", "selective", "full")
DEVICES = ("gpu", "cpu")
RUNTIME_RESERVE_GIB = 3.0  # CUDA context + NCCL buffers + allocator fragmentation, per GPU
MAX_CHUNK_ROWS = 4096  # the fused head's largest row chunk (kernels/fused_head_torch.py)
SERVER_RESERVE_GIB = 1.0  # a released SGLang server: CUDA context and what it does not release
HOST_LINK_GBPS = 25.0  # pinned host<->device copies (PCIe Gen4 x16 class), for the swap time


class PlanError(ValueError):
    """A planner input is invalid; the message names the field or flag."""


@dataclass(frozen=True)
class PlanInputs:
    """Everything one estimate needs. Lengths are tokens, sizes are sequences per DP rank."""

    model: ModelConfig
    tp: int = 1
    pp: int = 1
    dp: int = 1
    precision: str = "bf16"
    recompute: str = "none"
    distributed_optimizer: bool = False
    device: str = "gpu"  # "gpu": fused norm/SwiGLU kernels; "cpu": torch's composite ones
    micro_batch_size: int = 1
    prompt_len: int = 2048
    prompt_len_from_config: bool = True  # False: prompt_len is the planner's assumption
    response_len: int = 2048
    n_micro: int = 1  # micro-batches per optimizer step on one DP rank
    responses_per_step: int = 8
    gen_responses: int = 0  # responses generated per round (dynamic sampling); 0 = per step
    fused_head: bool = True
    head_chunk: int | None = None
    use_ref: bool = False
    offload_ref: bool = True
    servers: int = 0
    server_tp: int = 1
    server_mem_fraction: float = 0.85
    concurrency: int = 0  # requests in flight per server; 0 = responses_per_step / servers
    colocate: bool = False  # servers on the actor's GPUs, taking turns with the memory
    sync_bucket_mb: int = 64  # rollout.weight_sync_bucket_mb (the colocated sync's buffer)
    gpu_mem_gb: float = 80.0
    peak_tflops: float = 989.0  # dense bf16 per GPU (H100 SXM)
    mfu: float = 0.35
    rollout_mfu: float = 0.10

    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.response_len

    @property
    def rollout_responses(self) -> int:
        return self.gen_responses or self.responses_per_step

    @property
    def actor_gpus(self) -> int:
        return self.tp * self.pp * self.dp

    def validate(self) -> PlanInputs:
        """Raise :class:`PlanError` naming the bad field."""
        if self.precision not in PRECISIONS:
            raise PlanError(f"precision={self.precision!r} is not one of {PRECISIONS}")
        if self.recompute not in RECOMPUTE:
            raise PlanError(f"recompute={self.recompute!r} is not one of {RECOMPUTE}")
        if self.device not in DEVICES:
            raise PlanError(f"device={self.device!r} is not one of {DEVICES}")
        for name in ("tp", "pp", "dp", "micro_batch_size", "n_micro", "server_tp"):
            if getattr(self, name) < 1:
                raise PlanError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.colocate and self.servers * self.server_tp > self.actor_gpus:
            raise PlanError(f"colocate: {self.servers} servers x TP{self.server_tp} need "
                            f"{self.servers * self.server_tp} GPUs, the actor has "
                            f"{self.actor_gpus}")
        if not 0 < self.server_mem_fraction <= 1:
            raise PlanError(f"server_mem_fraction must be in (0, 1], got "
                            f"{self.server_mem_fraction}")
        try:
            validate_for_layout(self.model, self.tp, self.pp)
        except ModelConfigError as exc:
            raise PlanError(str(exc)) from exc
        return self


# --------------------------------------------------------------------------------------------
# Parameter counts
# --------------------------------------------------------------------------------------------
def layer_params(m: ModelConfig) -> tuple[int, int]:
    """(tensor-parallel-split, replicated) parameters of one transformer layer."""
    d, h, f = m.kv_channels, m.hidden_size, m.intermediate_size
    q, kv = m.num_attention_heads * d, m.num_key_value_heads * d
    split = h * (q + 2 * kv) + q * h + 3 * h * f  # QKV, output proj, SwiGLU fc1 (2f) + fc2
    split += (q + 2 * kv) if m.qkv_bias else 0
    replicated = 2 * h + (2 * d if m.qk_layernorm else 0)  # two RMSNorms (+ q/k norms)
    return split, replicated


def total_params(m: ModelConfig) -> int:
    """All parameters of the model (tied embeddings counted once)."""
    split, rep = layer_params(m)
    emb = m.vocab_size * m.hidden_size
    return m.num_hidden_layers * (split + rep) + m.hidden_size + emb * (
        1 if m.tie_word_embeddings else 2)


def stage_params(m: ModelConfig, tp: int, pp: int, stage: int) -> int:
    """Parameters one GPU of pipeline ``stage`` holds (its TP shard; megatron keeps a copy of
    the tied embedding on the last stage when ``pp > 1``)."""
    split, rep = layer_params(m)
    n = (m.num_hidden_layers // pp) * (split // tp + rep)
    emb = m.vocab_size // tp * m.hidden_size
    if stage == 0:
        n += emb
    if stage == pp - 1:
        n += m.hidden_size  # final norm
        if not m.tie_word_embeddings or pp > 1:
            n += emb
    return n


# --------------------------------------------------------------------------------------------
# Actor memory
# --------------------------------------------------------------------------------------------
def _dtype_bytes(precision: str) -> int:
    return 4 if precision == "fp32" else 2


def optimizer_state_bytes(params: int, x: PlanInputs) -> dict[str, float]:
    """Weights, fp32 main weights, fp32 gradients and Adam moments of ``params`` parameters."""
    shard = x.dp if x.distributed_optimizer else 1
    w = _dtype_bytes(x.precision)
    return {
        "weights": params * w,
        "main weights (fp32)": 0.0 if x.precision == "fp32" else params * 4 / shard,
        "gradients (fp32)": params * 4.0,
        "Adam moments (fp32)": params * 8 / shard,
    }


def layer_activation_elems(x: PlanInputs) -> tuple[float, float]:
    """Saved-for-backward elements of one layer, without recomputation:
    (per token, per sequence). Attention is SDPA on both devices (models/attention.py: flash /
    fused kernels keep q, k, v, the output and log-sum-exp, no ``[S, S]`` scores), so the
    per-sequence term is zero; the devices differ in the norm and SwiGLU kernels."""
    m, tp = x.model, x.tp
    h, f, d = m.hidden_size, m.intermediate_size, m.kv_channels
    q, kv = m.num_attention_heads * d, m.num_key_value_heads * d
    attn = (q + 2 * kv + q) / tp  # q, k, v + output (+ log-sum-exp, negligible)
    if x.device == "gpu":  # fused RMSNorm (input + output), fused SwiGLU
        norms = 2 * 2 * h
        mlp = 3 * f / tp  # fc1 output (2f) + SwiGLU output (f)
    else:  # torch's composite RMSNorm (input, normalised, output), plain SwiGLU
        norms = 2 * 3 * h
        mlp = 4 * f / tp  # fc1 output (2f), silu output (f), product (f)
    return norms + attn + mlp, 0.0


def activation_bytes(x: PlanInputs) -> dict[str, float]:
    """Activations of the first pipeline stage (the one with the most micro-batches in flight)."""
    a = _dtype_bytes(x.precision)
    softmax_b = 4  # attention_softmax_in_fp32 (only for a per-sequence term)
    tokens = x.micro_batch_size * x.seq_len
    per_tok, per_seq = layer_activation_elems(x)
    one_layer = tokens * per_tok * a + x.micro_batch_size * per_seq * softmax_b
    layers = x.model.num_hidden_layers // x.pp
    in_flight = min(x.pp, x.n_micro)
    if x.recompute == "full":  # layer inputs kept, one layer re-materialised during backward
        kept = in_flight * layers * tokens * x.model.hidden_size * a
        return {"activations (layer inputs, full recompute)": kept,
                "recompute working set (1 layer)": one_layer}
    return {f"activations ({in_flight} micro-batch(es) x {layers} layers, recompute "
            f"{x.recompute})": in_flight * layers * one_layer}


def head_bytes(x: PlanInputs) -> dict[str, float]:
    """Output head of the last stage, one micro-batch: response rows only."""
    m, a = x.model, _dtype_bytes(x.precision)
    rows = x.micro_batch_size * x.response_len
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
        items = optimizer_state_bytes(stage_params(x.model, x.tp, x.pp, stage), x)
        if stage == 0:
            items.update(activation_bytes(x))
        if stage == x.pp - 1:
            if x.pp > 1:  # the last stage holds one micro-batch's activations
                items.update(activation_bytes(dataclasses.replace(x, n_micro=1, pp=x.pp)))
            items.update(head_bytes(x))
        if x.use_ref:
            p = stage_params(x.model, x.tp, x.pp, stage) * _dtype_bytes(x.precision)
            items["reference model" + (" (offloaded to CPU)" if x.offload_ref else "")] = (
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
    return max(stage_params(x.model, x.tp, x.pp, s) for s in {0, x.pp - 1}) * per_param


# --------------------------------------------------------------------------------------------
# Rollout servers
# --------------------------------------------------------------------------------------------
def kv_bytes_per_token(m: ModelConfig, server_tp: int) -> float:
    """bf16 K and V of all layers for one token on one server GPU (KV heads split over TP,
    replicated when TP exceeds them)."""
    heads = max(1, m.num_key_value_heads // server_tp)
    return 2 * m.num_hidden_layers * heads * m.kv_channels * 2


def server_breakdown(x: PlanInputs) -> dict[str, Any]:
    """One server GPU: weights, the KV cache the configured concurrency needs, the budget."""
    m = x.model
    weights = total_params(m) * 2 / x.server_tp
    conc = x.concurrency or -(-x.rollout_responses // max(x.servers, 1))
    kv_tok = kv_bytes_per_token(m, x.server_tp)
    need = conc * x.seq_len * kv_tok
    budget = x.server_mem_fraction * x.gpu_mem_gb * GIB
    pool = max(budget - weights, 0.0)
    return {"weights (bf16)": weights, "kv_per_token": kv_tok, "concurrency": conc,
            "kv_needed": need, "kv_pool": pool,
            "max_full_length_requests": int(pool // (x.seq_len * kv_tok)),
            "weights_fit": weights < budget, "kv_fits": need <= pool}


def colocated_phases(x: PlanInputs, stage: int, actor: dict[str, float],
                     server: dict[str, Any]) -> dict[str, float]:
    """Bytes on one shared GPU in each phase of the colocated step (megatron_rl/colocation.py):
    rollout = the server's static budget (weights + KV pool) + the trainer's runtime reserve
    (the actor is on the host); update = the actor's whole breakdown + a released server's
    reserve; weight sync = the actor's parameters (training dtype) + the resumed server + one
    bucket (grads and optimizer state are already on the host)."""
    budget = server["weights (bf16)"] + server["kv_pool"]
    reserve = RUNTIME_RESERVE_GIB * GIB if x.device == "gpu" else 0.0
    params = stage_params(x.model, x.tp, x.pp, stage) * _dtype_bytes(x.precision)
    return {"rollout (server budget + trainer runtime)": budget + reserve,
            "update (actor + released server)": sum(actor.values()) + SERVER_RESERVE_GIB * GIB,
            "weight sync (actor params + server + bucket)": params + budget + reserve
            + x.sync_bucket_mb * 2**20}


def swap_seconds(x: PlanInputs, stage: int) -> float:
    """Host<->device copy time of one colocated step: the actor's parameters, fp32 gradients
    and optimizer state leave and come back once (each way at ``HOST_LINK_GBPS``)."""
    n = stage_params(x.model, x.tp, x.pp, stage)
    state = optimizer_state_bytes(n, x)
    return 2 * sum(state.values()) / (HOST_LINK_GBPS * 1e9)


# --------------------------------------------------------------------------------------------
# Step time
# --------------------------------------------------------------------------------------------
def step_flops(x: PlanInputs) -> dict[str, float]:
    """FLOPs of one RL step: rollout (prefill + decode), old-policy (and reference) forward,
    training forward + backward (+ recomputation). Padded lengths (an upper bound)."""
    m = x.model
    split, rep = layer_params(m)
    body = m.num_hidden_layers * (split + rep)
    attn = 2 * m.num_hidden_layers * m.num_attention_heads * m.kv_channels * x.seq_len  # causal
    head = 2 * m.vocab_size * m.hidden_size
    toks = x.responses_per_step * x.seq_len
    resp = x.responses_per_step * x.response_len
    fwd = toks * (2 * body + attn) + resp * head
    recompute = {"none": 0.0, "selective": toks * attn, "full": toks * (2 * body + attn)}
    gen = x.rollout_responses * x.seq_len
    out = {"rollout (one generation round)": gen * (2 * body + attn)
           + x.rollout_responses * x.response_len * head,
           "old-policy log-probs": fwd,
           "train (fwd + bwd)": 3 * fwd + recompute[x.recompute] + resp * head}  # head recompute
    if x.use_ref:
        out["reference log-probs"] = fwd
    return out


def step_seconds(x: PlanInputs) -> dict[str, float]:
    """Seconds per phase at the stated MFUs (actor phases include the pipeline bubble)."""
    fl = step_flops(x)
    actor = x.actor_gpus * x.peak_tflops * 1e12 * x.mfu
    bubble = 1 + (x.pp - 1) / x.n_micro
    roll = "rollout (one generation round)"
    out = {k: v / actor * bubble for k, v in fl.items() if k != roll}
    if x.servers:
        out[roll] = fl[roll] / (x.servers * x.server_tp * x.peak_tflops * 1e12
                                          * x.rollout_mfu)
    return out


# --------------------------------------------------------------------------------------------
# The plan
# --------------------------------------------------------------------------------------------
@dataclass
class Plan:
    inputs: PlanInputs
    stage: int
    actor: dict[str, float]
    server: dict[str, Any] | None
    seconds: dict[str, float] = field(default_factory=dict)
    colocated: dict[str, float] | None = None  # bytes per phase on a shared GPU (colocate)

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
        return f"TP{x.tp}xPP{x.pp}xDP{x.dp}"


def make_plan(x: PlanInputs) -> Plan:
    """The estimate for one layout."""
    x.validate()
    stage, items = actor_breakdown(x)
    server = server_breakdown(x) if x.servers else None
    seconds = step_seconds(x)
    colocated = None
    if x.colocate and server is not None:
        colocated = colocated_phases(x, stage, items, server)
        seconds["colocation swaps (host<->device)"] = swap_seconds(x, stage)
    return Plan(x, stage, items, server, seconds, colocated)


def _gib(b: float) -> str:
    if b < 0.1 * GIB:
        return f"{b / 1024 ** 2:8.2f} MiB"
    return f"{b / GIB:8.2f} GiB"


def _fmt_s(s: float) -> str:
    return f"{s / 60:.1f} min" if s >= 120 else f"{s:.2f} s"


def format_plan(p: Plan, alternatives: bool = True) -> str:
    """The human-readable report of one plan."""
    x, m = p.inputs, p.inputs.model
    lines = [
        f"model: {m.family} {total_params(m) / 1e9:.2f}B params, {m.num_hidden_layers} layers, "
        f"hidden {m.hidden_size}, vocab {m.vocab_size}",
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
                  f"  {'weights (bf16) per GPU':<58} {_gib(s['weights (bf16)'])}",
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
    total = sum(p.seconds.values())
    lines += ["", f"step time at MFU {x.mfu:.0%} (actor), {x.rollout_mfu:.0%} (rollout), "
                  f"{x.peak_tflops:g} TFLOP/s peak, padded max lengths (upper bound), no "
                  f"communication:"]
    lines += [f"  {k:<32} {_fmt_s(v)}" for k, v in p.seconds.items()]
    lines.append(f"  {'total (phases sequential)':<32} {_fmt_s(total)}")
    lines.append(f"verdict: {p.layout} {'FITS' if p.fits else 'DOES NOT FIT'}")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Layout search
# --------------------------------------------------------------------------------------------
def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def search(x: PlanInputs, gpus: int, max_tp: int = 8,
           recompute: tuple[str, ...] = RECOMPUTE) -> list[Plan]:
    """Every TP x PP x DP (x recompute) layout of ``gpus`` actor GPUs the model can split into,
    fitting ones first, then by estimated step time, then by memory."""
    global_mini = x.n_micro * x.micro_batch_size * x.dp  # sequences per optimizer step
    plans = []
    for tp in _divisors(gpus):
        for pp in _divisors(gpus // tp):
            dp = gpus // (tp * pp)
            if tp > max_tp or global_mini % dp or x.responses_per_step % dp:
                continue
            local = global_mini // dp
            if local % x.micro_batch_size:
                continue
            for rc in recompute:
                cand = dataclasses.replace(x, tp=tp, pp=pp, dp=dp, recompute=rc,
                                           n_micro=local // x.micro_batch_size)
                try:
                    plans.append(make_plan(cand))
                except PlanError:
                    continue
    return sorted(plans, key=lambda p: (not p.fits, sum(p.seconds.values()), p.actor_total))


def format_search(plans: list[Plan], top: int = 15) -> str:
    """A ranked table of layouts."""
    lines = [f"{'rank':>4} {'layout':<16} {'recompute':<10} {'actor GiB/GPU':>14} "
             f"{'fits':>5} {'step time':>10}"]
    for i, p in enumerate(plans[:top], 1):
        lines.append(f"{i:>4} {p.layout:<16} {p.inputs.recompute:<10} "
                     f"{p.actor_total / GIB:>14.2f} {'yes' if p.fits else 'no':>5} "
                     f"{_fmt_s(sum(p.seconds.values())):>10}")
    if len(plans) > top:
        lines.append(f"... {len(plans) - top} more")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# From a run config
# --------------------------------------------------------------------------------------------
def _sglang_field(cfg, name: str, default: Any) -> Any:
    sg = getattr(cfg.rollout, "sglang", None)
    if sg is None:
        return default
    val = sg.get(name, default) if isinstance(sg, dict) else getattr(sg, name, default)
    return default if val is None else val


def inputs_from_config(cfg, **overrides: Any) -> PlanInputs:
    """:class:`PlanInputs` from a :class:`~megatron_rl.config.RunConfig`; ``overrides`` (CLI
    flags, ``None`` = keep) win over the config."""
    from megatron_rl.model_source import model_config

    m = model_config(cfg.model)
    a, p, r, t = cfg.actor, cfg.parallel, cfg.rollout, cfg.trainer
    responses = t.train_batch_size * r.n
    mini = a.mini_batch_size or responses
    servers = _sglang_field(cfg, "servers", 0)
    servers = len(servers) if isinstance(servers, (list, tuple)) else int(servers or 0)
    servers = servers or int(_sglang_field(cfg, "num_servers", 0))  # the fleet it would start
    fused = a.fused_logprob_entropy
    recompute = getattr(a, "recompute", "none")
    vals: dict[str, Any] = dict(
        model=m, tp=p.tp, pp=p.pp, dp=p.dp,
        precision=getattr(a, "precision", None) or "bf16",
        recompute=recompute if recompute in RECOMPUTE else ("full" if recompute else "none"),
        distributed_optimizer=cfg.optim.use_distributed_optimizer,
        micro_batch_size=a.micro_batch_size,
        prompt_len=cfg.data.max_prompt_length or 2048, response_len=r.max_new_tokens,
        prompt_len_from_config=cfg.data.max_prompt_length > 0 or overrides.get(
            "prompt_len") is not None,
        n_micro=max(1, mini // p.dp // a.micro_batch_size), responses_per_step=responses,
        gen_responses=(r.gen_batch_size or t.train_batch_size) * r.n,
        fused_head=True if fused is None else fused, head_chunk=a.logprob_chunk_size,
        use_ref=cfg.loss.build().use_kl_loss, offload_ref=bool(getattr(a, "offload_ref", True)),
        servers=servers if r.engine == "sglang" or servers else 0,
        server_tp=int(_sglang_field(cfg, "tp_size", 1)),
        server_mem_fraction=float(_sglang_field(cfg, "mem_fraction_static", 0.85)),
        concurrency=int(_sglang_field(cfg, "max_running_requests", 0)),
        colocate=bool(_sglang_field(cfg, "colocate", False)) and r.engine == "sglang",
        sync_bucket_mb=int(getattr(r, "weight_sync_bucket_mb", 64)))
    vals.update({k: v for k, v in overrides.items() if v is not None})
    if "dp" in overrides and overrides["dp"] is not None and "n_micro" not in overrides:
        vals["n_micro"] = max(1, mini // vals["dp"] // vals["micro_batch_size"])
    return PlanInputs(**vals).validate()


# --------------------------------------------------------------------------------------------
# CLI: python -m megatron_rl plan CONFIG [...]
# --------------------------------------------------------------------------------------------
def _cmd_plan(args) -> int:
    import sys

    from megatron_rl.config import ConfigError, load_config

    try:
        cfg = load_config(args.config, args.overrides)
        over = dict(precision=args.precision, recompute=args.recompute, servers=args.servers,
                    server_tp=args.server_tp, concurrency=args.concurrency,
                    server_mem_fraction=args.mem_fraction, gpu_mem_gb=args.gpu_mem_gb,
                    distributed_optimizer=args.distributed_optimizer, device=args.device,
                    prompt_len=args.prompt_len, response_len=args.response_len, mfu=args.mfu,
                    rollout_mfu=args.rollout_mfu, peak_tflops=args.peak_tflops,
                    tp=args.tp, pp=args.pp, dp=args.dp, colocate=args.colocate)
        if args.gpus is not None and not args.search:
            tp = args.tp or cfg.parallel.tp
            pp = args.pp or cfg.parallel.pp
            if args.gpus % (tp * pp):
                raise PlanError(f"--gpus {args.gpus} is not a multiple of TP x PP = {tp * pp}")
            over["dp"] = args.gpus // (tp * pp)
        x = inputs_from_config(cfg, **over)
        if args.search:
            gpus = args.gpus or x.actor_gpus
            plans = search(x, gpus, max_tp=args.max_tp)
            if not plans:
                raise PlanError(f"no TP x PP x DP layout of {gpus} GPUs splits this model and "
                                f"batch")
            print(f"search: {gpus} actor GPUs, {len(plans)} layouts x recompute settings; ranked "
                  f"by fit, then estimated step time, then memory per GPU\n")
            print(format_search(plans, args.top))
            print(f"\nbest: {plans[0].layout} recompute {plans[0].inputs.recompute}\n")
            print(format_plan(plans[0]))
            return 0 if plans[0].fits else 1
        plan = make_plan(x)
    except (ConfigError, PlanError) as exc:
        print(f"plan error: {exc}", file=sys.stderr)
        return 2
    print(format_plan(plan))
    return 0 if plan.fits else 1


def add_plan_subcommand(sub) -> None:
    """Register ``plan`` on the CLI's subparsers."""
    import argparse

    p = sub.add_parser("plan", help="per-GPU memory and step-time estimate of a config's layout "
                                    "(--search: rank all TPxPPxDP layouts)")
    p.add_argument("config", help="YAML run config")
    p.add_argument("overrides", nargs="*", help="key=value config overrides")
    p.add_argument("--gpus", type=int, default=None,
                   help="actor GPUs (sets DP; with --search: the GPUs to lay out)")
    p.add_argument("--gpu-mem-gb", type=float, default=80.0, help="memory per GPU in GiB")
    p.add_argument("--search", action="store_true", help="enumerate and rank TPxPPxDP layouts")
    p.add_argument("--max-tp", type=int, default=8, help="largest TP in --search (one node)")
    p.add_argument("--top", type=int, default=15, help="rows of the --search table")
    p.add_argument("--tp", type=int, default=None)
    p.add_argument("--pp", type=int, default=None)
    p.add_argument("--dp", type=int, default=None)
    p.add_argument("--precision", choices=PRECISIONS, default=None,
                   help="default: actor.precision, else bf16")
    p.add_argument("--recompute", choices=RECOMPUTE, default=None,
                   help="default: actor.recompute, else none")
    p.add_argument("--distributed-optimizer", action=argparse.BooleanOptionalAction,
                   default=None, help="default: optim.use_distributed_optimizer")
    p.add_argument("--device", choices=DEVICES, default=None,
                   help="gpu (flash attention, fused kernels; default) or cpu (local spec)")
    p.add_argument("--servers", type=int, default=None,
                   help="rollout servers (default: rollout.sglang.servers)")
    p.add_argument("--server-tp", type=int, default=None,
                   help="GPUs per server (default: rollout.sglang.tp_size, else 1)")
    p.add_argument("--colocate", action=argparse.BooleanOptionalAction, default=None,
                   help="servers on the actor's GPUs (default: rollout.sglang.colocate)")
    p.add_argument("--concurrency", type=int, default=None,
                   help="requests in flight per server (default: responses / servers)")
    p.add_argument("--mem-fraction", type=float, default=None,
                   help="server mem_fraction_static (default 0.85)")
    p.add_argument("--prompt-len", type=int, default=None,
                   help="default: data.max_prompt_length, else 2048")
    p.add_argument("--response-len", type=int, default=None,
                   help="default: rollout.max_new_tokens")
    p.add_argument("--mfu", type=float, default=None, help="actor MFU (default 0.35)")
    p.add_argument("--rollout-mfu", type=float, default=None, help="rollout MFU (default 0.10)")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="dense bf16 TFLOP/s per GPU (default 989, H100 SXM)")
    p.set_defaults(func=_cmd_plan)
