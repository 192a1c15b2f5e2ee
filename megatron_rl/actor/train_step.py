"""The actor's policy update over megatron's pipeline schedules.

One RL step's batch (this DP rank's rows, ``[N, S]`` tensors) is cut into mini-batches (one
optimizer step each) and micro-batches (one pipeline forward/backward each):

- a global mini-batch of ``mini_batch_size`` sequences is split over DP ranks as contiguous row
  blocks (rank r holds rows ``[r*G/dp, (r+1)*G/dp)`` of every mini-batch), the order the loss
  module's global token indices assume;
- the :class:`~megatron_rl.loss.context.ReductionContext` is built once per mini-batch, before the
  schedule runs, so every micro-batch divides by the global denominators;
- Clip-Cov/KL-Cov select their tokens once per mini-batch from mini-batch-wide statistics
  (``old_logp`` for the first update after a rollout, else a no-grad pre-pass, unless the config
  says ``cov_stat_source: old_logp``);
- megatron's schedule divides each micro-batch loss by the number of micro-batches and DDP averages
  gradients over DP; the loss handed back is multiplied by both, so the summed gradient equals that
  of one process holding the whole mini-batch.

Numerical guard: a non-finite loss or gradient skips the optimizer step (gradients dropped, weights
untouched), is reported with its step, and after ``max_consecutive_skips`` skips in a row the run
stops with :class:`NonFiniteError`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch
import torch.distributed as dist

from megatron_rl.actor.actor_config import ActorConfig, ActorConfigError  # noqa: F401 - re-export
from megatron_rl.actor.cp_forward import cp_model_forward, cp_response_logprob_entropy
from megatron_rl.actor.forward import forward_logprob_entropy
from megatron_rl.actor.micro_batches import (
    budget_micro_batches,
    dp_host_group,
    global_seq_ids,
)
from megatron_rl.actor.moe_padding import padding_kwargs
from megatron_rl.actor.precision import bare_model, model_call_kwargs
from megatron_rl.loss import (
    LossConfig,
    LossInputs,
    MetricAccumulator,
    ReductionContext,
    compute_loss,
    entropy_dynamics_diagnostic,
    select_cov_tokens,
)
from megatron_rl.loss.bapo import bapo_bounds
from megatron_rl.loss.context import rank_token_bound
from megatron_rl.loss.rollout_correction import denominator_masks
from megatron_rl.loss.siren import SirenTerm, siren_select
from megatron_rl.models.heads import response_logprob_entropy
from megatron_rl.models.response_tokens import response_indices
from megatron_rl.parallel.context_parallel import (
    cp_size,
    padded_length,
)

COV_LOSSES = ("clip_cov", "kl_cov")
# losses whose per-mini-batch statistics need the current weights' log-probs (a no-grad pre-pass
# for every update but the first of an RL step, where they are old_logp)
PREPASS_LOSSES = COV_LOSSES + ("bapo",)


class NonFiniteError(RuntimeError):
    """Too many consecutive optimizer steps had a non-finite loss or gradient."""


@dataclass
class NumericalGuard:
    """Counts consecutive skipped steps; raises after ``limit`` in a row."""

    limit: int = 3
    consecutive: int = 0
    skipped_steps: list[int] = field(default_factory=list)

    def record(self, ok: bool, step: int, reason: str) -> None:
        if ok:
            self.consecutive = 0
            return
        self.consecutive += 1
        self.skipped_steps.append(step)
        if dist.get_rank() == 0:
            print(f"[guard] step {step}: {reason}; optimizer step skipped "
                  f"({self.consecutive}/{self.limit} consecutive)", flush=True)
        if self.consecutive >= self.limit:
            raise NonFiniteError(f"{self.consecutive} consecutive non-finite updates (last at step "
                                 f"{step}: {reason}); stopping. Skipped steps: "
                                 f"{self.skipped_steps}")


def split_rows(n: int, size: int, what: str) -> list[slice]:
    """Cut ``n`` rows into blocks of ``size``; ``n`` must be a multiple of ``size``."""
    if size < 1 or n % size:
        raise ActorConfigError(f"{what}: {n} rows cannot be split into blocks of {size}")
    return [slice(i, i + size) for i in range(0, n, size)]


def minibatch_slices(n_local: int, cfg: ActorConfig, dp: int) -> list[list[slice]]:
    """Per mini-batch, the list of micro-batch row slices of this rank's ``n_local`` rows."""
    global_rows = n_local * dp
    mini = cfg.mini_batch_size or global_rows
    if mini % dp:
        raise ActorConfigError(f"actor.mini_batch_size={mini} is not divisible by the "
                               f"data-parallel size {dp}")
    local_mini = mini // dp
    out = []
    for mb in split_rows(n_local, local_mini, f"actor.mini_batch_size={mini} over dp={dp}"):
        micro = split_rows(local_mini, cfg.micro_batch_size,
                           f"actor.micro_batch_size={cfg.micro_batch_size}")
        out.append([slice(mb.start + m.start, mb.start + m.stop) for m in micro])
    return out


