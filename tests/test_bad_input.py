"""The bad-input corpus (issue 28): every config field with a wrong type, an out-of-range value and
a misspelt key; broken datasets, HF directories and reward plugins. Each case must give a one-line
``ConfigError`` naming the input and the fix at load time, and (run through ``train``) leave the
run directory unwritten.

Run ``python tests/test_bad_input.py`` for the table and the counts (docs/bad-input.md)."""

from __future__ import annotations

import json
import os
import shutil
import sys
import textwrap
from dataclasses import dataclass, field
from typing import Callable

import pytest

from megatron_rl.config.errors import ConfigError
from megatron_rl.config.load import load_config
from megatron_rl.config.schema import (
    CHOICES,
    FREE_TEXT,
    RANGES,
    SEED_MAX,
    UNBOUNDED,
    base_type,
    leaf_fields,
)
from megatron_rl.config.sections import RunConfig


@dataclass
class Case:
    """One bad input: ``overrides`` (``{tmp}`` is the case's scratch dir) made by ``setup`` and the
    fragments the error must contain."""

    name: str
    overrides: list[str]
    needles: list[str]
    setup: Callable[[str], None] | None = None
    group: str = "config"
    extra: dict = field(default_factory=dict)


# ---- config fields: generated from the dataclasses -----------------------------------------------
WRONG_TYPE = {int: "abc", float: "fast", bool: "3", str: "123", list: "5", dict: "5"}
TYPE_WORDS = {int: "an integer", float: "a number", bool: "true or false", str: "a string",
              list: "a list", dict: "a mapping"}


def misspell(key: str) -> str:
    """A typo: two middle letters swapped (a letter appended to keys of one or two letters)."""
    if len(key) < 3:
        return key + "x"
    i = len(key) // 2
    swapped = key[:i - 1] + key[i] + key[i - 1] + key[i + 1:]
    return swapped if swapped != key else key[:i] + key[i + 1:]


def out_of_range(name: str) -> list[str]:
    """Values just outside the field's range (below its low end, above its high end)."""
    rng = RANGES[name]
    is_int = base_type(dict(leaf_fields(RunConfig))[name]) is int
    vals = []
    if rng.lo is not None:
        vals.append(rng.lo if rng.lo_open else (rng.lo - 1 if is_int else rng.lo - 0.5))
    if rng.hi is not None:
        vals.append(rng.hi if rng.hi_open else (rng.hi + 1 if is_int else rng.hi + 0.5))
    if not is_int:
        vals.append(float("nan"))
    return [str(int(v)) if is_int else (".nan" if v != v else repr(float(v))) for v in vals]


def config_cases() -> list[Case]:
    cases = []
    for name, tp in leaf_fields(RunConfig):
        kind = base_type(tp)
        section, _, key = name.rpartition(".")
        cases.append(Case(f"{name}: wrong type", [f"{name}={WRONG_TYPE[kind]}"],
                          [name, TYPE_WORDS[kind]]))
        bad = f"{section}.{misspell(key)}" if section else misspell(key)
        cases.append(Case(f"{name}: misspelt key", [f"{bad}=1"],
                          [f"unknown config key {bad!r}", f"did you mean {name!r}"]))
        if name in RANGES:
            for v in out_of_range(name):
                cases.append(Case(f"{name}: out of range ({v})", [f"{name}={v}"],
                                  [name, "must be", v.lstrip(".")]))
        if name in CHOICES:
            allowed = CHOICES[name]()
            cases.append(Case(f"{name}: not an allowed value", [f"{name}=zzz_bad"],
                              [name.rpartition(".")[2], "zzz_bad", sorted(allowed)[0]]))
    sections = [f.rpartition(".")[0].split(".")[0] for f, _ in leaf_fields(RunConfig)]
    for sec in dict.fromkeys(sections):
        bad = misspell(sec)
        cases.append(Case(f"section {sec}: misspelt", [f"{bad}.x=1"],
                          [f"unknown config key {bad!r}", f"did you mean {sec!r}"]))
    # strings that name files, URLs or other fields: checked at load
    cases += [
        Case("model.hf_path: not a directory", ["model.preset=null", "model.hf_path={tmp}/none"],
             ["model.hf_path", "is not a directory"]),
        Case("model.megatron_ckpt: not a directory",
             ["model.preset=null", "model.megatron_ckpt={tmp}/none"],
             ["model.megatron_ckpt", "is not a directory"]),
        Case("model.tokenizer: not a directory", ["model.tokenizer={tmp}/none"],
             ["model.tokenizer", "'byte' or a Hugging Face tokenizer directory"]),
        Case("model: two sources", ["model.preset=tiny", "model.hf_path={tmp}"],
             ["exactly one of model.preset"]),
        Case("data.prompt_field: renamed", ["data.prompt_field=q"],
             ["data.prompt_field was renamed data.prompt_key"]),
        Case("data.answer_field: renamed", ["data.answer_field=a"],
             ["data.answer_field was renamed data.answer_key"]),
        Case("data.task: unknown", ["data.task=chain_summ"], ["data.task", "did you mean"]),
        Case("rollout.sglang.router_url: not a URL", ["rollout.sglang.router_url=gpu1:30000"],
             ["rollout.sglang.router_url", "http(s)://"]),
        Case("rollout.sglang.servers: not a URL", ["rollout.sglang.servers=[gpu1:1]"],
             ["rollout.sglang.servers", "http(s)://"]),
        Case("rollout.sglang.gpus: not an index", ["rollout.sglang.gpus=[a]"],
             ["rollout.sglang.gpus", "CUDA device index"]),
        Case("trainer.seed: above 2**32-1", [f"trainer.seed={SEED_MAX + 1}"],
             ["trainer.seed", f"in [0, {SEED_MAX}]"]),
        Case("actor.max_tokens_per_micro_batch: below the longest sequence",
             ["actor.max_tokens_per_micro_batch=100", "data.max_prompt_length=64",
              "rollout.max_new_tokens=64"],
             ["actor.max_tokens_per_micro_batch=100", "64 + 64 = 128", "at least 128"]),
    ]
    return cases


