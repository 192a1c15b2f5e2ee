"""The Megatron actor: model stage + DDP + optimizer + policy updater + checkpoints, for one rank.

Batch convention (this DP rank's rows): ``tokens [N, S]`` int64, ``mask [N, S]`` bool (response
tokens; position 0 never), ``advantages [N, S]`` fp32; the old-policy pass adds ``old_logp`` and
``old_entropy``, the reference pass ``ref_logp`` and the teacher pass ``teacher_logp`` (``[N, S]``
fp32, last pipeline stage only).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from megatron_rl.actor.checkpoint import CheckpointSaver, latest_checkpoint, load_checkpoint
from megatron_rl.actor.forward import forward_logprob_entropy
from megatron_rl.actor.micro_batches import budget_forward_batches, dp_host_group, unsplit_rows
from megatron_rl.actor.optim import OptimConfig, build_optimizer, wrap_ddp
from megatron_rl.actor.precision import (
    apply_recompute,
    resolve_offload_ref,
    set_precision,
    wrap_precision,
)
from megatron_rl.actor.train_step import ActorConfig, PolicyUpdater, entropy_top_p, split_rows
from megatron_rl.loss import LossConfig
from megatron_rl.models.builder import build_gpt_model
from megatron_rl.models.config import ModelConfig
from megatron_rl.models.weights import load_full_state_dict
from megatron_rl.parallel.context_parallel import cp_size


def _build_model(cfg: ModelConfig, seed: int, state, lora=None) -> torch.nn.Module:
    """This rank's stage: from a weight source (anything with ``load_into(model)``, e.g.
    :class:`megatron_rl.convert.model_source.HFShardSource`), from canonical full weights,
    or seeded. With ``lora`` (an enabled :class:`LoraConfig`): megatron's local layer spec, base
    weights frozen, adapters added (:mod:`megatron_rl.models.lora`)."""
    if lora is not None and lora.enabled:
        from megatron_rl.models.builder import local_spec_only
        from megatron_rl.models.lora import apply_lora

        with local_spec_only():
            model = _build_model(cfg, seed, state)
        apply_lora(model, lora, seed)
        return model
    if hasattr(state, "load_into"):
        from megatron_rl.convert.model_source import build_model_from_source

        return build_model_from_source(cfg, state)
    model = build_gpt_model(cfg, seed=seed)
    if state is not None:
        load_full_state_dict(model, state)
    return model


def variable_shapes(model: torch.nn.Module, cfg: ActorConfig) -> None:
    """Token-budget micro-batches have their own ``[B, T]`` each: the pipeline's P2P exchanges
    the shape before each activation (megatron-core's ``variable_seq_lengths``)."""
    if cfg.max_tokens_per_micro_batch:
        model.config.variable_seq_lengths = True


def _frozen_model(cfg: ModelConfig, seed: int, state, actor_cfg: ActorConfig) -> torch.nn.Module:
    """A frozen model (reference policy or distillation teacher): this rank's stage of ``cfg``
    from ``state`` (see :func:`_build_model`), in the actor's precision, eval mode, no grads."""
    model = _build_model(cfg, seed, state)
    variable_shapes(model, actor_cfg)
    set_precision(model, actor_cfg.precision)
    return wrap_precision(model).eval().requires_grad_(False)


def _frozen_offload(model: torch.nn.Module | None, enabled: bool):
    """A :class:`~megatron_rl.actor.offload.FrozenModelOffload` of ``model`` (its weights in
    pinned host memory between passes) when ``enabled``, else None."""
    if model is None or not enabled:
        return None
    from megatron_rl.actor.offload import FrozenModelOffload

    return FrozenModelOffload(model)


class Actor:
    """One rank's share of the policy model and its training machinery."""

    def __init__(self, model_cfg: ModelConfig, actor_cfg: ActorConfig, optim_cfg: OptimConfig,
                 loss_cfg: LossConfig, total_steps: int, seed: int = 1234,
                 full_state: Mapping[str, torch.Tensor] | None = None,
                 entropy_controller=None,
                 ref_state: Mapping[str, torch.Tensor] | None = None,
                 use_reference: bool = False, teacher_cfg: ModelConfig | None = None,
                 teacher_state=None) -> None:
        self.model_cfg, self.cfg, self.loss_cfg = model_cfg, actor_cfg, loss_cfg.validate()
        self.lora = actor_cfg.lora if actor_cfg.lora.enabled else None
        # fp32 weights, then cast; with LoRA the base is frozen and only adapters train
        self.model = _build_model(model_cfg, seed, full_state, self.lora)
        variable_shapes(self.model, actor_cfg)
        set_precision(self.model, actor_cfg.precision)
        apply_recompute(self.model, actor_cfg.recompute)
        # ``self.model`` stays the bare GPTModel (half-precision weights when bf16/fp16);
        # ``self.net`` is what runs: ``Float16Module(self.model)`` in half precision.
        self.net = wrap_precision(self.model)
        # Frozen reference policy, only when a KL term needs it (KL loss, or KL in the reward:
        # ``use_reference``): the initial weights
        # (``ref_state``, else ``full_state``, else the seeded init). With LoRA the reference is
        # the same model with its adapters off: no second copy of the weights.
        self.ref_model = None
        self.free_reference = self.lora is not None and (self.loss_cfg.use_kl_loss
                                                         or use_reference)
        if (self.loss_cfg.use_kl_loss or use_reference) and self.lora is None:
            ref = ref_state if ref_state is not None else full_state
            self.ref_model = _frozen_model(model_cfg, seed, ref, actor_cfg)
        self.offload_ref = resolve_offload_ref(actor_cfg.offload_ref)
        # weights in (pinned) host memory between reference passes
        self.ref_offload = _frozen_offload(self.ref_model, self.offload_ref)
        # On-policy distillation teacher (docs/distillation.md): another frozen model with its
        # own architecture and weights, placed like the reference (this rank's TP/PP stage,
        # same precision, offloaded with actor.offload_ref).
        self.teacher_model = None
        if teacher_cfg is not None:
            self.teacher_model = _frozen_model(teacher_cfg, seed, teacher_state, actor_cfg)
        self.teacher_offload = _frozen_offload(self.teacher_model, self.offload_ref)
        if actor_cfg.pack_sequences:
            from megatron_rl.actor.packing import check_packing_backend

            check_packing_backend(self.model)
        self.routing = None  # MoE routing replay (actor.routing_replay r2/r3): this stage's routers
        if actor_cfg.routing_replay != "none":
            from megatron_rl.actor.routing_replay import RoutingReplay

            self.routing = RoutingReplay(self.model, actor_cfg.routing_replay)
        self.ddp = wrap_ddp(self.net, optim_cfg.use_distributed_optimizer)
        self.optimizer, self.scheduler = build_optimizer(self.ddp, optim_cfg, total_steps)
        # megatron's schedule multiplies each loss by this before backward (the fp16 loss scale;
        # 1 for bf16/fp32), as Megatron-LM's training loop does.
        self.model.config.grad_scale_func = getattr(self.optimizer, "scale_loss", None)
        self.updater = PolicyUpdater(self.ddp, self.optimizer, self.scheduler, actor_cfg,
                                     self.loss_cfg, entropy_controller, routing=self.routing)
        self.updater.before_optimizer_step = self.wait_for_save_copy

    def micro_batches(self, batch: Mapping[str, Any]) -> list[dict]:
        """Cut this rank's rows into micro-batches of ``actor.micro_batch_size`` sequences."""
        n = batch["tokens"].shape[0]
        return [{k: v[s] if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
                for s in split_rows(n, self.cfg.micro_batch_size,
                                    f"actor.micro_batch_size={self.cfg.micro_batch_size}")]

    def logprobs(self, batch: Mapping[str, Any], compute_entropy: bool = True,
                 model: torch.nn.Module | None = None, temperature: float | None = None,
                 routing: str = "free") -> dict[str, torch.Tensor] | None:
        """Forward-only ``logp``/``entropy`` ``[N, S]`` of ``batch`` (last stage; else None), at
        ``temperature`` (default: the actor's sampling temperature). ``routing`` (MoE with
        ``actor.routing_replay``): ``free`` routes normally, ``record`` writes each layer's expert
        ids into ``batch["routed_experts"]``, ``replay`` routes by them."""
        temp = self.cfg.temperature if temperature is None else temperature
        groups = None
        if self.cfg.max_tokens_per_micro_batch:
            # every DP rank runs the same count (fillers last; their outputs are dropped)
            mbs, groups = budget_forward_batches(dict(batch), self.cfg.max_tokens_per_micro_batch,
                                                 packed=self.cfg.pack_sequences,
                                                 group=dp_host_group(), cp=cp_size())
        else:
            mbs = self.micro_batches(batch)
        outs = forward_logprob_entropy(model or self.net, mbs,
                                       temperature=temp,
                                       compute_entropy=compute_entropy,
                                       chunk_size=self.cfg.logprob_chunk_size,
                                       fused=self.cfg.use_fused_head,
                                       pack=self.cfg.pack_sequences,
                                       routing=None if routing == "free" else self.routing,
                                       record_routing=routing == "record",
                                       entropy_top_p=entropy_top_p(self.loss_cfg)
                                       if compute_entropy else 1.0)
        if not outs:
            return None
        keys = ("logp", "entropy") if compute_entropy else ("logp",)
        if groups is not None:  # back to [N, S] rows in batch order
            n, seq = batch["tokens"].shape
            return {k: unsplit_rows([o[k] for o in outs], groups, n, seq) for k in keys}
        return {k: torch.cat([o[k] for o in outs]) for k in keys}

    def add_old_logprobs(self, batch: dict[str, Any]) -> dict[str, Any]:
        """The old-policy pass: adds ``old_logp`` and ``old_entropy`` (current weights). With
        ``actor.routing_replay``: r2 records this pass's expert ids into ``routed_experts``
        (replacing any from the engine), r3 routes by the engine's."""
        routing = "free"
        if self.routing is not None and self.cfg.routing_replay == "r2":
            from megatron_rl.actor.routing_replay import KEY, new_record_buffer

            batch[KEY] = new_record_buffer(batch, self.model_cfg.num_hidden_layers,
                                           self.model_cfg.num_experts_per_tok)
            routing = "record"
        elif self.routing is not None:
            routing = "replay"
        out = self.logprobs(batch, routing=routing)
        if out is not None:
            batch["old_logp"], batch["old_entropy"] = out["logp"], out["entropy"]
        return batch

    def add_ref_logprobs(self, batch: dict[str, Any]) -> dict[str, Any]:
        """The reference pass: adds ``ref_logp`` (no-op when no KL term is configured). With
        LoRA: the actor's own model with every adapter off (the base model)."""
        if self.free_reference:
            from megatron_rl.models.lora import adapters_disabled

            with adapters_disabled(self.model):
                out = self.logprobs(batch, compute_entropy=False)
            if out is not None:
                batch["ref_logp"] = out["logp"]
            return batch
        out = self._frozen_logprobs(batch, self.ref_model, self.ref_offload)
        if out is not None:
            batch["ref_logp"] = out
        return batch

    def add_teacher_logprobs(self, batch: dict[str, Any]) -> dict[str, Any]:
        """The teacher pass (on-policy distillation): adds ``teacher_logp`` ``[N, S]`` fp32, the
        teacher's log-prob of every sampled token at the actor's temperature (last stage; a
        no-op without a teacher)."""
        out = self._frozen_logprobs(batch, self.teacher_model, self.teacher_offload)
        if out is not None:
            batch["teacher_logp"] = out
        return batch

    def _frozen_logprobs(self, batch: Mapping[str, Any], model: torch.nn.Module | None,
                         offload) -> torch.Tensor | None:
        """``logp [N, S]`` of a frozen model (reference or teacher), onloaded for the pass when
        it is offloaded; None without the model or off the last stage."""
        if model is None:
            return None
        if offload is not None:
            offload.onload()
        try:
            out = self.logprobs(batch, compute_entropy=False, model=model)
        finally:
            if offload is not None:
                offload.offload()
        return None if out is None else out["logp"]

    def release(self) -> None:
        """Prepare a discarded actor for garbage collection (the SFT warm start's actor).

        The model config holds the optimizer (``grad_scale_func``, its bound ``scale_loss``);
        with megatron's distributed optimizer, the optimizer's shard views of the parameters
        carry autograd graphs that reach the parameters' gradient accumulators and DDP's hooks,
        i.e. the model. That cycle runs through C++ autograd nodes the garbage collector cannot
        traverse, so model, gradients and optimizer state would stay alive for good; cutting
        the config's link leaves only collectable cycles. The updater's hook back to this actor
        (``before_optimizer_step``) is cut for the same reason. The actor cannot train
        afterwards."""
        self.model.config.grad_scale_func = None
        self.updater.before_optimizer_step = None

    def update(self, batch: Mapping[str, Any], step: int) -> list[dict[str, float]]:
        """All optimizer steps of one RL step; metrics per mini-batch (last stage)."""
        return self.updater.update(dict(batch), step)

    def save(self, root: str, step: int, trainer_state: dict | None = None) -> str:
        """Atomic checkpoint of model, optimizer, scheduler, RNG and ``trainer_state``."""
        state = dict(trainer_state or {})
        if self.updater.entropy_controller is not None:
            from megatron_rl.actor.controller_state import last_stage_state

            # updated on the last stage, saved by rank 0: bring the last stage's state here
            state["entropy_controller"] = last_stage_state(self.updater.entropy_controller)
        if self.loss_cfg.siren_coef > 0:  # SIREN's anchor: set at the first step, kept
            state["siren_anchor"] = self._siren_anchor_state()
        state["optimizer_steps"] = self.updater.optimizer_steps
        return self.saver.save(root, step, self.ddp, self.optimizer, self.scheduler, state)

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

    def _siren_anchor_state(self) -> tuple[float, str] | None:
        """SIREN's anchor as ``(value, dtype name)`` from the last pipeline stage (which holds
        it), on every rank; None before the first step (collective over the host group)."""
        from megatron_rl.parallel import runtime

        a = self.updater.siren_anchor
        mine = (float(a), str(a.dtype).split(".")[-1]) if a is not None else None
        return runtime.broadcast_object(mine, runtime.last_stage_rank())

    def _load_siren_anchor(self, state: tuple[float, str] | None) -> None:
        """The saved anchor back on the last stage, in its dtype (a resumed run goes on from
        the same anchor, bit for bit)."""
        from megatron.core import parallel_state as ps

        from megatron_rl.parallel import runtime

        if state is not None and ps.is_pipeline_last_stage():
            self.updater.siren_anchor = torch.tensor(state[0], dtype=getattr(torch, state[1]),
                                                     device=runtime.device())

    def resume(self, root: str) -> dict[str, Any] | None:
        """Load the newest checkpoint under ``root`` if there is one (any saved layout)."""
        self.wait_for_save()
        path = latest_checkpoint(root)
        if path is None:
            return None
        info = load_checkpoint(path, self.ddp, self.optimizer, self.scheduler)
        trainer = info["trainer"]
        if self.updater.entropy_controller is not None and "entropy_controller" in trainer:
            self.updater.entropy_controller.load_state_dict(trainer["entropy_controller"])
        if self.loss_cfg.siren_coef > 0:
            self._load_siren_anchor(trainer.get("siren_anchor"))
        self.updater.optimizer_steps = trainer.get("optimizer_steps", 0)
        return info
