"""Dynamic sampling with a fleet: stop a generation round as soon as its outcome is decided.

DAPO's sampler keeps the first ``train_batch_size`` groups (in prompt order) whose metric has
non-zero std. :func:`prefix_stop_rule` returns a ``stop_when(i, group)`` callback for
:meth:`SGLangEngine.generate`: it scores each completed group, and once the groups ``0..k`` are
all complete and hold enough kept groups, the remaining requests are aborted. Because only the
complete prefix counts, the kept groups are exactly those a full round would keep (the run stays
deterministic); only never-used leftovers are skipped.
"""

from __future__ import annotations

from typing import Callable, Sequence


def prefix_stop_rule(rows: Sequence[dict], tokenizer, score_fn: Callable[[dict, str], float],
                     metric: str, need: int) -> Callable[[int, list], bool] | None:
    """The callback, or None when ``metric`` is not decided by the raw score alone."""
    if metric not in ("acc", "score") or need <= 0:
        return None
    kept: dict[int, bool] = {}
    state = {"next": 0, "kept": 0}

    def value(row: dict, comp) -> float:
        try:
            s = float(score_fn(row, tokenizer.decode(comp.response_ids)))
        except Exception:  # noqa: BLE001 - a failing reward scores 0, as in generate_records
            s = 0.0
        return float(s >= 1.0) if metric == "acc" else s

    def stop_when(i: int, group: list) -> bool:
        vals = [value(rows[i], c) for c in group]
        kept[i] = max(vals) != min(vals)
        while state["next"] in kept:
            state["kept"] += kept[state["next"]]
            state["next"] += 1
        return state["kept"] >= need

    return stop_when
