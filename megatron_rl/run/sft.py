"""Supervised warm start with the same Megatron actor (teacher-forced answer tokens).

The SFT loss is the token-mean negative log-likelihood of ``answer + EOS`` (the ``nll`` policy
loss with advantage 1 on every answer token). It runs through the actor's own update path: megatron
pipeline schedule, DDP, optimizer, numerical guard; no old-policy pass is needed.
"""

from __future__ import annotations

import random
import time

import torch


def sft_batch(tokenizer, rows: list[dict]) -> dict[str, torch.Tensor]:
    """``tokens/mask/advantages [N, S]`` for prompt + answer + EOS (mask on answer + EOS)."""
    seqs = [(tokenizer.encode(r["prompt"]), tokenizer.encode(str(r["answer"])) + [tokenizer.eos_id])
            for r in rows]
    width = max(len(p) + len(a) for p, a in seqs)
    tokens = torch.full((len(seqs), width), tokenizer.pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.bool)
    for i, (p, a) in enumerate(seqs):
        tokens[i, :len(p) + len(a)] = torch.tensor(p + a)
        mask[i, len(p):len(p) + len(a)] = True
    # ``old_logp`` is required by the loss inputs but unused by the ``nll`` loss.
    return {"tokens": tokens, "mask": mask, "advantages": mask.float(),
            "old_logp": torch.zeros(tokens.shape)}


def run_sft(cfg, tokenizer, train_rows: list[dict] | None, make_actor) -> tuple[dict, list]:
    """Train ``cfg.sft.steps`` steps; return the canonical full weights and a metric log."""
    import dataclasses

    from megatron.core import parallel_state as ps

    from megatron_rl.actor.optim import OptimConfig
    from megatron_rl.actor.precision import gather_main_state_dict
    from megatron_rl.loss import LossConfig
    from megatron_rl.parallel.runtime import broadcast_object
    from megatron_rl.rollout.collect import dp_rows

    s = cfg.sft
    dp = ps.get_data_parallel_world_size()
    if s.batch_size % dp:
        raise ValueError(f"sft.batch_size={s.batch_size} must be divisible by parallel.dp={dp}")
    micro = min(cfg.actor.micro_batch_size, s.batch_size // dp)
    while (s.batch_size // dp) % micro:
        micro -= 1
    # the run's optimizer kind: a model that needs the distributed optimizer for RL needs it here
    optim = OptimConfig(lr=s.lr, weight_decay=0.0, clip_grad=1.0,
                        use_distributed_optimizer=cfg.optim.use_distributed_optimizer)
    actor = make_actor(cfg, optim,
                       LossConfig(policy_loss="nll"),
                       s.steps, actor_cfg=dataclasses.replace(
                           cfg.actor, micro_batch_size=micro, mini_batch_size=0, ppo_epochs=1,
                           temperature=1.0,  # supervised NLL of the model itself (T = 1)
                           routing_replay="none",  # dataset text: no rollout routing to replay
                           # the warm start makes the base model: all weights (LoRA is RL's)
                           lora=dataclasses.replace(cfg.actor.lora, rank=0)))
    rng = random.Random(cfg.trainer.seed)
    dp_rank = ps.get_data_parallel_rank()
    log = []
    t0 = time.perf_counter()
    for step in range(s.steps):
        rows = [rng.choice(train_rows) for _ in range(s.batch_size)] if train_rows else None
        batch = broadcast_object(sft_batch(tokenizer, rows) if rows is not None else None)
        local = {k: v[dp_rows(batch["tokens"].shape[0], dp, dp_rank, 0)]
                 for k, v in batch.items()}
        metrics = actor.update(local, step)[-1]
        if "sft/nll" in metrics:  # last pipeline stage: NLL of the batch (global token-mean)
            nll = metrics["sft/nll"]
            log.append({"sft/step": step + 1, "sft/nll": nll,
                        "sft/grad_norm": metrics.get("actor/grad_norm", 0.0)})
            reporter = ps.get_tensor_model_parallel_rank() == 0 and dp_rank == 0
            if reporter and (step + 1) % max(1, s.steps // 5) == 0:
                print(f"[sft] step {step + 1}/{s.steps} nll {nll:.3f} "
                      f"({time.perf_counter() - t0:.0f}s)", flush=True)
    state = gather_main_state_dict(actor.model, actor.optimizer)  # fp32 main weights
    actor.release()  # cuts the one link the garbage collector cannot follow
    del actor
    release_memory()  # the RL actor is built next: the SFT actor's memory must be back
    return state, log


def release_memory() -> None:
    """Free what dropped objects held: megatron's DDP grad hooks and optimizer form reference
    cycles, so a ``del`` alone leaves a model, its grads and optimizer state alive until the next
    garbage collection; then hand CUDA's cached blocks back."""
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
