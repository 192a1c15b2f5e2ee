"""Layout-parity smoke check: the same weights and batch at TP1xPP1 and at TPxPP (xCP) give the
same per-token log-prob and entropy.

The reference run builds the model at TP1xPP1 from a seed and exports its canonical weights; the
parallel run builds its model from a *different* seed and then loads those weights through
:mod:`megatron_rl.models.weights` (resharding, not re-initialisation), runs megatron's pipeline
schedule forward-only, and reports from the last stage.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from megatron_rl.parallel.launch import spawn


@dataclass
class ParityReport:
    """Per-token differences between a parallel layout and the TP1xPP1 reference."""

    tp: int
    pp: int
    tokens: int
    max_abs_logp: float
    max_abs_entropy: float
    wall_s: float
    samples: list[tuple[float, float, float, float]]  # (logp_ref, logp_par, H_ref, H_par)
    cp: int = 1  # context-parallel size of the parallel run

    @property
    def label(self) -> str:
        """``TPxPP`` (``TPxPPxCP`` with context parallelism)."""
        return f"TP{self.tp}xPP{self.pp}" + (f"xCP{self.cp}" if self.cp > 1 else "")

    def ok(self, atol: float) -> bool:
        return self.max_abs_logp <= atol and self.max_abs_entropy <= atol


def make_batch(micro_batches: int, batch: int, seq: int, vocab: int, seed: int = 0) -> list[dict]:
    """Random token ids with a prompt prefix and a right-padded response of random length."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(micro_batches):
        tokens = torch.randint(0, vocab, (batch, seq), generator=g)
        mask = torch.zeros(batch, seq, dtype=torch.bool)
        for b in range(batch):
            prompt = int(torch.randint(1, seq // 2, (1,), generator=g))
            resp = int(torch.randint(1, seq - prompt + 1, (1,), generator=g))
            mask[b, prompt:prompt + resp] = True
        out.append({"tokens": tokens, "mask": mask})
    return out


def layout_worker(tp: int, pp: int, preset: str, full_state: dict | None, micro_batches: list,
                  seed: int, temperature: float, chunk_size: int | None, cp: int = 1
                  ) -> dict | None:
    """Run in each spawned rank: build, (load), forward; the reporting rank returns results."""
    from megatron.core import parallel_state as ps

    from megatron_rl.actor.forward import forward_logprob_entropy
    from megatron_rl.models.builder import build_gpt_model
    from megatron_rl.models.config import get_preset
    from megatron_rl.models.weights import gather_full_state_dict, load_full_state_dict
    from megatron_rl.parallel import runtime

    runtime.init_parallel(tp=tp, pp=pp, cp=cp, seed=seed, timeout_s=120)
    cfg = get_preset(preset)
    model = build_gpt_model(cfg, seed=seed)
    exported = None
    if full_state is None:
        exported = gather_full_state_dict(model)
    else:
        load_full_state_dict(model, full_state)
    t0 = time.perf_counter()
    outs = forward_logprob_entropy(model, micro_batches, temperature=temperature,
                                   chunk_size=chunk_size)
    wall = time.perf_counter() - t0
    reporter = (ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0
                and runtime.first_replica())
    result = None
    if reporter:
        result = {"outs": outs, "wall_s": wall}
    if exported is not None and torch.distributed.get_rank() == 0:
        result = dict(result or {}, state=exported)
    runtime.shutdown()
    return result


def run_layout(tp: int, pp: int, preset: str, micro_batches: list, full_state: dict | None,
               seed: int, temperature: float = 1.0, chunk_size: int | None = None,
               timeout_s: float = 300.0, cp: int = 1) -> dict:
    """Spawn ``tp*pp*cp`` gloo ranks for one layout; return the merged reports."""
    results = spawn(layout_worker, tp * pp * cp, (tp, pp, preset, full_state, micro_batches,
                                                  seed, temperature, chunk_size, cp),
                    timeout_s=timeout_s)
    merged: dict = {}
    for r in results:
        if r:
            merged.update(r)
    return merged


def compare(ref: list[dict], got: list[dict], masks: list[torch.Tensor]) -> tuple[float, float,
                                                                                   int]:
    """Max |diff| of logp and entropy over response tokens, and the token count."""
    dl = de = 0.0
    n = 0
    for r, g, m in zip(ref, got, masks):
        dl = max(dl, float((r["logp"] - g["logp"])[m].abs().max()))
        de = max(de, float((r["entropy"] - g["entropy"])[m].abs().max()))
        n += int(m.sum())
    return dl, de, n


def parity(tp: int, pp: int, preset: str = "tiny", micro_batches: int = 2, batch: int = 2,
           seq: int = 32, seed: int = 1234, temperature: float = 1.0,
           chunk_size: int | None = None, log=print, cp: int = 1) -> ParityReport:
    """Reference at TP1xPP1, then the requested layout (``cp``: context-parallel size, each
    sequence split over ``cp`` ranks) with resharded weights; compare."""
    from megatron_rl.models.config import get_preset

    cfg = get_preset(preset)
    mbs = make_batch(micro_batches, batch, seq, cfg.vocab_size, seed)
    log(f"[check] reference run TP1xPP1 ({preset}, {micro_batches}x{batch}x{seq} tokens) ...")
    ref = run_layout(1, 1, preset, mbs, None, seed, temperature, chunk_size)
    label = f"TP{tp}xPP{pp}" + (f"xCP{cp}" if cp > 1 else "")
    log(f"[check] parallel run {label} ({tp * pp * cp} gloo processes, weights resharded from "
        "the reference) ...")
    got = run_layout(tp, pp, preset, mbs, ref["state"], seed + 1, temperature, chunk_size,
                     cp=cp)
    dl, de, n = compare(ref["outs"], got["outs"], [mb["mask"] for mb in mbs])
    m0 = mbs[0]["mask"]
    r0, g0 = ref["outs"][0], got["outs"][0]
    samples = list(zip(r0["logp"][m0].tolist(), g0["logp"][m0].tolist(),
                       r0["entropy"][m0].tolist(), g0["entropy"][m0].tolist()))
    return ParityReport(tp, pp, n, dl, de, got["wall_s"], samples, cp)


def format_report(rep: ParityReport, atol: float, max_rows: int = 8) -> str:
    """Human-readable per-token table plus the verdict line."""
    lines = [f"{'token':>5} {'logp TP1xPP1':>13} {f'logp {rep.label}':>13} "
             f"{'H TP1xPP1':>10} {f'H {rep.label}':>10}"]
    for i, (lr, lp, hr, hp) in enumerate(rep.samples[:max_rows]):
        lines.append(f"{i:>5} {lr:>13.6f} {lp:>13.6f} {hr:>10.6f} {hp:>10.6f}")
    verdict = "PASS" if rep.ok(atol) else "FAIL"
    lines.append(f"{verdict}: {rep.tokens} response tokens, max |dlogp|={rep.max_abs_logp:.2e}, "
                 f"max |dH|={rep.max_abs_entropy:.2e} (atol {atol:g}); parallel forward "
                 f"{rep.wall_s:.2f}s")
    return "\n".join(lines)
