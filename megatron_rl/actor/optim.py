"""megatron-core DistributedDataParallel, optimizer and LR schedule for the actor.

The standard optimizer is the default. ``use_distributed_optimizer=True`` shards the fp32 main
weights and Adam moments over data parallel (megatron's ``DistributedOptimizer``); without apex or
Transformer Engine it runs on torch's Adam, whose checkpoint path megatron-core gets wrong, which
:mod:`megatron_rl.actor.distopt_compat` corrects (a no-op when apex or TE is present).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the config part is imported by config loading, which stays torch-free
    import torch

LR_DECAY_STYLES = ("constant", "linear", "cosine")


class OptimConfigError(ValueError):
    """An optimizer config field has an invalid value."""


@dataclass(frozen=True)
class OptimConfig:
    """AdamW with warm-up and decay; gradient clipping by global norm."""

    lr: float = 1e-6
    min_lr: float = 0.0
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    lr_warmup_steps: int = 0
    lr_decay_steps: int | None = None  # None: no decay after warm-up
    lr_decay_style: str = "constant"
    use_distributed_optimizer: bool = False

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise OptimConfigError(f"optim.lr must be > 0, got {self.lr}")
        if not 0 <= self.min_lr <= self.lr:
            raise OptimConfigError(f"optim.min_lr must be in [0, lr={self.lr}], got {self.min_lr}")
        if self.clip_grad < 0:
            raise OptimConfigError(f"optim.clip_grad must be >= 0 (0 disables), got "
                                   f"{self.clip_grad}")
        if self.lr_decay_style not in LR_DECAY_STYLES:
            raise OptimConfigError(f"optim.lr_decay_style={self.lr_decay_style!r} is not one of "
                                   f"{LR_DECAY_STYLES}")
        if self.lr_warmup_steps < 0:
            raise OptimConfigError(f"optim.lr_warmup_steps must be >= 0, got "
                                   f"{self.lr_warmup_steps}")


def wrap_ddp(model: torch.nn.Module, use_distributed_optimizer: bool = False):
    """Wrap one model chunk in megatron-core ``DistributedDataParallel``.

    Gradients are averaged over the data-parallel group (megatron's default), so a loss that is
    normalised by a global denominator must be multiplied by the DP size (see
    ``megatron_rl.actor.train_step``).
    """
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )

    ddp_cfg = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False,
        use_distributed_optimizer=use_distributed_optimizer, check_for_nan_in_grad=False)
    ddp = DistributedDataParallel(model.config, ddp_cfg, model)
    from megatron_rl.models.moe_tp import TP_PARTIAL_GRAD

    if any(getattr(p, TP_PARTIAL_GRAD, False) for p in model.parameters()):
        model.config.finalize_model_grads_func = _finalize_with_tp_partial_grads
    else:
        model.config.finalize_model_grads_func = finalize_model_grads
    return ddp


def _finalize_with_tp_partial_grads(model_chunks, *args, **kwargs):
    """megatron's gradient finalisation, then the TP sum of the MoE layers' partial gradients
    (:mod:`megatron_rl.models.moe_tp`)."""
    from megatron.core.distributed import finalize_model_grads

    from megatron_rl.models.moe_tp import allreduce_tp_partial_grads

    finalize_model_grads(model_chunks, *args, **kwargs)
    allreduce_tp_partial_grads(model_chunks)


def build_optimizer(ddp_model, cfg: OptimConfig, total_steps: int):
    """megatron optimizer (AdamW) and ``OptimizerParamScheduler`` for ``ddp_model``."""
    import torch
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    if cfg.use_distributed_optimizer:
        from megatron_rl.actor import distopt_compat

        distopt_compat.install()  # torch-Adam fallback only (no apex / TE)
    dtype = ddp_model.config.params_dtype
    ocfg = OptimizerConfig(
        optimizer="adam", lr=cfg.lr, min_lr=cfg.min_lr, weight_decay=cfg.weight_decay,
        adam_beta1=cfg.adam_beta1, adam_beta2=cfg.adam_beta2, adam_eps=cfg.adam_eps,
        clip_grad=cfg.clip_grad, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
        params_dtype=dtype, use_distributed_optimizer=cfg.use_distributed_optimizer,
        # fp16: dynamic loss scale from 2**16 (megatron's default 2**32 overflows for the first
        # steps, which the numerical guard would count as failures).
        initial_loss_scale=2.0**16 if dtype == torch.float16 else 2.0**32)
    from megatron_rl.actor.grad_norm import install as install_grad_norm

    install_grad_norm()  # the clip norm is layout-invariant (megatron_rl/actor/grad_norm.py)
    optimizer = get_megatron_optimizer(ocfg, [ddp_model])
    decay_steps = cfg.lr_decay_steps or max(total_steps, cfg.lr_warmup_steps + 1)
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0 if cfg.lr_warmup_steps else cfg.lr, max_lr=cfg.lr,
        min_lr=cfg.min_lr if cfg.lr_decay_style != "constant" else cfg.lr,
        lr_warmup_steps=cfg.lr_warmup_steps, lr_decay_steps=decay_steps,
        lr_decay_style=cfg.lr_decay_style, start_wd=cfg.weight_decay, end_wd=cfg.weight_decay,
        wd_incr_steps=max(1, total_steps), wd_incr_style="constant")
    return optimizer, scheduler
