"""Shared pieces of the Megatron <-> Hugging Face mapping: the tensor-map tables that each family
file declares, and the two re-layouts that are not plain copies.

Canonical names and layouts are those of :mod:`megatron_rl.models.weights` (local-spec names with
global layer indices, whole tensors). Two canonical tensors are fusions of several HF tensors:

- ``linear_qkv`` (weight ``[(nh + 2*ng)*d, H]``, bias ``[(nh + 2*ng)*d]``) is megatron's
  per-query-group interleave: for each KV group g, ``[q_g (nh/ng*d rows), k_g (d rows), v_g (d
  rows)]``; HF keeps ``q_proj [nh*d, H]``, ``k_proj [ng*d, H]``, ``v_proj [ng*d, H]``.
- ``linear_fc1.weight`` ``[2*ffn, H]`` is ``[gate; up]``; HF keeps ``gate_proj`` and ``up_proj``
  ``[ffn, H]`` each.

Everything else is a copy under another name.
"""

from __future__ import annotations

import resource
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from megatron_rl.models.config import ModelConfig

if TYPE_CHECKING:  # config validation reads the mappings here and stays torch-free
    import torch

COPY, QKV, FC1 = "copy", "qkv", "fc1"


class ConvertError(ValueError):
    """A checkpoint or config cannot be converted; the message names the tensor or field."""


@dataclass(frozen=True)
class TensorMap:
    """One canonical tensor and the HF tensor(s) it is made of (in fusion order)."""

    canonical: str
    hf: tuple[str, ...]
    kind: str = COPY


# --- the two fused layouts ------------------------------------------------------------------
def _qkv_dims(cfg: ModelConfig) -> tuple[int, int, int]:
    """``(groups, heads_per_group, head_dim)``."""
    ng = cfg.num_key_value_heads
    return ng, cfg.num_attention_heads // ng, cfg.kv_channels


def merge_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              cfg: ModelConfig) -> torch.Tensor:
    """HF ``q [nh*d, *]``, ``k, v [ng*d, *]`` -> megatron interleave ``[(nh+2ng)*d, *]``.

    Works for weights (``* = H``) and biases (no trailing dim).
    """
    import torch

    ng, hpg, d = _qkv_dims(cfg)
    rest = tuple(q.shape[1:])
    parts = (q.reshape(ng, hpg * d, *rest), k.reshape(ng, d, *rest), v.reshape(ng, d, *rest))
    return torch.cat(parts, dim=1).reshape(ng * (hpg + 2) * d, *rest)


def split_qkv(qkv: torch.Tensor, cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor,
                                                              torch.Tensor]:
    """Inverse of :func:`merge_qkv`: interleaved ``[(nh+2ng)*d, *]`` -> contiguous q, k, v."""
    import torch

    ng, hpg, d = _qkv_dims(cfg)
    rest = tuple(qkv.shape[1:])
    grouped = qkv.reshape(ng, (hpg + 2) * d, *rest)
    q, k, v = torch.split(grouped, [hpg * d, d, d], dim=1)
    return (q.reshape(ng * hpg * d, *rest).contiguous(), k.reshape(ng * d, *rest).contiguous(),
            v.reshape(ng * d, *rest).contiguous())


