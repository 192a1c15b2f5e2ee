"""Vocab-parallel log-prob / entropy: equality with a single-process fp32 reference at TP=1,2,4,8.

Multi-process cases run as a few batched gloo jobs (spawning costs seconds on a small CPU box).
Tolerances: fp32/bf16/fp16 forward at atol 1e-5 against the fp32 reference of the same input
values (the math is fp32 either way); fp32 gradients at atol 1e-5; bf16/fp16 gradients come back in
the input dtype, so they are compared with the fp32 reference gradient rounded to that dtype
(rtol 1e-2 ~ 2 bf16 ulp).
"""

from __future__ import annotations

import itertools
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from megatron_rl.ops import (
    check_tp_consistency,
    naive_logprob_entropy,
    reference_logprob_entropy,
    vocab_parallel_logprob_entropy,
)
from megatron_rl.parallel.launch import WorkerError, spawn

V_GLOBAL = 96          # divisible by 1, 2, 4, 8
N_TOKENS = 13          # odd, so chunk_size=5 leaves a ragged last chunk
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


# --------------------------------------------------------------------------------------------
# Cases: specs are plain dicts, so workers rebuild the very same tensors from the seed.
# --------------------------------------------------------------------------------------------
def _spec(seed: int, dtype: str = "fp32", temperature: float = 1.0, chunk_size=None,
          compute_entropy: bool = True, entropy_grad: bool = True, n: int = N_TOKENS) -> dict:
    return dict(seed=seed, dtype=dtype, temperature=temperature, chunk_size=chunk_size,
                compute_entropy=compute_entropy, entropy_grad=entropy_grad, n=n)


def _cases(tp: int) -> list[dict]:
    grid = itertools.product(["fp32", "bf16"], [1.0, 0.7], [None, 5])
    cases = [_spec(seed=100 * tp + i, dtype=d, temperature=t, chunk_size=c)
             for i, (d, t, c) in enumerate(grid)]
    cases += [_spec(seed=100 * tp + 50, compute_entropy=False, chunk_size=4),
              _spec(seed=100 * tp + 51, entropy_grad=False, temperature=1.3),
              _spec(seed=100 * tp + 52, dtype="bf16", compute_entropy=False)]
    return cases


def _make(spec: dict, tp: int):
    """Full ``[N, V]`` logits, labels (every shard boundary included), upstream grads."""
    g = torch.Generator().manual_seed(spec["seed"])
    n, v_local = spec["n"], V_GLOBAL // tp
    full = (3.0 * torch.randn(n, V_GLOBAL, generator=g)).to(DTYPES[spec["dtype"]])
    labels = torch.randint(0, V_GLOBAL, (n,), generator=g)
    edges = sorted({0, V_GLOBAL - 1, *(r * v_local for r in range(tp)),
                    *(r * v_local - 1 for r in range(1, tp))})
    labels[: min(n, len(edges))] = torch.tensor(edges[:n])
    g_lp = torch.randn(n, generator=g)
    g_h = torch.randn(n, generator=g)
    return full, labels, g_lp, g_h


def _loss(logp, entropy, g_lp, g_h, spec):
    loss = (logp * g_lp).sum()
    if spec["compute_entropy"] and spec["entropy_grad"]:
        loss = loss + (entropy * g_h).sum()
    return loss


def _run_shard(spec: dict, tp: int, rank: int, group) -> dict:
    full, labels, g_lp, g_h = _make(spec, tp)
    v_local = V_GLOBAL // tp
    shard = full[:, rank * v_local:(rank + 1) * v_local].clone().requires_grad_(True)
    logp, entropy = vocab_parallel_logprob_entropy(
        shard, labels, group, temperature=spec["temperature"], chunk_size=spec["chunk_size"],
        compute_entropy=spec["compute_entropy"], entropy_grad=spec["entropy_grad"])
    _loss(logp, entropy, g_lp, g_h, spec).backward()
    return dict(logp=logp.detach(), entropy=None if entropy is None else entropy.detach(),
                entropy_requires_grad=None if entropy is None else entropy.requires_grad,
                grad=shard.grad)


