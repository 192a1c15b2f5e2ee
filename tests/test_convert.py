"""HF <-> Megatron conversion and the Megatron -> HF weight stream (issue 5).

Tiny random ``transformers`` models are made at test time (nothing is downloaded). The slow tests
share three spawned jobs: the conversion runs at TP2xPP2 (4 gloo ranks, which also run the stream
checks), and the checkpoint it writes is loaded at TP1xPP1 and TP2xPP1.
"""

from __future__ import annotations

import glob
import json
import os
import shutil

import pytest
import torch

from megatron_rl.convert import ConvertError, convert_megatron_to_hf, merge_qkv, split_qkv
from megatron_rl.convert.hf_io import plan_shards
from megatron_rl.convert.hf_to_megatron import prepare
from megatron_rl.convert.registry import hf_config_dict, read_hf_config
from megatron_rl.convert.stream import bucketize
from megatron_rl.models.config import ModelConfig

transformers = pytest.importorskip("transformers")

ATOL = 1e-5
FAMILIES = ("qwen2", "qwen3", "llama")
BUCKET_BYTES = 40_000  # several buckets per stage; bigger tensors (embedding) go alone


# --- tiny HF checkpoints -----------------------------------------------------------------------
def make_hf_checkpoint(family: str, path: str, seed: int = 0) -> str:
    """Save a random tiny HF model of ``family`` (fp32, several safetensors shards)."""
    cls = {"qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config,
           "llama": transformers.LlamaConfig}[family]
    kw = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
              rope_theta=5000.0, rms_norm_eps=1e-5, initializer_range=0.1,
              tie_word_embeddings=family == "llama")
    if family == "qwen3":
        kw["head_dim"] = 32  # != hidden / heads, as in real Qwen3
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cls(**kw))
    with torch.no_grad():  # norms and biases away from their 1/0 init, so mapping errors show
        for name, p in model.named_parameters():
            if "norm" in name or "bias" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path, max_shard_size="100KB")
    return path


def read_safetensors_dir(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        out.update(load_file(f))
    return out


def tokens_for_test() -> torch.Tensor:
    return torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(7))


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("hf")
    return {f: make_hf_checkpoint(f, str(root / f), seed=i) for i, f in enumerate(FAMILIES)}


# --- fast: mapping ------------------------------------------------------------------------------
def test_qkv_interleave_order_and_inverse():
    cfg = ModelConfig(family="llama", hidden_size=4, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=1, vocab_size=8, intermediate_size=8)
    q = torch.tensor([[0.0], [1.0], [2.0], [3.0]])
    k = torch.tensor([[10.0], [11.0]])
    v = torch.tensor([[20.0], [21.0]])
    qkv = merge_qkv(q, k, v, cfg)
    assert qkv.flatten().tolist() == [0, 1, 10, 20, 2, 3, 11, 21]  # [q_g, k_g, v_g] per group
    for a, b in zip(split_qkv(qkv, cfg), (q, k, v), strict=True):
        assert torch.equal(a, b)
    bias = torch.arange(8.0)
    assert torch.equal(merge_qkv(*split_qkv(bias, cfg), cfg), bias)


def test_plan_shards_and_bucketize_respect_budget():
    assert plan_shards([3, 3, 3, 10, 1], 6) == [[0, 1], [2], [3], [4]]
    pairs = [(str(i), torch.zeros(n)) for i, n in enumerate([2, 2, 2, 9, 1])]  # fp32: 4 B each
    buckets = [[n for n, _ in b] for b in bucketize(pairs, 16)]
    assert buckets == [["0", "1"], ["2"], ["3"], ["4"]]


def test_hf_config_dict_reads_back(tmp_path):
    cfg = ModelConfig(family="qwen3", vocab_size=256, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=32, rope_theta=12345.0, tie_word_embeddings=True)
    (tmp_path / "config.json").write_text(json.dumps(hf_config_dict(cfg)))
    _, back, _ = read_hf_config(str(tmp_path))
    assert back.replace(attention_bias=None, qk_norm=None) == cfg
    hf = transformers.AutoConfig.from_pretrained(str(tmp_path), local_files_only=True)
    assert hf.head_dim == 32 and hf.tie_word_embeddings


