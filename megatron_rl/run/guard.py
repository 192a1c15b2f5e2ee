"""A run directory's guard rails: resume preflight, ``config.json`` history, checkpoint pruning.

- :func:`preflight` (before any process starts): when ``trainer.resume`` finds a checkpoint, the
  new config is compared with the run's ``config.json``. Changed fields are listed as a warning;
  changes that break the run (the model, tokenizer, algorithm, advantage estimator, dataset, or
  the checkpoint format) are refused with a :class:`~megatron_rl.config.errors.ConfigError`. A
  run whose newest checkpoint was written by an early stop is finished: preflight says so and the
  command exits 0 instead of training one more step.
- :func:`write_config`: ``config.json`` is never silently overwritten; when it differs, the old one
  is kept as ``config.<n>.json`` first.
- :func:`prune_checkpoints`: keep the newest ``trainer.keep_checkpoints`` checkpoints.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

# Fields a resumed run must keep: changing them makes the checkpoint (or the data position, or the
# meaning of the optimizer state) belong to a different run. Prefix match on dotted names.
BREAKING = ("model.", "loss.algorithm", "trainer.advantage", "trainer.kl_in_reward_coef",
            "optim.use_distributed_optimizer", "data.path", "data.task", "data.task_kwargs",
            "data.seed", "data.train_size", "data.val_size", "data.split_by", "data.prompt_key",
            "data.answer_key", "data.max_prompt_length", "data.chat_template")


def flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}`` (an empty mapping has no entries)."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, name + "."))
        else:
            out[name] = value
    return out


def config_changes(old: dict, new: dict, defaults: dict | None = None
                   ) -> dict[str, tuple[Any, Any]]:
    """``{field: (old, new)}`` of every field whose value differs (missing on one side: None).
    With ``defaults`` (a default config's dict), a field the old config does not have (it was
    written by a release without that field) is no change while its new value is the default."""
    a, b = flatten(old), flatten(new)
    d = flatten(defaults) if defaults is not None else {}
    return {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b))
            if a.get(k) != b.get(k) and not (k not in a and k in d and b.get(k) == d[k])}


def is_breaking(field: str) -> bool:
    return any(field == p or (p.endswith(".") and field.startswith(p)) or
               field.startswith(p + ".") for p in BREAKING)


def _saved_config(run_dir: str) -> dict | None:
    path = os.path.join(run_dir, "config.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def early_stopped(ckpt_path: str) -> tuple[int, str] | None:
    """``(steps done, reason)`` when the checkpoint was written by an early stop, else None."""
    from megatron_rl.actor.checkpoint import read_meta

    meta = read_meta(ckpt_path)  # weights_only: a shared checkpoint cannot run code
    trainer = meta.get("trainer") or {}
    reason = (trainer.get("early_stop") or {}).get("stopped_reason")
    return (int(trainer.get("next_step", meta["step"] + 1)), reason) if reason else None


def preflight(cfg, log=print) -> str | None:
    """Check a resume before any work. Returns a message when the run is already finished by an
    early stop (nothing to do), else None. Raises ``ConfigError`` for breaking changes."""
    from megatron_rl.actor.ckpt_index import latest_checkpoint
    from megatron_rl.config.errors import ConfigError

    t = cfg.trainer
    ckpt = latest_checkpoint(os.path.join(t.output_dir, "checkpoints"))
    if not t.resume or ckpt is None:
        return None
    old = _saved_config(t.output_dir)
    if old is not None:
        changes = config_changes(old, cfg.to_dict(), type(cfg)().to_dict())
        breaking = {k: v for k, v in changes.items() if is_breaking(k)}
        if breaking:
            listed = "; ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in breaking.items())
            raise ConfigError(f"cannot resume {t.output_dir} under a changed config ({listed}): "
                              "these fields must match the run's config.json; use a new "
                              "output_dir or trainer.resume=false")
        if changes:
            listed = "; ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in changes.items())
            log(f"[train] warning: resuming {t.output_dir} with a changed config: {listed}")
    stopped = early_stopped(ckpt)
    if stopped is not None and cfg.early_stop.enabled:
        steps, reason = stopped
        return (f"[train] {t.output_dir} early-stopped after step {steps} ({reason}); nothing to "
                "do (use a new output_dir, trainer.resume=false, or early_stop.enabled=false to "
                "continue)")
    return None


def write_config(cfg) -> str:
    """Write ``output_dir/config.json``; a different existing one is kept as ``config.<n>.json``
    first (never silently overwritten). Returns the path. Call on one rank."""
    run_dir = cfg.trainer.output_dir
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, "config.json")
    new = cfg.to_dict()
    old = _saved_config(run_dir)
    if old is not None and old != new:
        n = 1
        while os.path.exists(os.path.join(run_dir, f"config.{n}.json")):
            n += 1
        kept = os.path.join(run_dir, f"config.{n}.json")
        os.replace(path, kept)
        print(f"[train] config.json changed; the previous one is kept as {kept}", flush=True)
    with open(path + ".tmp", "w") as f:
        json.dump(new, f, indent=1)
    os.replace(path + ".tmp", path)
    return path


def prune_checkpoints(root: str, keep: int) -> list[str]:
    """Delete all but the newest ``keep`` complete checkpoints under ``root`` (0: keep all); the
    one ``latest`` names is never deleted. Returns the deleted paths. Call on one rank."""
    from megatron_rl.actor.checkpoint import latest_checkpoint

    if keep <= 0 or not os.path.isdir(root):
        return []
    names = sorted(n for n in os.listdir(root) if n.startswith("step_") and not
                   n.endswith(".tmp") and os.path.isdir(os.path.join(root, n)))
    latest = latest_checkpoint(root)
    protected = {os.path.basename(latest)} if latest else set()
    doomed = [n for n in names[:-keep] if n not in protected]
    for n in doomed:
        shutil.rmtree(os.path.join(root, n), ignore_errors=True)
    return [os.path.join(root, n) for n in doomed]
