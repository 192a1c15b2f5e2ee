"""The allowed range of every numeric config field and the allowed values of every named choice.

:func:`check_ranges` runs when a config is loaded (before any process starts): every number must be
finite and inside its field's range, every choice one of its allowed values, whatever section it is
in (an ``rollout.sglang`` value is checked even while ``rollout.engine`` is ``embedded``). Errors
name the dotted field, the allowed range or values, and the value given.

Every ``int``/``float`` field of :class:`~megatron_rl.config.sections.RunConfig` is listed in
:data:`RANGES` or, with the reason, in :data:`UNBOUNDED`; every ``str`` field in :data:`CHOICES`
or :data:`FREE_TEXT` (``tests/test_bad_input.py`` fails for a new field that is in none of them).
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from megatron_rl.config.errors import ConfigError, closest
from megatron_rl.config.sections import RunConfig

SEED_MAX = 2**32 - 1  # numpy's seeds are 32-bit
ADVANTAGES = ("grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gae")
FILTER_METRICS = ("acc", "score", "reward")  # per-response record fields


@dataclass(frozen=True)
class Range:
    """``lo <= x <= hi`` (``lo_open``/``hi_open``: strict); None bounds are unbounded."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False

    def contains(self, x: float) -> bool:
        if self.lo is not None and (x <= self.lo if self.lo_open else x < self.lo):
            return False
        return not (self.hi is not None and (x >= self.hi if self.hi_open else x > self.hi))

    def describe(self) -> str:
        """``"> 0"``, ``">= 1"``, ``"in (0, 1]"``."""
        if self.hi is None:
            return f"{'>' if self.lo_open else '>='} {_num(self.lo)}"
        if self.lo is None:
            return f"{'<' if self.hi_open else '<='} {_num(self.hi)}"
        return (f"in {'(' if self.lo_open else '['}{_num(self.lo)}, {_num(self.hi)}"
                f"{')' if self.hi_open else ']'}")


def _num(x: float | None) -> str:
    return str(int(x)) if x is not None and float(x).is_integer() else str(x)


POS = Range(0, None, lo_open=True)  # > 0
NONNEG = Range(0)  # >= 0
ONE_UP = Range(1)  # >= 1
UNIT = Range(0, 1)  # [0, 1]
UNIT_OPEN_LOW = Range(0, 1, lo_open=True)  # (0, 1]
BETA = Range(0, 1, hi_open=True)  # [0, 1)
SEED = Range(0, SEED_MAX)

RANGES: dict[str, Range] = {
    "parallel.tp": ONE_UP, "parallel.pp": ONE_UP, "parallel.dp": ONE_UP, "parallel.ep": ONE_UP,
    "parallel.cp": ONE_UP,
    "parallel.timeout_s": POS, "parallel.host_timeout_s": POS,
    "model.moe_aux_loss_coeff": NONNEG, "model.moe_z_loss_coeff": NONNEG,
    "data.max_prompt_length": NONNEG, "data.train_size": ONE_UP, "data.val_size": ONE_UP,
    "data.seed": SEED,
    "rollout.sglang.num_servers": ONE_UP, "rollout.sglang.router_port": Range(1, 65535),
    "rollout.sglang.tp_size": ONE_UP, "rollout.sglang.mem_fraction_static": UNIT_OPEN_LOW,
    "rollout.sglang.concurrency": ONE_UP, "rollout.sglang.request_timeout_s": POS,
    "rollout.sglang.max_retries": NONNEG, "rollout.sglang.max_offpolicy_lag": Range(-1),
    "rollout.sglang.probe_tolerance": POS, "rollout.sglang.probe_length": NONNEG,
    "rollout.sglang.spot_checks": NONNEG, "rollout.sglang.flush_retries": NONNEG,
    "rollout.sglang.max_restarts": NONNEG,
    "rollout.sglang.server_threads": ONE_UP,
    "rollout.n": ONE_UP, "rollout.temperature": POS, "rollout.top_p": UNIT_OPEN_LOW,
    "rollout.max_new_tokens": ONE_UP, "rollout.val_temperature": NONNEG, "rollout.val_n": ONE_UP,
    "rollout.gen_batch_size": NONNEG, "rollout.max_num_gen_batches": ONE_UP,
    "rollout.overlong_buffer": NONNEG, "rollout.overlong_penalty_factor": NONNEG,
    "rollout.rv_filter_p": UNIT_OPEN_LOW, "rollout.reward_timeout_s": POS,
    "rollout.weight_sync_bucket_mb": ONE_UP, "rollout.max_staleness": Range(0, 64),
    "actor.micro_batch_size": ONE_UP, "actor.mini_batch_size": NONNEG, "actor.ppo_epochs": ONE_UP,
    "actor.temperature": POS, "actor.logprob_chunk_size": ONE_UP,
    "actor.max_consecutive_skips": ONE_UP, "actor.max_tokens_per_micro_batch": NONNEG,
    "actor.lora.alpha": POS, "actor.lora.dropout": BETA,
    "optim.lr": POS, "optim.min_lr": NONNEG, "optim.weight_decay": NONNEG,
    "optim.adam_beta1": BETA, "optim.adam_beta2": BETA, "optim.adam_eps": POS,
    "optim.clip_grad": NONNEG, "optim.lr_warmup_steps": NONNEG, "optim.lr_decay_steps": ONE_UP,
    "loss.rollout_correction_threshold": Range(1, None, lo_open=True),
    "loss.icepop_low": Range(0, 1), "loss.icepop_high": ONE_UP,
    "loss.seq_mask_low": Range(0, 1, lo_open=True), "loss.seq_mask_high": ONE_UP,
    "trainer.total_steps": ONE_UP, "trainer.train_batch_size": ONE_UP, "trainer.test_freq": ONE_UP,
    "trainer.save_freq": ONE_UP, "trainer.seed": SEED, "trainer.keep_checkpoints": NONNEG,
    "trainer.max_restarts": NONNEG, "trainer.restart_backoff_s": NONNEG,
    "trainer.kl_in_reward_coef": NONNEG,
    "trainer.collapse_metrics.every_n_steps": ONE_UP,
    "trainer.collapse_metrics.max_inputs": Range(2),
    "sft.steps": NONNEG, "sft.batch_size": ONE_UP, "sft.lr": POS,
    "early_stop.rv_warmup_steps": ONE_UP, "early_stop.rv_patience": ONE_UP,
    "early_stop.rv_ratio": NONNEG, "early_stop.val_threshold": NONNEG,
    "early_stop.val_patience": ONE_UP,
    "env.size": Range(2, 64), "env.max_turns": ONE_UP, "env.success_rate": UNIT_OPEN_LOW,
    "env.frozen_p": UNIT, "env.boxes": ONE_UP, "env.invalid_penalty": NONNEG,
    "env.step_penalty": NONNEG, "env.val_size": ONE_UP, "env.max_total_tokens": ONE_UP,
    "env.seed": SEED,
    "critic.gamma": UNIT, "critic.lam": UNIT, "critic.cliprange_value": POS,
    "critic.warmup_steps": NONNEG, "critic.lr": POS, "critic.weight_decay": NONNEG,
    "critic.clip_grad": NONNEG, "critic.ppo_epochs": ONE_UP, "critic.mini_batch_size": NONNEG,
    "teacher.coef": POS, "teacher.task_coef": NONNEG, "teacher.disagree_nats": POS,
    "teacher.parallel.tp": ONE_UP, "teacher.parallel.pp": ONE_UP,
}

