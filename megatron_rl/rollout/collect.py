"""One step's rollout on the engine's rank: generate, score, filter, turn records into a batch.

Records are plain dicts, one per response: ``uid`` (prompt group), ``prompt_ids``,
``response_ids``, ``logprobs``, ``truncated``, ``response_length``, ``score``, ``acc``, ``reward``.
"""

from __future__ import annotations

import itertools
from typing import Callable, Sequence

import torch

from megatron_rl.rewards.math_verify_reward import score_batch
from megatron_rl.rollout.advantages import (
    broadcast_to_tokens,
    dr_grpo_advantages,
    grpo_advantages,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
)
from megatron_rl.rollout.engine import SamplingParams
from megatron_rl.rollout.filters import (
    DynamicSampler,
    apply_overlong,
    filter_groups_by_std,
    mean_in_group_std,
    reward_variance_top_p,
    select_uids,
)
from megatron_rl.util.progress import Progress

_uid = itertools.count()


def generate_records(engine, tokenizer, rows: Sequence[dict], params: SamplingParams,
                     score_fn: Callable[[dict, str], float], seed: int,
                     timeout_s: float = 5.0, counters: dict | None = None,
                     stop_when=None) -> list[dict]:
    """Generate ``params.n`` responses per row and score them (one record per response).

    Each sample is scored in isolation: a reward function that raises or hangs gives 0 for that
    sample (counted in ``counters["reward_failed"/"reward_timeout"]``), never a crashed run.
    """
    prompts = [tokenizer.encode(r["prompt"]) for r in rows]
    if stop_when is not None:  # an SGLang fleet aborts leftovers (rollout/early_abort.py)
        groups = engine.generate(prompts, params, seed=seed, stop_when=stop_when)
    else:
        groups = engine.generate(prompts, params, seed=seed)
    flat = [(row, c, tokenizer.decode(c.response_ids)) for row, comps in zip(rows, groups)
            for c in comps]
    scores, n_failed, n_timeout = score_batch(score_fn, [f[0] for f in flat],
                                              [f[2] for f in flat], timeout_s)
    if counters is not None:
        counters["reward_failed"] = counters.get("reward_failed", 0) + n_failed
        counters["reward_timeout"] = counters.get("reward_timeout", 0) + n_timeout
    records = []
    it = iter(zip(flat, scores))
    for k, comps in enumerate(groups):
        uid = next(_uid)
        for _ in comps:
            (_, c, text), s = next(it)
            s = float(s)
            records.append({"uid": uid, "prompt_index": k, "prompt_ids": c.prompt_ids,
                            "response_ids":
                            c.response_ids, "logprobs": c.logprobs, "truncated": not c.finished,
                            "response_length": len(c.response_ids), "score": s,
                            "acc": float(s >= 1.0), "reward": s, "text": text,
                            "weight_version": c.weight_version,
                            **({"routed_experts": c.routed_experts}
                               if c.routed_experts is not None else {}),
                            **({"token_versions": c.token_versions} if c.token_versions
                               else {})})
    return records


def banked_or_generated(bank, step: int, round_i: int, rows: list[dict], tokenizer,
                        generate: Callable[[], list[dict]], counters: dict) -> list[dict]:
    """Round ``round_i`` of ``step``: its groups from the durable rollout ``bank`` when banked
    there (fresh ``uid`` per group; counted in ``counters["bank_reused_groups"]``), else
    ``generate()``'s records, banked before they are returned. ``bank`` None: ``generate()``."""
    if bank is None:
        return generate()
    groups = bank.take(step, round_i, [tokenizer.encode(r["prompt"]) for r in rows])
    if groups is not None:
        counters["bank_reused_groups"] = counters.get("bank_reused_groups", 0) + len(groups)
        return [{**s, "uid": uid} for g in groups for uid in [next(_uid)] for s in g]
    records = generate()
    bank.append(step, round_i, records)
    return records


