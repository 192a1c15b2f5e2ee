"""Prompt datasets (JSONL/Parquet/task), train/val split and the resumable loader."""

import json

import pytest

from megatron_rl.data.prompts import PromptDataset, PromptLoader, train_val_split


def _write_jsonl(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(path)


def test_jsonl_fields_and_nested(tmp_path):
    p = _write_jsonl(tmp_path / "d.jsonl", [
        {"q": "1+1=", "sol": {"gt": 2}, "extra": 5},
        {"q": [{"role": "system", "content": "s"}, {"role": "user", "content": "2+2="}],
         "sol": {"gt": "4"}},
    ])
    ds = PromptDataset.from_files(p, prompt_key="q", answer_key="sol.gt")
    assert [r["prompt"] for r in ds] == ["1+1=", "2+2="]
    assert [r["answer"] for r in ds] == ["2", "4"]
    assert ds[0]["extra"] == 5


def test_missing_answer_names_file_and_line(tmp_path):
    p = _write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "a", "answer": "1"},
                                             {"prompt": "b"}])
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: row has no answer field 'answer'"):
        PromptDataset.from_files(p)
    p2 = _write_jsonl(tmp_path / "bad2.jsonl", [{"answer": "1"}])
    with pytest.raises(ValueError, match=r"bad2\.jsonl:1: row has no prompt"):
        PromptDataset.from_files(p2)
    with pytest.raises(FileNotFoundError):
        PromptDataset.from_files(str(tmp_path / "nope.jsonl"))
    (tmp_path / "x.csv").write_text("a")
    with pytest.raises(ValueError, match="unsupported"):
        PromptDataset.from_files(str(tmp_path / "x.csv"))


def test_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    t = pa.table({"prompt": ["1+2=", "3+4="], "answer": ["3", None]})
    pq.write_table(t, tmp_path / "d.parquet")
    with pytest.raises(ValueError, match=r"d\.parquet row 1: row has no answer"):
        PromptDataset.from_files(str(tmp_path / "d.parquet"))
    pq.write_table(pa.table({"prompt": ["1+2="], "answer": ["3"]}), tmp_path / "ok.parquet")
    assert PromptDataset.from_files(str(tmp_path / "ok.parquet"))[0]["answer"] == "3"


def test_from_task_and_split():
    ds = PromptDataset.from_task("chain_sum", size=300, seed=3)
    assert len(ds) == 300 and all(r["prompt"].endswith("=") for r in ds)
    tr, va = train_val_split(ds, 0.2, seed=1)
    assert not {r["prompt"] for r in tr} & {r["prompt"] for r in va}
    assert len(tr) + len(va) == 300
    tr2, va2 = train_val_split(ds, 0.2, seed=1)
    assert [r["prompt"] for r in va] == [r["prompt"] for r in va2]
    tr3, va3 = train_val_split(ds, 50, seed=1, by=None)
    assert len(va3) == 50 and len(tr3) == 250
    with pytest.raises(ValueError):
        train_val_split(ds, 0, seed=1)


def test_loader_deterministic_and_resume():
    rows = [{"prompt": str(i), "answer": str(i)} for i in range(10)]
    a = PromptLoader(rows, batch_size=3, seed=7)
    first = [[r["prompt"] for r in a.next_batch()] for _ in range(5)]
    # epoch = 3 full batches (last partial dropped), each epoch a permutation
    assert len({p for b in first[:3] for p in b}) == 9
    assert first[:3] != first[3:5] + [None]
    b = PromptLoader(rows, batch_size=3, seed=7)
    assert [[r["prompt"] for r in b.next_batch()] for _ in range(5)] == first

    state = json.loads(json.dumps(a.state_dict()))  # survives a JSON checkpoint
    expected = [[r["prompt"] for r in a.next_batch()] for _ in range(7)]
    c = PromptLoader(rows, batch_size=3, seed=7)
    c.load_state_dict(state)
    assert [[r["prompt"] for r in c.next_batch()] for _ in range(7)] == expected
    d = PromptLoader(rows, batch_size=3, seed=8)
    with pytest.raises(ValueError, match="seed differs"):
        d.load_state_dict(state)
    with pytest.raises(ValueError):
        PromptLoader(rows[:2], batch_size=3)
