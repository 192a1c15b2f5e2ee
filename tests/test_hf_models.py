"""Real models in and out (issue 11): a Hugging Face directory as the model (each rank reads only
its own shard), its tokenizer and chat template, DAPO-Math-style Parquet data, HF exports whose
logits equal the actor's.

Tiny random Qwen2 (untied) and Qwen3 (tied embeddings) directories are made at test time with
:mod:`megatron_rl.testing.tiny_hf` (sharded safetensors, a byte-level BPE tokenizer trained in about
a second, a ChatML template); nothing is downloaded. The slow tests share two jobs: one 4-rank
TP2xPP2 load job (HF directory and converted checkpoint), and one TP2xPP2 training run through the
CLI whose checkpoint export is compared with the actor loaded from the same checkpoint.
"""

from __future__ import annotations

import glob
import json
import os

import pytest
import torch

from megatron_rl.config.errors import ConfigError
from megatron_rl.config.load import load_config
from megatron_rl.convert.common import to_canonical
from megatron_rl.convert.hf_io import HFCheckpoint
from megatron_rl.convert.model_source import (
    HFShardSource,
    assemble_shard,
    model_config,
    shard_reads,
)
from megatron_rl.convert.registry import mapping_for
from megatron_rl.data.tokenizer import HFTokenizer, TokenizerError, check_vocab_fits
from megatron_rl.models.weights import shard_for_rank

transformers = pytest.importorskip("transformers")
pytest.importorskip("pyarrow")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ATOL = 2e-5


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, dict[str, str]]:
    from megatron_rl.testing.tiny_hf import make_tiny_hf

    root = tmp_path_factory.mktemp("tiny_hf")
    return {"qwen2": make_tiny_hf(str(root / "qwen2"), "qwen2", rows=48, seed=0),
            "qwen3": make_tiny_hf(str(root / "qwen3"), "qwen3", rows=48, seed=1,
                                  tie_word_embeddings=True)}


def _cfg(*overrides: str):
    return load_config(None, list(overrides))


# --- fast: model source, config checks ----------------------------------------------------------
def test_model_config_from_hf_dir_and_padded_vocab(tiny):
    cfg = model_config(_cfg(f"model.hf_path={tiny['qwen2']['model']}").model)
    hf = json.load(open(os.path.join(tiny["qwen2"]["model"], "config.json")))
    assert cfg.family == "qwen2" and cfg.vocab_size == hf["vocab_size"] == 320
    assert cfg.hidden_size == 64 and not cfg.tie_word_embeddings
    tok = HFTokenizer(tiny["qwen2"]["model"])
    assert tok.vocab_size < cfg.vocab_size  # padded model vocab holds every tokenizer id
    q3 = model_config(_cfg(f"model.hf_path={tiny['qwen3']['model']}").model)
    assert q3.family == "qwen3" and q3.tie_word_embeddings and q3.kv_channels == 32


def test_unsupported_architecture_is_a_clear_config_error(tiny, tmp_path):
    d = tmp_path / "mistral"
    d.mkdir()
    hf = json.load(open(os.path.join(tiny["qwen2"]["model"], "config.json")))
    hf.update(architectures=["MistralForCausalLM"], model_type="mistral")
    (d / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ConfigError, match=r"model.hf_path.*MistralForCausalLM.*supported: "
                                          r"LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM"):
        _cfg(f"model.hf_path={d}")
    with pytest.raises(ConfigError, match="model.hf_path=.* is not a directory"):
        _cfg(f"model.hf_path={tmp_path / 'nope'}")


def test_exactly_one_model_source(tiny):
    with pytest.raises(ConfigError, match="exactly one of model.preset, model.hf_path, "
                                          "model.megatron_ckpt.*preset, hf_path"):
        _cfg("model.preset=tiny", f"model.hf_path={tiny['qwen2']['model']}")
    assert _cfg().model.preset is None and model_config(_cfg().model).vocab_size == 256


def test_layout_and_missing_tensor_checked_at_load_time(tiny, tmp_path):
    with pytest.raises(ConfigError, match="num_key_value_heads=2 is not divisible by "
                                          "tensor_parallel_size=4"):
        _cfg(f"model.hf_path={tiny['qwen2']['model']}", "parallel.tp=4")
    # a directory whose index names a tensor that no shard holds
    src = tiny["qwen2"]["model"]
    d = tmp_path / "broken"
    d.mkdir()
    for f in os.listdir(src):
        if not f.startswith("model-00001-") and not f.endswith(".json"):
            os.symlink(os.path.join(src, f), d / f)
    (d / "config.json").write_text(open(os.path.join(src, "config.json")).read())
    with pytest.raises(ConfigError, match="model.hf_path: .*missing"):
        _cfg(f"model.hf_path={d}")


