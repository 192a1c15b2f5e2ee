"""``data.eval_sets``: named evaluation sets, checked and completed when the config is loaded.

Each entry is a mapping (docs/evaluation.md):

* ``name`` (required): ``[A-Za-z0-9_.-]+``, unique; metrics are logged as ``eval/<name>/...``;
* the prompts: a shipped set named alone (``math_latex``, ``chain_sum``, see
  :mod:`megatron_rl.data.builtin_sets`), or ``path`` (a JSONL/Parquet file or a list of files in
  the training-data layout, with ``prompt_key`` / ``answer_key`` as in ``data``) or ``task`` (a
  reasoning-gym task, with ``task_kwargs``, ``size`` prompts and ``seed``); exactly one of the
  two; ``limit`` keeps the first ``limit`` prompts (0: all);
* sampling: ``n`` samples per prompt, ``temperature`` (0: greedy), ``top_p``,
  ``max_new_tokens`` (default: the ``rollout`` section's ``temperature``, ``top_p``,
  ``max_new_tokens``);
* ``scorer``: ``math_verify`` | ``exact_match`` | ``task`` (the reasoning-gym verifier) | a reward
  plug-in ``module:function`` (default: ``task`` for a task set, else ``math_verify``);
* ``k``: the k of pass@k / avg@k / maj@k, each in ``[1, n]`` (default ``[1, n]``).

:func:`normalize_eval_sets` turns every entry into a complete mapping (defaults filled in) so that
the saved config says exactly how each set was sampled; every error is a ``ConfigError`` naming
``data.eval_sets[i].<field>`` and the allowed values.
"""

from __future__ import annotations

import math
import re
from typing import Any

from megatron_rl.config.errors import ConfigError, closest

SCORERS = ("math_verify", "exact_match", "task")  # or a plug-in "module:function"
NAME_RE = re.compile(r"^[A-Za-z0-9_.-]+$")
FIELDS = ("name", "path", "task", "task_kwargs", "size", "seed", "limit", "prompt_key",
          "answer_key", "n", "temperature", "top_p", "max_new_tokens", "scorer", "k")
DEFAULT_TASK_SIZE = 64
DEFAULT_TASK_SEED = 1000  # not data.seed: a task set is generated apart from the training prompts


def normalize_eval_sets(cfg) -> None:
    """Check ``cfg.data.eval_sets`` and replace it with complete entries (defaults filled in)."""
    sets = cfg.data.eval_sets
    if sets and cfg.env.name:
        raise ConfigError(f"data.eval_sets needs single-turn prompts; env.name={cfg.env.name!r} "
                          "trains on multi-turn environments (remove data.eval_sets)")
    out, seen = [], set()
    for i, raw in enumerate(sets):
        spec = normalize_one(raw, i, cfg)
        if spec["name"] in seen:
            raise ConfigError(f"data.eval_sets[{i}].name={spec['name']!r} is used by an earlier "
                              "set; every set needs its own name")
        seen.add(spec["name"])
        out.append(spec)
    cfg.data.eval_sets = out


def normalize_one(raw: Any, i: int, cfg) -> dict:
    """One complete entry of ``data.eval_sets`` (``i``: its index, for the messages)."""
    where = f"data.eval_sets[{i}]"
    if isinstance(raw, str):  # a shipped set by name: data.eval_sets=math_latex,chain_sum
        raw = {"name": raw}
    if not isinstance(raw, dict):
        raise ConfigError(f"{where} must be a mapping with a name and a path or task "
                          f"(docs/evaluation.md), got {raw!r}")
    for key in raw:
        if key not in FIELDS:
            raise ConfigError(f"{where}: unknown field {key!r}{closest(str(key), FIELDS)} "
                              f"(allowed: {', '.join(FIELDS)})")
    name = raw.get("name")
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise ConfigError(f"{where}.name must be a name of letters, digits, '_', '.' or '-' "
                          f"(it becomes the metric prefix eval/<name>/), got {name!r}")
    where = f"data.eval_sets[{i}] ({name})"
    raw = with_builtin(raw)
    if ("path" in raw) == ("task" in raw):
        from megatron_rl.data.builtin_sets import BUILTIN_SETS

        raise ConfigError(f"{where}: give exactly one of path (JSONL/Parquet files) or task "
                          f"(a reasoning-gym task), or name a shipped set "
                          f"({', '.join(BUILTIN_SETS)}) alone")
    r = cfg.rollout
    spec: dict[str, Any] = {"name": name}
    if "path" in raw:
        spec["path"] = _paths(raw["path"], f"{where}.path")
        spec["prompt_key"] = _text(raw.get("prompt_key", cfg.data.prompt_key),
                                   f"{where}.prompt_key")
        ak = raw.get("answer_key", cfg.data.answer_key)
        spec["answer_key"] = None if ak is None else _text(ak, f"{where}.answer_key")
    else:
        spec["task"] = _task(raw["task"], f"{where}.task")
        kw = raw.get("task_kwargs", {})
        if not isinstance(kw, dict):
            raise ConfigError(f"{where}.task_kwargs must be a mapping, got {kw!r}")
        spec["task_kwargs"] = dict(kw)
        spec["size"] = _int(raw.get("size", DEFAULT_TASK_SIZE), f"{where}.size", 1)
        spec["seed"] = _int(raw.get("seed", DEFAULT_TASK_SEED), f"{where}.seed", 0)
    spec["limit"] = _int(raw.get("limit", 0), f"{where}.limit", 0)
    spec["n"] = _int(raw.get("n", 1), f"{where}.n", 1)
    spec["temperature"] = _float(raw.get("temperature", r.temperature), f"{where}.temperature",
                                 ">= 0 (0: greedy)", lambda x: x >= 0)
    spec["top_p"] = _float(raw.get("top_p", r.top_p), f"{where}.top_p", "in (0, 1]",
                           lambda x: 0 < x <= 1)
    spec["max_new_tokens"] = _int(raw.get("max_new_tokens", r.max_new_tokens),
                                  f"{where}.max_new_tokens", 1)
    spec["scorer"] = _scorer(raw.get("scorer", "task" if "task" in spec else "math_verify"),
                             f"{where}.scorer", "task" in spec)
    spec["k"] = _ks(raw.get("k"), spec["n"], f"{where}.k")
    return spec