def collect_step(engine, tokenizer, loader, cfg, score_fn, step: int, bank=None
                 ) -> tuple[list[dict], dict]:
    """Generation rounds (DAPO dynamic sampling when enabled), overlong shaping, RV filter.

    ``cfg`` is the run config; ``loader`` yields ``rollout.gen_batch_size`` prompts per round.
    ``bank``: a :class:`~megatron_rl.rollout.bank.RolloutBank` (``rollout.durable_bank``): each
    round is taken from it when banked, else generated and banked. Returns the kept records and
    rollout metrics.
    """
    r, t = cfg.rollout, cfg.trainer
    params = SamplingParams(n=r.n, max_new_tokens=r.max_new_tokens, temperature=r.temperature,
                            top_p=r.top_p)
    metrics: dict[str, float] = {}
    counters: dict[str, int] = {}
    shaped_all: list[dict] = []

    def one_round(i: int) -> list[dict]:
        rows = loader.next_batch()
        stop = None
        if r.dynamic_sampling and getattr(engine, "supports_stop_when", False):
            from megatron_rl.rollout.early_abort import prefix_stop_rule

            stop = prefix_stop_rule(rows, tokenizer, score_fn, r.filter_metric,
                                    t.train_batch_size - sampler.kept_prompts)
        recs = banked_or_generated(
            bank, step, i, rows, tokenizer, lambda: generate_records(
                engine, tokenizer, rows, params, score_fn, seed=t.seed * 100003 + step * 101 + i,
                timeout_s=r.reward_timeout_s, counters=counters, stop_when=stop), counters)
        if r.overlong_buffer > 0 or r.overlong_filter:
            recs, om = apply_overlong(recs, r.max_new_tokens,
                                      r.overlong_buffer if r.overlong_buffer > 0 else None,
                                      r.overlong_penalty_factor, r.overlong_filter)
            metrics.update({f"rollout/{k}": float(v) for k, v in om.items()})
        shaped_all.extend(recs)
        return recs

    if r.dynamic_sampling:
        sampler = DynamicSampler(train_batch_size=t.train_batch_size,
                                 max_num_gen_batches=r.max_num_gen_batches,
                                 metric=r.filter_metric)
        with Progress(t.train_batch_size, f"rollout step {step + 1}", unit="prompts kept",
                      min_s=10.0, transient=True) as bar:  # silent in logs unless slow
            i = 0
            while not sampler.add(one_round(i)):
                i += 1
                bar.set(sampler.kept_prompts, info=f"{i} generation round(s)")
            bar.set(min(sampler.kept_prompts, t.train_batch_size),
                    info=f"{i + 1} generation round(s)")
        records, stats = sampler.result()
        metrics.update({f"rollout/{k}": float(v) for k, v in stats.items()})
    else:
        records = one_round(0)
        _, counts = filter_groups_by_std(records, r.filter_metric)
        metrics.update({f"rollout/{k}": float(v) for k, v in counts.items()})
    if r.rv_filter_p < 1.0 or not r.rv_include_zero:  # p=1 still drops zero-variance groups
        kept, rv = reward_variance_top_p(records, r.rv_filter_p, r.rv_include_zero)
        records = select_uids(records, kept)
        metrics.update({f"rollout/rv_{k}": float(v) for k, v in rv.items()
                        if isinstance(v, (int, float))})
    metrics.update(rollout_metrics(shaped_all, records))
    metrics.update({f"rollout/{k}": float(v) for k, v in counters.items()})
    metrics.update(getattr(engine, "pop_metrics", dict)())  # SGLang fleet: lag, retries
    if not hasattr(engine, "pop_metrics") and getattr(engine, "last_sync_bytes", None):
        metrics["rollout/weight_sync_bytes"] = float(engine.last_sync_bytes)  # embedded engine
    return records, metrics


def rollout_metrics(generated: list[dict], kept: list[dict]) -> dict[str, float]:
    """Accuracy, reward, length and truncation over everything generated this step."""
    n = max(1, len(generated))
    return {"rollout/acc": sum(x["acc"] for x in generated) / n,
            "rollout/score": sum(x["score"] for x in generated) / n,
            "rollout/reward": sum(x["reward"] for x in generated) / n,
            "rollout/response_length": sum(x["response_length"] for x in generated) / n,
            "rollout/truncated_frac": sum(x["truncated"] for x in generated) / n,
            # over everything generated (before filtering): the early-stop signal (RAGEN)
            "rollout/in_group_reward_std": mean_in_group_std(generated) if generated else 0.0,
            "rollout/kept_responses": float(len(kept))}


def compute_advantages(records: list[dict], estimator: str) -> torch.Tensor:
    """Per-response scalar advantages ``[R]`` (outcome rewards, ALGORITHMS.md §3)."""
    scores = torch.tensor([x["reward"] for x in records], dtype=torch.float32)
    groups = torch.tensor([x["uid"] for x in records])
    if estimator == "grpo":
        return grpo_advantages(scores, groups).float()
    if estimator == "dr_grpo":
        return dr_grpo_advantages(scores, groups).float()
    if estimator == "rloo":
        return rloo_advantages(scores, groups).float()
    raise ValueError(f"trainer.advantage={estimator!r} is not an outcome estimator here")


