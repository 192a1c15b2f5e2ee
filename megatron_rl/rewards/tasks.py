"""Verifiable tasks from ``reasoning-gym`` with compact prompts for the tiny byte models.

The gym's procedural generators make the problems and its verifiers (``score_answer``) score the
answers; nothing here re-implements either. The gym's own questions are long English sentences,
too long for a byte-level model with a few layers, so the prompt is rebuilt from the entry's
structured ``metadata`` (the answer is always the gym's answer):

==================  ======================================  ==================
task                prompt (from metadata)                  example
==================  ======================================  ==================
``chain_sum``       ``expression`` without spaces + ``=``   ``"4-1="`` → ``3``
``basic_arithmetic````expression`` without spaces + ``=``   ``"5-3="`` → ``2``
``products``        ``expression`` without spaces + ``=``   ``"4*1="`` → ``4``
``gcd``             ``gcd(a,b)=``                           ``"gcd(4,16)="``
``lcm``             ``lcm(a,b)=``                           ``"lcm(10,2)="``
``countdown``       ``[numbers]->target=``                  ``"[2,5]->7="``
``spell_backward``  ``rev(word)=``                          ``"rev(sun)="``
any other task      the gym's question (may be long)
==================  ======================================  ==================

``TASK_PRESETS`` gives each mapped task a tiny-model difficulty; keyword arguments to
:func:`make_task_dataset` override it. ``DEFAULT_TASK = "chain_sum"`` with 2 terms of 1 digit:
``a+b`` / ``a-b`` with a, b in 0..9 (200 distinct prompts, answers -9..18).

Scores are the gym's verifier scores in [0, 1]. Note that the arithmetic verifiers give partial
credit when the oracle answer is a substring of the response (``"13"`` for ``"3"`` scores
``len("3")/len("13") = 0.5``); use :func:`is_correct` (score == 1) for a binary accuracy.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any, Callable

DEFAULT_TASK = "chain_sum"

TASK_PRESETS: dict[str, dict[str, Any]] = {
    "chain_sum": dict(min_terms=2, max_terms=2, min_digits=1, max_digits=1),
    "basic_arithmetic": dict(min_terms=2, max_terms=2, min_digits=1, max_digits=1),
    "products": dict(min_terms=2, max_terms=2, min_digits=1, max_digits=1),
    "gcd": dict(min_numbers=2, max_numbers=2, min_value=1, max_value=20),
    "lcm": dict(min_numbers=2, max_numbers=2, min_value=1, max_value=10),
    "countdown": dict(min_numbers=2, max_numbers=3, min_value=1, max_value=9, min_target=1,
                      max_target=20),
    "spell_backward": dict(min_word_len=3, max_word_len=5),
}


def _expr(meta: dict) -> str:
    return str(meta["expression"]).replace(" ", "") + "="


def _nums(meta: dict) -> str:
    return ",".join(str(n) for n in meta["numbers"])


PROMPT_BUILDERS: dict[str, Callable[[dict], str]] = {
    "chain_sum": _expr,
    "basic_arithmetic": _expr,
    "products": _expr,
    "gcd": lambda m: f"gcd({_nums(m)})=",
    "lcm": lambda m: f"lcm({_nums(m)})=",
    "countdown": lambda m: f"[{_nums(m)}]->{m['target']}=",
    "spell_backward": lambda m: f"rev({m['word']})=",
}


def known_tasks() -> list[str]:
    import reasoning_gym  # noqa: F401  (registers the datasets)
    from reasoning_gym.factory import DATASETS

    return sorted(DATASETS)


def task_kwarg_names(name: str) -> list[str] | None:
    """The keyword arguments reasoning-gym task ``name`` accepts (its config dataclass's fields
    but ``seed``/``size``, which the data section sets), or None when it cannot tell."""
    import dataclasses

    import reasoning_gym  # noqa: F401  (registers the datasets)
    from reasoning_gym.factory import DATASETS

    entry = DATASETS.get(name)
    if not entry or not dataclasses.is_dataclass(entry[1]):
        return None
    return [f.name for f in dataclasses.fields(entry[1]) if f.name not in ("seed", "size")]


def _check_name(name: str) -> None:
    names = known_tasks()
    if name not in names:
        import difflib

        close = difflib.get_close_matches(name, names, n=3)
        hint = f" Did you mean {', '.join(close)}?" if close else ""
        raise ValueError(
            f"unknown task {name!r}.{hint} Tasks with compact prompts: "
            f"{', '.join(sorted(PROMPT_BUILDERS))}. All reasoning-gym tasks: {', '.join(names)}"
        )


def _kwargs(name: str, task_kwargs: dict) -> dict:
    kw = dict(TASK_PRESETS.get(name, {}))
    kw.update(task_kwargs)
    return kw


def _jsonable(entry: dict) -> dict:
    return json.loads(json.dumps(entry, default=str))


def make_task_dataset(name: str = DEFAULT_TASK, size: int = 1000, seed: int = 0,
                      **task_kwargs) -> list[dict]:
    """``size`` rows ``{"prompt", "answer", "task", "task_kwargs", "entry"}`` from the gym's
    generator ``name`` (deterministic in ``seed``). ``task_kwargs`` override ``TASK_PRESETS``."""
    import reasoning_gym

    _check_name(name)
    kw = _kwargs(name, task_kwargs)
    ds = reasoning_gym.create_dataset(name, size=size, seed=seed, **kw)
    build = PROMPT_BUILDERS.get(name)
    rows = []
    for entry in ds:
        entry = _jsonable(entry)
        prompt = build(entry["metadata"]) if build else entry["question"]
        rows.append({"prompt": prompt, "answer": str(entry["answer"]), "task": name,
                     "task_kwargs": kw, "entry": entry})
    return rows


@lru_cache(maxsize=64)
def _scorer(name: str, kw_json: str):
    import reasoning_gym

    return reasoning_gym.create_dataset(name, size=1, seed=0, **json.loads(kw_json))


def score(row: dict, response_text: str) -> float:
    """The gym verifier's score in [0, 1] of ``response_text`` (leading/trailing whitespace
    stripped) for a row made by :func:`make_task_dataset`."""
    name = row["task"]
    kw = row.get("task_kwargs") or _kwargs(name, {})
    ds = _scorer(name, json.dumps(kw, sort_keys=True))
    entry = row.get("entry") or {"answer": row["answer"], "metadata": {}}
    s = ds.score_answer((response_text or "").strip(), entry)
    return float(min(max(s, 0.0), 1.0))


def is_correct(row: dict, response_text: str) -> bool:
    """Binary accuracy: the verifier's score is exactly 1."""
    return score(row, response_text) >= 1.0
