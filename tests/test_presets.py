"""Algorithm presets reproduce the recipes they name (issue 23 item 8).

Each row of ``RECIPES`` lists the *effective* loss settings of one named recipe, every knob spelt
out (nothing inherited from ``LossConfig``'s generic defaults), with its source: the ALGORITHMS.md
section and the reference code or script it was read from. A preset that silently inherits a
generic default its recipe lacks (e.g. verl's dual clip c = 3 or the log-ratio clamp +-20) fails.
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_rl.loss import PRESETS, LossConfig, LossInputs, ReductionContext, compute_loss

INF = math.inf
# the knobs every recipe row states explicitly
COMMON = dict(loss_agg_mode="token-mean", clip_ratio_low=0.2, clip_ratio_high=0.2,
              use_kl_loss=False, entropy_coeff=0.0, positive_nll_coef=0.0, erc=False)


def row(policy_loss: str, c: float, clamp: float, **kw) -> dict:
    return {**COMMON, "policy_loss": policy_loss, "clip_ratio_c": c, "log_ratio_clamp": clamp,
            **kw}


RECIPES: dict[str, dict] = {
    # §1 verl compute_policy_loss_vanilla, actor.yaml defaults
    "ppo": row("ppo", 3.0, 20.0),
    # §3.1 DeepSeekMath GRPO objective (plain PPO-clip, sample-level loss, KL in the loss);
    # KL settings from verl docs/algo/grpo.md
    "grpo": row("ppo", INF, INF, loss_agg_mode="seq-mean-token-mean", use_kl_loss=True,
                kl_loss_coef=0.001, kl_loss_type="low_var_kl"),
    # §3.2 Dr.GRPO: sail-sg/oat PPOLearner (plain PPO-clip, no clamp), train_zero_math.py (no KL)
    "dr_grpo": row("ppo", INF, INF, loss_agg_mode="seq-mean-token-sum-norm"),
    # §2.1 DAPO recipe run_dapo_qwen2.5_32b.sh on verl's vanilla loss
    "dapo": row("ppo", 10.0, 20.0, clip_ratio_high=0.28),
    # §5 verl compute_policy_loss_gspo (log s clamped at 10, no dual clip), test_gspo_3b_math.sh
    "gspo": row("gspo", 3.0, 20.0, clip_ratio_low=3e-4, clip_ratio_high=4e-4,
                loss_agg_mode="seq-mean-token-mean", gspo_log_ratio_max=10.0),
    "gspo_token": row("gspo_token", 3.0, 20.0, clip_ratio_low=3e-4, clip_ratio_high=4e-4,
                      loss_agg_mode="seq-mean-token-mean", gspo_log_ratio_max=10.0),
    # §6 verl compute_policy_loss_cispo (clamp 20), run_cispo_qwen2_5_0_5b_gsm8k.sh
    "cispo": row("cispo", 3.0, 20.0, clip_ratio_low=10.0, clip_ratio_high=0.2),
    # §7 KlearReasoner compute_gppo_loss (c = 10, no clamp: the loss ignores log_ratio_clamp)
    "gppo": row("gppo", 10.0, 20.0, clip_ratio_high=0.28, positive_nll_coef=0.1),
    # §8 Archer2.0 compute_policy_loss_archer + run_archer2.0_qwen2.5_1.5b_code.sh
    "aspo": row("aspo", 3.0, 20.0, use_kl_loss=True, kl_loss_coef=0.001,
                kl_loss_type="low_var_kl", aspo_entropy_quantile=0.8, aspo_eps_low_entropy=0.2,
                aspo_eps_high_entropy=0.4, aspo_c_pos=3.0, aspo_c_neg=3.0),
    # §4 Entropy-Mechanism recipe/dapo/{7b,32b}_clip_cov.sh, verl kl_cov defaults (fractions)
    "clip_cov": row("clip_cov", 10.0, 20.0, clip_ratio_low=1.0, clip_ratio_high=1.0,
                    clip_cov_ratio=2e-4, clip_cov_lb=1.0, clip_cov_ub=5.0),
    "kl_cov": row("kl_cov", 10.0, 20.0, kl_cov_ratio=2e-4, kl_cov_coef=1.0),
    # §9 Kwai-Klear/ERC recipe/dapo/*erc_1_05.sh (bounds 0.95/1.05, positive NLL 0.1)
    "dapo_erc": row("ppo", 10.0, 20.0, clip_ratio_high=0.28, erc=True, erc_low=0.95,
                    erc_high=1.05, positive_nll_coef=0.1),
    "gppo_erc": row("gppo", 10.0, 20.0, erc=True, erc_low=0.95, erc_high=1.05,
                    positive_nll_coef=0.1),
    # §10.2 lime-RL/DCPO compute_policy_loss_dcpo (clamp commented out) + run_dcpo.sh
    "dcpo": row("dcpo", 10.0, INF, clip_ratio_high=0.28),
    # §10.1 Skywork-OR1 dp_actor + or1_scripts/train/*.sh: plain PPO-clip, no KL
    "skywork_or1": row("ppo", INF, INF),
    # GMPO: verl compute_policy_loss_geo_mean + the authors' train_zero_math_gmpo.py (log-space
    # clip 0.4, sequence-level aggregation); the dual clip c is unused by this loss
    "gmpo": row("gmpo", 3.0, 20.0, loss_agg_mode="seq-mean-token-mean", gmpo_clip_low=0.4,
                gmpo_clip_high=0.4),
    # SAPO: verl's soft gate, actor.yaml tau_pos 1.0 / tau_neg 1.05, seq-mean-token-mean
    "sapo": row("sapo", 3.0, 20.0, loss_agg_mode="seq-mean-token-mean", sapo_tau_pos=1.0,
                sapo_tau_neg=1.05),
    # DPPO: the authors' run_qwen30b_dppo.sh (TV 0.15, KL 0.05), verl's ratio cap 20, no squared
    # log-ratio term (verl and the paper)
    "dppo_tv": row("dppo_tv", 3.0, 20.0, dppo_tv_delta_low=0.15, dppo_tv_delta_high=0.15,
                   dppo_ratio_cap=20.0, dppo_sq_log_ratio_coef=0.0),
    "dppo_kl": row("dppo_kl", 3.0, 20.0, dppo_kl_delta_low=0.05, dppo_kl_delta_high=0.05,
                   dppo_ratio_cap=20.0, dppo_sq_log_ratio_coef=0.0),
    # BAPO: WooooDyy/BAPO recipe/bapo/config/bapo_trainer.yaml on verl's vanilla loss
    "bapo": row("bapo", 3.0, 20.0, bapo_target=1.0, bapo_low_start=0.6, bapo_low_max=0.8,
                bapo_low_step=0.05, bapo_high_start=1.2, bapo_high_max=2.0,
                bapo_high_step=0.05),
    # SIREN: Linn3a/siren exp_scripts/siren.sh (clip 0.28, entropy_coeff 0.005, mask_ratio 0.8)
    "siren": row("ppo", 3.0, 20.0, clip_ratio_low=0.28, clip_ratio_high=0.28, siren_coef=0.005,
                 siren_quantile=0.8, siren_anchor=None),
}


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_preset_effective_settings_match_the_recipe(name):
    cfg = LossConfig.for_algorithm(name)
    got = {k: getattr(cfg, k) for k in RECIPES[name]}
    assert got == RECIPES[name]


def test_every_preset_has_a_recipe_row():
    missing = sorted(set(PRESETS) - set(RECIPES))
    assert not missing, f"add a RECIPES row (with its source) for the preset(s) {missing}"


def _loss_and_grad(cfg: LossConfig, log_r: list[float], adv: list[float]):
    logp = torch.tensor([log_r], dtype=torch.float64, requires_grad=True)
    old = torch.zeros_like(logp)
    a = torch.tensor([adv], dtype=torch.float64)
    mask = torch.ones_like(a, dtype=torch.bool)
    ctx = ReductionContext.from_minibatch(mask, group=None)
    out = compute_loss(LossInputs(logp, old, a, mask), cfg.validate(), ctx)
    out.loss.backward()
    return out.loss.detach().item(), logp.grad[0].tolist()


def test_skywork_or1_is_plain_ppo_clip():
    """ALGORITHMS.md §10.1: A = -1, r = 5 gives loss 5 and gradient 5 (not the dual clip's 3, 0)."""
    loss, grad = _loss_and_grad(LossConfig.for_algorithm("skywork_or1"), [math.log(5.0)], [-1.0])
    assert loss == pytest.approx(5.0) and grad == pytest.approx([5.0])
    loss, grad = _loss_and_grad(LossConfig.for_algorithm("ppo"), [math.log(5.0)], [-1.0])
    assert loss == pytest.approx(3.0) and grad == pytest.approx([0.0])
    # no log-ratio clamp either: log r = 21 keeps its value and gradient (a clamp at 20 would
    # give e^20 and gradient 0)
    loss, grad = _loss_and_grad(LossConfig.for_algorithm("skywork_or1"), [21.0], [-1.0])
    assert loss == pytest.approx(math.exp(21.0)) and grad == pytest.approx([math.exp(21.0)])


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "skywork_or1"])
def test_plain_ppo_clip_presets_have_no_dual_clip(name):
    """Negative-advantage tokens far above the ratio band keep the gradient -A r (two tokens,
    token-mean or per-sequence aggregation: the gradient of token 0 is r / 2 in every mode)."""
    cfg = LossConfig.for_algorithm(name, loss_scale_factor=2.0, use_kl_loss=False)
    _, grad = _loss_and_grad(cfg, [math.log(4.0), 0.0], [-1.0, 0.0])
    assert grad[0] == pytest.approx(2.0)
