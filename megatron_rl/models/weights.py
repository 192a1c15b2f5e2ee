"""Canonical full weights <-> this rank's tensor/pipeline shard of a megatron ``GPTModel``.

The canonical state dict is layout-free:

- names are the local-spec parameter names with **global** layer indices
  (``decoder.layers.7.mlp.linear_fc1.weight``), Transformer Engine names are mapped onto them;
- tensors are whole (never split by tensor parallelism);
- ``linear_fc1.weight`` is ``[gate; up]`` (``[2*ffn, H]``). megatron's tensor-parallel shard of the
  fused SwiGLU weight is ``[gate_r; up_r]``, so a plain slice of the local layout would mix gate and
  up rows across TP sizes; :func:`shard_for_rank` and :func:`gather_full_state_dict` re-layout it.
- ``linear_qkv`` keeps megatron's per-query-group interleave ``[q_g, k_g, v_g]`` for each group g;
  a contiguous slice of whole groups is the TP shard, so it needs no re-layout here.
- With tied embeddings only ``embedding.word_embeddings.weight`` is stored; the last stage's
  ``output_layer.weight`` (PP > 1) is loaded from it.
- Mixture-of-experts layers: expert ``e`` of layer ``L`` is
  ``decoder.layers.L.mlp.experts.local_experts.e.*`` with the **global** expert id ``e`` (an
  expert-parallel rank holds experts ``ep_rank * E/EP ...``); experts are never split by tensor
  parallelism (expert tensor parallel size 1). The router is ``decoder.layers.L.mlp.router.weight``
  ``[E, H]``. With grouped-GEMM experts (``model.moe_grouped_gemm``, megatron-core's
  ``TEGroupedMLP``) a layer holds local expert slot ``i`` as ``mlp.experts.linear_fc1.weight{i}`` /
  ``mlp.experts.linear_fc2.weight{i}``; :func:`expert_rest` maps both spellings onto the canonical
  one (and :func:`local_name` back), with the same tensor layout (``[gate; up]``, ``[H, ffn]``).

This is what lets the same weights run at TP1xPP1, TP2xPP2 or TP4 without re-initialising.
"""

from __future__ import annotations

import re
import zlib
from typing import Iterator, Mapping

import torch
import torch.distributed as dist

_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
_EXPERT_RE = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.*)$")
# megatron-core 0.16.1 transformer/moe/experts.py:512-575 (TEGroupedMLP.__init__) builds
# ``linear_fc1``/``linear_fc2`` as TEColumn/RowParallelGroupedLinear (extensions/
# transformer_engine.py:1459-1550, 1809-1900), subclasses of TE's ``GroupedLinear``, which registers
# one parameter per GEMM: ``weight{i}`` (``bias{i}`` with add_bias_linear) and one
# ``_extra_state`` per module (``_extra_state{i}`` appear only in sharded_state_dict keys,
# transformer_engine.py:1780).
_GROUPED_RE = re.compile(r"^mlp\.experts\.(linear_fc[12])\.(weight|bias)(\d+)$")
_PACKED_RE = re.compile(r"^mlp\.experts\.linear_fc[12]\.(weight|bias)$")
_ANY_EXPERT_RE = re.compile(
    r"\.mlp\.experts\.(local_experts\.\d+\.|linear_fc[12]\.(weight|bias)\d+$)")
_EXTRA_STATE_RE = re.compile(r"(^|\.)_extra_state\d*$")
_TE_TO_LOCAL = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
}
EMBEDDING = "embedding.word_embeddings.weight"
OUTPUT = "output_layer.weight"


class WeightsError(ValueError):
    """A state dict does not fit the model (missing/extra tensor, wrong shape)."""


def _layer_offsets(model: torch.nn.Module) -> dict[int, int]:
    """Local layer index -> global (0-based) layer index of this pipeline stage."""
    layers = getattr(getattr(model, "decoder", None), "layers", [])
    return {i: int(layer.layer_number) - 1 for i, layer in enumerate(layers)}


layer_offsets = _layer_offsets