_TP_DIM = {"embedding.word_embeddings.weight": 0, "output_layer.weight": 0, "linear_qkv": 0,
           "linear_fc1": 0, "linear_proj": 1, "linear_fc2": 1}


def _tp_dim(name: str) -> int | None:
    return next((d for k, d in _TP_DIM.items() if k in name), None)


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
@pytest.mark.parametrize("tp", [1, 2])
def test_shard_reads_equal_slices_of_canonical_tensors(tiny, family, tp):
    """Each TP rank's slices, assembled, equal megatron's TP shard of the canonical tensor."""
    cfg = model_config(_cfg(f"model.hf_path={tiny[family]['model']}").model)
    src = HFShardSource(tiny[family]["model"], cfg)
    ckpt = HFCheckpoint(tiny[family]["model"])
    for tmap in mapping_for(cfg).tensor_maps(cfg):
        full = to_canonical(tmap, [ckpt.get(n) for n in tmap.hf], cfg)
        dim = _tp_dim(tmap.canonical)
        for rank in range(tp):
            before = src.bytes_read
            pieces = [src.read(r) for r in shard_reads(tmap, cfg, dim is not None, dim or 0,
                                                       tp, rank)]
            local = assemble_shard(tmap, pieces, cfg, tp if dim is not None else 1)
            want = shard_for_rank(tmap.canonical, full, dim is not None, dim or 0, tp, rank)
            assert torch.equal(local, want), (tmap.canonical, tp, rank)
            assert src.bytes_read - before == want.numel() * want.element_size()


# --- fast: tokenizer, datasets, rewards ---------------------------------------------------------
def test_tokenizer_chat_template_eos_pad_and_vocab_check(tiny):
    from megatron_rl.run.setup import make_tokenizer

    tok = make_tokenizer(_cfg(f"model.hf_path={tiny['qwen2']['model']}"))
    assert isinstance(tok, HFTokenizer) and tok.has_chat_template
    assert tok.tok.convert_ids_to_tokens(tok.eos_id) == "<|im_end|>"
    assert tok.tok.convert_ids_to_tokens(tok.pad_id) == "<|endoftext|>"
    text = tok.render_prompt([{"role": "user", "content": "What is 3 plus 4 ?"}])
    assert text == "<|im_start|>user\nWhat is 3 plus 4 ?<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode(text)
    assert ids[0] == tok.tok.convert_tokens_to_ids("<|im_start|>")
    assert tok.decode(tok.encode("\\boxed{7}") + [tok.eos_id] + tok.encode("junk")) == "\\boxed{7}"
    with pytest.raises(TokenizerError, match="has 300 tokens but the model's vocab_size is 256"):
        check_vocab_fits(tok, 256, "test")
    with pytest.raises(TokenizerError, match="300 tokens.*vocab_size is 256"):  # byte-model run
        make_tokenizer(_cfg(f"model.tokenizer={tiny['qwen2']['model']}"))


def test_dapo_parquet_rendered_filtered_and_scored_by_math_verify(tiny, capsys):
    from megatron_rl.rewards.math_verify_reward import math_reward_fn
    from megatron_rl.run.setup import build_datasets, make_tokenizer, score_fn

    base = (f"model.hf_path={tiny['qwen2']['model']}", f"data.path={tiny['qwen2']['data']}",
            "data.val_size=8")
    cfg = _cfg(*base)
    tok = make_tokenizer(cfg)
    train, val = build_datasets(cfg, tok)
    assert len(train) + len(val) == 48
    row = train[0]
    assert row["data_source"] == "tiny_math" and row["messages"][0]["role"] == "user"
    assert row["prompt"] == tok.render_prompt(row["messages"])  # chat template applied
    assert row["answer"] == row["reward_model"]["ground_truth"]
    assert score_fn(cfg) is math_reward_fn
    assert math_reward_fn(row, f"so \\boxed{{{row['answer']}}}") == 1.0
    assert math_reward_fn(row, "\\boxed{1000}") == 0.0
    lens = sorted(len(tok.encode(r["prompt"])) for r in list(train) + list(val))
    limit = lens[-1] - 1  # drops the prompts with two 2-digit numbers
    want_dropped = sum(n > limit for n in lens)
    assert 0 < want_dropped < 48
    capsys.readouterr()
    tr2, va2 = build_datasets(_cfg(*base, f"data.max_prompt_length={limit}"), tok)
    assert len(tr2) + len(va2) == 48 - want_dropped
    assert f"dropped {want_dropped} of 48 prompts longer than data.max_prompt_length={limit}" \
        in capsys.readouterr().out