def merge_fc1(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """HF ``gate_proj, up_proj [ffn, H]`` -> megatron ``linear_fc1 [2*ffn, H]`` (``[gate; up]``)."""
    import torch

    return torch.cat([gate, up], dim=0)


def split_fc1(fc1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`merge_fc1` (contiguous, storage not shared)."""
    gate, up = fc1.chunk(2, dim=0)
    return gate.contiguous(), up.contiguous()


def to_canonical(tmap: TensorMap, tensors: Sequence[torch.Tensor],
                 cfg: ModelConfig) -> torch.Tensor:
    """Fuse the HF tensors of ``tmap`` (in ``tmap.hf`` order) into the canonical tensor."""
    if tmap.kind == QKV:
        return merge_qkv(*tensors, cfg)
    if tmap.kind == FC1:
        return merge_fc1(*tensors)
    (t,) = tensors
    return t


def to_hf(tmap: TensorMap, tensor: torch.Tensor, cfg: ModelConfig) -> list[tuple[str,
                                                                                 torch.Tensor]]:
    """Split a canonical tensor into its ``(hf_name, tensor)`` pieces."""
    if tmap.kind == QKV:
        pieces: Sequence[torch.Tensor] = split_qkv(tensor, cfg)
    elif tmap.kind == FC1:
        pieces = split_fc1(tensor)
    else:
        pieces = (tensor,)
    return list(zip(tmap.hf, pieces, strict=True))


# --- shapes implied by a config ---------------------------------------------------------------
def canonical_shape(name: str, cfg: ModelConfig) -> tuple[int, ...]:
    """Full canonical shape of ``name`` for ``cfg`` (layer index ignored)."""
    h, d, v = cfg.hidden_size, cfg.kv_channels, cfg.vocab_size
    nh, ng, ffn = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size
    suffix = name.split(".", 3)[-1] if name.startswith("decoder.layers.") else name
    if suffix.startswith("mlp.experts.local_experts."):  # one expert: its own FFN size
        ffn = cfg.moe_intermediate_size
        suffix = "mlp." + suffix.split(".", 4)[-1]
    shapes = {
        "embedding.word_embeddings.weight": (v, h), "output_layer.weight": (v, h),
        "decoder.final_layernorm.weight": (h,), "input_layernorm.weight": (h,),
        "pre_mlp_layernorm.weight": (h,),
        "self_attention.linear_qkv.weight": ((nh + 2 * ng) * d, h),
        "self_attention.linear_qkv.bias": ((nh + 2 * ng) * d,),
        "self_attention.linear_proj.weight": (h, nh * d),
        "self_attention.q_layernorm.weight": (d,), "self_attention.k_layernorm.weight": (d,),
        "mlp.linear_fc1.weight": (2 * ffn, h), "mlp.linear_fc2.weight": (h, ffn),
        "mlp.router.weight": (cfg.num_experts, h),
    }
    if suffix not in shapes:
        raise ConvertError(f"no shape rule for canonical tensor {name!r}")
    return shapes[suffix]


def hf_shapes(tmap: TensorMap, cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Expected shape of each HF tensor of ``tmap``."""
    full = canonical_shape(tmap.canonical, cfg)
    rest = full[1:]
    if tmap.kind == QKV:
        ng, hpg, d = _qkv_dims(cfg)
        rows = (ng * hpg * d, ng * d, ng * d)
        return {n: (r, *rest) for n, r in zip(tmap.hf, rows, strict=True)}
    if tmap.kind == FC1:
        return {n: (full[0] // 2, *rest) for n in tmap.hf}
    return {tmap.hf[0]: full}


# --- family tables ----------------------------------------------------------------------------
@dataclass(frozen=True)
class FamilyMapping:
    """Megatron <-> HF names of one model family.

    ``layer_tensors`` rows are ``(canonical suffix, HF suffixes, kind)`` relative to
    ``decoder.layers.{i}.`` and ``model.layers.{i}.``; ``global_tensors`` rows are full names.
    ``output`` is omitted when embeddings are tied (HF checkpoints do not store ``lm_head``).
    ``expert_tensors`` rows (MoE families) are relative to ``decoder.layers.{i}.mlp.experts.
    local_experts.{e}.`` and ``model.layers.{i}.mlp.experts.{e}.``, repeated for every expert e.
    """

    family: str
    model_type: str
    architectures: tuple[str, ...]
    layer_tensors: tuple[tuple[str, tuple[str, ...], str], ...]
    embedding: tuple[str, str] = ("embedding.word_embeddings.weight", "model.embed_tokens.weight")
    final_norm: tuple[str, str] = ("decoder.final_layernorm.weight", "model.norm.weight")
    output: tuple[str, str] = ("output_layer.weight", "lm_head.weight")
    expert_tensors: tuple[tuple[str, tuple[str, ...], str], ...] = ()

    def layer_maps(self, layer: int, num_experts: int = 0) -> list[TensorMap]:
        """Tensor maps of decoder layer ``layer`` (global, 0-based; ``num_experts`` per layer)."""
        maps = [TensorMap(f"decoder.layers.{layer}.{c}",
                          tuple(f"model.layers.{layer}.{h}" for h in hf), kind)
                for c, hf, kind in self.layer_tensors]
        for e in range(num_experts if self.expert_tensors else 0):
            maps += [TensorMap(f"decoder.layers.{layer}.mlp.experts.local_experts.{e}.{c}",
                               tuple(f"model.layers.{layer}.mlp.experts.{e}.{h}" for h in hf),
                               kind) for c, hf, kind in self.expert_tensors]
        return maps

    def tensor_maps(self, cfg: ModelConfig) -> list[TensorMap]:
        """All tensor maps of ``cfg`` in checkpoint order (embedding, layers, norm, head)."""
        maps = [TensorMap(self.embedding[0], (self.embedding[1],))]
        for i in range(cfg.num_hidden_layers):
            maps += self.layer_maps(i, cfg.num_experts)
        maps.append(TensorMap(self.final_norm[0], (self.final_norm[1],)))
        if not cfg.tie_word_embeddings:
            maps.append(TensorMap(self.output[0], (self.output[1],)))
        return maps


def require(hf: Mapping[str, Any], field: str, allowed: Sequence[Any], default: Any,
            arch: str) -> None:
    """Raise unless ``hf[field]`` (or ``default`` when absent) is one of ``allowed``."""
    val = hf.get(field, default)
    if val not in allowed:
        raise ConvertError(f"{arch}: config.json field {field}={val!r} is not supported "
                           f"(supported: {', '.join(repr(a) for a in allowed)})")


def peak_rss_bytes() -> int:
    """Peak resident set size of this process: ``VmHWM`` (reset by exec, unlike ``ru_maxrss``,
    which a spawned child inherits from its parent on Linux), else ``ru_maxrss``."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
