"""Actor step benchmarks.

Layouts (default): per-step wall time and peak RSS per rank of one actor RL step (old-policy
pass + update) at several TP x PP x DP layouts, measured in one run on gloo processes.

    python tools/bench_actor_step.py --layouts 1x1x1 2x1x1 1x2x1 2x2x1 1x1x2 --steps 3

Throughput (``--mfu``, one GPU): tokens/s per GPU and model FLOPs utilisation of the actor's
update (forward + backward + optimizer step, DAPO loss over every token) for ``qwen2.5-0.5b`` and
``qwen2.5-1.5b`` at 4 x 4096 tokens in bf16, fused head on/off, recompute none/full, next to the
anchor measured in the same run: a plain ``transformers`` Qwen2 of the same shape
(``attn_implementation="sdpa"``, bf16 weights) doing forward + backward with cross-entropy over
the same micro-batches (no optimizer step). ``--small`` runs the same table for a tiny shape on
CPU in well under a minute.

    python tools/bench_actor_step.py --mfu          # GPU
    python tools/bench_actor_step.py --small        # CPU smoke run of the same table

MFU = (6 * P * tokens + 6 * L * S^2 * d_attn * sequences) / time / peak, with P the parameters
that multiply activations (all but the input embedding; a tied output head counts), the second
term the causal attention matmuls (QK^T and AV, forward + backward); recomputed FLOPs are not
counted. MFU(12) counts the full S x S square instead (12 * L * S^2 * d_attn, Megatron-LM's and
PaLM's convention, which most published MFU numbers use); the table prints both. Peak:
``--peak-tflops``, else by full device name (:data:`PEAK_TFLOPS`: H100 SXM 989, H100 PCIe 756,
H100 NVL 835, H200 989, A100 312 TFLOP/s bf16 dense).
"""

from __future__ import annotations

import argparse
import resource
import time

import torch

from megatron_rl.parallel.launch import spawn