# Numeric fields without a range: none today (every number has one).
UNBOUNDED: dict[str, str] = {
    "actor.lora.rank": "0 (the default) means no adapters; a rank given in the config must be >= 1 "
                       "(config/checks.py check_actor_lora), negative values are refused by "
                       "LoraConfig",
}


def _choices(module: str, name: str) -> Callable[[], tuple[str, ...]]:
    def get() -> tuple[str, ...]:
        import importlib

        return tuple(getattr(importlib.import_module(module), name))
    return get


# Named choices: their allowed values (checked here, or, for the two names with a suggestion of the
# closest known name, by megatron_rl.config.checks: model.preset, data.task, loss.algorithm).
CHOICES: dict[str, Callable[[], tuple[str, ...]]] = {
    "model.preset": lambda: tuple(sorted(_choices("megatron_rl.models.config", "PRESETS")())),
    "parallel.backend": _choices("megatron_rl.parallel.backend", "BACKENDS"),
    "data.split_by": lambda: ("prompt", "row"),
    "rollout.sglang.serve_rules": _choices("megatron_rl.rollout.serve_rules", "RULES"),
    "rollout.engine": lambda: ("embedded", "sglang"),
    "rollout.sglang.launcher": _choices("megatron_rl.rollout.fleet", "LAUNCHERS"),
    "rollout.sglang.weight_sync": _choices("megatron_rl.rollout.fleet", "WEIGHT_SYNCS"),
    "rollout.sglang.quantization": _choices("megatron_rl.rollout.quant_choices", "QUANTIZATIONS"),
    "rollout.sglang.fp8_scale_fmt": _choices("megatron_rl.rollout.quant_choices", "SCALE_FMTS"),
    "rollout.filter_metric": lambda: FILTER_METRICS,
    "actor.precision": _choices("megatron_rl.actor.actor_config", "PRECISIONS"),
    "actor.recompute": _choices("megatron_rl.actor.actor_config", "RECOMPUTE"),
    "actor.routing_replay": _choices("megatron_rl.actor.actor_config", "ROUTING_REPLAY_MODES"),
    "actor.lora.sync": _choices("megatron_rl.models.lora_config", "LORA_SYNCS"),
    "optim.lr_decay_style": _choices("megatron_rl.actor.optim", "LR_DECAY_STYLES"),
    "loss.algorithm": lambda: tuple(sorted(_choices("megatron_rl.loss.config", "PRESETS")())),
    "loss.rollout_correction": _choices("megatron_rl.loss.params",
                                        "ROLLOUT_CORRECTIONS"),
    "loss.rollout_correction_denominator": _choices("megatron_rl.loss.params",
                                                    "ROLLOUT_CORRECTION_DENOMINATORS"),
    "trainer.advantage": lambda: ADVANTAGES,
    "trainer.collapse_metrics.reasoning": lambda: ("think", "reply"),
    "env.name": _choices("megatron_rl.envs", "ENVS"),
    "teacher.engine": _choices("megatron_rl.loss.distill_choices", "ENGINES"),
    "teacher.mode": _choices("megatron_rl.loss.distill_choices", "MODES"),
}

