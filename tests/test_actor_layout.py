"""Layout invariance of a whole actor update (issue 4): one RL step with 2 micro-batches per rank,
token-mean DAPO loss with Clip-Cov, from identical weights and batch, at TP1xPP1xDP1, TP2, PP2,
TP2xPP2 and DP2 gives the same updated weights and the same metrics."""

import pytest
import torch

from megatron_rl.parallel.launch import spawn

GLOBAL_SEQS, SEQ, VOCAB = 4, 20, 256


def make_global_batch(seed: int = 0) -> dict:
    """Prompt + right-padded response rows, per-sequence advantages, old-logp noise."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (GLOBAL_SEQS, SEQ), generator=g)
    mask = torch.zeros(GLOBAL_SEQS, SEQ, dtype=torch.bool)
    for b, (p, r) in enumerate([(3, 12), (5, 9), (2, 17), (6, 4)]):
        mask[b, p:p + r] = True
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])[:, None].expand(GLOBAL_SEQS, SEQ).contiguous()
    noise = 0.3 * torch.randn(GLOBAL_SEQS, SEQ, generator=g)
    return {"tokens": tokens, "mask": mask, "advantages": adv * mask, "old_noise": noise}


# the 2025-26 losses (issue 23), bounds narrow enough that clips/masks act on this batch, each
# with an off-policy correction (behaviour = the actor's own log-probs, proximal = them + noise)
NEW_LOSSES = {"gmpo": dict(gmpo_clip_low=0.1, gmpo_clip_high=0.1, rollout_correction="icepop",
                           icepop_low=0.8, icepop_high=1.25),
              "dppo_kl": dict(dppo_kl_delta_low=1e-4, dppo_kl_delta_high=1e-4,  # q ~ 1/256
                              rollout_correction="seq_mask_tis", rollout_correction_threshold=1.3,
                              seq_mask_low=0.9, seq_mask_high=1.1)}


def loss_config(name: str | None = None):
    from megatron_rl.loss import LossConfig

    if name is not None:
        return LossConfig.for_algorithm(name, **NEW_LOSSES[name])
    # DAPO clip-higher + Clip-Cov; bounds wide enough that tokens get selected on a tiny batch.
    return LossConfig.for_algorithm("clip_cov", clip_ratio_low=0.2, clip_ratio_high=0.28,
                                    clip_cov_ratio=0.05, clip_cov_lb=-100.0, clip_cov_ub=100.0,
                                    cov_stat_source="prepass")


def _update_worker(tp: int, pp: int, dp: int, steps: int, fused: bool = False,
                   loss: str | None = None) -> dict | None:
    from megatron.core import parallel_state as ps

    from megatron_rl.actor.actor import Actor
    from megatron_rl.actor.optim import OptimConfig
    from megatron_rl.actor.train_step import ActorConfig
    from megatron_rl.models.config import get_preset
    from megatron_rl.models.weights import gather_full_state_dict
    from megatron_rl.parallel import runtime

    runtime.init_parallel(tp=tp, pp=pp, dp=dp, timeout_s=120)
    full = make_global_batch()
    rows = slice(ps.get_data_parallel_rank() * GLOBAL_SEQS // dp,
                 (ps.get_data_parallel_rank() + 1) * GLOBAL_SEQS // dp)
    batch = {k: v[rows] for k, v in full.items()}
    noise = batch.pop("old_noise")
    actor = Actor(get_preset("tiny"), ActorConfig(micro_batch_size=GLOBAL_SEQS // dp // 2,
                                                  fused_logprob_entropy=fused),
                  OptimConfig(lr=1e-3, adam_eps=1e-6, clip_grad=1.0), loss_config(loss),
                  total_steps=steps, seed=7)
    history = []
    for step in range(steps):
        actor.add_old_logprobs(batch)
        if "old_logp" in batch:  # last stage: pretend the rollout policy lagged a little
            if loss is not None:  # the engine's log-probs: the actor's before the lag
                batch["rollout_logp"] = batch["old_logp"].clone()
            batch["old_logp"] = batch["old_logp"] + noise * batch["mask"]
        history += actor.update(batch, step)
    state = gather_full_state_dict(actor.model)
    out = None
    if ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0 and \
            ps.get_data_parallel_rank() == 0:
        out = {"history": history}
    if torch.distributed.get_rank() == 0:
        out = dict(out or {}, state=state)
    runtime.shutdown()
    return out


def run(tp: int, pp: int, dp: int, steps: int = 1, fused: bool = False,
        loss: str | None = None) -> dict:
    merged: dict = {}
    for r in spawn(_update_worker, tp * pp * dp, (tp, pp, dp, steps, fused, loss),
                   timeout_s=400):
        merged.update(r or {})
    return merged


@pytest.fixture(scope="module")
def reference():
    return run(1, 1, 1)


def _max_rel(a: dict, b: dict) -> float:
    """Relative L2 distance of two whole state dicts, ||a - b|| / ||b||."""
    assert set(a) == set(b)
    diff = sum(float((a[k].double() - b[k].double()).pow(2).sum()) for k in a) ** 0.5
    return diff / sum(float(b[k].double().pow(2).sum()) for k in b) ** 0.5


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("tp,pp,dp,fused", [(2, 1, 1, False), (1, 2, 1, False),
                                            (2, 2, 1, False), (1, 1, 2, False), (2, 2, 1, True)])
def test_update_is_layout_invariant(reference, tp, pp, dp, fused):
    """The last case also swaps in the fused head (torch reference of kernels.fused_head)."""
    got = run(tp, pp, dp, fused=fused)
    ref_h, got_h = reference["history"], got["history"]
    assert ref_h[0]["clip_cov/num_selected"] >= 1  # the Clip-Cov path is exercised
    assert ref_h[0]["actor/skipped"] == 0.0
    assert _max_rel(got["state"], reference["state"]) < 1e-5
    for k, v in ref_h[0].items():
        if k == "actor/tokens_per_micro_batch":  # the micro-batch shape is part of the layout
            continue
        assert got_h[0][k] == pytest.approx(v, rel=1e-5, abs=1e-6), k


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("loss", sorted(NEW_LOSSES))
def test_new_loss_update_is_layout_invariant(loss):
    """GMPO (sequence-level) with IcePop and DPPO-KL (masking) with seq_mask_tis: TP2xPP2 with
    the fused head vs TP1xPP1."""
    ref, got = run(1, 1, 1, loss=loss), run(2, 2, 1, fused=True, loss=loss)
    ref_h, got_h = ref["history"], got["history"]
    assert ref_h[0]["actor/skipped"] == 0.0
    assert 0 < ref_h[0]["policy/clip_frac"] < 1  # the clip / trust-region mask is exercised
    assert 0 < ref_h[0]["rollout_corr/masked_frac"] < 1  # and the correction's mask
    assert _max_rel(got["state"], ref["state"]) < 1e-5
    for k, v in ref_h[0].items():
        if k == "actor/tokens_per_micro_batch":  # the micro-batch shape is part of the layout
            continue
        assert got_h[0][k] == pytest.approx(v, rel=1e-5, abs=1e-6), k


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_update_changes_weights(reference):
    """Negative control for the comparison above: the update moved the weights."""
    from megatron_rl.models.config import get_preset

    init = run_init_state(get_preset("tiny"))
    assert _max_rel(init, reference["state"]) > 1e-4


def _init_worker() -> dict:
    from megatron_rl.models.builder import build_gpt_model
    from megatron_rl.models.config import get_preset
    from megatron_rl.models.weights import gather_full_state_dict
    from megatron_rl.parallel import runtime

    runtime.init_parallel(1, 1, timeout_s=60)
    state = gather_full_state_dict(build_gpt_model(get_preset("tiny"), seed=7))
    runtime.shutdown()
    return state


def run_init_state(_cfg) -> dict:
    return spawn(_init_worker, 1, timeout_s=120)[0]
