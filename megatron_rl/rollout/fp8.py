"""FP8 rollout weights: block-wise 128x128 e4m3 quantisation in the checkpoint format SGLang's
``fp8`` quantization loads (DeepSeek-V3 / Qwen3-FP8 block checkpoints).

Format (SGLang 0.5.21 ``srt/layers/quantization/fp8.py``, ``Fp8LinearMethod.create_weights``):
a quantised linear layer ``X`` is two tensors, ``X.weight`` ``[n, k]`` ``float8_e4m3fn`` and
``X.weight_scale_inv`` ``[ceil(n/128), ceil(k/128)]`` ``float32``, the scale of each 128x128
block such that ``weight ~= fp8 * scale_inv`` (a last partial block is padded with zeros for its
amax and cropped; SGLang's dequantisation, ``fp8_utils.block_quant_dequant``, repeats the scales
and crops the same way). ``config.json`` carries ``quantization_config = {"quant_method": "fp8",
"fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}``
(:func:`quantization_config`).

Scale format (``scale_fmt``):

- ``"float32"`` (default): ``scale_inv = amax / 448`` (amax clamped to 1e-4), the weight divided
  by it: bit for bit ``per_block_cast_to_fp8`` of ``sglang/benchmark/deepseek_utils.py``
  (DeepSeek-V3 / Qwen3-FP8 checkpoints). SGLang serves these as they are, except with the
  DeepGEMM runner (Hopper/Blackwell, ``should_deepgemm_weight_requant_ue8m0``), where it
  re-quantises the loaded blocks to UE8M0 itself after loading
  (``requant_block_scale_ue8m0_for_deepgemm``).
- ``"ue8m0"``: the scale rounded up to a power of two (``ceil_to_ue8m0``), stored as float32:
  bit for bit ``per_block_cast_to_fp8`` of ``srt/layers/quantization/fp8_utils.py`` (DeepGEMM's,
  what SGLang's own UE8M0 re-quantisation runs). The format of checkpoints whose
  ``quantization_config`` says ``"scale_fmt": "ue8m0"`` (DeepSeek-V3.1/V3.2): SGLang then also
  quantises activations with UE8M0 scales; a re-quantisation on its side is a no-op.

Which layers SGLang quantises: ``Fp8Config.get_quant_method`` returns an FP8 method for
``LinearBase`` (q/k/v/o, gate/up/down projections) and ``FusedMoE`` (routed experts) layers,
nothing for the rest: ``VocabParallelEmbedding`` (``embed_tokens``) and its subclass
``ParallelLMHead`` (``lm_head``), the norms (``RMSNorm``), and the MoE routers, built as
``ReplicatedLinear(..., quant_config=None)`` (``models/qwen2_moe.py``, ``qwen3_moe.py``: ``gate``,
``shared_expert_gate``). Biases of quantised layers stay in the model's dtype.
:func:`is_quantized` encodes that list on HF names.
"""

from __future__ import annotations

import contextlib
import re
import time
from typing import Iterable, Iterator

import torch

from megatron_rl.rollout.quant_choices import QUANTIZATIONS, SCALE_FMTS  # noqa: F401

BLOCK = (128, 128)
E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
FP8_DTYPE = torch.float8_e4m3fn
SCALE_SUFFIX = "_scale_inv"  # X.weight -> X.weight_scale_inv

Bucket = list[tuple[str, torch.Tensor]]

# linear layers of the HF checkpoints we write (Llama, Qwen2, Qwen3, Qwen3-MoE): attention
# projections, dense / shared-expert / routed-expert MLP projections; never the router
# ("mlp.gate.weight"), "shared_expert_gate", embeddings, lm_head, norms or biases
_QUANTIZED = re.compile(r"\.(self_attn\.[qkvo]_proj|mlp\.(experts\.\d+\.|shared_experts?\.)?"
                        r"(gate|up|down)_proj)\.weight$")


def is_quantized(name: str) -> bool:
    """Whether SGLang's ``fp8`` quantization serves the HF tensor ``name`` in FP8 (the module
    docstring's list): ``...self_attn.q_proj.weight`` yes, ``...mlp.gate.weight`` (router),
    ``embed_tokens``, ``lm_head``, norms and biases no."""
    return bool(_QUANTIZED.search(name))


def scale_name(name: str) -> str:
    """``X.weight`` -> ``X.weight_scale_inv`` (SGLang's parameter name)."""
    return name + SCALE_SUFFIX