# Strings that are paths, URLs or names: checked where they are used (see docs/bad-input.md).
FREE_TEXT: dict[str, str] = {
    "model.hf_path": "a directory: config.json, shards and tensor shapes checked at load",
    "model.megatron_ckpt": "a directory: checked at load",
    "model.tokenizer": "'byte' or a tokenizer directory: checked at load",
    "model.init_weights": "a .pt file: must exist (input check)",
    "data.task": "a reasoning-gym task name: checked at load, closest name suggested",
    "data.path": "dataset files: read and checked before the run starts (input check)",
    "data.prompt_key": "a field of the dataset rows: checked against the data (input check)",
    "data.answer_key": "a field of the dataset rows: checked against the data (input check)",
    "data.prompt_field": "renamed to data.prompt_key: any value is an error",
    "data.answer_field": "renamed to data.answer_key: any value is an error",
    "rollout.sglang.router_url": "an http(s):// URL: checked at load",
    "parallel.socket_ifname": "a network interface name: checked on the ranks (names the ones "
                              "that exist)",
    "rollout.sglang.host": "the interface started servers bind to (127.0.0.1 by default)",
    "rollout.sglang.sync_dir": "a directory on shared storage, created when needed",
    "rollout.sglang.python": "an interpreter with sglang installed: must be a file (at load)",
    "rollout.sglang.sender_address": "an address of this host the servers reach (default: routed)",
    "rollout.reward_fn": "'module:function': imported and probed before the run (input check)",
    "trainer.output_dir": "the run directory, created when needed",
    "logging.project": "a name for wandb / tensorboard",
    "trainer.collapse_metrics.think_open": "the reasoning's opening tag, matched as its tokens",
    "trainer.collapse_metrics.think_close": "the reasoning's closing tag, matched as its tokens",
    "teacher.hf_path": "a directory: config.json, shards and tensor shapes checked at load",
    "teacher.checkpoint": "a directory: checked at load",
    "teacher.tokenizer": "'byte' or a tokenizer directory: checked at load against the "
                         "student's",
    "teacher.url": "an http(s):// URL of the teacher's router or server: checked at load",
}


# checked with the closest known name suggested (megatron_rl.config.checks), in their own order
_SUGGESTED = ("loss.algorithm",)


def leaf_fields(cls: type, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """``(dotted name, type)`` of every non-dataclass field of ``cls``, nested sections included."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            yield from leaf_fields(tp, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", tp


def base_type(tp: Any) -> Any:
    """``int | None`` -> ``int``; ``list[str]`` -> ``list``; others unchanged."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        tp = next(a for a in typing.get_args(tp) if a is not type(None))
    return typing.get_origin(tp) or tp


def get_field(cfg: Any, dotted: str) -> Any:
    node = cfg
    for part in dotted.split("."):
        node = getattr(node, part)
    return node


def range_error(name: str, value: Any) -> str | None:
    """The message for a number outside its field's range (or not finite), else None."""
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, float) and not math.isfinite(value):
        rng = RANGES.get(name)
        allowed = f" (allowed: {rng.describe()})" if rng else ""
        return f"{name} must be a finite number{allowed}, got {value}"
    rng = RANGES.get(name)
    if rng is not None and not rng.contains(value):
        return f"{name} must be {rng.describe()}, got {value}"
    return None


def check_ranges(cfg: Any) -> None:
    """Every number of ``cfg`` finite and in range, every choice allowed; raises ``ConfigError``
    naming the first bad field."""
    for name, tp in leaf_fields(RunConfig):
        value = get_field(cfg, name)
        kind = base_type(tp)
        if kind in (int, float):
            msg = range_error(name, value)
            if msg:
                raise ConfigError(msg)
        elif kind is str and name in CHOICES and name not in _SUGGESTED and value is not None:
            allowed = CHOICES[name]()
            if value not in allowed:
                raise ConfigError(f"{name}={value!r} is not one of {allowed}"
                                  f"{closest(value, allowed)}")
    for gpu in cfg.rollout.sglang.gpus:
        if isinstance(gpu, bool) or not isinstance(gpu, int) or gpu < 0:
            raise ConfigError(f"rollout.sglang.gpus: {gpu!r} is not a CUDA device index (>= 0)")
    url = cfg.rollout.sglang.router_url
    if url is not None and not url.startswith(("http://", "https://")):
        raise ConfigError(f"rollout.sglang.router_url={url!r} is not an http(s):// URL")
    for u in cfg.rollout.sglang.servers:
        if not isinstance(u, str) or not u.startswith(("http://", "https://")):
            raise ConfigError(f"rollout.sglang.servers: {u!r} is not an http(s):// URL")
