"""GPU checks of the compiled fused head (Triton elementwise passes + cuBLAS GEMMs) against a
float64 reference: the shapes of issue 14 (N=16384, H=5120, V=151936, and a TP=4 shard), N=1,
T != 1, entropy off / without grad, vocab not a tile multiple, bf16 and fp32, determinism.

Run on a CUDA machine: ``python -m pytest -q -m gpu tests/test_fused_head_gpu.py``. Every test
is ``gpu``-marked and skips without CUDA (tests/conftest.py).

Reference (:func:`reference`): float64 log-softmax / entropy and their gradients, computed in
row chunks on the GPU, of the logits the fused head is defined on, made by the same device GEMM
the fused head runs (``torch.mm`` of the same row chunks, input dtype out, fp32 accumulation
inside; what megatron's ``output_layer`` returns). Both sides then see bit-identical logits, so
the forward tolerance is that of fp32 softmax arithmetic over the vocabulary, 5e-4 absolute on
log-prob and entropy (an fp64-products reference would differ by one bf16 ulp of the largest
logit, ~0.06, and hide a 1% entropy error). Gradients are compared by relative L2 error: bf16
8e-3 (the logits gradient is rounded to bf16 before the gradient GEMMs, as in the unfused path,
and the hidden gradient is returned in bf16: ~4e-3 measured on small shapes under
``TRITON_INTERPRET=1``), fp32 1e-5. Forward gaps measured there: ~1e-6.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from megatron_rl.kernels.fused_head import fused_linear_logprob_entropy

pytestmark = pytest.mark.gpu
DEVICE = os.environ.get("MRL_GPU_TEST_DEVICE", "cuda")   # "cpu" + TRITON_INTERPRET=1: dry run
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
ISSUE_N, ISSUE_H, ISSUE_V = 16384, 5120, 151936


def make_inputs(n: int, h: int, v: int, dtype: torch.dtype, seed: int = 0):
    """hidden ``[n, h]``, weight ``[v, h]`` (logits of std ~3), labels, upstream grads."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    hidden = torch.randn(n, h, generator=g).to(DEVICE, dtype)
    weight = (3.0 / math.sqrt(h) * torch.randn(v, h, generator=g)).to(DEVICE, dtype)
    labels = torch.randint(0, v, (n,), generator=g).to(DEVICE)
    labels[: min(n, 2)] = torch.tensor([0, v - 1][: min(n, 2)], device=DEVICE)
    g_lp = torch.randn(n, generator=g).to(DEVICE)
    g_h = torch.randn(n, generator=g).to(DEVICE)
    return hidden, weight, labels, g_lp, g_h


def fused_rows(hidden, weight, chunk_size=None, tiles=None) -> int:
    """Rows per chunk the fused head (Triton backend) uses for these inputs."""
    from megatron_rl.kernels.fused_head import _chunk_ops
    from megatron_rl.kernels.fused_head_torch import _chunk_rows

    return _chunk_rows(hidden.size(0), weight.size(0), hidden, _chunk_ops("triton", tiles),
                       chunk_size)


def reference(hidden, weight, labels, g_lp, g_h, temperature: float, with_entropy: bool,
              entropy_grad: bool, rows: int | None = None) -> dict:
    """float64 ``logp, entropy, grad_hidden, grad_weight`` of ``mm(h, W^T) / T``, where the
    logits come from the device GEMM in the input dtype over the fused head's own row chunks
    (``rows``; None: :func:`fused_rows`), so both sides see the same logits."""
    rows = rows or fused_rows(hidden, weight)
    w64 = weight.double()
    n, v = hidden.size(0), weight.size(0)
    out = dict(logp=torch.empty(n, dtype=torch.float64, device=hidden.device),
               entropy=torch.empty(n, dtype=torch.float64, device=hidden.device),
               grad_h=torch.empty(hidden.shape, dtype=torch.float64, device=hidden.device),
               grad_w=torch.zeros(weight.shape, dtype=torch.float64, device=hidden.device),
               zmax=0.0)
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        h64 = hidden[r0:r1].double()
        logits = torch.mm(hidden[r0:r1], weight.t()).double()  # the fused head's own GEMM
        out["zmax"] = max(out["zmax"], float(logits.abs().max()))
        z = logits / temperature
        logp_all = torch.log_softmax(z, dim=-1)
        p = logp_all.exp()
        idx = labels[r0:r1].unsqueeze(1)
        out["logp"][r0:r1] = logp_all.gather(1, idx).squeeze(1)
        ent = -(p * logp_all).sum(-1)
        out["entropy"][r0:r1] = ent
        dz = -p * g_lp[r0:r1].double().unsqueeze(1)
        dz.scatter_add_(1, idx, g_lp[r0:r1].double().unsqueeze(1))
        if with_entropy and entropy_grad:
            mu = (p * z).sum(-1, keepdim=True)
            dz -= p * (z - mu) * g_h[r0:r1].double().unsqueeze(1)
        dz /= temperature
        out["grad_h"][r0:r1] = dz @ w64
        out["grad_w"] += dz.t() @ h64
        del logits, z, logp_all, p, dz
    assert v > 0
    return out


