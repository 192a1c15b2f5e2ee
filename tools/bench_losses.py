"""Benchmark: global Clip-Cov / KL-Cov (ours) vs a per-micro-batch implementation in the anchors'
style (``.cpu()`` top-k / ``.item()`` counts / ``nonzero`` + ``randperm`` per micro-batch, an
"at least one token" floor per micro-batch), on one mini-batch of 64 x 4096 tokens, CPU, one run.
The anchor computes the metrics verl's loss functions return (``ppo_kl``, ``pg_clipfrac``, read
with ``.item()`` per micro-batch), as ours computes its counterparts; the anchor without them is
printed too (``... without metrics``). Ours is timed with all its metrics, including those the
anchor has no counterpart for (the PPO clip fraction, KL-Cov's mean ``|log ratio|`` and the five
selection metrics: batch covariance, mean selected Cov, selected count and fractions), and with
its global fp64 means where the anchor takes fp32 means per micro-batch: the comparison is of
the two as they are, nothing removed from either.

Reported per variant: wall time per mini-batch (selection + loss forward + backward of every
micro-batch) and the number of host syncs per mini-batch. Syncs are counted two ways at once:
a ``TorchDispatchMode`` counts the ops that force a device->host sync on a GPU
(``aten._local_scalar_dense`` = ``.item()``/``int()``/``bool()``, ``aten.nonzero``,
``aten.masked_select`` and boolean-mask indexing, whose output shape depends on data), and
``Tensor.cpu`` / ``Tensor.tolist`` are wrapped to count explicit copies to the host (on a CPU
tensor ``.cpu()`` is a no-op, so the dispatcher alone would miss it).

Also printed: the cost of the "prepass" statistic source, as the ratio of a no-grad forward to a
forward + backward of a small transformer (the pre-pass is one extra no-grad forward per
mini-batch; the "old_logp" source costs nothing).

Usage: ``python tools/bench_losses.py [--micro-batches 8] [--repeats 5] [--clock wall|cpu]
[--baseline DIR] [--dp 2]``: ``--baseline`` times another checkout's implementation in the same
run (before/after); ``--dp 2`` runs 2 gloo ranks, each with half of the mini-batch, ours over the
DP group vs the anchor on the rank's shard plus one all-reduce.
"""

from __future__ import annotations

import argparse
import contextlib
import pathlib
import sys
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # run from a checkout

import megatron_rl.loss as ours_lib  # noqa: E402
from megatron_rl.loss import LossConfig, ReductionContext, select_cov_tokens  # noqa: E402

B, T = 64, 4096


# ---- host-sync counting ---------------------------------------------------------------------
class SyncCounter(TorchDispatchMode):
    """Counts ops that would block on a device->host copy on a GPU."""

    SYNC_OPS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default,
                torch.ops.aten.masked_select.default}

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.SYNC_OPS:
            self.count += 1
        elif func is torch.ops.aten.index.Tensor and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or [])):
            self.count += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def count_host_syncs():
    """Yields a dict whose ``"n"`` is the number of host syncs inside the block."""
    box = {"n": 0}
    orig_cpu, orig_tolist = torch.Tensor.cpu, torch.Tensor.tolist

    def cpu(self, *a, **k):
        box["n"] += 1
        return orig_cpu(self, *a, **k)

    def tolist(self, *a, **k):
        box["n"] += 1
        return orig_tolist(self, *a, **k)

    torch.Tensor.cpu, torch.Tensor.tolist = cpu, tolist
    mode = SyncCounter()
    try:
        with mode:
            yield box
    finally:
        torch.Tensor.cpu, torch.Tensor.tolist = orig_cpu, orig_tolist
        box["n"] += mode.count


# ---- anchor-style per-micro-batch implementation ---------------------------------------------
def _masked_mean(x, m):
    return (x * m).sum() / m.sum()


