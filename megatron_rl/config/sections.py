"""The run config's sections: one dataclass per YAML section, every field with its default.

A config file holds any subset of the sections below; everything else keeps its default
(:func:`megatron_rl.config.load.load_config` reads the YAML; docs/configuration.md lists every
field). ``actor`` and ``optim`` are the actor's own dataclasses.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from megatron_rl.actor.actor_config import ActorConfig
from megatron_rl.actor.optim import OptimConfig


@dataclass
class ModelSection:
    # Exactly one of preset / hf_path / megatron_ckpt decides the architecture ("tiny" if none).
    preset: str | None = None  # random tiny demo models (megatron_rl.models.config.PRESETS)
    hf_path: str | None = None  # Hugging Face dir: config.json + *.safetensors (+ tokenizer)
    megatron_ckpt: str | None = None  # output of `convert hf-to-megatron` (any TP/PP)
    tokenizer: str | None = None  # "byte" or an HF tokenizer dir; default: from the model dir
    init_weights: str | None = None  # canonical weights (.pt) to start from, e.g. from `sft`
    moe_aux_loss_coeff: float = 0.0  # MoE load-balancing loss (0: off, RL default; docs/moe.md)
    moe_z_loss_coeff: float = 0.0  # MoE router z-loss (0: off, RL default; docs/moe.md)
    moe_grouped_gemm: bool = False  # MoE experts as TE grouped GEMMs (needs the gpu extra)


@dataclass
class ParallelSection:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    ep: int = 1  # expert-parallel size: MoE experts split over ep ranks (docs/moe.md)
    cp: int = 1  # context-parallel size: each sequence split over cp ranks (docs/parallelism.md)
    backend: str = "auto"  # auto (NCCL with GPUs, else gloo) | nccl | gloo (CPU ranks); docs/gpu.md
    timeout_s: float = 1800.0  # collectives of the update, checkpoints, weight sync
    host_timeout_s: float = 14400.0  # host objects: ranks wait here while rank 0 generates
    socket_ifname: str = ""  # multi-node: interface of the rendezvous and gloo/NCCL sockets


@dataclass
class DataSection:
    task: str = "basic_arithmetic"  # reasoning-gym task (or "path" below)
    task_kwargs: dict = field(default_factory=dict)
    path: str | None = None  # JSONL/Parquet prompts; overrides task
    prompt_key: str = "prompt"  # dotted path; a list of chat messages is rendered by the template
    answer_key: str | None = None  # dotted path; None: "answer", else "reward_model.ground_truth"
    max_prompt_length: int = 0  # drop prompts longer than this many tokens (0 = keep all)
    chat_template: bool = True  # render prompts with the tokenizer's chat template if it has one
    prompt_field: str | None = None  # renamed to prompt_key (a clear error when used)
    answer_field: str | None = None  # renamed to answer_key (a clear error when used)
    train_size: int = 2000
    val_size: int = 64
    split_by: str = "prompt"  # "prompt": no val prompt is a train prompt; "row": iid rows
    seed: int = 0
    eval_sets: list = field(default_factory=list)  # named sets: pass@k/avg@k/maj@k (evaluation.md)


@dataclass
class SGLangSection:
    """The SGLang rollout fleet (``rollout.engine: sglang``; docs/rollout.md)."""

    servers: list = field(default_factory=list)  # URLs of running servers; empty: start some
    num_servers: int = 2  # servers to start when ``servers`` is empty
    launcher: str = "serve"  # "serve" (ours, CPU/tests) | "sglang" (python -m sglang.launch_server)
    router_url: str | None = None  # a running sglang-router; None: start one on router_port
    host: str = "127.0.0.1"
    router_port: int = 30000  # servers started here listen on router_port + 1 + i
    tp_size: int = 1  # --tp-size of each started SGLang server
    mem_fraction_static: float = 0.8  # --mem-fraction-static of each started SGLang server
    gpus: list = field(default_factory=list)  # CUDA ids for started servers (tp_size per server)
    colocate: bool = False  # share the trainer's GPUs, taking turns with memory (colocation.md)
    concurrency: int = 32  # requests in flight
    request_timeout_s: float = 600.0
    max_retries: int = 3  # per request, on another server
    max_offpolicy_lag: int = -1  # -1: only measure rollout/offpolicy_lag; >= 0: refuse staler
    weight_sync: str = "from_disk"  # from_disk | from_tensor | from_distributed
    quantization: str | None = None  # null: the actor's dtype; fp8: block FP8 (docs/sglang.md)
    fp8_scale_fmt: str = "float32"  # fp8 block scales: float32 | ue8m0 (DeepSeek-V3.1 style)
    sync_dir: str | None = None  # from_disk: shared storage (default OUTPUT_DIR/weight_sync)
    probe_tolerance: float | None = None  # mean |engine - actor| probe gap; None: by precision
    probe_length: int = 64  # tokens of the probe sequence (0: no probe)
    spot_checks: int = 0  # /get_weights_by_name checks per sender per sync (Llama/serve only)
    server_threads: int = 1  # torch threads of each started `serve`
    python: str | None = None  # interpreter of started servers (SGLang's venv); None: trainer's
    extra_args: list = field(default_factory=list)  # appended to each started server's command
    sender_address: str | None = None  # from_distributed: address servers reach senders at
    #   (None: the interface routed to the servers, else the one routed to MASTER_ADDR)
    serve_rules: str = "0.5.21"  # launcher serve imitates SGLang >= 0.5.21 | "0.5.20" (older)
    flush_retries: int = 60  # /flush_cache refused while requests drain: retries, 1 s apart
    restart_dead: bool = True  # restart a dead started server; it rejoins after the next sync
    max_restarts: int = 3  # restarts per started server (then it stays removed)


@dataclass
class RolloutSection:
    engine: str = "embedded"
    per_request_seed: bool = False  # seed each sample by itself (always on for engine=sglang)
    sglang: SGLangSection = field(default_factory=SGLangSection)
    n: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 8
    val_temperature: float = 0.0  # 0 = greedy validation
    val_n: int = 1  # samples per validation prompt (accuracy = mean over all samples)
    dynamic_sampling: bool = True
    gen_batch_size: int = 0  # prompts per generation round; 0 = train_batch_size
    max_num_gen_batches: int = 10
    filter_metric: str = "acc"
    overlong_buffer: int = 0  # L_cache of the soft overlong punishment; 0 = off
    overlong_penalty_factor: float = 1.0
    overlong_filter: bool = False
    rv_filter_p: float = 1.0  # RAGEN reward-variance top-p; 1.0 = off
    rv_include_zero: bool = True
    reward_fn: str | None = None  # dotted path of a custom reward fn(row, response) -> float
    reward_timeout_s: float = 5.0
    weight_sync_bucket_mb: int = 64
    max_staleness: int = 0  # 0: synchronous; K > 0: generation runs ahead (docs/async.md)
    partial: bool = True  # sync keeps in-flight tokens (false: redo them; docs/async.md)
    durable_bank: bool = False  # false: a resumed run regenerates every rollout group


@dataclass
class CollapseMetricsSection:
    # RAGEN-2 collapse diagnostics of multi-turn runs (docs/training.md): H(Z|X), I(X;Z)
    enabled: bool = False  # log collapse/* (needs env.name); extra forward passes, see the docs
    every_n_steps: int = 10  # on the first step and every N-th after it
    max_inputs: int = 8  # inputs (episode groups) scored; rows = max_inputs^2 x rollout.n
    reasoning: str = "think"  # Z = think: text between the tags | reply: the whole first reply
    think_open: str = "<think>"  # tag ending X (reasoning: think)
    think_close: str = "</think>"  # tag after Z (reasoning: think)


@dataclass
class TrainerSection:
    total_steps: int = 20
    train_batch_size: int = 8  # prompts per RL step
    advantage: str = "grpo"
    test_freq: int = 5
    save_freq: int = 10
    output_dir: str = "runs/default"
    seed: int = 1234
    resume: bool = True
    export_hf: bool | None = None  # HF dir in every checkpoint; None: true for model.hf_path
    keep_checkpoints: int = 0  # keep only the newest K checkpoints; 0 = keep all
    async_save: bool = False  # write checkpoints in the background (docs/checkpoints.md)
    max_restarts: int = 0  # a rank died: restart all from the newest checkpoint (reliability.md)
    restart_backoff_s: float = 5.0  # wait before restart k: this * 2**(k-1) s, at most 600 s
    kl_in_reward_coef: float = 0.0  # REINFORCE++: r_t -= coef * (old_logp - ref_logp)_t
    deterministic: bool = False  # reproducible GPU kernels (slower attention; docs/gpu.md)
    plots: bool = True  # PNG curves in OUTPUT_DIR/plots/ at the end (or: megatron_rl plot DIR)
    collapse_metrics: CollapseMetricsSection = field(default_factory=CollapseMetricsSection)


@dataclass
class SFTSection:
    steps: int = 0
    batch_size: int = 32
    lr: float = 1e-3


@dataclass
class EarlyStopSection:
    enabled: bool = True
    rv_warmup_steps: int = 10
    rv_patience: int = 10
    rv_ratio: float = 0.1
    val_threshold: float = 0.01
    val_patience: int = 5


@dataclass
class LoggingSection:
    tensorboard: bool = False
    wandb: bool = False
    project: str = "megatron_rl"


@dataclass
class LossSection:
    algorithm: str = "dapo"
    overrides: dict = field(default_factory=dict)  # LossConfig fields
    # off-policy correction of the engine's samples, rho = pi_old / pi_rollout (docs/rollout.md)
    rollout_correction: str = "none"  # weight of each token's policy loss, a function of rho
    rollout_correction_threshold: float = 2.0  # C: tis min(rho, C), mis [1/C, C], seq_mask_tis cap
    icepop_low: float = 0.5  # icepop: token weight 0 when rho < icepop_low
    icepop_high: float = 5.0  # icepop: token weight 0 when rho > icepop_high
    seq_mask_low: float = 0.999  # seq_mask_tis: drop rows whose geometric-mean rho is below
    seq_mask_high: float = 1.001  # seq_mask_tis: drop rows whose geometric-mean rho is above
    rollout_correction_denominator: str = "all"  # all: rejected tokens stay in means; kept: leave

    def build(self):
        from megatron_rl.loss import LossConfig

        extra = {k: getattr(self, k) for k in (
            "rollout_correction", "rollout_correction_threshold", "icepop_low", "icepop_high",
            "seq_mask_low", "seq_mask_high", "rollout_correction_denominator")}
        return LossConfig.for_algorithm(self.algorithm, **{**extra, **self.overrides})


@dataclass
class EnvSection:
    # Multi-turn environment (megatron_rl.envs); None: single-turn prompts from the data section.
    name: str | None = None  # "frozenlake" | "sokoban"
    size: int = 4  # grid side (frozenlake >= 2; sokoban 5..20)
    max_turns: int = 5  # replies per episode
    success_rate: float = 0.8  # frozenlake: probability the intended move happens (1.0 = no slip)
    frozen_p: float = 0.8  # frozenlake: probability a generated cell is ice
    boxes: int = 1  # sokoban
    invalid_penalty: float = 0.1  # reward of an unparsable reply (as a penalty, >= 0)
    step_penalty: float = 0.0  # sokoban: per-move penalty
    val_size: int = 64  # validation environments
    max_total_tokens: int = 512  # an episode ends before its next turn would exceed this
    seed: int = 0


@dataclass
class CriticSection:
    # The PPO value model (trainer.advantage: gae): same architecture and TP/PP as the actor.
    gamma: float = 1.0
    lam: float = 1.0
    cliprange_value: float = 0.5
    warmup_steps: int = 0  # RL steps that train only the critic (verl's critic_warmup)
    lr: float = 1e-5
    weight_decay: float = 0.0
    clip_grad: float = 1.0
    ppo_epochs: int = 1
    mini_batch_size: int = 0  # 0: actor.mini_batch_size
    whiten_advantages: bool = True  # verl's masked_whiten over the batch's reply tokens


@dataclass
class TeacherParallelSection:
    """The actor teacher's model-parallel split: only the run's own is supported, another value
    is refused when the config loads (docs/distillation.md, "Where the teacher runs")."""

    tp: int | None = None  # null: parallel.tp (a different value is refused at load time)
    pp: int | None = None  # null: parallel.pp (a different value is refused at load time)


@dataclass
class TeacherSection:
    """On-policy distillation (docs/distillation.md): a frozen teacher scores the student's own
    samples token by token. Off unless ``hf_path``, ``checkpoint`` or ``url`` is set."""

    hf_path: str | None = None  # the teacher's HF dir (e.g. a run's checkpoints/step_N/hf export)
    checkpoint: str | None = None  # or: a `convert hf-to-megatron` output (any saved TP/PP)
    tokenizer: str | None = None  # "byte" or an HF tokenizer dir; default: the teacher's dir
    engine: str = "actor"  # actor: frozen Megatron model on the trainer ranks | sglang: servers
    url: str | None = None  # engine sglang: the teacher's router or server (http://host:port)
    mode: str = "reward"  # reward: A_t = task_coef*A_task - coef*KL_t | loss: + coef * k2 term
    coef: float = 1.0  # weight of the distillation signal
    task_coef: float = 1.0  # weight of the task advantage (0 = pure distillation)
    disagree_nats: float = 2.0  # distill/disagree_frac: tokens with KL_t above this many nats
    parallel: TeacherParallelSection = field(default_factory=TeacherParallelSection)


@dataclass
class RunConfig:
    model: ModelSection = field(default_factory=ModelSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    data: DataSection = field(default_factory=DataSection)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    actor: ActorConfig = field(default_factory=ActorConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    loss: LossSection = field(default_factory=LossSection)
    trainer: TrainerSection = field(default_factory=TrainerSection)
    sft: SFTSection = field(default_factory=SFTSection)
    early_stop: EarlyStopSection = field(default_factory=EarlyStopSection)
    logging: LoggingSection = field(default_factory=LoggingSection)
    env: EnvSection = field(default_factory=EnvSection)
    critic: CriticSection = field(default_factory=CriticSection)
    teacher: TeacherSection = field(default_factory=TeacherSection)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
