"""``rollout.engine: sglang``: the :class:`~megatron_rl.rollout.engine.RolloutEngine` interface
over SGLang's HTTP API, through ``sglang-router``.

Every sample is one ``/generate`` request (``input_ids``, ``sampling_params`` with temperature,
top_p, max_new_tokens, stop_token_ids and a per-request ``sampling_seed``, ``return_logprob``);
its per-token log-probs come from ``meta_info.output_token_logprobs`` and its weight version from
``meta_info.weight_version``. At most ``concurrency`` requests are in flight (thread pool). A
request that fails (dead server, timeout, unexpected abort) is retried through the router after
the fleet's health check removed the dead server, so no sample is lost and no group is shortened;
its per-request seed makes the retry produce what the first server would have. ``stop_when``
lets a caller (dynamic sampling) stop early: queued requests are cancelled and in-flight ones
aborted (``/abort_request``), and only complete groups are returned.

Partial rollouts (``rollout.partial``, default on): a weight sync never throws generated tokens
away. SGLang >= 0.5.21 servers are paused with ``mode: "retract"`` (the request keeps its tokens
and continues under the new weights; its reply's ``weight_versions`` spans give each token's
version). A server that can only abort returns the request with the tokens generated so far;
the client sends it again with those tokens appended to ``input_ids`` and ``max_new_tokens``
reduced by their count, and joins the pieces (each piece comes from one version). Each response
token carries the version that produced it and its log-prob under that version. Tokens generated
and then discarded (``rollout.partial: false``: aborted requests restart from scratch; or any
other abort) are counted in ``rollout/redone_tokens``.
"""

from __future__ import annotations

import threading
import uuid
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Callable, Iterable

from megatron_rl.rollout.engine import Bucket, Completion, SamplingParams
from megatron_rl.rollout.fleet import Fleet, ServerError, http_json
from megatron_rl.rollout.sampling import request_seed

if TYPE_CHECKING:
    import torch


class StaleResponseError(RuntimeError):
    """A response's weight version is older than ``max_offpolicy_lag`` allows."""


def parse_version(v) -> int:
    """SGLang's weight_version string -> int (-1 for ``"default"`` / unparsable)."""
    try:
        return int(v)
    except (TypeError, ValueError):
        return -1


def sampling_params_json(params: SamplingParams, stop_ids: list[int], seed: int) -> dict:
    """SGLang ``sampling_params`` of one request."""
    greedy = params.greedy or params.temperature <= 0
    return {"temperature": 0.0 if greedy else params.temperature, "top_p": params.top_p,
            "max_new_tokens": params.max_new_tokens, "stop_token_ids": stop_ids,
            "sampling_seed": seed, "skip_special_tokens": False}


def generate_request(prompt: list[int], params: SamplingParams, stop_ids: list[int], seed: int,
                     rid: str, routed_experts: bool = False, lora: str | None = None) -> dict:
    """The ``/generate`` body of one sample (SGLang ``GenerateReqInput`` fields);
    ``routed_experts``: ask for every token's MoE routing (``return_routed_experts``); ``lora``:
    the name of the loaded LoRA adapter to generate with (SGLang's ``lora_path``)."""
    req = {"input_ids": list(prompt), "sampling_params": sampling_params_json(params, stop_ids,
                                                                              seed),
           "return_logprob": True, "rid": rid, "stream": False}
    if routed_experts:
        req["return_routed_experts"] = True
    if lora:
        req["lora_path"] = lora
    return req


def token_versions(meta: dict, n: int) -> list[int] | None:
    """Per-token weight versions of a reply from SGLang >= 0.5.21's ``meta_info.weight_versions``
    spans (``[{"version", "start", "end"}]`` over the output tokens); None when the reply has no
    spans or a single one (every token from ``weight_version``)."""
    spans = meta.get("weight_versions") or []
    if len(spans) < 2:
        return None
    out = [parse_version(meta.get("weight_version"))] * n
    for sp in spans:
        for i in range(int(sp["start"]), min(int(sp["end"]), n)):
            out[i] = parse_version(sp["version"])
    return out


