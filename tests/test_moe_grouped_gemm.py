"""Grouped-GEMM experts (``model.moe_grouped_gemm``: megatron-core ``TEGroupedMLP``).

Transformer Engine is not installable on the CPU box, so the TE path itself runs only in the
``gpu`` test at the bottom (skipped "needs transformer_engine" without TE, even with
``MRL_REQUIRE_GPU=1``). The CPU tests pin what the TE path relies on:

* the names: ``TEGroupedMLP``'s parameter names are read from megatron-core's own source
  (the attributes its ``__init__`` builds, the per-GEMM keys its TE wrapper reads), then mapped
  to canonical names and back, with the expert offset of every expert-parallel rank;
* one 2-rank EP2 job with real SequentialMLP models: their canonical state dict re-keyed into
  grouped names and back loads into a fresh model and gathers bit-exactly; the local names
  :func:`~megatron_rl.models.weights.local_name` makes are the model's own names;
* load-time errors (dense model, TE missing) and the builder's refusal without TE.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re

import pytest
import torch

from megatron_rl.models.weights import (
    WeightsError,
    canonical_name,
    expert_id,
    expert_rest,
    is_expert_name,
    local_name,
)

PRESET = "tiny-qwen3-moe"  # 8 experts, 4 layers


def _mcore_file(*parts: str) -> str:
    spec = importlib.util.find_spec("megatron.core")
    return os.path.join(os.path.dirname(spec.origin), *parts)


def te_grouped_mlp_param_names(layer: int, num_local: int) -> list[str]:
    """The parameter (and ``_extra_state``) names of one ``TEGroupedMLP`` layer, derived from
    megatron-core's source: the ``self.<name> = build_module(submodules.<name>, ...)`` modules of
    ``TEGroupedMLP.__init__`` (transformer/moe/experts.py) and the per-GEMM state-dict keys
    ``full_state_dict[f"<key>{gemm_idx}"]`` its TE ``GroupedLinear`` wrapper reads
    (extensions/transformer_engine.py, ``TEGroupedLinear._sharded_state_dict_grouped``)."""
    tree = ast.parse(open(_mcore_file("transformer", "moe", "experts.py")).read())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "TEGroupedMLP")
    init = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    modules = [t.attr for n in ast.walk(init) if isinstance(n, ast.Assign)
               and isinstance(n.value, ast.Call) and getattr(n.value.func, "id", "") ==
               "build_module" and isinstance(n.value.args[0], ast.Attribute)
               and n.value.args[0].value.id == "submodules"
               for t in n.targets if isinstance(t, ast.Attribute)
               and t.attr == n.value.args[0].attr]
    te_src = open(_mcore_file("extensions", "transformer_engine.py")).read()
    keys = sorted(set(re.findall(r'full_state_dict\[f"(\w+)\{gemm_idx\}"\]', te_src)))
    assert 'full_state_dict["_extra_state"]' in te_src  # one extra state per TE module
    # activation_func is built only with use_te_activation_func (off here) and holds no weights
    modules = sorted(m for m in modules if m != "activation_func")
    assert modules == ["linear_fc1", "linear_fc2"] and keys == ["bias", "weight"], (modules, keys)
    # add_bias_linear=False for every supported family: weights only
    names = [f"decoder.layers.{layer}.mlp.experts.{m}.weight{i}"
             for m in modules for i in range(num_local)]
    return names + [f"decoder.layers.{layer}.mlp.experts.{m}._extra_state" for m in modules]


def test_grouped_names_map_to_canonical_with_ep_offsets():
    """EP2 of 8 experts on a stage holding global layers 2, 3: every rank's grouped slot i of
    either GEMM is canonical expert ``rank * 4 + i``; all ranks together cover each canonical
    expert tensor once; the inverse gives the grouped (and the SequentialMLP) name back."""
    offsets = {0: 2, 1: 3}
    n_local, ep = 4, 2
    seen: dict[str, str] = {}
    for rank in range(ep):
        first = rank * n_local
        for layer in offsets:
            for name in te_grouped_mlp_param_names(layer, n_local):
                canon = canonical_name(name, offsets, first)
                if name.endswith("_extra_state"):
                    assert canon is None and not is_expert_name(name)
                    continue
                assert is_expert_name(name) and is_expert_name(canon)
                slot = int(re.search(r"weight(\d+)$", name).group(1))
                fc = name.split(".")[5]
                assert canon == (f"decoder.layers.{offsets[layer]}.mlp.experts.local_experts."
                                 f"{first + slot}.{fc}.weight")
                assert expert_id(canon) == first + slot
                assert canon not in seen, (canon, seen.get(canon), name)
                seen[canon] = name
                assert local_name(canon, offsets, first, n_local, grouped=True) == name
                seq = f"decoder.layers.{layer}.mlp.experts.local_experts.{slot}.{fc}.weight"
                assert local_name(canon, offsets, first, n_local) == seq
                assert canonical_name(seq, offsets, first) == canon
                other = (1 - rank) * n_local  # the other rank does not hold this expert
                assert local_name(canon, offsets, other, n_local, grouped=True) is None
    assert len(seen) == 2 * 8 * 2  # layers x experts x GEMMs
    assert local_name("decoder.layers.0.mlp.router.weight", offsets) is None  # not this stage
    assert local_name("decoder.layers.3.mlp.router.weight", offsets) == \
        "decoder.layers.1.mlp.router.weight"
    assert expert_rest("mlp.experts.linear_fc2.bias3", 4) == \
        "mlp.experts.local_experts.7.linear_fc2.bias"
    assert expert_rest("mlp.router.weight", 4) is None
    with pytest.raises(WeightsError, match="single_grouped_parameter"):
        canonical_name("decoder.layers.0.mlp.experts.linear_fc1.weight", offsets)


def _roundtrip_worker() -> dict:
    from megatron.core import parallel_state as ps

    from megatron_rl.models.builder import build_gpt_model, transformer_engine_available
    from megatron_rl.models.config import get_preset
    from megatron_rl.models.weights import (
        _layer_offsets,
        gather_full_state_dict,
        load_full_state_dict,
        local_experts,
    )
    from megatron_rl.parallel import runtime

    runtime.init_parallel(tp=1, pp=1, ep=2, timeout_s=120)
    cfg = get_preset(PRESET)
    build_error = ""
    if not transformer_engine_available():  # the builder refuses rather than fall back
        try:
            build_gpt_model(cfg.replace(moe_grouped_gemm=True), seed=3)
        except RuntimeError as exc:
            build_error = str(exc)
    model = build_gpt_model(cfg, seed=3)
    full = gather_full_state_dict(model)
    offsets = _layer_offsets(model)
    first, n_local = local_experts(model)
    own = sorted(n for n, _ in model.named_parameters())
    # canonical -> local names of this rank (SequentialMLP): exactly the model's own names
    mine = sorted(filter(None, (local_name(c, offsets, first, n_local) for c in full)))
    # canonical -> grouped local names of this rank -> canonical again, tensors untouched
    grouped = {g: t for c, t in full.items()
               if (g := local_name(c, offsets, first, n_local, grouped=True)) is not None}
    back = {canonical_name(g, offsets, first): t for g, t in grouped.items()}
    ranks: list = [None] * 2
    torch.distributed.all_gather_object(ranks, back, group=ps.get_expert_model_parallel_group())
    rebuilt = {k: v for r in ranks for k, v in r.items()}
    fresh = build_gpt_model(cfg, seed=11)
    changed = any(not torch.equal(a, b) for a, b in zip(fresh.parameters(), model.parameters()))
    load_full_state_dict(fresh, rebuilt)
    again = gather_full_state_dict(fresh)
    out = {"own": own, "mine": mine, "full_keys": sorted(full), "rebuilt_keys": sorted(rebuilt),
           "bitexact": all(torch.equal(full[k], again[k]) for k in full) and
           sorted(again) == sorted(full),
           "changed": changed,
           "grouped_experts": sorted(g for g in grouped if is_expert_name(g))[:3],
           "first": first, "te": transformer_engine_available(), "build_error": build_error}
    runtime.shutdown()
    return out


def test_sequential_state_dict_through_grouped_names_is_bit_exact():
    from megatron_rl.parallel.launch import spawn

    ranks = spawn(_roundtrip_worker, 2, (), timeout_s=300)
    for rank, r in enumerate(ranks):
        assert r["first"] == 4 * rank
        assert r["mine"] == r["own"]
        assert r["rebuilt_keys"] == r["full_keys"]
        assert r["changed"] and r["bitexact"]  # the fresh model differed before the load
        assert r["grouped_experts"][0] == "decoder.layers.0.mlp.experts.linear_fc1.weight0"
        if not r["te"]:
            assert "model.moe_grouped_gemm=true needs Transformer Engine" in r["build_error"]


def test_grouped_gemm_is_checked_at_load():
    from megatron_rl.config.errors import ConfigError
    from megatron_rl.config.load import load_config
    from megatron_rl.models.builder import moe_kwargs, transformer_engine_importable
    from megatron_rl.models.config import ModelConfigError, get_preset

    with pytest.raises(ConfigError, match=r"model.moe_grouped_gemm=true needs a mixture"):
        load_config(None, ["model.moe_grouped_gemm=true"])
    with pytest.raises(ModelConfigError, match=r"model.moe_grouped_gemm=true needs a mixture"):
        get_preset("tiny").replace(moe_grouped_gemm=True)
    cfg = get_preset(PRESET)
    assert moe_kwargs(cfg.replace(moe_grouped_gemm=True), 2)["moe_grouped_gemm"] is True
    assert moe_kwargs(cfg, 2)["moe_grouped_gemm"] is False
    moe = ["model.preset=tiny-qwen3-moe", "model.moe_grouped_gemm=true"]
    if transformer_engine_importable():
        assert load_config(None, moe).model.moe_grouped_gemm
    else:
        with pytest.raises(ConfigError, match=r"model.moe_grouped_gemm=true needs Transformer "
                                              r"Engine .*gpu extra"):
            load_config(None, moe)


def _te_available() -> bool:
    from megatron_rl.models.builder import transformer_engine_importable

    return transformer_engine_importable()


def _te_worker() -> dict:
    from megatron.core.transformer.moe.experts import SequentialMLP, TEGroupedMLP

    from megatron_rl.convert.stream import iter_hf_weight_buckets
    from megatron_rl.convert.verify import megatron_logits
    from megatron_rl.models.builder import build_gpt_model
    from megatron_rl.models.config import get_preset
    from megatron_rl.models.weights import gather_full_state_dict
    from megatron_rl.parallel import runtime

    runtime.init_parallel(tp=1, pp=1, timeout_s=300)
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(5))
    out = {}
    for grouped in (True, False):
        cfg = get_preset(PRESET).replace(moe_grouped_gemm=grouped)
        model = build_gpt_model(cfg, torch.bfloat16, seed=0)  # same canonical weights
        kinds = {type(m).__name__ for n, m in model.named_modules() if n.endswith("mlp.experts")}
        assert kinds == {(TEGroupedMLP if grouped else SequentialMLP).__name__}, kinds
        with torch.no_grad():
            logits = megatron_logits(model, tokens).cpu()
        stream = {n: t.detach().cpu().clone()
                  for b in iter_hf_weight_buckets(model, 2**20) for n, t in b}
        out[grouped] = {"logits": logits, "stream": stream,
                        "canonical": gather_full_state_dict(model)}
    runtime.shutdown()
    return out


@pytest.mark.gpu
@pytest.mark.skipif(not _te_available(), reason="needs transformer_engine")
def test_te_grouped_gemm_matches_sequential_mlp():
    """A tiny Qwen3-MoE with TEGroupedMLP experts and one with SequentialMLP experts (both the
    TE spec, bf16), built from the same canonical weights: same canonical state dict and weight
    stream (bit-exact), same logits to bf16 tolerance (grouped vs per-expert GEMMs)."""
    from megatron_rl.parallel.launch import spawn

    (out,) = spawn(_te_worker, 1, (), timeout_s=600)
    g, s = out[True], out[False]
    assert sorted(g["canonical"]) == sorted(s["canonical"])
    assert all(torch.equal(g["canonical"][k], s["canonical"][k]) for k in g["canonical"])
    assert sorted(g["stream"]) == sorted(s["stream"])
    assert any(".mlp.experts.7." in n for n in g["stream"])
    assert all(torch.equal(g["stream"][k], s["stream"][k]) for k in g["stream"])
    gap = (g["logits"] - s["logits"]).abs().max() / s["logits"].abs().max()
    assert gap < 2e-2, f"grouped vs sequential logits differ by {gap:.3g} (relative max)"
