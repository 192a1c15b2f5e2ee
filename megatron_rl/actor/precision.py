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
- ``actor.offload_ref``: the frozen reference model's weights live in pinned host memory between
  reference passes and are copied into a kept device buffer for each pass (default on with
  CUDA; :class:`megatron_rl.actor.offload.FrozenModelOffload`).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from megatron_rl.actor.actor_config import (  # noqa: F401 - re-export
    PRECISIONS,
    RECOMPUTE,
    validate_memory_fields,
)

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


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


def precision_of(model: torch.nn.Module) -> str:
    """``bf16`` / ``fp16`` / ``fp32`` from a (wrapped) model's megatron config."""
    cfg = model.config
    return "bf16" if cfg.bf16 else "fp16" if cfg.fp16 else "fp32"


def main_param_pairs(optimizer) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
    """``(half-precision model param, its fp32 main param)`` of megatron's mixed-precision
    optimizer (empty for the fp32 optimizer, whose model params are the main params, and for the
    distributed optimizer, whose main params are DP shards: :func:`gather_distopt_main`)."""
    pairs: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
    for opt in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        for model_group, main_group in zip(getattr(opt, "float16_groups", []),
                                           getattr(opt, "fp32_from_float16_groups", [])):
            pairs += list(zip(model_group, main_group, strict=True))
    return pairs


def distributed_optimizers(optimizer) -> list:
    """The megatron ``DistributedOptimizer`` s in ``optimizer`` (empty for the standard one)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return [o for o in getattr(optimizer, "chained_optimizers", None) or [optimizer]
            if isinstance(o, DistributedOptimizer)]


def _half_params(buffer) -> list[torch.nn.Parameter]:
    return [p for p in buffer.param_index_map if p.dtype in (torch.bfloat16, torch.float16)]


def gather_distopt_state(optimizer, key: str = "param", half_only: bool = True
                         ) -> dict[int, torch.Tensor]:
    """``id(model param) -> full param-shaped fp32 tensor`` of the distributed optimizer's
    per-parameter ``key`` (``param``: the main weight; ``exp_avg``, ``exp_avg_sq``), assembled
    from the DP shards. Collective over DP (one all-reduce per grad buffer; every element has one
    owner, the others add exact zeros). ``half_only``: only bf16/fp16 model params."""
    out: dict[int, torch.Tensor] = {}
    for opt in distributed_optimizers(optimizer):
        for gbuf_idx, buffer in enumerate(opt.buffers):
            params = _half_params(buffer) if half_only else list(buffer.param_index_map)
            if not params:
                continue
            flat = torch.zeros(buffer.numel, dtype=torch.float32, device=buffer.grad_data.device)
            for (_dtype, buckets) in opt.gbuf_ranges[gbuf_idx].items():
                for bucket in buckets:
                    for p, ranges in bucket["param_map"].items():
                        world = ranges["gbuf_world"]
                        flat[world.start:world.end] = \
                            opt._get_main_param_and_optimizer_states(p)[key].detach().view(-1)
            torch.distributed.all_reduce(flat, group=opt.data_parallel_group)
            for p in params:
                start, end, _ = buffer.param_index_map[p]
                out[id(p)] = flat[start:end].view(p.shape)
    return out


def set_distopt_main(optimizer, full: Mapping[int, torch.Tensor]) -> None:
    """Copy this DP rank's shard of each full fp32 main weight in ``full`` (``id(model param)``
    keys) into the distributed optimizer's main params (no collective)."""
    with torch.no_grad():
        for opt in distributed_optimizers(optimizer):
            for model_group, main_group in zip(opt.model_float16_groups,
                                               opt.shard_fp32_from_float16_groups):
                for p, main in zip(model_group, main_group):
                    if id(p) in full:
                        r = opt._get_model_param_range_map(p)["param"]
                        main.copy_(full[id(p)].reshape(-1)[r.start:r.end])


def fresh_main_buffers(optimizer) -> dict[int, torch.Tensor]:
    """``id(half-precision model param) -> empty fp32 CPU tensor of its shape`` for the
    distributed optimizer: where a checkpoint load puts the full fp32 main weights before
    :func:`set_distopt_main` keeps this rank's shards."""
    return {id(p): torch.empty(p.shape, dtype=torch.float32)
            for opt in distributed_optimizers(optimizer) for buffer in opt.buffers
            for p in _half_params(buffer)}


def optimizer_main_tensors(optimizer, optimizer_sharded: Any) -> dict[int, torch.Tensor]:
    """``id(half-precision model param) -> fp32 main weight`` held by the distributed
    optimizer's ``fully_reshardable`` sharded state dict (already gathered over DP by megatron, so
    pointing the model part at them costs no memory). Its ``param_state`` is numbered in the order
    of the grad buffers' ``param_index_map`` (``sharded_param_state_fully_reshardable``)."""
    chain = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    out: dict[int, torch.Tensor] = {}
    for i, opt in enumerate(chain):
        if opt not in distributed_optimizers(opt):
            continue
        sd = optimizer_sharded if len(chain) == 1 else optimizer_sharded[i]
        params = [p for buffer in opt.buffers for p in buffer.param_index_map]
        for idx, p in enumerate(params):
            if p.dtype in (torch.bfloat16, torch.float16):
                out[id(p)] = sd["param_state"][idx]["param"].data
    return out


def main_param_map(optimizer) -> dict[int, torch.Tensor]:
    """``id(model param) -> fp32 main param`` (empty for fp32 actors). With the distributed
    optimizer the full main weights are gathered over DP (collective)."""
    if distributed_optimizers(optimizer):
        return gather_distopt_state(optimizer, "param")
    return {id(p): main for p, main in main_param_pairs(optimizer)}


def gather_main_state_dict(model: torch.nn.Module, optimizer) -> dict[str, torch.Tensor]:
    """The canonical full state dict of the fp32 main weights (collective, small models)."""
    from megatron_rl.models.weights import gather_full_state_dict

    return gather_full_state_dict(bare_model(model), main=main_param_map(optimizer))


def point_sharded_at_main(sharded: dict, optimizer,
                          mains: Mapping[int, torch.Tensor] | None = None) -> dict:
    """Make every ``ShardedTensor`` of a model sharded state dict whose data is a half-precision
    parameter refer to its fp32 main parameter instead (in place; returns ``sharded``). Saving
    then writes fp32 main weights; loading fills the main weights. ``mains``: ``id(param) ->
    fp32 tensor`` (default: :func:`main_param_map`)."""
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    mains = main_param_map(optimizer) if mains is None else mains

    def swap(x):
        # Factories (e.g. the gated MLP's fc1, split into gate/up) build their tensors from .data.
        if isinstance(x, (ShardedTensor, ShardedTensorFactory)) and x.data is not None \
                and x.data.dtype in (torch.bfloat16, torch.float16):
            main = mains.get(id(x.data))
            if main is not None:
                x.data = main
                if isinstance(x, ShardedTensor):
                    x.dtype = x.data.dtype
        return x

    if mains:
        dict_list_map_inplace(swap, sharded)
    return sharded


def copy_main_to_model(optimizer) -> None:
    """Re-round the half-precision weights from the fp32 main weights (after a load)."""
    with torch.no_grad():
        for p, main in main_param_pairs(optimizer):
            p.copy_(main)
