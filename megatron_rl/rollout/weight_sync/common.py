"""What every weight sync strategy shares: the pause/flush/version/continue protocol, spot
checks through ``/get_weights_by_name`` and the probe sequence."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Iterable, NamedTuple

import torch

from megatron_rl.rollout.fleet import ServerError, http_json

Bucket = list[tuple[str, torch.Tensor]]


class WeightSyncError(RuntimeError):
    """A server did not accept the weights, or its weights/log-probs differ from the actor's."""


def post_each(urls: list[str], fn) -> None:
    """``fn(url)`` for every server in parallel; the first error is raised."""
    if urls:
        with ThreadPoolExecutor(len(urls)) as pool:
            list(pool.map(fn, urls))


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


def flush_cache(url: str, retries: int = 60, wait_s: float = 1.0, timeout_s: float = 30.0
                ) -> None:
    """``/flush_cache`` on one server, bounded. SGLang refuses a flush (HTTP 400) while its
    scheduler still holds requests, and ``/pause_generation`` in abort mode can return before
    the aborted requests are gone: ``?timeout=`` makes SGLang >= 0.5.21 wait for idle itself
    (older servers ignore it), and a refused flush is retried ``retries`` times ``wait_s`` apart
    (slime: 60 x 1 s)."""
    last = None
    for attempt in range(retries + 1):
        try:
            http_json("POST", f"{url}/flush_cache?timeout={timeout_s:g}",
                      timeout=timeout_s + 30.0)
            return
        except ServerError as exc:
            if "HTTP 400" not in str(exc):
                raise WeightSyncError(str(exc)) from None
            last = exc
        if attempt < retries:
            time.sleep(wait_s)
    raise WeightSyncError(f"{url}/flush_cache refused {retries + 1} times (requests still "
                          f"running): {last}")


def flush_all(urls: list[str], retries: int = 60, wait_s: float = 1.0,
              timeout_of=lambda url: 30.0) -> None:
    """:func:`flush_cache` on every server in parallel (``timeout_of(url)``: its ``?timeout=``)."""
    if urls:
        with ThreadPoolExecutor(len(urls)) as pool:
            list(pool.map(lambda u: flush_cache(u, retries, wait_s, timeout_of(u)), urls))


RETRACT_SINCE = (0, 5, 21)  # the first SGLang release that reports per-token weight versions


def release_tuple(version: str) -> tuple[int, ...]:
    """``"0.5.21"`` / ``"0.5.21.post1"`` / ``"0.5.22rc0"`` -> ``(0, 5, 21)`` / ... (the leading
    numeric fields); ``()`` for anything else (e.g. an unknown server)."""
    import re

    m = re.match(r"\s*(\d+(?:\.\d+)*)", str(version or ""))
    return tuple(int(x) for x in m.group(1).split(".")) if m else ()


def pause_mode_for(version: str, partial: bool) -> str:
    """The ``/pause_generation`` mode a weight sync uses on a server reporting ``version``
    (``/server_info``'s ``"version"``): ``"retract"`` where the run keeps partial rollouts
    (``rollout.partial``) and the server is SGLang >= 0.5.21 (or our ``serve`` with its rules):
    running requests go back to the waiting queue, keep their tokens, and report per-token
    ``weight_versions`` spans; ``"abort"`` otherwise: the requests come back aborted with their
    tokens, and the client sends them again -- from the kept prefix with ``rollout.partial``,
    from scratch without (``rollout/redone_tokens``). ``in_place`` is never used: it keeps the
    old weights' KV cache and SGLang then refuses the ``/flush_cache`` a sync needs."""
    return "retract" if partial and release_tuple(version) >= RETRACT_SINCE else "abort"


@dataclass(frozen=True)
class ServerLayout:
    """How one server spreads the model over its GPUs, as its ``/server_info`` reports it
    (SGLang's resolved server arguments, top-level keys)."""

    tp: int = 1  # tp_size: ranks that each hold a shard; every one joins a weight group
    dp: int = 1  # dp_size: data-parallel replicas inside the server
    pp: int = 1  # pp_size
    dp_attention: bool = False  # enable_dp_attention (DP inside the TP ranks)


