"""``python -m megatron_rl serve``: OUR rollout server speaking the subset of SGLang's HTTP API
that the trainer uses. It is not SGLang and not a mock of it: a real server (stdlib
``ThreadingHTTPServer``) around a ``transformers`` model that generates with per-request seeds
(:mod:`megatron_rl.rollout.sampling`). It lets the SGLang client, ``sglang-router`` and the weight
sync strategies run end to end on machines where SGLang cannot (CPU); the request and response
JSON follow SGLang's (``sglang/srt/entrypoints/http_server.py``, ``srt/managers/io_struct.py``).

Endpoints: ``/generate``, ``/health``, ``/health_generate``, ``/abort_request``,
``/pause_generation``, ``/continue_generation``, ``/flush_cache``, ``/update_weights_from_disk``,
``/update_weights_from_tensor`` (CPU buckets read out of the sender's memory,
``load_format="megatron_rl_vm"``, or from shared-memory files, ``"megatron_rl_shm"``),
``/init_weights_update_group`` + ``/update_weights_from_distributed`` +
``/destroy_weights_update_group`` (a gloo/NCCL group with the trainer's senders),
``/update_weight_version``, ``/get_weights_by_name``, ``/get_model_info``, ``/server_info``
(alias ``/get_server_info``), ``/release_memory_occupation`` + ``/resume_memory_occupation``
(SGLang's contract: :mod:`megatron_rl.rollout.memory_occupation`), ``/load_lora_adapter`` +
``/unload_lora_adapter`` and ``/generate``'s ``lora_path`` (``--enable-lora``:
:mod:`megatron_rl.rollout.serve_lora`); with ``--sglang-rules 0.5.21`` (default) also
``/begin_weight_update``, ``/end_weight_update`` and ``/weights_checker``.

Where the trainer depends on them it follows real SGLang's rules: ``--sglang-rules 0.5.21``
refuses tensor/distributed updates outside a weight-update session (HTTP 400, SGLang's message;
``0.5.20`` has no sessions: 404 on begin); ``/flush_cache`` is refused while requests run
(``?timeout=S`` waits for idle first, 0.5.21); ``/get_weights_by_name`` answers 400 for Qwen2/Qwen3
(SGLang's models lack it); ``/init_weights_update_group`` joins through SGLang's rendezvous
(:mod:`megatron_rl.rollout.weight_sync.group`).
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import json
import os
import threading
import time
import uuid
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch

from megatron_rl.rollout.fp8 import wire_view
from megatron_rl.rollout.memory_occupation import MemoryOccupation, tensor_bytes
from megatron_rl.rollout.sampling import SampleResult, sample_completion, teacher_forced_logprobs
from megatron_rl.rollout.serve_lora import GenerateRefused, LoraRefused, ServedLora
from megatron_rl.rollout.serve_rules import NEW_RULES, OLD_RULES, RULES  # noqa: F401 - re-export

NO_WEIGHTS_BY_NAME = ("qwen2", "qwen3")  # SGLang's models without get_weights_by_name
_SESSION_ERR = "{} must run between begin_weight_update() and end_weight_update()"

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
           "float8_e4m3fn": torch.float8_e4m3fn,
           "torch.float32": torch.float32, "torch.float16": torch.float16,
           "torch.bfloat16": torch.bfloat16, "torch.float8_e4m3fn": torch.float8_e4m3fn}


def dtype_of(name: str) -> torch.dtype:
    """``"bfloat16"`` / ``"torch.bfloat16"`` -> ``torch.bfloat16`` (clear error otherwise)."""
    if name not in _DTYPES:
        raise ValueError(f"dtype {name!r} is not one of {sorted(_DTYPES)}")
    return _DTYPES[name]


def load_safetensors_dir(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of every ``*.safetensors`` file in ``path`` (HF names)."""
    from safetensors.torch import load_file

    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors file in {path!r}")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(f))
    return out


def build_model(preset: str | None, model_path: str | None) -> tuple[torch.nn.Module, str]:
    """The served fp32 model: a preset's architecture (random weights, filled by weight sync) or
    an HF directory (``config.json``, weights loaded when present). Returns (model, path)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if model_path:
        conf = AutoConfig.from_pretrained(model_path)
        model = AutoModelForCausalLM.from_config(conf).float().eval()
        if glob.glob(os.path.join(model_path, "*.safetensors")):
            load_named(model, load_safetensors_dir(model_path).items())
        return model, model_path
    from megatron_rl.models.config import get_preset
    from megatron_rl.rollout.embedded import build_hf_model

    return build_hf_model(get_preset(preset or "tiny")), f"preset:{preset or 'tiny'}"


def served_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``model``'s parameters by the names a weight update sends (checkpoint names: one tensor
    per MoE expert)."""
    from megatron_rl.convert.qwen3_moe import checkpoint_named_params

    return checkpoint_named_params(model)