def completion_from_response(prompt: list[int], resp: dict,
                             routed_shape: tuple[int, int] | None = None
                             ) -> tuple[Completion, int]:
    """``(Completion, weight_version)`` of one ``/generate`` reply; the completion carries the
    version (SGLang: the one serving when the request finished) and per-token versions when the
    weights changed while it ran (partial rollout). ``routed_shape`` ``(layers, top_k)``: decode
    ``meta_info.routed_experts`` (an error when the server sent none: SGLang drops the request
    field unless the server runs with ``--enable-return-routed-experts``)."""
    meta = resp["meta_info"]
    lps = meta.get("output_token_logprobs") or []
    ids = [int(t) for _, t, *_ in lps] if lps else list(resp.get("output_ids") or [])
    finished = (meta.get("finish_reason") or {}).get("type") == "stop"
    version = parse_version(meta.get("weight_version"))
    routed = None
    if routed_shape is not None:
        from megatron_rl.rollout.routed_experts import decode

        if "routed_experts" not in meta:
            raise ServerError("actor.routing_replay=r3 asked for routed experts and the server "
                              "sent none: start SGLang with --enable-return-routed-experts")
        routed = decode(meta["routed_experts"], *routed_shape)
    return (Completion(prompt_ids=list(prompt), response_ids=ids,
                       logprobs=[float(lp) for lp, *_ in lps], finished=finished,
                       weight_version=version, token_versions=token_versions(meta, len(ids)),
                       routed_experts=routed),
            version)


class Prefix:
    """The tokens a request kept across aborts (partial rollouts): ids, their log-probs, the
    version of each, and (routing replay r3) the last aborted reply's routed experts
    ``[prompt + kept - 1, layers, top_k]`` int32, which cover every kept token."""

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.routed: torch.Tensor | None = None

    def extend(self, comp: Completion) -> None:
        """Append a reply's tokens (``comp``: its completion; per-token versions from its spans,
        else its ``weight_version`` for every token)."""
        n = len(comp.response_ids)
        self.ids += comp.response_ids
        self.logprobs += comp.logprobs[:n] + [0.0] * (n - len(comp.logprobs))
        self.versions += comp.token_versions or [comp.weight_version] * n
        if comp.routed_experts is not None:
            self.routed = comp.routed_experts

    def at_cap(self, prompt: list[int]) -> Completion:
        """The whole sample when the kept tokens already reach ``max_new_tokens`` (an abort
        that came exactly at the last token): nothing is sent again; the routed experts are
        the aborted reply's."""
        return self.join(prompt, Completion(prompt_ids=list(prompt), response_ids=[],
                                            logprobs=[], finished=False,
                                            weight_version=self.versions[-1]))

    def join(self, prompt: list[int], comp: Completion) -> Completion:
        """The whole sample: the kept tokens followed by ``comp`` (the reply to prompt + kept
        tokens); ``token_versions`` None when every token has one version."""
        versions = self.versions + (comp.token_versions or
                                    [comp.weight_version] * len(comp.response_ids))
        return Completion(prompt_ids=list(prompt), response_ids=self.ids + comp.response_ids,
                          logprobs=self.logprobs + comp.logprobs, finished=comp.finished,
                          weight_version=comp.weight_version,
                          token_versions=versions if len(set(versions)) > 1 else None,
                          routed_experts=comp.routed_experts if comp.routed_experts is not None
                          else self.routed)


def continued_params(params: SamplingParams, kept: int) -> SamplingParams:
    """``params`` of a request continued after ``kept`` tokens: ``max_new_tokens`` reduced."""
    import dataclasses

    return dataclasses.replace(params, max_new_tokens=params.max_new_tokens - kept)