def anchor_clip_cov(logp, old, adv, mask, cfg: LossConfig, metrics: bool = True):
    """Per-micro-batch Clip-Cov as the public implementations structure it (not exact global).
    ``metrics``: also the two metrics verl's ``compute_policy_loss_clip_cov`` returns
    (``actor/ppo_kl``, ``actor/pg_clipfrac``: masked means read with ``.item()``), the
    counterparts of ours (``policy/ppo_kl``, ``clip_cov/zeroed_frac``)."""
    m = mask.float()
    lr = logp - old
    ratio = torch.exp(lr)
    l1 = -adv * ratio
    l2 = -adv * ratio.clamp(1 - cfg.clip_ratio_low, 1 + cfg.clip_ratio_high)
    n_clip = max(int(cfg.clip_cov_ratio * m.sum().item()), 1)  # host sync, per-mb floor
    cov = (adv - _masked_mean(adv, m)) * (logp.detach() - _masked_mean(logp.detach(), m))
    cov = cov.masked_fill(~mask, float("-inf"))
    cand = (cov > cfg.clip_cov_lb) & (cov < cfg.clip_cov_ub) & ~(l2 > l1) & mask
    idx = torch.nonzero(cand)  # host sync (dynamic shape)
    corr = torch.ones_like(adv)
    if len(idx) > 0:
        pick = idx[torch.randperm(len(idx))[:min(n_clip, len(idx))]]
        corr[pick[:, 0], pick[:, 1]] = 0
    if metrics:
        _ = (_masked_mean(-lr.detach(), m).item(), _masked_mean((corr == 0).float(), m).item())
    return torch.maximum(l1, l2) * corr


def anchor_kl_cov(logp, old, adv, mask, cfg: LossConfig, metrics: bool = True):
    """Per-micro-batch KL-Cov with the top-k done on host copies, as in the public code;
    ``metrics``: also verl's ``actor/ppo_kl`` (masked mean of ``|log ratio|``, ``.item()``), the
    counterpart of ours (``kl_cov/abs_log_ratio``)."""
    lr = logp - old
    loss = -adv * torch.exp(lr)
    flat_valid = torch.nonzero(mask.reshape(-1), as_tuple=True)[0]  # host sync
    a = adv[mask].detach().reshape(-1).cpu()
    lp = logp[mask].detach().reshape(-1).cpu()
    if len(a) > 0:
        cov = (a - a.mean()) * (lp - lp.mean())
        k = max(1, int(len(cov) * cfg.kl_cov_ratio))
        top = flat_valid[torch.topk(cov, k, largest=True).indices]
        extra = torch.zeros(loss.numel())
        extra[top] = cfg.kl_cov_coef
        loss = loss + extra.view_as(loss) * lr.abs()
    if metrics:
        _ = _masked_mean(lr.detach().abs(), mask.float()).item()
    return loss


def anchor_step(mbs, cfg, fn, dp: bool = False, metrics: bool = True):
    """Per-micro-batch losses on this rank's micro-batches; with ``dp`` one ``all_reduce`` of
    the summed loss per mini-batch (for logging: the least a DP run needs besides the
    gradients, which DDP reduces in both variants); ``metrics``: with verl's per-micro-batch
    metrics of the loss (see :func:`anchor_clip_cov`)."""
    n = len(mbs)
    total = torch.zeros(())
    for mb in mbs:
        logp = mb["logp"].clone().requires_grad_(True)
        per_tok = fn(logp, mb["old"], mb["adv"], mb["mask"], cfg, metrics)
        m = mb["mask"].float()
        loss = (per_tok * m).sum() / m.sum().item() / n  # per-mb token-mean, grad accumulation
        loss.backward()
        total = total + loss.detach()
    if dp:
        torch.distributed.all_reduce(total)


