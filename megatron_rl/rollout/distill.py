"""The step's on-policy distillation signal (docs/distillation.md, :mod:`megatron_rl.loss.distill`):
after the old-policy and teacher passes, on the last pipeline stage (where ``old_logp`` and
``teacher_logp`` live), the per-token reverse KL of the student's samples becomes part of the
advantages (``teacher.mode: reward``) and the step's ``distill/*`` metrics; in ``teacher.mode:
loss`` the advantages are the task's (times ``teacher.task_coef``) and the loss adds the k2
term.

The metrics are reduced over the data-parallel group (every valid token of the step, whatever the
TP/PP/DP layout); the advantage change is per token and needs no reduction.
"""

from __future__ import annotations

import torch

from megatron_rl.loss.distill import distill_advantages, distill_stats


def add_distillation(local: dict, teacher) -> dict[str, float]:
    """With a teacher pass in ``local`` (``teacher_logp [N, S]``): reward mode replaces
    ``local["advantages"]`` by ``teacher.task_coef * A_task - teacher.coef * KL_t``, loss mode
    by ``teacher.task_coef * A_task`` (the loss adds the distillation term); returns the
    ``distill/*`` metrics (last stage; ``{}`` elsewhere and without a teacher). ``teacher`` is
    the run's :class:`~megatron_rl.config.sections.TeacherSection`."""
    if "teacher_logp" not in local or "old_logp" not in local:
        return {}
    from megatron.core import parallel_state as ps

    student, teach = local["old_logp"], local["teacher_logp"]
    mask = local["mask"].to(student.device)
    # reward mode: the distillation term joins the advantages; loss mode: the loss adds it
    coef = teacher.coef if teacher.mode == "reward" else 0.0
    if coef or teacher.task_coef != 1.0:
        adv = distill_advantages(local["advantages"], student, teach, mask, coef,
                                 teacher.task_coef)
        local["advantages"] = adv.to(local["advantages"].device)
    stats = distill_stats(student, teach, mask, teacher.disagree_nats,
                          group=ps.get_data_parallel_group())
    values = torch.stack(list(stats.values())).tolist()  # one host sync per step
    return dict(zip(stats, values))