def _reference(spec: dict, tp: int) -> dict:
    full, labels, g_lp, g_h = _make(spec, tp)
    x = full.detach().float().requires_grad_(True)
    logp, entropy = reference_logprob_entropy(x, labels, spec["temperature"])
    _loss(logp, entropy, g_lp, g_h, spec).backward()
    return dict(logp=logp.detach(), entropy=entropy.detach(), grad=x.grad)


def _check(spec: dict, tp: int, per_rank: list[dict]) -> None:
    """Compare the per-rank outputs of one case with the fp32 single-process reference."""
    ref = _reference(spec, tp)
    what = f"tp={tp} {spec}"
    for r, out in enumerate(per_rank):   # every rank holds the same all-reduced answer
        assert torch.equal(out["logp"], per_rank[0]["logp"]), f"{what}: rank {r} logp differs"
    out = per_rank[0]
    assert out["logp"].dtype == torch.float32
    torch.testing.assert_close(out["logp"], ref["logp"], atol=1e-5, rtol=0, msg=what)
    if spec["compute_entropy"]:
        assert out["entropy"].dtype == torch.float32
        torch.testing.assert_close(out["entropy"], ref["entropy"], atol=1e-5, rtol=0, msg=what)
        assert out["entropy_requires_grad"] == spec["entropy_grad"], what
    else:
        assert out["entropy"] is None, what
    grad = torch.cat([o["grad"] for o in per_rank], dim=-1)
    assert grad.dtype == DTYPES[spec["dtype"]], what
    if spec["dtype"] == "fp32":
        torch.testing.assert_close(grad, ref["grad"], atol=1e-5, rtol=0, msg=what)
    else:   # returned in the input dtype: compare at that dtype's rounding
        torch.testing.assert_close(grad.float(), ref["grad"].to(grad.dtype).float(),
                                   atol=1e-5, rtol=1e-2, msg=what)


# --------------------------------------------------------------------------------------------
# TP = 1, in process
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec", _cases(1) + [_spec(60, dtype="fp16", temperature=0.8,
                                                      chunk_size=6)],
                         ids=lambda s: "-".join(f"{v}" for v in s.values()))
def test_tp1_matches_reference(spec):
    _check(spec, 1, [_run_shard(spec, 1, 0, None)])


def test_entropy_grad_only_and_no_upstream_grad():
    full, labels, _, g_h = _make(_spec(7), 1)
    x = full.clone().requires_grad_(True)
    _, entropy = vocab_parallel_logprob_entropy(x, labels, chunk_size=4)
    (entropy * g_h).sum().backward()
    xr = full.clone().requires_grad_(True)
    (reference_logprob_entropy(xr, labels)[1] * g_h).sum().backward()
    torch.testing.assert_close(x.grad, xr.grad, atol=1e-5, rtol=0)


def test_naive_matches_reference():
    full, labels, _, _ = _make(_spec(8, temperature=0.9), 1)
    for a, b in zip(naive_logprob_entropy(full, labels, temperature=0.9),
                    reference_logprob_entropy(full, labels, 0.9), strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_empty_batch():
    x = torch.zeros(0, 16, requires_grad=True)
    logp, entropy = vocab_parallel_logprob_entropy(x, torch.zeros(0, dtype=torch.long))
    assert logp.shape == (0,) and entropy.shape == (0,)
    (logp.sum() + entropy.sum()).backward()
    assert x.grad.shape == (0, 16)


# --------------------------------------------------------------------------------------------
# Memory contract: one [N, V_local] tensor saved, and it is the input itself
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype,chunk_size,compute_entropy,entropy_grad", [
    ("fp32", None, True, True), ("bf16", None, True, True), ("bf16", 4, True, True),
    ("fp32", 3, False, True), ("bf16", None, True, False)])
