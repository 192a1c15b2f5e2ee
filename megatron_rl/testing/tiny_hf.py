"""A tiny Hugging Face model directory and a DAPO-Math-style Parquet file, made in seconds.

    python -m megatron_rl.testing.tiny_hf OUT [--family qwen2|qwen3|llama] [--rows 64]

writes ``OUT/model`` (random ``Qwen2ForCausalLM`` by default, saved with ``save_pretrained`` in
several small safetensors shards, plus a word-level tokenizer with a ChatML chat template) and
``OUT/dapo_math.parquet`` (``prompt`` as chat messages, ``reward_model.ground_truth``,
``data_source``: the verl / DAPO-Math-17k layout) with addition problems.

The tokenizer (byte-level BPE) is trained with the ``tokenizers`` library on the dataset's own
text; the model's ``vocab_size`` is padded up to a multiple of 64
(as real checkpoints pad theirs), larger than the tokenizer.
"""

from __future__ import annotations

import argparse
import os
import random

import torch

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
QUESTION = "What is {a} plus {b} ? Put the final answer in \\boxed{{}} ."


def math_rows(n: int, seed: int = 0) -> list[dict]:
    """``n`` rows in the DAPO-Math layout (distinct questions ``a + b``, a, b in 0..49)."""
    rng = random.Random(seed)
    pairs = rng.sample([(a, b) for a in range(50) for b in range(50)], n)
    return [{"data_source": "tiny_math", "ability": "MATH",
             "prompt": [{"role": "user", "content": QUESTION.format(a=a, b=b)}],
             "reward_model": {"style": "rule", "ground_truth": str(a + b)},
             "extra_info": {"index": i}} for i, (a, b) in enumerate(pairs)]


def write_parquet(rows: list[dict], path: str) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def make_tokenizer(out_dir: str, corpus: list[str], vocab_size: int = 300):
    """A byte-level BPE tokenizer (the Qwen2/GPT-2 kind, so ``AutoTokenizer`` loads it for every
    family) trained on ``corpus`` in about a second, with ChatML special tokens and chat template;
    saved to ``out_dir`` and returned (``PreTrainedTokenizerFast``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL[:3],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)
    return fast


def make_model(out_dir: str, vocab_size: int, family: str = "qwen2", seed: int = 0,
               tie_word_embeddings: bool | None = None, max_shard_size: str = "60KB",
               **shape) -> str:
    """Save a random tiny causal LM of ``family`` (fp32) in several safetensors shards."""
    import transformers

    cls = {"qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config,
           "llama": transformers.LlamaConfig}[family]
    kw = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              rope_theta=10000.0, rms_norm_eps=1e-6, initializer_range=0.1,
              tie_word_embeddings=family != "qwen2" if tie_word_embeddings is None
              else tie_word_embeddings)
    if family == "qwen3":
        kw["head_dim"] = 32  # != hidden / heads, as in real Qwen3
    kw.update(shape)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cls(**kw), dtype=torch.float32)
    with torch.no_grad():  # norms and biases away from 1/0 so that mapping errors show
        for name, p in model.named_parameters():
            if "norm" in name or "bias" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(out_dir, max_shard_size=max_shard_size)
    return out_dir


def make_tiny_hf(out: str, family: str = "qwen2", rows: int = 64, seed: int = 0,
                 tie_word_embeddings: bool | None = None) -> dict[str, str]:
    """``{"model": DIR, "data": PARQUET}`` under ``out`` (see the module docstring)."""
    data = math_rows(rows, seed)
    model_dir = os.path.join(out, "model")
    os.makedirs(model_dir, exist_ok=True)
    corpus = [m["content"] for r in data for m in r["prompt"]] + [
        f"user assistant system \\boxed{{{r['reward_model']['ground_truth']}}}" for r in data]
    tok = make_tokenizer(model_dir, corpus)
    vocab = -(-len(tok) // 64) * 64  # padded, as real checkpoints are
    make_model(model_dir, vocab, family, seed, tie_word_embeddings)
    return {"model": model_dir, "data": write_parquet(data, os.path.join(out,
                                                                         "dapo_math.parquet"))}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out")
    p.add_argument("--family", default="qwen2", choices=("qwen2", "qwen3", "llama"))
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    paths = make_tiny_hf(args.out, args.family, args.rows, args.seed)
    print(f"model: {paths['model']}\ndata:  {paths['data']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
