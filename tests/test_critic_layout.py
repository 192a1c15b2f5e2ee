"""The critic (value model on megatron-core) is layout invariant — TP2xPP2 gives the values,
GAE advantages and value-loss metrics of TP1xPP1 over two updates — and resumes bit-exactly from
its checkpoint (issue 15)."""

import pytest
import torch

from megatron_rl.parallel.launch import spawn

ROWS, SEQ = 4, 20


def make_batch() -> dict:
    """Multi-turn-like rows: prompt, reply, env text, reply; turn rewards on each reply's end."""
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(2, 256, (ROWS, SEQ), generator=g)
    mask = torch.zeros(ROWS, SEQ, dtype=torch.bool)
    rewards = torch.zeros(ROWS, SEQ)
    for b, (p, r1, e, r2) in enumerate([(3, 3, 4, 2), (2, 4, 3, 3), (4, 2, 5, 4), (3, 5, 2, 2)]):
        mask[b, p:p + r1] = True
        mask[b, p + r1 + e:p + r1 + e + r2] = True
        rewards[b, p + r1 - 1] = 0.1 * b
        rewards[b, p + r1 + e + r2 - 1] = 1.0 if b % 2 else 0.0
    return {"tokens": tokens, "mask": mask, "token_rewards": rewards,
            "advantages": torch.zeros(ROWS, SEQ)}


def _critic(total_steps: int):
    from megatron_rl.actor.train_step import ActorConfig
    from megatron_rl.config.sections import CriticSection
    from megatron_rl.critic.critic import Critic
    from megatron_rl.models.config import get_preset

    return Critic(get_preset("tiny"), CriticSection(lr=1e-2, gamma=0.95, lam=0.9,
                                                     cliprange_value=0.5),
                  ActorConfig(micro_batch_size=2, mini_batch_size=ROWS), total_steps, seed=5)


def _worker(tp: int, pp: int, ckpt: str | None) -> dict | None:
    from megatron.core import parallel_state as ps

    from megatron_rl.parallel import runtime

    runtime.init_parallel(tp=tp, pp=pp, dp=1, timeout_s=120)
    critic = _critic(total_steps=3)
    seen = []
    for step in range(2):
        batch = critic.add_advantages(make_batch())
        hist = critic.update(batch, step)
        seen.append({k: batch[k].clone() for k in ("values", "returns", "advantages")
                     if k in batch} | {"metrics": hist[-1]})
    out = {"seen": seen}
    if ckpt is not None:  # save, take a third step, then resume into a fresh critic and redo it
        critic.save(ckpt, 1)
        third = critic.add_advantages(make_batch())
        critic.update(third, 2)
        after = critic.values(make_batch())
        fresh = _critic(total_steps=3)
        assert fresh.resume(ckpt)
        again = fresh.add_advantages(make_batch())
        fresh.update(again, 2)
        out["resume"] = (third.get("values"), again.get("values"), after,
                         fresh.values(make_batch()))
    keep = ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0
    runtime.shutdown()
    return out if keep else None


def run(tp: int, pp: int, ckpt: str | None = None) -> dict:
    results = [r for r in spawn(_worker, tp * pp, (tp, pp, ckpt), timeout_s=400) if r]
    assert len(results) == 1
    return results[0]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_critic_tp2_pp2_equals_tp1_pp1_and_resumes_bit_exactly(tmp_path):
    ref = run(1, 1, str(tmp_path / "ckpt"))
    par = run(2, 2)
    for a, b in zip(ref["seen"], par["seen"]):
        for k in ("values", "returns", "advantages"):
            torch.testing.assert_close(a[k], b[k], atol=2e-5, rtol=1e-4)
        for k in ("critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean"):
            assert a["metrics"][k] == pytest.approx(b["metrics"][k], rel=1e-4, abs=1e-6)
    # the second step's values are non-trivial (the zero-initialised head has learned)
    assert ref["seen"][1]["values"].abs().max() > 1e-3
    assert ref["seen"][1]["metrics"]["critic/vf_loss"] < ref["seen"][0]["metrics"][
        "critic/vf_loss"]
    v_third, v_again, after, after_resumed = ref["resume"]
    assert torch.equal(v_third, v_again) and torch.equal(after, after_resumed)
