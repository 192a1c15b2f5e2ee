"""Low-rank adapters (LoRA) on megatron-core's tensor-parallel linears.

megatron-core 0.16.1 has no LoRA module (``ColumnParallelLinear``'s ``disable_grad_reduce`` is the
only hook NeMo's adapters use), so the adapters live here. An adapter adds
``(alpha/rank) · x Aᵀ Bᵀ`` to the output of one linear whose weight ``W [out, in]`` is frozen:

- **column-parallel** (``linear_qkv``, ``linear_fc1``; ``W`` split by output rows): ``A [r, in]``
  is replicated on every TP rank and ``B [out/tp, r]`` split by output rows like ``W``. The rank's
  ``h = x Aᵀ`` passes through megatron's ``copy_to_tensor_model_parallel_region`` (identity
  forward, all-reduce of ``dL/dh`` over TP backward), so ``A``'s gradient and the input gradient
  are the full ones on every TP rank. The fused SwiGLU ``fc1`` has two B's (``lora_B_gate``,
  ``lora_B_up``), each split like its half of ``W``, so every tensor reshards by a plain slice.
- **row-parallel** (``linear_proj``, ``linear_fc2``; ``W`` split by input columns): ``A [r, in/tp]``
  is split by input columns like ``W``, ``B [out, r]`` replicated. The rank's partial product
  ``x_i A_iᵀ Bᵀ`` joins the rank's partial sum ``x_i W_iᵀ`` before the layer's all-reduce; ``B``
  passes through ``copy_to_tensor_model_parallel_region`` so its gradient is summed over TP.

The product is added inside the linear's ``_forward_impl`` (after the matmul, before megatron's
gather/all-reduce), replaced per instance. ``B = 0`` at initialisation (the LoRA paper), so the
adapted model equals the base model; ``A`` is drawn from a generator seeded by the tensor's
canonical name and sliced, so the initial adapters are the same at every TP/PP layout.
:func:`adapters_disabled` switches every adapter off (the base model, bit for bit: the product
is not added at all) — the free reference policy.

Names: an adapter is the submodule ``adapter`` of its linear; its canonical tensor names are the
linear's canonical prefix plus ``lora_A`` / ``lora_B`` (``lora_B_gate`` / ``lora_B_up`` for fc1),
e.g. ``decoder.layers.3.self_attention.linear_qkv.lora_A``: global layer ids, whole tensors.
:func:`megatron_rl.models.weights.iter_local_params` skips adapter parameters (the base weights
keep their names) and :func:`merged_shard` gives a base weight's shard with its adapter merged
(``W_i + (alpha/rank)·B_i A`` or ``W_i + (alpha/rank)·B A_i``: no full-size copy is made).
"""

from __future__ import annotations

import contextlib
import math
import zlib
from typing import Iterator

import torch

from megatron_rl.models.lora_config import LoraConfig
from megatron_rl.models.weights import (  # noqa: F401 - re-exported
    LORA_ATTR,
    canonical_name,
    is_lora_name,
    layer_offsets,
    merged_shard,
)

ADAPTER = "adapter"  # submodule name of an adapter on its linear (weights.is_lora_name)
_KIND = {"linear_qkv": "column", "linear_fc1": "column", "linear_proj": "row",
         "linear_fc2": "row"}


def _tp_group_of(linear: torch.nn.Module):
    from megatron.core import parallel_state as ps

    return getattr(linear, "tp_group", None) or ps.get_tensor_model_parallel_group()


def _uniform_a(name: str, rank: int, fan_in: int, seed: int) -> torch.Tensor:
    """The full canonical ``A [rank, fan_in]``: Kaiming-uniform with ``a = sqrt(5)`` (PEFT's
    default, bound ``1/sqrt(fan_in)``) from a generator seeded by ``(seed, name)``; on CPU."""
    g = torch.Generator().manual_seed((zlib.crc32(name.encode()) + 1000003 * seed) % 2**63)
    bound = 1.0 / math.sqrt(fan_in)
    return (torch.rand(rank, fan_in, generator=g, dtype=torch.float64) * 2 - 1).mul(bound).float()


