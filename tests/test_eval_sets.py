"""``data.eval_sets``: load-time checks and defaults, the shipped sets, one evaluation through the
embedded engine, and the metrics a training run logs (``eval/<set>/pass@k`` ...)."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch

from megatron_rl.config.errors import ConfigError
from megatron_rl.config.load import load_config

ROOT = Path(__file__).resolve().parents[1]
LATEX = ROOT / "megatron_rl" / "data" / "eval_sets" / "math_latex.jsonl"


def _cfg(*sets: dict, extra: tuple[str, ...] = ()):
    return load_config(None, [f"data.eval_sets={json.dumps(list(sets))}", *extra])


# ---- config ------------------------------------------------------------------------------------
def test_defaults_are_filled_in_from_the_rollout_section():
    cfg = _cfg({"name": "gym", "task": "chain_sum", "n": 4},
               {"name": "latex", "path": str(LATEX), "scorer": "exact_match", "k": [2, 1],
                "n": 2, "temperature": 0},
               extra=("rollout.temperature=0.7", "rollout.max_new_tokens=6"))
    gym, latex = cfg.data.eval_sets
    assert gym == {"name": "gym", "task": "chain_sum", "task_kwargs": {}, "size": 64,
                   "seed": 1000, "limit": 0, "n": 4, "temperature": 0.7, "top_p": 1.0,
                   "max_new_tokens": 6, "scorer": "task", "k": [1, 4]}
    assert latex["path"] == [str(LATEX)] and latex["scorer"] == "exact_match"
    assert latex["k"] == [1, 2] and latex["temperature"] == 0.0
    assert latex["prompt_key"] == "prompt" and latex["answer_key"] is None


@pytest.mark.parametrize("entry,needle", [
    ({"task": "chain_sum"}, r"data.eval_sets\[0\].name must be a name"),
    ({"name": "a b", "task": "chain_sum"}, r"data.eval_sets\[0\].name must be a name"),
    ({"name": "x"}, r"data.eval_sets\[0\] \(x\): give exactly one of path"),
    ({"name": "x", "task": "chain_sum", "path": "a.jsonl"}, "exactly one of path"),
    ({"name": "x", "task": "chain_sum", "scorer": "math_verfy"},
     r"data.eval_sets\[0\] \(x\).scorer='math_verfy' is not one of math_verify, exact_match, "
     r"task or a reward plug-in 'module:function'; did you mean 'math_verify'"),
    ({"name": "x", "path": "a.jsonl", "scorer": "task"}, r"scorer='task' scores with a "
                                                         "reasoning-gym verifier"),
    ({"name": "x", "task": "chain_sum", "n": 4, "k": [1, 8]},
     r"\(x\).k: 8 is not an integer in \[1, n=4\]"),
    ({"name": "x", "task": "chain_sum", "n": 0}, r"\(x\).n must be an integer >= 1, got 0"),
    ({"name": "x", "task": "chain_sum", "temperature": -1},
     r"\(x\).temperature must be a number >= 0 \(0: greedy\), got -1"),
    ({"name": "x", "task": "chain_sum", "top_p": 0}, r"top_p must be a number in \(0, 1\]"),
    ({"name": "x", "task": "chain_sum", "samples": 3},
     r"unknown field 'samples'.*\(allowed: name, path, task"),
    ({"name": "x", "task": "chain_summ"}, r"\(x\).task='chain_summ' is not a reasoning-gym task; "
                                          "did you mean 'chain_sum'"),
    (3, r"data.eval_sets\[0\] must be a mapping"),
    ("gsm8k", r"data.eval_sets\[0\] \(gsm8k\): give exactly one of path"),
])
def test_bad_entries_name_the_field_and_allowed_values(entry, needle):
    with pytest.raises(ConfigError, match=needle):
        _cfg(entry)


def test_duplicate_names_and_multi_turn_envs_are_refused():
    with pytest.raises(ConfigError, match=r"eval_sets\[1\].name='a' is used by an earlier set"):
        _cfg({"name": "a", "task": "chain_sum"}, {"name": "a", "task": "gcd"})
    with pytest.raises(ConfigError, match="needs single-turn prompts; env.name='frozenlake'"):
        _cfg({"name": "a", "task": "chain_sum"}, extra=("env.name=frozenlake",))


def test_input_checks_read_every_set(tmp_path):
    from megatron_rl.run.input_checks import check_inputs

    cfg = _cfg({"name": "gone", "path": str(tmp_path / "missing.jsonl")})
    with pytest.raises(ConfigError, match=r"data.eval_sets\[0\] \(gone\).path: prompt dataset "
                                          "file not found"):
        check_inputs(cfg)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "1+1="}\n')
    with pytest.raises(ConfigError, match=r"\(bad\).path: .*no answer field"):
        check_inputs(_cfg({"name": "bad", "path": str(bad)}))
    with pytest.raises(ConfigError, match=r"\(p\).scorer: .*module 'no_such_mod' not found"):
        check_inputs(_cfg({"name": "p", "task": "chain_sum", "scorer": "no_such_mod:f"}))
    check_inputs(_cfg({"name": "ok", "path": str(LATEX)}, {"name": "gym", "task": "chain_sum"}))


# ---- the shipped sets --------------------------------------------------------------------------
def test_shipped_latex_set_is_scored_by_math_verify():
    """Every reference answer, boxed, scores 1 and votes as itself; a wrong one scores 0.
    (``5\\sqrt{2}``, ``9\\pi`` and ``x + 1`` used to parse as their first number.)"""
    from megatron_rl.eval.sets import build_eval_sets

    cfg = _cfg({"name": "latex", "path": str(LATEX)})
    (es,) = build_eval_sets(cfg, _byte_tok())
    assert len(es.rows) == 12 and es.spec["scorer"] == "math_verify"
    for row in es.rows:
        right = f"The answer is $\\boxed{{{row['answer']}}}$."
        assert es.score_fn(row, right) == 1.0, row["answer"]
        assert es.score_fn(row, "The answer is $\\boxed{7}$.") == 0.0, row["answer"]
        assert es.score_fn(row, "The answer is $\\boxed{-1}$.") == 0.0, row["answer"]
        assert es.extract(right) == es.extract(f"so ${row['answer']}$"), row["answer"]


def test_exact_match_scorer_and_boxed_extraction():
    from megatron_rl.eval.sets import exact_match_answer, exact_match_score, last_boxed

    assert last_boxed(r"a \boxed{\frac{1}{2}} b \boxed{3}") == "3"
    assert last_boxed(r"\boxed{\frac{1}{2}}") == r"\frac{1}{2}"
    assert last_boxed("no box") is None
    assert exact_match_answer("  7 ") == "7" and exact_match_answer("   ") is None
    assert exact_match_score({"answer": " 7"}, r"so \boxed{7}") == 1.0
    assert exact_match_score({"answer": "7"}, "7.0") == 0.0


def _byte_tok():
    from megatron_rl.rewards.tokenizer import ByteTokenizer

    return ByteTokenizer()


def _engine():
    from megatron_rl.models.config import get_preset
    from megatron_rl.rollout.embedded import EmbeddedEngine

    torch.manual_seed(0)
    tok = _byte_tok()
    return EmbeddedEngine(get_preset("tiny"), tok.eos_id, tok.pad_id), tok


def test_evaluate_set_through_the_embedded_engine():
    """n samples per prompt through generate_records; the metrics are those of the recorded
    samples (pass@k brute force over their k-subsets), every sample kept for audit."""
    from megatron_rl.eval.sets import build_eval_sets, evaluate_set, logged_metrics

    cfg = _cfg({"name": "gym", "task": "chain_sum", "size": 6, "n": 4, "k": [1, 2, 4],
                "temperature": 1.0, "max_new_tokens": 3})
    (es,) = build_eval_sets(cfg, _byte_tok())
    engine, tok = _engine()
    calls = []
    res = evaluate_set(engine, tok, es, seed=3, chunk=4, progress=lambda d, t: calls.append((d, t)))
    assert calls == [(4, 6), (6, 6)]
    assert len(res.samples) == 24 and res.settings["n"] == 4 and res.settings["k"] == [1, 2, 4]
    by_prompt = [res.samples[i * 4:(i + 1) * 4] for i in range(6)]
    for k in (1, 2, 4):
        brute = sum(sum(any(g[i]["correct"] for i in s) for s in itertools.combinations(
            range(4), k)) / len(list(itertools.combinations(range(4), k))) for g in by_prompt) / 6
        assert res.metrics[f"pass@{k}"] == pytest.approx(brute)
    assert all(0 < s["length"] <= 3 for s in res.samples)
    assert res.metrics["mean_length"] == pytest.approx(sum(s["length"] for s in res.samples) / 24)
    assert res.metrics["truncated_frac"] == pytest.approx(
        sum(s["truncated"] for s in res.samples) / 24)
    for s in res.samples:
        assert s["correct"] == (es.score_fn(_row(es, s), s["response"]) >= 1.0)
    logged = logged_metrics([res])
    assert set(logged) == {f"eval/gym/{m}@{k}" for m in ("pass", "avg", "maj") for k in (1, 2, 4)
                           } | {"eval/gym/mean_length", "eval/gym/truncated_frac"}


def _row(es, sample):
    return next(r for r in es.rows if r["raw_prompt"] == sample["prompt"])


def test_greedy_set_repeats_the_same_response():
    from megatron_rl.eval.sets import build_eval_sets, evaluate_set

    cfg = _cfg({"name": "g", "task": "chain_sum", "size": 3, "n": 2, "temperature": 0,
                "max_new_tokens": 3})
    (es,) = build_eval_sets(cfg, _byte_tok())
    engine, tok = _engine()
    res = evaluate_set(engine, tok, es, seed=0)
    for i in range(3):
        assert res.samples[2 * i]["response"] == res.samples[2 * i + 1]["response"]
    assert res.metrics["pass@2"] == res.metrics["pass@1"] == res.metrics["avg@2"]


# ---- a training run logs the sets -------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_training_logs_eval_sets_at_start_every_test_freq_and_end(tmp_path):
    from conftest import tiny_train

    sets = [{"name": "gym", "task": "chain_sum", "size": 8, "n": 4, "k": [1, 4]},
            {"name": "greedy", "task": "chain_sum", "size": 8, "n": 1, "temperature": 0}]
    rows, stdout = tiny_train(tmp_path, f"data.eval_sets={json.dumps(sets)}",
                              "trainer.test_freq=2")
    steps = [r["step"] for r in rows if "eval/gym/pass@4" in r]
    assert steps == [0, 2, 3], steps
    last = [r for r in rows if "eval/gym/pass@4" in r][-1]
    for key in ("pass@1", "avg@1", "maj@1", "pass@4", "avg@4", "maj@4", "mean_length",
                "truncated_frac"):
        assert 0 <= last[f"eval/gym/{key}"] <= (4 if key == "mean_length" else 1), key
    assert last["eval/gym/pass@4"] >= last["eval/gym/pass@1"]
    assert "eval/greedy/pass@1" in last and "[eval] step 3 gym:" in stdout
    # `eval RUN` on the last checkpoint: the numbers the training log shows for that step
    # (in place on the run's two ranks, as under torchrun: conftest.run_cli)
    from conftest import run_cli

    (code, out, err), = run_cli(2, ["eval", str(tmp_path)], timeout_s=600)
    assert code == 0, out[-2000:] + err[-2000:]
    for name in ("gym", "greedy"):
        doc = json.loads((tmp_path / "eval" / f"{name}.json").read_text())
        logged = {k.split("/")[-1]: v for k, v in last.items() if k.startswith(f"eval/{name}/")}
        assert logged == {k: v for k, v in doc["metrics"].items() if k in logged}, name
        assert len(logged) == (8 if name == "gym" else 5)


def test_shipped_sets_by_name_alone():
    cfg = _cfg({"name": "math_latex", "n": 2}, {"name": "chain_sum", "k": [1]})
    latex, gym = cfg.data.eval_sets
    assert latex["path"] == [str(LATEX)] and latex["scorer"] == "math_verify"
    assert gym["task"] == "chain_sum" and gym["size"] == 64 and gym["scorer"] == "task"
    with pytest.raises(ConfigError, match=r"or name a shipped set \(math_latex, chain_sum\)"):
        _cfg({"name": "aime24"})
    by_name = load_config(None, ["data.eval_sets=math_latex,chain_sum"]).data.eval_sets
    assert [s["name"] for s in by_name] == ["math_latex", "chain_sum"]
