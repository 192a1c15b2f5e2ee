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
                              seq_mask_low=0.9, seq_mask_high=1.1),
              # issue 44: BAPO's bounds searched over the mini-batch (at the first update the
              # search's ratio is 1: pos/neg = 20.5/11 < target, so it runs to both maxima) and
              # SIREN's peak-entropy selection over the vocab-parallel entropies
              "bapo": dict(bapo_target=2.5, bapo_low_start=0.7, bapo_low_max=0.95,
                           bapo_low_step=0.05, bapo_high_start=1.05, bapo_high_max=1.5,
                           bapo_high_step=0.05),
              "siren": dict(siren_coef=0.5, siren_quantile=0.6, siren_anchor=3.0),
              # + the top-p vocabulary mask: the nucleus threshold searched over the TP shards
              "siren_top_p": dict(siren_coef=0.5, siren_quantile=0.6, siren_anchor=1.0,
                                  siren_top_p=0.8)}


def loss_config(name: str | None = None):
    from megatron_rl.loss import LossConfig

    if name is not None:
        return LossConfig.for_algorithm(name.removesuffix("_top_p"), **NEW_LOSSES[name])
    # DAPO clip-higher + Clip-Cov; bounds wide enough that tokens get selected on a tiny batch.
    return LossConfig.for_algorithm("clip_cov", clip_ratio_low=0.2, clip_ratio_high=0.28,
                                    clip_cov_ratio=0.05, clip_cov_lb=-100.0, clip_cov_ub=100.0,
                                    cov_stat_source="prepass")


def _update_worker(tp: int, pp: int, dp: int, steps: int, fused: bool = False,
                   loss: str | None = None, runtime_up: bool = False) -> dict | None:
    from megatron.core import parallel_state as ps

    from megatron_rl.actor.actor import Actor
    from megatron_rl.actor.optim import OptimConfig
    from megatron_rl.actor.train_step import ActorConfig
    from megatron_rl.models.config import get_preset
    from megatron_rl.models.weights import gather_full_state_dict
    from megatron_rl.parallel import runtime

    if not runtime_up:
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
    collapse = collapse_part(actor) if loss == "gmpo" else None  # one model is enough
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
        if collapse is not None:
            out["collapse"] = collapse
    if torch.distributed.get_rank() == 0:
        out = dict(out or {}, state=state)
    if not runtime_up:
        runtime.shutdown()
    return out


def collapse_records() -> list[dict]:
    """Three episode groups of two samples each: prompt and first reply token ids (issue 44)."""
    g = torch.Generator().manual_seed(5)
    recs = []
    for uid in range(3):
        prompt = torch.randint(1, VOCAB, (4 + uid,), generator=g).tolist()
        for _ in range(2):
            reply = torch.randint(1, VOCAB, (3,), generator=g).tolist() + [0]  # 0: EOS
            recs.append({"uid": uid, "prompt_ids": prompt, "response_ids": reply,
                         "turn_ends": [3]})
    return recs


def collapse_part(actor) -> dict[str, float]:
    """RAGEN-2 collapse metrics of :func:`collapse_records` with ``actor`` (every rank holds all
    rows: DP = 1), on the last stage."""
    from megatron_rl.metrics.collapse import (
        collapse_metrics,
        cross_rows,
        first_turn_pair,
        plan_pairs,
    )

    pairs = [first_turn_pair(r, 0, "reply", [], []) for r in collapse_records()]
    inputs, samples, plan = plan_pairs(pairs, max_inputs=8)
    return collapse_metrics(actor, cross_rows(inputs, samples, 0, 2), plan)


def _losses_worker(tp: int, pp: int, fused: bool, losses: tuple[str, ...]) -> dict:
    """One process group, one actor per loss in turn (one start-up for all of them)."""
    from megatron_rl.parallel import runtime

    runtime.init_parallel(tp=tp, pp=pp, dp=1, timeout_s=120)
    out = {loss: _update_worker(tp, pp, 1, 1, fused, loss, runtime_up=True) for loss in losses}
    runtime.shutdown()
    return out


def run_losses(tp: int, pp: int, fused: bool) -> dict[str, dict]:
    """``{loss: {"history", "state"}}`` of every :data:`NEW_LOSSES` entry at TP x PP."""
    merged: dict[str, dict] = {loss: {} for loss in NEW_LOSSES}
    for r in spawn(_losses_worker, tp * pp, (tp, pp, fused, tuple(sorted(NEW_LOSSES))),
                   timeout_s=600):
        for loss, part in r.items():
            merged[loss].update(part or {})
    return merged


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


@pytest.fixture(scope="module")
def new_loss_runs():
    """TP1xPP1 and TP2xPP2 (fused head) runs of every new loss: one spawn per layout."""
    return run_losses(1, 1, False), run_losses(2, 2, True)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_collapse_metrics_are_layout_invariant(new_loss_runs):
    """The cross-scoring pass (every reply under every prompt) through the actor's forward at
    TP2xPP2 gives the TP1xPP1 collapse statistics."""
    ref, got = (runs["gmpo"]["collapse"] for runs in new_loss_runs)
    assert ref["collapse/inputs"] == 3 and ref["collapse/samples"] == 6
    assert ref["collapse/mi_estimate"] != 0.0 and sorted(got) == sorted(ref)
    for k, v in ref.items():
        assert got[k] == pytest.approx(v, rel=1e-5, abs=1e-5), k


# what shows each loss's mechanism acting on this batch
BITES = {"gmpo": ("policy/clip_frac", "rollout_corr/masked_frac"),
         "dppo_kl": ("policy/clip_frac", "rollout_corr/masked_frac"),
         "bapo": ("policy/clip_frac",), "siren": ("siren/selected_frac",),
         "siren_top_p": ("siren/selected_frac",)}


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("loss", sorted(NEW_LOSSES))
def test_new_loss_update_is_layout_invariant(new_loss_runs, loss):
    """GMPO (sequence-level) with IcePop, DPPO-KL (masking) with seq_mask_tis, BAPO (bounds
    searched over the mini-batch) and SIREN (global peak-entropy selection over vocab-parallel
    entropies, anchored): TP2xPP2 with the fused head vs TP1xPP1."""
    ref, got = (runs[loss] for runs in new_loss_runs)
    ref_h, got_h = ref["history"], got["history"]
    assert ref_h[0]["actor/skipped"] == 0.0
    for key in BITES[loss]:  # the clip / mask / selection is exercised
        assert 0 < ref_h[0][key] < 1, (key, ref_h[0][key])
    if loss == "bapo":  # the search moved both bounds off their starts
        assert ref_h[0]["bapo/clip_low"] == pytest.approx(0.95)
        assert ref_h[0]["bapo/clip_high"] == pytest.approx(1.5)
    if loss.startswith("siren"):
        assert ref_h[0]["siren/gap"] != 0.0
    if loss == "siren_top_p":  # the nucleus entropy, not the full-vocabulary one
        full = new_loss_runs[0]["siren"]["history"][0]["policy/entropy"]
        assert 0 < ref_h[0]["policy/entropy"] < full - 0.05, (ref_h[0]["policy/entropy"], full)
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