def is_fp8_part(name: str, dtype: torch.dtype) -> bool:
    """An FP8 weight or its ``weight_scale_inv`` (``rollout.sglang.quantization: fp8``)."""
    from megatron_rl.rollout.fp8 import FP8_DTYPE, SCALE_SUFFIX

    return dtype == FP8_DTYPE or name.endswith(SCALE_SUFFIX)


def load_named(model: torch.nn.Module, items) -> int:
    """Copy HF-named tensors into ``model``; unknown names or shapes raise. Block-FP8 weights
    with their ``weight_scale_inv`` (in one call) are dequantised into the served weights
    (:func:`megatron_rl.rollout.fp8.dequantize_pairs`): the server then computes with exactly
    what SGLang's ``fp8`` layers hold. Returns the count of weights loaded."""
    from megatron_rl.rollout.fp8 import dequantize_pairs

    params = served_params(model)
    dtype = next(iter(params.values())).dtype if params else torch.float32
    n = 0
    with torch.no_grad():
        for name, t in dequantize_pairs(items, dtype):
            if name not in params:
                raise KeyError(f"weight {name!r} is not a parameter of the served model")
            if tuple(t.shape) != tuple(params[name].shape):
                raise ValueError(f"weight {name!r}: shape {tuple(t.shape)} != "
                                 f"{tuple(params[name].shape)}")
            params[name].copy_(t)
            n += 1
    return n


def read_shm_bucket(meta: dict) -> list[tuple[str, torch.Tensor]]:
    """Tensors of one flattened CPU bucket in a shared-memory file (``from_tensor`` on CPU):
    ``meta = {"path", "nbytes", "tensors": [[name, dtype, shape, byte_offset], ...]}``."""
    flat = torch.from_file(meta["path"], shared=True, size=int(meta["nbytes"]),
                           dtype=torch.uint8)  # mapped, not read: one copy, into the weights
    out = []
    for name, dt, shape, off in meta["tensors"]:
        dtype = dtype_of(dt)
        n = 1
        for s in shape:
            n *= int(s)
        nb = n * torch.empty((), dtype=dtype).element_size()
        out.append((name, flat[off:off + nb].view(dtype).reshape(shape)))
    return out


class ShmMaps:
    """Shared-memory bucket files kept mapped between updates: the sender reuses two files for
    every bucket of every sync, so each is mapped (and its pages faulted in) once; afterwards a
    bucket costs one copy into the weights. A file removed or replaced is mapped again; the
    mappings of removed files are dropped at the next update and at the end of a session."""

    def __init__(self) -> None:
        self.maps: dict[str, tuple[tuple[int, int], torch.Tensor]] = {}

    def get(self, path: str, nbytes: int) -> torch.Tensor:
        """The first ``nbytes`` of file ``path`` as a mapped uint8 tensor."""
        st = os.stat(path)
        key = (st.st_ino, st.st_size)
        hit = self.maps.get(path)
        if hit is None or hit[0] != key:
            if nbytes > st.st_size:
                raise ValueError(f"{path}: {st.st_size} bytes, the bucket says {nbytes}")
            self.maps[path] = (key, torch.from_file(path, shared=True, size=st.st_size,
                                                    dtype=torch.uint8))
        return self.maps[path][1][:nbytes]

    def prune(self) -> None:
        """Drop the mappings of files that were removed or replaced (frees their memory)."""
        for path, (key, _) in list(self.maps.items()):
            try:
                st = os.stat(path)
                if (st.st_ino, st.st_size) == key:
                    continue
            except OSError:
                pass
            del self.maps[path]


def _target(params: dict, name: str, shape, dt: str) -> tuple[torch.Tensor, torch.dtype]:
    """The served model's parameter ``name`` and the sent dtype, checked against the sent shape."""
    if name not in params:
        raise KeyError(f"weight {name!r} is not a parameter of the served model")
    p = params[name]
    if tuple(shape) != tuple(p.shape):
        raise ValueError(f"weight {name!r}: shape {tuple(shape)} != {tuple(p.shape)}")
    return p, dtype_of(dt)