class SGLangEngine:
    """Rollouts from a :class:`~megatron_rl.rollout.fleet.Fleet`; weights are pushed by
    :mod:`megatron_rl.rollout.weight_sync` (see :func:`megatron_rl.rollout.sync.sync_weights`)."""

    supports_stop_when = True  # generate(..., stop_when=) aborts leftovers

    def __init__(self, fleet: Fleet, eos_id: int, concurrency: int = 32,
                 max_retries: int = 3, max_offpolicy_lag: int = -1,
                 request_timeout_s: float = 600.0, sync=None) -> None:
        self.fleet, self.eos_id = fleet, eos_id
        self.concurrency, self.max_retries = concurrency, max_retries
        self.max_offpolicy_lag, self.timeout = max_offpolicy_lag, request_timeout_s
        self.sync = sync  # a weight_sync strategy (set by make_sglang_engine)
        self.partial = False  # rollout.partial (set with the sync's): continue aborted requests
        self.probe_length, self.probe_tolerance = 64, 1e-4
        self.routed_shape: tuple[int, int] | None = None  # (layers, top_k): routing replay r3
        self.weight_version = -1
        # actor.lora.sync=adapter: the servers keep the base and load the policy's adapters
        # (megatron_rl.rollout.weight_sync.lora_adapter); requests name the loaded adapter
        self.adapter_sync = False
        self.lora_name: str | None = None  # set once servers hold the adapter
        self.lora_base_urls: set[str] = set()  # servers that received the base weights
        self._lock = threading.Lock()
        self._metrics: dict[str, float] = {}
        self._lags: list[int] = []
        self._inflight: dict[str, bool] = {}
        self._stop = threading.Event()  # cancel_all: every request ends (rollout producer close)
        self._next_server = 0  # round robin of direct requests (routing replay r3)

    # ---- metrics ---------------------------------------------------------------------------------
    def _count(self, key: str, n: float = 1.0) -> None:
        with self._lock:
            self._metrics[key] = self._metrics.get(key, 0.0) + n

    def note_sync(self, values: dict[str, float]) -> None:
        """Metrics of the last weight sync (reported with the next rollout)."""
        with self._lock:
            self._metrics.update(values)

    def pop_metrics(self) -> dict[str, float]:
        """Counters and off-policy lag since the last call (``rollout/`` keys; a key that names
        its own group, ``time/weight_quant``, as it is)."""
        with self._lock:
            out = {k if "/" in k else f"rollout/{k}": v for k, v in self._metrics.items()}
            out.setdefault("rollout/redone_tokens", 0.0)
            if self._lags:
                out["rollout/offpolicy_lag"] = sum(self._lags) / len(self._lags)
                out["rollout/offpolicy_lag_max"] = float(max(self._lags))
            self._metrics, self._lags = {}, []
        return out

    # ---- one request -----------------------------------------------------------------------------
    def _one(self, prompt: list[int], params: SamplingParams, seed: int,
             cancel: threading.Event) -> Completion | None:
        """One sample, retried on failure; None when cancelled. A request a weight sync aborted
        is sent again: from its generated tokens (``partial``) or from scratch."""
        last = None
        attempt = requeued = 0
        kept = Prefix()
        while attempt <= self.max_retries:
            if cancel.is_set() or self._stop.is_set():
                return None
            if kept.ids and len(kept.ids) >= params.max_new_tokens:  # nothing left to generate
                return kept.at_cap(prompt)
            rid = uuid.uuid4().hex
            epoch = getattr(self.sync, "epoch", 0)  # weight syncs begun so far
            with self._lock:
                self._inflight[rid] = True
            # a continued request: its own seed (a fresh random stream for the rest)
            body = generate_request(prompt + kept.ids, continued_params(params, len(kept.ids)),
                                    [self.eos_id], request_seed(seed, len(kept.ids), 0)
                                    if kept.ids else seed, rid, self.routed_shape is not None,
                                    self.lora_name)
            try:
                resp = http_json("POST", self._generate_url(), body, timeout=self.timeout)
            except ServerError as exc:
                last = exc
                resp = None
            finally:
                with self._lock:
                    self._inflight.pop(rid, None)
            if cancel.is_set() or self._stop.is_set():
                return None
            if resp is not None:
                finish = (resp.get("meta_info", {}).get("finish_reason") or {}).get("type")
                if finish == "abort" and self._sync_aborted(epoch) and requeued < 100:
                    # a weight sync's pause (mode abort) ended it: sent again under the new
                    # weights (it waits at the server until continue_generation), from its
                    # tokens (partial) or from scratch with the same seed; not a failure
                    requeued += 1
                    self._count("aborted_requeued")
                    self._keep_or_redo(kept, prompt, resp)
                    continue
                if finish == "abort":
                    self._keep_or_redo(kept, prompt, resp, keep=False)
                if finish != "abort":
                    comp, version = completion_from_response(prompt + kept.ids, resp,
                                                             self.routed_shape)
                    comp = kept.join(prompt, comp) if kept.ids else comp
                    lag = max(0, self.weight_version - version)
                    if 0 <= self.max_offpolicy_lag < lag:
                        self._count("stale_refused")
                        last = StaleResponseError(f"weight version {version}, engine at "
                                                  f"{self.weight_version}")
                        attempt += 1
                        continue
                    if not params.validation:  # lag: of the samples trained on only
                        with self._lock:
                            self._lags.append(lag)
                    return comp
                last = ServerError(f"request {rid} was aborted by the server")
            attempt += 1
            self._count("request_retries")
            self.fleet.check_health()
        raise ServerError(f"a rollout request failed {self.max_retries + 1} times: {last}")

    def _keep_or_redo(self, kept: Prefix, prompt: list[int], resp: dict,
                      keep: bool | None = None) -> None:
        """An aborted reply: its tokens join ``kept`` (partial rollouts, ``keep`` None) or are
        thrown away with the kept ones (``keep=False``, or ``partial`` off), counted in
        ``redone_tokens``."""
        has_routed = "routed_experts" in (resp.get("meta_info") or {})
        try:
            comp, _ = completion_from_response(prompt + kept.ids, resp,
                                               self.routed_shape if has_routed else None)
        except (KeyError, TypeError, ValueError):
            comp = None
        n = 0 if comp is None else len(comp.response_ids)
        whole = comp is not None and len(comp.logprobs) == n  # tokens with their log-probs
        if (self.partial if keep is None else keep) and whole:
            if n:
                kept.extend(comp)
                self._count("resumed_requests")
            return
        self._count("redone_tokens", float(n + len(kept.ids)))
        kept.__init__()

    def _generate_url(self) -> str:
        """Where a ``/generate`` goes: the router; with routing replay r3 the servers themselves,
        round robin over the registered ones. sglang-router (0.3.2, measured) re-serialises a
        ``/generate`` body into its own request type, which has no ``return_routed_experts``, so
        the servers would never be asked for the routing."""
        urls = list(self.fleet.urls) if self.routed_shape is not None else []
        if not urls:
            return self.fleet.router_url + "/generate"
        with self._lock:
            self._next_server += 1
            return urls[self._next_server % len(urls)] + "/generate"

    def _sync_aborted(self, epoch: int) -> bool:
        """Whether a weight sync paused the servers since a request started (its abort came
        from ``/pause_generation``)."""
        sync = self.sync
        return sync is not None and (getattr(sync, "paused", False) or
                                     getattr(sync, "epoch", 0) != epoch)

    def cancel_all(self, on: bool) -> None:
        """``on``: end every request now (queued ones return nothing, in-flight ones are
        aborted); ``False``: accept requests again. Used when the rollout producer closes."""
        if on:
            self._stop.set()
            self.abort_inflight()
        else:
            self._stop.clear()

    def abort_inflight(self) -> None:
        """``/abort_request`` for every in-flight request, on every server."""
        with self._lock:
            rids = list(self._inflight)
        for url in self.fleet.urls:
            for rid in rids:
                try:
                    http_json("POST", url + "/abort_request", {"rid": rid}, timeout=5.0)
                except ServerError:
                    pass

    # ---- RolloutEngine ------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams, seed: int | None = None,
                 stop_when: Callable[[int, list[Completion]], bool] | None = None
                 ) -> list[list[Completion]]:
        """``params.n`` completions per prompt, in prompt order. ``stop_when(i, group)`` is called
        as each group completes; once it returns True the rest is cancelled/aborted and the
        unfinished groups come back empty (never shortened)."""
        seed = 0 if seed is None else seed
        cancel = threading.Event()
        groups: list[list[Completion | None]] = [[None] * params.n for _ in prompts]
        left = [params.n] * len(prompts)
        with ThreadPoolExecutor(self.concurrency) as pool:
            futs = {pool.submit(self._one, p, params, request_seed(seed, i, j), cancel): (i, j)
                    for i, p in enumerate(prompts) for j in range(params.n)}
            pending = set(futs)
            while pending:
                done, pending = wait(pending, return_when=FIRST_COMPLETED)
                for f in done:
                    i, j = futs[f]
                    comp = None if f.cancelled() else f.result()
                    if comp is None:
                        continue
                    groups[i][j] = comp
                    left[i] -= 1
                    if left[i] == 0 and stop_when is not None and not cancel.is_set() and \
                            stop_when(i, groups[i]):
                        cancel.set()
                        for g in pending:
                            g.cancel()
                        self.abort_inflight()
                        self._count("aborted_requests", sum(1 for g in pending
                                                            if not g.cancelled()))
        return [list(g) if k == 0 else [] for g, k in zip(groups, left)]

    def update_weights(self, buckets: Iterable[Bucket], version: int) -> str:
        """Single-process push of HF-named buckets through the configured strategy."""
        from megatron_rl.rollout.weight_sync import push_single_process

        return push_single_process(self, buckets, version)

    def close(self) -> None:
        self.fleet.stop()