# ---- datasets, HF directories, reward plugins: run through `train` -------------------------------
def _jsonl(path: str, rows: list, raw: bytes = b"") -> None:
    with open(path, "wb") as f:
        f.write(b"".join(json.dumps(r).encode() + b"\n" for r in rows) + raw)


def _rows(n: int = 40, **extra) -> list[dict]:
    return [{"prompt": f"{i}+1=", "answer": str(i + 1), **extra} for i in range(n)]


def _parquet(path: str, table: dict) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table(table), path)


DATA = ["data.path={tmp}/d.jsonl", "data.val_size=4", "trainer.train_batch_size=8",
        "rollout.gen_batch_size=0"]
PQ = ["data.path={tmp}/d.parquet", "data.val_size=4", "trainer.train_batch_size=8",
      "rollout.gen_batch_size=0"]


def data_cases() -> list[Case]:
    g = "dataset"
    return [
        Case("JSONL: missing prompt column", DATA, ["d.jsonl:1", "no prompt field 'prompt'",
                                                    "set data.prompt_key"],
             lambda t: _jsonl(f"{t}/d.jsonl", [{"question": "1+1=", "answer": "2"}] * 40), g),
        Case("JSONL: missing answer column", DATA, ["d.jsonl:3", "no answer field 'answer'",
                                                    "data.answer_key"],
             lambda t: _jsonl(f"{t}/d.jsonl", _rows(2) + [{"prompt": "x"}] + _rows(40)), g),
        Case("Parquet: missing prompt column", PQ, ["d.parquet", "no column 'prompt'",
                                                    "set data.prompt_key"],
             lambda t: _parquet(f"{t}/d.parquet", {"q": ["1+1="] * 40, "answer": ["2"] * 40}), g),
        Case("JSONL: empty prompt", DATA, ["d.jsonl:2", "is empty or not text", "remove the row"],
             lambda t: _jsonl(f"{t}/d.jsonl", _rows(1) + [{"prompt": "  ", "answer": "1"}]), g),
        Case("JSONL: empty chat message list", DATA, ["d.jsonl:1", "is empty or not text"],
             lambda t: _jsonl(f"{t}/d.jsonl", [{"prompt": [], "answer": "1"}] + _rows()), g),
        Case("JSONL: chat message with empty content", DATA, ["d.jsonl:1", "is empty or not text"],
             lambda t: _jsonl(f"{t}/d.jsonl", [{"prompt": [{"role": "user", "content": ""}],
                                                "answer": "1"}] + _rows()), g),
        Case("Parquet: empty prompt", PQ, ["d.parquet row 5", "is empty or not text"],
             lambda t: _parquet(f"{t}/d.parquet", {
                 "prompt": [f"{i}+1=" if i != 5 else "" for i in range(40)],
                 "answer": ["1"] * 40}), g),
        Case("JSONL: prompt longer than the context", DATA,
             ["1 of 41 prompts do not fit the model's context", "max_position_embeddings=512",
              "set data.max_prompt_length=508"],
             lambda t: _jsonl(f"{t}/d.jsonl", _rows() + [{"prompt": "9" * 600, "answer": "1"}]),
             g),
        Case("data.max_prompt_length + max_new_tokens > context",
             DATA + ["data.max_prompt_length=510"],
             ["data.max_prompt_length=510 + rollout.max_new_tokens=", "max_position_embeddings"],
             lambda t: _jsonl(f"{t}/d.jsonl", _rows()), g),
        Case("JSONL: non-UTF-8 bytes", DATA, ["d.jsonl:41", "not UTF-8 text (byte 0xe9",
                                              "re-encode the file as UTF-8"],
             lambda t: _jsonl(f"{t}/d.jsonl", _rows(),
                              b'{"prompt": "caf\xe9", "answer": "1"}\n'), g),
        Case("Parquet: non-UTF-8 bytes", PQ, ["d.parquet row 3", "not UTF-8 text"],
             lambda t: _parquet(f"{t}/d.parquet", {
                 "prompt": [b"caf\xe9" if i == 3 else b"ok" for i in range(40)],
                 "answer": ["1"] * 40}), g),
        Case("JSONL: duplicate ids", DATA,
             ["duplicate id 7 in rows 7 and 39", "ids must be unique"],
             lambda t: _jsonl(f"{t}/d.jsonl", [{**r, "id": i} for i, r in enumerate(_rows(39))]
                              + [{"prompt": "a", "answer": "b", "id": 7}]), g),
        Case("JSONL: invalid JSON line", DATA, ["d.jsonl:41", "invalid JSON"],
             lambda t: _jsonl(f"{t}/d.jsonl", _rows(), b'{"prompt": "x",\n'), g),
        Case("JSONL: empty file", DATA, ["d.jsonl", "the file has no rows"],
             lambda t: _jsonl(f"{t}/d.jsonl", []), g),
        Case("data.path: file missing", ["data.path={tmp}/none.jsonl"],
             ["data.path", "prompt dataset file not found"], None, g),
        Case("data.path: unsupported format", ["data.path={tmp}/d.csv"],
             ["data.path", "unsupported dataset format '.csv'"],
             lambda t: open(f"{t}/d.csv", "w").write("prompt,answer\n1+1=,2\n"), g),
        Case("Parquet: corrupt file", PQ, ["d.parquet", "not a readable Parquet file"],
             lambda t: open(f"{t}/d.parquet", "wb").write(b"PAR1 not really"), g),
        Case("dataset: fewer rows than a batch", DATA, ["6 training rows", "fewer than one batch"],
             lambda t: _jsonl(f"{t}/d.jsonl", _rows(10)), g),
        Case("data.task_kwargs: not the task's", ["data.task_kwargs={min_termz: 2}"],
             ["data.task_kwargs", "min_termz"], None, g),
        Case("model.init_weights: missing file", ["model.init_weights={tmp}/sft_weights.pt"],
             ["model.init_weights", "is not a file"], None, g),
    ]


