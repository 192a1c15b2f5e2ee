"""Check the planner (megatron_rl/plan/) against the memory the real actor reaches on CPU.

One fresh process per preset (TP1 x PP1 x DP1, fp32, gloo): build the :class:`Actor`, run RL steps
(old-policy pass + update, Adam), and read the process's resident memory from ``/proc/self/status``:

* **static** = ``VmRSS`` after step 1 (weights, gradient buffer and Adam moments exist; the step's
  activations are freed) minus ``VmRSS`` before the actor was built;
* **step peak** = ``VmHWM`` during step 2 (reset through ``/proc/self/clear_refs`` just before it)
  minus the same baseline.

The planner gets the same shape with ``device=cpu`` (SDPA attention, torch's composite RMSNorm
and plain SwiGLU), ``precision=fp32`` and the unfused head.

    python tools/bench_plan_check.py --presets tiny qwen2.5-0.5b moe-check

``moe-check`` is a mixture-of-experts shape small enough for a CPU box (Qwen3-MoE family, hidden
1024, 4 layers, 32 experts, top-8, expert FFN 384, vocab 32768: 229M parameters, 115M active).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _bench_common import reset_peak_rss, rss_kib  # noqa: E402

from megatron_rl.parallel.launch import spawn  # noqa: E402


def _trim() -> None:
    """Give freed heap pages back to the OS (glibc keeps small freed blocks otherwise)."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def _config(preset: str):
    """A registry preset, or ``moe-check`` (see the module docstring)."""
    from megatron_rl.models.config import ModelConfig, get_preset

    if preset == "moe-check":
        return ModelConfig(family="qwen3_moe", vocab_size=32768, hidden_size=1024,
                           intermediate_size=3072, num_hidden_layers=4, num_attention_heads=16,
                           num_key_value_heads=4, head_dim=64, max_position_embeddings=4096,
                           num_experts=32, num_experts_per_tok=8, moe_intermediate_size=384)
    return get_preset(preset)


def _batch(rows: int, prompt: int, response: int, vocab: int, seed: int) -> dict:
    """Every row: ``prompt`` tokens then ``response`` response tokens (mask on those)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (rows, prompt + response), generator=g)
    mask = torch.zeros(rows, prompt + response, dtype=torch.bool)
    mask[:, prompt:] = True
    adv = torch.randn(rows, 1, generator=g) * mask
    return {"tokens": tokens, "mask": mask, "advantages": adv}


def _warm_up(Actor, ActorConfig, OptimConfig, LossConfig, get_preset) -> None:
    """One step of a throwaway tiny actor: lazy imports, thread pools and first-call caches are
    then in the baseline, not in the measured model's numbers."""
    import gc

    cfg = get_preset("tiny")
    actor = Actor(cfg, ActorConfig(micro_batch_size=2, fused_logprob_entropy=False),
                  OptimConfig(lr=1e-5), LossConfig.for_algorithm("dapo"), total_steps=2, seed=1)
    batch = _batch(2, 8, 8, cfg.vocab_size, seed=0)
    actor.add_old_logprobs(batch)
    actor.update(batch, 0)
    del actor, batch
    gc.collect()


def _worker(preset: str, rows: int, micro: int, prompt: int, response: int,
            chunk: int | None) -> dict:
    from megatron_rl.actor.actor import Actor
    from megatron_rl.actor.optim import OptimConfig
    from megatron_rl.actor.train_step import ActorConfig
    from megatron_rl.loss import LossConfig
    from megatron_rl.models.config import get_preset
    from megatron_rl.parallel import runtime

    torch.set_num_threads(1)
    runtime.init_parallel(tp=1, pp=1, dp=1, timeout_s=600)
    cfg = _config(preset)
    warm = rss_kib("VmRSS")
    _warm_up(Actor, ActorConfig, OptimConfig, LossConfig, get_preset)
    _trim()
    base = rss_kib("VmRSS")
    actor = Actor(cfg, ActorConfig(micro_batch_size=micro, logprob_chunk_size=chunk,
                                   fused_logprob_entropy=False),
                  OptimConfig(lr=1e-5), LossConfig.for_algorithm("dapo"), total_steps=4, seed=1)
    built = rss_kib("VmRSS")
    out = {"base_kib": base, "built_kib": built - base, "warm_up_kib": base - warm}
    for step in range(2):
        batch = _batch(rows, prompt, response, cfg.vocab_size, seed=step)
        if step == 1:
            _trim()
            out["peak_reset"] = reset_peak_rss()
        actor.add_old_logprobs(batch)
        actor.update(batch, step)
        if step == 0:
            _trim()
            out["static_kib"] = rss_kib("VmRSS") - base
    out["peak_kib"] = rss_kib("VmHWM") - base
    runtime.shutdown()
    return out


def plan_for(preset: str, rows: int, micro: int, prompt: int, response: int,
             chunk: int | None):
    """The planner's estimate for the same shape."""
    from megatron_rl.plan.inputs import PlanInputs
    from megatron_rl.plan.memory import optimizer_state_bytes, stage_params
    from megatron_rl.plan.report import make_plan

    x = PlanInputs(model=_config(preset), precision="fp32", device="cpu",
                   micro_batch_size=micro, prompt_len=prompt, response_len=response,
                   n_micro=rows // micro, responses_per_step=rows, fused_head=False,
                   head_chunk=chunk)
    plan = make_plan(x)
    static = sum(optimizer_state_bytes(stage_params(x.model, 1, 1, 0), x).values())
    return static, plan.actor_total


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--presets", nargs="+", default=["tiny", "qwen2.5-0.5b"])
    p.add_argument("--rows", type=int, default=4, help="sequences per step")
    p.add_argument("--micro", type=int, default=2, help="sequences per micro-batch")
    p.add_argument("--prompt", type=int, default=192)
    p.add_argument("--response", type=int, default=64)
    p.add_argument("--chunk", type=int, default=None, help="actor.logprob_chunk_size")
    a = p.parse_args()
    print(f"batch {a.rows} x ({a.prompt} prompt + {a.response} response), micro-batch "
          f"{a.micro}, fp32, TP1xPP1xDP1, CPU; MiB above the pre-build baseline")
    print(f"{'preset':<14} {'static meas':>11} {'static plan':>11} {'err':>7} "
          f"{'peak meas':>10} {'peak plan':>10} {'err':>7}")
    for preset in a.presets:
        (res,) = spawn(_worker, 1, (preset, a.rows, a.micro, a.prompt, a.response, a.chunk),
                       timeout_s=1800)
        static_p, peak_p = plan_for(preset, a.rows, a.micro, a.prompt, a.response, a.chunk)
        sm, pm = res["static_kib"] / 1024, res["peak_kib"] / 1024
        sp, pp = static_p / 2 ** 20, peak_p / 2 ** 20
        note = f"  (warm-up/fixed overhead {res['warm_up_kib'] / 1024:.0f} MiB)"
        if not res["peak_reset"]:
            note += "  (VmHWM not resettable: peak since start)"
        print(f"{preset:<14} {sm:>11.1f} {sp:>11.1f} {(sp - sm) / sm:>+7.1%} {pm:>10.1f} "
              f"{pp:>10.1f} {(pp - pm) / pm:>+7.1%}{note}", flush=True)


if __name__ == "__main__":
    main()
