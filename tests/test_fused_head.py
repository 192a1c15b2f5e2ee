"""Fused linear head + log-prob + entropy (row-chunked GEMMs + one fused elementwise pass).

Reference: float64 ``log_softmax`` of ``hidden.double() @ W.double().T`` in one process,
differentiated by autograd back to ``hidden`` and ``W``. Checked for the torch elementwise pass
(in process and at TP=2 over gloo) and for the Triton kernels in interpreter mode
(``TRITON_INTERPRET=1``, set in a spawned worker before Triton is imported) at TP=1 and TP=2.

The fused head computes the logits GEMM in the input dtype (bf16 in, fp32 accumulate, bf16 out:
the logits megatron's ``output_layer`` returns). The bf16/fp16 cases therefore use inputs on a
coarse grid (multiples of 1/4 and 1/8 with ``|logit| < 8``): every logit is then exact in bf16
whatever the accumulation order, so the forward can be held to the float64 reference at 1e-5
for every dtype. Gradients: fp32 atol 1e-5; bf16/fp16 round each logits-chunk gradient to the
input dtype before the two gradient GEMMs (what the unfused path's ``[N, V]`` logits gradient
would be) and come back in the input dtype, so they are compared at ``atol = rtol = 2e-2 x
max|ref|`` (about 2 bf16 ulps at the top of the range). ``test_bf16_against_literal_unfused_path``
covers random (off-grid) bf16 inputs against the unfused op on bf16 logits.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_rl.kernels.fused_head import fused_linear_logprob_entropy, resolve_backend
from megatron_rl.ops import vocab_parallel_logprob_entropy
from megatron_rl.parallel.launch import spawn

H_DIM = 24             # not a multiple of the test K tile (16)
V_GLOBAL = 76          # 76 and V_local = 38 (TP=2): not multiples of the vocab tile (16)
N_TOKENS = 13          # odd: chunk_size=5 leaves a ragged last chunk
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
TINY = dict(chunk_size=5)
INTERP_ENV = {"TRITON_INTERPRET": "1"}


def TINY_TRITON_TILES(cls):  # noqa: N802 - a constant built lazily (Triton imports late)
    """Interpreter-sized tiles: several vocab tiles per row, ragged edges everywhere."""
    return cls(block_r=2, block_v=16, num_warps=1, mm_block_m=16, mm_block_n=16, mm_block_k=16,
               mm_num_warps=1, mm_num_stages=1)


# --------------------------------------------------------------------------------------------
# Cases: plain dicts, so spawned workers rebuild the same tensors from the seed
# --------------------------------------------------------------------------------------------
def _spec(seed: int, dtype: str = "fp32", temperature: float = 1.0, compute_entropy=True,
          entropy_grad=True, n: int = N_TOKENS, masked: bool = False, **tiles) -> dict:
    return dict(seed=seed, dtype=dtype, temperature=temperature, compute_entropy=compute_entropy,
                entropy_grad=entropy_grad, n=n, masked=masked, tiles=tiles)


def _cases() -> list[dict]:
    grid = itertools.product(["fp32", "bf16"], [1.0, 0.7], [{}, TINY])
    cases = [_spec(10 + i, d, t, **tiles) for i, (d, t, tiles) in enumerate(grid)]
    cases += [_spec(30, compute_entropy=False, **TINY),
              _spec(31, entropy_grad=False, temperature=1.3, **TINY),
              _spec(32, n=1),
              _spec(33, masked=True, **TINY),
              _spec(34, dtype="fp16", temperature=0.8, **TINY)]
    return cases


def _make(spec: dict):
    """hidden ``[n, H]``, full weight ``[V, H]``, labels (shard edges first), upstream grads.

    fp32: Gaussian. bf16/fp16: values on a grid (``k/4``, ``|k| <= 4`` and ``k/8``, ``|k| <= 2``)
    so that each logit is a multiple of 1/32 below 8 in magnitude, exact in bf16.
    """
    g = torch.Generator().manual_seed(spec["seed"])
    n, dtype = spec["n"], DTYPES[spec["dtype"]]
    if dtype == torch.float32:
        hidden = torch.randn(n, H_DIM, generator=g)
        weight = 3.0 / H_DIM ** 0.5 * torch.randn(V_GLOBAL, H_DIM, generator=g)
    else:
        hidden = torch.randint(-4, 5, (n, H_DIM), generator=g) / 4.0
        weight = torch.randint(-2, 3, (V_GLOBAL, H_DIM), generator=g) / 8.0
    hidden, weight = hidden.to(dtype), weight.to(dtype)
    labels = torch.randint(0, V_GLOBAL, (n,), generator=g)
    edges = [0, V_GLOBAL // 2 - 1, V_GLOBAL // 2, V_GLOBAL - 1, 15, 16]
    labels[: min(n, len(edges))] = torch.tensor(edges[:n])
    g_lp, g_h = torch.randn(n, generator=g), torch.randn(n, generator=g)
    if spec["masked"]:                      # loss-masked tokens: zero upstream gradient
        g_lp[::3] = 0.0
        g_h[::3] = 0.0
    return hidden, weight, labels, g_lp, g_h


def _loss(logp, entropy, g_lp, g_h, spec):
    loss = (logp * g_lp).sum()
    if spec["compute_entropy"] and spec["entropy_grad"]:
        loss = loss + (entropy * g_h).sum()
    return loss


def _reference(spec: dict) -> dict:
    """float64 log-softmax / entropy of the full logits, one process; grads by autograd."""
    hidden, weight, labels, g_lp, g_h = _make(spec)
    h64 = hidden.double().requires_grad_(True)
    w64 = weight.double().requires_grad_(True)
    logp_all = torch.log_softmax((h64 @ w64.t()) / spec["temperature"], dim=-1)
    logp = logp_all.gather(1, labels.unsqueeze(1)).squeeze(1)
    ent = -(logp_all.exp() * logp_all).sum(-1) if spec["compute_entropy"] else None
    _loss(logp, ent, g_lp.double(), g_h.double(), spec).backward()
    return dict(logp=logp.detach().float(), entropy=None if ent is None else ent.detach().float(),
                grad_h=h64.grad.float(), grad_w=w64.grad.float())


def _run_fused(spec: dict, tp: int, rank: int, group, backend: str) -> dict:
    """This rank's fused result: its weight shard, the full hidden, reduced grad_hidden."""
    hidden, weight, labels, g_lp, g_h = _make(spec)
    v_local = V_GLOBAL // tp
    shard = weight[rank * v_local:(rank + 1) * v_local].clone().requires_grad_(True)
    hidden.requires_grad_(True)
    tiles = dict(spec["tiles"])
    triton_tiles = None
    if backend == "triton":
        from megatron_rl.kernels.fused_head_triton import TritonTiles

        triton_tiles = TINY_TRITON_TILES(TritonTiles)
    logp, ent = fused_linear_logprob_entropy(
        hidden, shard, labels, group, temperature=spec["temperature"],
        compute_entropy=spec["compute_entropy"], entropy_grad=spec["entropy_grad"],
        backend=backend, triton_tiles=triton_tiles, **tiles)
    _loss(logp, ent, g_lp, g_h, spec).backward()
    out = dict(logp=logp.detach(), entropy=None if ent is None else ent.detach(),
               grad_h=hidden.grad, grad_w=shard.grad,
               ent_requires_grad=None if ent is None else ent.requires_grad)
    if spec.get("twice"):                     # determinism: a second backward, bit for bit
        first = (hidden.grad.clone(), shard.grad.clone())
        hidden.grad = shard.grad = None
        logp, ent = fused_linear_logprob_entropy(
            hidden, shard, labels, group, temperature=spec["temperature"],
            compute_entropy=spec["compute_entropy"], entropy_grad=spec["entropy_grad"],
            backend=backend, triton_tiles=triton_tiles, **tiles)
        _loss(logp, ent, g_lp, g_h, spec).backward()
        out["bit_equal"] = all(torch.equal(a, b) for a, b in
                               zip(first, (hidden.grad, shard.grad), strict=True))
    return out