def test_convert_subcommand_parses_both_directions():
    import argparse

    from megatron_rl.convert.cli import add_convert_subcommand, parse_size

    parser = argparse.ArgumentParser()
    add_convert_subcommand(parser.add_subparsers(dest="command"))
    a = parser.parse_args(["convert", "hf-to-megatron", "--hf-dir", "h", "--out", "o", "--tp", "2"])
    assert (a.direction, a.tp, a.pp, a.func.__name__) == ("hf-to-megatron", 2, 1,
                                                          "run_hf_to_megatron")
    b = parser.parse_args(["convert", "megatron-to-hf", "--ckpt", "c", "--out", "o",
                           "--max-shard-size", "5MiB", "--dtype", "bfloat16"])
    assert (b.max_shard_size, b.dtype, b.func.__name__) == (5 * 2**20, "bfloat16",
                                                             "run_megatron_to_hf")
    assert parse_size("2GB") == 2 * 10**9
    with pytest.raises(argparse.ArgumentTypeError, match="units"):
        parse_size("2 parsecs")


# --- fast: bad input ----------------------------------------------------------------------------
def _copy(src: str, dst) -> str:
    shutil.copytree(src, dst)
    return str(dst)


def _edit_tensors(path: str, edit) -> None:
    """Apply ``edit(dict)`` to every safetensors file of ``path`` and fix up the index."""
    from safetensors.torch import load_file, save_file

    index_path = os.path.join(path, "model.safetensors.index.json")
    index = json.load(open(index_path))
    for f in sorted(set(index["weight_map"].values())):
        tensors = load_file(os.path.join(path, f))
        edit(tensors, f)
        save_file(tensors, os.path.join(path, f), metadata={"format": "pt"})
        for name in tensors:
            index["weight_map"][name] = f
    names = set()
    for f in set(index["weight_map"].values()):
        names |= set(load_file(os.path.join(path, f)))
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if k in names}
    json.dump(index, open(index_path, "w"))


def test_unsupported_architecture_lists_supported(hf_dirs, tmp_path):
    d = _copy(hf_dirs["llama"], tmp_path / "m")
    cfg = json.load(open(os.path.join(d, "config.json")))
    cfg["architectures"], cfg["model_type"] = ["MistralForCausalLM"], "mistral"
    json.dump(cfg, open(os.path.join(d, "config.json"), "w"))
    with pytest.raises(ConvertError, match="MistralForCausalLM") as exc:
        prepare(d, None, 1, 1)
    for arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "LlamaForCausalLM"):
        assert arch in str(exc.value)


@pytest.mark.parametrize("field,value,match", [
    ("attention_bias", True, "attention_bias=True"),
    ("rope_parameters", {"rope_type": "llama3", "rope_theta": 1.0, "factor": 8.0}, "llama3"),
])
def test_unsupported_features_are_named(hf_dirs, tmp_path, field, value, match):
    d = _copy(hf_dirs["llama"], tmp_path / "m")
    cfg = json.load(open(os.path.join(d, "config.json")))
    cfg[field] = value
    json.dump(cfg, open(os.path.join(d, "config.json"), "w"))
    with pytest.raises(ConvertError, match=match):
        prepare(d, None, 1, 1)


def test_missing_tensor_is_named(hf_dirs, tmp_path):
    d = _copy(hf_dirs["qwen2"], tmp_path / "m")
    _edit_tensors(d, lambda t, f: t.pop("model.layers.2.self_attn.k_proj.bias", None))
    with pytest.raises(ConvertError, match=r"missing.*model\.layers\.2\.self_attn\.k_proj\.bias"):
        prepare(d, None, 1, 1)


def test_extra_tensor_is_named(hf_dirs, tmp_path):
    d = _copy(hf_dirs["qwen3"], tmp_path / "m")

    def add(t, f):
        if f.endswith("00001-of-" + f.split("-of-")[1]):
            t["model.layers.0.self_attn.mystery.weight"] = torch.zeros(2)
    _edit_tensors(d, add)
    with pytest.raises(ConvertError, match=r"unexpected.*model\.layers\.0\.self_attn\.mystery"):
        prepare(d, None, 1, 1)


def test_shape_mismatch_names_tensor_and_both_shapes(hf_dirs, tmp_path):
    d = _copy(hf_dirs["llama"], tmp_path / "m")
    name = "model.layers.1.mlp.down_proj.weight"

    def shrink(t, f):
        if name in t:
            t[name] = t[name][:, :100].contiguous()
    _edit_tensors(d, shrink)
    with pytest.raises(ConvertError) as exc:
        prepare(d, None, 1, 1)
    msg = str(exc.value)
    assert name in msg and "[64, 100]" in msg and "[64, 128]" in msg


def test_tp_must_divide_heads(hf_dirs, tmp_path):
    with pytest.raises(ConvertError, match="num_key_value_heads=2 is not divisible by "
                                           "tensor_parallel_size=4"):
        prepare(hf_dirs["qwen2"], None, 4, 1)
    d = _copy(hf_dirs["qwen3"], tmp_path / "m")
    cfg = json.load(open(os.path.join(d, "config.json")))
    cfg["num_attention_heads"] = cfg["num_key_value_heads"] = 6
    json.dump(cfg, open(os.path.join(d, "config.json"), "w"))
    with pytest.raises(ConvertError, match="num_attention_heads=6 is not divisible by "
                                           "tensor_parallel_size=4"):
        prepare(d, None, 4, 1)


