"""What one plan estimate is made of (:class:`PlanInputs`), read from a run config or CLI flags,
and the planner's constants (reserves, host link bandwidth)."""

from __future__ import annotations

from dataclasses import dataclass
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


# Effective all-to-all bandwidth per GPU and direction, for the MoE token exchange: NVLink inside a
# node (H100 SXM: 450 GB/s per direction raw; NCCL all-to-all reaches well under that), one
# 400 Gb/s NIC per GPU between nodes (50 GB/s raw).
INTRA_NODE_GBPS = 200.0


INTER_NODE_GBPS = 40.0


GPUS_PER_NODE = 8


class PlanError(ValueError):
    """A planner input is invalid; the message names the field or flag."""


@dataclass(frozen=True)
class PlanInputs:
    """Everything one estimate needs. Lengths are tokens, sizes are sequences per DP rank."""

    model: ModelConfig
    tp: int = 1
    pp: int = 1
    dp: int = 1
    ep: int = 1  # expert parallelism (MoE models): experts split over ep ranks of a stage
    cp: int = 1  # context parallelism: each sequence split over cp ranks (dense models)
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
    offload_ref: bool = True  # the reference model and the distillation teacher
    lora_rank: int = 0  # actor.lora.rank: frozen base + trainable adapters (0: full fine-tuning)
    lora_targets: tuple = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
    teacher: ModelConfig | None = None  # teacher.engine: actor (a frozen model per stage)
    servers: int = 0
    server_tp: int = 1
    server_mem_fraction: float = 0.85
    concurrency: int = 0  # requests in flight per server; 0 = responses_per_step / servers
    colocate: bool = False  # servers on the actor's GPUs, taking turns with the memory
    server_quantization: str | None = None  # rollout.sglang.quantization: "fp8" halves weights
    kv_cache_dtype: str = "auto"  # the servers' --kv-cache-dtype (fp8_*: 1-byte K/V)
    sync_bucket_mb: int = 64  # rollout.weight_sync_bucket_mb (the colocated sync's buffer)
    gpu_mem_gb: float = 80.0
    peak_tflops: float = 989.0  # dense bf16 per GPU (H100 SXM)
    mfu: float = 0.35
    rollout_mfu: float = 0.10
    token_budget: int = 0  # actor.max_tokens_per_micro_batch (0: micro_batch_size x seq_len)
    response_mean: float = 0.0  # response-length distribution (0: assumed, see plan/lengths.py)
    response_p95: float = 0.0
    lengths_file: str | None = None  # a run's response_lengths.json (wins over mean/p95)
    max_staleness: int = 0  # rollout.max_staleness (>= 1: generation overlaps the actor)
    gpus_per_node: int = GPUS_PER_NODE  # where the expert-parallel group crosses nodes
    intra_node_gbps: float = INTRA_NODE_GBPS
    inter_node_gbps: float = INTER_NODE_GBPS

    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.response_len

    @property
    def rollout_responses(self) -> int:
        return self.gen_responses or self.responses_per_step

    @property
    def actor_gpus(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    @property
    def expert_dp(self) -> int:
        """Expert data parallelism: megatron-core's ``world / (expert TP x EP x PP)`` with expert
        TP 1, the ranks that hold the same experts (and shard their optimizer state)."""
        return self.tp * self.dp // self.ep

    def validate(self) -> PlanInputs:
        """Raise :class:`PlanError` naming the bad field."""
        if self.precision not in PRECISIONS:
            raise PlanError(f"precision={self.precision!r} is not one of {PRECISIONS}")
        if self.recompute not in RECOMPUTE:
            raise PlanError(f"recompute={self.recompute!r} is not one of {RECOMPUTE}")
        if self.device not in DEVICES:
            raise PlanError(f"device={self.device!r} is not one of {DEVICES}")
        for name in ("tp", "pp", "dp", "ep", "cp", "micro_batch_size", "n_micro", "server_tp",
                     "gpus_per_node"):
            if getattr(self, name) < 1:
                raise PlanError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.colocate and self.servers * self.server_tp > self.actor_gpus:
            raise PlanError(f"colocate: {self.servers} servers x TP{self.server_tp} need "
                            f"{self.servers * self.server_tp} GPUs, the actor has "
                            f"{self.actor_gpus}")
        if not 0 < self.server_mem_fraction <= 1:
            raise PlanError(f"server_mem_fraction must be in (0, 1], got "
                            f"{self.server_mem_fraction}")
        if self.intra_node_gbps <= 0 or self.inter_node_gbps <= 0:
            raise PlanError(f"intra_node_gbps={self.intra_node_gbps} and inter_node_gbps="
                            f"{self.inter_node_gbps} must be > 0")
        try:
            validate_for_layout(self.model, self.tp, self.pp, self.ep)
        except ModelConfigError as exc:
            raise PlanError(str(exc)) from exc
        if self.cp > 1 and self.ep > 1:
            raise PlanError(f"cp={self.cp} with ep={self.ep}: context parallelism runs with "
                            "ep=1 (parallel.cp and parallel.ep)")
        if self.teacher is not None:
            try:
                validate_for_layout(self.teacher, self.tp, self.pp, 1)
            except ModelConfigError as exc:
                raise PlanError(f"teacher: {exc}") from exc
        if (self.tp * self.dp) % self.ep:
            raise PlanError(f"ep={self.ep} must divide the ranks of a pipeline stage, tp x dp = "
                            f"{self.tp} x {self.dp} = {self.tp * self.dp} (megatron-core carves "
                            f"the expert-parallel group out of them)")
        return self


def _flag_value(args: list, flag: str, default: str) -> str:
    """The value of ``flag`` (``--flag V`` or ``--flag=V``, the last one) in a command line."""
    args = [str(a) for a in args or []]
    out = default
    for k, a in enumerate(args):
        if a == flag and k + 1 < len(args):
            out = args[k + 1]
        elif a.startswith(flag + "="):
            out = a.split("=", 1)[1]
    return out


def _sglang_field(cfg, name: str, default: Any) -> Any:
    sg = getattr(cfg.rollout, "sglang", None)
    if sg is None:
        return default
    val = sg.get(name, default) if isinstance(sg, dict) else getattr(sg, name, default)
    return default if val is None else val


def _teacher_model(cfg) -> ModelConfig | None:
    """The distillation teacher's architecture when the trainer ranks hold it (``teacher.engine:
    actor``; docs/distillation.md), else None (no teacher, or one served by SGLang)."""
    section = getattr(cfg, "teacher", None)
    if section is None:
        return None
    from megatron_rl.config.teacher import actor_teacher, teacher_model_section
    from megatron_rl.convert.model_source import model_config

    return model_config(teacher_model_section(section)) if actor_teacher(section) else None


def inputs_from_config(cfg, **overrides: Any) -> PlanInputs:
    """:class:`PlanInputs` from a :class:`~megatron_rl.config.sections.RunConfig`;
    ``overrides`` (CLI flags, ``None`` = keep) win over the config."""
    from megatron_rl.convert.model_source import model_config

    m = model_config(cfg.model)
    teacher = _teacher_model(cfg)
    a, p, r, t = cfg.actor, cfg.parallel, cfg.rollout, cfg.trainer
    responses = t.train_batch_size * r.n
    mini = a.mini_batch_size or responses
    servers = _sglang_field(cfg, "servers", 0)
    servers = len(servers) if isinstance(servers, (list, tuple)) else int(servers or 0)
    servers = servers or int(_sglang_field(cfg, "num_servers", 0))  # the fleet it would start
    fused = a.fused_logprob_entropy
    recompute = getattr(a, "recompute", "none")
    vals: dict[str, Any] = dict(
        model=m, tp=p.tp, pp=p.pp, dp=p.dp, ep=getattr(p, "ep", 1), cp=getattr(p, "cp", 1),
        precision=getattr(a, "precision", None) or "bf16",
        recompute=recompute if recompute in RECOMPUTE else ("full" if recompute else "none"),
        distributed_optimizer=cfg.optim.use_distributed_optimizer,
        micro_batch_size=a.micro_batch_size,
        prompt_len=cfg.data.max_prompt_length or 2048, response_len=r.max_new_tokens,
        prompt_len_from_config=cfg.data.max_prompt_length > 0 or overrides.get(
            "prompt_len") is not None,
        n_micro=max(1, mini // p.dp // a.micro_batch_size), responses_per_step=responses,
        token_budget=int(getattr(a, "max_tokens_per_micro_batch", 0) or 0),
        gen_responses=(r.gen_batch_size or t.train_batch_size) * r.n,
        fused_head=True if fused is None else fused, head_chunk=a.logprob_chunk_size,
        use_ref=cfg.loss.build().use_kl_loss, offload_ref=bool(getattr(a, "offload_ref", True)),
        lora_rank=a.lora.rank, lora_targets=a.lora.modules,
        teacher=teacher,
        servers=servers if r.engine == "sglang" or servers else 0,
        server_tp=int(_sglang_field(cfg, "tp_size", 1)),
        server_mem_fraction=float(_sglang_field(cfg, "mem_fraction_static", 0.85)),
        concurrency=int(_sglang_field(cfg, "max_running_requests", 0)),
        colocate=bool(_sglang_field(cfg, "colocate", False)) and r.engine == "sglang",
        server_quantization=_sglang_field(cfg, "quantization", None),
        kv_cache_dtype=_flag_value(_sglang_field(cfg, "extra_args", []), "--kv-cache-dtype",
                                   "auto"),
        sync_bucket_mb=int(getattr(r, "weight_sync_bucket_mb", 64)),
        max_staleness=int(getattr(r, "max_staleness", 0) or 0))
    vals.update({k: v for k, v in overrides.items() if v is not None})
    if "dp" in overrides and overrides["dp"] is not None and "n_micro" not in overrides:
        vals["n_micro"] = max(1, mini // vals["dp"] // vals["micro_batch_size"])
    return PlanInputs(**vals).validate()