def _check(got: dict, ref: dict, spec: dict, tp: int = 1, rank: int = 0) -> None:
    ctx = f"case {spec} tp={tp} rank={rank}"
    torch.testing.assert_close(got["logp"], ref["logp"], atol=1e-5, rtol=0, msg=ctx)
    if spec["compute_entropy"]:
        torch.testing.assert_close(got["entropy"], ref["entropy"], atol=1e-5, rtol=0, msg=ctx)
        assert got["ent_requires_grad"] == spec["entropy_grad"], ctx
    else:
        assert got["entropy"] is None, ctx
    v_local = V_GLOBAL // tp
    ref_w = ref["grad_w"][rank * v_local:(rank + 1) * v_local]
    for name, g, r in (("grad_h", got["grad_h"], ref["grad_h"]), ("grad_w", got["grad_w"], ref_w)):
        assert g.dtype == DTYPES[spec["dtype"]], (ctx, name, g.dtype)
        tol = 1e-5 if spec["dtype"] == "fp32" else 2e-2 * float(r.float().abs().max())
        rtol = 0 if spec["dtype"] == "fp32" else 2e-2
        torch.testing.assert_close(g.float(), r.float(), atol=tol, rtol=rtol,
                                   msg=lambda m, n=name: f"{ctx} {n}: {m}")
    if spec["masked"]:                        # masked rows get exactly no gradient
        assert torch.all(got["grad_h"][::3] == 0), ctx
    if spec.get("twice"):
        assert got["bit_equal"], f"{ctx}: two backward passes differ"


