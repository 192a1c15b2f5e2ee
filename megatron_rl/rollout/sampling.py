"""Per-request sampling: one completion per request, seeded by the request alone.

A request's tokens depend only on (weights, prompt, sampling params, seed), never on which server
serves it, how requests are batched or in which order they arrive. The embedded engine (with
``rollout.per_request_seed``) and our ``serve`` process use this same code, so a fleet and the
embedded engine sample identical responses for the same run seed.
"""

from __future__ import annotations

import threading
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Callable

import torch

_MASK64 = (1 << 63) - 1


def request_seed(base: int, prompt_index: int, sample_index: int) -> int:
    """A 63-bit seed for sample ``sample_index`` of prompt ``prompt_index`` of a round."""
    x = (base * 0x9E3779B97F4A7C15 + prompt_index * 0xBF58476D1CE4E5B9 + sample_index *
         0x94D049BB133111EB + 0x2545F4914F6CDD1D) & _MASK64
    x ^= x >> 31
    return (x * 0xD6E8FEB86659FD93) & _MASK64


@dataclass
class SampleResult:
    """Generated ids (including the stop token when one matched), their log-probs and why the
    generation ended: ``"stop"`` (matched ``matched``), ``"length"`` or ``"abort"``."""

    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: str = "length"
    matched: int | None = None
    routed_experts: torch.Tensor | None = None  # [len(prompt)+len(ids)-1, layers, top_k] int32


def _pick(logits: torch.Tensor, temperature: float, top_p: float, greedy: bool,
          gen: torch.Generator) -> tuple[int, float]:
    """Next token and its log-prob under the temperature-scaled distribution (``logits [V]``)."""
    if greedy or temperature <= 0:
        logp = torch.log_softmax(logits, dim=-1)
        tok = int(torch.argmax(logits))
        return tok, float(logp[tok])
    logp = torch.log_softmax(logits / temperature, dim=-1)
    probs = logp.exp()
    if top_p < 1.0:
        sp, si = torch.sort(probs, descending=True)
        keep = torch.cumsum(sp, 0) - sp < top_p  # smallest prefix whose mass reaches top_p
        filt = torch.zeros_like(probs)
        filt[si[keep]] = sp[keep]
        probs = filt
    tok = int(torch.multinomial(probs, 1, generator=gen))
    return tok, float(logp[tok])


@torch.no_grad()
def sample_completion(model: torch.nn.Module, prompt_ids: list[int], max_new_tokens: int,
                      temperature: float, top_p: float, greedy: bool, stop_ids: set[int],
                      seed: int, lock: threading.Lock | None = None,
                      abort: threading.Event | None = None,
                      running: threading.Event | None = None,
                      res: SampleResult | None = None,
                      routed_experts: bool = False,
                      retracted: threading.Event | None = None,
                      before_step: Callable[[], None] | None = None) -> SampleResult:
    """Generate one completion with a KV cache, on the model's device.

    ``lock`` is held around each forward (a weight update waits between tokens); ``abort`` set
    by another thread ends the request with ``finish="abort"``; while ``running`` is cleared
    (a server paused in place) no token is generated. ``res`` (filled in as tokens come) lets
    another thread see how many tokens exist when the weights change. ``routed_experts`` (an
    MoE model): ``res.routed_experts`` gets the top-k expert ids of every token run through the
    model (:mod:`megatron_rl.rollout.routed_experts`). ``retracted`` set by another thread (a
    server paused with SGLang's ``retract``): the KV cache is dropped and, before the next token,
    recomputed from the prompt and the tokens generated so far under the weights held then (the
    tokens and their log-probs are kept). Each token is picked and recorded under ``lock``, so a
    weight update that takes the lock sees every token of the old weights in ``res``.
    ``before_step`` runs before each decode step's forward (the embedded engine's partial
    rollouts let a weight update in there).
    """
    if routed_experts:
        from megatron_rl.rollout.routed_experts import RoutingCapture

        cap = RoutingCapture(model)
        with cap.active():
            # a recomputed KV cache routes every position again (SGLang's retract resets a
            # request's routed experts): what was captured before is dropped
            res = _sample(model, prompt_ids, max_new_tokens, temperature, top_p, greedy,
                          stop_ids, seed, lock, abort, running, res, retracted, cap.calls.clear,
                          before_step)
        got = cap.result()
        res.routed_experts = None if got is None else got[0]
        return res
    return _sample(model, prompt_ids, max_new_tokens, temperature, top_p, greedy, stop_ids,
                   seed, lock, abort, running, res, retracted, None, before_step)


def _sample(model: torch.nn.Module, prompt_ids: list[int], max_new_tokens: int,
            temperature: float, top_p: float, greedy: bool, stop_ids: set[int], seed: int,
            lock: threading.Lock | None, abort: threading.Event | None,
            running: threading.Event | None, res: SampleResult | None,
            retracted: threading.Event | None = None,
            on_recompute: Callable[[], None] | None = None,
            before_step: Callable[[], None] | None = None) -> SampleResult:
    device = next(model.parameters()).device
    gen = torch.Generator(device="cpu").manual_seed(seed & _MASK64)
    res = SampleResult() if res is None else res
    inp = torch.tensor([prompt_ids], dtype=torch.long, device=device)
    past = None
    for _ in range(max_new_tokens):
        while running is not None and not running.wait(0.05):
            if abort is not None and abort.is_set():
                break
        if abort is not None and abort.is_set():
            res.finish = "abort"
            return res
        if before_step is not None:
            before_step()
        with lock if lock is not None else nullcontext():
            if retracted is not None and retracted.is_set():  # recompute the KV cache
                retracted.clear()
                if on_recompute is not None:
                    on_recompute()
                past = None
                inp = torch.tensor([list(prompt_ids) + res.ids], dtype=torch.long, device=device)
            out = model(input_ids=inp, past_key_values=past, use_cache=True)
            past = out.past_key_values
            tok, lp = _pick(out.logits[0, -1].float().cpu(), temperature, top_p, greedy, gen)
            res.ids.append(tok)
            res.logprobs.append(lp)
        if tok in stop_ids:
            res.finish, res.matched = "stop", tok
            return res
        inp = torch.tensor([[tok]], dtype=torch.long, device=device)
    return res


@torch.no_grad()
def teacher_forced_logprobs(model: torch.nn.Module, ids: list[int],
                            lock: threading.Lock | None = None) -> list[float]:
    """``log p(ids[t] | ids[<t])`` for ``t >= 1`` at temperature 1 (``len(ids) - 1`` values)."""
    device = next(model.parameters()).device
    with lock if lock is not None else nullcontext():
        logits = model(input_ids=torch.tensor([ids], device=device)).logits[0].float()
    logp = torch.log_softmax(logits[:-1], dim=-1)
    tgt = torch.tensor(ids[1:], device=logits.device)
    return logp.gather(-1, tgt[:, None])[:, 0].cpu().tolist()