def _tiny_hf(tmp: str) -> str:
    """A copy of the module's tiny HF model under ``tmp`` (made once, in HF_CACHE)."""
    from megatron_rl.testing.tiny_hf import make_tiny_hf

    cache = os.path.join(os.environ.get("BAD_INPUT_CACHE", "/tmp"), f"bad_input_hf_{os.getuid()}")
    if not os.path.isdir(os.path.join(cache, "model")):
        make_tiny_hf(cache + ".part", rows=48)
        shutil.rmtree(cache, ignore_errors=True)
        os.replace(cache + ".part", cache)
    shutil.copytree(os.path.join(cache, "model"), f"{tmp}/hf")
    shutil.copy(os.path.join(cache, "dapo_math.parquet"), f"{tmp}/d.parquet")
    return f"{tmp}/hf"


def _drop_shard(tmp: str) -> None:
    hf = _tiny_hf(tmp)
    index = json.load(open(f"{hf}/model.safetensors.index.json"))
    os.remove(os.path.join(hf, sorted(set(index["weight_map"].values()))[1]))


def _edit_config(tmp: str, **changes) -> None:
    hf = _tiny_hf(tmp)
    cfg = json.load(open(f"{hf}/config.json"))
    cfg.update(changes)
    json.dump(cfg, open(f"{hf}/config.json", "w"))


def _small_vocab_model(tmp: str) -> None:
    """The tokenizer (hundreds of tokens) next to a model with a 64-row vocabulary."""
    from megatron_rl.testing.tiny_hf import make_model

    hf = _tiny_hf(tmp)
    for f in os.listdir(hf):
        if f.endswith((".safetensors", ".json")) and "token" not in f:
            os.remove(os.path.join(hf, f))
    make_model(hf, 64)