# ---- ours ------------------------------------------------------------------------------------
def global_step(mbs, cfg, lib=None, group=None):
    """One mini-batch with the global selection; ``lib``: another checkout's ``megatron_rl.loss``
    (``--baseline``), default this one; ``group="default"``: the DP group (``--dp``)."""
    L = lib or ours_lib
    masks = [mb["mask"] for mb in mbs]
    ctx = L.ReductionContext.from_minibatch(masks, group=group)
    sel = L.select_cov_tokens(ctx, cfg, [mb["logp"] for mb in mbs], [mb["old"] for mb in mbs],
                              [mb["adv"] for mb in mbs], masks, step=1)
    acc = L.MetricAccumulator()
    for i, mb in enumerate(mbs):
        logp = mb["logp"].clone().requires_grad_(True)
        out = L.compute_loss(L.LossInputs(logp, mb["old"], mb["adv"], mb["mask"],
                                          cov_selected=sel.selected[i]), cfg, ctx)
        out.loss_for_backward.backward()
        acc.update(out.stats)
    acc.reduce(ctx)


class Baseline:
    """``megatron_rl.loss`` of another checkout (``lib``) and that checkout's modules
    (``modules``): its code resolves some names at call time (the package's lazy attributes,
    the loss registry's ``module:function`` entries), so :meth:`active` puts its modules in
    ``sys.modules`` while it runs (a few dict updates, negligible next to a mini-batch)."""

    def __init__(self, lib, modules: dict) -> None:
        self.lib, self.modules = lib, modules

    @contextlib.contextmanager
    def active(self):
        saved = {k: sys.modules.get(k) for k in self.modules}
        sys.modules.update(self.modules)
        try:
            yield self.lib
        finally:
            for k, v in saved.items():
                if v is None:
                    sys.modules.pop(k, None)
                else:
                    sys.modules[k] = v


def load_baseline(root: str) -> Baseline:
    """``megatron_rl.loss`` of another checkout ``root`` (e.g. ``git worktree add /tmp/base
    <commit>``), imported beside this one's for a side-by-side timing, with every module of its
    ``loss`` package loaded."""
    import importlib
    import pkgutil

    def ours(k: str) -> bool:
        return k == "megatron_rl" or k.startswith("megatron_rl.")

    saved = {k: v for k, v in sys.modules.items() if ours(k)}
    for k in saved:
        del sys.modules[k]
    sys.path.insert(0, str(pathlib.Path(root).resolve()))
    try:
        lib = importlib.import_module("megatron_rl.loss")
        for info in pkgutil.iter_modules(lib.__path__):
            importlib.import_module(f"megatron_rl.loss.{info.name}")
        for name in getattr(lib, "__all__", []):
            getattr(lib, name)
        modules = {k: v for k, v in sys.modules.items() if ours(k)}
    finally:
        sys.path.pop(0)
        for k in [k for k in sys.modules if ours(k)]:
            del sys.modules[k]
        sys.modules.update(saved)
    return Baseline(lib, modules)


def baseline_step(mbs, cfg, base: Baseline, group=None) -> None:
    """:func:`global_step` with the baseline checkout's code."""
    with base.active() as lib:
        global_step(mbs, cfg, lib, group)


def selection_only(mbs, cfg):
    masks = [mb["mask"] for mb in mbs]
    ctx = ReductionContext.from_minibatch(masks, group=None)
    select_cov_tokens(ctx, cfg, [mb["logp"] for mb in mbs], [mb["old"] for mb in mbs],
                      [mb["adv"] for mb in mbs], masks, step=1)