def read_server_layout(url: str, timeout: float = 30.0) -> ServerLayout:
    """``tp_size``/``dp_size``/``pp_size``/``enable_dp_attention`` of the server at ``url``:
    ``GET /server_info`` (SGLang 0.5.21, whose ``/get_server_info`` is a deprecated alias),
    ``/get_server_info`` where ``/server_info`` is missing (older SGLang)."""
    try:
        try:
            info = http_json("GET", url + "/server_info", timeout=timeout)
        except ServerError as exc:
            if "HTTP 404" not in str(exc):
                raise
            info = http_json("GET", url + "/get_server_info", timeout=timeout)
    except ServerError as exc:
        raise WeightSyncError(f"cannot read the server's TP size: {exc}") from None
    if not isinstance(info, dict) or "tp_size" not in info:
        raise WeightSyncError(f"{url}/server_info reports no tp_size: {str(info)[:200]}")
    return ServerLayout(int(info["tp_size"]), int(info.get("dp_size") or 1),
                        int(info.get("pp_size") or 1), bool(info.get("enable_dp_attention")))


def layout_error(url: str, layout: ServerLayout, strategy: str) -> str | None:
    """Why ``strategy`` cannot update this server, None when it can. SGLang 0.5.21 refuses
    tensor and distributed updates with ``dp_size > 1`` unless DP attention is on (an assert in
    its tokenizer manager), and its ranks join a weight group as ``rank_offset + tp_rank``,
    which collides across pipeline stages."""
    if strategy not in ("from_tensor", "from_distributed"):
        return None
    if layout.dp > 1 and not layout.dp_attention:
        return (f"{url} runs dp_size={layout.dp} without --enable-dp-attention: SGLang refuses "
                f"{strategy} updates there; use rollout.sglang.weight_sync=from_disk or "
                "one server per replica")
    if strategy == "from_distributed" and layout.pp > 1:
        return (f"{url} runs pp_size={layout.pp}: its ranks would join the weight group under "
                "colliding ranks (rank_offset + tp_rank per stage); use from_disk")
    return None