HF = ["model.preset=null", "model.hf_path={tmp}/hf", "data.path={tmp}/d.parquet",
      "data.val_size=8", "trainer.train_batch_size=8", "rollout.gen_batch_size=0",
      "sft.steps=0"]


def hf_cases() -> list[Case]:
    g = "hf"
    return [
        Case("HF: missing shard", HF, ["model.hf_path", "shard(s) listed in "
                                       "model.safetensors.index.json are missing"],
             _drop_shard, g),
        Case("HF: vocabulary mismatch (config.json vs tensors)", HF,
             ["model.hf_path", "shape mismatch for tensor 'model.embed_tokens.weight'"],
             lambda t: _edit_config(t, vocab_size=640), g),
        Case("HF: tokenizer larger than the model's vocabulary", HF,
             ["model.tokenizer", "the tokenizer has", "vocab_size is 64",
              "set model.tokenizer to the model's tokenizer directory"], _small_vocab_model, g),
        Case("HF: unsupported architecture", HF,
             ["model.hf_path", "GPTNeoXForCausalLM", "is not supported", "Qwen2ForCausalLM"],
             lambda t: _edit_config(t, architectures=["GPTNeoXForCausalLM"],
                                    model_type="gpt_neox"), g),
        Case("HF: no config.json", HF, ["model.hf_path", "has no config.json"],
             lambda t: os.remove(f"{_tiny_hf(t)}/config.json"), g),
    ]


PLUGIN = textwrap.dedent('''
    import threading

    RELEASE = threading.Event()

    def raises(row, response):
        return 1 / 0

    def hangs(row, response):
        RELEASE.wait(120)
        return 0.0

    def nan(row, response):
        return float("nan")

    def text(row, response):
        return "good"

    def ok(row, response):
        return 1.0
    ''')


def _plugin(tmp: str) -> None:
    with open(f"{tmp}/bad_reward_plugin.py", "w") as f:
        f.write(PLUGIN)


def reward_cases() -> list[Case]:
    g = "reward"
    fn = "rollout.reward_fn=bad_reward_plugin:"
    return [
        Case("reward plugin raises", [fn + "raises"],
             ["rollout.reward_fn='bad_reward_plugin:raises'", "raised ZeroDivisionError",
              "must return a float for any response"], _plugin, g),
        Case("reward plugin hangs", [fn + "hangs", "rollout.reward_timeout_s=0.5"],
             ["did not return within rollout.reward_timeout_s=0.5 s"], _plugin, g),
        Case("reward plugin returns NaN", [fn + "nan"],
             ["returned nan", "rewards must be finite numbers"], _plugin, g),
        Case("reward plugin returns text", [fn + "text"], ["returned 'good', not a number"],
             _plugin, g),
        Case("reward plugin: module missing", ["rollout.reward_fn=no_such_module:fn"],
             ["rollout.reward_fn", "module 'no_such_module' not found"], None, g),
        Case("reward plugin: function missing", [fn + "nope"],
             ["rollout.reward_fn", "has no attribute 'nope'"], _plugin, g),
    ]


# ---- running a case ------------------------------------------------------------------------------
def run_config_case(case: Case, tmp: str) -> str | None:
    """The error message of loading ``case`` (None when it loads)."""
    try:
        load_config(None, [o.replace("{tmp}", tmp) for o in case.overrides])
    except ConfigError as exc:
        return str(exc)
    return None


def run_train_case(case: Case, tmp: str, capsys) -> tuple[int, str, bool]:
    """``(exit code, stderr, run dir written?)`` of ``train`` on ``case``."""
    from megatron_rl.cli.app import main

    if case.setup:
        case.setup(tmp)
    capsys.readouterr()  # the setup's own output (progress bars)
    run_dir = os.path.join(tmp, "run")
    argv = ["train", f"output_dir={run_dir}", "trainer.total_steps=1", "sft.steps=0",
            *[o.replace("{tmp}", tmp) for o in case.overrides]]  # the case's values win
    sys.path.insert(0, tmp)
    try:
        rc = main(argv)
    finally:
        sys.path.remove(tmp)
        sys.modules.pop("bad_reward_plugin", None)
    return rc, capsys.readouterr().err, os.path.exists(run_dir)


def clear(msg: str | None, case: Case) -> bool:
    """One line that contains every expected fragment."""
    return msg is not None and "\n" not in msg.strip() and all(n in msg for n in case.needles)


CONFIG_CASES = config_cases()
FILE_CASES = data_cases() + hf_cases() + reward_cases()


