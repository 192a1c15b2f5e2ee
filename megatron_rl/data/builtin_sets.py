"""Evaluation sets shipped with the package (no download): ``data.eval_sets`` entries that give
only a ``name`` from :data:`BUILTIN_SETS` take the rest of the entry from here.

* ``math_latex``: 12 hand-written math problems whose reference answers are LaTeX
  (``\\frac{5}{6}``, ``5\\sqrt{2}``, ``9\\pi``, ``x + 1`` ...), scored by math-verify; the prompts
  ask for the answer in ``\\boxed{}`` (``megatron_rl/data/eval_sets/math_latex.jsonl``).
* ``chain_sum``: 64 reasoning-gym ``chain_sum`` problems (``a+b`` / ``a-b``, one digit: the main
  job's task) generated with seed 1000, scored by the gym's verifier.
"""

from __future__ import annotations

import os

EVAL_SETS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "eval_sets")

BUILTIN_SETS: dict[str, dict] = {
    "math_latex": {"path": os.path.join(EVAL_SETS_DIR, "math_latex.jsonl"),
                   "scorer": "math_verify"},
    "chain_sum": {"task": "chain_sum", "size": 64, "seed": 1000, "scorer": "task"},
}