class SyncStrategy:
    """Base class. ``begin``/``commit``/``resume`` run on the coordinator (one process);
    ``send`` on every sender (one per pipeline stage) in parallel; ``spot_check`` on each sender
    after ``commit``.

    Strategies with ``needs_session`` (tensor, distributed) send inside SGLang's weight-update
    session (``/begin_weight_update`` ... ``/end_weight_update``, required from SGLang 0.5.21;
    a server that answers 404 to begin is older and is updated without one)."""

    name = "base"
    needs_session = False
    quantization: str | None = None  # rollout.sglang.quantization: "fp8" sends block FP8
    scale_fmt = "float32"  # rollout.sglang.fp8_scale_fmt (megatron_rl.rollout.fp8)
    quant_s = 0.0  # seconds the last send spent quantising (time/weight_quant)

    def __init__(self, urls: list[str], sync_dir: str, sender: int = 0,
                 model_path: str | None = None, spots_per_send: int = 0,
                 server_tp: int | None = None) -> None:
        self.urls, self.sync_dir, self.sender = list(urls), sync_dir, sender
        self.server_tp = server_tp  # ranks of every server; None: each one's /server_info
        self.server_tps: dict[str, int] = {}  # url -> its tp_size, read once per url
        self.model_path, self.spots_per_send = model_path, spots_per_send
        self.spots: list[tuple[str, list]] = []
        self.flush_retries, self.flush_wait_s = 60, 1.0
        self.sessions: set[str] = set()  # servers with an open weight-update session
        self.no_session: set[str] = set()  # servers without sessions (SGLang <= 0.5.20)
        self.epoch, self.paused = 0, False  # syncs begun; paused between begin and resume
        self.partial = False  # rollout.partial: keep in-flight requests' tokens across a sync
        self.pause_modes: dict[str, str] = {}  # url -> its pause mode (pause_mode_for), once
        # actor.lora.sync=adapter: always "abort" (a retracted request keeps the adapter it
        # started with, and SGLang's unload of that adapter waits for it: the sync would block)
        self.adapter_sync = False
        self.lora_checked: set[str] = set()  # servers whose /server_info has enable_lora

    def pause_mode(self, url: str) -> str:
        """The ``/pause_generation`` mode of the server at ``url`` (:func:`pause_mode_for` of its
        ``/server_info`` version, read once; ``"abort"`` where it cannot be read, and with
        adapter-only LoRA sync)."""
        if not self.partial or self.adapter_sync:
            return "abort"
        if url not in self.pause_modes:
            try:
                info = http_json("GET", url + "/server_info", timeout=30.0)
            except ServerError:
                info = {}
            version = info.get("version", "") if isinstance(info, dict) else ""
            self.pause_modes[url] = pause_mode_for(version, True)
        return self.pause_modes[url]

    def tp_of(self, url: str) -> int:
        """TP ranks of the server at ``url`` (each gets its own tensor payload and joins a weight
        group): ``server_tp`` when fixed, else the server's ``/server_info`` (read once; a
        layout this strategy cannot update raises :class:`WeightSyncError`)."""
        if self.server_tp is not None:
            return self.server_tp
        if url not in self.server_tps:
            layout = read_server_layout(url)
            err = layout_error(url, layout, self.name)
            if err:
                raise WeightSyncError(err)
            self.server_tps[url] = layout.tp
        return self.server_tps[url]

    def rank_offsets(self) -> list[int]:
        """Index of each server's first TP rank when the ranks of ``urls`` are counted in
        order (``offsets[i] + r`` is rank ``r`` of server ``i``); one more entry: the total."""
        offsets = [0]
        for u in self.urls:
            offsets.append(offsets[-1] + self.tp_of(u))
        return offsets

    # ---- coordinator ---------------------------------------------------------------------------
    def begin(self, version: int, session: bool = True) -> None:
        """Pause generation (each server in its :meth:`pause_mode`: running requests retracted
        with their tokens kept, or aborted), flush the KV cache (bounded retries while aborted
        requests drain) and open the weight-update session on every server (``session=False``:
        no base weights follow, e.g. an adapter-only LoRA sync)."""
        self.epoch += 1  # before the pause: the client re-queues the requests it aborts
        self.paused = True
        post_each(self.urls, lambda u: post_all([u], "/pause_generation",
                                                {"mode": self.pause_mode(u)}))
        self.flush()
        if self.needs_session and session:
            post_each(self.urls, self._begin_session)

    def _begin_session(self, url: str) -> None:
        """``/begin_weight_update`` on one server: 404 -> an older server (no sessions); a
        session left open by a failed sync is closed and opened again."""
        if url in self.no_session:
            return
        for _ in range(2):
            try:
                http_json("POST", url + "/begin_weight_update", {}, timeout=120.0)
                self.sessions.add(url)
                return
            except ServerError as exc:
                if "HTTP 404" in str(exc):
                    self.no_session.add(url)
                    return
                if "already open" not in str(exc):
                    raise WeightSyncError(str(exc)) from None
                self._end_session(url)
        raise WeightSyncError(f"{url}/begin_weight_update: a session stays open")

    def _end_session(self, url: str) -> None:
        """``/end_weight_update`` on one server (a no-op where no session was opened here)."""
        self.sessions.discard(url)
        try:
            http_json("POST", url + "/end_weight_update", {}, timeout=120.0)
        except ServerError as exc:
            if "no weight-update session" not in str(exc) and "HTTP 404" not in str(exc):
                raise WeightSyncError(str(exc)) from None

    def end_sessions(self) -> None:
        """Close every session opened by :meth:`begin` (best effort on dead servers)."""
        for u in list(self.sessions):
            try:
                self._end_session(u)
            except WeightSyncError:
                pass

    def commit(self, version: int) -> None:
        """Make the sent weights live (strategy specific: close the session), set the weight
        version, flush the cache."""
        if self.needs_session:
            post_each([u for u in self.urls if u in self.sessions], self._end_session)
        post_all(self.urls, "/update_weight_version", {"new_version": str(version),
                                                       "abort_all_requests": False})
        self.flush()

    def flush(self) -> None:
        """Flush every server's KV cache while paused. A server paused with ``retract`` holds
        its requests in the waiting queue: SGLang 0.5.21 flushes then only without a timeout
        (its ``?timeout=`` waits for an empty waiting queue, which never comes before
        ``/continue_generation``); a server paused with ``abort`` gets ``?timeout=30`` to wait
        for the aborted requests to drain."""
        flush_all(self.urls, self.flush_retries, self.flush_wait_s,
                  lambda u: 0.0 if self.pause_mode(u) == "retract" else 30.0)

    def resume(self) -> None:
        """Continue generation on every server that answers (closing a session a failed sync
        left open); the servers that did not are named in the error raised at the end."""
        self.end_sessions()
        failed = []
        for u in self.urls:
            try:
                post_all([u], "/continue_generation")
            except WeightSyncError as exc:
                failed.append(str(exc))
        self.paused = False
        if failed:
            raise WeightSyncError(f"continue_generation failed: {failed}")

    # ---- senders -------------------------------------------------------------------------------
    def wire_buckets(self, buckets: Iterable[Bucket]) -> Iterable[Bucket]:
        """The buckets as they go out: with ``quantization="fp8"`` each one quantised as the
        stream yields it, on its own device (:func:`megatron_rl.rollout.fp8.quantize_buckets`:
        the layers SGLang quantises as FP8 + ``weight_scale_inv``, the rest unchanged), the time
        spent summed into :attr:`quant_s`; else unchanged."""
        self.quant_s = 0.0
        if self.quantization != "fp8":
            return buckets
        from megatron_rl.rollout.fp8 import quantize_buckets

        return quantize_buckets(buckets, self.scale_fmt, self)

    def add_quant_time(self, seconds: float) -> None:
        """Called by :func:`megatron_rl.rollout.fp8.quantize_buckets` per bucket."""
        self.quant_s += seconds

    def send(self, buckets: Iterable[Bucket], version: int) -> int:
        """Push every bucket; returns the bytes sent. Records spot-check samples."""
        self.spots = []
        buckets = self.wire_buckets(buckets)
        self.start_send(version)
        total = 0
        try:
            for bucket in buckets:
                self._remember_spots(bucket)
                total += sum(t.numel() * t.element_size() for _, t in bucket)
                self.send_bucket(bucket, version)
        except BaseException:
            try:
                self.finish_send(version)  # release files / pending posts
            except Exception:  # noqa: BLE001 - the first error is the one raised
                pass
            raise
        self.finish_send(version)
        return total

    def start_send(self, version: int) -> None:
        """Before this sender's first bucket."""

    def send_bucket(self, bucket: Bucket, version: int) -> None:
        raise NotImplementedError

    def finish_send(self, version: int) -> None:
        """After this sender's last bucket (e.g. flush files)."""

    def _remember_spots(self, bucket: Bucket) -> None:
        """The first tensor of each of the first ``spots_per_send`` buckets (2 rows of it); an
        FP8 bucket's first tensor the server holds as sent (FP8 weights and their scales are
        held dequantised)."""
        if bucket and len(self.spots) < self.spots_per_send:
            from megatron_rl.rollout.fp8 import FP8_DTYPE, SCALE_SUFFIX

            kept = [(n, t) for n, t in bucket
                    if t.dtype != FP8_DTYPE and not n.endswith(SCALE_SUFFIX)]
            if kept:
                name, t = kept[0]
                self.spots.append((name, t.detach()[:2].float().cpu().tolist()))  # 2 rows only

    def spot_check(self, atol: float = 0.0) -> list[str]:
        """``/get_weights_by_name`` of the remembered tensors on every server; mismatches.
        (Off by default: SGLang's Qwen2/Qwen3 models have no ``get_weights_by_name`` and answer
        400, and where it exists it converts a TP shard to a Python list.)"""
        errors = []
        for name, rows in self.spots:
            for u in self.urls:
                try:
                    got = http_json("POST", u + "/get_weights_by_name",
                                    {"name": name, "truncate_size": len(rows)})
                except ServerError as exc:
                    raise WeightSyncError(
                        f"{exc}; this server cannot read weights back (SGLang supports "
                        "/get_weights_by_name only for some models, e.g. not Qwen2/Qwen3): set "
                        "rollout.sglang.spot_checks=0 (the probe still verifies the sync)"
                    ) from None
                a, b = torch.tensor(got, dtype=torch.float32), torch.tensor(rows)
                if a.shape != b.shape or not torch.allclose(a, b, atol=atol, rtol=0):
                    errors.append(f"{u}: {name} differs from the sent tensor")
        return errors