def make_sglang_engine(cfg, tokenizer) -> SGLangEngine:
    """Start (or attach to) the fleet of ``rollout.sglang`` and return the engine."""
    import os

    from megatron_rl.rollout.fleet import Fleet
    from megatron_rl.rollout.weight_sync import make_strategy

    s = cfg.rollout.sglang
    r3 = cfg.actor.routing_replay == "r3"
    flag = "--enable-return-routed-experts"  # SGLang ignores return_routed_experts without it
    if r3 and flag not in s.extra_args:
        import dataclasses

        s = dataclasses.replace(s, extra_args=[*s.extra_args, flag])
    adapter_sync = cfg.actor.lora.enabled and cfg.actor.lora.sync == "adapter"
    if adapter_sync:  # SGLang's LoRA adapter loading (--enable-lora ...), unless given
        s = lora_fleet(s, cfg)
    root = os.path.join(cfg.trainer.output_dir, "sglang")
    model_path = cfg.model.hf_path or write_model_config(cfg, os.path.join(root, "model"))
    if s.quantization == "fp8":
        s, model_path = fp8_fleet(s, model_path, os.path.join(root, "model-fp8"))
    fleet = Fleet(s, model_path, tokenizer.eos_id, os.path.join(root, "logs")).start()
    engine = SGLangEngine(fleet, tokenizer.eos_id, s.concurrency, s.max_retries,
                          s.max_offpolicy_lag, s.request_timeout_s)
    engine.sync = make_strategy(s.weight_sync, fleet, s.sync_dir or
                                os.path.join(cfg.trainer.output_dir, "weight_sync"))
    engine.sync.quantization, engine.sync.scale_fmt = s.quantization, s.fp8_scale_fmt
    engine.partial = engine.sync.partial = cfg.rollout.partial
    engine.adapter_sync = engine.sync.adapter_sync = adapter_sync
    engine.sync.spots_per_send = s.spot_checks
    engine.sync.flush_retries = s.flush_retries
    if hasattr(engine.sync, "address_override"):
        engine.sync.address_override = s.sender_address
    engine.probe_length, engine.probe_tolerance = s.probe_length, probe_tolerance_of(cfg)
    if r3:
        from megatron_rl.convert.model_source import model_config

        m = model_config(cfg.model)
        engine.routed_shape = (m.num_hidden_layers, m.num_experts_per_tok)
    return engine