class LoraAdapter(torch.nn.Module):
    """The adapter of one ``ColumnParallelLinear`` (``kind="column"``) or ``RowParallelLinear``
    (``kind="row"``); see the module docstring for the shapes and their TP split."""

    def __init__(self, linear: torch.nn.Module, kind: str, cfg: LoraConfig, canonical: str,
                 seed: int, fc1: bool = False) -> None:
        super().__init__()
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        group = _tp_group_of(linear)
        tp, tp_rank = group.size(), group.rank()
        w = linear.weight
        self.kind, self.rank, self.scaling, self.dropout = kind, cfg.rank, cfg.scaling, cfg.dropout
        self.canonical, self.fc1, self.enabled = canonical, fc1, True
        self.tp_group = group
        dev, dtype = w.device, w.dtype
        out_local, in_local = w.shape
        if kind == "column":
            a_full = _uniform_a(canonical + ".lora_A", cfg.rank, in_local, seed)
            self.lora_A = torch.nn.Parameter(a_full.to(device=dev, dtype=dtype))
            halves = ("lora_B_gate", "lora_B_up") if fc1 else ("lora_B",)
            for name in halves:
                b = torch.nn.Parameter(torch.zeros(out_local // len(halves), cfg.rank,
                                                   device=dev, dtype=dtype))
                set_tensor_model_parallel_attributes(b, True, 0, 1)
                setattr(self, name, b)
            self.b_names = halves
        else:
            a_full = _uniform_a(canonical + ".lora_A", cfg.rank, in_local * tp, seed)
            a = a_full.chunk(tp, dim=1)[tp_rank].contiguous()
            self.lora_A = torch.nn.Parameter(a.to(device=dev, dtype=dtype))
            set_tensor_model_parallel_attributes(self.lora_A, True, 1, 1)
            self.lora_B = torch.nn.Parameter(torch.zeros(out_local, cfg.rank, device=dev,
                                                         dtype=dtype))
            self.b_names = ("lora_B",)

    def b_matrix(self) -> torch.Tensor:
        """This rank's ``B`` ``[rows, r]`` in the base weight's local row order (fc1: ``[gate_i;
        up_i]``, as megatron's local fc1 shard)."""
        if len(self.b_names) == 1:
            return getattr(self, self.b_names[0])
        return torch.cat([getattr(self, n) for n in self.b_names], dim=0)

    def _drop(self, x: torch.Tensor) -> torch.Tensor:
        if self.dropout > 0 and self.training and torch.is_grad_enabled():
            return torch.nn.functional.dropout(x, self.dropout, training=True)
        return x

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        """The adapter's contribution to the linear's local output (``x``: the linear's local
        input ``[S, B, in_local]``; result ``[S, B, out_local]``, the partial sum's shape for a
        row-parallel layer). Autograd reduces what must be summed over TP."""
        from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

        x = self._drop(x)
        if self.kind == "column":
            h = torch.matmul(x, self.lora_A.t())
            h = copy_to_tensor_model_parallel_region(h, group=self.tp_group)
            return torch.matmul(h, self.b_matrix().t()) * self.scaling
        b = copy_to_tensor_model_parallel_region(self.lora_B, group=self.tp_group)
        return torch.matmul(torch.matmul(x, self.lora_A.t()), b.t()) * self.scaling

    @torch.no_grad()
    def merged(self, weight: torch.Tensor) -> torch.Tensor:
        """``weight + (alpha/rank)·B·A`` for this rank's shard (computed in fp32, returned in the
        weight's dtype; one shard-sized temporary). ``weight``: this rank's base shard."""
        delta = torch.matmul(self.b_matrix().float(), self.lora_A.float()) * self.scaling
        return (weight.float() + delta).to(weight.dtype)


def _wrap_forward_impl(linear: torch.nn.Module, adapter: LoraAdapter) -> None:
    """Make ``linear``'s ``_forward_impl`` (the local matmul, before megatron's all-reduce /
    gather) add the adapter's product when the adapter is enabled."""
    base_impl = linear._forward_impl

    def forward_impl(input, weight, *args, **kwargs):  # noqa: A002 - megatron's signature
        out = base_impl(input, weight, *args, **kwargs)
        if not adapter.enabled:
            return out
        return out + adapter.delta(input).to(out.dtype)

    linear._forward_impl = forward_impl


def _canonical_prefix(local: str, offsets: dict[int, int]) -> str:
    return canonical_name(local + ".weight", offsets)[: -len(".weight")]