def make_minibatch(n_micro: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(T // 4, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    logp = -torch.rand(B, T, generator=g) * 4
    old = logp + torch.randn(B, T, generator=g) * 0.05
    adv = torch.randn(B, 1, generator=g).expand(B, T).contiguous()
    per = B // n_micro
    return [dict(logp=logp[i:i + per], old=old[i:i + per], adv=adv[i:i + per],
                 mask=mask[i:i + per]) for i in range(0, B, per)]


CLOCK = time.perf_counter  # --clock cpu: time.process_time (CPU seconds of this process)


def timed(fn, repeats: int) -> tuple[float, int]:
    return timed_side_by_side([fn], repeats)[0]


def timed_side_by_side(fns, repeats: int) -> list[tuple[float, int]]:
    """Best time and host syncs of each function; the repeats are interleaved (A, B, A, B, ...)
    so that a load change on a shared machine hits every variant alike."""
    syncs = []
    for fn in fns:
        fn()  # warm-up
        with count_host_syncs() as box:
            fn()
        syncs.append(box["n"])
    best = [float("inf")] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            t0 = CLOCK()
            fn()
            best[i] = min(best[i], CLOCK() - t0)
    return list(zip(best, syncs, strict=True))


def prepass_ratio(repeats: int) -> float:
    """no-grad forward time / (forward + backward) time of a small transformer LM."""
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(256, 4, 1024, batch_first=True)
    model = torch.nn.Sequential(torch.nn.Embedding(4096, 256),
                                torch.nn.TransformerEncoder(layer, 2), torch.nn.Linear(256, 4096))
    x = torch.randint(0, 4096, (4, 512))

    def fwd():
        with torch.no_grad():
            torch.log_softmax(model(x), -1)

    def fwd_bwd():
        torch.log_softmax(model(x), -1).mean().backward()

    return timed(fwd, repeats)[0] / timed(fwd_bwd, repeats)[0]


CFGS = {"clip_cov": dict(policy_loss="clip_cov", clip_cov_ratio=2e-4, clip_ratio_low=0.2,
                         clip_ratio_high=0.2),
        "kl_cov": dict(policy_loss="kl_cov", kl_cov_ratio=2e-4)}
ANCHORS = {"clip_cov": anchor_clip_cov, "kl_cov": anchor_kl_cov}


def _dp_worker(dp: int, n_micro: int, repeats: int, clock: str, baseline: str | None) -> dict:
    """One DP rank: its shard (rows ``rank::dp`` blocks) of the same mini-batch; ours (global
    selection over the DP group) vs the anchor on the shard plus one all-reduce."""
    from megatron_rl.parallel.runtime import init_distributed

    global CLOCK
    CLOCK = time.process_time if clock == "cpu" else time.perf_counter
    torch.set_num_threads(1)
    init_distributed(backend="gloo", timeout_s=300)
    rank = torch.distributed.get_rank()
    base = load_baseline(baseline) if baseline else None
    mbs = make_minibatch(n_micro)
    per = len(mbs) // dp
    mbs = mbs[rank * per:(rank + 1) * per]
    out = {}
    for name, kw in CFGS.items():
        cfg = LossConfig(**kw).validate()
        fns = [lambda cfg=cfg: global_step(mbs, cfg, group="default"),
               lambda cfg=cfg, name=name: anchor_step(mbs, cfg, ANCHORS[name], dp=True),
               lambda cfg=cfg, name=name: anchor_step(mbs, cfg, ANCHORS[name], dp=True,
                                                      metrics=False)]
        if base is not None:
            bcfg = base.lib.LossConfig(**kw)
            fns.append(lambda bcfg=bcfg: baseline_step(mbs, bcfg, base, group="default"))
        out[name] = [t for t, _ in timed_side_by_side(fns, repeats)]
    return out


def main_dp(args) -> None:
    from megatron_rl.parallel.launch import spawn

    res = spawn(_dp_worker, args.dp, (args.dp, args.micro_batches, args.repeats, args.clock,
                                      args.baseline), timeout_s=1200)
    print(f"mini-batch {B}x{T}, DP={args.dp} gloo ranks x {args.micro_batches // args.dp} "
          f"micro-batches, {args.clock} clock; ms per mini-batch, slowest rank")
    for name in CFGS:
        t = [max(r[name][i] for r in res) for i in range(len(res[0][name]))]
        print(f"{name + ' global (ours)':<38}{t[0] * 1e3:>16.1f}")
        print(f"{name + ' per-rank anchor + all-reduce':<38}{t[1] * 1e3:>16.1f}")
        print(f"{name + ' same, loss without metrics':<38}{t[2] * 1e3:>16.1f}")
        if len(t) > 3:
            print(f"{name + ' global (baseline)':<38}{t[3] * 1e3:>16.1f}")
            print(f"{name + ' time ratio baseline/anchor':<38}{t[3] / t[1]:>16.2f}")
        print(f"{name + ' time ratio ours/anchor':<38}{t[0] / t[1]:>16.2f}")
        print(f"{name + ' ratio ours/anchor without metrics':<38}{t[0] / t[2]:>16.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--micro-batches", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads (1 avoids OpenMP spin-wait noise on a shared box)")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="wall: perf_counter; cpu: process CPU time (steadier on a shared box, "
                         "where waiting for a core inflates wall time)")
    ap.add_argument("--baseline", metavar="DIR", default=None,
                    help="also time the global selection of another checkout DIR (before/after)")
    ap.add_argument("--dp", type=int, default=1,
                    help="DP ranks (gloo processes), each with its shard of the mini-batch")
    args = ap.parse_args()
    if args.dp > 1:
        main_dp(args)
        return
    base = load_baseline(args.baseline) if args.baseline else None
    global CLOCK
    CLOCK = time.process_time if args.clock == "cpu" else time.perf_counter
    torch.set_num_threads(args.threads)
    mbs = make_minibatch(args.micro_batches)
    n_tok = int(sum(mb["mask"].sum() for mb in mbs))
    print(f"mini-batch {B}x{T} ({n_tok} valid tokens), {args.micro_batches} micro-batches, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU, {args.clock} clock")
    cfgs = {name: LossConfig(**kw) for name, kw in CFGS.items()}
    anchors = ANCHORS
    print(f"{'variant':<38}{'ms / mini-batch':>16}{'host syncs':>12}")
    for name, cfg in cfgs.items():
        cfg.validate()
        fns = [lambda cfg=cfg: selection_only(mbs, cfg), lambda cfg=cfg: global_step(mbs, cfg),
               lambda cfg=cfg, name=name: anchor_step(mbs, cfg, anchors[name]),
               lambda cfg=cfg, name=name: anchor_step(mbs, cfg, anchors[name], metrics=False)]
        if base is not None:
            bcfg = base.lib.LossConfig(**vars(cfg))
            fns.append(lambda bcfg=bcfg: baseline_step(mbs, bcfg, base))
        res = timed_side_by_side(fns, args.repeats)
        (t_sel, s_sel), (t_g, s_g), (t_a, s_a), (t_n, s_n) = res[:4]
        print(f"{name + ' global selection only':<38}{t_sel * 1e3:>16.1f}{s_sel:>12d}")
        print(f"{name + ' global (ours), full step':<38}{t_g * 1e3:>16.1f}{s_g:>12d}")
        print(f"{name + ' per-micro-batch (anchor)':<38}{t_a * 1e3:>16.1f}{s_a:>12d}")
        print(f"{name + ' same, loss without metrics':<38}{t_n * 1e3:>16.1f}{s_n:>12d}")
        if base is not None:
            t_b, s_b = res[4]
            print(f"{name + ' global (baseline) full step':<38}{t_b * 1e3:>16.1f}{s_b:>12d}")
            print(f"{name + ' time ratio baseline/anchor':<38}{t_b / t_a:>16.2f}")
        print(f"{name + ' time ratio ours/anchor':<38}{t_g / t_a:>16.2f}")
        print(f"{name + ' ratio ours/anchor without metrics':<38}{t_g / t_n:>16.2f}")
    r = prepass_ratio(args.repeats)
    print(f"prepass cost: no-grad forward / (forward+backward) = {r:.2f} "
          f"(cov_stat_source='prepass' adds about {r * 100:.0f}% of a training micro-batch pass "
          "per mini-batch after the first; 'old_logp' adds 0)")


if __name__ == "__main__":
    main()
