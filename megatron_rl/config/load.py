"""Loading a run config: YAML file or built-in recipe, ``key=value`` overrides, type coercion.

Unknown keys are errors that suggest the closest known key; values are checked against the
field's type; then the load-time checks run (:mod:`megatron_rl.config.checks`,
:mod:`megatron_rl.config.schema`, :mod:`megatron_rl.config.validate`).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Mapping

import yaml

from megatron_rl.config.checks import as_float, check_run_config, ratio_one_warning
from megatron_rl.config.errors import ConfigError
from megatron_rl.config.overrides import (
    OverrideConflict,
    print_notes,
    resolve_exclusive,
    suggest_key,
)
from megatron_rl.config.sections import RunConfig
from megatron_rl.config.validate import validate_run_config


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
            raise ConfigError(f"unknown config key {full!r}"
                              f"{suggest_key(full, RunConfig, sorted(fields))}")
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
    the file, e.g. :data:`megatron_rl.config.default_recipe.DEFAULT_RECIPE`) and apply overrides."""
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
    tree = parse_overrides(items)
    try:  # a model source on the command line replaces the recipe's
        data, notes = resolve_exclusive(data, tree, path or "the built-in recipe")
    except OverrideConflict as exc:
        raise ConfigError(str(exc)) from None
    print_notes(notes)
    data = _merge(data, tree)
    cfg = _build(RunConfig, data, "")
    check_run_config(cfg, data)
    validate_run_config(cfg)
    print_notes([w for w in (ratio_one_warning(cfg),) if w])
    return cfg
