"""Device discipline of the actor's RL step, checked on CPU (issue 10).

A real actor step (old-policy pass, reference pass with the KL term, Clip-Cov update with the
entropy-dynamics diagnostic, measured entropy, the last-stage rank and metrics broadcast) runs
under :class:`megatron_rl.testing.device_spy.DeviceSpy`, unfused and fused head. The spy fails the
test for any tensor factory in project code without ``device=`` (on a GPU that tensor would be
on the CPU), any host sync inside the per-micro-batch path, and any project-code result on another
device than the batch. Negative controls show the spy catches each kind of fault, including the
exact lines that crashed on an H100 before this issue.
"""

from __future__ import annotations

import os

import pytest
import torch

from megatron_rl.parallel.launch import spawn
from megatron_rl.testing.device_spy import DeviceSpy

HERE = os.path.abspath(__file__)


def _batch(n: int = 4, seq: int = 16, vocab: int = 256) -> dict:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (n, seq), generator=g)
    mask = torch.zeros(n, seq, dtype=torch.bool)
    for b in range(n):
        mask[b, 4:4 + 3 + 2 * b] = True
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])[:n, None].expand(n, seq) * mask
    return {"tokens": tokens, "mask": mask, "advantages": adv.contiguous()}


def _spied_step_worker(fused: bool, budget: int = 0, bapo_siren: bool = False) -> dict:
    from megatron_rl.actor.actor import Actor
    from megatron_rl.actor.optim import OptimConfig
    from megatron_rl.actor.train_step import ActorConfig
    from megatron_rl.loss import LossConfig
    from megatron_rl.metrics.step import last_stage_metrics, measured_entropy
    from megatron_rl.models.config import get_preset
    from megatron_rl.parallel import runtime

    runtime.init_parallel(tp=1, pp=1, timeout_s=120)
    loss = LossConfig.for_algorithm("clip_cov", clip_cov_ratio=0.2, clip_cov_lb=-100.0,
                                    clip_cov_ub=100.0, use_kl_loss=True, kl_loss_coef=0.01)
    mini = 0
    from megatron_rl.config.sections import TeacherSection
    from megatron_rl.rollout.distill import add_distillation

    if bapo_siren:  # two mini-batches: the second one's bounds and selection need the pre-pass
        # (+ an on-policy distillation teacher: its pass, the signal and the k2 loss term)
        loss = LossConfig.for_algorithm("bapo", siren_coef=0.1, distill_loss_coef=0.5)
        mini = 2
    actor = Actor(get_preset("tiny"), ActorConfig(micro_batch_size=1 if bapo_siren else 2,
                                                  mini_batch_size=mini,
                                                  fused_logprob_entropy=fused,
                                                  max_tokens_per_micro_batch=budget),
                  OptimConfig(lr=1e-3), loss, total_steps=1, seed=3,
                  teacher_cfg=get_preset("tiny") if bapo_siren else None)
    batch = runtime.move_batch_(_batch(), runtime.device())
    spy = DeviceSpy(device=batch["tokens"].device)
    with spy:
        actor.add_old_logprobs(batch)
        actor.add_ref_logprobs(batch)
        actor.add_teacher_logprobs(batch)
        add_distillation(batch, TeacherSection(mode="loss", task_coef=0.5))
        history = actor.update(batch, 0)
        measured_entropy(batch)
        metrics = last_stage_metrics(history, runtime.last_stage_rank())
    runtime.shutdown()
    return {"violations": spy.report(), "calls": spy.calls, "metrics": metrics}


@pytest.mark.parametrize("fused,budget", [(False, 0), (True, 24)],
                         ids=["unfused", "fused-token-budget"])
def test_actor_step_creates_every_tensor_on_the_batch_device(fused, budget):
    """The second case also cuts token-budget micro-batches (actor/micro_batches.py)."""
    (out,) = spawn(_spied_step_worker, 1, (fused, budget), timeout_s=240)
    assert out["calls"] > 200, "the spy did not see the update path"
    assert "actor/loss" in out["metrics"]
    assert out["violations"] == "", out["violations"]


def test_actor_step_bapo_siren_creates_every_tensor_on_the_batch_device():
    """BAPO's bound search and SIREN's selection, anchor and pre-pass in the update path, with
    an on-policy distillation teacher (its pass, the signal and the k2 loss term)."""
    (out,) = spawn(_spied_step_worker, 1, (False, 0, True), timeout_s=240)
    assert out["calls"] > 200, "the spy did not see the update path"
    assert "bapo/clip_high" in out["metrics"] and "siren/reg" in out["metrics"]
    assert out["metrics"]["distill/loss_k2"] > 0
    assert out["violations"] == "", out["violations"]


# ---- negative controls: the spy catches each fault ---------------------------------------------
def _spy() -> DeviceSpy:
    return DeviceSpy(device=torch.device("cpu"), roots=(HERE,))