def test_saves_only_the_input_logits(dtype, chunk_size, compute_entropy, entropy_grad):
    full, labels, _, _ = _make(_spec(9, dtype=dtype), 1)
    x = full.clone().requires_grad_(True)
    saved = []

    def pack(t):
        saved.append(dict(shape=tuple(t.shape), dtype=t.dtype, ptr=t.data_ptr(),
                          storage=t.untyped_storage().data_ptr(), bytes=t.numel() * t.itemsize))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logp, entropy = vocab_parallel_logprob_entropy(
            x, labels, chunk_size=chunk_size, compute_entropy=compute_entropy,
            entropy_grad=entropy_grad)
    big = [s for s in saved if len(s["shape"]) == 2]
    assert len(big) == 1, saved
    assert big[0]["shape"] == tuple(x.shape) and big[0]["dtype"] == x.dtype
    assert big[0]["ptr"] == x.data_ptr() and big[0]["storage"] == x.untyped_storage().data_ptr()
    n = x.shape[0]
    assert all(s["shape"] == (n,) for s in saved if len(s["shape"]) != 2), saved
    n_stats = 2 if (compute_entropy and entropy_grad) else 1       # lse (+ mu)
    assert len(saved) == 1 + 1 + n_stats                           # logits, labels, stats
    # Nothing else hangs off the backward node: no tensor attributes on ctx.
    assert not any(isinstance(v, torch.Tensor) for v in vars(logp.grad_fn).values())
    loss = logp.sum() + (entropy.sum() if compute_entropy and entropy_grad else 0)
    loss.backward()
    assert x.grad.dtype == x.dtype and x.grad.shape == x.shape


