"""Evaluation sets (``data.eval_sets``): their prompts, scorer and answer extractor, and one
evaluation of a set through the rollout path validation uses (``generate_records`` on the run's
engine: embedded or the SGLang fleet).

A set's rows come from its files (the training-data layout, :class:`PromptDataset`) or its
reasoning-gym task, rendered for the tokenizer as training prompts are. Every sample is scored by
the set's scorer (correct: score 1) and its answer extracted for maj@k:

* ``math_verify``: the first expression math-verify parses from the response (its sympy form, so
  ``\\boxed{\\frac{1}{2}}`` and ``1/2`` vote together), None when nothing parses;
* ``exact_match``: the content of the last ``\\boxed{...}`` when there is one, else the whole
  response, whitespace stripped; correct when it equals the stripped reference answer;
* ``task`` and plug-ins: the stripped response (None when empty).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from megatron_rl.eval.metrics import Sample, set_metrics

# prompts per engine call; training and `eval` use the same chunks (sampling seed trainer.seed + the
# chunk's first prompt index), so both give the same samples for the same weights and settings
EVAL_CHUNK = 64
ScoreFn = Callable[[dict, str], float]
Extract = Callable[[str], "str | None"]


@dataclass
class EvalSet:
    """One named set: its complete spec (``data.eval_sets`` entry), rendered rows, scorer and
    answer extractor."""

    spec: dict
    rows: list[dict]
    score_fn: ScoreFn
    extract: Extract
    dropped: int = 0  # prompts longer than data.max_prompt_length
    source: str = ""

    @property
    def name(self) -> str:
        return self.spec["name"]


@dataclass
class EvalResult:
    """Metrics of one evaluation of a set and every sample behind them."""

    name: str
    metrics: dict[str, float]
    settings: dict
    samples: list[dict] = field(default_factory=list)
    wall_s: float = 0.0


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` of ``text`` (braces balanced), else None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i, depth = start + len("\\boxed{"), 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j].strip()
    return None


def exact_match_answer(response: str) -> str | None:
    """The extracted answer of ``exact_match``: last boxed content, else the stripped text."""
    boxed = last_boxed(response or "")
    out = boxed if boxed is not None else (response or "").strip()
    return out or None


def exact_match_score(row: dict, response: str) -> float:
    """1.0 when the extracted answer equals the stripped reference answer, else 0.0."""
    return float(exact_match_answer(response) == str(row["answer"]).strip())


def math_verify_answer(response: str) -> str | None:
    """The first expression math-verify parses from ``response`` (sympy form), else None."""
    import logging

    from math_verify import parse

    logging.getLogger("math_verify").setLevel(logging.ERROR)
    try:
        parsed = parse(response or "")
    except Exception:  # noqa: BLE001 - an unparsable response has no answer
        return None
    return str(parsed[0]) if parsed else None


def stripped_answer(response: str) -> str | None:
    return (response or "").strip() or None


def scorer(spec: dict) -> tuple[ScoreFn, Extract]:
    """``(score_fn, extract)`` of a set's ``scorer``."""
    name = spec["scorer"]
    if name == "math_verify":
        from megatron_rl.rewards.math_verify_reward import math_reward_fn

        return math_reward_fn, math_verify_answer
    if name == "exact_match":
        return exact_match_score, exact_match_answer
    from megatron_rl.rewards.plugin import load_reward_fn

    return load_reward_fn(name), stripped_answer


def load_rows(spec: dict) -> tuple[list[dict], str]:
    """The set's raw rows (files or generated task prompts; first ``limit`` when set)."""
    from megatron_rl.data.prompts import PromptDataset

    if "path" in spec:
        ds = PromptDataset.from_files(spec["path"], spec["prompt_key"], spec["answer_key"])
    else:
        ds = PromptDataset.from_task(spec["task"], spec["size"], spec["seed"],
                                     **spec["task_kwargs"])
    rows = ds.rows[:spec["limit"]] if spec["limit"] else ds.rows
    return rows, ds.source


