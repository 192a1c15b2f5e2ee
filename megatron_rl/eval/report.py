"""Results of ``eval`` on disk and on screen: ``eval/<set>.json`` (metrics, settings, every
sample), the table on stdout, and ``eval --compare A B`` with a bootstrap confidence interval of
each metric's difference.

The bootstrap resamples prompts (with replacement; a prompt keeps all its samples) and recomputes
the metrics from the samples: paired when both sides evaluated the same prompts (the usual base vs
trained comparison: one resample of prompt indices serves both), else each side on its own.
"""

from __future__ import annotations

import json
import os
import random
from typing import Sequence

from megatron_rl.eval.metrics import Sample, set_metrics

FORMAT_VERSION = 1
SHOWN = ("pass@", "avg@", "maj@", "mean_length", "truncated_frac")


def write_result(out_dir: str, result, meta: dict) -> str:
    """``out_dir/<set>.json`` of one :class:`~megatron_rl.eval.sets.EvalResult` (atomic)."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{result.name}.json")
    doc = {"format": FORMAT_VERSION, "set": result.name, "metrics": result.metrics,
           "settings": result.settings, **meta, "wall_s": result.wall_s,
           "samples": result.samples}
    with open(path + ".tmp", "w") as f:
        json.dump(doc, f, indent=1, default=str)
    os.replace(path + ".tmp", path)
    return path


def shown_keys(metrics: dict) -> list[str]:
    """The metric names of a table, in the order pass@k, avg@k, maj@k (by k), length, truncation."""
    def order(key: str) -> tuple:
        head, _, k = key.partition("@")
        rank = {"pass": 0, "avg": 1, "maj": 2}.get(head, 3)
        return (rank, int(k) if k.isdigit() else 0, key)

    return sorted((k for k in metrics if k.startswith(SHOWN)), key=order)


def format_table(rows: Sequence[tuple[str, dict]]) -> str:
    """One line per set (``rows``: ``(name, metrics)``), one column per metric."""
    keys: list[str] = []
    for _, m in rows:
        keys += [k for k in shown_keys(m) if k not in keys]
    keys = shown_keys(dict.fromkeys(keys))
    width = max([len("set")] + [len(n) for n, _ in rows])
    cols = [max(len(k), 7) for k in keys]
    head = f"{'set':<{width}}  {'prompts':>7}  " + "  ".join(
        f"{k:>{c}}" for k, c in zip(keys, cols))
    lines = [head, "-" * len(head)]
    for name, m in rows:
        cells = "  ".join(f"{_fmt(m.get(k)):>{c}}" for k, c in zip(keys, cols))
        lines.append(f"{name:<{width}}  {int(m.get('prompts', 0)):>7}  {cells}")
    return "\n".join(lines)


def _fmt(v) -> str:
    if v is None:
        return "-"
    return f"{v:.1f}" if abs(v) >= 10 else f"{v:.4f}"


# ---- comparison -----------------------------------------------------------------------------
def eval_dir(path: str) -> str:
    """The folder of ``<set>.json`` files of a run directory, an ``--out`` folder or itself."""
    inner = os.path.join(path, "eval")
    if os.path.isdir(inner):
        return inner
    if os.path.isdir(path):
        return path
    raise FileNotFoundError(f"eval --compare: {path} is not a directory with eval results "
                            "(run `eval` on it first)")


def load_results(path: str) -> dict[str, dict]:
    """``{set name: the document of eval/<set>.json}`` under ``path`` (see :func:`eval_dir`)."""
    d = eval_dir(path)
    out = {}
    for name in sorted(os.listdir(d)):
        if name.endswith(".json"):
            with open(os.path.join(d, name)) as f:
                doc = json.load(f)
            if isinstance(doc, dict) and "samples" in doc and "metrics" in doc:
                out[doc.get("set", name[:-5])] = doc
    if not out:
        raise FileNotFoundError(f"eval --compare: no eval/<set>.json under {path}")
    return out


def groups_of(doc: dict) -> tuple[list, list[list[Sample]]]:
    """``(prompt ids, samples per prompt)`` of an eval document, in file order."""
    by: dict = {}
    for s in doc["samples"]:
        pid = json.dumps(s["prompt_id"], sort_keys=True, default=str)
        by.setdefault(pid, []).append(Sample(bool(s["correct"]), _hashable(s.get("answer")),
                                             int(s.get("length", 0)),
                                             bool(s.get("truncated", False))))
    return list(by), list(by.values())


def _hashable(x):
    return json.dumps(x, sort_keys=True) if isinstance(x, (list, dict)) else x


def bootstrap_diff(a: list[list[Sample]], b: list[list[Sample]], ks: Sequence[int],
                   paired: bool, rounds: int = 1000, seed: int = 0,
                   level: float = 0.95) -> dict[str, tuple[float, float]]:
    """``{metric: (lo, hi)}``: the central ``level`` interval of ``metric(B) - metric(A)`` over
    ``rounds`` resamples of prompts (``paired``: the same prompt indices on both sides)."""
    rng = random.Random(seed)
    diffs: dict[str, list[float]] = {}
    for _ in range(rounds):
        ia = [rng.randrange(len(a)) for _ in a]
        ib = ia if paired else [rng.randrange(len(b)) for _ in b]
        ma = set_metrics([a[i] for i in ia], ks)
        mb = set_metrics([b[i] for i in ib], ks)
        for key in ma:
            if key.startswith(SHOWN):
                diffs.setdefault(key, []).append(mb[key] - ma[key])
    lo_q, hi_q = (1 - level) / 2, 1 - (1 - level) / 2
    return {k: (_quantile(v, lo_q), _quantile(v, hi_q)) for k, v in diffs.items()}


def _quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def compare(path_a: str, path_b: str, rounds: int = 1000, seed: int = 0) -> list[dict]:
    """Per set evaluated on both sides: ``{"set", "paired", "rows": [(metric, a, b, b - a, lo,
    hi)]}``; metrics are recomputed from the samples at the k both sides share."""
    ra, rb = load_results(path_a), load_results(path_b)
    common = [s for s in ra if s in rb]
    if not common:
        raise ValueError(f"eval --compare: no set evaluated on both sides ({sorted(ra)} vs "
                         f"{sorted(rb)})")
    out = []
    for name in common:
        ids_a, ga = groups_of(ra[name])
        ids_b, gb = groups_of(rb[name])
        n = min(len(ga[0]), len(gb[0]))
        ks = sorted(set(ra[name]["settings"]["k"]) & set(rb[name]["settings"]["k"])
                    & set(range(1, n + 1))) or [1]
        ga, gb = [g[:n] for g in ga], [g[:n] for g in gb]
        paired = ids_a == ids_b
        ma, mb = set_metrics(ga, ks), set_metrics(gb, ks)
        ci = bootstrap_diff(ga, gb, ks, paired, rounds, seed)
        rows = [(k, ma[k], mb[k], mb[k] - ma[k], *ci[k]) for k in shown_keys(ma)]
        out.append({"set": name, "paired": paired, "n": n, "rows": rows})
    return out


def format_compare(results: list[dict], name_a: str, name_b: str) -> str:
    """The comparison table: per set and metric, A, B, B - A and its 95% bootstrap interval."""
    lines = [f"A = {name_a}", f"B = {name_b}"]
    for r in results:
        lines += ["", f"{r['set']} (n={r['n']}, {'paired' if r['paired'] else 'unpaired'} "
                      "bootstrap over prompts)",
                  f"{'metric':<16}{'A':>10}{'B':>10}{'B - A':>10}   95% CI of B - A"]
        for key, a, b, d, lo, hi in r["rows"]:
            mark = " *" if lo > 0 or hi < 0 else ""
            lines.append(f"{key:<16}{_fmt(a):>10}{_fmt(b):>10}{d:>+10.4f}   "
                         f"[{lo:+.4f}, {hi:+.4f}]{mark}")
    lines += ["", "* the interval excludes 0"]
    return "\n".join(lines)