def pad_records(records: list[dict], pad_id: int, rows_multiple: int) -> dict[str, torch.Tensor]:
    """``tokens/mask/rollout_logp [N, S]`` (right-padded), ``reward/positive [N]`` on the CPU; N is
    padded with empty rows to a multiple of ``rows_multiple``. ``mask`` is a record's
    ``response_mask`` when it has one (multi-turn: the model's own tokens), else its whole response
    unless it was overlong-filtered. Records with ``routed_experts`` (an MoE engine's routing,
    ``[len - 1, layers, k]``) add ``routed_experts [N, S, layers, k]`` int32, -1 where there is
    none (each row's last token, padding)."""
    n = len(records)
    n_pad = -(-n // rows_multiple) * rows_multiple
    seq = max(len(x["prompt_ids"]) + len(x["response_ids"]) for x in records)
    tokens = torch.full((n_pad, seq), pad_id, dtype=torch.long)
    mask = torch.zeros((n_pad, seq), dtype=torch.bool)
    roll_lp = torch.zeros((n_pad, seq))
    for i, x in enumerate(records):
        p, resp = x["prompt_ids"], x["response_ids"]
        span = slice(len(p), len(p) + len(resp))
        tokens[i, :span.stop] = torch.tensor(p + resp)
        if "response_mask" in x:
            mask[i, span] = torch.tensor(x["response_mask"], dtype=torch.bool)
        elif not x.get("overlong_filtered", False):
            mask[i, span] = True
        roll_lp[i, span] = torch.tensor(x["logprobs"])
    reward = torch.zeros(n_pad)
    reward[:n] = torch.tensor([x["reward"] for x in records])
    positive = torch.zeros(n_pad, dtype=torch.bool)  # correct responses (GPPO's NLL term)
    positive[:n] = torch.tensor([x["acc"] >= 1.0 for x in records])
    out = {"tokens": tokens, "mask": mask, "rollout_logp": roll_lp, "reward": reward,
           "positive": positive}
    routed = [x.get("routed_experts") for x in records]
    if any(r is not None for r in routed):
        if any(r is None for r in routed):
            raise ValueError("some rollout records carry routed_experts and some do not")
        shape = routed[0].shape[1:]
        out["routed_experts"] = torch.full((n_pad, seq, *shape), -1, dtype=torch.int32)
        for i, (x, r) in enumerate(zip(records, routed)):
            want = len(x["prompt_ids"]) + len(x["response_ids"]) - 1
            if tuple(r.shape) != (want, *shape):
                raise ValueError(f"record {i}: routed_experts has shape {tuple(r.shape)}, "
                                 f"expected {(want, *shape)} (prompt + response - 1 tokens)")
            out["routed_experts"][i, :want] = r
    return out


def records_to_batch(records: list[dict], estimator: str, pad_id: int, rows_multiple: int,
                     versions: bool = False) -> dict[str, torch.Tensor]:
    """:func:`pad_records` plus ``advantages [N, S]`` of ``estimator``; with ``versions`` also
    ``rollout_version [N, S]`` (int64, CPU): the policy version that generated each response
    token (its record's ``token_versions``, else its ``weight_version``; -1 elsewhere)."""
    batch = pad_records(records, pad_id, rows_multiple)
    batch["advantages"] = token_advantages(records, estimator, batch["mask"])
    if versions:
        ver = torch.full(batch["tokens"].shape, -1, dtype=torch.long)
        for i, x in enumerate(records):
            p, n = len(x["prompt_ids"]), len(x["response_ids"])
            tv = x.get("token_versions") or [x.get("weight_version", -1)] * n
            ver[i, p:p + n] = torch.tensor(tv, dtype=torch.long)
        batch["rollout_version"] = ver
    return batch


def token_advantages(records: list[dict], estimator: str, mask: torch.Tensor) -> torch.Tensor:
    """``[N, S]`` advantages of ``estimator`` for ``records`` (padded to ``mask``'s N rows, which
    get nothing). ``reinforce_pp`` needs the old/ref log-probs: zeros here, filled in by
    :mod:`megatron_rl.rollout.late_advantages`; ``gae`` is filled in by the critic."""
    n, (n_pad, seq) = len(records), mask.shape
    if estimator == "reinforce_pp_baseline":
        scores = torch.tensor([x["reward"] for x in records] + [0.0] * (n_pad - n))
        groups = torch.tensor([x["uid"] for x in records] + [-1 - i for i in range(n_pad - n)])
        return reinforce_pp_baseline_advantages(scores, groups, mask)
    if estimator in ("reinforce_pp", "gae"):
        return torch.zeros((n_pad, seq))
    seq_adv = torch.zeros(n_pad)
    seq_adv[:n] = compute_advantages(records, estimator)
    return broadcast_to_tokens(seq_adv, mask)


def dp_rows(n: int, dp: int, dp_rank: int, mini: int) -> torch.Tensor:
    """Row indices of this DP rank: for every global mini-batch of ``mini`` rows, its contiguous
    ``mini/dp`` block (the order the loss module's global token indices assume)."""
    mini = mini or n
    per = mini // dp
    return torch.cat([torch.arange(j * mini + dp_rank * per, j * mini + (dp_rank + 1) * per)
                      for j in range(n // mini)])