def build_eval_sets(cfg, tokenizer, specs: list[dict] | None = None) -> list[EvalSet]:
    """Every set of ``specs`` (default ``cfg.data.eval_sets``), rows rendered for ``tokenizer``
    as training prompts are (chat template, ``data.max_prompt_length``)."""
    from megatron_rl.data.prompts import PromptDataset
    from megatron_rl.run.setup import render_prompts

    out = []
    for spec in cfg.data.eval_sets if specs is None else specs:
        rows, source = load_rows(spec)
        ds, dropped = render_prompts(PromptDataset(rows, source), tokenizer,
                                     cfg.data.chat_template, cfg.data.max_prompt_length)
        if not len(ds):
            raise ValueError(f"eval set {spec['name']!r}: no prompt of {source} is within "
                             f"data.max_prompt_length={cfg.data.max_prompt_length} tokens")
        score_fn, extract = scorer(spec)
        out.append(EvalSet(spec, ds.rows, score_fn, extract, dropped, source))
    return out


def sampling_params(spec: dict):
    """The engine's :class:`SamplingParams` of a set (temperature 0: greedy)."""
    from megatron_rl.rollout.engine import SamplingParams

    t = spec["temperature"]
    return SamplingParams(n=spec["n"], max_new_tokens=spec["max_new_tokens"],
                          temperature=t or 1.0, top_p=spec["top_p"], greedy=t == 0,
                          validation=True)


def settings_of(spec: dict) -> dict:
    """What decides the numbers besides the weights: sampling, scorer, k."""
    keys = ("n", "temperature", "top_p", "max_new_tokens", "scorer", "k", "limit")
    return {k: spec[k] for k in keys}


def evaluate_set(engine, tokenizer, es: EvalSet, seed: int, timeout_s: float = 5.0,
                 chunk: int = EVAL_CHUNK, progress: Callable[[int, int], None] | None = None
                 ) -> EvalResult:
    """Generate ``n`` samples per prompt of ``es``, score and extract them, and compute the
    set's metrics. ``chunk`` > 0: prompts per engine call (``progress(done, total)`` after each)."""
    from megatron_rl.rollout.collect import generate_records

    t0 = time.perf_counter()
    params = sampling_params(es.spec)
    n, rows = es.spec["n"], es.rows
    step = chunk or len(rows)
    records: list[dict] = []
    for i in range(0, len(rows), step):
        records += generate_records(engine, tokenizer, rows[i:i + step], params, es.score_fn,
                                    seed=seed + i, timeout_s=timeout_s)
        if progress is not None:
            progress(min(i + step, len(rows)), len(rows))
    groups, samples = [], []
    for p, row in enumerate(rows):
        group = []
        for j, rec in enumerate(records[p * n:(p + 1) * n]):
            answer = es.extract(rec["text"])
            group.append(Sample(correct=rec["score"] >= 1.0, answer=answer,
                                length=rec["response_length"], truncated=rec["truncated"]))
            samples.append({"prompt_id": row.get("id", p), "sample": j, "prompt":
                            row.get("raw_prompt", row["prompt"]), "reference": row["answer"],
                            "response": rec["text"], "answer": answer, "score": rec["score"],
                            "correct": rec["score"] >= 1.0, "length": rec["response_length"],
                            "truncated": rec["truncated"]})
        groups.append(group)
    metrics = set_metrics(groups, es.spec["k"])
    return EvalResult(es.name, metrics, settings_of(es.spec), samples,
                      time.perf_counter() - t0)


def logged_metrics(results: list[EvalResult]) -> dict[str, float]:
    """``{"eval/<set>/<metric>": value}`` for metrics.jsonl (pass@k, avg@k, maj@k, mean_length,
    truncated_frac)."""
    keep = ("pass@", "avg@", "maj@", "mean_length", "truncated_frac")
    return {f"eval/{r.name}/{k}": v for r in results for k, v in r.metrics.items()
            if k.startswith(keep)}