# --------------------------------------------------------------------------------------------
# Chunked torch reference, in process (TP=1)
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec", _cases(), ids=lambda s: f"{s['dtype']}-T{s['temperature']}-"
                         f"n{s['n']}-ce{int(s['compute_entropy'])}eg{int(s['entropy_grad'])}-"
                         f"m{int(s['masked'])}-{'tiled' if s['tiles'] else 'whole'}")
def test_torch_reference_matches_foundation_op(spec):
    _check(_run_fused(spec, 1, 0, None, "torch"), _reference(spec), spec)


def test_bf16_against_literal_unfused_path():
    """Unfused path with bf16 logits (what ``output_layer`` returns) vs ours: logits rounding."""
    spec = _spec(40, "bf16", 0.9, **TINY)
    hidden, weight, labels, _, _ = _make(spec)
    logits = hidden @ weight.t()                                  # bf16 logits
    assert float(logits.float().abs().max()) < 12
    ref_lp, ref_h = vocab_parallel_logprob_entropy(logits, labels, temperature=0.9)
    lp, ent = fused_linear_logprob_entropy(hidden, weight, labels, temperature=0.9,
                                           backend="torch", **TINY)
    torch.testing.assert_close(lp, ref_lp, atol=5e-2, rtol=0)
    torch.testing.assert_close(ent, ref_h, atol=5e-2, rtol=0)


class _BigTensorSpy(TorchDispatchMode):
    """Record the shapes of new (not view / in-place) op outputs of >= ``limit`` elements."""

    def __init__(self, limit: int):
        super().__init__()
        self.limit, self.big = limit, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        flat = list(args) + list((kwargs or {}).values())
        inputs = {a.untyped_storage().data_ptr() for a in flat if isinstance(a, torch.Tensor)}
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.numel() >= self.limit \
                    and t.untyped_storage().data_ptr() not in inputs:   # new memory only
                self.big.append((str(func), tuple(t.shape)))
        return out