def test_spy_catches_the_h100_crash_lines():
    tokens = torch.zeros(2, 5, dtype=torch.long)
    with _spy() as spy:
        torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)  # old train_step.py:215
        torch.zeros((), dtype=torch.float32)  # old NaN flag of the update
        torch.tensor([0], dtype=torch.int64)  # old last_stage_rank
    kinds = [v.kind for v in spy.violations]
    assert kinds == ["factory_without_device"] * 3, spy.report()


def test_spy_accepts_device_correct_lines():
    tokens = torch.zeros(2, 5, dtype=torch.long)
    with _spy() as spy:
        torch.arange(tokens.shape[1], device=tokens.device)
        torch.zeros((), dtype=torch.float32, device=tokens.device)
        torch.as_tensor(tokens, dtype=torch.float32)
        tokens.new_zeros(3)
        torch.zeros_like(tokens)
    assert spy.violations == [] and spy.calls >= 5


def test_spy_catches_host_sync_in_a_micro_batch_function():
    x = torch.ones(3)

    def loss_func(t):
        return float(t.sum()) + t.max().item()

    with _spy() as spy:
        loss_func(x)
        x.sum().item()  # outside the per-micro-batch path: allowed
    assert [v.kind for v in spy.violations] == ["host_sync", "host_sync"], spy.report()


def test_spy_catches_a_result_on_another_device():
    with _spy() as spy:
        torch.zeros(2, device="meta")
    assert [v.kind for v in spy.violations] == ["other_device"], spy.report()


def test_spy_catches_an_injected_cpu_tensor_in_the_loss(monkeypatch):
    """An update whose loss creates one tensor without ``device=`` (the pre-issue-10 bug) fails."""
    import megatron_rl.loss.compute as compute

    real = compute.compute_loss

    def leaky(*args, **kwargs):
        out = real(*args, **kwargs)
        torch.zeros((), dtype=torch.float32)  # what a GPU would put on the CPU
        return out

    monkeypatch.setattr(compute, "compute_loss", leaky)
    from megatron_rl.loss import LossConfig, LossInputs, ReductionContext

    m = torch.tensor([[False, True, True]])
    inp = LossInputs(logp=torch.zeros(1, 3, requires_grad=True), old_logp=torch.zeros(1, 3),
                     advantages=torch.ones(1, 3), mask=m)
    with _spy() as spy:
        compute.compute_loss(inp, LossConfig(), ReductionContext.from_minibatch([m], group=None))
    assert [v.what for v in spy.violations] == ["torch.zeros"], spy.report()


# ---- the runtime's device helpers ----------------------------------------------------------------
def test_move_batch_moves_every_tensor_once():
    from megatron_rl.parallel.runtime import move_batch_

    batch = {"tokens": torch.zeros(2, 3, dtype=torch.long), "mask": torch.ones(2, 3).bool(),
             "n": 7}
    move_batch_(batch, "meta")
    assert {v.device.type for v in batch.values() if isinstance(v, torch.Tensor)} == {"meta"}
    assert batch["n"] == 7
    same = dict(batch)
    move_batch_(batch, torch.device("meta"))
    assert all(batch[k] is same[k] for k in batch)  # already there: no copy


def _host_worker() -> dict:
    import torch.distributed as dist

    from megatron_rl.parallel import runtime

    runtime.init_parallel(tp=1, pp=2, timeout_s=60)
    obj = runtime.broadcast_object({"from": dist.get_rank()} if dist.get_rank() == 1 else None,
                                   src=1)
    out = {"device": str(runtime.device()), "obj": obj,
           "world": runtime.host_group() is dist.group.WORLD,
           "last": runtime.last_stage_rank()}
    runtime.shutdown()
    return out


def test_device_and_host_collectives_on_gloo():
    outs = spawn(_host_worker, 2, (), timeout_s=300)
    for out in outs:
        assert out == {"device": "cpu", "obj": {"from": 1}, "world": True, "last": 1}


def test_weight_stream_is_cast_to_the_engine_dtype():
    from megatron_rl.models.config import get_preset
    from megatron_rl.rollout.embedded import EmbeddedEngine
    from megatron_rl.rollout.sync import as_engine_dtype

    engine = EmbeddedEngine(get_preset("tiny"), eos_id=1, pad_id=0)
    assert engine.weight_dtype == torch.float32
    buckets = [[("a", torch.ones(2, dtype=torch.bfloat16)), ("b", torch.ones(1))]]
    (got,) = list(as_engine_dtype(iter(buckets), engine))
    assert [t.dtype for _, t in got] == [torch.float32, torch.float32]
    engine.model.to(torch.bfloat16)
    (got,) = list(as_engine_dtype(iter(buckets), engine))
    assert [t.dtype for _, t in got] == [torch.bfloat16, torch.bfloat16]