def read_shm_into(model: torch.nn.Module, meta: dict, maps: ShmMaps | None = None) -> int:
    """Load a shared-memory bucket (layout as :func:`read_shm_bucket`) straight into the
    model's CPU parameters: one copy per tensor out of the file's mapping (kept in ``maps``
    between calls, since mapping a file costs page faults as large as the copy). Returns the
    count."""
    params = served_params(model)
    flat = (maps or ShmMaps()).get(meta["path"], int(meta["nbytes"]))
    fp8: list[tuple[str, torch.Tensor]] = []  # FP8 weights and scales: dequantised below
    with torch.no_grad():
        for name, dt, shape, off in meta["tensors"]:
            if is_fp8_part(name, dtype_of(dt)):
                nb = _numel(shape) * torch.empty((), dtype=dtype_of(dt)).element_size()
                fp8.append((name, flat[int(off):int(off) + nb].clone().view(dtype_of(dt))
                            .reshape(shape)))
                continue
            p, dtype = _target(params, name, shape, dt)
            nb = p.numel() * torch.empty((), dtype=dtype).element_size()
            if int(off) + nb > flat.numel():
                raise ValueError(f"weight {name!r}: bytes {off}..{int(off) + nb} are outside "
                                 f"the {flat.numel()}-byte bucket")
            raw = flat[int(off):int(off) + nb]
            esize = torch.empty((), dtype=dtype).element_size()
            if int(off) % esize:  # an offset the dtype view cannot start at: bytes first
                raw = raw.clone()
            p.detach().copy_(raw.view(dtype).view(p.shape))
    if fp8:
        load_named(model, fp8)
    return len(meta["tensors"])


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


class _IOVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


def vm_read(pid: int, address: int, dst: torch.Tensor) -> None:
    """Copy ``dst.nbytes`` bytes at ``address`` in process ``pid`` into contiguous CPU tensor
    ``dst`` (``process_vm_readv``; partial reads continued). Raises ``ValueError`` naming
    ``VM_UNAVAILABLE`` when the OS refuses."""
    from megatron_rl.rollout.weight_sync.from_tensor import VM_UNAVAILABLE

    libc = ctypes.CDLL(None, use_errno=True)
    n, done = dst.numel() * dst.element_size(), 0
    while done < n:
        local = _IOVec(dst.data_ptr() + done, n - done)
        remote = _IOVec(address + done, n - done)
        got = libc.process_vm_readv(int(pid), ctypes.byref(local), 1, ctypes.byref(remote), 1,
                                    0)
        if got <= 0:
            err = ctypes.get_errno()
            raise ValueError(f"{VM_UNAVAILABLE}: process_vm_readv of pid {pid}: "
                             f"{os.strerror(err) if got < 0 else 'no bytes'}")
        done += got


def read_vm_into(model: torch.nn.Module, meta: dict) -> int:
    """Load a ``megatron_rl_vm`` bucket ``{"pid", "token": [address, bytes], "tensors": [[name,
    dtype, shape, address, nbytes], ...]}`` straight out of the sender's memory into the model's
    CPU parameters (one copy each). The token is read first: a different process under that
    pid (another PID namespace) is refused. Returns the count."""
    from megatron_rl.rollout.weight_sync.from_tensor import VM_UNAVAILABLE

    params = served_params(model)
    pid = int(meta["pid"])
    addr, want = meta["token"]
    token = torch.empty(len(want), dtype=torch.uint8)
    vm_read(pid, int(addr), token)
    if token.tolist() != list(want):
        raise ValueError(f"{VM_UNAVAILABLE}: pid {pid} is not the sender (token differs)")
    fp8: list[tuple[str, torch.Tensor]] = []  # FP8 weights and scales: dequantised below
    with torch.no_grad():
        for name, dt, shape, address, nbytes in meta["tensors"]:
            if is_fp8_part(name, dtype_of(dt)):
                t = torch.empty(shape, dtype=dtype_of(dt))
                vm_read(pid, int(address), t)
                fp8.append((name, t))
                continue
            p, dtype = _target(params, name, shape, dt)
            if p.numel() * torch.empty((), dtype=dtype).element_size() != int(nbytes):
                raise ValueError(f"weight {name!r}: {nbytes} bytes for shape {shape} {dt}")
            direct = p.dtype == dtype and p.device.type == "cpu" and p.is_contiguous()
            dst = p.detach() if direct else torch.empty(shape, dtype=dtype)
            vm_read(pid, int(address), dst)
            if not direct:
                p.copy_(dst)
    if fp8:
        load_named(model, fp8)
    return len(meta["tensors"])


