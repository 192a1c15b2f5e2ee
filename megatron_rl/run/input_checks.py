"""Checks of a run's inputs before any process starts (``train``, ``sft``, ``eval`` and
``train --check`` call :func:`check_inputs` right after loading the config).

:func:`~megatron_rl.config.load.load_config` checks the config itself (names, types, ranges, the
model directory's headers). The checks here read what the config points at, so that a bad input
fails in seconds, before the SFT warm start or the first rollout, with nothing written to the run
directory:

* ``model.init_weights`` exists; the tokenizer's vocabulary fits the model's;
* ``data.path``: every row parses (UTF-8, JSON, the prompt and answer fields present and
  non-empty), ids are unique, the split leaves enough rows for a batch, and every kept prompt plus
  ``rollout.max_new_tokens`` fits the model's context (``max_position_embeddings``);
* ``data.eval_sets``: every set's rows read and rendered as ``data.path`` rows are, its scorer
  imported (a plug-in is called once on the set's first prompt);
* ``rollout.reward_fn``: imported, then called once on the first prompt with its reference answer
  as the response, under ``rollout.reward_timeout_s``: it must return a finite number.

Every failure is a :class:`~megatron_rl.config.errors.ConfigError` naming the field and the fix.
"""

from __future__ import annotations

import math
import os
from typing import Any

from megatron_rl.config.errors import ConfigError
from megatron_rl.config.overrides import closest_name
from megatron_rl.config.sections import RunConfig
from megatron_rl.rewards.tasks import task_kwarg_names


def check_inputs(cfg: RunConfig) -> None:
    """All input checks of ``cfg`` (see the module docstring); raises ``ConfigError``."""
    check_init_weights(cfg)
    check_socket_ifname(cfg)
    tok = tokenizer_of(cfg)
    rows = dataset_rows(cfg, tok)
    check_reward_fn(cfg, rows)
    check_eval_sets(cfg, tok)


def check_init_weights(cfg: RunConfig) -> None:
    path = cfg.model.init_weights
    if path and not os.path.isfile(path):
        raise ConfigError(f"model.init_weights={path!r} is not a file (expected the .pt weights "
                          "written by `sft`, e.g. OUTPUT_DIR/sft_weights.pt)")


def check_socket_ifname(cfg: RunConfig) -> None:
    """``parallel.socket_ifname`` must be an interface of this machine (every node of a job
    checks its own)."""
    from megatron_rl.parallel.netbind import BindError, interface_address

    if cfg.parallel.socket_ifname:
        try:
            interface_address(cfg.parallel.socket_ifname)
        except BindError as exc:
            raise ConfigError(str(exc)) from exc


def tokenizer_of(cfg: RunConfig):
    """The run's tokenizer; a vocabulary larger than the model's is a ``ConfigError``."""
    from megatron_rl.data.tokenizer import TokenizerError
    from megatron_rl.run.setup import make_tokenizer

    try:
        return make_tokenizer(cfg)
    except TokenizerError as exc:
        raise ConfigError(f"model.tokenizer: {exc}") from exc
    except (OSError, ValueError) as exc:
        raise ConfigError(f"model.tokenizer: cannot load the tokenizer ({exc}); set model."
                          "tokenizer to a Hugging Face tokenizer directory or 'byte'") from exc


def context_length(cfg: RunConfig) -> int:
    from megatron_rl.run.setup import model_config

    return int(model_config(cfg).max_position_embeddings)


def dataset_rows(cfg: RunConfig, tok) -> list[dict]:
    """The rendered training rows (a few generated ones for reasoning-gym tasks; none for
    multi-turn environments), after every data check."""
    from megatron_rl.data.prompts import PromptDataset

    d, r = cfg.data, cfg.rollout
    if cfg.env.name:
        return []
    ctx = context_length(cfg)
    if d.max_prompt_length and d.max_prompt_length + r.max_new_tokens > ctx:
        raise ConfigError(f"data.max_prompt_length={d.max_prompt_length} + rollout.max_new_tokens="
                          f"{r.max_new_tokens} exceeds the model's context "
                          f"(max_position_embeddings={ctx}); lower one of them")
    if not d.path:
        _check_task_kwargs(d.task, d.task_kwargs)
        try:
            return PromptDataset.from_task(d.task, 2, d.seed, **d.task_kwargs).rows
        except Exception as exc:  # noqa: BLE001 - reasoning-gym validates its own kwargs
            raise ConfigError(f"data.task_kwargs={d.task_kwargs!r} for data.task={d.task!r}: "
                              f"{type(exc).__name__}: {exc}") from exc
    from megatron_rl.run.setup import build_datasets

    try:
        train, val = build_datasets(cfg, tok)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"data.path: {exc}") from exc
    batch = r.gen_batch_size or cfg.trainer.train_batch_size
    if len(train) < batch:
        raise ConfigError(f"data.path: {len(train)} training rows after the split (data.val_size="
                          f"{d.val_size}) are fewer than one batch of {batch} prompts; add rows or "
                          "lower data.val_size / trainer.train_batch_size")
    check_prompt_lengths(train.rows + val.rows, tok, ctx, r.max_new_tokens, d.max_prompt_length)
    return train.rows