def _worker(tp: int, pp: int, dp: int, seqs: int, seq_len: int, steps: int, preset: str,
            loss: str) -> dict:
    from megatron.core import parallel_state as ps

    from megatron_rl.actor.actor import Actor
    from megatron_rl.actor.optim import OptimConfig
    from megatron_rl.actor.train_step import ActorConfig
    from megatron_rl.cli.check import make_batch
    from megatron_rl.loss import LossConfig
    from megatron_rl.models.config import get_preset
    from megatron_rl.parallel import runtime

    runtime.init_parallel(tp=tp, pp=pp, dp=dp, timeout_s=300)
    cfg = get_preset(preset)
    local = seqs // dp
    actor = Actor(cfg, ActorConfig(micro_batch_size=max(1, local // 2)), OptimConfig(lr=1e-4),
                  LossConfig.for_algorithm(loss), total_steps=steps + 1, seed=1)
    times = []
    for step in range(steps + 1):  # step 0 is warm-up
        (mb,) = make_batch(1, seqs, seq_len, cfg.vocab_size, seed=step)
        r = ps.get_data_parallel_rank()
        batch = {k: v[r * local:(r + 1) * local] for k, v in mb.items()}
        g = torch.Generator().manual_seed(step)
        batch["advantages"] = torch.randn(seqs, 1, generator=g)[r * local:(r + 1) * local] * \
            batch["mask"]
        torch.distributed.barrier()
        t0 = time.perf_counter()
        actor.add_old_logprobs(batch)
        actor.update(batch, step)
        torch.distributed.barrier()
        if step:
            times.append(time.perf_counter() - t0)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # MiB (Linux: KiB)
    runtime.shutdown()
    return {"step_s": sum(times) / len(times), "rss_mib": rss}


# ---- throughput and MFU ------------------------------------------------------------------------
# Dense bf16 peak TFLOP/s by device name, most specific first (NVIDIA data sheets, no sparsity).
PEAK_TFLOPS = (("H100 NVL", 835.0), ("H100 PCIe", 756.0), ("H100 SXM", 989.0),
               ("H100 80GB HBM3", 989.0), ("H200", 989.0), ("H800", 989.0), ("GH200", 989.0),
               ("A100", 312.0))


def peak_tflops_of(name: str) -> float | None:
    """Dense bf16 peak of a ``torch.cuda.get_device_name()`` string (None: unknown; a bare
    "H100" is ambiguous between SXM, PCIe and NVL and is not guessed)."""
    for key, tf in PEAK_TFLOPS:
        if key in name:
            return tf
    return None


def peak_flops(arg_tflops: float | None) -> float | None:
    """Peak dense bf16 FLOP/s of this device (None when unknown, e.g. on CPU)."""
    if arg_tflops:
        return arg_tflops * 1e12
    if not torch.cuda.is_available():
        return None
    tf = peak_tflops_of(torch.cuda.get_device_name())
    return None if tf is None else tf * 1e12


def model_flops(cfg, seqs: int, seq_len: int, attention_factor: int = 6) -> float:
    """Training FLOPs of one pass over ``seqs x seq_len`` tokens (see module docstring).

    ``attention_factor``: 6 counts the causal half of the ``S x S`` scores (6·L·S²·d, the work
    done); 12 counts the full square (12·L·S²·d, Megatron-LM's / PaLM's convention, which most
    published MFU numbers use). The table prints both."""
    head = cfg.head_dim or cfg.hidden_size // cfg.num_attention_heads
    heads_dim, kv_dim = cfg.num_attention_heads * head, cfg.num_key_value_heads * head
    h, f, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    per_layer = h * (heads_dim + 2 * kv_dim) + heads_dim * h + 3 * h * f
    params = layers * per_layer + cfg.vocab_size * h  # + output head (tied or not)
    tokens = seqs * seq_len
    attention = attention_factor * layers * seq_len * seq_len * heads_dim * seqs
    return 6.0 * params * tokens + attention


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _peak_mem_gib() -> float:
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def _mfu_batch(seqs: int, seq_len: int, vocab: int, seed: int = 0) -> dict:
    """Random tokens; every position after the first is a response token."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (seqs, seq_len), generator=g)
    mask = torch.ones(seqs, seq_len, dtype=torch.bool)
    mask[:, 0] = False
    adv = torch.randn(seqs, 1, generator=g).expand(seqs, seq_len) * mask
    return {"tokens": tokens, "mask": mask, "advantages": adv.contiguous()}


def _actor_worker(preset: str, seqs: int, seq_len: int, micro: int, fused: bool,
                  recompute: str, precision: str, steps: int) -> dict:
    from megatron_rl.actor.actor import Actor
    from megatron_rl.actor.optim import OptimConfig
    from megatron_rl.actor.train_step import ActorConfig
    from megatron_rl.loss import LossConfig
    from megatron_rl.models.config import get_preset
    from megatron_rl.parallel import runtime

    runtime.init_parallel(tp=1, pp=1, timeout_s=600)
    cfg = get_preset(preset)
    actor = Actor(cfg, ActorConfig(micro_batch_size=micro, fused_logprob_entropy=fused,
                                   recompute=recompute, precision=precision),
                  OptimConfig(lr=1e-6), LossConfig.for_algorithm("dapo"),
                  total_steps=steps + 2, seed=1)
    batch = runtime.move_batch_(_mfu_batch(seqs, seq_len, cfg.vocab_size), runtime.device())
    actor.add_old_logprobs(batch)
    times = []
    for step in range(steps + 1):  # step 0 warms up kernels and allocator
        _sync()
        t0 = time.perf_counter()
        actor.update(batch, step)
        _sync()
        if step:
            times.append(time.perf_counter() - t0)
    out = {"s": min(times), "mem": _peak_mem_gib()}
    runtime.shutdown()
    return out


def _anchor_worker(preset: str, seqs: int, seq_len: int, micro: int, steps: int) -> dict:
    """transformers Qwen2 + SDPA, bf16 (fp32 on CPU), forward + backward with cross-entropy."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from megatron_rl.convert.registry import hf_config_dict
    from megatron_rl.models.config import get_preset

    cfg = get_preset(preset)
    fields = hf_config_dict(cfg)
    model_type = fields.pop("model_type")
    fields.pop("architectures", None)
    conf = AutoConfig.for_model(model_type, **fields)
    conf._attn_implementation = "sdpa"
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(conf, attn_implementation="sdpa")
    model = model.to(dev, torch.bfloat16).train()
    tokens = _mfu_batch(seqs, seq_len, cfg.vocab_size)["tokens"].to(dev)
    times = []
    for step in range(steps + 1):
        _sync()
        t0 = time.perf_counter()
        for i in range(0, seqs, micro):
            ids = tokens[i:i + micro]
            logits = model(input_ids=ids).logits
            loss = torch.nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1))
            loss.backward()
        model.zero_grad(set_to_none=True)
        _sync()
        if step:
            times.append(time.perf_counter() - t0)
    return {"s": min(times), "mem": _peak_mem_gib()}