def version_spans(events: list[tuple[str, int]], current: str, n: int) -> list[dict]:
    """``meta_info.weight_versions`` of a request with ``n`` output tokens: the spans
    ``{"version", "start", "end"}`` of SGLang 0.5.21 (``compute_weight_version_spans``; an event
    ``(old, k)`` says tokens ``[.., k)`` came from ``old``)."""
    spans: list[dict] = []
    for version, end in [*events, (current, n)]:
        end = min(end, n)
        if spans and end <= spans[-1]["end"]:
            continue
        if spans and version == spans[-1]["version"]:
            spans[-1]["end"] = end
            continue
        spans.append({"version": version, "start": spans[-1]["end"] if spans else 0,
                      "end": end})
    return spans


class RefusedError(RuntimeError):
    """A request real SGLang refuses (HTTP 400 with its message)."""


class ServeState:
    """Model, weight version, pause state and in-flight requests of one server."""

    def __init__(self, model: torch.nn.Module, model_path: str, eos_id: int | None,
                 port: int, rules: str = NEW_RULES, enable_return_routed_experts: bool = False,
                 lora: ServedLora | None = None) -> None:
        self.model, self.model_path, self.eos_id, self.port = model, model_path, eos_id, port
        # as SGLang's --enable-return-routed-experts: without it a request's
        # return_routed_experts is ignored (no meta_info.routed_experts)
        self.enable_return_routed_experts = enable_return_routed_experts
        if rules not in RULES:
            raise ValueError(f"serve rules {rules!r} is not one of {RULES}")
        self.rules = rules  # which SGLang release's rules this server imitates
        self.shm_maps = ShmMaps()  # from_tensor on CPU: the sender's bucket files, mapped
        self.session = False  # a weight-update session is open (rules >= 0.5.21)
        self.lock = threading.Lock()  # held per forward and for a whole weight update
        self.weight_version = "default"
        self.running = threading.Event()
        self.running.set()  # cleared while paused
        self.pause_mode: str | None = None  # the mode of the pause in force (None: running)
        self.inflight: dict[str, threading.Event] = {}
        # rid -> set when a retract pause dropped the request's KV cache (recomputed under the
        # weights of continue_generation before its next token, as SGLang re-prefills it)
        self.retracted: dict[str, threading.Event] = {}
        # rid -> (live result, [(old version, tokens it produced)]): SGLang 0.5.21's
        # weight-version events of a request that outlives a version change
        self.live: dict[str, tuple[SampleResult, list[tuple[str, int]]]] = {}
        self.inflight_lock = threading.Lock()
        self.groups: dict[str, Any] = {}
        self.started = time.time()
        self.memory = MemoryOccupation(model)  # released regions (colocation)
        self.lora = lora or ServedLora(model)  # SGLang's LoRA adapters (--enable-lora)

    # ---- generation -----------------------------------------------------------------------------
    def generate_one(self, ids: list[int], sp: dict, rid: str, return_logprob: bool,
                     logprob_start_len: int, routed: tuple[bool, int] = (False, 0),
                     lora_path: str | None = None) -> dict:
        """One SGLang-shaped response dict for one prompt. ``routed``: the request's
        ``(return_routed_experts, routed_experts_start_len)``; ``lora_path``: the name of the
        loaded LoRA adapter it runs with (None: the base model)."""
        with self.lora.using(lora_path):
            return self._generate_one(ids, sp, rid, return_logprob, logprob_start_len, routed)

    def _generate_one(self, ids: list[int], sp: dict, rid: str, return_logprob: bool,
                      logprob_start_len: int, routed: tuple[bool, int]) -> dict:
        want_routed, start_len = routed
        if want_routed and not 0 <= start_len <= len(ids):  # scheduler.py handle_generate_request
            msg = (f"routed_experts_start_len={start_len} must be in [0, {len(ids)}] (the number "
                   "of input tokens)")
            return {"text": "", "output_ids": [], "meta_info": {
                "id": rid, "finish_reason": {"type": "abort", "message": msg},
                "prompt_tokens": len(ids), "completion_tokens": 0, "cached_tokens": 0,
                "weight_version": self.weight_version}}
        capture = want_routed and self.enable_return_routed_experts
        self.running.wait()
        abort = threading.Event()
        live: tuple[SampleResult, list[tuple[str, int]]] = (SampleResult(), [])
        with self.inflight_lock:
            self.memory.check_can_generate()  # refused while weights / KV cache are released
            self.inflight[rid] = abort
            self.live[rid] = live
            self.retracted[rid] = retracted = threading.Event()
        try:
            stop = set(int(s) for s in (sp.get("stop_token_ids") or []))
            if self.eos_id is not None and not sp.get("ignore_eos", False):
                stop.add(self.eos_id)
            temp = float(sp.get("temperature", 1.0))
            seed = sp.get("sampling_seed")
            seed = int(seed) if seed is not None else uuid.uuid4().int & ((1 << 63) - 1)
            res = sample_completion(self.model, ids, int(sp.get("max_new_tokens", 128)), temp,
                                    float(sp.get("top_p", 1.0)), temp == 0.0, stop, seed,
                                    lock=self.lock, abort=abort, running=self.running,
                                    res=live[0], routed_experts=capture, retracted=retracted)
        finally:
            with self.inflight_lock:
                self.inflight.pop(rid, None)
                self.live.pop(rid, None)
                self.retracted.pop(rid, None)
                version = self.weight_version  # SGLang reports the version serving at the end
        finish: dict[str, Any] = {"type": res.finish}
        if res.finish == "stop":
            finish["matched"] = res.matched
        elif res.finish == "length":
            finish["length"] = len(res.ids)
        else:
            finish["message"] = "aborted"
        meta: dict[str, Any] = {"id": rid, "finish_reason": finish, "prompt_tokens": len(ids),
                                "completion_tokens": len(res.ids), "cached_tokens": 0,
                                "weight_version": version}
        if self.rules == NEW_RULES:  # per-token versions (a request that outlived a sync)
            spans = version_spans(live[1], version, len(res.ids))
            meta["weight_versions"] = spans
            meta["weight_version"] = spans[-1]["version"]
        if return_logprob:
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(res.logprobs,
                                                                              res.ids)]
            if logprob_start_len >= 0:
                lps = teacher_forced_logprobs(self.model, ids, self.lock)
                start = min(logprob_start_len, len(ids) - 1)
                meta["input_token_logprobs"] = [
                    [None if i == 0 else lps[i - 1], ids[i], None] for i in range(start, len(ids))]
        if capture and res.routed_experts is not None:  # [seqlen - 1 - start, layers, k] int32
            from megatron_rl.rollout.routed_experts import encode

            meta["routed_experts"] = encode(res.routed_experts[start_len:])
        return {"text": "", "output_ids": res.ids, "meta_info": meta}

    def generate(self, req: dict) -> Any:
        """``/generate``: ``input_ids`` is one prompt (list of ints) or a batch (list of lists)."""
        ids = req.get("input_ids")
        if ids is None:
            raise ValueError("this server needs input_ids (it has no tokenizer for text)")
        single = not ids or isinstance(ids[0], int)
        batch = [ids] if single else ids
        sps = req.get("sampling_params") or {}
        sps = sps if isinstance(sps, list) else [sps] * len(batch)
        rids = req.get("rid") or [uuid.uuid4().hex for _ in batch]
        rids = [rids] if isinstance(rids, str) else rids
        routed = (bool(req.get("return_routed_experts")),
                  int(req.get("routed_experts_start_len", 0)))
        loras = req.get("lora_path")
        loras = loras if isinstance(loras, list) else [loras] * len(batch)
        out = [self.generate_one(list(map(int, b)), sp, r, bool(req.get("return_logprob")),
                                 int(req.get("logprob_start_len", -1)), routed, lora)
               for b, sp, r, lora in zip(batch, sps, rids, loras)]
        return out[0] if single else out

    def abort(self, req: dict) -> None:
        """``/abort_request``: ``rid`` or ``abort_all``."""
        with self.inflight_lock:
            for rid, ev in self.inflight.items():
                if req.get("abort_all") or rid == req.get("rid"):
                    ev.set()

    def pause(self, req: dict) -> None:
        """``/pause_generation`` with SGLang 0.5.21's modes (``PauseGenerationReqInput``,
        ``Scheduler.pause_generation``). New requests wait in every mode. ``"abort"`` (default)
        aborts the running ones (they return ``finish_reason.type == "abort"`` with the tokens
        generated so far); ``"in_place"`` stops them between tokens with their KV cache kept
        (``/flush_cache`` is refused while they exist, as SGLang's is while its running batch
        holds requests); ``"retract"`` stops them between tokens and drops their KV cache (back
        to the waiting queue: ``/flush_cache`` succeeds) -- after ``/continue_generation`` it is
        recomputed from prompt + generated tokens under the weights then held. In both keeping
        modes the tokens and log-probs already generated are kept, the tokens after a weight
        update come from the new weights, and the reply's ``weight_versions`` spans say which
        tokens came from which version."""
        mode = req.get("mode", "abort")
        if mode not in ("abort", "retract", "in_place"):
            raise ValueError(f"pause_generation mode={mode!r} is not one of "
                             "('abort', 'retract', 'in_place')")
        with self.inflight_lock:
            self.running.clear()
            self.pause_mode = mode
            if mode == "retract":
                for ev in self.retracted.values():
                    ev.set()
        if mode == "abort":
            self.abort({"abort_all": True})

    def resume(self) -> None:
        """``/continue_generation``: paused and waiting requests run again."""
        with self.inflight_lock:
            self.pause_mode = None
            self.running.set()

    def busy(self) -> bool:
        """Whether requests hold KV cache (SGLang: its running batch is not empty): requests in
        flight, except while a ``retract`` pause holds them in the waiting queue."""
        return bool(self.inflight) and self.pause_mode != "retract"

    # ---- weights --------------------------------------------------------------------------------
    def set_version(self, version: Any) -> None:
        """A new weight version; a running request that already produced tokens records that
        they came from the old one (SGLang 0.5.21 ``record_weight_version_events``)."""
        if version is None or str(version) == self.weight_version:
            return
        with self.inflight_lock:
            for res, events in self.live.values():
                if res.ids:
                    events.append((self.weight_version, len(res.ids)))
            self.weight_version = str(version)

    def release_memory(self, req: dict) -> None:
        """``/release_memory_occupation`` (idle servers only)."""
        with self.lock, self.inflight_lock:
            self.memory.release(req.get("tags"), len(self.inflight))

    def resume_memory(self, req: dict) -> None:
        """``/resume_memory_occupation``."""
        with self.lock:
            self.memory.resume(req.get("tags"))

    def update_from_disk(self, req: dict) -> dict:
        self.memory.check_weights_held()
        tensors = load_safetensors_dir(req["model_path"])
        with self.lock:
            n = load_named(self.model, tensors.items())
            self.set_version(req.get("weight_version"))
        return {"success": True, "message": f"loaded {n} tensors from {req['model_path']}",
                "num_paused_requests": 0}

    def _require_session(self, what: str) -> None:
        """SGLang >= 0.5.21 refuses tensor/distributed updates outside a session (HTTP 400)."""
        if self.rules == NEW_RULES and not self.session:
            raise RefusedError(_SESSION_ERR.format(what))

    def begin_session(self) -> dict:
        """``/begin_weight_update`` (SGLang >= 0.5.21; older servers answer 404)."""
        if self.session:
            raise RefusedError("a weight-update session is already open; call "
                               "end_weight_update() first")
        self.session = True
        return {"success": True, "message": "Success"}

    def end_session(self) -> dict:
        if not self.session:
            raise RefusedError("no weight-update session is open; call begin_weight_update() "
                               "first")
        self.session = False
        self.shm_maps.prune()
        return {"success": True, "message": "Success"}

    def flush(self, query: dict) -> str:
        """``/flush_cache``: refused (400) while requests are running, as SGLang's scheduler
        does. Without a timeout, requests a ``retract`` pause put back in the waiting queue do
        not count (SGLang's ``flush_cache`` ignores the waiting queue while paused);
        ``?timeout=S`` (SGLang >= 0.5.21, ``SchedulerFlushWrapper``) waits up to S seconds for a
        fully idle server, waiting queue included -- so it times out while retracted requests
        wait for ``/continue_generation``."""
        timeout = float(query.get("timeout", 0.0)) if self.rules == NEW_RULES else 0.0
        if timeout <= 0.0:
            if self.busy():
                raise RefusedError("Flush cache failed: requests are running.")
            return "Cache flushed.\n"
        deadline = time.monotonic() + timeout
        while self.inflight and time.monotonic() < deadline:
            time.sleep(0.05)
        if self.inflight:
            raise RefusedError("Timed out waiting for idle state.")
        return "Cache flushed.\n"

    def checksum(self, req: dict) -> dict:
        """``/weights_checker {"action": "checksum"}`` (SGLang >= 0.5.21): sha256 over every
        parameter's name and bytes."""
        import hashlib

        if req.get("action", "checksum") != "checksum":
            raise RefusedError(f"Unsupported action={req.get('action')!r}")
        h = hashlib.sha256()
        with self.lock:
            for name, p in sorted(self.model.named_parameters()):
                h.update(name.encode())
                h.update(tensor_bytes(p.detach().contiguous().cpu()))
        return {"success": True, "message": "Success.", "per_engine_checksum": h.hexdigest()}

    def update_from_tensor(self, req: dict) -> dict:
        self.memory.check_weights_held()
        self._require_session("update_weights_from_tensor")
        fmt = req.get("load_format")
        if fmt not in ("megatron_rl_shm", "megatron_rl_vm"):
            raise ValueError(f"load_format={fmt!r}: this CPU server reads buckets from the "
                             "sender's memory (load_format='megatron_rl_vm') or shared-memory "
                             "files ('megatron_rl_shm'); CUDA IPC needs real SGLang")
        n = 0
        with self.lock:
            self.shm_maps.prune()
            for blob in req["serialized_named_tensors"]:
                meta = json.loads(blob)
                n += read_vm_into(self.model, meta) if fmt == "megatron_rl_vm" else \
                    read_shm_into(self.model, meta, self.shm_maps)
            self.set_version(req.get("weight_version"))
        return {"success": True, "message": f"loaded {n} tensors"}

    def init_group(self, req: dict) -> dict:
        """``/init_weights_update_group``: join the trainer's group as rank ``rank_offset``
        through the same rendezvous as SGLang's ranks (``init_custom_process_group``)."""
        from megatron_rl.rollout.weight_sync.group import join_weight_group

        backend = req.get("backend", "nccl")
        rank, world = int(req["rank_offset"]), int(req["world_size"])
        name = req.get("group_name", "weight_update_group")
        if name in self.groups:
            raise RefusedError(f"group {name!r} already exists")
        self.groups[name] = join_weight_group(backend, req["master_address"],
                                              int(req["master_port"]), world, rank, name)
        return {"success": True, "message": f"joined as rank {rank} of {world} ({backend})"}

    def destroy_group(self, req: dict) -> dict:
        from megatron_rl.rollout.weight_sync.group import leave_weight_group

        leave_weight_group(self.groups.pop(req.get("group_name", "weight_update_group"), None))
        return {"success": True, "message": ""}

    def update_from_distributed(self, req: dict) -> dict:
        self.memory.check_weights_held()
        self._require_session("update_weights_from_distributed")
        pg = self.groups[req.get("group_name", "weight_update_group")]
        device = next(self.model.parameters()).device
        recv = []
        for name, dt, shape in zip(req["names"], req["dtypes"], req["shapes"]):
            t = torch.empty(shape, dtype=dtype_of(dt), device=device)
            pg.broadcast(wire_view(t), 0).wait()  # FP8 over gloo: its bytes
            recv.append((name, t))
        with self.lock:
            n = load_named(self.model, recv)
            self.set_version(req.get("weight_version"))
        return {"success": True, "message": f"received {n} tensors"}

    def weights_by_name(self, req: dict) -> list:
        self.memory.check_weights_held()
        if getattr(self.model.config, "model_type", "") in NO_WEIGHTS_BY_NAME:
            raise RefusedError(f"{type(self.model).__name__} has no get_weights_by_name "
                               "(as SGLang's Qwen2/Qwen3 models)")
        params = dict(self.model.named_parameters())
        name = req["name"]
        if name not in params:
            raise KeyError(f"no parameter named {name!r}")
        with self.lock:
            rows = params[name].detach()[:int(req.get("truncate_size", 100))]  # first rows only
            return rows.float().cpu().tolist()

    def model_info(self) -> dict:
        conf = self.model.config
        return {"model_path": self.model_path, "tokenizer_path": self.model_path,
                "is_generation": True, "preferred_sampling_params": None,
                "weight_version": self.weight_version, "has_image_understanding": False,
                "has_audio_understanding": False, "model_type": conf.model_type,
                "architectures": list(getattr(conf, "architectures", None) or [])}

    def server_info(self) -> dict:
        return {"model_path": self.model_path, "port": self.port, "tp_size": 1, "dp_size": 1,
                "pp_size": 1, "enable_dp_attention": False,  # SGLang's server_args keys
                # the SGLang release whose rules it follows (clients choose the pause mode by it)
                "version": self.rules, "server": "megatron_rl-serve",
                "weight_version": self.weight_version,
                "internal_states": [{"paused": not self.running.is_set(),
                                     "num_running_reqs": len(self.inflight),
                                     "memory_released": sorted(self.memory.released)}],
                "max_total_num_tokens": 1 << 20, **self.lora.server_info()}


