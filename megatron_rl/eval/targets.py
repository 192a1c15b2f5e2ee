"""What ``python -m megatron_rl eval TARGET`` evaluates: the target's kind and config, and the sets.

TARGET is one of

* a run directory (``config.json`` + ``checkpoints/``): its newest checkpoint, or ``--step N``'s;
  its config decides the model, layout, engine and sampling; results go to ``RUN/eval/``;
* a Megatron checkpoint written by ``convert hf-to-megatron`` (``megatron_rl_convert.json``);
* a Hugging Face model directory (``config.json`` + ``*.safetensors``), e.g. a base model before
  RL;
* a YAML config (or none: the built-in recipe) — the run directory is its ``trainer.output_dir``
  (the form ``eval CONFIG [key=value ...]`` always had).

``key=value`` overrides apply to every form (e.g. ``rollout.engine=sglang``, ``parallel.tp=1``).
"""

from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass

from megatron_rl.config.errors import ConfigError
from megatron_rl.config.sections import RunConfig

KINDS = ("run", "config", "megatron", "hf")


@dataclass
class EvalRequest:
    """What the ``eval`` job does besides validation: ``kind`` of target, the checkpoint step
    (None: newest), where ``eval/<set>.json`` go, and whether the validation split is scored."""

    kind: str
    target: str | None
    step: int | None = None
    out_dir: str = ""
    validate: bool = True

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def target_kind(target: str | None) -> str:
    """``"run"``, ``"megatron"``, ``"hf"`` or ``"config"`` (a YAML file, ``key=value`` or None)."""
    if target is None or not os.path.isdir(target):
        return "config"
    if os.path.isfile(os.path.join(target, "config.json")) and os.path.isdir(
            os.path.join(target, "checkpoints")):
        return "run"
    from megatron_rl.convert.ckpt_format import SIDECAR

    if os.path.isfile(os.path.join(target, SIDECAR)):
        return "megatron"
    if os.path.isfile(os.path.join(target, "config.json")) and glob.glob(
            os.path.join(target, "*.safetensors")):
        return "hf"
    raise ConfigError(f"eval: {target} is not a run directory (config.json + checkpoints/), a "
                      "Megatron checkpoint (megatron_rl_convert.json) or a Hugging Face model "
                      "directory (config.json + *.safetensors)")


def load_target_config(kind: str, target: str | None, overrides: list[str],
                       out: str | None) -> RunConfig:
    """The run config of a target (see the module docstring)."""
    from megatron_rl.config.load import load_config

    if kind == "run":
        with open(os.path.join(target, "config.json")) as f:
            base = json.load(f)
        return load_config(None, overrides, base=base)
    if kind in ("hf", "megatron"):
        field = "hf_path" if kind == "hf" else "megatron_ckpt"
        out_dir = [f"trainer.output_dir={out}"] if out else []
        return load_config(None, [f"model.{field}={target}", "trainer.export_hf=false",
                                  *out_dir, *overrides])
    from megatron_rl.config.default_recipe import DEFAULT_RECIPE

    return load_config(target, overrides, base=None if target else DEFAULT_RECIPE)


def resolve_sets(names: str | None, cfg: RunConfig, n: int | None = None,
                 k: list[int] | None = None, temperature: float | None = None,
                 max_new_tokens: int | None = None) -> list[dict]:
    """Complete ``data.eval_sets`` entries for ``--sets`` (comma-separated: a set of the config,
    a shipped set, a JSONL/Parquet file, or a reasoning-gym task; None: the config's sets) with
    ``--n/--k/--temperature/--max-new-tokens`` applied to each."""
    from megatron_rl.config.eval_sets import normalize_one

    raws = list(cfg.data.eval_sets) if names is None else [
        _one_set(x.strip(), cfg) for x in names.split(",") if x.strip()]
    out = []
    for i, raw in enumerate(raws):
        raw = dict(raw)
        if n is not None:
            raw["n"] = n
            if k is None and any(x > n for x in raw.get("k", [])):
                raw.pop("k")
        if k is not None:
            raw["k"] = list(k)
        if temperature is not None:
            raw["temperature"] = temperature
        if max_new_tokens is not None:
            raw["max_new_tokens"] = max_new_tokens
        out.append(normalize_one(raw, i, cfg))
    if len({s["name"] for s in out}) != len(out):
        raise ConfigError(f"eval --sets: two sets share a name ({[s['name'] for s in out]})")
    return out


def _one_set(name: str, cfg: RunConfig) -> dict:
    from megatron_rl.data.builtin_sets import BUILTIN_SETS

    for spec in cfg.data.eval_sets:
        if spec["name"] == name:
            return spec
    if name in BUILTIN_SETS:
        return {"name": name}
    if os.path.splitext(name)[1].lower() in (".jsonl", ".json", ".parquet"):
        if not os.path.isfile(name):
            raise ConfigError(f"eval --sets: {name} does not exist")
        stem = os.path.splitext(os.path.basename(name))[0]
        return {"name": stem, "path": name}
    from megatron_rl.rewards.tasks import PROMPT_BUILDERS, known_tasks

    if name in PROMPT_BUILDERS or name in known_tasks():
        return {"name": name, "task": name}
    mine = [s["name"] for s in cfg.data.eval_sets]
    raise ConfigError(f"eval --sets: {name!r} is none of the config's data.eval_sets {mine}, "
                      f"the shipped sets {sorted(BUILTIN_SETS)}, a .jsonl/.parquet file or a "
                      "reasoning-gym task")
