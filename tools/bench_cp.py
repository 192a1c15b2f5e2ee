"""Activation memory per rank under context parallelism (``parallel.cp``) at CP 1, 2 and 4.

For each CP size one spawned gloo job (TP1 x PP1 x DP1 x CP``cp``) builds the same model and
runs the training forward of one fixed long row (log-probs of every token, the loss's input)
with gradients. The activation memory of a rank is counted exactly as the bytes of every tensor
storage autograd saves for the backward pass (``torch.autograd.graph.saved_tensors_hooks``; the
weights excluded), then the backward runs once to show the graph is complete. The goal is about
``1/cp`` of CP 1 plus the gathered K/V (one ``[S, B, groups, D]`` pair per layer, kept for the
backward).

    python tools/bench_cp.py --seq 1024 --preset tiny

Last line: ``bench_cp: mem_ratio_2=<CP2/CP1> mem_ratio_4=<CP4/CP1>`` (the largest rank of each).
"""

from __future__ import annotations

import argparse

import torch

from megatron_rl.parallel.launch import spawn


def saved_bytes_of_forward(model: torch.nn.Module, tokens: torch.Tensor) -> tuple[int, float]:
    """Bytes of the storages autograd saves during one forward of ``tokens [1, S]`` (all
    positions but the first scored) on this rank, weights excluded; and the summed log-prob
    (after the backward ran)."""
    from megatron_rl.actor.cp_forward import cp_model_forward, cp_response_logprob_entropy
    from megatron_rl.models.heads import response_logprob_entropy
    from megatron_rl.parallel.context_parallel import cp_size

    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in weights:
            saved[st.data_ptr()] = st.nbytes()
        return t

    mask = torch.ones_like(tokens, dtype=torch.bool)
    mask[:, 0] = False
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        if cp_size() > 1:
            hidden = cp_model_forward(model, tokens)
            logp, _ = cp_response_logprob_entropy(model, hidden, tokens, mask,
                                                  compute_entropy=False)
        else:
            pos = torch.arange(tokens.shape[1]).unsqueeze(0)
            hidden = model(tokens, pos, None)
            logp, _ = response_logprob_entropy(model, hidden, tokens, mask,
                                               compute_entropy=False)
        loss = logp.sum()
    loss.backward()
    return sum(saved.values()), float(loss.detach())


def _worker(cp: int, seq: int, preset: str) -> dict:
    import torch.distributed as dist

    from megatron_rl.models.builder import build_gpt_model
    from megatron_rl.models.config import get_preset
    from megatron_rl.parallel import runtime

    runtime.init_parallel(tp=1, pp=1, cp=cp, timeout_s=600)
    cfg = get_preset(preset)
    model = build_gpt_model(cfg, seed=0)
    tokens = torch.randint(0, cfg.vocab_size, (1, seq), generator=torch.Generator().manual_seed(0))
    nbytes, logp_sum = saved_bytes_of_forward(model, tokens)
    out = {"rank": dist.get_rank(), "bytes": nbytes, "logp_sum": logp_sum}
    runtime.shutdown()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq", type=int, default=1024, help="tokens of the row (default 1024)")
    ap.add_argument("--preset", default="tiny", help="model preset (default tiny)")
    args = ap.parse_args()
    peak: dict[int, int] = {}
    for cp in (1, 2, 4):
        reports = spawn(_worker, cp, (cp, args.seq, args.preset), timeout_s=1200)
        peak[cp] = max(r["bytes"] for r in reports)
        logp = reports[0]["logp_sum"]
        print(f"CP{cp}: {len(reports)} rank(s), saved activations per rank "
              + ", ".join(f"{r['bytes'] / 2**20:.1f} MiB" for r in reports)
              + f"; sum of log-probs {logp:.4f}", flush=True)
    print(f"bench_cp: mem_ratio_2={peak[2] / peak[1]:.3f} mem_ratio_4={peak[4] / peak[1]:.3f}")


if __name__ == "__main__":
    main()
