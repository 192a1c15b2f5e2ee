"""The critic honours ``actor.precision`` (issue 21): in bf16 (and fp16) it runs megatron's
``Float16Module`` (value head included; its output is upcast to fp32) with fp32 gradient buffers
and fp32 main weights in the mixed-precision optimizer, like the actor. Against the fp32 critic
on the same weights and batches over two updates, value-loss metrics agree to 2e-2 relative
(measured: 5e-3) and the values after the first update to 5e-2 relative L2 (measured: 7e-3; bf16
rounds the hidden states to 8 mantissa bits). A bf16 critic resumes bit-exactly."""

import torch
from test_critic_layout import ROWS, make_batch

from megatron_rl.parallel.launch import spawn


def _critic(precision: str):
    from megatron_rl.actor.train_step import ActorConfig
    from megatron_rl.config.sections import CriticSection
    from megatron_rl.critic.critic import Critic
    from megatron_rl.models.config import get_preset

    return Critic(get_preset("tiny"), CriticSection(lr=1e-2, gamma=0.95, lam=0.9,
                                                     cliprange_value=0.5),
                  ActorConfig(micro_batch_size=2, mini_batch_size=ROWS, precision=precision),
                  total_steps=3, seed=5)


def _worker(ckpt: str) -> dict:
    from megatron_rl.actor.precision import main_param_pairs
    from megatron_rl.parallel import runtime

    runtime.init_parallel(tp=1, pp=1, timeout_s=120)
    out = {}
    for precision in ("fp32", "bf16", "fp16"):
        critic = _critic(precision)
        seen = []
        for step in range(2):
            batch = critic.add_advantages(make_batch())
            hist = critic.update(batch, step)
            seen.append({"values": batch["values"].clone(), "metrics": hist[-1]})
        model = critic.model
        out[precision] = {
            "seen": seen,
            "weights": sorted({str(p.dtype) for p in model.parameters()}),
            "values_dtype": str(seen[0]["values"].dtype),
            "main_grads": sorted({str(p.main_grad.dtype) for p in model.parameters()}),
            "fp32_mains": len(main_param_pairs(critic.optimizer)),
        }
        if precision == "bf16":  # save, step, resume into a fresh critic, redo the step
            critic.save(ckpt, 1)
            critic.update(critic.add_advantages(make_batch()), 2)
            fresh = _critic("bf16")
            assert fresh.resume(ckpt)
            fresh.update(fresh.add_advantages(make_batch()), 2)
            out["resume"] = (critic.values(make_batch()), fresh.values(make_batch()))
    runtime.shutdown()
    return out


def test_bf16_critic_is_mixed_precision_and_tracks_fp32(tmp_path):
    (out,) = spawn(_worker, 1, (str(tmp_path / "ckpt"),), timeout_s=400)
    f32 = out["fp32"]
    assert f32["weights"] == ["torch.float32"] and f32["fp32_mains"] == 0
    for half in ("bf16", "fp16"):  # fp16: the loss is scaled, the optimizer unscales
        b16 = out[half]
        assert b16["weights"] == [f"torch.{'bfloat16' if half == 'bf16' else 'float16'}"]
        assert b16["main_grads"] == ["torch.float32"] and b16["values_dtype"] == "torch.float32"
        assert b16["fp32_mains"] > 0  # fp32 main weights for the half-precision ones
        for a, b in zip(f32["seen"], b16["seen"]):
            for key in ("critic/vf_loss", "critic/grad_norm"):
                x, y = a["metrics"][key], b["metrics"][key]
                assert abs(x - y) <= 2e-2 * max(1.0, abs(x)), (half, key, x, y)
        va, vb = f32["seen"][1]["values"], b16["seen"][1]["values"]
        assert va.abs().sum() > 0  # the first update moved the (zero-initialised) head
        gap = float((va - vb).norm() / va.norm())
        assert gap <= 5e-2, (half, gap)
    before, after = out["resume"]
    assert torch.equal(before, after)