def weights_checksums(urls: list[str]) -> dict[str, str | None]:
    """``/weights_checker {"action": "checksum"}`` of every server: ``url -> per_engine_checksum``
    (a hash of every weight of the engine, all TP ranks), None where the server has no such
    endpoint (404) or cannot compute it (400, e.g. SGLang on CPU)."""
    def one(u: str) -> str | None:
        try:
            reply = http_json("POST", u + "/weights_checker", {"action": "checksum"},
                              timeout=300.0)
        except ServerError as exc:
            if "HTTP 404" in str(exc) or "HTTP 400" in str(exc):
                return None
            raise WeightSyncError(str(exc)) from None
        return reply.get("per_engine_checksum") if isinstance(reply, dict) else None

    if not urls:
        return {}
    with ThreadPoolExecutor(len(urls)) as pool:
        return dict(zip(urls, pool.map(one, urls)))


def checksum_disagreement(sums: dict[str, str | None]) -> list[str]:
    """Servers whose checksum differs from the most common one (servers of one fleet share
    model and TP size, so after a sync every engine must hold the same weights)."""
    known = [v for v in sums.values() if v is not None]
    if len(known) < 2:
        return []
    major = max(set(known), key=known.count)
    return [f"{u}: weights checksum {v[:12]} differs from the fleet's {major[:12]}"
            for u, v in sums.items() if v is not None and v != major]