# --- slow: spawned jobs -------------------------------------------------------------------------
def _build_and_load(ckpt: str, seed: int):
    from megatron_rl.convert.ckpt_format import read_sidecar
    from megatron_rl.convert.hf_to_megatron import load_megatron_checkpoint
    from megatron_rl.models.builder import build_gpt_model

    cfg = ModelConfig(**read_sidecar(ckpt)["model_config"])
    model = build_gpt_model(cfg, seed=seed)  # different random init, then overwritten
    load_megatron_checkpoint(model, ckpt)
    return model


def _collect_stream(model, broadcast_pp: bool) -> dict:
    from megatron_rl.convert.stream import iter_hf_weight_buckets

    tensors, sizes = {}, []
    for bucket in iter_hf_weight_buckets(model, BUCKET_BYTES, broadcast_pp=broadcast_pp):
        sizes.append((len(bucket), sum(t.numel() * t.element_size() for _, t in bucket)))
        for name, t in bucket:
            assert name not in tensors, f"{name} yielded twice"
            tensors[name] = t.clone()
    return {"tensors": tensors, "sizes": sizes}


def convert_tp2pp2_worker(hf_dirs: dict, out_root: str, tokens: torch.Tensor) -> dict:
    """TP2xPP2: convert each family, reload into a fresh model, logits, stream (both modes)."""
    from megatron.core import parallel_state as ps

    from megatron_rl.convert.hf_to_megatron import convert_rank
    from megatron_rl.convert.verify import megatron_logits
    from megatron_rl.parallel import runtime

    runtime.init_parallel(tp=2, pp=2, timeout_s=300)
    out = {"tp_rank": ps.get_tensor_model_parallel_rank(),
           "pp_rank": ps.get_pipeline_model_parallel_rank()}
    for family, hf_dir in hf_dirs.items():
        ckpt = os.path.join(out_root, family)
        convert_rank(hf_dir, ckpt)
        model = _build_and_load(ckpt, seed=123)
        out[family] = {"logits": megatron_logits(model, tokens),
                       "local": _collect_stream(model, broadcast_pp=False),
                       "broadcast": _collect_stream(model, broadcast_pp=True)}
    runtime.shutdown()
    return out


def load_logits_worker(ckpts: dict, tp: int, pp: int, tokens: torch.Tensor,
                       negative_hf_dir: str | None) -> dict:
    """Load each checkpoint at TPxPP and return last-stage logits; optionally the negative
    control (HF weights loaded with a plain [q; k; v] concatenation instead of the interleave)."""
    from megatron_rl.convert import common
    from megatron_rl.convert.hf_to_megatron import LazyCanonicalState, prepare
    from megatron_rl.convert.verify import megatron_logits
    from megatron_rl.models.builder import build_gpt_model
    from megatron_rl.models.weights import load_full_state_dict
    from megatron_rl.parallel import runtime

    runtime.init_parallel(tp=tp, pp=pp, timeout_s=300)
    out = {f: megatron_logits(_build_and_load(c, seed=7), tokens) for f, c in ckpts.items()}
    if negative_hf_dir is not None:
        _, cfg, _, ckpt, maps, _ = prepare(negative_hf_dir, None, tp, pp)
        common.merge_qkv = lambda q, k, v, _cfg: torch.cat([q, k, v], dim=0)
        model = build_gpt_model(cfg, seed=7)
        load_full_state_dict(model, LazyCanonicalState(ckpt, maps, cfg))
        out["negative"] = megatron_logits(model, tokens)
    runtime.shutdown()
    return out