def ceil_to_ue8m0(x: torch.Tensor) -> torch.Tensor:
    """The smallest power of two >= ``x`` (float32, exponent clamped to [1, 254]): DeepGEMM's
    ``ceil_to_ue8m0``. Same shape and device as ``x``."""
    bits = x.abs().float().view(torch.int32)
    exp = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return (exp.clamp(1, 254) << 23).view(torch.float32)


def _blocks(w: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """``w [n, k]`` as ``[N, bn, K, bk]`` blocks (N = ceil(n/bn), K = ceil(k/bk)); a view when
    both dims are multiples of the block, else a zero-padded copy of this one tensor."""
    n, k = w.shape
    bn, bk = block
    pn, pk = -n % bn, -k % bk
    if pn or pk:
        w = torch.nn.functional.pad(w, (0, pk, 0, pn))
    return w.view((n + pn) // bn, bn, (k + pk) // bk, bk)


def quantize_block_fp8(w: torch.Tensor, scale_fmt: str = "float32",
                       block: tuple[int, int] = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-wise FP8 of a 2-D weight ``w [n, k]`` (any float dtype, any device):
    ``(fp8 [n, k] float8_e4m3fn, scale_inv [ceil(n/bn), ceil(k/bk)] float32)``, both on ``w``'s
    device, computed in float32 as SGLang's reference functions (module docstring)."""
    if w.dim() != 2:
        raise ValueError(f"block FP8 quantises 2-D weights, got shape {tuple(w.shape)}")
    if scale_fmt not in SCALE_FMTS:
        raise ValueError(f"scale_fmt={scale_fmt!r} is not one of {SCALE_FMTS}")
    n, k = w.shape
    x = _blocks(w, block)
    # the max of |x| is exact in x's dtype: two contiguous-first reductions, then float32
    amax = x.abs().amax(dim=3, keepdim=True).amax(dim=1, keepdim=True).float().clamp(1e-4)
    if scale_fmt == "ue8m0":
        sf = ceil_to_ue8m0(amax / E4M3_MAX)
        q = (x * (1.0 / sf)).to(FP8_DTYPE)
    else:
        sf = amax / E4M3_MAX
        q = (x * (E4M3_MAX / amax)).to(FP8_DTYPE)
    q = q.view(x.shape[0] * block[0], x.shape[2] * block[1])[:n, :k].contiguous()
    return q, sf.view(x.shape[0], x.shape[2])


def dequantize_block_fp8(q: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype,
                         block: tuple[int, int] = BLOCK) -> torch.Tensor:
    """``q * scale_inv`` per block, cast to ``dtype`` (as SGLang's ``block_quant_dequant``):
    ``[n, k]`` on ``q``'s device."""
    n, k = q.shape[-2:]
    s = scale_inv.float().repeat_interleave(block[0], dim=-2).repeat_interleave(block[1], dim=-1)
    return (q.float() * s[..., :n, :k]).to(dtype)


def fp8_round_trip(w: torch.Tensor, scale_fmt: str = "float32") -> torch.Tensor:
    """What an FP8 server computes with for weight ``w``: quantised and dequantised, in ``w``'s
    dtype and device."""
    q, s = quantize_block_fp8(w, scale_fmt)
    return dequantize_block_fp8(q, s, w.dtype)


def quantize_bucket(bucket: Bucket, scale_fmt: str = "float32") -> Bucket:
    """``bucket`` with every :func:`is_quantized` weight replaced by its FP8 tensor followed by
    its ``weight_scale_inv`` (same bucket: a receiver pairs them without state across buckets);
    other tensors unchanged. One tensor at a time on its own device: no copy of the bucket."""
    out: Bucket = []
    for name, t in bucket:
        if is_quantized(name) and t.dim() == 2:
            q, s = quantize_block_fp8(t.detach(), scale_fmt)
            out += [(name, q), (scale_name(name), s)]
        else:
            out.append((name, t))
    return out


def quantize_buckets(buckets: Iterable[Bucket], scale_fmt: str = "float32",
                     timer=None) -> Iterator[Bucket]:
    """:func:`quantize_bucket` of every bucket as the stream yields it (the original bucket is
    dropped here before the next one is made: one bucket and its FP8 copy at a time, never a
    copy of the model); the seconds each bucket took go to ``timer.add_quant_time`` (CUDA: the
    stream is synchronised once per bucket, so the time is the kernels', not their launch)."""
    for bucket in buckets:
        t0 = time.perf_counter()
        out = quantize_bucket(bucket, scale_fmt)
        if out and out[0][1].is_cuda:
            torch.cuda.current_stream(out[0][1].device).synchronize()
        if timer is not None:
            timer.add_quant_time(time.perf_counter() - t0)
        del bucket
        yield out


def quantization_config(scale_fmt: str = "float32") -> dict:
    """``config.json``'s ``quantization_config`` of a block-FP8 checkpoint, as SGLang's
    ``Fp8Config.from_config`` reads it (``scale_fmt`` only for UE8M0)."""
    conf = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": list(BLOCK)}
    if scale_fmt == "ue8m0":
        conf["scale_fmt"] = "ue8m0"
    return conf


def write_quantization_config(model_dir: str, scale_fmt: str = "float32") -> None:
    """Add :func:`quantization_config` to ``model_dir/config.json`` (in place)."""
    import json
    import os

    path = os.path.join(model_dir, "config.json")
    with open(path) as f:
        conf = json.load(f)
    conf["quantization_config"] = quantization_config(scale_fmt)
    with open(path + ".tmp", "w") as f:
        json.dump(conf, f, indent=2)
    os.replace(path + ".tmp", path)


def wire_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a weight-group broadcast carries it: FP8 on CPU as its bytes (``uint8``, same
    storage: gloo has no FP8 type, so both ends of a gloo group view it so; real SGLang's
    receivers do not, and take FP8 only over NCCL); NCCL broadcasts FP8 itself."""
    return t.view(torch.uint8) if t.dtype == FP8_DTYPE and not t.is_cuda else t


def dequantize_pairs(items: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype
                     ) -> Iterator[tuple[str, torch.Tensor]]:
    """Receiver side: HF-named tensors with every FP8 ``X.weight`` + ``X.weight_scale_inv`` pair
    (any order within ``items``) replaced by the dequantised ``X.weight`` in ``dtype``; other
    tensors pass through. An FP8 weight or a scale without its partner raises ``ValueError``."""
    pending: dict[str, torch.Tensor] = {}
    for name, t in items:
        if name.endswith(SCALE_SUFFIX) or t.dtype == FP8_DTYPE:
            key = name[:-len(SCALE_SUFFIX)] if name.endswith(SCALE_SUFFIX) else name
            other = pending.pop(key, None)
            if other is None:
                pending[key] = t
                continue
            q, s = (other, t) if t.dtype == torch.float32 else (t, other)
            yield key, dequantize_block_fp8(q, s, dtype)
        else:
            yield name, t
    if pending:
        raise ValueError(f"FP8 weights without their weight_scale_inv (or scales without their "
                         f"weight) in one update: {sorted(pending)[:4]}")


@contextlib.contextmanager
def fp8_actor_weights(model: torch.nn.Module, scale_fmt: str = "float32") -> Iterator[None]:
    """Inside the block, every parameter of the live (sharded) Megatron ``model`` that holds a
    layer SGLang quantises holds what an FP8 server computes with: each of its HF tensors
    (:func:`megatron_rl.convert.common.to_hf`: fused QKV and fc1 split, TP shards all-gathered
    one parameter at a time) quantised and dequantised (:func:`fp8_round_trip`), fused and
    sharded back. The probe's expectation after an FP8 sync. Collective over the TP group (every
    TP rank of the stage must enter). The originals wait in host memory (this rank's quantised
    shards) and are copied back on exit, also after an error."""
    from megatron.core import parallel_state as ps

    from megatron_rl.convert.common import to_canonical, to_hf
    from megatron_rl.convert.registry import mapping_for
    from megatron_rl.convert.stream import gather_tp
    from megatron_rl.models.weights import (
        is_expert_name,
        iter_local_params,
        shard_for_rank,
        tp_info,
    )

    cfg = model.model_config
    index = {m.canonical: m for m in mapping_for(cfg).tensor_maps(cfg)}
    group = ps.get_tensor_model_parallel_group()
    tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    saved: list[tuple[torch.Tensor, torch.Tensor]] = []
    try:
        with torch.no_grad():
            for _, name, param in iter_local_params(model):
                tmap = index[name]
                if not any(is_quantized(h) for h in tmap.hf):
                    continue
                expert = is_expert_name(name)  # a whole expert on this rank (no TP split)
                full = param.detach() if expert else gather_tp(name, param, group)
                pieces = [fp8_round_trip(t, scale_fmt) if is_quantized(h) and t.dim() == 2
                          else t for h, t in to_hf(tmap, full, cfg)]
                canon = to_canonical(tmap, pieces, cfg)
                partitioned, dim = tp_info(param)
                local = canon if expert else shard_for_rank(name, canon, partitioned, dim, tp,
                                                            rank)
                saved.append((param, param.detach().to("cpu", copy=True)))
                param.detach().copy_(local)
        yield
    finally:
        with torch.no_grad():
            for param, host in saved:
                param.detach().copy_(host)
