"""``teacher.engine: sglang``: the distillation teacher served by SGLang servers (or our
``serve``), behind a router or as one server URL (docs/distillation.md).

Rank 0 scores the step's batch before it is scattered: every row (prompt + response token ids,
up to its last valid token) is one ``/generate`` request with ``return_logprob`` and
``logprob_start_len: 0`` (one greedy token is generated and ignored), the same body the weight
sync's probe sends; the reply's ``meta_info.input_token_logprobs`` hold ``log p(ids[t] |
ids[<t])`` for every position. SGLang computes them from unscaled logits, i.e. at temperature 1,
so this engine needs ``actor.temperature: 1`` (checked at load time).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch

from megatron_rl.rollout.weight_sync.common import engine_probe_logprobs


def row_ids(tokens: torch.Tensor, mask: torch.Tensor) -> list[list[int] | None]:
    """Per row of ``tokens``/``mask`` ``[N, S]`` (host): the ids up to the row's last valid
    (response) token, None for a row without one (padding rows)."""
    out: list[list[int] | None] = []
    for t, m in zip(tokens.tolist(), mask.bool().tolist()):
        last = max((i for i, v in enumerate(m) if v), default=-1)
        out.append(t[:last + 1] if last > 0 else None)
    return out


class SGLangTeacher:
    """Teacher log-probs of given token ids from an SGLang endpoint (``url``: a router or one
    server), ``concurrency`` requests in flight."""

    def __init__(self, url: str, concurrency: int = 32) -> None:
        self.url, self.concurrency = url.rstrip("/"), max(1, int(concurrency))

    def batch_logprobs(self, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``[N, S]`` fp32 on the host: the teacher's log-prob of each valid token of ``tokens``
        given the tokens before it; 0 elsewhere. One request per row with a valid token."""
        rows = row_ids(tokens, mask)
        out = torch.zeros(tokens.shape, dtype=torch.float32)
        todo = [i for i, ids in enumerate(rows) if ids is not None]
        with ThreadPoolExecutor(min(self.concurrency, max(1, len(todo)))) as pool:
            lps = list(pool.map(lambda i: engine_probe_logprobs(self.url, rows[i]), todo))
        for i, lp in zip(todo, lps):
            n = len(rows[i])
            if len(lp) != n - 1:
                raise RuntimeError(f"teacher server {self.url} returned {len(lp)} prompt-token "
                                   f"log-probs for {n} ids (expected {n - 1})")
            out[i, 1:n] = torch.tensor(lp, dtype=torch.float32)
        return torch.where(mask.bool(), out, 0.0)
