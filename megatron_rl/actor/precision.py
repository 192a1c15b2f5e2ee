"""Actor precision and memory options, all through megatron-core's own mechanisms.

- ``actor.precision``: ``bf16`` | ``fp16`` | ``fp32`` (default: ``bf16`` when CUDA is present,
  ``fp32`` on CPU). Half precision wraps the model in megatron's ``Float16Module`` (weights and
  activations in half precision), keeps fp32 main parameters in megatron's mixed-precision
  optimizer, accumulates and reduces gradients in fp32 (``grad_reduce_in_fp32``) and, for fp16,
  scales the loss dynamically. The last stage's hidden states stay in half precision
  (``fp32_output=False``) so the output head multiplies half-precision operands; the log-prob,
  entropy and loss math runs in fp32 (:mod:`megatron_rl.models.heads`).
- ``actor.recompute``: ``none`` | ``selective`` (core attention) | ``full`` (every layer),
  megatron's ``recompute_granularity`` / ``recompute_method`` / ``recompute_num_layers``.
- ``actor.offload_ref``: the frozen reference model's weights live on the CPU between reference
  passes (default on with CUDA).
"""

from __future__ import annotations

from typing import Any

import torch

PRECISIONS = ("bf16", "fp16", "fp32")
RECOMPUTE = ("none", "selective", "full")
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def validate_memory_fields(precision: str | None, recompute: str, offload_ref: bool | None,
                           error: type[Exception] = ValueError) -> None:
    """Raise ``error`` naming the field and its allowed values for a bad value."""
    if precision is not None and precision not in PRECISIONS:
        raise error(f"actor.precision={precision!r} is not one of {PRECISIONS} (or null for "
                    "bf16 with CUDA, fp32 on CPU)")
    if recompute not in RECOMPUTE:
        raise error(f"actor.recompute={recompute!r} is not one of {RECOMPUTE}")
    if offload_ref is not None and not isinstance(offload_ref, bool):
        raise error(f"actor.offload_ref={offload_ref!r} must be true, false or null")


def resolve_precision(precision: str | None) -> str:
    """``precision`` itself, or the default: bf16 when CUDA is usable, fp32 otherwise."""
    if precision is None:
        return "bf16" if torch.cuda.is_available() else "fp32"
    validate_memory_fields(precision, "none", None)
    return precision


def params_dtype(precision: str | None) -> torch.dtype:
    """The model weights' dtype for ``precision``."""
    return _DTYPES[resolve_precision(precision)]


def resolve_offload_ref(offload_ref: bool | None) -> bool:
    """``offload_ref`` itself, or the default: on when CUDA is usable."""
    return torch.cuda.is_available() if offload_ref is None else offload_ref


def recompute_overrides(recompute: str) -> dict[str, Any]:
    """``TransformerConfig`` fields for ``actor.recompute``."""
    validate_memory_fields(None, recompute, None)
    if recompute == "selective":
        return {"recompute_granularity": "selective", "recompute_modules": ["core_attn"]}
    if recompute == "full":
        return {"recompute_granularity": "full", "recompute_method": "uniform",
                "recompute_num_layers": 1}
    return {}


def set_precision(model: torch.nn.Module, precision: str | None) -> str:
    """Mark ``model``'s megatron config for ``precision`` (weights are cast by
    :func:`wrap_precision`); returns the resolved precision.

    The model is built and initialised (or loaded) in fp32 first, so a half-precision model holds
    exactly the rounded fp32 weights at every layout.
    """
    precision = resolve_precision(precision)
    cfg = model.config
    dtype = _DTYPES[precision]
    cfg.bf16, cfg.fp16 = precision == "bf16", precision == "fp16"
    cfg.params_dtype = cfg.pipeline_dtype = dtype  # P2P buffers of the pipeline schedule
    return precision


def apply_recompute(model: torch.nn.Module, recompute: str) -> None:
    """Switch megatron's activation recomputation on for a built model (``actor.recompute``)."""
    fields = recompute_overrides(recompute)
    cfg = model.config
    for k, v in fields.items():
        setattr(cfg, k, v)
    if recompute == "selective":  # read at construction by megatron's Attention
        for m in model.modules():
            if hasattr(m, "checkpoint_core_attention"):
                m.checkpoint_core_attention = True


def wrap_precision(model: torch.nn.Module) -> torch.nn.Module:
    """``Float16Module(model)`` when the model's config is bf16/fp16 (casts the weights in place:
    the wrapped module is ``model`` itself), else ``model``."""
    cfg = model.config
    if not (cfg.bf16 or cfg.fp16):
        return model
    from megatron.core.transformer.module import Float16Module

    return Float16Module(cfg, model)


def is_half_wrapped(model: torch.nn.Module) -> bool:
    """True when a ``Float16Module`` sits anywhere in the wrapper chain (DDP -> ... -> model)."""
    from megatron.core.transformer.module import Float16Module

    m = model
    while m is not None:
        if isinstance(m, Float16Module):
            return True
        m = getattr(m, "module", None)
    return False


def model_call_kwargs(model: torch.nn.Module) -> dict[str, Any]:
    """Keyword arguments for calling ``model``: keep half-precision hidden states on the last
    stage (the head takes them as they are) instead of megatron's default fp32 upcast."""
    return {"fp32_output": False} if is_half_wrapped(model) else {}


def bare_model(model: torch.nn.Module) -> torch.nn.Module:
    """The innermost module under DDP / ``Float16Module`` wrappers."""
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    return model


def move_module_(model: torch.nn.Module, device: torch.device | str) -> None:
    """Move ``model``'s parameters and buffers to ``device`` (the reference offload)."""
    model.to(device)