def test_plain_prompt_answer_jsonl_and_renamed_fields(tiny, tmp_path):
    from megatron_rl.rewards.tasks import score
    from megatron_rl.run.setup import build_datasets, make_tokenizer, score_fn

    path = tmp_path / "plain.jsonl"
    path.write_text("".join(json.dumps({"question": f"What is {i} plus 1 ?",
                                        "sol": str(i + 1)}) + "\n" for i in range(12)))
    cfg = _cfg(f"model.hf_path={tiny['qwen2']['model']}", f"data.path={path}",
               "data.prompt_key=question", "data.answer_key=sol", "data.val_size=2")
    train, _ = build_datasets(cfg, make_tokenizer(cfg))
    assert train[0]["prompt"].startswith("<|im_start|>user\nWhat is ")  # one user message
    assert train[0]["raw_prompt"].startswith("What is ")
    cfg_raw = _cfg(f"model.hf_path={tiny['qwen2']['model']}", f"data.path={path}",
                   "data.prompt_key=question", "data.answer_key=sol", "data.val_size=2",
                   "data.chat_template=false")
    assert build_datasets(cfg_raw)[0][0]["prompt"].startswith("What is ")
    with pytest.raises(ConfigError, match="data.prompt_field was renamed data.prompt_key"):
        _cfg("data.prompt_field=question")
    with pytest.raises(ConfigError, match="data.answer_field was renamed data.answer_key"):
        _cfg("data.answer_field=sol")
    assert score_fn(_cfg()) is score  # reasoning-gym tasks keep their verifier


# --- slow: TP2xPP2 loading --------------------------------------------------------------------
def _load_worker(hf_dirs: dict, mg_dir: str, tokens: torch.Tensor) -> dict:
    from megatron_rl.convert.common import peak_rss_bytes
    from megatron_rl.convert.model_source import (
        HFShardSource,
        MegatronCkptSource,
        build_model_from_source,
    )
    from megatron_rl.convert.verify import megatron_logits
    from megatron_rl.models.config import ModelConfig  # noqa: F401
    from megatron_rl.parallel import runtime

    runtime.init_parallel(tp=2, pp=2)
    out: dict = {"rss_start": peak_rss_bytes()}
    for fam, d in hf_dirs.items():
        from megatron_rl.convert.registry import read_hf_config

        cfg = read_hf_config(d)[1]
        src = HFShardSource(d, cfg)
        model = build_model_from_source(cfg, src)
        out[fam] = {"logits": megatron_logits(model, tokens), "bytes_read": src.bytes_read,
                    "own_bytes": src.own_bytes,
                    "total_bytes": sum(i.nbytes for i in src.ckpt.info.values())}
        del model
    cfg = read_hf_config(hf_dirs["qwen2"])[1]
    out["megatron"] = megatron_logits(build_model_from_source(cfg, MegatronCkptSource(mg_dir)),
                                      tokens)
    runtime.shutdown()
    return out


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_tp2pp2_loads_own_shard_only_and_matches_transformers(tiny, tmp_path):
    from megatron_rl.convert import convert_hf_to_megatron
    from megatron_rl.convert.verify import hf_logits
    from megatron_rl.parallel.launch import spawn

    dirs = {f: tiny[f]["model"] for f in ("qwen2", "qwen3")}
    mg = str(tmp_path / "mg")
    convert_hf_to_megatron(dirs["qwen2"], mg, tp=1, pp=1, log=lambda _m: None)
    tokens = torch.randint(0, 300, (2, 10), generator=torch.Generator().manual_seed(0))
    res = spawn(_load_worker, 4, (dirs, mg, tokens), timeout_s=500)
    for fam in dirs:
        want = hf_logits(dirs[fam], tokens)
        for rank, r in enumerate(res):
            st = r[fam]
            # every byte read is a byte of this rank's own TP x PP shard ...
            assert st["bytes_read"] == st["own_bytes"], (fam, rank)
            # ... and a TP2 x PP2 rank owns well under half of the model
            assert st["bytes_read"] < 0.45 * st["total_bytes"], (fam, rank, st)
            if rank in (2, 3):  # last pipeline stage
                torch.testing.assert_close(st["logits"], want, atol=ATOL, rtol=0)
                if fam == "qwen2":
                    torch.testing.assert_close(r["megatron"], want, atol=ATOL, rtol=0)