def check_prompt_lengths(rows: list[dict], tok, ctx: int, max_new: int, max_prompt: int) -> None:
    """Every rendered prompt plus ``max_new`` tokens fits ``ctx`` (with ``max_prompt == 0``; a
    positive ``data.max_prompt_length`` already dropped the long ones)."""
    if max_prompt:
        return
    long = [(i, n) for i, row in enumerate(rows)
            if (n := len(tok.encode(row["prompt"]))) + max_new > ctx]
    if long:
        i, n = long[0]
        raise ConfigError(f"data.path: {len(long)} of {len(rows)} prompts do not fit the model's "
                          f"context: prompt tokens + rollout.max_new_tokens = {n} + {max_new} > "
                          f"max_position_embeddings={ctx} (first: {rows[i]['raw_prompt']!r:.60}); "
                          f"set data.max_prompt_length={max(1, ctx - max_new)} to drop them or "
                          "lower rollout.max_new_tokens")


def check_reward_fn(cfg: RunConfig, rows: list[dict]) -> None:
    """Import ``rollout.reward_fn`` and call it once (first row, its answer as the response)."""
    spec = cfg.rollout.reward_fn
    if not spec:
        return
    from megatron_rl.rewards.plugin import load_reward_fn

    try:
        fn = load_reward_fn(spec)
    except (ImportError, AttributeError, TypeError, ValueError) as exc:
        raise ConfigError(f"rollout.reward_fn: {exc}") from exc
    if rows:
        probe_reward_fn(fn, spec, rows[0], cfg.rollout.reward_timeout_s)


def probe_reward_fn(fn, spec: str, row: dict, timeout_s: float,
                    field: str = "rollout.reward_fn", which: str = "training") -> float:
    """``fn(row, row["answer"])`` in a thread bounded by ``timeout_s``; its value, or a
    ``ConfigError`` saying what went wrong (raised, hung, not a finite number)."""
    from megatron_rl.rewards.math_verify_reward import _call_in_thread

    what = (f"{field}={spec!r} called on the first {which} prompt with its reference "
            "answer as the response")
    status, value = _call_in_thread(fn, row, str(row.get("answer", "")), timeout_s)
    if status == "timeout":
        raise ConfigError(f"{what} did not return within rollout.reward_timeout_s={timeout_s} s; "
                          "make it faster (or raise rollout.reward_timeout_s)")
    if status == "error":
        raise ConfigError(f"{what} raised {type(value).__name__}: {value}; a reward function "
                          "must return a float for any response (fix it or catch the error)")
    return _finite(value, what)


def _finite(value: Any, what: str) -> float:
    try:
        f = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{what} returned {value!r}, not a number; return a float") from None
    if not math.isfinite(f):
        raise ConfigError(f"{what} returned {f}; rewards must be finite numbers")
    return f


def _check_task_kwargs(task: str, kwargs: dict) -> None:
    """Every ``data.task_kwargs`` key is a keyword of the reasoning-gym task (closest named)."""
    known = task_kwarg_names(task)
    for key in kwargs if known is not None else ():
        if key not in known:
            raise ConfigError(f"data.task_kwargs.{key}: not a keyword of reasoning-gym task "
                              f"{task!r}{closest_name(key, known)} (allowed: "
                              f"{', '.join(known)})")


def check_eval_sets(cfg: RunConfig, tok) -> None:
    """Every ``data.eval_sets`` entry's rows load and render, and its scorer loads (a plug-in is
    probed on the set's first prompt); errors name ``data.eval_sets[i]``."""
    from megatron_rl.eval.sets import build_eval_sets

    for i, spec in enumerate(cfg.data.eval_sets):
        where = f"data.eval_sets[{i}] ({spec['name']})"
        if "task" in spec:
            _check_task_kwargs(spec["task"], spec["task_kwargs"])
        try:
            (es,) = build_eval_sets(cfg, tok, [spec])
        except (ImportError, AttributeError, TypeError) as exc:
            raise ConfigError(f"{where}.scorer: {exc}") from exc
        except (OSError, ValueError) as exc:
            raise ConfigError(f"{where}.{'path' if 'path' in spec else 'task'}: {exc}") from exc
        if ":" in spec["scorer"]:
            probe_reward_fn(es.score_fn, spec["scorer"], es.rows[0], cfg.rollout.reward_timeout_s,
                            f"{where}.scorer", "evaluation")