# LoRA (megatron_rl.models.lora): adapter tensors live in a submodule ``adapter`` of their linear
# (names ``...linear_qkv.adapter.lora_A``; canonical ``...linear_qkv.lora_A``), and a base weight
# with an adapter carries it as ``param.mrl_lora``.
LORA_ATTR = "mrl_lora"


def is_lora_name(name: str) -> bool:
    """Whether a (local or canonical) parameter name is a LoRA adapter tensor."""
    return ".adapter.lora_" in name or ".lora_A" in name or ".lora_B" in name


def merged_shard(param: torch.Tensor) -> torch.Tensor:
    """A base parameter's local shard with its LoRA adapter merged, ``W_i + (alpha/r)·B·A`` on
    this rank's shard (:meth:`megatron_rl.models.lora.LoraAdapter.merged`); the parameter itself,
    detached, when it has no adapter or the adapter is off."""
    ad = getattr(param, LORA_ATTR, None)
    if ad is None or not ad.enabled:
        return param.detach()
    return ad.merged(param.detach())


def expert_rest(rest: str, shift: int, grouped: bool = False) -> str | None:
    """The one translation of a routed expert's in-layer tensor name (``rest`` follows
    ``decoder.layers.L.``); None when ``rest`` is not a routed expert's tensor.

    ``rest`` is either spelling: ``mlp.experts.local_experts.{i}.linear_fc1.weight``
    (SequentialMLP and canonical) or ``mlp.experts.linear_fc1.weight{i}`` (TEGroupedMLP). The
    result names expert ``i + shift`` in the SequentialMLP/canonical spelling, or with
    ``grouped`` in the TEGroupedMLP one. Local -> canonical: ``shift`` = this rank's first global
    expert id; canonical -> local: minus that."""
    e = _EXPERT_RE.match(rest)
    if e:
        idx, fc, kind = int(e.group(1)), *e.group(2).rsplit(".", 1)
    else:
        g = _GROUPED_RE.match(rest)
        if not g:
            return None
        fc, kind, idx = g.group(1), g.group(2), int(g.group(3))
    idx += shift
    if idx < 0:
        raise WeightsError(f"expert tensor {rest!r} shifted by {shift} has a negative id")
    if grouped:
        return f"mlp.experts.{fc}.{kind}{idx}"
    return f"mlp.experts.local_experts.{idx}.{fc}.{kind}"


def canonical_name(local_name: str, offsets: Mapping[int, int],
                   expert_offset: int = 0) -> str | None:
    """Canonical name of a local parameter name; None for parameters that are not stored
    (``_extra_state`` entries). ``expert_offset``: global id of this rank's first local expert."""
    if _EXTRA_STATE_RE.search(local_name):
        return None
    m = _LAYER_RE.match(local_name)
    if not m:
        return local_name
    idx, rest = int(m.group(1)), m.group(2)
    rest = _TE_TO_LOCAL.get(rest, rest)
    if _PACKED_RE.match(rest):
        raise WeightsError(f"{local_name}: one packed tensor for all local experts (Transformer "
                           "Engine's single_grouped_parameter) is not supported; grouped-GEMM "
                           "experts must expose one weight{i} per expert")
    rest = expert_rest(rest, expert_offset) or rest
    return f"decoder.layers.{offsets[idx]}.{rest}"


def local_name(name: str, offsets: Mapping[int, int], expert_offset: int = 0,
               num_local_experts: int | None = None, grouped: bool = False) -> str | None:
    """Inverse of :func:`canonical_name` for the local spec (norms keep their local names): the
    parameter name of canonical ``name`` on a rank whose stage holds ``offsets`` (local -> global
    layer) and experts ``expert_offset ...`` (+ ``num_local_experts``); ``grouped`` for
    TEGroupedMLP names. None when the tensor is not on this rank."""
    m = _LAYER_RE.match(name)
    if not m:
        return name
    local = {g: i for i, g in offsets.items()}.get(int(m.group(1)))
    if local is None:
        return None
    rest = m.group(2)
    e = _EXPERT_RE.match(rest)
    if e:
        slot = int(e.group(1)) - expert_offset
        if slot < 0 or (num_local_experts is not None and slot >= num_local_experts):
            return None
        rest = expert_rest(rest, -expert_offset, grouped)
    return f"decoder.layers.{local}.{rest}"


