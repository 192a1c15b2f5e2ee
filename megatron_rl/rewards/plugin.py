"""Reward-function plug-in point.

``load_reward_fn("package.module:function")`` or ``load_reward_fn("package.module.function")``
imports and returns a callable ``fn(row: dict, response: str) -> float``. Errors are
``ValueError`` / ``ImportError`` / ``AttributeError`` / ``TypeError`` naming the spec and what is
wrong (malformed spec, module not found, attribute missing — with the module's public names —,
or not callable). A failing import *inside* the user's module is re-raised with its cause.

Built-in short names: ``"task"`` (reasoning-gym verifier, :func:`rewards.tasks.score`),
``"math_verify"`` (:func:`rewards.math_verify_reward.math_reward_fn`).
"""

from __future__ import annotations

import importlib
from typing import Callable

BUILTIN = {
    "task": "megatron_rl.rewards.tasks:score",
    "math_verify": "megatron_rl.rewards.math_verify_reward:math_reward_fn",
}

RewardFn = Callable[[dict, str], float]


def _import(modname: str, spec: str):
    try:
        return importlib.import_module(modname)
    except ModuleNotFoundError as e:
        if e.name and (modname == e.name or modname.startswith(e.name + ".")):
            raise ImportError(f"reward function {spec!r}: module {modname!r} not found "
                              f"(is it installed or on PYTHONPATH?)") from None
        raise ImportError(f"reward function {spec!r}: importing {modname!r} failed: {e}") from e


def load_reward_fn(spec: str) -> RewardFn:
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"reward function spec must be 'package.module:function' or "
                         f"'package.module.function', got {spec!r}")
    spec = spec.strip()
    target = BUILTIN.get(spec, spec)
    if ":" in target:
        modname, _, attr = target.partition(":")
        if not modname or not attr or ":" in attr:
            raise ValueError(f"reward function spec {spec!r}: expected 'package.module:function'")
        mod = _import(modname, spec)
    else:
        modname, _, attr = target.rpartition(".")
        if not modname or not attr:
            raise ValueError(f"reward function spec {spec!r}: expected 'package.module:function' "
                             f"or 'package.module.function' (built-ins: {', '.join(BUILTIN)})")
        mod = _import(modname, spec)
    obj = mod
    for part in attr.split("."):
        if not hasattr(obj, part):
            public = [n for n in dir(mod) if not n.startswith("_")]
            raise AttributeError(f"reward function {spec!r}: {modname!r} has no attribute "
                                 f"{attr!r} (public names: {', '.join(public[:30])})")
        obj = getattr(obj, part)
    if not callable(obj):
        raise TypeError(f"reward function {spec!r}: {modname}.{attr} is a "
                        f"{type(obj).__name__}, not callable; expected fn(row, response) -> float")
    return obj