def mfu_table(presets: list[str], seqs: int, seq_len: int, micro: int, steps: int,
              precision: str, peak_tflops: float | None) -> None:
    """Print tokens/s per GPU and MFU for the actor variants and the transformers anchor."""
    from megatron_rl.models.config import get_preset

    peak = peak_flops(peak_tflops)
    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    print(f"device={dev} batch={seqs}x{seq_len} micro={micro} precision={precision} "
          f"timed steps={steps} (+1 warm-up, best kept); peak="
          f"{peak / 1e12 if peak else float('nan'):.0f} TFLOP/s")
    print("MFU(6) counts causal attention as 6·L·S²·d (the work done); MFU(12) as 12·L·S²·d "
          "(Megatron-LM/PaLM convention, used by most published numbers)")
    print(f"{'model':>14} {'variant':>26} {'tokens/s':>10} {'MFU(6)':>7} {'MFU(12)':>8} "
          f"{'peak mem GiB':>13}")
    variants = [(f"actor fused={f} recompute={r}", (f, r)) for f in (True, False)
                for r in ("none", "full")] + [("transformers+sdpa anchor", None)]
    for preset in presets:
        flops = model_flops(get_preset(preset), seqs, seq_len)
        flops12 = model_flops(get_preset(preset), seqs, seq_len, attention_factor=12)
        for label, v in variants:
            try:
                if v is None:
                    (res,) = spawn(_anchor_worker, 1, (preset, seqs, seq_len, micro, steps),
                                   timeout_s=1200)
                else:
                    (res,) = spawn(_actor_worker, 1, (preset, seqs, seq_len, micro, v[0], v[1],
                                                      precision, steps), timeout_s=1200)
            except Exception as exc:  # noqa: BLE001 - an OOM in one variant is a table row
                msg = str(exc).strip().splitlines()[-1][:60]
                print(f"{preset:>14} {label:>26} failed: {msg}", flush=True)
                continue
            tps = seqs * seq_len / res["s"]
            mfu = f"{100 * flops / res['s'] / peak:6.1f}%" if peak else "     -"
            mfu12 = f"{100 * flops12 / res['s'] / peak:7.1f}%" if peak else "      -"
            print(f"{preset:>14} {label:>26} {tps:>10.0f} {mfu:>7} {mfu12:>8} "
                  f"{res['mem']:>13.2f}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--layouts", nargs="+", default=["1x1x1", "2x1x1", "1x2x1", "2x2x1", "1x1x2"],
                   help="TPxPPxDP layouts")
    p.add_argument("--seqs", type=int, default=8, help="sequences per RL step (global)")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up step")
    p.add_argument("--model", default="tiny")
    p.add_argument("--loss", default="dapo")
    p.add_argument("--mfu", action="store_true", help="tokens/s and MFU table (one GPU)")
    p.add_argument("--small", action="store_true",
                   help="the --mfu table for a tiny shape (CPU, < 1 minute)")
    p.add_argument("--presets", nargs="+", default=["qwen2.5-0.5b", "qwen2.5-1.5b"])
    p.add_argument("--micro", type=int, default=1, help="sequences per micro-batch (--mfu)")
    p.add_argument("--precision", default="bf16", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--peak-tflops", type=float, default=None)
    a = p.parse_args()
    if a.small:
        mfu_table(["tiny"], 2, 64, a.micro, 2, a.precision, a.peak_tflops)
        return
    if a.mfu:
        mfu_table(a.presets, 4, 4096, a.micro, a.steps, a.precision, a.peak_tflops)
        return
    print(f"model={a.model} loss={a.loss} batch={a.seqs}x{a.seq_len} steps={a.steps} "
          f"(+1 warm-up); old-policy pass + update per step; 1 thread per rank")
    print(f"{'layout':>8} {'ranks':>5} {'s/step':>8} {'peak RSS/rank (MiB)':>20}")
    for lay in a.layouts:
        tp, pp, dp = (int(x) for x in lay.split("x"))
        res = spawn(_worker, tp * pp * dp, (tp, pp, dp, a.seqs, a.seq_len, a.steps, a.model,
                                            a.loss), timeout_s=900)
        print(f"{lay:>8} {tp * pp * dp:>5} {max(r['step_s'] for r in res):>8.3f} "
              f"{max(r['rss_mib'] for r in res):>20.0f}", flush=True)


if __name__ == "__main__":
    main()