def is_expert_name(name: str) -> bool:
    """Whether a (local or canonical, SequentialMLP or TEGroupedMLP) parameter name is a routed
    expert's."""
    return bool(_ANY_EXPERT_RE.search(name))


def expert_id(name: str) -> int | None:
    """Global expert id of a canonical expert tensor name (None for other tensors)."""
    m = _LAYER_RE.match(name)
    e = _EXPERT_RE.match(m.group(2)) if m else None
    return int(e.group(1)) if e else None


def local_experts(model: torch.nn.Module) -> tuple[int, int]:
    """``(first global expert id, number of local experts)`` of this expert-parallel rank
    (``(0, 0)`` for a dense model)."""
    cfg = getattr(model, "config", None)
    n = getattr(cfg, "num_moe_experts", None) or 0
    if not n:
        return 0, 0
    from megatron.core import parallel_state as ps

    ep = ps.get_expert_model_parallel_world_size()
    return ps.get_expert_model_parallel_rank() * (n // ep), n // ep


def _is_fc1_weight(name: str) -> bool:
    return name.endswith("mlp.linear_fc1.weight")


def tp_info(param: torch.Tensor) -> tuple[bool, int]:
    """``(split by tensor parallelism, split dim)``. Routed experts are whole on every rank
    (expert tensor parallel size 1), whatever megatron's attributes say."""
    if getattr(param, "mrl_expert", False):
        return False, 0
    return bool(getattr(param, "tensor_model_parallel", False)), int(
        getattr(param, "partition_dim", 0))


def mark_expert_params(model: torch.nn.Module) -> None:
    """Tag routed-expert parameters (``param.mrl_expert = True``) for :func:`tp_info`."""
    for name, param in model.named_parameters():
        if is_expert_name(name):
            param.mrl_expert = True


def shard_for_rank(name: str, full: torch.Tensor, partitioned: bool, dim: int, tp: int,
                   rank: int) -> torch.Tensor:
    """This TP rank's slice of a canonical full tensor (fc1 re-laid out as ``[gate_r; up_r]``)."""
    if not partitioned or tp == 1:
        return full
    if _is_fc1_weight(name):
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp, dim=0)[rank], up.chunk(tp, dim=0)[rank]], dim=0)
    if full.shape[dim] % tp:
        raise WeightsError(f"{name}: dimension {dim} of shape {tuple(full.shape)} is not "
                           f"divisible by tensor_parallel_size={tp}")
    return full.chunk(tp, dim=dim)[rank]