def probe_tokens(vocab_size: int, length: int, seed: int = 20260) -> list[int]:
    """A fixed pseudo-random token sequence for the probe (ids in ``[2, vocab)``)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, vocab_size, (length,), generator=g).tolist()


def engine_probe_logprobs(url: str, ids: list[int], lora: str | None = None) -> list[float]:
    """``log p(ids[t] | ids[<t])``, t >= 1, computed by the server (SGLang
    ``input_token_logprobs`` with ``logprob_start_len=0``); ``lora``: with that loaded LoRA
    adapter (SGLang's ``lora_path``)."""
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
            "return_logprob": True, "logprob_start_len": 0}
    if lora:
        body["lora_path"] = lora
    reply = http_json("POST", url + "/generate", body, timeout=120.0)
    lps = reply["meta_info"]["input_token_logprobs"]
    return [float(lp) for lp, *_ in lps[1:]]


class ProbeGap(NamedTuple):
    """Engine vs actor log-probs of the probe sequence, one server: ``mean`` |gap| over its
    tokens (the statistic the sync is checked on) and the largest single-token gap (reported)."""

    mean: float
    max: float


def probe_gap(engine_logp: list[float], actor_logp: list[float]) -> ProbeGap:
    """:class:`ProbeGap` of two per-token log-prob lists (infinite when their lengths differ or
    they are empty; NaN stays NaN and fails every tolerance)."""
    got = torch.tensor(engine_logp, dtype=torch.float64)
    ref = torch.tensor(actor_logp, dtype=torch.float64)
    if got.shape != ref.shape or ref.numel() == 0:
        return ProbeGap(float("inf"), float("inf"))
    d = (got - ref).abs()
    return ProbeGap(float(d.mean()), float(d.max()))


def probe_failure(url: str, gap: ProbeGap, tol: float, tokens: int) -> str | None:
    """The error of a server whose mean probe gap is over ``tol`` (or NaN), else None."""
    if gap.mean <= tol:
        return None
    return (f"{url}: probe log-probs differ from the actor's by {gap.mean:.3g} on average over "
            f"{tokens} tokens (largest {gap.max:.3g}) > {tol:g}")


def probe_gaps(urls: list[str], ids: list[int], actor_logp: list[float],
               lora: str | None = None) -> dict[str, ProbeGap]:
    """:class:`ProbeGap` of every server's teacher-forced log-probs of ``ids`` vs the actor's
    (``lora``: with that loaded adapter)."""
    return {u: probe_gap(engine_probe_logprobs(u, ids, lora), actor_logp) for u in urls}


def worst_gap(gaps: Iterable[ProbeGap]) -> ProbeGap:
    """The largest mean and the largest single-token gap over servers (NaN wins)."""
    gaps = list(gaps)
    if not gaps:
        return ProbeGap(0.0, 0.0)
    return ProbeGap(*(max(vals, key=lambda v: (v != v, v)) for vals in zip(*gaps)))


def probe_servers(urls: list[str], ids: list[int], actor_logp: list[float], tol: float,
                  lora: str | None = None) -> tuple[ProbeGap, list[str]]:
    """The worst :class:`ProbeGap` over every server's teacher-forced log-probs of ``ids`` vs the
    actor's, and the errors of the servers whose mean gap is over ``tol``
    (``rollout.sglang.probe_tolerance``; the rule: docs/gpu.md); ``lora``: the servers compute
    with that loaded adapter."""
    gaps = probe_gaps(urls, ids, actor_logp, lora)
    errors = [e for u, g in gaps.items() if (e := probe_failure(u, g, tol, len(actor_logp)))]
    return worst_gap(gaps.values()), errors


def probe_check(urls: list[str], ids: list[int], actor_logp: list[float], tol: float
                ) -> tuple[float, list[str]]:
    """:func:`probe_servers` with the worst mean gap as a float."""
    gap, errors = probe_servers(urls, ids, actor_logp, tol)
    return gap.mean, errors