def lora_fleet(s, cfg):
    """``rollout.sglang`` with the LoRA server arguments of adapter-only sync
    (:func:`megatron_rl.rollout.weight_sync.lora_adapter.server_args_for`) appended to
    ``extra_args``, unless they already name ``--enable-lora``."""
    import dataclasses

    from megatron_rl.convert.model_source import model_config
    from megatron_rl.rollout.weight_sync.lora_adapter import server_args_for

    extra = [str(a) for a in s.extra_args]
    if "--enable-lora" in extra:
        return s
    return dataclasses.replace(s, extra_args=extra + server_args_for(cfg.actor.lora,
                                                                     model_config(cfg.model)))


def fp8_fleet(s, model_path: str, out_dir: str):
    """``(section, model dir)`` for servers that serve block-FP8 weights
    (``rollout.sglang.quantization: fp8``): ``out_dir/config.json`` is ``model_path``'s with
    the ``quantization_config`` SGLang's ``fp8`` loader reads for block checkpoints (no weight
    files: the first sync, before any rollout, brings them, FP8 + scales); SGLang servers get
    ``--quantization fp8`` and, when ``model_path`` held weights (bf16, which an FP8 layer cannot
    load), ``--load-format dummy`` unless ``extra_args`` names a load format."""
    import dataclasses
    import glob
    import os
    import shutil

    from megatron_rl.rollout.fp8 import write_quantization_config

    os.makedirs(out_dir, exist_ok=True)
    shutil.copy(os.path.join(model_path, "config.json"), os.path.join(out_dir, "config.json"))
    write_quantization_config(out_dir, s.fp8_scale_fmt)
    extra = [str(a) for a in s.extra_args]
    if s.launcher == "sglang":
        if not any(a == "--quantization" or a.startswith("--quantization=") for a in extra):
            extra += ["--quantization", "fp8"]
        has_weights = bool(glob.glob(os.path.join(model_path, "*.safetensors")))
        if has_weights and not any(a.startswith("--load-format") for a in extra):
            extra += ["--load-format", "dummy"]
    return dataclasses.replace(s, extra_args=extra), out_dir


