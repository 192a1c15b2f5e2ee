"""What every weight sync strategy shares: the pause/flush/version/continue protocol, spot
checks through ``/get_weights_by_name`` and the probe sequence."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Iterable

import torch

from megatron_rl.rollout.fleet import ServerError, http_json

Bucket = list[tuple[str, torch.Tensor]]


class WeightSyncError(RuntimeError):
    """A server did not accept the weights, or its weights/log-probs differ from the actor's."""


def post_all(urls: list[str], path: str, body: dict | None = None, timeout: float = 600.0
             ) -> list:
    """POST ``body`` to ``url + path`` on every server in parallel; raise on any failure."""
    def one(u: str):
        reply = http_json("POST", u + path, body or {}, timeout=timeout)
        if isinstance(reply, dict) and reply.get("success") is False:
            raise WeightSyncError(f"{u}{path}: {reply.get('message')}")
        return reply

    if not urls:
        return []
    with ThreadPoolExecutor(len(urls)) as pool:
        try:
            return list(pool.map(one, urls))
        except ServerError as exc:
            raise WeightSyncError(str(exc)) from None


class SyncStrategy:
    """Base class. ``begin``/``commit``/``resume`` run on the coordinator (one process);
    ``send`` on every sender (one per pipeline stage) in parallel; ``spot_check`` on each sender
    after ``commit``."""

    name = "base"

    def __init__(self, urls: list[str], sync_dir: str, sender: int = 0,
                 model_path: str | None = None, spots_per_send: int = 2,
                 server_tp: int = 1) -> None:
        self.urls, self.sync_dir, self.sender = list(urls), sync_dir, sender
        self.server_tp = server_tp  # ranks per server (SGLang --tp-size) in a weight group
        self.model_path, self.spots_per_send = model_path, spots_per_send
        self.spots: list[tuple[str, list]] = []

    # ---- coordinator ---------------------------------------------------------------------------
    def begin(self, version: int) -> None:
        """Pause generation (aborting leftovers) and flush the KV cache on every server."""
        post_all(self.urls, "/pause_generation", {"mode": "abort"})
        post_all(self.urls, "/flush_cache")

    def commit(self, version: int) -> None:
        """Make the sent weights live (strategy specific) and set the weight version."""
        post_all(self.urls, "/update_weight_version", {"new_version": str(version),
                                                       "abort_all_requests": False})
        post_all(self.urls, "/flush_cache")

    def resume(self) -> None:
        post_all(self.urls, "/continue_generation")

    # ---- senders -------------------------------------------------------------------------------
    def send(self, buckets: Iterable[Bucket], version: int) -> int:
        """Push every bucket; returns the bytes sent. Records spot-check samples."""
        self.spots = []
        self.start_send(version)
        total = 0
        for bucket in buckets:
            self._remember_spots(bucket)
            total += sum(t.numel() * t.element_size() for _, t in bucket)
            self.send_bucket(bucket, version)
        self.finish_send(version)
        return total

    def start_send(self, version: int) -> None:
        """Before this sender's first bucket."""

    def send_bucket(self, bucket: Bucket, version: int) -> None:
        raise NotImplementedError

    def finish_send(self, version: int) -> None:
        """After this sender's last bucket (e.g. flush files)."""

    def _remember_spots(self, bucket: Bucket) -> None:
        """The first tensor of each of the first ``spots_per_send`` buckets (2 rows of it)."""
        if bucket and len(self.spots) < self.spots_per_send:
            name, t = bucket[0]
            self.spots.append((name, t.detach()[:2].float().cpu().tolist()))  # 2 rows only

    def spot_check(self, atol: float = 0.0) -> list[str]:
        """``/get_weights_by_name`` of the remembered tensors on every server; mismatches."""
        errors = []
        for name, rows in self.spots:
            for u in self.urls:
                got = http_json("POST", u + "/get_weights_by_name",
                                {"name": name, "truncate_size": len(rows)})
                a, b = torch.tensor(got, dtype=torch.float32), torch.tensor(rows)
                if a.shape != b.shape or not torch.allclose(a, b, atol=atol, rtol=0):
                    errors.append(f"{u}: {name} differs from the sent tensor")
        return errors


def probe_tokens(vocab_size: int, length: int, seed: int = 20260) -> list[int]:
    """A fixed pseudo-random token sequence for the probe (ids in ``[2, vocab)``)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, vocab_size, (length,), generator=g).tolist()


def engine_probe_logprobs(url: str, ids: list[int]) -> list[float]:
    """``log p(ids[t] | ids[<t])``, t >= 1, computed by the server (SGLang
    ``input_token_logprobs`` with ``logprob_start_len=0``)."""
    reply = http_json("POST", url + "/generate", {
        "input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
        "return_logprob": True, "logprob_start_len": 0}, timeout=120.0)
    lps = reply["meta_info"]["input_token_logprobs"]
    return [float(lp) for lp, *_ in lps[1:]]


def probe_check(urls: list[str], ids: list[int], actor_logp: list[float], tol: float
                ) -> tuple[float, list[str]]:
    """Max |engine - actor| probe log-prob over every server, and the servers over ``tol``."""
    worst, errors = 0.0, []
    ref = torch.tensor(actor_logp, dtype=torch.float64)
    for u in urls:
        got = torch.tensor(engine_probe_logprobs(u, ids), dtype=torch.float64)
        d = float((got - ref).abs().max()) if got.shape == ref.shape else float("inf")
        worst = max(worst, d)
        if not d <= tol:
            errors.append(f"{u}: probe log-probs differ from the actor's by {d:.3g} > {tol:g}")
    return worst, errors