def test_every_field_is_classified():
    """A new numeric field needs a range (or a reason not to), a new string field its allowed
    values (or a note where it is checked): the corpus covers new fields automatically."""
    fields = dict(leaf_fields(RunConfig))
    numeric = {n for n, t in fields.items() if base_type(t) in (int, float)}
    text = {n for n, t in fields.items() if base_type(t) is str}
    assert numeric - set(RANGES) - set(UNBOUNDED) == set()
    assert text - set(CHOICES) - set(FREE_TEXT) == set()
    assert set(RANGES) | set(UNBOUNDED) <= numeric and set(CHOICES) | set(FREE_TEXT) <= text
    assert len(fields) >= 129


def test_config_corpus(tmp_path):
    """Every generated config case gives a clear one-line ``ConfigError``."""
    bad = []
    for case in CONFIG_CASES:
        msg = run_config_case(case, str(tmp_path))
        if not clear(msg, case):
            bad.append(f"{case.name}: {case.overrides} -> {msg!r} (want {case.needles})")
    print(f"\nconfig corpus: cases={len(CONFIG_CASES)} clear={len(CONFIG_CASES) - len(bad)}")
    assert not bad, "\n".join(bad)
    assert len(CONFIG_CASES) > 400


def test_defaults_and_edges_load():
    """The corpus is not vacuous: the defaults and the ends of each range load."""
    load_config(None, [])
    edges = [f"{n}={int(r.lo) if float(r.lo).is_integer() else r.lo}"
             for n, r in RANGES.items() if r.lo is not None and not r.lo_open
             and n not in ("early_stop.val_threshold",)]
    for e in edges:
        load_config(None, [e])


def test_config_errors_write_nothing(tmp_path, capsys):
    """A config error (one case per section) through ``train``: exit 2, no run directory."""
    seen, picked = set(), []
    for case in CONFIG_CASES:
        section = case.name.split(".")[0]
        if "wrong type" in case.name and section not in seen:
            seen.add(section)
            picked.append(case)
    assert len(picked) >= 12
    for case in picked:
        rc, err, written = run_train_case(case, str(tmp_path), capsys)
        assert rc == 2 and err.startswith("error: ") and clear(err[7:], case), (case.name, err)
        assert not written, case.name


@pytest.mark.parametrize("case", FILE_CASES, ids=[c.name for c in FILE_CASES])
def test_file_corpus(case, tmp_path, capsys):
    """Broken files: ``train`` exits 2 with a clear one-line error and writes nothing."""
    rc, err, written = run_train_case(case, str(tmp_path), capsys)
    assert rc == 2, err
    assert err.startswith("error: ") and clear(err[len("error: "):], case), err
    assert not written, "the run directory was created"


def test_good_plugin_and_data_pass_the_checks(tmp_path, capsys):
    """The same files, not broken, pass ``train --check`` (the checks are not vacuous)."""
    from megatron_rl.cli.app import main

    _plugin(str(tmp_path))
    _jsonl(f"{tmp_path}/d.jsonl", _rows())
    sys.path.insert(0, str(tmp_path))
    try:
        argv = ["train", "--check", *[o.replace("{tmp}", str(tmp_path)) for o in DATA],
                "rollout.reward_fn=bad_reward_plugin:ok"]
        assert main(argv) == 0, capsys.readouterr().err
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("bad_reward_plugin", None)


if __name__ == "__main__":  # the table of docs/bad-input.md
    import tempfile

    class _Cap:
        def readouterr(self):
            return type("R", (), {"err": ""})()

    n_ok = 0
    for c in CONFIG_CASES:
        with tempfile.TemporaryDirectory() as d:
            n_ok += clear(run_config_case(c, d), c)
    print(f"config: cases={len(CONFIG_CASES)} clear={n_ok}")
    total, total_ok = len(CONFIG_CASES), n_ok
    import contextlib
    import dataclasses
    import io

    for c in FILE_CASES:
        with tempfile.TemporaryDirectory() as d:
            if c.setup:
                with contextlib.redirect_stderr(io.StringIO()):
                    c.setup(d)
            c = dataclasses.replace(c, setup=None)
            buf = io.StringIO()
            with contextlib.redirect_stderr(buf):
                rc, _, written = run_train_case(c, d, _Cap())
            err = buf.getvalue()
            ok = rc == 2 and not written and clear(err[len("error: "):], c)
            total_ok += ok
            print(f"{c.group:8s} {'ok ' if ok else 'BAD'} {c.name}: {err.strip()[:150]}")
    total += len(FILE_CASES)
    print(f"bad-input corpus: cases={total} clear={total_ok}")