def test_torch_reference_memory_no_logits_buffer():
    """Nothing ``[N, V_local]``-sized is saved for backward, nor allocated in fwd or bwd."""
    n, v, h = 64, 96, 8                      # N*V = 6144 >> V*H = 768 > N*H = 512
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, h, generator=g, requires_grad=True)
    weight = torch.randn(v, h, generator=g, requires_grad=True)
    labels = torch.randint(0, v, (n,), generator=g)
    saved: list[torch.Tensor] = []

    def pack(t):
        saved.append(t)
        return t

    spy = _BigTensorSpy(limit=n * v // 4)    # chunks are 8 x 96 = N*V / 8 elements
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), spy:
        logp, ent = fused_linear_logprob_entropy(hidden, weight, labels, backend="torch",
                                                 chunk_size=8)
        (logp.sum() + ent.sum()).backward()
    assert spy.big == [], spy.big
    control = _BigTensorSpy(limit=n * v // 4)     # negative control: the unfused path trips it
    with control:
        lp_ref, ent_ref = vocab_parallel_logprob_entropy(hidden @ weight.t(), labels)
        (lp_ref.sum() + ent_ref.sum()).backward()
    assert (n, v) in [shape for _, shape in control.big]
    assert saved, "nothing saved for backward?"
    assert max(t.numel() for t in saved) < n * v
    inputs = {hidden.untyped_storage().data_ptr(), weight.untyped_storage().data_ptr()}
    extra = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved
             if t.untyped_storage().data_ptr() not in inputs}
    assert sum(extra.values()) <= 4 * n * 8, extra     # only [N]-sized vectors besides inputs


def test_validation_and_backend_choice():
    hidden, weight = torch.randn(3, 4), torch.randn(5, 4)
    assert resolve_backend("auto", torch.device("cpu")) == "torch"
    with pytest.raises(ValueError, match="out of range"):
        fused_linear_logprob_entropy(hidden, weight, torch.tensor([0, 1, 5]))
    with pytest.raises(TypeError, match="dtype"):
        fused_linear_logprob_entropy(hidden, weight.double(), torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="hidden"):
        fused_linear_logprob_entropy(hidden, torch.randn(5, 3), torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="backend"):
        fused_linear_logprob_entropy(hidden, weight, torch.tensor([0, 1, 2]), backend="cuda")
    with pytest.raises(ValueError, match="temperature"):
        fused_linear_logprob_entropy(hidden, weight, torch.tensor([0, 1, 2]), temperature=0)


def test_empty_batch():
    hidden = torch.randn(0, 4, requires_grad=True)
    weight = torch.randn(5, 4, requires_grad=True)
    logp, ent = fused_linear_logprob_entropy(hidden, weight, torch.zeros(0, dtype=torch.long))
    assert logp.shape == ent.shape == (0,)
    (logp.sum() + ent.sum()).backward()
    assert torch.all(weight.grad == 0)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_torch_path_deterministic(dtype):
    """Two backward passes give bit-equal gradients (no atomics, fixed chunk order)."""
    spec = dict(_spec(50, dtype, 0.9, **TINY), twice=True)
    _check(_run_fused(spec, 1, 0, None, "torch"), _reference(spec), spec)