def _take(batch: dict[str, Any], rows: slice) -> dict[str, Any]:
    return {k: (v[rows] if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}


def _pipeline_size() -> int:
    from megatron.core import parallel_state as ps

    return ps.get_pipeline_model_parallel_world_size()


def _last_stage() -> bool:
    from megatron.core import parallel_state as ps

    return ps.is_pipeline_last_stage()


def entropy_top_p(cfg: LossConfig) -> float:
    """The vocabulary nucleus of every entropy the actor computes: SIREN's ``siren_top_p`` when
    SIREN is on (its selection, anchor and regulariser, and the logged entropy), else 1."""
    return cfg.siren_top_p if cfg.siren_coef > 0 else 1.0


def needs_entropy(cfg: LossConfig, adaptive: bool) -> tuple[bool, bool]:
    """(compute entropy in the update pass, entropy needs a gradient)."""
    grad = cfg.entropy_coeff > 0 or adaptive or cfg.siren_coef > 0
    return True, grad


class PolicyUpdater:
    """Runs the mini-batch/micro-batch update of one RL step on a DDP-wrapped model chunk."""

    def __init__(self, ddp_model, optimizer, scheduler, actor_cfg: ActorConfig,
                 loss_cfg: LossConfig, entropy_controller=None, routing=None) -> None:
        self.model = ddp_model
        self.routing = routing  # RoutingReplay (actor.routing_replay r2/r3) or None
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.cfg = actor_cfg
        self.loss_cfg = loss_cfg
        self.entropy_controller = entropy_controller
        self.guard = NumericalGuard(actor_cfg.max_consecutive_skips)
        self.optimizer_steps = 0
        self.siren_anchor: torch.Tensor | None = None  # SIREN's H_anchor (0-dim, last stage)
        # called right before each optimizer step (the actor: wait for an asynchronous
        # checkpoint's host copy of the weights it is about to change)
        self.before_optimizer_step: Callable[[], None] | None = None

    @property
    def module(self):
        return getattr(self.model, "module", self.model)

    # ---- one mini-batch ----------------------------------------------------------------------
    def _micro_batches(self, batch: dict, slices: list[slice]) -> list[dict]:
        return [_take(batch, s) for s in slices]

    def _cov_prepass(self, mbs: list[dict], first_update: bool) -> list[dict] | None:
        """The current weights' log-probs (and entropies, for SIREN) for the per-mini-batch
        statistics of Clip-Cov/KL-Cov, BAPO's bound search and SIREN's selection when they are
        not the old pass's: a pipeline pass, so every stage runs it (outputs on the last stage)."""
        cfg = self.loss_cfg
        if first_update:
            return None
        cov_old = cfg.policy_loss in COV_LOSSES and cfg.cov_stat_source == "old_logp"
        siren = cfg.siren_coef > 0
        if not siren and (cfg.policy_loss not in PREPASS_LOSSES or cov_old):
            return None
        return forward_logprob_entropy(self.module, mbs, temperature=self.cfg.temperature,
                                       compute_entropy=siren,
                                       chunk_size=self.cfg.logprob_chunk_size,
                                       fused=self.cfg.use_fused_head,
                                       pack=self.cfg.pack_sequences, routing=self.routing,
                                       entropy_top_p=entropy_top_p(cfg))

    def _cov_selection(self, mbs: list[dict], ctx: ReductionContext, prepass: list[dict] | None,
                       step: int, salt: int = 0):
        cfg = self.loss_cfg
        if cfg.policy_loss not in COV_LOSSES:
            return None, {}
        olds = [mb["old_logp"] for mb in mbs]
        # exact: the current weights' log-probs (no grad, before any backward), else the old ones
        use_old = prepass is None or cfg.cov_stat_source == "old_logp"
        stat = olds if use_old else [o["logp"] for o in prepass]
        sel = select_cov_tokens(ctx, cfg, stat, olds, [mb["advantages"] for mb in mbs],
                                [mb["mask"] for mb in mbs], step, salt=salt)
        return sel.selected, sel.stats

    def _bapo_bounds(self, mbs: list[dict], ctx: ReductionContext, prepass: list[dict] | None):
        """BAPO's ``[2]`` ratio bounds of this mini-batch (None for other losses) and metrics."""
        if self.loss_cfg.policy_loss != "bapo":
            return None, {}
        olds = [mb["old_logp"] for mb in mbs]
        stat = olds if prepass is None else [o["logp"] for o in prepass]
        out = bapo_bounds(ctx, self.loss_cfg, stat, olds, [mb["advantages"] for mb in mbs],
                          [mb["mask"] for mb in mbs])
        return out.bounds, out.stats

    def _siren_terms(self, mbs: list[dict], ctx: ReductionContext, prepass: list[dict] | None):
        """SIREN's per-micro-batch terms (None when off) and metrics: the peak-entropy tokens
        of the current weights' entropies (``old_entropy`` at the first update, else the
        pre-pass), their mean and its gap to the anchor set by :meth:`siren_anchor_from`."""
        cfg = self.loss_cfg
        if cfg.siren_coef <= 0:
            return None, {}
        ents = ([mb["old_entropy"] for mb in mbs] if prepass is None
                else [o["entropy"] for o in prepass])
        sel = siren_select(ctx, cfg, ents, [mb["mask"] for mb in mbs])
        anchor = self.siren_anchor.to(sel.h_sel.device)
        gap = sel.h_sel - anchor
        terms = [SirenTerm(s, gap, sel.n_sel) for s in sel.selected]
        frac = sel.n_sel / ctx.num_tokens.clamp_min(1).double()
        return terms, {"siren/selected_entropy": sel.h_sel.float(), "siren/anchor": anchor.float(),
                       "siren/gap": gap.float(), "siren/selected_frac": frac.float()}

    def siren_anchor_from(self, batch: dict[str, Any]) -> None:
        """Set SIREN's anchor once (last pipeline stage): ``loss.siren_anchor`` when given, else
        the selected mean entropy of this first step's whole batch (old pass, all DP ranks)."""
        cfg = self.loss_cfg
        if cfg.siren_coef <= 0 or self.siren_anchor is not None or not _last_stage():
            return
        dev = batch["mask"].device
        if cfg.siren_anchor is not None:
            self.siren_anchor = torch.tensor(float(cfg.siren_anchor), dtype=torch.float64,
                                             device=dev)
            return
        ctx = ReductionContext.from_minibatch([batch["mask"]])
        self.siren_anchor = siren_select(ctx, cfg, [batch["old_entropy"]],
                                         [batch["mask"]]).h_sel

    def train_minibatch(self, mbs: list[dict], step: int, first_update: bool,
                        diagnose: bool | None = None, salt: int = 0) -> dict[str, float]:
        """Forward/backward all micro-batches of one mini-batch, then one guarded optimizer step.

        ``diagnose``: run the §12 entropy-dynamics diagnostic (default: ``first_update``);
        ``salt``: mixed into Clip-Cov's random keys (epoch and mini-batch, see :meth:`update`).
        Metrics are returned on the last pipeline stage (empty dict elsewhere).
        """
        from megatron.core.pipeline_parallel import get_forward_backward_func

        last = _last_stage()
        cfg, n_micro = self.loss_cfg, len(mbs)
        bsz = max(mb["tokens"].shape[0] for mb in mbs)  # the shapes differ only with a token
        seq = max(mb["tokens"].shape[1] for mb in mbs)  # budget (variable_seq_lengths)
        ctx = selected = bounds = siren = None
        cov_stats: dict = {}
        acc = MetricAccumulator()
        losses: list[torch.Tensor] = []
        prepass = self._cov_prepass(mbs, first_update)
        if last:
            extra = denominator_masks(mbs, cfg)  # rollout_correction_denominator: kept
            if cfg.positive_nll_coef > 0:
                extra["positive"] = [mb["mask"].bool() & mb["positive"].bool()[:, None]
                                     for mb in mbs]
            masks = [mb["mask"] for mb in mbs]
            budget = "seq_id" in mbs[0]  # token-budget micro-batches: regrouped rows
            # the rank bound needs equal row counts on every DP rank; a token budget's filler
            # micro-batches (one row each) break that, so there the exchange is sized by the
            # gathered counts (gloo) or falls back to the radix selection (NCCL)
            bound = None if budget else rank_token_bound(
                masks, getattr(bare_model(self.model), "max_sequence_length", None))
            ctx = ReductionContext.from_minibatch(
                masks, extra_masks=extra, rank_numel_bound=bound,
                seq_ids=[mb["seq_id"] for mb in mbs] if budget else None)
            selected, cov_stats = self._cov_selection(mbs, ctx, prepass, step, salt)
            bounds, bapo_stats = self._bapo_bounds(mbs, ctx, prepass)
            siren, siren_stats = self._siren_terms(mbs, ctx, prepass)
            cov_stats = {**cov_stats, **bapo_stats, **siren_stats}
            diagnose = first_update if diagnose is None else diagnose
            if diagnose and cfg.policy_loss != "nll":  # §12 diagnostic, every epoch-0 mini-batch
                cov_stats = {**cov_stats, **entropy_dynamics_diagnostic(
                    ctx, [mb["old_logp"] for mb in mbs], [mb["advantages"] for mb in mbs],
                    [mb["mask"] for mb in mbs], cfg.diagnostic_top_frac)}
        alpha = None if self.entropy_controller is None else self.entropy_controller.alpha
        compute_ent, ent_grad = needs_entropy(cfg, self.entropy_controller is not None)
        module = bare_model(self.model)  # the GPTModel under DDP / Float16Module (the head)
        half_kwargs = model_call_kwargs(self.model)
        # megatron-core's PackedSeqParams: imported here, config loading must not need megatron
        from megatron_rl.actor.packing import PackedMicroBatches, token_counts, token_metrics

        cp = cp_size()  # > 1: each row split over the CP ranks (parallel/context_parallel.py)
        packed = PackedMicroBatches(mbs, common=_pipeline_size() > 1, cp=cp) \
            if self.cfg.pack_sequences else None
        # response positions of every micro-batch: one host sync per mini-batch, not per micro
        index = response_indices([mb["mask"] for mb in mbs]) \
            if last and packed is None and cp == 1 else None
        head_kwargs = dict(temperature=self.cfg.temperature, compute_entropy=compute_ent,
                           entropy_grad=ent_grad, chunk_size=self.cfg.logprob_chunk_size,
                           fused=self.cfg.use_fused_head, entropy_top_p=entropy_top_p(cfg))

        def forward_step(data_iterator, model_chunk):
            i, mb = next(data_iterator)
            tokens, mask = mb["tokens"], mb["mask"]
            if self.routing is not None:  # the old pass's (r2) or the engine's (r3) expert ids
                self.routing.before_forward(mb, False)
            if packed is not None:
                hidden = packed.model_forward(model_chunk, i, **half_kwargs)
            elif cp > 1:
                hidden = cp_model_forward(model_chunk, tokens, **half_kwargs,
                                          **padding_kwargs(model_chunk, mask))
            else:
                pos = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0).expand_as(
                    tokens)
                hidden = model_chunk(tokens, pos, None, **half_kwargs,  # MoE: padding mask
                                     **padding_kwargs(model_chunk, mask))

            def loss_func(hidden_states):
                if packed is not None:
                    logp, ent = packed.logprob_entropy(module, hidden_states, i, **head_kwargs)
                elif cp > 1:  # full [B, S] values on every CP rank (summed over CP)
                    logp, ent = cp_response_logprob_entropy(module, hidden_states, tokens, mask,
                                                            **head_kwargs)
                else:
                    logp, ent = response_logprob_entropy(module, hidden_states, tokens, mask,
                                                         index=index[i], **head_kwargs)
                out = compute_loss(LossInputs(
                    logp=logp, old_logp=mb["old_logp"], advantages=mb["advantages"], mask=mask,
                    entropy=ent, old_entropy=mb.get("old_entropy"), ref_logp=mb.get("ref_logp"),
                    cov_selected=None if selected is None else selected[i],
                    positive=mb.get("positive"), rollout_logp=mb.get("rollout_logp"),
                    bapo_bounds=bounds, siren=None if siren is None else siren[i],
                    teacher_logp=mb.get("teacher_logp")), cfg, ctx,
                    entropy_coeff=alpha)
                acc.update(out.stats)
                losses.append(out.loss.detach())
                # The schedule divides by n_micro and DDP averages over DP x CP: undo both.
                return out.loss_for_backward * n_micro, {}

            return hidden, loss_func

        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        try:
            get_forward_backward_func()(
                forward_step_func=forward_step, data_iterator=iter(list(enumerate(mbs))),
                model=[self.model], num_microbatches=n_micro,
                seq_length=padded_length(seq, cp) if packed is None else packed.seq_length,
                micro_batch_size=bsz if packed is None else packed.micro_batch_size,
                forward_only=False)
        finally:
            if self.routing is not None:
                self.routing.off()

        metrics: dict[str, float] = {}
        dev = mbs[0]["tokens"].device
        loss_bad = torch.zeros((), dtype=torch.float32, device=dev)
        if last:
            # loss sum, then (used tokens, processed tokens, micro-batches): one all-reduce
            sizes = token_counts(mbs, packed, dev)
            total = ctx.all_reduce(torch.cat([torch.stack(losses).double().sum().view(1), sizes]))
            loss_bad = (~torch.isfinite(total[0])).float()
            metrics = {k: float(v) for k, v in {**acc.reduce(ctx), **cov_stats}.items()}
            metrics["actor/loss"] = float(total[0])
            metrics.update(token_metrics(total[1:]))
            metrics["actor/tokens"] = float(ctx.num_tokens)  # weight of the step's aggregation
        grad_bad = self._nonfinite_grads(dev)
        flag = torch.stack([loss_bad, grad_bad])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # one host-visible decision per mini-batch
        ok = not bool(flag.any())
        grad_norm = float("nan")
        if ok:
            if self.before_optimizer_step is not None:
                self.before_optimizer_step()
            success, grad_norm, _ = self.optimizer.step()
            ok = bool(success) and grad_norm is not None and grad_norm == grad_norm and abs(
                grad_norm) != float("inf")
            self.scheduler.step(1)
            self.optimizer_steps += 1
        else:
            self.model.zero_grad_buffer()
            self.optimizer.zero_grad()
        reason = "non-finite loss" if flag[0] else "non-finite gradient"
        self.guard.record(ok, step, reason)
        metrics.update({"actor/grad_norm": float(grad_norm) if grad_norm is not None else 0.0,
                        "actor/lr": float(self.optimizer.param_groups[0]["lr"]),
                        "actor/skipped": 0.0 if ok else 1.0})
        return metrics

    def _nonfinite_grads(self, device: torch.device) -> torch.Tensor:
        """0-dim fp32 on ``device``: 1 when any local gradient has a NaN/inf."""
        bad = torch.zeros((), dtype=torch.float32, device=device)
        for p in self.module.parameters():
            g = getattr(p, "main_grad", None)
            if g is None:
                g = p.grad
            if g is not None:
                bad = torch.maximum(bad, (~torch.isfinite(g)).any().float())
        return bad

    # ---- one RL step ---------------------------------------------------------------------------
    def update(self, batch: dict[str, Any], step: int) -> list[dict[str, float]]:
        """All epochs and mini-batches of one RL step over this DP rank's ``batch`` rows."""
        from megatron.core import parallel_state as ps

        from megatron_rl.parallel.runtime import device, move_batch_

        move_batch_(batch, device())  # once per RL step; no-op when already there
        self.siren_anchor_from(batch)
        n_local = batch["tokens"].shape[0]
        dp = ps.get_data_parallel_world_size()
        budget = self.cfg.max_tokens_per_micro_batch
        # with a token budget only the mini-batches' rows are used here
        plan = minibatch_slices(n_local, replace(self.cfg, micro_batch_size=1) if budget else
                                self.cfg, dp)
        history = []
        for epoch in range(self.cfg.ppo_epochs):
            for j, slices in enumerate(plan):
                if budget:
                    rows = slice(slices[0].start, slices[-1].stop)
                    mbs = budget_micro_batches(batch, rows, budget, global_seq_ids(
                        batch, rows, dp, ps.get_data_parallel_rank()),
                        dp_host_group(), packed=self.cfg.pack_sequences, cp=cp_size())
                else:
                    mbs = self._micro_batches(batch, slices)
                history.append(self.train_minibatch(
                    mbs, step, first_update=(epoch == 0 and j == 0), diagnose=epoch == 0,
                    salt=epoch * 65536 + j))  # Clip-Cov draws new tokens per epoch/mini-batch
        return history
