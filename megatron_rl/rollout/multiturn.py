"""Multi-turn rollouts: episodes of several turns in one conversation with a text environment.

An episode's token sequence is ``prompt | reply_1 | env_1 | reply_2 | env_2 | ... | reply_T``:
the prompt is the env's instructions plus its first observation; each reply is what the engine
generated (including its EOS); each ``env_k`` is the next observation rendered as the following
user turn. Only reply tokens are trained on (``response_mask``); environment text is context.
The episode's reward is the sum of its turn rewards; each turn's reward sits on the last token of
that turn's reply (``turn_ends``), which is where GAE (:mod:`megatron_rl.critic.gae`) reads it.

Generation goes through the :class:`~megatron_rl.rollout.engine.RolloutEngine` interface only
(one ``generate`` call per turn for all live episodes), so the embedded and SGLang engines both
work. Everything here runs on rank 0 (host lists); tensors are built on CPU.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from megatron_rl.rollout.engine import SamplingParams

_uid = itertools.count(10**9)


@dataclass
class Episode:
    """One conversation with one environment (host lists, token ids)."""

    uid: int
    env: object
    tokens: list[int]
    prompt_len: int
    mask: list[bool] = field(default_factory=list)  # per token after the prompt
    logprobs: list[float] = field(default_factory=list)
    turn_rewards: list[float] = field(default_factory=list)
    turn_ends: list[int] = field(default_factory=list)  # index (after the prompt) of a turn's last
    done: bool = False
    success: bool = False
    invalid: int = 0
    texts: list[str] = field(default_factory=list)


class TurnRenderer:
    """Text of the first user turn and of every later environment turn for ``tokenizer``.

    With a chat template (HF tokenizers), an observation becomes a user message followed by the
    assistant generation prompt, appended after the model's own reply tokens (which end in the
    template's end-of-turn token, the engine's EOS). Without one (byte tokenizer), the raw text.
    """

    def __init__(self, tokenizer, use_template: bool = True) -> None:
        self.tok = tokenizer
        self.template = bool(use_template and getattr(tokenizer, "has_chat_template", False))

    def first_text(self, instructions: str, obs: str) -> str:
        from megatron_rl.data.tokenizer import render_prompt

        return render_prompt(self.tok, instructions + obs, self.template)

    def first(self, instructions: str, obs: str) -> list[int]:
        return self.tok.encode(self.first_text(instructions, obs))

    def next(self, obs: str) -> list[int]:
        if not self.template:
            return self.tok.encode(obs)
        hf = self.tok.tok
        head = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
        base = hf.apply_chat_template(head, tokenize=False)
        full = hf.apply_chat_template(head + [{"role": "user", "content": obs}],
                                      add_generation_prompt=True, tokenize=False)
        if not full.startswith(base):  # an unusual template: plain user text
            return self.tok.encode(obs)
        # What the template puts after the assistant's content, minus the end-of-turn token the
        # model generated itself (its EOS), then the new user turn and the generation prompt.
        tail = base[base.rindex("y") + 1:]
        eos_text = hf.decode([self.tok.eos_id])
        if tail.startswith(eos_text):
            tail = tail[len(eos_text):]
        return self.tok.encode(tail + full[len(base):])


def run_episodes(engine, tokenizer, make_env: Callable[[], object], seeds: Sequence[int],
                 group_size: int, params: SamplingParams, max_turns: int, gen_seed: int,
                 max_total_tokens: int, use_template: bool = True) -> list[dict]:
    """``group_size`` episodes per env seed (one group, one ``uid``, per seed); one record each.

    Episodes end when the env says done, after ``max_turns`` replies, or when the next turn would
    not fit ``max_total_tokens``. Episode ``j`` of a group resets with ``noise_seed = seed *
    1000003 + j`` (same map, own dynamics randomness).
    """
    render = TurnRenderer(tokenizer, use_template)
    eps: list[Episode] = []
    for s in seeds:
        uid = next(_uid)
        for j in range(group_size):
            env = make_env()
            obs = env.reset(int(s), noise_seed=int(s) * 1000003 + j)
            ids = render.first(env.instructions, obs)
            eps.append(Episode(uid=uid, env=env, tokens=list(ids), prompt_len=len(ids)))
    one = SamplingParams(n=1, max_new_tokens=params.max_new_tokens,
                         temperature=params.temperature, top_p=params.top_p, greedy=params.greedy,
                         validation=params.validation)
    for turn in range(max_turns):
        live = [e for e in eps if not e.done]
        if not live:
            break
        outs = engine.generate([e.tokens for e in live], one, seed=gen_seed * 7919 + turn)
        for e, comps in zip(live, outs):
            _apply_reply(e, comps[0], tokenizer, render, turn, max_turns, max_total_tokens,
                         params.max_new_tokens)
    return [episode_record(e) for e in eps]


def _apply_reply(e: Episode, comp, tokenizer, render: TurnRenderer, turn: int, max_turns: int,
                 max_total_tokens: int, max_new_tokens: int) -> None:
    """Append one reply, step the env, append the next observation unless the episode ended."""
    resp = list(comp.response_ids)
    e.tokens += resp
    e.mask += [True] * len(resp)
    e.logprobs += list(comp.logprobs)
    text = tokenizer.decode(resp)
    e.texts.append(text)
    obs, reward, done, info = e.env.step(text)
    e.turn_rewards.append(float(reward))
    e.turn_ends.append(len(e.mask) - 1)
    e.invalid += int(info.get("invalid", False))
    e.success = e.success or bool(info.get("success", False))
    if done or turn + 1 >= max_turns:
        e.done = True
        return
    nxt = render.next(obs)
    if len(e.tokens) + len(nxt) + max_new_tokens > max_total_tokens:
        e.done = True  # the next turn would not fit the model's context
        return
    e.tokens += nxt
    e.mask += [False] * len(nxt)
    e.logprobs += [0.0] * len(nxt)


def episode_record(e: Episode) -> dict:
    """The record of a finished episode (the single-turn record keys plus the turn structure)."""
    total = float(sum(e.turn_rewards))
    return {"uid": e.uid, "prompt_ids": e.tokens[:e.prompt_len],
            "response_ids": e.tokens[e.prompt_len:], "response_mask": list(e.mask),
            "logprobs": list(e.logprobs), "turn_rewards": list(e.turn_rewards),
            "turn_ends": list(e.turn_ends), "reward": total, "score": total,
            "acc": float(e.success), "turns": len(e.turn_rewards), "invalid": e.invalid,
            "response_length": int(sum(e.mask)), "truncated": False, "text": " | ".join(e.texts)}


def episodes_to_batch(records: list[dict], estimator: str, pad_id: int, rows_multiple: int
                      ) -> dict[str, torch.Tensor]:
    """``tokens/mask/advantages/rollout_logp/token_rewards [N, S]``, ``reward/positive [N]``.

    ``mask`` is true on the model's reply tokens only; ``token_rewards`` holds each turn's reward on
    its last reply token. Outcome estimators (grpo, dr_grpo, rloo, reinforce_pp_baseline) give
    one advantage per episode, broadcast over its reply tokens; for ``gae`` (the critic,
    :func:`megatron_rl.critic.gae.gae_advantages`) and ``reinforce_pp`` (returns carried across the
    environment tokens, :mod:`megatron_rl.rollout.late_advantages`) the advantages are zeros here
    and filled in later. Rows are padded with empty rows to a multiple of ``rows_multiple``.
    """
    from megatron_rl.rollout.collect import pad_records, token_advantages

    batch = pad_records(records, pad_id, rows_multiple)
    tok_r = torch.zeros_like(batch["rollout_logp"])
    for i, x in enumerate(records):
        for end, r in zip(x["turn_ends"], x["turn_rewards"]):
            tok_r[i, len(x["prompt_ids"]) + end] += r
    return {**batch, "advantages": token_advantages(records, estimator, batch["mask"]),
            "token_rewards": tok_r}


class EnvSeedLoader:
    """Training env seeds: ``groups`` new seeds per call, never the validation seeds."""

    def __init__(self, groups: int, seed: int) -> None:
        self.groups, self.base, self.next = groups, seed * 7_000_003, 0

    def next_batch(self) -> list[int]:
        out = [self.base + self.next + i for i in range(self.groups)]
        self.next += self.groups
        return out

    def state_dict(self) -> dict:
        return {"next": self.next}

    def load_state_dict(self, st: dict) -> None:
        self.next = st["next"]


VAL_SEED_OFFSET = 2**40  # validation maps never collide with training maps


def validation_seeds(n: int, seed: int) -> list[int]:
    return [VAL_SEED_OFFSET + seed * 100_003 + i for i in range(n)]


def collect_env_step(engine, tokenizer, loader: EnvSeedLoader, cfg, step: int
                     ) -> tuple[list[dict], dict]:
    """One step's episodes (``train_batch_size`` env groups x ``rollout.n``), the RV filter, and
    the rollout metrics. The filter runs whenever ``rv_filter_p < 1`` or ``rv_include_zero`` is
    false (p = 1 without zero-variance groups still drops those groups)."""
    from megatron_rl.envs import make_env
    from megatron_rl.rollout.collect import rollout_metrics
    from megatron_rl.rollout.filters import reward_variance_top_p, select_uids

    r, t, e = cfg.rollout, cfg.trainer, cfg.env
    params = SamplingParams(n=r.n, max_new_tokens=r.max_new_tokens, temperature=r.temperature,
                            top_p=r.top_p)
    records = run_episodes(engine, tokenizer, lambda: make_env(e), loader.next_batch(), r.n,
                           params, e.max_turns, gen_seed=t.seed * 100003 + step,
                           max_total_tokens=e.max_total_tokens,
                           use_template=cfg.data.chat_template)
    generated = records
    metrics: dict[str, float] = {}
    if r.rv_filter_p < 1.0 or not r.rv_include_zero:
        kept, rv = reward_variance_top_p(records, r.rv_filter_p, r.rv_include_zero)
        records = select_uids(records, kept)
        metrics.update({f"rollout/rv_{k}": float(v) for k, v in rv.items()})
    metrics.update(rollout_metrics(generated, records))
    n = max(1, len(generated))
    metrics["rollout/success"] = metrics["rollout/acc"]
    metrics["rollout/turns"] = sum(x["turns"] for x in generated) / n
    metrics["rollout/invalid_per_episode"] = sum(x["invalid"] for x in generated) / n
    return records, metrics


def validate_envs(engine, tokenizer, cfg) -> float:
    """Success rate on ``env.val_size`` held-out envs x ``rollout.val_n`` episodes (greedy unless
    ``rollout.val_temperature > 0``)."""
    from megatron_rl.envs import make_env

    r, e = cfg.rollout, cfg.env
    params = SamplingParams(n=r.val_n, max_new_tokens=r.max_new_tokens,
                            temperature=r.val_temperature or 1.0, greedy=r.val_temperature == 0,
                            validation=True)
    recs = run_episodes(engine, tokenizer, lambda: make_env(e),
                        validation_seeds(e.val_size, e.seed), r.val_n, params, e.max_turns,
                        gen_seed=cfg.trainer.seed, max_total_tokens=e.max_total_tokens,
                        use_template=cfg.data.chat_template)
    return sum(x["acc"] for x in recs) / max(1, len(recs))


def env_sft_rows(cfg, tokenizer, n: int) -> list[dict]:
    """Format-only warm-start rows: the first turn of ``n`` training envs, each answered with a
    uniformly random legal action (teaches the reply format, not the solution)."""
    import random

    from megatron_rl.envs import make_env

    render = TurnRenderer(tokenizer, cfg.data.chat_template)
    rng = random.Random(cfg.env.seed + 17)
    rows = []
    for s in EnvSeedLoader(n, cfg.env.seed + 1).next_batch():
        env = make_env(cfg.env)
        obs = env.reset(s)
        rows.append({"prompt": render.first_text(env.instructions, obs),
                     "answer": rng.choice("LDRU")})
    return rows
