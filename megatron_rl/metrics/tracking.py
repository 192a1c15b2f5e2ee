"""Metrics logging: JSONL always, TensorBoard / W&B when installed and enabled, a progress line.

``Tracker(run_dir)`` appends one JSON object per step to ``run_dir/metrics.jsonl``
(``{"step": s, "time": unix, "wall_s": since start, **metrics}``, flushed per line; NaN/inf
become ``null``; tensors and numpy scalars become floats). ``resume_step=S`` first drops rows
with ``step > S`` (a run resumed from the checkpoint of step S rewrites what came after it).

TensorBoard (``torch.utils.tensorboard``, needs the ``tensorboard`` package) and W&B are used
only when enabled *and* importable; otherwise one notice line is printed and logging goes on.
W&B runs offline unless the user configured it (``WANDB_MODE`` or ``WANDB_API_KEY`` set).

The progress line (one plain line per logged step, no ``\\r``)::

    [step 12/100] reward 0.532 | entropy 1.234 | val_acc 0.410 | 3.21 s/step | ETA 4m42s

looks the values up in ``progress_keys`` (first key present wins).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Any

DEFAULT_PROGRESS_KEYS: dict[str, tuple[str, ...]] = {
    "reward": ("train/reward_mean", "train/reward", "reward/mean", "critic/score/mean",
               "reward"),
    "acc": ("train/acc", "train/acc_mean", "acc/mean"),
    "entropy": ("actor/entropy", "train/entropy", "entropy"),
    "val_acc": ("val/acc", "val/accuracy", "val/acc_mean", "val_acc"),
    "reverse_kl": ("distill/reverse_kl",),  # on-policy distillation runs only
}


def _to_py(v: Any) -> Any:
    if hasattr(v, "item") and callable(v.item):
        try:
            v = v.item()
        except (ValueError, RuntimeError):
            v = v.tolist()
    if isinstance(v, bool) or v is None or isinstance(v, str):
        return v
    if isinstance(v, (int, float)):
        return v if math.isfinite(v) else None
    if isinstance(v, (list, tuple)):
        return [_to_py(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _to_py(x) for k, x in v.items()}
    return str(v)


def _fmt_eta(s: float) -> str:
    s = int(max(s, 0))
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{sec:02d}s"


class Tracker:
    def __init__(self, run_dir: str, total_steps: int | None = None,
                 use_tensorboard: bool = True, use_wandb: bool = False,
                 project: str | None = None, run_name: str | None = None,
                 config: dict | None = None, resume_step: int | None = None,
                 progress: bool = True, progress_keys: dict | None = None, stream=None):
        self.run_dir = run_dir
        os.makedirs(run_dir, exist_ok=True)
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self.total_steps = total_steps
        self.progress = progress
        self.progress_keys = dict(DEFAULT_PROGRESS_KEYS, **(progress_keys or {}))
        self.stream = stream if stream is not None else sys.stdout
        self._t0 = time.time()
        self._first_step: int | None = None
        self._last_val: dict[str, float] = {}
        if resume_step is not None and os.path.exists(self.path):
            self._truncate(resume_step)
        self._fh = open(self.path, "a", encoding="utf-8")
        self._tb = None
        self._wandb = None
        if use_tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(log_dir=os.path.join(run_dir, "tensorboard"))
            except Exception as e:  # ImportError when tensorboard is missing
                self._notice(f"TensorBoard disabled ({type(e).__name__}: {e})")
        if use_wandb:
            try:
                import wandb

                mode = os.environ.get("WANDB_MODE") or (
                    "online" if os.environ.get("WANDB_API_KEY") else "offline")
                self._wandb = wandb.init(project=project or "megatron_rl", name=run_name,
                                         dir=run_dir, config=config or {}, mode=mode,
                                         resume="allow")
            except Exception as e:
                self._notice(f"W&B disabled ({type(e).__name__}: {e})")

    def _notice(self, msg: str) -> None:
        print(f"[tracking] {msg}", file=self.stream, flush=True)

    def _truncate(self, resume_step: int) -> None:
        keep = []
        with open(self.path, encoding="utf-8") as f:
            for line in f:
                try:
                    if json.loads(line).get("step", -1) <= resume_step:
                        keep.append(line if line.endswith("\n") else line + "\n")
                except json.JSONDecodeError:
                    continue  # a line cut by a crash
        with open(self.path, "w", encoding="utf-8") as f:
            f.writelines(keep)

    def log(self, metrics: dict, step: int) -> dict:
        """Write one row for ``step``; returns the row written."""
        now = time.time()
        if self._first_step is None:
            self._first_step, self._t_first = step, now
        clean = {str(k): _to_py(v) for k, v in metrics.items()}
        row = {"step": int(step), "time": now, "wall_s": now - self._t0, **clean}
        self._fh.write(json.dumps(row) + "\n")
        self._fh.flush()
        scalars = {k: v for k, v in clean.items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if self._tb is not None:
            for k, v in scalars.items():
                self._tb.add_scalar(k, v, step)
            self._tb.flush()
        if self._wandb is not None:
            try:
                self._wandb.log(scalars, step=step)
            except Exception as e:  # never let W&B crash a run
                self._notice(f"W&B log failed, disabling ({e})")
                self._wandb = None
        if self.progress:
            print(self.progress_line(clean, step, now), file=self.stream, flush=True)
        return row

    def _pick(self, metrics: dict, name: str):
        for k in self.progress_keys.get(name, ()):
            v = metrics.get(k)
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                return v
        return None

    def progress_line(self, metrics: dict, step: int, now: float | None = None) -> str:
        now = time.time() if now is None else now
        total = f"/{self.total_steps}" if self.total_steps else ""
        parts = []
        for name in ("reward", "acc", "entropy", "val_acc", "reverse_kl"):
            v = self._pick(metrics, name)
            if v is None and name == "val_acc":
                v = self._last_val.get(name)  # validation runs every test_freq steps
            elif name == "val_acc" and v is not None:
                self._last_val[name] = v
            if v is not None:
                parts.append(f"{name} {v:.3f}")
        done = step - (self._first_step or step)
        if done > 0:
            per = (now - self._t_first) / done
            parts.append(f"{per:.2f} s/step")
            if self.total_steps:
                parts.append(f"ETA {_fmt_eta(per * (self.total_steps - step))}")
        return f"[step {step}{total}] " + " | ".join(parts)

    def close(self) -> None:
        if not self._fh.closed:
            self._fh.close()
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            try:
                self._wandb.finish()
            except Exception:
                pass
            self._wandb = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


_NVML_OK: bool | None = None


def gpu_stats() -> dict:
    """Per-GPU utilisation / memory / power via NVML (``nvidia-ml-py``); ``{}`` silently when
    NVML or a GPU is unavailable. Keys: ``gpu/<i>/util``, ``gpu/<i>/mem_used_gib``,
    ``gpu/<i>/mem_total_gib``, ``gpu/<i>/power_w``, ``gpu/<i>/temp_c``."""
    global _NVML_OK
    if _NVML_OK is False:
        return {}
    try:
        import pynvml

        if not _NVML_OK:
            pynvml.nvmlInit()
            _NVML_OK = True
        out = {}
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            util = pynvml.nvmlDeviceGetUtilizationRates(h)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            out[f"gpu/{i}/util"] = float(util.gpu)
            out[f"gpu/{i}/mem_used_gib"] = mem.used / 2**30
            out[f"gpu/{i}/mem_total_gib"] = mem.total / 2**30
            try:
                out[f"gpu/{i}/power_w"] = pynvml.nvmlDeviceGetPowerUsage(h) / 1000.0
                out[f"gpu/{i}/temp_c"] = float(
                    pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU))
            except Exception:
                pass
        return out
    except Exception:
        _NVML_OK = False
        return {}
