"""Input checks, kept out of the per-micro-batch path.

* :func:`check_shapes` reads only shapes and dtypes (host metadata, never a device value): cheap,
  call it anywhere.
* :func:`nonfinite_fields` returns sync-free device flags.
* :func:`assert_finite` turns those flags into a ``ValueError`` naming the bad fields. Reading the
  flags is **one host sync**: call it once per step (e.g. on the whole mini-batch before the
  micro-batch loop, or only when debugging), never inside the micro-batch loop.

Padding positions are ignored: NaN / inf there is allowed (losses mask with ``where``).
Empty mask (no valid token anywhere): every loss and metric is a well-defined 0 with zero gradient.
"""

from __future__ import annotations

import torch

from megatron_rl.loss.types import LossInputs

Tensor = torch.Tensor
_PER_TOKEN = ("logp", "old_logp", "advantages", "mask", "entropy", "old_entropy", "ref_logp",
              "cov_selected", "teacher_logp")


def check_shapes(inp: LossInputs) -> None:
    """Every per-token field is ``[B, T]`` like ``logp`` and floating fields are floating."""
    shape = tuple(inp.logp.shape)
    if len(shape) != 2:
        raise ValueError(f"LossInputs.logp must be [B, T], got shape {shape}")
    for name in _PER_TOKEN:
        t = getattr(inp, name)
        if t is None:
            continue
        if tuple(t.shape) != shape:
            raise ValueError(f"LossInputs.{name} has shape {tuple(t.shape)}; expected {shape} "
                             "(same as logp)")
        if name not in ("mask", "cov_selected") and not t.is_floating_point():
            raise ValueError(f"LossInputs.{name} must be floating point, got {t.dtype}")
    if inp.positive is not None and tuple(inp.positive.shape) != shape[:1]:
        raise ValueError(f"LossInputs.positive must be [B]={shape[:1]}, got "
                         f"{tuple(inp.positive.shape)}")


def nonfinite_fields(inp: LossInputs) -> dict[str, Tensor]:
    """``{field: 0-dim bool tensor}``, True where a valid token holds NaN/inf. No host sync."""
    m = inp.mask.bool()
    out = {}
    for name in ("logp", "old_logp", "advantages", "entropy", "old_entropy", "ref_logp",
                 "teacher_logp"):
        t = getattr(inp, name)
        if t is not None:
            out[name] = (~torch.isfinite(t.detach()) & m).any()
    return out


def assert_finite(inp: LossInputs) -> None:
    """Raise ``ValueError`` listing the fields with NaN/inf on valid tokens. ONE host sync."""
    flags = nonfinite_fields(inp)
    if not flags:
        return
    names = list(flags)
    bad_flags = torch.stack([flags[n] for n in names]).tolist()  # the single host sync
    bad = [n for n, b in zip(names, bad_flags, strict=True) if b]
    if bad:
        raise ValueError(f"non-finite values (NaN/inf) on valid tokens in LossInputs fields {bad}")