# --------------------------------------------------------------------------------------------
# Bad input: clear errors
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("logits,labels,kwargs,exc,match", [
    (torch.randn(4, 8), torch.tensor([0, 1, 8, 2]), {}, ValueError, r"out of range \[0, 8\)"),
    (torch.randn(4, 8), torch.tensor([0, -1, 3, 2]), {}, ValueError, "out of range"),
    (torch.randn(4, 8), torch.zeros(4), {}, TypeError, "integer"),
    (torch.randn(4, 8), torch.zeros(4, dtype=torch.bool), {}, TypeError, "integer"),
    (torch.randint(0, 5, (4, 8)), torch.zeros(4, dtype=torch.long), {}, TypeError,
     "floating-point"),
    (torch.randn(2, 4, 8), torch.zeros(2, 4, dtype=torch.long), {}, ValueError, "2-D"),
    (torch.randn(4, 8), torch.zeros(5, dtype=torch.long), {}, ValueError, r"shape \(N,\)"),
    (torch.randn(4, 8), torch.zeros(4, 1, dtype=torch.long), {}, ValueError, r"shape \(N,\)"),
    (torch.randn(4, 8), torch.zeros(4, dtype=torch.long), {"temperature": 0.0}, ValueError,
     "temperature"),
    (torch.randn(4, 8), torch.zeros(4, dtype=torch.long), {"temperature": -1.0}, ValueError,
     "temperature"),
    (torch.randn(4, 8), torch.zeros(4, dtype=torch.long), {"chunk_size": 0}, ValueError,
     "chunk_size"),
])
def test_bad_input(logits, labels, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        vocab_parallel_logprob_entropy(logits, labels, **kwargs)


def test_check_tp_consistency_single_process_is_a_no_op():
    check_tp_consistency(5, 7, None)


# --------------------------------------------------------------------------------------------
# Multi-process workers (module level, so the spawn launcher can import them)
# --------------------------------------------------------------------------------------------
def _count_all_reduce():
    """Patch ``dist.all_reduce`` with a counter; returns (patcher, calls list)."""
    calls, real = [], dist.all_reduce

    def counting(tensor, *args, **kwargs):
        calls.append(tuple(tensor.shape))
        return real(tensor, *args, **kwargs)

    return mock.patch.object(dist, "all_reduce", counting), calls


def _tp_worker(tp: int, cases: list[dict], use_megatron: bool) -> dict:
    from megatron_rl.parallel import runtime

    if use_megatron:   # default group = megatron's TP group
        runtime.init_parallel(tp=tp, backend="gloo", timeout_s=60)
        group = None
    else:
        runtime.init_distributed(backend="gloo", timeout_s=60)
        group = dist.group.WORLD
    rank = dist.get_rank()
    result = dict(cases=[_run_shard(spec, tp, rank, group) for spec in cases])
    check_tp_consistency(N_TOKENS, V_GLOBAL // tp, group)   # agreeing ranks: no error

    # Collective count: two all-reduces in forward whatever the chunking, none in backward.
    patcher, calls = _count_all_reduce()
    with patcher:
        for chunk in (None, 2):
            spec = _spec(seed=1, chunk_size=chunk)
            _run_shard(spec, tp, rank, group)
    result["all_reduce_shapes"] = calls

    # Negative control: the same op with the MAX all-reduce dropped must give a wrong answer.
    real = dist.all_reduce

    def no_max(tensor, op=dist.ReduceOp.SUM, *args, **kwargs):
        return None if op == dist.ReduceOp.MAX else real(tensor, op, *args, **kwargs)

    with mock.patch.object(dist, "all_reduce", no_max):
        result["no_max"] = _run_shard(_spec(seed=2), tp, rank, group)

    if tp == 4:  # two TP=2 groups inside a world of 4: shard offsets follow the group rank
        groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        result["sub"] = [_run_shard(spec, 2, rank % 2, groups[rank // 2])
                         for spec in cases[:4]]
    return result


def _check_tp(tp: int, use_megatron: bool = False) -> None:
    cases = _cases(tp)
    per_rank = spawn(_tp_worker, tp, (tp, cases, use_megatron), timeout_s=240)
    for i, spec in enumerate(cases):
        _check(spec, tp, [r["cases"][i] for r in per_rank])
    shapes = per_rank[0]["all_reduce_shapes"]
    assert shapes == [(N_TOKENS,), (N_TOKENS, 3)] * 2, shapes
    # Negative control: same harness, MAX all-reduce dropped -> the comparison must fail.
    with pytest.raises(AssertionError):
        _check(_spec(seed=2), tp, [r["no_max"] for r in per_rank])
    if tp == 4:
        for i, spec in enumerate(cases[:4]):
            _check(spec, 2, [r["sub"][i] for r in per_rank[:2]])
            _check(spec, 2, [r["sub"][i] for r in per_rank[2:]])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_tp2_matches_reference_megatron_default_group():
    _check_tp(2, use_megatron=True)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_tp4_matches_reference_and_subgroups():
    _check_tp(4)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_tp8_matches_reference():
    _check_tp(8)


def _consistency_worker() -> str:
    from megatron_rl.parallel import runtime

    runtime.init_distributed(backend="gloo", timeout_s=30)
    n = 8 if dist.get_rank() == 0 else 16
    try:
        check_tp_consistency(n, 48, dist.group.WORLD)
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_check_tp_consistency_names_ranks_and_shapes():
    messages = spawn(_consistency_worker, 2, (), timeout_s=120)
    for rank, msg in enumerate(messages):
        assert "disagree" in msg, msg
        assert "tp_rank 0 (global rank 0): [N=8, V_local=48]" in msg, msg
        assert "tp_rank 1 (global rank 1): [N=16, V_local=48]" in msg, msg
        assert f"this is tp_rank {rank}" in msg


def _mismatch_worker() -> None:
    from megatron_rl.parallel import runtime

    runtime.init_distributed(backend="gloo", timeout_s=10)
    n = 8 if dist.get_rank() == 0 else 16
    x = torch.randn(n, 48, requires_grad=True)
    vocab_parallel_logprob_entropy(x, torch.zeros(n, dtype=torch.long), dist.group.WORLD)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_mismatched_shapes_error_instead_of_hanging():
    # gloo aborts on the size mismatch; NCCL would raise when the 10 s group timeout expires.
    # Either way: an error from the launcher (WorkerError), not a TimeoutError or a hang.
    with pytest.raises(WorkerError):
        spawn(_mismatch_worker, 2, (), timeout_s=90)
