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
class RolloutSection:
    engine: str = "embedded"
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

    def build(self):
        from megatron_rl.loss import LossConfig

        return LossConfig.for_algorithm(self.algorithm, **self.overrides)


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


ADVANTAGES = ("grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline")


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
    if cfg.trainer.advantage not in ADVANTAGES:
        raise ConfigError(f"trainer.advantage={cfg.trainer.advantage!r} is not one of "
                          f"{ADVANTAGES}")
    if cfg.rollout.engine != "embedded":
        raise ConfigError(f"rollout.engine={cfg.rollout.engine!r} is not available here "
                          "(allowed: 'embedded')")
    for name in ("total_steps", "train_batch_size", "test_freq", "save_freq"):
        if getattr(cfg.trainer, name) < 1:
            raise ConfigError(f"trainer.{name} must be >= 1")
    if cfg.rollout.n < 1 or cfg.rollout.max_new_tokens < 1:
        raise ConfigError("rollout.n and rollout.max_new_tokens must be >= 1")
    if cfg.data.split_by not in ("prompt", "row"):
        raise ConfigError(f"data.split_by={cfg.data.split_by!r} is not one of ('prompt', 'row')")
    if not 0 < cfg.rollout.rv_filter_p <= 1:
        raise ConfigError(f"rollout.rv_filter_p must be in (0, 1], got {cfg.rollout.rv_filter_p}")
    rows = cfg.trainer.train_batch_size * cfg.rollout.n
    if rows % cfg.parallel.dp:
        raise ConfigError(f"trainer.train_batch_size x rollout.n = {rows} responses must be "
                          f"divisible by parallel.dp={cfg.parallel.dp}")