def unshard(name: str, parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    if _is_fc1_weight(name):
        halves = [p.chunk(2, dim=0) for p in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(parts, dim=dim)


def _tied(model: torch.nn.Module) -> bool:
    return bool(getattr(model, "share_embeddings_and_output_weights", False))


def iter_local_params(model: torch.nn.Module) -> Iterator[tuple[str, str, torch.nn.Parameter]]:
    """Yield ``(local_name, canonical_name, param)`` for every stored parameter of this stage
    (LoRA adapter tensors excluded: :mod:`megatron_rl.models.lora`)."""
    offsets = _layer_offsets(model)
    first_expert, _ = local_experts(model)
    for local, param in model.named_parameters():
        if is_lora_name(local):  # adapters: megatron_rl.models.lora
            continue
        name = canonical_name(local, offsets, first_expert)
        if name is None:
            continue
        if name == OUTPUT and _tied(model):
            continue  # a copy of the embedding on the last stage; stored once as EMBEDDING
        yield local, name, param


def gather_stage_state_dict(model: torch.nn.Module, tp_group=None,
                            main: Mapping[int, torch.Tensor] | None = None
                            ) -> dict[str, torch.Tensor]:
    """Canonical full tensors of this pipeline stage (all-gathered over TP). Collective over TP.

    ``main`` maps ``id(param)`` to a tensor read instead of the parameter (the fp32 main weights
    of a bf16/fp16 actor, :func:`megatron_rl.actor.precision.main_param_map`). A weight with a
    LoRA adapter is read merged (``W + (alpha/rank)·B·A``, shard by shard)."""
    from megatron.core import parallel_state as ps

    tp_group = tp_group or ps.get_tensor_model_parallel_group()
    tp = dist.get_world_size(tp_group) if dist.is_initialized() else 1
    out: dict[str, torch.Tensor] = {}
    for _, name, param in iter_local_params(model):
        partitioned, dim = tp_info(param)
        data = main[id(param)].detach() if main and id(param) in main else merged_shard(param)
        if is_expert_name(name):
            out.update((n, t.cpu()) for n, t in gather_experts(model, name, data))
        elif partitioned and tp > 1:
            parts = [torch.empty_like(data) for _ in range(tp)]
            dist.all_gather(parts, data.contiguous(), group=tp_group)
            out[name] = unshard(name, parts, dim).cpu()
        else:
            out[name] = data.clone().cpu()
    return out


def gather_experts(model: torch.nn.Module, name: str, data: torch.Tensor
                   ) -> list[tuple[str, torch.Tensor]]:
    """``(canonical name, tensor)`` of the same local expert slot on every expert-parallel rank
    (global expert ids), in rank order. Collective over the expert-parallel group."""
    from megatron.core import parallel_state as ps

    first, n_local = local_experts(model)
    ep = ps.get_expert_model_parallel_world_size()
    if ep == 1:
        return [(name, data)]
    parts = [torch.empty_like(data) for _ in range(ep)]
    dist.all_gather(parts, data.contiguous(), group=ps.get_expert_model_parallel_group())
    slot = expert_id(name) - first
    prefix, rest = name.split(".mlp.experts.local_experts.", 1)
    rest = rest.split(".", 1)[1]
    return [(f"{prefix}.mlp.experts.local_experts.{r * n_local + slot}.{rest}", part)
            for r, part in enumerate(parts)]


def gather_full_state_dict(model: torch.nn.Module, main: Mapping[int, torch.Tensor] | None = None
                           ) -> dict[str, torch.Tensor]:
    """The whole model's canonical state dict, on every rank of the model-parallel group.

    Small-model helper (tests, the ``check`` command): stages exchange their tensors with
    ``all_gather_object``. Large models use the streaming iterator of the conversion tools.
    """

    return merge_pipeline_stages(gather_stage_state_dict(model, main=main))


def merge_pipeline_stages(stage: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every pipeline stage's ``stage`` dict merged, on every rank (``all_gather_object`` over
    the PP group: small host dicts only)."""
    from megatron.core import parallel_state as ps

    pp = ps.get_pipeline_model_parallel_world_size()
    if pp == 1:
        return stage
    stages: list = [None] * pp
    dist.all_gather_object(stages, stage, group=ps.get_pipeline_model_parallel_group())
    full: dict[str, torch.Tensor] = {}
    for s in stages:
        full.update(s)
    return full


def load_full_state_dict(model: torch.nn.Module, full: Mapping[str, torch.Tensor],
                         strict: bool = True) -> None:
    """Copy this rank's shard of canonical ``full`` weights into ``model`` (no collective).

    Raises :class:`WeightsError` naming the tensor for a missing tensor, a shape mismatch, or (with
    ``strict``) tensors of this stage's layers that the model does not have.
    """
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_world_size()
    rank = ps.get_tensor_model_parallel_rank()
    seen: set[str] = set()
    with torch.no_grad():
        for local, name, param in iter_local_params(model):
            seen.add(name)
            if name not in full:
                raise WeightsError(f"missing tensor {name!r} (model parameter {local!r})")
            partitioned, dim = tp_info(param)
            shard = shard_for_rank(name, full[name], partitioned, dim, tp, rank)
            if tuple(shard.shape) != tuple(param.shape):
                raise WeightsError(
                    f"shape mismatch for {name!r}: checkpoint shard {tuple(shard.shape)} (full "
                    f"{tuple(full[name].shape)}) vs model {tuple(param.shape)} at "
                    f"tensor_parallel_size={tp}")
            param.copy_(shard.to(param.dtype))
        if _tied(model) and getattr(model, "post_process", False) and not getattr(
                model, "pre_process", True):
            # PP > 1 with tied embeddings: the last stage holds its own copy of the embedding.
            out = model.output_layer.weight
            if EMBEDDING not in full:
                raise WeightsError(f"missing tensor {EMBEDDING!r} (tied output layer)")
            out.copy_(shard_for_rank(OUTPUT, full[EMBEDDING], True, 0, tp, rank).to(out.dtype))
    if strict:
        offsets = set(_layer_offsets(model).values())
        first, n_local = local_experts(model)
        mine = {n for n in full if _belongs_to_stage(n, model, offsets) and (
            expert_id(n) is None or first <= expert_id(n) < first + n_local)}
        extra = sorted(mine - seen)
        if extra:
            raise WeightsError(f"unexpected tensors for this model: {extra[:5]}"
                               f"{' ...' if len(extra) > 5 else ''}")


def _belongs_to_stage(name: str, model: torch.nn.Module, layer_ids: set[int]) -> bool:
    m = _LAYER_RE.match(name)
    if m:
        return int(m.group(1)) in layer_ids
    if name.startswith("embedding."):
        return bool(getattr(model, "pre_process", False))
    return bool(getattr(model, "post_process", False))


def full_shape(name: str, param: torch.Tensor, tp: int) -> tuple[int, ...]:
    """Canonical (unsharded) shape of a local parameter."""
    partitioned, dim = tp_info(param)
    shape = list(param.shape)
    if partitioned:
        shape[dim] *= tp
    return tuple(shape)


def canonical_init(name: str, shape: tuple[int, ...], std: float, num_layers: int,
                   seed: int) -> torch.Tensor:
    """Deterministic initial value of one canonical tensor, independent of the layout.

    Norm weights are 1, biases 0; output projections (``linear_proj``, ``linear_fc2``) use
    megatron's scaled init ``std / sqrt(2 * num_layers)``; every other weight is ``N(0, std)``. The
    generator is seeded from ``(seed, name)`` so each tensor is the same whatever stage or TP rank
    builds it.
    """
    if "norm" in name:
        return torch.ones(shape)
    if name.endswith(".bias"):
        return torch.zeros(shape)
    scale = std / (2.0 * num_layers) ** 0.5 if (
        "linear_proj" in name or "linear_fc2" in name) else std
    g = torch.Generator().manual_seed((zlib.crc32(name.encode()) + 1000003 * seed) % 2**63)
    return torch.randn(shape, generator=g) * scale


def init_layout_invariant(model: torch.nn.Module, std: float, seed: int) -> None:
    """Re-initialise ``model`` so that its weights are the same canonical weights at every layout.

    megatron's own init consumes one RNG stream in construction order, so a pipeline stage that
    skips earlier layers draws different numbers; this makes a seeded tiny model reproducible
    across TP/PP/DP (no collective; each rank makes only the tensors it holds).
    """
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_world_size()
    rank = ps.get_tensor_model_parallel_rank()
    num_layers = model.config.num_layers
    with torch.no_grad():
        for _, name, param in iter_local_params(model):
            full = canonical_init(name, full_shape(name, param, tp), std, num_layers, seed)
            partitioned, dim = tp_info(param)
            param.copy_(shard_for_rank(name, full, partitioned, dim, tp, rank))
        if _tied(model) and getattr(model, "post_process", False) and not getattr(
                model, "pre_process", True):
            out = model.output_layer.weight
            full = canonical_init(EMBEDDING, full_shape(EMBEDDING, out, tp), std, num_layers, seed)
            out.copy_(shard_for_rank(OUTPUT, full, True, 0, tp, rank))