def with_builtin(raw: dict) -> dict:
    """A shipped set named with neither ``path`` nor ``task``: its entry under ``raw``'s fields."""
    from megatron_rl.data.builtin_sets import BUILTIN_SETS

    if "path" in raw or "task" in raw or raw.get("name") not in BUILTIN_SETS:
        return raw
    return {**BUILTIN_SETS[raw["name"]], **raw}


def _paths(value: Any, where: str) -> list[str]:
    paths = [value] if isinstance(value, str) else value
    if not isinstance(paths, list) or not paths or not all(
            isinstance(p, str) and p for p in paths):
        raise ConfigError(f"{where} must be a file path or a list of paths (.jsonl, .json, "
                          f".parquet), got {value!r}")
    return list(paths)


def _text(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{where} must be a non-empty string, got {value!r}")
    return value


def _task(value: Any, where: str) -> str:
    from megatron_rl.rewards.tasks import PROMPT_BUILDERS, known_tasks

    name = _text(value, where)
    if name not in PROMPT_BUILDERS:
        tasks = known_tasks()
        if name not in tasks:
            raise ConfigError(f"{where}={name!r} is not a reasoning-gym task"
                              f"{closest(name, tasks)}")
    return name


def _int(value: Any, where: str, lo: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise ConfigError(f"{where} must be an integer >= {lo}, got {value!r}")
    return value


def _float(value: Any, where: str, allowed: str, ok) -> float:
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            pass
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(
            value) or not ok(value):
        raise ConfigError(f"{where} must be a number {allowed}, got {value!r}")
    return float(value)


def _scorer(value: Any, where: str, task_set: bool) -> str:
    allowed = f"{', '.join(SCORERS)} or a reward plug-in 'module:function'"
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{where} must be one of {allowed}, got {value!r}")
    if value in SCORERS:
        if value == "task" and not task_set:
            raise ConfigError(f"{where}='task' scores with a reasoning-gym verifier: only for a "
                              "set with task:, not path: (use math_verify, exact_match or a "
                              "plug-in)")
        return value
    mod, _, fn = value.partition(":")
    if not (mod and fn and all(p.isidentifier() for p in mod.split(".")) and fn.isidentifier()):
        raise ConfigError(f"{where}={value!r} is not one of {allowed}"
                          f"{closest(value, SCORERS)}")
    return value


def _ks(value: Any, n: int, where: str) -> list[int]:
    if value is None:
        return sorted({1, n})
    ks = [value] if isinstance(value, int) and not isinstance(value, bool) else value
    if isinstance(ks, str):
        try:
            ks = [int(x) for x in ks.split(",") if x.strip()]
        except ValueError:
            ks = value
    if not isinstance(ks, list) or not ks:
        raise ConfigError(f"{where} must be a non-empty list of integers in [1, n={n}], got "
                          f"{value!r}")
    for k in ks:
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= n:
            raise ConfigError(f"{where}: {k!r} is not an integer in [1, n={n}] (pass@k needs "
                              f"k <= n samples per prompt; raise n or drop {k!r})")
    return sorted(set(ks))
