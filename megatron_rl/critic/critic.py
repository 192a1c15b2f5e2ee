"""The PPO critic: megatron-core ``GPTModel`` trunk + scalar value head, its own optimizer.

The critic has the actor's architecture and TP/PP layout and starts from the actor's initial
weights (the same weight source / full state dict / seeded init); the last pipeline stage adds a
``value_head`` (``Linear(H, 1)``, zero-initialised, replicated over TP: every TP rank sees the same
final-norm hidden states, so its gradient is identical on all of them). The value of reply token
``t`` is read from the hidden state at ``t - 1`` (the state before the token was generated), the
same position convention as the actor's log-probs.

Precision follows ``actor.precision``: in bf16/fp16 the trunk is wrapped in megatron's
``Float16Module`` (half-precision weights and activations), gradients accumulate and reduce in
fp32 and megatron's mixed-precision optimizer keeps fp32 main weights, as for the actor. The value
head is cast with the trunk (megatron's mixed-precision optimizer and its checkpoint format expect
one dtype per model); its output is upcast, so GAE and the value loss are computed in fp32.

Per RL step (all ranks, SPMD; tensors on the model's device, host values only in metrics):

1. :meth:`Critic.add_advantages`: forward-only values ``[N, S]``, GAE + whitening
   (:mod:`megatron_rl.critic.gae`) -> ``values``, ``returns``, ``advantages`` (last stage);
2. :meth:`Critic.update`: clipped value loss (:mod:`megatron_rl.critic.value_loss`), token-mean
   over each global mini-batch, one guarded optimizer step per mini-batch.

The critic is checkpointed next to the actor (``OUTPUT_DIR/critic_checkpoints``) with the same
atomic, reshardable format, so a resumed run continues bit-exactly.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import torch
import torch.distributed as dist

from megatron_rl.actor.checkpoint import CheckpointSaver, latest_checkpoint, load_checkpoint
from megatron_rl.actor.cp_forward import cp_model_forward, cp_token_values
from megatron_rl.actor.forward import _position_ids, validate_micro_batches
from megatron_rl.actor.micro_batches import (
    budget_forward_batches,
    budget_micro_batches,
    dp_host_group,
    unsplit_rows,
)
from megatron_rl.actor.moe_padding import padding_kwargs
from megatron_rl.actor.optim import OptimConfig, build_optimizer, wrap_ddp
from megatron_rl.actor.precision import model_call_kwargs, set_precision, wrap_precision
from megatron_rl.actor.train_step import ActorConfig, minibatch_slices, split_rows
from megatron_rl.critic.gae import gae_advantages, masked_whiten
from megatron_rl.critic.value_loss import value_loss_token_mean
from megatron_rl.parallel.context_parallel import (
    cp_size,
    padded_length,
)


def token_values(model: torch.nn.Module, hidden: torch.Tensor, mask: torch.Tensor
                 ) -> torch.Tensor:
    """Values ``[B, S]`` fp32 of the tokens marked in ``mask`` (zero elsewhere) from the last
    stage's hidden states ``[S, B, H]``: token ``t`` reads position ``t - 1``. Context
    parallelism: ``hidden`` holds this rank's ``S_p / cp`` positions; every CP rank returns the
    full values (:func:`~megatron_rl.parallel.context_parallel.cp_token_values`)."""
    if cp_size() > 1:
        return cp_token_values(model.value_head, hidden, mask)
    v = model.value_head(hidden).squeeze(-1).transpose(0, 1).float()  # [B, S]
    out = torch.zeros_like(v)
    out[:, 1:] = v[:, :-1]
    return out * mask.float()


def _trunk_forward(model_chunk: torch.nn.Module, tokens: torch.Tensor, mask: torch.Tensor,
                   call: dict) -> torch.Tensor:
    """The trunk on ``tokens [B, S]``: all positions, or this CP rank's ``S_p / cp`` under
    context parallelism (MoE: the padding mask travels along)."""
    if cp_size() > 1:
        return cp_model_forward(model_chunk, tokens, **call, **padding_kwargs(model_chunk, mask))
    return model_chunk(tokens, _position_ids(tokens), None, **call,
                       **padding_kwargs(model_chunk, mask))


def _is_last_stage() -> bool:
    from megatron.core import parallel_state as ps

    return ps.is_pipeline_last_stage()


class Critic:
    """One rank's share of the value model and its training machinery."""

    def __init__(self, model_cfg, critic_cfg, actor_cfg: ActorConfig, total_steps: int,
                 seed: int = 1234, full_state: Any = None) -> None:
        from megatron_rl.actor.actor import _build_model, variable_shapes

        self.cfg = critic_cfg
        self.actor_cfg = dataclasses.replace(
            actor_cfg, mini_batch_size=critic_cfg.mini_batch_size or actor_cfg.mini_batch_size,
            ppo_epochs=critic_cfg.ppo_epochs)
        self.model = _build_model(model_cfg, seed, full_state)  # fp32, then cast
        variable_shapes(self.model, actor_cfg)
        if _is_last_stage():
            device = next(self.model.parameters()).device
            head = torch.nn.Linear(model_cfg.hidden_size, 1, bias=True)
            torch.nn.init.zeros_(head.weight)
            torch.nn.init.zeros_(head.bias)
            self.model.value_head = head.to(device)
        self.precision = set_precision(self.model, actor_cfg.precision)
        # ``self.net`` runs: ``Float16Module(self.model)`` in half precision (casts the weights)
        self.net = wrap_precision(self.model)
        self._call = model_call_kwargs(self.net)  # half-precision hidden states on the last stage
        self.ddp = wrap_ddp(self.net)
        optim = OptimConfig(lr=critic_cfg.lr, weight_decay=critic_cfg.weight_decay,
                            clip_grad=critic_cfg.clip_grad)
        self.optimizer, self.scheduler = build_optimizer(self.ddp, optim, total_steps)
        # the schedule multiplies each loss by the fp16 loss scale (1 for bf16/fp32), as for the
        # actor: the optimizer divides the gradients by it
        self.model.config.grad_scale_func = getattr(self.optimizer, "scale_loss", None)
        self.optimizer_steps = 0

    # ---- values and advantages -----------------------------------------------------------------
    def _micro_batches(self, batch: Mapping[str, Any], rows: slice | None = None) -> list[dict]:
        n = batch["tokens"].shape[0]
        slices = split_rows(n, self.actor_cfg.micro_batch_size,
                            f"actor.micro_batch_size={self.actor_cfg.micro_batch_size}")
        return [{k: v[s] for k, v in batch.items() if isinstance(v, torch.Tensor)}
                for s in slices]

    @torch.no_grad()
    def values(self, batch: Mapping[str, Any]) -> torch.Tensor | None:
        """Forward-only values ``[N, S]`` of this rank's rows (last stage; None elsewhere)."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        budget, groups = self.actor_cfg.max_tokens_per_micro_batch, None
        if budget:
            mbs, groups = budget_forward_batches(  # one count over DP, fillers last
                {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}, budget,
                group=dp_host_group(), cp=cp_size())
        else:
            mbs = self._micro_batches(batch)
        bsz, seq = validate_micro_batches(mbs, bool(budget))
        model, net = self.model, self.net
        device = next(model.parameters()).device

        def forward_step(data_iterator, model_chunk):
            mb = next(data_iterator)
            tokens, mask = mb["tokens"].to(device), mb["mask"].to(device)
            hidden = _trunk_forward(model_chunk, tokens, mask, self._call)
            return hidden, lambda h, non_loss_data=True: token_values(model, h, mask)

        net.eval()
        try:
            outs = get_forward_backward_func()(
                forward_step_func=forward_step, data_iterator=iter(mbs), model=[net],
                num_microbatches=len(mbs), seq_length=padded_length(seq, cp_size()),
                micro_batch_size=bsz, forward_only=True, collect_non_loss_data=True)
        finally:
            net.train()
        if not _is_last_stage():
            return None
        if groups is not None:  # back to [N, S] rows in batch order
            return unsplit_rows(list(outs), groups, *batch["tokens"].shape)
        return torch.cat(list(outs))

    def add_advantages(self, batch: dict[str, Any]) -> dict[str, Any]:
        """Adds ``values``, ``returns`` and GAE ``advantages`` ``[N, S]`` fp32 (last stage), on
        the batch's device; computed on the model's device."""
        from megatron.core import parallel_state as ps

        values = self.values(batch)
        if values is None:
            return batch
        mask = batch["mask"].to(values.device)
        adv, ret = gae_advantages(batch["token_rewards"].to(values.device), values, mask,
                                  self.cfg.gamma, self.cfg.lam)
        if self.cfg.whiten_advantages:
            adv = masked_whiten(adv, mask, group=ps.get_data_parallel_group())
        home = batch["mask"].device  # results live where the batch lives
        batch["values"], batch["returns"], batch["advantages"] = (
            values.to(home), ret.to(home), adv.to(home))
        return batch

    def actor_trains(self, step: int) -> bool:
        """False during the critic warm-up (the first ``critic.warmup_steps`` RL steps)."""
        return step >= self.cfg.warmup_steps

    # ---- update --------------------------------------------------------------------------------
    def train_minibatch(self, mbs: list[dict]) -> dict[str, float]:
        """Forward/backward of one mini-batch's micro-batches, then one guarded optimizer step."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        from megatron_rl.loss import ReductionContext

        last, n_micro = _is_last_stage(), len(mbs)
        bsz, seq = validate_micro_batches(mbs, bool(self.actor_cfg.max_tokens_per_micro_batch))
        model, device = self.model, next(self.model.parameters()).device
        ctx = ReductionContext.from_minibatch([mb["mask"].to(device) for mb in mbs]) \
            if last else None
        sums: list[torch.Tensor] = []

        def forward_step(data_iterator, model_chunk):
            mb = next(data_iterator)
            tokens, mask = mb["tokens"].to(device), mb["mask"].to(device)
            hidden = _trunk_forward(model_chunk, tokens, mask, self._call)

            def loss_func(h):
                vpred = token_values(model, h, mask)
                loss, clip = value_loss_token_mean(
                    vpred, mb["values"].to(device), mb["returns"].to(device), mask,
                    self.cfg.cliprange_value, ctx.token_denominator)
                vsum = (vpred.detach() * mask.float()).sum() / ctx.token_denominator
                sums.append(torch.stack([loss.detach(), clip.detach(), vsum]))
                # The schedule divides by n_micro and DDP averages over DP (x CP, which the
                # schedule multiplies back): undo both.
                return loss * n_micro * ctx.grad_scale, {}

            return hidden, loss_func

        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(mbs), model=[self.ddp],
            num_microbatches=n_micro, seq_length=padded_length(seq, cp_size()),
            micro_batch_size=bsz, forward_only=False)
        metrics: dict[str, float] = {}
        bad = torch.zeros(2, device=device)
        if last:
            tot = ctx.all_reduce(torch.stack(sums).sum(0).double())
            bad[0] = float(not bool(torch.isfinite(tot).all()))
            metrics = {"critic/vf_loss": float(tot[0]), "critic/vf_clipfrac": float(tot[1]),
                       "critic/vpred_mean": float(tot[2])}
        for p in self.model.parameters():
            g = getattr(p, "main_grad", p.grad)
            if g is not None:
                bad[1] = torch.maximum(bad[1], (~torch.isfinite(g)).any().float())
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        grad_norm = float("nan")
        if not bool(bad.any()):
            self.wait_for_save_copy()  # an async checkpoint's host copy of these weights
            _, grad_norm, _ = self.optimizer.step()
            self.scheduler.step(1)
            self.optimizer_steps += 1
        else:  # NaN/inf: never trained on
            self.ddp.zero_grad_buffer()
            self.optimizer.zero_grad()
        metrics.update({"critic/grad_norm": float(grad_norm if grad_norm is not None else 0.0),
                        "critic/skipped": float(bool(bad.any()))})
        return metrics

    def update(self, batch: Mapping[str, Any], step: int,
               actor_history: list[dict] | None = None) -> list[dict[str, float]]:
        """All critic epochs/mini-batches of one RL step; the actor's history with the critic's
        last metrics (and ``critic/actor_trained``) merged into its final entry."""
        from megatron.core import parallel_state as ps

        keys = ("tokens", "mask", "values", "returns", "row_index")
        local = {k: batch[k] for k in keys if k in batch}
        if "values" not in local:  # not the last stage: only tokens travel through the pipeline
            local["values"] = local["returns"] = torch.zeros(batch["tokens"].shape,
                                                      device=batch["tokens"].device)
        dp = ps.get_data_parallel_world_size()
        budget = self.actor_cfg.max_tokens_per_micro_batch
        plan = minibatch_slices(batch["tokens"].shape[0], dataclasses.replace(
            self.actor_cfg, micro_batch_size=1) if budget else self.actor_cfg, dp)
        metrics: dict[str, float] = {}
        for _ in range(self.actor_cfg.ppo_epochs):
            for slices in plan:
                if budget:  # the value loss is a token mean: no sequence index needed
                    rows = slice(slices[0].start, slices[-1].stop)
                    mbs = budget_micro_batches(local, rows, budget, None, dp_host_group(),
                                               cp=cp_size())
                else:
                    mbs = [{k: v[s] for k, v in local.items()} for s in slices]
                metrics = self.train_minibatch(mbs)
        history = list(actor_history or [])
        last = dict(history[-1]) if history else {}
        last.update(metrics)
        last["critic/actor_trained"] = float(self.actor_trains(step))
        return history[:-1] + [last]

    # ---- checkpoints ---------------------------------------------------------------------------
    def save(self, root: str, step: int) -> str:
        return self.saver.save(root, step, self.ddp, self.optimizer, self.scheduler,
                               {"optimizer_steps": self.optimizer_steps})

    @property
    def saver(self) -> CheckpointSaver:
        """Synchronous unless ``saver.async_save`` is set (``trainer.async_save``)."""
        if getattr(self, "_saver", None) is None:
            self._saver = CheckpointSaver()
        return self._saver

    def wait_for_save_copy(self) -> None:
        """Block until an asynchronous save in flight holds its host copy of the weights and
        optimizer state (before they change: the optimizer step, an offload); no collective."""
        saver = getattr(self, "_saver", None)
        if saver is not None:
            saver.wait_staged()

    def wait_for_save(self) -> str | None:
        """Collective: finish an asynchronous save in flight (moves ``latest``); its path."""
        return self.saver.wait()

    def resume(self, root: str) -> bool:
        """Load the newest critic checkpoint under ``root``; False when there is none."""
        self.wait_for_save()
        path = latest_checkpoint(root)
        if path is None:
            return False
        info = load_checkpoint(path, self.ddp, self.optimizer, self.scheduler)
        self.optimizer_steps = info["trainer"].get("optimizer_steps", 0)
        return True