def run_fused(hidden, weight, labels, g_lp, g_h, temperature: float, with_entropy: bool,
              entropy_grad: bool, main_grad: bool = False, tiles=None, chunk_size=None) -> dict:
    """Fused forward + backward; ``grad_w`` from ``.grad`` or from a fresh fp32 ``main_grad``."""
    h = hidden.detach().clone().requires_grad_(True)
    w = weight.detach().clone().requires_grad_(True)
    if main_grad:
        w.main_grad = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
    logp, ent = fused_linear_logprob_entropy(
        h, w, labels, temperature=temperature, compute_entropy=with_entropy,
        entropy_grad=entropy_grad, backend="triton", triton_tiles=tiles, chunk_size=chunk_size,
        use_main_grad=main_grad)
    loss = (logp * g_lp).sum()
    if with_entropy and entropy_grad:
        loss = loss + (ent * g_h).sum()
    loss.backward()
    return dict(logp=logp.detach(), entropy=None if ent is None else ent.detach(),
                ent_requires_grad=None if ent is None else ent.requires_grad,
                grad_h=h.grad, grad_w=w.main_grad if main_grad else w.grad)


def _rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b).norm() / b.norm().clamp_min(1e-30))


def check(got: dict, ref: dict, dtype: torch.dtype, temperature: float, with_entropy: bool,
          entropy_grad: bool, ctx: str) -> None:
    tol = 5e-4  # fp32 softmax arithmetic on identical logits (module docstring)
    assert float((got["logp"].double() - ref["logp"]).abs().max()) <= tol, ctx
    if with_entropy:
        assert float((got["entropy"].double() - ref["entropy"]).abs().max()) <= tol, ctx
        assert got["ent_requires_grad"] == entropy_grad, ctx
    else:
        assert got["entropy"] is None, ctx
    gtol = 1e-5 if dtype == torch.float32 else 8e-3
    for name in ("grad_h", "grad_w"):
        err = _rel_l2(got[name], ref[name])
        assert err <= gtol, f"{ctx} {name}: relative L2 error {err:.3g} > {gtol}"


CASES = [
    # (name, n, h, v, dtype, T, entropy, entropy_grad, main_grad)
    ("issue-tp1-bf16", ISSUE_N, ISSUE_H, ISSUE_V, "bf16", 1.0, True, True, True),
    ("issue-tp4-bf16-T0.7", ISSUE_N, ISSUE_H, ISSUE_V // 4, "bf16", 0.7, True, True, False),
    ("issue-tp4-fp32-T1.3", ISSUE_N, ISSUE_H, ISSUE_V // 4, "fp32", 1.3, True, True, True),
    ("n1-bf16", 1, ISSUE_H, ISSUE_V // 4, "bf16", 0.9, True, True, False),
    ("ragged-bf16-entropy-off", 3001, 1000, 32003, "bf16", 1.0, False, False, True),
    ("ragged-bf16-entropy-nograd", 3001, 1000, 32003, "bf16", 1.2, True, False, False),
    ("ragged-fp32-T0.6", 777, 256, 5000, "fp32", 0.6, True, True, False),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_compiled_matches_float64(case):
    name, n, h, v, dtype, temperature, with_entropy, entropy_grad, main_grad = case
    inputs = make_inputs(n, h, v, DTYPES[dtype])
    got = run_fused(*inputs, temperature, with_entropy, entropy_grad, main_grad=main_grad)
    ref = reference(*inputs, temperature, with_entropy, entropy_grad)
    check(got, ref, DTYPES[dtype], temperature, with_entropy, entropy_grad, name)


@pytest.mark.parametrize("wgrad", ["triton", "cublas"])
def test_wgrad_gemm_choices(wgrad):
    """The Triton ``grad_weight`` GEMM and cuBLAS ``addmm(out_dtype=fp32)`` both match."""
    from megatron_rl.kernels.fused_head_triton import TritonTiles

    if wgrad == "cublas":
        from megatron_rl.kernels.fused_head_triton import _cublas_fp32_accumulate_ok

        if not _cublas_fp32_accumulate_ok(torch.device(DEVICE), torch.bfloat16):
            pytest.skip("torch.addmm(out_dtype=float32) is unavailable on this device/build")
    inputs = make_inputs(2048, 1024, 30011, torch.bfloat16, seed=1)
    got = run_fused(*inputs, 1.0, True, True, main_grad=True, tiles=TritonTiles(wgrad=wgrad),
                    chunk_size=512)
    ref = reference(*inputs, 1.0, True, True, rows=512)
    check(got, ref, torch.bfloat16, 1.0, True, True, f"wgrad={wgrad}")


@pytest.mark.parametrize("main_grad", [False, True])
def test_compiled_deterministic(main_grad):
    """Two backward passes give bit-equal gradients (no atomics)."""
    inputs = make_inputs(4096, 2048, 50000, torch.bfloat16, seed=2)
    a = run_fused(*inputs, 0.8, True, True, main_grad=main_grad, chunk_size=1024)
    b = run_fused(*inputs, 0.8, True, True, main_grad=main_grad, chunk_size=1024)
    for key in ("logp", "entropy", "grad_h", "grad_w"):
        assert torch.equal(a[key], b[key]), key
