"""SGLang's own block-FP8 functions on our tensors, run inside the SGLang venv
(:mod:`megatron_rl.testing.sglang_env`): ``python sglang_fp8_ref.py IN.pt OUT.pt``.

``IN.pt``: ``{"weights": {name: tensor}, "payload": {hf_name: tensor}, "attn": {...},
"mlp": {...}}``. ``OUT.pt``, for every weight: SGLang's float32-scale quantiser
(``sglang.benchmark.deepseek_utils.per_block_cast_to_fp8``), its UE8M0 quantiser
(``sglang.srt.layers.quantization.fp8_utils.per_block_cast_to_fp8``) and its dequantisation
(``fp8_utils.block_quant_dequant``) of both; for the payload (our FP8 ``q/k/v/o/gate/up/down``
tensors + ``weight_scale_inv``): the ``weight`` and ``weight_scale_inv`` parameters of SGLang's
``QKVParallelLinear``, ``MergedColumnParallelLinear`` and ``RowParallelLinear`` under its ``fp8``
config, filled by their own weight loaders (the path ``load_weights`` of SGLang's Qwen2/Llama
models takes), and SGLang's dequantisation of them.
"""

from __future__ import annotations

import sys

import torch


def reference(inp: dict) -> dict:
    """Everything ``OUT.pt`` holds (module docstring)."""
    from sglang.benchmark.deepseek_utils import per_block_cast_to_fp8 as cast_f32
    from sglang.srt.layers.quantization.fp8_utils import block_quant_dequant
    from sglang.srt.layers.quantization.fp8_utils import per_block_cast_to_fp8 as cast_ue8m0

    out: dict = {}
    for name, w in inp["weights"].items():
        for fmt, cast in (("float32", cast_f32), ("ue8m0", cast_ue8m0)):
            q, s = cast(w)
            out[f"{name}/{fmt}/q"], out[f"{name}/{fmt}/s"] = q, s
            out[f"{name}/{fmt}/deq"] = block_quant_dequant(q, s, [128, 128], w.dtype)
    out.update(load_payload(inp))
    return out


def load_payload(inp: dict) -> dict:
    """Our FP8 payload through SGLang's fp8 linear layers and their weight loaders."""
    from sglang.srt.runtime_context import get_parallel

    get_parallel().override_permanently(tp_size=1, tp_rank=0)
    from sglang.srt.layers.linear import (
        MergedColumnParallelLinear,
        QKVParallelLinear,
        RowParallelLinear,
    )
    from sglang.srt.layers.quantization.fp8 import Fp8Config
    from sglang.srt.layers.quantization.fp8_utils import block_quant_dequant

    p, a = inp["payload"], inp["attn"]
    cfg = Fp8Config.from_config(inp["quantization_config"])
    dt = torch.bfloat16
    hidden, hd, nh, nkv, ffn = a["hidden"], a["head_dim"], a["heads"], a["kv_heads"], a["ffn"]
    layers = {
        "qkv": QKVParallelLinear(hidden, hd, nh, nkv, bias=False, quant_config=cfg,
                                 params_dtype=dt, prefix="model.layers.0.self_attn.qkv_proj"),
        "o": RowParallelLinear(nh * hd, hidden, bias=False, quant_config=cfg, params_dtype=dt,
                               prefix="model.layers.0.self_attn.o_proj"),
        "gate_up": MergedColumnParallelLinear(hidden, [ffn, ffn], bias=False, quant_config=cfg,
                                              params_dtype=dt,
                                              prefix="model.layers.0.mlp.gate_up_proj"),
        "down": RowParallelLinear(ffn, hidden, bias=False, quant_config=cfg, params_dtype=dt,
                                  prefix="model.layers.0.mlp.down_proj"),
    }
    # (layer, HF module, shard id) as Qwen2ForCausalLM.load_weights's stacked_params_mapping
    feeds = [("qkv", "self_attn.q_proj", "q"), ("qkv", "self_attn.k_proj", "k"),
             ("qkv", "self_attn.v_proj", "v"), ("o", "self_attn.o_proj", None),
             ("gate_up", "mlp.gate_proj", 0), ("gate_up", "mlp.up_proj", 1),
             ("down", "mlp.down_proj", None)]
    for key, module, shard in feeds:
        layer = layers[key]
        for suffix in ("weight", "weight_scale_inv"):
            param = getattr(layer, suffix)
            t = p[f"model.layers.0.{module}.{suffix}"]
            if shard is None:
                param.weight_loader(param, t)
            else:
                param.weight_loader(param, t, shard)
    out = {}
    for key, layer in layers.items():
        out[f"load/{key}/weight"] = layer.weight.data.clone()
        out[f"load/{key}/weight_scale_inv"] = layer.weight_scale_inv.data.clone()
        out[f"load/{key}/deq"] = block_quant_dequant(layer.weight.data,
                                                     layer.weight_scale_inv.data, [128, 128], dt)
    return out


def main(argv: list[str]) -> int:
    inp = torch.load(argv[1])
    torch.save(reference(inp), argv[2])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