# --- slow: train from an HF directory at TP2xPP2, export, load the export -------------------------
def _actor_logits_worker(ckpt: str, cfg, tokens: torch.Tensor):
    from megatron_rl.actor.checkpoint import load_checkpoint
    from megatron_rl.convert.verify import megatron_logits
    from megatron_rl.models.builder import build_gpt_model
    from megatron_rl.parallel import runtime

    runtime.init_parallel(tp=1, pp=1)
    model = build_gpt_model(cfg, seed=0)
    load_checkpoint(ckpt, model, restore_rng=False)
    out = megatron_logits(model, tokens)
    runtime.shutdown()
    return out


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_train_from_hf_dir_tp2pp2_exports_loadable_hf_checkpoints(tiny, tmp_path):
    from safetensors.torch import load_file

    from megatron_rl.cli.app import main
    from megatron_rl.convert.verify import hf_logits
    from megatron_rl.parallel.launch import spawn
    from megatron_rl.run.export import load_run_config

    out = tmp_path / "run"
    (tmp_path / "run.yaml").write_text(f"model: {{hf_path: {tiny['qwen2']['model']}}}\n")
    from conftest import run_cli

    cmd = ["train", str(tmp_path / "run.yaml"),
           f"data.path={tiny['qwen2']['data']}", "data.val_size=8", "parallel.tp=2",
           "parallel.pp=2", "trainer.total_steps=2", "trainer.save_freq=1", "trainer.test_freq=2",
           "trainer.plots=false",
           "trainer.train_batch_size=4", "rollout.n=2", "rollout.max_new_tokens=6",
           "rollout.dynamic_sampling=false", "actor.micro_batch_size=4",
           "loss.algorithm=grpo", "optim.lr=0.01", f"output_dir={out}"]
    (code, stdout, stderr), = run_cli(4, cmd, timeout_s=800)  # TP2 x PP2 in place
    assert code == 0, stdout[-3000:] + stderr[-3000:]
    assert "summary: val_acc_start=" in stdout
    assert json.load(open(out / "reference_source.json"))["kind"] == "hf"  # grpo has a KL term
    ckpts = sorted(glob.glob(str(out / "checkpoints" / "step_*")))
    assert len(ckpts) == 2 and all(os.path.isfile(os.path.join(c, "hf", "config.json"))
                                   for c in ckpts)
    export = os.path.join(ckpts[-1], "hf")
    assert os.path.isfile(os.path.join(export, "tokenizer.json"))
    assert os.path.isfile(os.path.join(export, "model.safetensors.index.json"))
    tok = transformers.AutoTokenizer.from_pretrained(export, local_files_only=True)
    assert tok.chat_template and tok.eos_token == "<|im_end|>"

    cfg = model_config(load_run_config(str(out)).model)
    tokens = torch.randint(0, 300, (2, 10), generator=torch.Generator().manual_seed(1))
    actor = spawn(_actor_logits_worker, 1, (ckpts[-1], cfg, tokens), timeout_s=300)[0]
    exported = hf_logits(export, tokens)
    torch.testing.assert_close(exported, actor, atol=ATOL, rtol=0)
    # the weights moved (lr 0.01): the export is the trained model, not the initial one
    assert (hf_logits(tiny["qwen2"]["model"], tokens) - exported).abs().max() > 1e-3

    # the CLI export of the same step writes the same tensors
    again = tmp_path / "again"
    assert main(["export", str(out), "--step", "2", "--out", str(again)]) == 0
    a = {k: v for f in glob.glob(os.path.join(export, "*.safetensors")) for k, v in
         load_file(f).items()}
    b = {k: v for f in glob.glob(str(again / "*.safetensors")) for k, v in load_file(f).items()}
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert main(["export", str(out), "--step", "7", "--out", str(tmp_path / "x")]) == 2