@pytest.fixture(scope="module")
def converted(hf_dirs, tmp_path_factory) -> dict:
    from megatron_rl.convert.verify import hf_logits
    from megatron_rl.parallel.launch import spawn

    root = str(tmp_path_factory.mktemp("megatron"))
    tokens = tokens_for_test()
    ranks = spawn(convert_tp2pp2_worker, 4, (hf_dirs, root, tokens), timeout_s=380)
    ckpts = {f: os.path.join(root, f) for f in FAMILIES}
    return {"root": root, "ckpts": ckpts, "tokens": tokens, "tp2pp2": ranks,
            "hf": {f: hf_logits(d, tokens) for f, d in hf_dirs.items()}}


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return float((a - b).abs().max())


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_logits_match_hf_tp2pp2(converted):
    for family in FAMILIES:
        last = [r for r in converted["tp2pp2"] if r["pp_rank"] == 1]
        assert len(last) == 2
        for r in last:  # both TP ranks of the last stage hold the gathered logits
            assert _max_diff(r[family]["logits"], converted["hf"][family]) <= ATOL, family


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1)])
def test_logits_match_hf_other_layouts(converted, hf_dirs, tp, pp):
    """The checkpoint written at TP2xPP2 loads at TP1xPP1 / TP2xPP1 and matches HF; at TP1xPP1
    the negative control (wrong QKV layout) must fail the same check."""
    from megatron_rl.parallel.launch import spawn

    neg = hf_dirs["qwen2"] if tp == 1 else None
    res = spawn(load_logits_worker, tp * pp, (converted["ckpts"], tp, pp, converted["tokens"],
                                               neg), timeout_s=380)
    for family in FAMILIES:
        for r in res:
            assert _max_diff(r[family], converted["hf"][family]) <= ATOL, (family, tp, pp)
    if neg is not None:
        assert _max_diff(res[0]["negative"], converted["hf"]["qwen2"]) > 1e-2


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("family", FAMILIES)
def test_roundtrip_bit_exact_and_loads_in_transformers(converted, hf_dirs, tmp_path, family):
    from megatron_rl.convert.verify import hf_logits

    out = str(tmp_path / "hf")
    stats = convert_megatron_to_hf(converted["ckpts"][family], out, max_shard_bytes=60_000,
                                   log=lambda _m: None)
    assert len(stats["shards"]) > 1
    orig, back = read_safetensors_dir(hf_dirs[family]), read_safetensors_dir(out)
    assert sorted(orig) == sorted(back)
    for name in orig:
        assert orig[name].dtype == back[name].dtype and torch.equal(orig[name], back[name]), name
    assert os.path.isfile(os.path.join(out, "generation_config.json"))  # assets travel along
    assert torch.equal(hf_logits(out, converted["tokens"]), converted["hf"][family])


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_megatron_to_hf_distributed_ranks_split_the_shards(converted, tmp_path):
    ckpt = converted["ckpts"]["qwen3"]
    single, split = str(tmp_path / "one"), str(tmp_path / "two")
    convert_megatron_to_hf(ckpt, single, max_shard_bytes=60_000, log=lambda _m: None)
    mine = [convert_megatron_to_hf(ckpt, split, max_shard_bytes=60_000, rank=r, world_size=2,
                                   log=lambda _m: None)["shards"] for r in (0, 1)]
    assert mine[0] and mine[1] and not set(mine[0]) & set(mine[1])
    assert sorted(os.listdir(single)) == sorted(os.listdir(split))
    a, b = read_safetensors_dir(single), read_safetensors_dir(split)
    assert all(torch.equal(a[k], b[k]) for k in a) and sorted(a) == sorted(b)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_megatron_to_hf_rejects_a_config_that_does_not_fit(converted, hf_dirs, tmp_path):
    hf = json.load(open(os.path.join(hf_dirs["llama"], "config.json")))
    hf["intermediate_size"] = 96
    with pytest.raises(ConvertError, match=r"decoder\.layers\.mlp\.linear_fc1\.weight.*"
                                           r"\[4, 256, 64\].*\[4, 192, 64\]"):
        convert_megatron_to_hf(converted["ckpts"]["llama"], str(tmp_path / "x"), hf_config=hf)


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("family", FAMILIES)
def test_stream_tp2pp2_yields_exactly_the_hf_state_dict(converted, hf_dirs, family):
    expected = read_safetensors_dir(hf_dirs[family])
    ranks = converted["tp2pp2"]
    union: dict[str, torch.Tensor] = {}
    for r in ranks:
        local = r[family]["local"]
        for n_tensors, nbytes in local["sizes"]:
            assert nbytes <= BUCKET_BYTES or n_tensors == 1, (n_tensors, nbytes)
        if r["tp_rank"] == 0:
            assert not set(union) & set(local["tensors"]), "two stages yielded one tensor"
            union.update(local["tensors"])
        else:  # the other TP rank of the same stage yields the same tensors
            twin = next(x for x in ranks if x["pp_rank"] == r["pp_rank"] and x["tp_rank"] == 0)
            assert sorted(twin[family]["local"]["tensors"]) == sorted(local["tensors"])
    assert sorted(union) == sorted(expected)
    for name, t in expected.items():
        assert torch.equal(union[name], t), name
    assert len(ranks[0][family]["local"]["sizes"]) > 3  # the budget really split the stream
    for r in ranks:  # broadcast mode: every rank gets every tensor
        got = r[family]["broadcast"]
        assert sorted(got["tensors"]) == sorted(expected)
        assert all(torch.equal(got["tensors"][n], t) for n, t in expected.items())
        assert all(b <= BUCKET_BYTES or n == 1 for n, b in got["sizes"])
