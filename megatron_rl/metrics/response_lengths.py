"""The response-length histogram of a run: ``OUTPUT_DIR/response_lengths.json``, updated every
step from the generated responses (rank 0), read by ``plan --lengths-file`` to price padding.

Format: ``{"cap": rollout.max_new_tokens, "bins": 64, "counts": [...]}``, bin ``b`` counting
lengths in ``[b * cap / bins, (b + 1) * cap / bins)`` (the last bin includes the cap).
"""

from __future__ import annotations

import json
import os
from typing import Sequence

HISTOGRAM_FILE = "response_lengths.json"
HISTOGRAM_BINS = 64


def histogram(lengths: Sequence[int], cap: int, bins: int = HISTOGRAM_BINS,
              counts: list[int] | None = None) -> dict:
    """Histogram of response lengths in ``bins`` equal bins over ``[0, cap]`` (added to
    ``counts`` when given)."""
    counts = list(counts) if counts is not None else [0] * bins
    for n in lengths:
        counts[min(bins - 1, int(n) * bins // max(cap, 1))] += 1
    return {"cap": int(cap), "bins": bins, "counts": counts}


def write_histogram(output_dir: str, lengths: Sequence[int], cap: int) -> str:
    """Add this step's response ``lengths`` to ``output_dir/response_lengths.json`` (atomic)."""
    path = os.path.join(output_dir, HISTOGRAM_FILE)
    prev = None
    if os.path.exists(path):
        with open(path) as f:
            prev = json.load(f)
        if prev.get("cap") != cap or prev.get("bins") != HISTOGRAM_BINS:
            prev = None  # a different cap: start again
    data = histogram(lengths, cap, counts=None if prev is None else prev["counts"])
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)
    return path