# The probe rule: after a sync every server scores the fixed probe sequence (``probe_length``
# pseudo-random tokens, teacher forced); the *mean* |engine - actor| log-prob gap over its tokens
# must be within the tolerance of the run's precisions (the looser side wins). The mean, not the
# largest gap: random tokens sit at log-probs of -5 to -20, where correct bf16 arithmetic moves
# single tokens by up to ~1. Measured on CPU over 64 tokens, same weights: the tiny model in bf16
# vs fp32, mean 0.02 (largest 0.08); the tiny architecture with sharper logits (init std 0.2),
# mean 0.09 (largest 0.39); a deep randomly initialised model with very sharp logits (8 layers,
# std 0.3), two bf16 attention kernels, mean 0.20-0.26 (largest 1.5). Weights that are wrong
# anywhere move every token: one layer or tensor not loaded, or the previous weights, gives a
# mean of 0.65-3.3. fp32 on both sides: only summation order differs (measured ~2e-6); fp16 keeps
# 3 more mantissa bits than bf16. A sync one optimizer step stale is below any tolerance here (it
# moves log-probs by less than bf16 rounding); the probe catches weights that did not arrive or
# arrived wrong.
PROBE_TOLERANCE = {"fp32": 1e-4, "fp16": 0.05, "bf16": 0.25}


def server_precision(s) -> str:
    """Precision the servers compute in: ``fp32`` for our ``serve``; SGLang's ``--dtype auto``
    serves fp32 and bf16 checkpoints in half precision (bf16 assumed)."""
    return "fp32" if s.launcher == "serve" else "bf16"


def default_probe_tolerance(actor_precision: str, engine_precision: str) -> float:
    """The probe tolerance (mean |gap|) for an actor and engine precision (the looser one)."""
    return max(PROBE_TOLERANCE[actor_precision], PROBE_TOLERANCE[engine_precision])


def probe_tolerance_of(cfg) -> float:
    """``rollout.sglang.probe_tolerance``, or (None) the default of the run's precisions. Called in
    the rank process (the actor's default precision depends on CUDA being usable there)."""
    from megatron_rl.actor.precision import resolve_precision

    s = cfg.rollout.sglang
    if s.probe_tolerance is not None:
        return s.probe_tolerance
    return default_probe_tolerance(resolve_precision(cfg.actor.precision), server_precision(s))


def write_model_config(cfg, out_dir: str) -> str:
    """``out_dir/config.json`` of the run's architecture (servers start with random weights and
    get the actor's by weight sync)."""
    from transformers import AutoConfig

    from megatron_rl.convert.model_source import model_config
    from megatron_rl.convert.registry import hf_config_dict

    fields = hf_config_dict(model_config(cfg.model))
    model_type = fields.pop("model_type")
    AutoConfig.for_model(model_type, **fields).save_pretrained(out_dir)
    return out_dir