def test_auto_chunk_rows_budget():
    """The default chunk buffer stays within 8% of the [N, V_local] logits (issue shapes)."""
    from megatron_rl.kernels.fused_head_torch import auto_chunk_rows

    for n, v in ((16384, 151936), (16384, 151936 // 4), (4096, 151936)):
        rows = auto_chunk_rows(n, v, 2)
        assert rows * v * 2 <= 0.08 * n * v * 2 and rows >= 256, (n, v, rows)
    assert auto_chunk_rows(1, 10, 2) == 1 and auto_chunk_rows(100, 10, 2) == 100
    assert auto_chunk_rows(16384, 1000, 2, extra_fp32_buffers=2) < auto_chunk_rows(16384, 1000, 2)


def test_main_grad_accumulation_no_weight_sized_buffer():
    """``use_main_grad``: grad_weight lands in ``weight.main_grad`` (fp32, accumulated across
    calls), ``weight.grad`` stays None and backward allocates nothing of ``[V_local, H]`` size;
    without ``main_grad`` the same call allocates the fp32 accumulator (negative control)."""
    spec = _spec(60, "bf16", 1.1, n=48)
    hidden, weight, labels, g_lp, g_h = _make(spec)
    v, h = weight.size(0), hidden.size(1)               # N = 48, V = 76, H = 24: N*H < V*H
    ref = _reference(spec)
    weight.requires_grad_(True)
    weight.main_grad = torch.full((v, h), 0.5)                  # pre-existing content is kept
    hidden.requires_grad_(True)

    def step(use_main_grad: bool) -> _BigTensorSpy:
        logp, ent = fused_linear_logprob_entropy(hidden, weight, labels, temperature=1.1,
                                                 backend="torch", chunk_size=8,
                                                 use_main_grad=use_main_grad)
        loss = _loss(logp, ent, g_lp, g_h, spec)
        spy = _BigTensorSpy(limit=v * h)
        with spy:
            loss.backward()
        return spy

    spies = [step(True), step(True)]
    assert all(sp.big == [] for sp in spies), [sp.big for sp in spies]
    assert weight.grad is None
    torch.testing.assert_close(weight.main_grad - 0.5, 2 * ref["grad_w"], rtol=2e-2,
                               atol=4e-2 * float(ref["grad_w"].abs().max()))
    control = step(False)                                        # no main_grad use: a buffer
    assert any(shape == (v, h) for _, shape in control.big), control.big
    assert weight.grad is not None and weight.grad.dtype == torch.bfloat16


class _FakeHeadModel(torch.nn.Module):
    """Stand-in for the last stage: ``output_layer(x, weight=None) -> (x @ W.T, None)``."""

    def __init__(self, vocab: int, hidden: int, tied: bool):
        super().__init__()
        self.share_embeddings_and_output_weights = tied
        self.embedding_weight = torch.nn.Parameter(torch.randn(vocab, hidden))
        self.output_layer = _FakeOutputLayer(vocab, hidden)

    def shared_embedding_or_output_weight(self):
        return self.embedding_weight


class _FakeOutputLayer(torch.nn.Module):
    def __init__(self, vocab: int, hidden: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(vocab, hidden))
        self.bias = None

    def forward(self, x, weight=None):
        return x @ (self.weight if weight is None else weight).t(), None


@pytest.mark.parametrize("tied", [False, True])
def test_integration_matches_heads_tp1(tied):
    from megatron_rl.models.fused_head import fused_response_logprob_entropy
    from megatron_rl.models.heads import response_logprob_entropy

    torch.manual_seed(3)
    s, b, h, v = 9, 3, 8, 40
    model = _FakeHeadModel(v, h, tied)
    tokens = torch.randint(0, v, (b, s))
    mask = torch.zeros(b, s, dtype=torch.bool)
    mask[0, 3:7] = mask[1, 1:9] = mask[2, 8] = True
    hidden = torch.randn(s, b, h, requires_grad=True)
    outs = {}
    for name, fn in (("heads", response_logprob_entropy),
                     ("fused", fused_response_logprob_entropy)):
        model.zero_grad()
        hidden.grad = None
        lp, ent = fn(model, hidden, tokens, mask, temperature=0.8, chunk_size=4)
        (lp.sum() + 0.5 * ent.sum()).backward()
        weight = model.embedding_weight if tied else model.output_layer.weight
        outs[name] = (lp.detach(), ent.detach(), hidden.grad.clone(), weight.grad.clone())
    for a, r in zip(outs["fused"], outs["heads"]):
        torch.testing.assert_close(a, r, atol=1e-5, rtol=0)
    assert torch.all(outs["fused"][0][~mask] == 0) and torch.all(outs["fused"][1][~mask] == 0)


# --------------------------------------------------------------------------------------------
# Spawned workers: Triton interpreter (TP=1, TP=2) and the torch reference at TP=2 over gloo
# --------------------------------------------------------------------------------------------
def _worker(tp: int, backend: str, specs: list[dict]) -> list[dict]:
    """One rank: run every case; return per-case results (TP group = world)."""
    import torch.distributed as dist

    group, rank = None, 0
    if tp > 1:
        from megatron_rl.parallel.runtime import init_distributed

        init_distributed(backend="gloo", timeout_s=60)
        group, rank = dist.group.WORLD, dist.get_rank()
    if backend == "triton":
        import triton  # noqa: F401 - imported here, after TRITON_INTERPRET is set

        from megatron_rl.kernels.fused_head_triton import interpreter_active
        assert interpreter_active()
    return [_run_fused(spec, tp, rank, group, backend) for spec in specs]


def _spawn_cases(tp: int, backend: str, specs: list[dict]) -> None:
    env = dict(INTERP_ENV) if backend == "triton" else {}
    per_rank = spawn(_worker, tp, (tp, backend, specs), timeout_s=360, env=env)
    for spec, *got in zip(specs, *per_rank):
        ref = _reference(spec)
        for rank, g in enumerate(got):
            _check(g, ref, spec, tp, rank)


def _triton_cases() -> list[dict]:
    """The tiled half of the grid (several row chunks, several vocab tiles per row), N=1 and
    entropy off; two of them also run the backward twice (bit-equal gradients)."""
    cases = [c for c in _cases() if c["tiles"] or c["n"] == 1 or not c["compute_entropy"]]
    cases[0] = dict(cases[0], twice=True)                  # fp32
    cases[2] = dict(cases[2], twice=True)                  # bf16
    return cases


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_triton_interpreter_tp1():
    pytest.importorskip("triton")
    _spawn_cases(1, "triton", _triton_cases())


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_tp2_matches_single_process(backend):
    if backend == "triton":
        pytest.importorskip("triton")
    _spawn_cases(2, backend, _triton_cases() if backend == "triton" else _cases())


def _megatron_worker(presets: list[str]) -> list[dict]:
    """TP=2 megatron GPTModel: fused vs unfused head on random hidden states."""
    from megatron.core import parallel_state as ps

    from megatron_rl.cli.check import make_batch
    from megatron_rl.models.builder import build_gpt_model
    from megatron_rl.models.config import get_preset
    from megatron_rl.models.fused_head import fused_response_logprob_entropy, output_weight
    from megatron_rl.models.heads import response_logprob_entropy
    from megatron_rl.parallel import runtime

    runtime.init_parallel(tp=2, pp=1, seed=0, timeout_s=60)
    out = []
    for preset in presets:
        cfg = get_preset(preset)
        model = build_gpt_model(cfg, seed=5)
        batch = make_batch(1, 2, 12, cfg.vocab_size, seed=7)[0]
        g = torch.Generator().manual_seed(11)
        hidden = torch.randn(12, 2, cfg.hidden_size, generator=g).requires_grad_(True)
        res = {}
        for name, fn in (("heads", response_logprob_entropy),
                         ("fused", fused_response_logprob_entropy)):
            model.zero_grad()
            hidden.grad = None
            weight = output_weight(model)
            weight.grad = None
            lp, ent = fn(model, hidden, batch["tokens"], batch["mask"], temperature=0.7,
                         chunk_size=3)
            (lp.sum() - 0.3 * ent.sum()).backward()
            wg = getattr(weight, "main_grad", None)
            wg = weight.grad if weight.grad is not None else wg
            res[name] = (lp.detach(), ent.detach(), hidden.grad.clone(), wg.clone())
        out.append(dict(preset=preset, tied=model.share_embeddings_and_output_weights,
                        tp_rank=ps.get_tensor_model_parallel_rank(), **res))
    runtime.shutdown()
    return out


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_integration_megatron_tp2():
    """Real megatron output layer (untied and tied) at TP=2: values and grads match heads.py."""
    per_rank = spawn(_megatron_worker, 2, (["tiny", "tiny-llama"],), timeout_s=360)
    seen_tied = set()
    for rank_out in per_rank:
        for r in rank_out:
            seen_tied.add(r["tied"])
            for a, b in zip(r["fused"], r["heads"]):
                torch.testing.assert_close(a, b, atol=1e-5, rtol=0, msg=str(r["preset"]))
    assert seen_tied == {False, True}


# --------------------------------------------------------------------------------------------
# Inside a real actor update: megatron DDP's main_grad path, fused on vs off
# --------------------------------------------------------------------------------------------
def _actor_worker(presets: list[str]) -> list[dict]:
    """TP=1 actor (megatron GPTModel + DDP + optimizer): one update with the fused head on and
    off from the same weights and batch. Returns metrics, the updated state and every
    parameter's ``main_grad`` (what the optimizer consumed), and whether the fused backward found
    ``main_grad`` on the output weight (observed through ``main_grad_target``)."""
    import megatron_rl.kernels.fused_head as fh
    from megatron_rl.actor.actor import Actor
    from megatron_rl.actor.optim import OptimConfig
    from megatron_rl.actor.train_step import ActorConfig
    from megatron_rl.loss import LossConfig
    from megatron_rl.models.config import get_preset
    from megatron_rl.models.weights import gather_full_state_dict
    from megatron_rl.parallel import runtime

    found: list[bool] = []
    real_target = fh.main_grad_target

    def observed_target(weight):
        target = real_target(weight)
        found.append(target is not None)
        return target

    fh.main_grad_target = observed_target
    runtime.init_parallel(tp=1, pp=1, timeout_s=120)
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 256, (4, 18), generator=g)
    mask = torch.zeros(4, 18, dtype=torch.bool)
    for b, (p, r) in enumerate([(3, 12), (5, 9), (2, 15), (6, 4)]):
        mask[b, p:p + r] = True
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])[:, None] * mask
    noise = 0.2 * torch.randn(4, 18, generator=g) * mask        # the rollout policy lagged
    out = []
    for preset in presets:
        res = {}
        for fused in (False, True):
            found.clear()
            actor = Actor(get_preset(preset),
                          ActorConfig(micro_batch_size=2, fused_logprob_entropy=fused),
                          OptimConfig(lr=1e-3, adam_eps=1e-6, clip_grad=1.0),
                          LossConfig.for_algorithm("dapo", entropy_coeff=0.01),
                          total_steps=1, seed=7)
            batch = actor.add_old_logprobs({"tokens": tokens, "mask": mask, "advantages": adv})
            batch["old_logp"] = batch["old_logp"] + noise
            history = actor.update(batch, 0)
            grads = {n: p.main_grad.detach().clone() for n, p in
                     actor.ddp.module.named_parameters()}
            res[fused] = dict(history=history, grads=grads,
                              state=gather_full_state_dict(actor.model),
                              found=list(found))
        out.append(dict(preset=preset, tied=get_preset(preset).tie_word_embeddings, **{
            "off": res[False], "on": res[True]}))
    runtime.shutdown()
    return out


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_actor_update_fused_main_grad_matches_unfused():
    """Fused head with DDP main_grad accumulation (untied and tied output weight) gives the same
    gradients, metrics and updated weights as the unfused head, within fp32 slack."""
    per_preset = spawn(_actor_worker, 1, (["tiny", "tiny-llama"],), timeout_s=560)[0]
    assert {r["tied"] for r in per_preset} == {False, True}
    for r in per_preset:
        off, on = r["off"], r["on"]
        assert off["found"] == [] and on["found"] and all(on["found"]), r["preset"]
        for name, g_off in off["grads"].items():
            scale = float(g_off.abs().max()) + 1e-12
            torch.testing.assert_close(on["grads"][name], g_off, rtol=1e-4, atol=1e-5 * scale,
                                       msg=lambda m, n=f"{r['preset']} {name}": f"{n}: {m}")
        assert any(float(g.abs().max()) > 0 for g in off["grads"].values())
        for k, v in off["history"][0].items():
            assert on["history"][0][k] == pytest.approx(v, rel=1e-5, abs=1e-6), (r["preset"], k)
        for k, v in off["state"].items():
            torch.testing.assert_close(on["state"][k], v, rtol=1e-5, atol=1e-6)
