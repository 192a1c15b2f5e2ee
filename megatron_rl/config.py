"""Run configuration: nested dataclasses, YAML loading, ``key=value`` overrides, clear errors.

A config file holds any subset of the sections below; everything else keeps its default. Unknown
keys are errors that suggest the closest known key; values are checked against the field's type.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Mapping

import yaml

from megatron_rl.actor.optim import OptimConfig
from megatron_rl.actor.train_step import ActorConfig


class ConfigError(ValueError):
    """A config key or value is invalid; the message names the key and what is allowed."""


@dataclass
class ModelSection:
    # Exactly one of preset / hf_path / megatron_ckpt decides the architecture ("tiny" if none).
    preset: str | None = None  # random tiny demo models (megatron_rl.models.config.PRESETS)
    hf_path: str | None = None  # Hugging Face dir: config.json + *.safetensors (+ tokenizer)
    megatron_ckpt: str | None = None  # output of `convert hf-to-megatron` (any TP/PP)
    tokenizer: str | None = None  # "byte" or an HF tokenizer dir; default: from the model dir
    init_weights: str | None = None  # canonical weights (.pt) to start from, e.g. from `sft`


@dataclass
class ParallelSection:
    tp: int = 1
    pp: int = 1
    dp: int = 1
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
    sync_dir: str | None = None  # from_disk: shared storage (default OUTPUT_DIR/weight_sync)
    probe_tolerance: float | None = None  # max |engine - actor| probe log-prob; None: from the
    # actor's and the servers' precisions (1e-4 both fp32, 0.05 with bf16; docs/gpu.md)
    probe_length: int = 16  # tokens of the probe sequence (0: no probe)
    spot_checks: int = 0  # /get_weights_by_name checks per sender per sync (Llama/serve only)
    server_threads: int = 1  # torch threads of each started `serve`
    python: str | None = None  # interpreter of started servers (SGLang's venv); None: trainer's
    extra_args: list = field(default_factory=list)  # appended to each started server's command
    sender_address: str | None = None  # from_distributed: address servers reach senders at
    #   (None: the interface routed to the servers, else the one routed to MASTER_ADDR)
    serve_rules: str = "0.5.21"  # launcher serve imitates SGLang >= 0.5.21 | "0.5.20" (older)
    flush_retries: int = 60  # /flush_cache refused while requests drain: retries, 1 s apart


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
    kl_in_reward_coef: float = 0.0  # REINFORCE++: r_t -= coef * (old_logp - ref_logp)_t
    deterministic: bool = False  # reproducible GPU kernels (slower attention; docs/gpu.md)
    plots: bool = True  # PNG curves in OUTPUT_DIR/plots/ at the end (or: megatron_rl plot DIR)


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
    rollout_correction: str = "none"  # training/inference mismatch: none | tis | mis
    rollout_correction_threshold: float = 2.0  # C of TIS min(rho, C) / MIS (docs/rollout.md)

    def build(self):
        from megatron_rl.loss import LossConfig

        extra = {"rollout_correction": self.rollout_correction,
                 "rollout_correction_threshold": self.rollout_correction_threshold}
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

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _suggest(key: str, known: list[str]) -> str:
    close = difflib.get_close_matches(key, known, n=1)
    return f"; did you mean {close[0]!r}?" if close else f"; known keys: {', '.join(known)}"


def _coerce(path: str, value: Any, tp: Any) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(path, value, inner[0])
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{path} must be true or false, got {value!r}")
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path} must be an integer, got {value!r}")
        return value
    if tp is float:
        from megatron_rl.config_checks import as_float

        value = as_float(value)  # "1e-6": PyYAML 1.1 reads exponents without a dot as str
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{path} must be a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path} must be a string, got {value!r}")
        return value
    if tp is list or origin is list:
        if isinstance(value, str):
            value = [v for v in value.split(",") if v]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path} must be a list, got {value!r}")
        return list(value)
    if tp is dict or origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path} must be a mapping, got {value!r}")
        return dict(value)
    return value


def _build(cls: type, data: Mapping[str, Any], path: str) -> Any:
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        full = f"{path}.{key}" if path else key
        if key not in fields:
            raise ConfigError(f"unknown config key {full!r}{_suggest(key, sorted(fields))}")
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            if not isinstance(value, Mapping):
                raise ConfigError(f"{full} must be a mapping of {tp.__name__} fields")
            kwargs[key] = _build(tp, value, full)
        else:
            kwargs[key] = _coerce(full, value, tp)
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{path or 'config'}: {exc}") from exc


def _set_path(tree: dict, dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = tree
    for k in keys[:-1]:
        node = node.setdefault(k, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {dotted!r}: {k!r} is not a section")
    node[keys[-1]] = value


def parse_overrides(items: list[str]) -> dict:
    """``["a.b=1", "c=x"]`` -> nested dict; values are parsed as YAML scalars."""
    tree: dict = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key=value (e.g. trainer.seed=3)")
        key, raw = item.split("=", 1)
        _set_path(tree, key.strip(), _yaml_value(item, raw) if raw != "" else "")
    return tree


def _yaml_value(item: str, raw: str) -> Any:
    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError as exc:
        msg = str(exc).splitlines()[0]
        raise ConfigError(f"override {item!r}: the value is not valid YAML ({msg})") from None


def _merge(base: dict, extra: Mapping) -> dict:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, Mapping) and isinstance(
            out.get(k), Mapping) else v
    return out


_ALIASES = {"output_dir": "trainer.output_dir"}


def load_config(path: str | None, overrides: list[str] | None = None,
                base: Mapping[str, Any] | None = None) -> RunConfig:
    """Load a YAML file (or defaults when ``path`` is None; ``base``: a mapping used instead of
    the file, e.g. :data:`megatron_rl.default_recipe.DEFAULT_RECIPE`) and apply overrides."""
    data: dict = dict(base or {})
    if path is not None:
        try:
            with open(path) as f:
                data = yaml.safe_load(f) or {}
        except FileNotFoundError:
            raise ConfigError(f"config file {path!r} does not exist") from None
        except yaml.YAMLError as exc:
            where = getattr(exc, "problem_mark", None)
            at = f" at line {where.line + 1}, column {where.column + 1}" if where else ""
            raise ConfigError(f"{path}: malformed YAML{at}: "
                              f"{getattr(exc, 'problem', None) or exc}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: top level must be a mapping of sections")
    items = [(_ALIASES.get(o.split("=", 1)[0], o.split("=", 1)[0]) + "=" + o.split("=", 1)[1])
             if "=" in o else o for o in (overrides or [])]
    data = _merge(data, parse_overrides(items))
    cfg = _build(RunConfig, data, "")
    from megatron_rl.config_checks import check_run_config

    check_run_config(cfg, data)
    validate_run_config(cfg)
    return cfg


ADVANTAGES = ("grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gae")


def validate_run_config(cfg: RunConfig) -> None:
    """Cross-field checks; every message names the field and the allowed values."""
    from megatron_rl.model_source import ModelSourceError, validate_model_section
    from megatron_rl.models.config import ModelConfigError

    try:
        validate_model_section(cfg.model, cfg.parallel.tp, cfg.parallel.pp)
    except (ModelSourceError, ModelConfigError) as exc:
        raise ConfigError(str(exc)) from exc
    for old, new in (("prompt_field", "prompt_key"), ("answer_field", "answer_key")):
        if getattr(cfg.data, old) is not None:
            raise ConfigError(f"data.{old} was renamed data.{new}; use data.{new}="
                              f"{getattr(cfg.data, old)!r}")
    if cfg.data.max_prompt_length < 0:
        raise ConfigError(f"data.max_prompt_length must be >= 0 (0 = no limit), got "
                          f"{cfg.data.max_prompt_length}")
    cfg.loss.build()
    validate_parallel_section(cfg.parallel)
    if cfg.trainer.advantage not in ADVANTAGES:
        raise ConfigError(f"trainer.advantage={cfg.trainer.advantage!r} is not one of "
                          f"{ADVANTAGES}")
    if cfg.rollout.engine not in ("embedded", "sglang"):
        raise ConfigError(f"rollout.engine={cfg.rollout.engine!r} is not one of "
                          "('embedded', 'sglang')")
    if cfg.rollout.engine == "sglang":
        from megatron_rl.rollout.fleet import validate_sglang_section

        validate_sglang_section(cfg.rollout.sglang)
    from megatron_rl.colocation import validate_colocation

    validate_colocation(cfg)
    for name in ("total_steps", "train_batch_size", "test_freq", "save_freq"):
        if getattr(cfg.trainer, name) < 1:
            raise ConfigError(f"trainer.{name} must be >= 1")
    if cfg.rollout.n < 1 or cfg.rollout.max_new_tokens < 1:
        raise ConfigError("rollout.n and rollout.max_new_tokens must be >= 1")
    if cfg.data.split_by not in ("prompt", "row"):
        raise ConfigError(f"data.split_by={cfg.data.split_by!r} is not one of ('prompt', 'row')")
    if not 0 < cfg.rollout.rv_filter_p <= 1:
        raise ConfigError(f"rollout.rv_filter_p must be in (0, 1], got {cfg.rollout.rv_filter_p}")
    validate_env_critic(cfg)
    rows = cfg.trainer.train_batch_size * cfg.rollout.n
    if rows % cfg.parallel.dp:
        raise ConfigError(f"trainer.train_batch_size x rollout.n = {rows} responses must be "
                          f"divisible by parallel.dp={cfg.parallel.dp}")


def validate_parallel_section(p: ParallelSection) -> None:
    """``parallel.backend`` and the two timeouts."""
    from megatron_rl.parallel.runtime import BACKENDS

    if p.backend not in BACKENDS:
        raise ConfigError(f"parallel.backend={p.backend!r} is not one of {BACKENDS}")
    for name in ("timeout_s", "host_timeout_s"):
        if not getattr(p, name) > 0:
            raise ConfigError(f"parallel.{name} must be > 0 seconds, got {getattr(p, name)}")


def validate_env_critic(cfg: RunConfig) -> None:
    """Checks of the ``env`` and ``critic`` sections (multi-turn runs, GAE)."""
    from megatron_rl.envs import ENVS

    e, c = cfg.env, cfg.critic
    if e.name is not None:
        if e.name not in ENVS:
            raise ConfigError(f"env.name={e.name!r} is not one of {ENVS} (or null)")
        lo = 2 if e.name == "frozenlake" else 5
        hi = 20 if e.name == "sokoban" else 64
        if not lo <= e.size <= hi:
            raise ConfigError(f"env.size={e.size} is out of range for {e.name}: [{lo}, {hi}]")
        if not 0 < e.success_rate <= 1:
            raise ConfigError(f"env.success_rate must be in (0, 1], got {e.success_rate}")
        for name in ("max_turns", "val_size", "boxes", "max_total_tokens"):
            if getattr(e, name) < 1:
                raise ConfigError(f"env.{name} must be >= 1, got {getattr(e, name)}")
        if e.invalid_penalty < 0 or e.step_penalty < 0:
            raise ConfigError("env.invalid_penalty and env.step_penalty must be >= 0")
    elif cfg.trainer.advantage == "gae":
        raise ConfigError("trainer.advantage='gae' needs a multi-turn environment (set env.name "
                          f"to one of {('frozenlake', 'sokoban')})")
    if not (0 <= c.gamma <= 1 and 0 <= c.lam <= 1):
        raise ConfigError(f"critic.gamma and critic.lam must be in [0, 1], got {c.gamma}, {c.lam}")
    if not c.cliprange_value > 0 or not c.lr > 0:
        raise ConfigError("critic.cliprange_value and critic.lr must be > 0")
    am = cfg.actor.mini_batch_size
    if c.mini_batch_size and (not am or am % c.mini_batch_size):
        raise ConfigError(f"critic.mini_batch_size={c.mini_batch_size} must divide "
                          f"actor.mini_batch_size={am} (rows are padded to the actor's "
                          "mini-batch); 0 = the actor's")
    if c.warmup_steps < 0 or c.ppo_epochs < 1 or c.mini_batch_size < 0:
        raise ConfigError("critic.warmup_steps >= 0, critic.ppo_epochs >= 1 and "
                          "critic.mini_batch_size >= 0 are required")