def make_handler(state: ServeState) -> type[BaseHTTPRequestHandler]:
    """The request handler class bound to ``state``."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt: str, *args: Any) -> None:  # quiet
            return

        def _send(self, code: int, body: Any, text: bool = False) -> None:
            data = (body if text else json.dumps(body)).encode()
            self.send_response(code)
            self.send_header("Content-Type", "text/plain" if text else "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _body(self) -> dict:
            n = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(n) if n else b""
            return json.loads(raw) if raw.strip() else {}

        def do_GET(self) -> None:  # noqa: N802
            self._route(*self._path(), {})

        def do_POST(self) -> None:  # noqa: N802
            try:
                body = self._body()
            except json.JSONDecodeError as exc:
                self._send(HTTPStatus.BAD_REQUEST, {"error": {"message": f"bad JSON: {exc}"}})
                return
            self._route(*self._path(), body)

        def _path(self) -> tuple[str, dict]:
            """``(path, {query parameter: last value})``."""
            from urllib.parse import parse_qs, urlsplit

            parts = urlsplit(self.path)
            return parts.path, {k: v[-1] for k, v in parse_qs(parts.query).items()}

        def _route(self, path: str, query: dict, req: dict) -> None:
            s = state
            ok = {"success": True, "message": ""}
            routes = {
                "/health": lambda: ("", True),
                "/health_generate": lambda: (s.generate_one([0], {"max_new_tokens": 1},
                                                            uuid.uuid4().hex, False, -1) and "",
                                             True),
                "/generate": lambda: (s.generate(req), False),
                "/abort_request": lambda: (s.abort(req) or "", True),
                "/pause_generation": lambda: (s.pause(req) or ok, False),
                "/continue_generation": lambda: (s.resume() or ok, False),
                "/flush_cache": lambda: (s.flush(query), True),
                "/update_weights_from_disk": lambda: (s.update_from_disk(req), False),
                "/update_weights_from_tensor": lambda: (s.update_from_tensor(req), False),
                "/init_weights_update_group": lambda: (s.init_group(req), False),
                "/update_weights_from_distributed": lambda: (s.update_from_distributed(req),
                                                             False),
                "/destroy_weights_update_group": lambda: (s.destroy_group(req), False),
                "/update_weight_version": lambda: (s.set_version(req.get("new_version")) or ok,
                                                   False),
                "/get_weights_by_name": lambda: (s.weights_by_name(req), False),
                "/get_model_info": lambda: (s.model_info(), False),
                "/model_info": lambda: (s.model_info(), False),
                "/server_info": lambda: (s.server_info(), False),
                "/get_server_info": lambda: (s.server_info(), False),
                "/release_memory_occupation": lambda: (s.release_memory(req), False),
                "/resume_memory_occupation": lambda: (s.resume_memory(req), False),
                "/load_lora_adapter": lambda: (s.lora.load(req), False),
                "/unload_lora_adapter": lambda: (s.lora.unload(req), False),
            }
            if s.rules == NEW_RULES:
                routes.update({"/begin_weight_update": lambda: (s.begin_session(), False),
                               "/end_weight_update": lambda: (s.end_session(), False),
                               "/weights_checker": lambda: (s.checksum(req), False)})
            if path not in routes:
                self._send(HTTPStatus.NOT_FOUND, {"error": {"message": f"no route {path}"}})
                return
            try:
                body, text = routes[path]()
            except RefusedError as exc:  # SGLang's own refusals: 400 with its message
                self._send(HTTPStatus.BAD_REQUEST, {"success": False, "message": str(exc)})
                return
            except LoraRefused as exc:  # SGLang's LoRAUpdateOutput (no adapters: null)
                body = s.lora.result(False, str(exc)) if s.lora.enabled else \
                    {"success": False, "error_message": str(exc), "loaded_adapters": None}
                self._send(HTTPStatus.BAD_REQUEST, body)
                return
            except GenerateRefused as exc:  # SGLang's _create_error_response
                self._send(HTTPStatus.BAD_REQUEST, {"error": {"message": str(exc)}})
                return
            except (KeyError, ValueError, TypeError, FileNotFoundError) as exc:
                self._send(HTTPStatus.BAD_REQUEST, {"error": {"message": repr(exc)},
                                                    "success": False, "message": repr(exc)})
                return
            self._send(HTTPStatus.OK, body, text=text)

    return Handler


def make_server(state: ServeState, host: str, port: int) -> ThreadingHTTPServer:
    """A bound (not yet serving) threaded HTTP server; ``port=0`` picks a free port."""
    srv = ThreadingHTTPServer((host, port), make_handler(state))
    srv.daemon_threads = True
    state.port = srv.server_address[1]
    return srv


def cmd_serve(args: argparse.Namespace) -> int:
    """Run ``serve`` until interrupted (the CLI subcommand)."""
    torch.set_num_threads(args.threads)
    model, path = build_model(args.preset, args.model_path)
    lora = ServedLora(model, bool(getattr(args, "enable_lora", False)),
                      getattr(args, "max_lora_rank", None),
                      getattr(args, "lora_target_modules", None))
    state = ServeState(model, path, args.eos_id, args.port, args.sglang_rules,
                       args.enable_return_routed_experts, lora)
    srv = make_server(state, args.host, args.port)
    print(f"[serve] {path} on http://{args.host}:{state.port}", flush=True)
    try:
        srv.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0
