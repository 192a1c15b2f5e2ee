"""Embedded rollout engine: in-process generation with a ``transformers`` model.

The default where no SGLang server can run (CPU machines, tests, demos). It implements the
:class:`~megatron_rl.rollout.engine.RolloutEngine` interface: sampling with temperature/top-p,
per-token log-probs of the sampled tokens (under the temperature-scaled distribution), and weight
updates from HF-named buckets streamed out of the Megatron actor. Every update is verified: the
SHA-256 of the tensors received must equal the SHA-256 of the engine's parameters after loading,
and every parameter of the engine must have been received; otherwise :class:`WeightSyncError`.
"""

from __future__ import annotations

import hashlib
import threading
from contextlib import nullcontext
from typing import Iterable

import torch

from megatron_rl.models.config import ModelConfig
from megatron_rl.rollout.engine import Bucket, Completion, SamplingParams
from megatron_rl.rollout.memory_occupation import tensor_bytes


class WeightSyncError(RuntimeError):
    """The engine's weights do not equal what the trainer sent."""


def build_hf_model(cfg: ModelConfig) -> torch.nn.Module:
    """A random ``transformers`` causal LM with ``cfg``'s architecture (nothing downloaded)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from megatron_rl.convert.registry import hf_config_dict

    fields = hf_config_dict(cfg)
    model_type = fields.pop("model_type")
    fields.pop("architectures", None)
    conf = AutoConfig.for_model(model_type, **fields)
    return AutoModelForCausalLM.from_config(conf).float().eval()


def engine_placement(precision: str | None, dev: torch.device) -> tuple[torch.device,
                                                                         torch.dtype]:
    """Where the embedded engine generates: on a GPU in the actor's precision (bf16 by default);
    on the CPU in fp32 (half-precision CPU kernels are slow)."""
    from megatron_rl.actor.precision import params_dtype

    if dev.type == "cuda":
        return dev, params_dtype(precision)
    return torch.device("cpu"), torch.float32


def _digest(items: Iterable[tuple[str, torch.Tensor]]) -> str:
    h = hashlib.sha256()
    for name, t in sorted(items, key=lambda x: x[0]):
        h.update(name.encode())
        h.update(tensor_bytes(t.detach().to(torch.float32).contiguous().cpu()))  # not .numpy()
    return h.hexdigest()


class EmbeddedEngine:
    """A ``transformers`` model held by one process (rank 0 of the trainer)."""

    def __init__(self, cfg: ModelConfig, eos_id: int, pad_id: int,
                 per_request_seed: bool = False, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None, return_routed_experts: bool = False) -> None:
        self.cfg = cfg
        # MoE: each completion carries the experts every token was routed to (routing replay R3)
        self.return_routed_experts = return_routed_experts
        self.model = build_hf_model(cfg).to(device=device or "cpu", dtype=dtype or torch.float32)
        self.device = next(self.model.parameters()).device
        self.eos_id, self.pad_id = eos_id, pad_id
        self.weight_version = -1
        self.per_request_seed = per_request_seed  # sample like a `serve` fleet (sampling.py)
        # held for a whole generate call and a whole update: with asynchronous rollouts a
        # weight update waits until the running generate call ends (no request is in flight
        # across a version change, so each completion has one version) -- unless ``partial``
        self.lock = threading.RLock()
        # rollout.partial: a running generate call lets a waiting update run between two decode
        # steps (the KV cache and the tokens so far are kept, as SGLang's pause "in_place");
        # each completion then carries per-token versions
        self.partial = False
        self._update_wanted = threading.Event()
        self._update_done = threading.Event()

    # ---- weights -------------------------------------------------------------------------------
    @property
    def weight_dtype(self) -> torch.dtype:
        """The dtype the engine holds its weights in (the weight stream is cast to it)."""
        return next(self.model.parameters()).dtype

    def _expected_names(self) -> set[str]:
        from megatron_rl.convert.qwen3_moe import per_expert_names

        params = dict(self.model.named_parameters())
        names = set(params)
        for fused, parts in per_expert_names(params).items():  # MoE: checkpoint names
            names.discard(fused)
            names.update(parts)
        if self.cfg.tie_word_embeddings:
            names.discard("lm_head.weight")
        return names

    def _params(self) -> dict[str, torch.Tensor]:
        """Parameters by the names the weight stream sends (checkpoint names: one tensor per MoE
        expert, a view into transformers' fused expert tensors)."""
        from megatron_rl.convert.qwen3_moe import checkpoint_named_params

        return checkpoint_named_params(self.model)

    def update_weights(self, buckets: Iterable[Bucket], version: int) -> str:
        """Copy every received tensor into the model, then verify; returns the checksum. With
        ``partial`` a running generate call lets it in at its next decode step."""
        self._update_done.clear()
        self._update_wanted.set()
        try:
            with self.lock:
                return self._update_weights(buckets, version)
        finally:
            self._update_wanted.clear()
            self._update_done.set()

    def between_steps(self) -> None:
        """Called by a running generate call (holding the lock) between two decode steps: with
        ``partial``, a weight update waiting for the engine runs now; the call then continues
        with its KV cache and tokens kept, under the new weights."""
        if not (self.partial and self._update_wanted.is_set()):
            return
        self.lock.release()
        try:
            self._update_done.wait()
        finally:
            self.lock.acquire()

    def _update_weights(self, buckets: Iterable[Bucket], version: int) -> str:
        params = self._params()
        received: list[tuple[str, torch.Tensor]] = []
        with torch.no_grad():
            for bucket in buckets:
                for name, tensor in bucket:
                    if name not in params:
                        raise WeightSyncError(f"weight sync sent {name!r}, which the engine's "
                                              f"model does not have")
                    if tuple(tensor.shape) != tuple(params[name].shape):
                        raise WeightSyncError(f"weight sync shape mismatch for {name!r}: sent "
                                              f"{tuple(tensor.shape)}, engine has "
                                              f"{tuple(params[name].shape)}")
                    params[name].copy_(tensor)
                    received.append((name, tensor.detach().clone()))
        missing = self._expected_names() - {n for n, _ in received}
        if missing:
            raise WeightSyncError(f"weight sync did not send {sorted(missing)[:5]}")
        sent = _digest(received)
        loaded = _digest((n, params[n]) for n, _ in received)
        if sent != loaded:
            raise WeightSyncError(f"engine weights differ from the trainer's after sync "
                                  f"(version {version}): {loaded[:12]} != {sent[:12]}")
        self.weight_version = version
        return sent

    # ---- generation ----------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 seed: int | None = None) -> list[list[Completion]]:
        """``params.n`` completions per prompt (left-padded batch, KV cache; one request at a
        time with its own seed when ``per_request_seed``); each carries the weight version
        (the one at the end) and, when an update ran between its decode steps (``partial``),
        the version of each token."""
        with self.lock:
            out = self._generate(prompts, params, seed)
            for group in out:
                for c in group:
                    c.weight_version = self.weight_version
                    tv = c.token_versions
                    c.token_versions = tv if tv and len(set(tv)) > 1 else None
            return out

    def _step_versions(self) -> tuple[list[int], object]:
        """``(versions, processor)``: a ``transformers`` logits processor that records the
        version whose weights computed each decode step's logits, then lets a waiting update
        in (:meth:`between_steps`); ``versions[t]`` is the version of every row's token t."""
        from transformers import LogitsProcessor

        versions: list[int] = []
        eng = self

        class StepVersions(LogitsProcessor):
            def __call__(self, input_ids, scores):
                versions.append(eng.weight_version)
                eng.between_steps()
                return scores

        return versions, StepVersions()

    @torch.no_grad()
    def _generate(self, prompts: list[list[int]], params: SamplingParams,
                  seed: int | None = None) -> list[list[Completion]]:
        if self.per_request_seed:
            return self._generate_per_request(prompts, params, seed or 0)
        if seed is not None:
            torch.manual_seed(seed)
        rows = [p for p in prompts for _ in range(params.n)]
        width = max(len(p) for p in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long, device="cpu")
        attn = torch.zeros((len(rows), width), dtype=torch.long, device="cpu")
        for i, p in enumerate(rows):  # built on the host, moved once
            ids[i, width - len(p):] = torch.tensor(p, device="cpu")
            attn[i, width - len(p):] = 1
        ids, attn = ids.to(self.device), attn.to(self.device)
        sample = not params.greedy and params.temperature > 0
        cap = None
        if self.return_routed_experts:
            from megatron_rl.rollout.routed_experts import RoutingCapture

            cap = RoutingCapture(self.model)
        versions, step = self._step_versions()
        with cap.active() if cap is not None else nullcontext():
            out = self._hf_generate(ids, attn, params, sample, step)
        gen = out.sequences[:, width:]
        temp = params.temperature if sample else 1.0
        logp = torch.stack([torch.log_softmax(lg.float() / temp, dim=-1) for lg in out.logits], 1)
        tok_logp = logp.gather(-1, gen.unsqueeze(-1)).squeeze(-1).cpu()  # [R, new], one copy
        gen = gen.cpu()
        # [R, width + new - 1, layers, k]: every forward call's tokens
        routed = cap.result(len(rows)) if cap is not None else None
        results: list[list[Completion]] = [[] for _ in prompts]
        for i, p in enumerate(rows):
            resp = gen[i].tolist()
            finished = self.eos_id in resp
            end = resp.index(self.eos_id) + 1 if finished else len(resp)
            results[i // params.n].append(Completion(
                prompt_ids=list(p), response_ids=resp[:end],
                logprobs=tok_logp[i, :end].tolist(), finished=finished,
                token_versions=versions[:end],
                routed_experts=None if routed is None else  # left padding dropped
                routed[i, width - len(p):width + end - 1].clone()))
        return results

    def _hf_generate(self, ids: torch.Tensor, attn: torch.Tensor, params: SamplingParams,
                     sample: bool, step=None):
        from transformers import LogitsProcessorList

        return self.model.generate(
            logits_processor=LogitsProcessorList([step] if step is not None else []),
            input_ids=ids, attention_mask=attn, do_sample=sample,
            temperature=params.temperature if sample else None,
            top_p=params.top_p if sample else None, top_k=0 if sample else None,
            max_new_tokens=params.max_new_tokens, eos_token_id=self.eos_id,
            pad_token_id=self.pad_id, return_dict_in_generate=True, output_logits=True)

    def _generate_per_request(self, prompts: list[list[int]], params: SamplingParams,
                              seed: int) -> list[list[Completion]]:
        """Each sample seeded by ``request_seed(seed, prompt, sample)``, as a fleet samples."""
        from megatron_rl.rollout.sampling import request_seed, sample_completion

        greedy = params.greedy or params.temperature <= 0
        out: list[list[Completion]] = []
        for i, p in enumerate(prompts):
            group = []
            for j in range(params.n):
                versions: list[int] = []

                def before_step(versions=versions) -> None:  # the version of the next token
                    self.between_steps()
                    versions.append(self.weight_version)

                r = sample_completion(self.model, p, params.max_new_tokens,
                                      0.0 if greedy else params.temperature, params.top_p,
                                      greedy, {self.eos_id}, request_seed(seed, i, j),
                                      routed_experts=self.return_routed_experts,
                                      before_step=before_step)
                group.append(Completion(prompt_ids=list(p), response_ids=r.ids,
                                        logprobs=r.logprobs, finished=r.finish == "stop",
                                        token_versions=versions[:len(r.ids)],
                                        routed_experts=r.routed_experts))
            out.append(group)
        return out
