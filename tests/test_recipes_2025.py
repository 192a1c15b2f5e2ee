"""The GMPO / SAPO / DPPO recipes load, validate and select the intended loss and its defaults.

(``tests/test_trainer.py::test_example_recipe_runs`` runs every ``examples/tiny_*.yaml`` for two
steps, these three included.)
"""

import pytest

from megatron_rl.config.load import load_config


@pytest.mark.parametrize("recipe,loss,fields", [
    ("gmpo", "gmpo", dict(gmpo_clip_low=0.4, gmpo_clip_high=0.4,
                          loss_agg_mode="seq-mean-token-mean")),
    ("sapo", "sapo", dict(sapo_tau_pos=1.0, sapo_tau_neg=1.05,
                          loss_agg_mode="seq-mean-token-mean")),
    ("dppo", "dppo_tv", dict(dppo_tv_delta_low=0.15, dppo_tv_delta_high=0.15,
                             dppo_ratio_cap=20.0, loss_agg_mode="token-mean"))])
def test_recipe_loads_with_the_references_defaults(recipe, loss, fields):
    cfg = load_config(f"examples/tiny_{recipe}.yaml")
    lc = cfg.loss.build()
    assert lc.policy_loss == loss
    for k, v in fields.items():
        assert getattr(lc, k) == v, k
    # two optimizer steps per RL step, so the second update is off-policy and the loss's
    # clip / gate / trust region is exercised (on-policy every one of these losses is plain PG)
    assert 0 < cfg.actor.mini_batch_size < cfg.trainer.train_batch_size * cfg.rollout.n


def test_dppo_kl_variant_and_bad_override_fail_at_load_time():
    cfg = load_config("examples/tiny_dppo.yaml", ["loss.algorithm=dppo_kl"])
    assert cfg.loss.build().policy_loss == "dppo_kl"
    from megatron_rl.config.errors import ConfigError
    with pytest.raises(ConfigError, match=r"sapo_tau_neg=0 is out of range; allowed: \(0, inf\)"):
        load_config("examples/tiny_sapo.yaml", ["loss.overrides={sapo_tau_neg: 0}"])