def apply_lora(model: torch.nn.Module, cfg: LoraConfig, seed: int = 1234) -> list[LoraAdapter]:
    """Put adapters on the ``cfg.modules`` linears of this pipeline stage and freeze every other
    parameter. Returns the adapters (in module order). Must run before DDP wrapping."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    if getattr(getattr(model, "config", None), "num_moe_experts", None):
        raise ValueError("actor.lora: adapters on mixture-of-experts models are not supported "
                         "(dense models only)")
    offsets = layer_offsets(model)
    targets = []
    for name, mod in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if leaf not in cfg.modules or not name.startswith("decoder.layers."):
            continue
        want = ColumnParallelLinear if _KIND[leaf] == "column" else RowParallelLinear
        if not isinstance(mod, want):
            raise ValueError(f"actor.lora: {name} is a {type(mod).__name__}, not megatron's "
                             f"{want.__name__} (LoRA uses megatron's local layer spec)")
        targets.append((name, leaf, mod))
    for p in model.parameters():
        p.requires_grad_(False)
    adapters = []
    for name, leaf, mod in targets:
        ad = LoraAdapter(mod, _KIND[leaf], cfg, _canonical_prefix(name, offsets), seed,
                         fc1=leaf == "linear_fc1")
        mod.add_module(ADAPTER, ad)
        setattr(mod.weight, LORA_ATTR, ad)
        _wrap_forward_impl(mod, ad)
        adapters.append(ad)
    _input_requires_grad(model)
    model.lora_adapters = adapters
    model.lora_config = cfg
    return adapters


def _input_requires_grad(model: torch.nn.Module) -> None:
    """Make the first stage's embedding output require grad in training passes. With the base
    frozen it would not, and megatron's full recomputation (``tensor_parallel.checkpoint``, a
    reentrant autograd function) then gives its output no graph: the checkpointed layers'
    adapters would get no gradient. Later stages receive activations that require grad."""
    emb = getattr(model, "embedding", None)
    if emb is None:
        return

    def hook(_module, _inputs, output):
        if torch.is_grad_enabled() and isinstance(output, torch.Tensor) \
                and not output.requires_grad:
            return output.requires_grad_(True)
        return output

    emb.register_forward_hook(hook)


def adapters_of(model: torch.nn.Module) -> list[LoraAdapter]:
    """The adapters :func:`apply_lora` put on ``model`` (or the model it wraps); ``[]`` if none."""
    m = model
    while m is not None and not hasattr(m, "lora_adapters"):
        m = getattr(m, "module", None)
    return list(getattr(m, "lora_adapters", []) or [])


@contextlib.contextmanager
def adapters_disabled(model: torch.nn.Module) -> Iterator[None]:
    """Run ``model`` as its base model (every adapter off) inside the block."""
    adapters = adapters_of(model)
    states = [a.enabled for a in adapters]
    for a in adapters:
        a.enabled = False
    try:
        yield
    finally:
        for a, s in zip(adapters, states):
            a.enabled = s


def adapter_params(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Parameter,
                                                               LoraAdapter]]:
    """``(canonical name, parameter, adapter)`` of every adapter tensor on this stage."""
    for ad in adapters_of(model):
        yield ad.canonical + ".lora_A", ad.lora_A, ad
        for n in ad.b_names:
            yield f"{ad.canonical}.{n}", getattr(ad, n), ad


def split_dim(param: torch.Tensor) -> int | None:
    """The TP split dim of an adapter tensor, None when it is replicated."""
    if getattr(param, "tensor_model_parallel", False):
        return int(getattr(param, "partition_dim", 0))
    return None


def gather_adapters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Canonical full adapter tensors of this pipeline stage (all-gathered over TP; host fp32
    copies). Collective over TP."""
    import torch.distributed as dist

    out: dict[str, torch.Tensor] = {}
    for name, p, ad in adapter_params(model):
        dim = split_dim(p)
        tp = ad.tp_group.size()
        data = p.detach()
        if dim is not None and tp > 1:
            parts = [torch.empty_like(data) for _ in range(tp)]
            dist.all_gather(parts, data.contiguous(), group=ad.tp_group)
            data = torch.cat(parts, dim=dim)
        out[name] = data.float().cpu().clone()
    return out


def gather_full_adapters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every stage's canonical adapter tensors, on every rank of the model-parallel group."""
    from megatron_rl.models.weights import merge_pipeline_stages

    return merge_pipeline_stages(gather_adapters(model))


@torch.no_grad()
def load_adapters(model: torch.nn.Module, full: dict[str, torch.Tensor]) -> None:
    """Copy this rank's slices of canonical full adapter tensors into the model (no
    collective); every adapter tensor of this stage must be in ``full``."""
    for name, p, ad in adapter_params(model):
        if name not in full:
            raise KeyError(f"adapter tensor {name!r} is missing")
        t = full[name]
        dim = split_dim(p)
        if dim is not None and ad.tp_group.size() > 1:
            t = t.chunk(ad.tp_group.size(), dim=dim)[ad.tp_group.rank()]
        if tuple(t.shape) != tuple(p.shape):
            raise ValueError(f"adapter tensor {name!r}: shape {tuple(t.shape)} does not fit "
                             f"{tuple(p.shape)}")
        p.copy_(t.to(p.dtype))


def sharded_state_dict(model: torch.nn.Module, prefix: str = "model.") -> dict:
    """megatron ``ShardedTensor`` s of the adapter tensors only (canonical global names, so a
    checkpoint reshards across TP/PP/DP): the adapter-only model part of a LoRA checkpoint."""
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    dp_rank = ps.get_data_parallel_rank(with_context_parallel=True)
    out = {}
    for name, p, ad in adapter_params(model):
        dim = split_dim(p)
        tp, tp_rank = ad.tp_group.size(), ad.tp_group.rank()
        key = prefix + name
        if dim is None:
            out[key] = ShardedTensor.from_rank_offsets(key, p, replica_id=(0, tp_rank, dp_rank))
        else:
            out[key] = ShardedTensor.from_rank_offsets(key, p, (dim, tp_rank, tp),
                                                       replica_id=(0, 0, dp_rank))
    return out


def count_params(model: torch.nn.Module) -> tuple[int, int]:
    """``(trainable, frozen)`` parameter counts of this rank's stage."""
    train = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    return train, frozen
