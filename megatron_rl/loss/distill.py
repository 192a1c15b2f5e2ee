"""On-policy distillation: the student samples, a frozen teacher scores every sampled token, and
the student minimises the per-token reverse KL to the teacher (docs/distillation.md).

Estimator. For a response ``y ~ pi_S`` the reverse KL ``KL(pi_S || pi_T)`` of one position is
estimated on the sampled token only (the single-sample k1 estimator)::

    KL_t = log pi_S(y_t | y_<t) - log pi_T(y_t | y_<t)

It is unbiased for the per-position reverse KL (``E_{y_t ~ pi_S}[KL_t] = KL(pi_S || pi_T)`` at
that prefix), needs only the sampled token's log-prob from each model (no full-vocabulary
exchange, so any two models that share a tokenizer work) and is negative where the teacher likes
the token more than the student does.

Two ways to use it (``teacher.mode``):

* ``reward`` — the dense per-token advantage of Thinking Machines' "On-Policy Distillation"
  (Lu et al., 2025, thinkingmachines.ai/blog/on-policy-distillation) and of the Qwen3 technical
  report's on-policy distillation stage (arXiv:2505.09388 §4.5)::

      A_t = task_coef * A_task_t - coef * KL_t          (valid tokens; 0 at padding)

  ``KL_t`` is computed with ``log pi_S`` = ``old_logp`` (the actor's pass over the step's samples
  before the update), a constant; no critic, no baseline, no whitening. ``task_coef = 0`` is pure
  distillation; ``task_coef = 1`` adds the distillation signal to the run's task advantages
  (GRPO/DAPO/...) token by token. The policy loss of ``loss.algorithm`` then consumes ``A_t``
  (importance ratios and clipping as for any advantage). slime's on-policy distillation
  (``--use-opd``, docs/en/advanced/on-policy-distillation.md) adds the same term to any
  estimator's advantage (our ``task_coef = 1``); the Tinker cookbook's recipe of the Thinking
  Machines post uses it alone (our ``task_coef = 0``).

* ``loss`` — a term beside the policy loss, aggregated like every loss term over the global
  valid tokens of the mini-batch (the policy loss sees ``task_coef * A_task``; ``task_coef = 0``
  leaves the distillation term alone)::

      L_distill = coef * mean_t 1/2 (log pi_theta(y_t) - log pi_T(y_t))^2     (k2)

  On on-policy samples its gradient ``(log pi_theta - log pi_T) * grad log pi_theta`` is the
  per-token reverse-KL policy gradient (the k1 value's own gradient has zero expectation, which
  is why the k1 value cannot be the loss; see the k2 discussion of verl's KL-loss docs and
  J. Schulman, "Approximating KL divergence", 2020).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_rl.loss.distill_choices import ENGINES, MODES  # noqa: F401

Tensor = torch.Tensor


def reverse_kl(student_logp: Tensor, teacher_logp: Tensor, mask: Tensor) -> Tensor:
    """Per-token k1 reverse KL ``log pi_S - log pi_T`` ``[N, S]`` fp32, 0 at padding; on
    ``mask``'s device. Inputs ``[N, S]`` log-probs of the sampled tokens (constants)."""
    m = mask.to(student_logp.device).bool()
    delta = student_logp.detach().float() - teacher_logp.detach().to(student_logp.device).float()
    return torch.where(m, delta, 0.0)


def distill_advantages(task_adv: Tensor, student_logp: Tensor, teacher_logp: Tensor,
                       mask: Tensor, coef: float, task_coef: float) -> Tensor:
    """``task_coef * task_adv - coef * KL_t`` on valid tokens, 0 at padding (``[N, S]`` fp32,
    on ``student_logp``'s device); ``task_adv`` ``[N, S]`` are the run's task advantages."""
    m = mask.to(student_logp.device).bool()
    kl = reverse_kl(student_logp, teacher_logp, m)
    adv = task_coef * task_adv.to(student_logp.device).float() - coef * kl
    return torch.where(m, adv, 0.0)


def distill_loss_tokens(logp: Tensor, teacher_logp: Tensor) -> Tensor:
    """k2 per-token term ``1/2 (logp - teacher_logp)^2`` ``[B, T]`` (gradient through ``logp``
    only: ``(logp - teacher_logp) * grad logp``); the caller aggregates it over valid tokens."""
    return 0.5 * (logp - teacher_logp.detach()).square()


def distill_stats(student_logp: Tensor, teacher_logp: Tensor, mask: Tensor,
                  disagree_nats: float, group=None) -> dict[str, Tensor]:
    """The step's distillation metrics over the valid tokens of every rank of ``group`` (one
    all-reduce; 0-dim fp64 tensors on the log-probs' device, no host sync):

    * ``distill/reverse_kl``: mean of ``KL_t``;
    * ``distill/teacher_logp``: mean teacher log-prob of the sampled tokens;
    * ``distill/student_logp``: mean student log-prob of the sampled tokens;
    * ``distill/disagree_frac``: fraction of tokens with ``KL_t > disagree_nats`` (the teacher
      gives the student's token ``e^disagree_nats`` times less probability than the student).
    """
    m = mask.to(student_logp.device).bool()
    kl = reverse_kl(student_logp, teacher_logp, m).double()
    t = torch.where(m, teacher_logp.to(student_logp.device).double(), 0.0)
    s = torch.where(m, student_logp.double(), 0.0)
    sums = torch.stack([kl.sum(), t.sum(), s.sum(), (m & (kl > disagree_nats)).sum().double(),
                        m.sum().double()])
    if group is not None or dist.is_initialized():
        dist.all_reduce(sums, group=group)
    n = sums[4].clamp_min(1)
    return {"distill/reverse_kl": sums[0] / n, "distill/teacher_logp": sums[1] / n,
            "distill/student_logp": sums[2] / n, "distill/disagree_frac": sums[3] / n}
