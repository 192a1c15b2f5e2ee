"""Byte tokenizer, reasoning-gym tasks, math-verify reward, per-sample isolation, plug-ins."""

import time

import pytest

from megatron_rl.rewards.tokenizer import ByteTokenizer


def test_tokenizer_round_trip():
    tok = ByteTokenizer()
    for s in ["3+4=", "héllo ∑", ""]:
        assert tok.decode(tok.encode(s)) == s
    ids = tok.encode("12", add_eos=True) + [ord("9"), 0]
    assert ids[:3] == [49, 50, 1] and tok.decode(ids) == "12"
    assert tok.decode([0, 55, 0]) == "7"
    assert tok.decode([0xFF, 55]) == "\ufffd7"
    with pytest.raises(ValueError, match="reserved"):
        tok.encode("a\x01b")
    assert tok.apply_prompt("3+4") == "3+4=" and tok.apply_prompt("3+4=") == "3+4="
    with pytest.raises(ValueError, match="exceeds"):
        tok.apply_prompt("x" * 60)
    assert tok.vocab_size == 256 and (tok.pad_id, tok.eos_id) == (0, 1)


def test_tasks_default_and_verifier():
    from megatron_rl.rewards.tasks import DEFAULT_TASK, is_correct, make_task_dataset, score

    t = time.time()
    rows = make_task_dataset(DEFAULT_TASK, size=2000, seed=0)
    assert time.time() - t < 10
    assert len(rows) == 2000
    r = rows[1]
    assert r["prompt"] == r["entry"]["metadata"]["expression"].replace(" ", "") + "="
    assert len(r["prompt"]) == 4 and r["task"] == DEFAULT_TASK
    assert score(r, r["answer"]) == 1.0 and is_correct(r, " " + r["answer"] + "\n")
    wrong = str(int(r["answer"]) + 100)
    assert score(r, wrong) < 1.0 and not is_correct(r, wrong)
    assert score(r, "") == 0.0
    assert make_task_dataset(DEFAULT_TASK, 5, 0)[3]["prompt"] == rows[3]["prompt"]
    assert all(len(x["prompt"]) < 48 for x in rows)


@pytest.mark.parametrize("name,prefix", [("gcd", "gcd("), ("products", ""),
                                         ("spell_backward", "rev(")])
def test_other_compact_tasks(name, prefix):
    from megatron_rl.rewards.tasks import make_task_dataset, score

    rows = make_task_dataset(name, size=20, seed=1)
    for r in rows:
        assert r["prompt"].startswith(prefix) and r["prompt"].endswith("=")
        assert score(r, r["answer"]) == 1.0


def test_compact_prompt_tasks_are_reasoning_gym_tasks():
    """Config validation trusts these names without importing the gym."""
    from megatron_rl.rewards.tasks import PROMPT_BUILDERS, TASK_PRESETS, known_tasks

    assert set(PROMPT_BUILDERS) | set(TASK_PRESETS) <= set(known_tasks())


def test_unknown_task_lists_known():
    from megatron_rl.rewards.tasks import make_task_dataset

    with pytest.raises(ValueError, match=r"unknown task 'chain_summ'.*Did you mean chain_sum"):
        make_task_dataset("chain_summ", 3, 0)


# ---------------------------------------------------------------- math-verify and isolation
def test_math_reward():
    pytest.importorskip("math_verify")
    from megatron_rl.rewards.math_verify_reward import math_reward, math_reward_fn

    assert math_reward("the answer is \\boxed{\\frac{1}{2}}", "\\frac{1}{2}") == 1.0
    assert math_reward("0.5", "\\frac{1}{2}") == 1.0
    assert math_reward("7", "3") == 0.0
    assert math_reward("", "3") == 0.0
    assert math_reward_fn({"answer": "12"}, "12") == 1.0


def _ok(row, response):
    return 1.0 if response == row["answer"] else 0.0


def _raises(row, response):
    if response == "boom":
        raise RuntimeError("user reward bug")
    return _ok(row, response)


def _hangs(row, response):
    if response == "hang":
        time.sleep(30)
    if response == "nan":
        return float("nan")
    return _ok(row, response)


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_score_batch_isolates_failures_and_hangs(mode):
    from megatron_rl.rewards.math_verify_reward import score_batch

    rows = [{"answer": "1"}] * 5
    r, nf, nt = score_batch(_raises, rows, ["1", "boom", "2", "1", "boom"], timeout_s=5,
                            mode=mode)
    assert r == [1.0, 0.0, 0.0, 1.0, 0.0] and (nf, nt) == (2, 0)
    t = time.time()
    r, nf, nt = score_batch(_hangs, rows, ["1", "hang", "nan", "1", "0"], timeout_s=0.5,
                            mode=mode)
    assert time.time() - t < 25  # cut off by the timeout, well before the 30 s hang ends
    assert r == [1.0, 0.0, 0.0, 1.0, 0.0] and (nf, nt) == (1, 1)
    with pytest.raises(ValueError):
        score_batch(_ok, rows, ["1"])


def test_score_batch_lambda_process_falls_back():
    from megatron_rl.rewards.math_verify_reward import score_batch

    r, nf, nt = score_batch(lambda row, s: len(s), [{}, {}], ["ab", "c"], mode="process")
    assert r == [2.0, 1.0] and nf == nt == 0


def test_plugin_loading():
    from megatron_rl.rewards.plugin import load_reward_fn
    from megatron_rl.rewards.tasks import score

    assert load_reward_fn("megatron_rl.rewards.tasks:score") is score
    assert load_reward_fn("megatron_rl.rewards.tasks.score") is score
    assert load_reward_fn("task") is score
    assert callable(load_reward_fn("math_verify"))
    with pytest.raises(ImportError, match="module 'no_such_pkg.mod' not found"):
        load_reward_fn("no_such_pkg.mod:fn")
    with pytest.raises(AttributeError, match="has no attribute 'nope'"):
        load_reward_fn("megatron_rl.rewards.tasks:nope")
    with pytest.raises(TypeError, match="not callable"):
        load_reward_fn("megatron_rl.rewards.tasks:DEFAULT_TASK")
    with pytest.raises(ValueError):
        load_reward_fn("justaname")
    with pytest.raises(ValueError):
        load_reward_fn("")
