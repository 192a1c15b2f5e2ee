"""Run config: YAML + overrides, unknown keys with suggestions, typed values, cross-field checks."""

import pytest

from megatron_rl.config import ConfigError, load_config, parse_overrides


def test_defaults_and_overrides(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("trainer: {total_steps: 5}\nloss: {algorithm: clip_cov}\n")
    cfg = load_config(str(p), ["trainer.seed=7", "output_dir=/tmp/x", "rollout.top_p=0.9",
                               "loss.overrides={clip_cov_ratio: 0.01}"])
    assert cfg.trainer.total_steps == 5 and cfg.trainer.seed == 7
    assert cfg.trainer.output_dir == "/tmp/x" and cfg.rollout.top_p == 0.9
    assert cfg.loss.build().clip_cov_ratio == 0.01


def test_example_configs_load():
    import glob

    paths = sorted(glob.glob("examples/*.yaml"))
    assert paths
    for path in paths:
        load_config(path)


@pytest.mark.parametrize("override,needle", [
    (["trainer.totl_steps=3"], "unknown config key 'trainer.totl_steps'; did you mean "
                               "'total_steps'"),
    (["trainr.seed=3"], "unknown config key 'trainr'; did you mean 'trainer'"),
    (["trainer.seed=abc"], "trainer.seed must be an integer"),
    (["rollout.dynamic_sampling=3"], "rollout.dynamic_sampling must be true or false"),
    (["loss.algorithm=nope"], "unknown algorithm preset 'nope'"),
    (["trainer.advantage=ppo"], "trainer.advantage='ppo' is not one of"),
    (["actor.micro_batch_size=0"], "actor.micro_batch_size must be >= 1"),
    (["optim.lr_decay_style=step"], "optim.lr_decay_style='step' is not one of"),
    (["model.preset=gpt5"], "model preset 'gpt5' is unknown"),
    (["data.split_by=x"], "data.split_by='x' is not one of"),
    (["parallel.dp=3"], "divisible by parallel.dp=3"),
])
def test_bad_values(override, needle):
    with pytest.raises(Exception, match=needle.replace("(", r"\(").replace(")", r"\)")):
        load_config(None, override)


def test_bad_override_syntax_and_missing_file():
    with pytest.raises(ConfigError, match="must look like key=value"):
        parse_overrides(["trainer.seed"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("/nonexistent.yaml")
