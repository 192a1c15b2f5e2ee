"""``python -m megatron_rl eval TARGET``: targets, ``--sets``, results on disk, ``--compare``, and
one run evaluated as a run directory, as its Hugging Face export and with ``eval CONFIG``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_rl.config.errors import ConfigError
from megatron_rl.config.load import load_config
from megatron_rl.eval.metrics import Sample, set_metrics

ROOT = Path(__file__).resolve().parents[1]


# ---- targets and sets ---------------------------------------------------------------------------
def test_target_kinds(tmp_path):
    from megatron_rl.eval.targets import target_kind

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.json").write_text("{}")
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (hf / "model.safetensors").write_bytes(b"")
    meg = tmp_path / "meg"
    meg.mkdir()
    (meg / "megatron_rl_convert.json").write_text("{}")
    assert target_kind(str(run)) == "run" and target_kind(str(hf)) == "hf"
    assert target_kind(str(meg)) == "megatron"
    assert target_kind(None) == target_kind("examples/tiny_dapo.yaml") == "config"
    with pytest.raises(ConfigError, match="is not a run directory .* Megatron checkpoint"):
        target_kind(str(tmp_path))


def test_resolve_sets_names_files_tasks_and_overrides(tmp_path):
    from megatron_rl.eval.targets import resolve_sets

    cfg = load_config(None, ['data.eval_sets=[{name: mine, task: gcd, n: 8, k: [1, 8]}]'])
    data = tmp_path / "aime.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    sets = resolve_sets(f"mine,math_latex,{data},products", cfg, n=4)
    assert [s["name"] for s in sets] == ["mine", "math_latex", "aime", "products"]
    assert [s["n"] for s in sets] == [4, 4, 4, 4]
    assert sets[0]["task"] == "gcd" and sets[0]["k"] == [1, 4]  # k=8 > n: back to [1, n]
    assert sets[2]["path"] == [str(data)] and sets[2]["scorer"] == "math_verify"
    assert sets[3]["task"] == "products" and sets[3]["scorer"] == "task"
    assert resolve_sets(None, cfg, k=[2])[0]["k"] == [2]
    assert resolve_sets(None, cfg, temperature=0)[0]["temperature"] == 0.0
    with pytest.raises(ConfigError, match="'aime25' is none of the config's data.eval_sets "
                                          r"\['mine'\], the shipped sets"):
        resolve_sets("aime25", cfg)
    with pytest.raises(ConfigError, match=r"k: 5 is not an integer in \[1, n=4\]"):
        resolve_sets("mine", cfg, n=4, k=[5])


# ---- results on disk and the comparison ---------------------------------------------------------
def _doc(name: str, groups: list[list[tuple[bool, str]]], ks=(1, 2)) -> dict:
    samples = [{"prompt_id": p, "sample": j, "response": a, "answer": a, "correct": c,
                "score": float(c), "length": 3, "truncated": False}
               for p, g in enumerate(groups) for j, (c, a) in enumerate(g)]
    metrics = set_metrics([[Sample(c, a, 3) for c, a in g] for g in groups], ks)
    return {"set": name, "metrics": metrics, "settings": {"k": list(ks), "n": len(groups[0])},
            "samples": samples}


def _write(d: Path, doc: dict) -> None:
    (d / "eval").mkdir(parents=True, exist_ok=True)
    (d / "eval" / f"{doc['set']}.json").write_text(json.dumps(doc))


def test_compare_differences_and_paired_bootstrap(tmp_path):
    from megatron_rl.eval.report import compare, format_compare

    base = [[(False, "1"), (False, "2")]] * 10 + [[(True, "3"), (False, "4")]] * 10
    trained = [[(True, "3"), (True, "3")]] * 10 + [[(True, "3"), (False, "4")]] * 10
    _write(tmp_path / "a", _doc("s", base))
    _write(tmp_path / "b", _doc("s", trained))
    _write(tmp_path / "b", _doc("only_b", trained))
    (res,) = compare(str(tmp_path / "a"), str(tmp_path / "b"), rounds=300)
    assert res["set"] == "s" and res["paired"] and res["n"] == 2
    rows = {r[0]: r[1:] for r in res["rows"]}
    a, b, d, lo, hi = rows["pass@1"]
    assert (a, b, d) == (0.25, 0.75, 0.5)
    assert 0 < lo <= d <= hi  # every resample improves: the interval excludes 0
    assert rows["mean_length"][2:] == (0.0, 0.0, 0.0)
    text = format_compare([res], "a", "b")
    assert "paired bootstrap" in text and "pass@1" in text and "+0.5000" in text and " *" in text
    same = compare(str(tmp_path / "a"), str(tmp_path / "a"), rounds=50)[0]
    assert all(r[3:] == (0.0, 0.0, 0.0) for r in same["rows"])


def test_compare_unpaired_when_prompts_differ_and_errors(tmp_path):
    from megatron_rl.eval.report import compare

    _write(tmp_path / "a", _doc("s", [[(True, "1"), (False, "2")]] * 4))
    _write(tmp_path / "b", _doc("s", [[(True, "1"), (True, "1")]] * 6))
    assert compare(str(tmp_path / "a"), str(tmp_path / "b"), rounds=20)[0]["paired"] is False
    _write(tmp_path / "c", _doc("other", [[(True, "1"), (False, "2")]]))
    with pytest.raises(ValueError, match="no set evaluated on both sides"):
        compare(str(tmp_path / "a"), str(tmp_path / "c"))
    with pytest.raises(FileNotFoundError, match="not a directory with eval results"):
        compare(str(tmp_path / "nope"), str(tmp_path / "a"))


def test_table_lists_metrics_in_order():
    from megatron_rl.eval.report import format_table

    m = set_metrics([[Sample(True, "1", 2), Sample(False, "2", 4, True)]], [2, 1])
    lines = format_table([("latex", m)]).splitlines()
    assert lines[0].split() == ["set", "prompts", "pass@1", "pass@2", "avg@1", "avg@2", "maj@1",
                                "maj@2", "mean_length", "truncated_frac"]
    assert lines[2].split() == ["latex", "1", "0.5000", "1.0000", "1.0000", "0.5000", "1.0000",
                                "0.5000", "3.0000", "0.5000"]


def test_model_targets_need_out_and_sets(tmp_path, capsys):
    from megatron_rl.cli.app import main
    from megatron_rl.testing.tiny_hf import make_tiny_hf

    model = make_tiny_hf(str(tmp_path))["model"]
    assert main(["eval", model, "--sets", "math_latex"]) == 2
    assert "give --out DIR" in capsys.readouterr().err
    assert main(["eval", model, "--out", str(tmp_path / "o")]) == 2
    assert "give --sets" in capsys.readouterr().err


def test_legacy_eval_config_form_still_parses():
    from megatron_rl.cli.app import parse_args

    args = parse_args(["eval", "examples/tiny_dapo.yaml", "output_dir=runs/x", "--n", "4",
                       "trainer.seed=3"])
    assert args.target == "examples/tiny_dapo.yaml" and args.n == 4
    assert args.overrides == ["output_dir=runs/x", "trainer.seed=3"]


# ---- end to end ---------------------------------------------------------------------------------
def _cli(*argv: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MRL_PROGRESS": "1"}
    res = subprocess.run([sys.executable, "-m", "megatron_rl", *argv], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return res


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_run_its_hf_export_and_config_form_give_the_same_samples(tmp_path, capsys):
    """Two RL steps, then: `eval RUN` (newest checkpoint), `eval HF_EXPORT --out` and `eval
    MEGATRON_CKPT --out` (the export converted back) give the same samples and metrics; at
    temperature 0 the embedded engine and our `serve` fleet behind the real sglang-router give
    the same samples; `eval RUN --step 1` is another checkpoint; `eval CONFIG output_dir=RUN`
    still prints the validation accuracy; `eval --compare` reads both. All commands but one run
    one after another in one spawned rank (as under torchrun); `eval RUN` is a real
    `python -m megatron_rl` process (launcher, spawned rank, progress on stderr)."""
    from conftest import run_cli

    from megatron_rl.cli.app import main
    from megatron_rl.testing.procs import free_port_block

    run = tmp_path / "run"
    sets = ["--sets", "math_latex,chain_sum", "--n", "4", "--k", "1,2,4",
            "--max-new-tokens", "4"]
    greedy = ["--sets", "math_latex,chain_sum", "--n", "2", "--temperature", "0",
              "--max-new-tokens", "4"]
    commands = [
        ["train", str(ROOT / "examples" / "tiny_dapo.yaml"), f"output_dir={run}",
         "parallel.tp=1", "parallel.pp=1", "trainer.total_steps=2", "trainer.save_freq=1",
         "trainer.test_freq=2", "sft.steps=20", "trainer.train_batch_size=4", "rollout.n=4",
         "rollout.gen_batch_size=4", "rollout.dynamic_sampling=false",
         "actor.micro_batch_size=8", "actor.mini_batch_size=8", "data.val_size=8",
         "trainer.plots=false"],
        ["export", str(run), "--out", str(tmp_path / "hf")],
        ["eval", str(tmp_path / "hf"), *sets, "--out", str(tmp_path / "hf_eval")],
        ["convert", "hf-to-megatron", "--hf-dir", str(tmp_path / "hf"), "--out",
         str(tmp_path / "meg")],
        ["eval", str(tmp_path / "meg"), *sets, "--out", str(tmp_path / "meg_eval")],
        ["eval", str(run), *greedy, "--out", str(tmp_path / "emb")],
        ["eval", str(run), *greedy, "--out", str(tmp_path / "fleet"), "rollout.engine=sglang",
         "rollout.sglang.num_servers=2", f"rollout.sglang.router_port={free_port_block(3)}",
         "rollout.sglang.weight_sync=from_tensor"],
        ["eval", str(run), *sets, "--step", "1", "--out", str(tmp_path / "step1")],
        ["eval", str(ROOT / "examples" / "tiny_dapo.yaml"), f"output_dir={run}",
         "parallel.tp=1", "parallel.pp=1", "data.val_size=8"],
    ]
    results = run_cli(1, *commands, timeout_s=1100)
    for argv, (code, out, err) in zip(commands, results):
        assert code == 0, (argv[:2], out[-3000:], err[-3000:])
    assert len(results) == len(commands)
    legacy = results[-1][1]
    assert "eval: val_acc=" in legacy and "(after step 2)" in legacy

    res = _cli("eval", str(run), *sets)
    assert "eval: val_acc=" in res.stdout and "(after step 2)" in res.stdout
    assert "pass@4" in res.stdout.splitlines()[-4] and "samples" in res.stderr  # table, progress
    trained = json.loads((run / "eval" / "math_latex.json").read_text())
    assert len(trained["samples"]) == 48 and trained["settings"]["n"] == 4
    assert set(trained["samples"][0]) >= {"prompt_id", "response", "answer", "score", "correct"}
    exported = json.loads((tmp_path / "hf_eval" / "eval" / "math_latex.json").read_text())
    assert [s["response"] for s in exported["samples"]] == \
        [s["response"] for s in trained["samples"]]
    assert exported["metrics"] == trained["metrics"]
    converted = json.loads((tmp_path / "meg_eval" / "eval" / "math_latex.json").read_text())
    assert converted["kind"] == "megatron" and converted["metrics"] == trained["metrics"]
    for name in ("math_latex", "chain_sum"):
        emb = json.loads((tmp_path / "emb" / "eval" / f"{name}.json").read_text())
        fleet = json.loads((tmp_path / "fleet" / "eval" / f"{name}.json").read_text())
        assert fleet["engine"] == "sglang" and emb["engine"] == "embedded"
        assert [s["response"] for s in fleet["samples"]] == [s["response"] for s in
                                                             emb["samples"]], name
        assert fleet["metrics"] == emb["metrics"], name
    step1 = json.loads((tmp_path / "step1" / "eval" / "chain_sum.json").read_text())
    assert "(after step 1)" in step1["weights"]
    capsys.readouterr()
    assert main(["eval", "--compare", str(tmp_path / "step1"), str(run)]) == 0
    assert "chain_sum (n=4, paired bootstrap over prompts)" in capsys.readouterr().out
