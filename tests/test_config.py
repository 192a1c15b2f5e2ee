"""Run config: YAML + overrides, unknown keys with suggestions, typed values, cross-field checks."""

import pytest

from megatron_rl.config.errors import ConfigError
from megatron_rl.config.load import load_config, parse_overrides


def test_defaults_and_overrides(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("trainer: {total_steps: 5}\nloss: {algorithm: clip_cov}\n")
    cfg = load_config(str(p), ["trainer.seed=7", "output_dir=/tmp/x", "rollout.top_p=0.9",
                               "loss.overrides={clip_cov_ratio: 0.01}"])
    assert cfg.trainer.total_steps == 5 and cfg.trainer.seed == 7
    assert cfg.trainer.output_dir == "/tmp/x" and cfg.rollout.top_p == 0.9
    assert cfg.loss.build().clip_cov_ratio == 0.01


def test_example_configs_load(tmp_path):
    import glob

    import yaml

    paths = sorted(glob.glob("examples/*.yaml"))
    assert paths
    for path in paths:
        raw = yaml.safe_load(open(path))
        extra = []
        if raw.get("model", {}).get("hf_path"):  # the tiny HF model the example's comment makes
            from megatron_rl.testing.tiny_hf import make_tiny_hf

            made = make_tiny_hf(str(tmp_path))
            extra = [f"model.hf_path={made['model']}", f"data.path={made['data']}"]
        if raw.get("teacher", {}).get("hf_path"):  # the main job's model (tiny_opd.yaml)
            from conftest import make_preset_hf

            extra.append(f"teacher.hf_path={make_preset_hf(str(tmp_path / 'teacher'))}")
        load_config(path, extra)


@pytest.mark.parametrize("override,needle", [
    (["trainer.totl_steps=3"], "unknown config key 'trainer.totl_steps'; did you mean "
                               "'trainer.total_steps'"),
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


# ---- configs that don't lie (issue 11) -----------------------------------------------------------
def test_exponent_numbers_in_yaml_and_overrides(tmp_path):
    """PyYAML reads ``1e-6`` as a string; float fields accept it (and loss override floats)."""
    p = tmp_path / "c.yaml"
    p.write_text("optim: {lr: 1e-6, min_lr: 1e-7}\nloss: {algorithm: clip_cov, overrides: "
                 "{clip_cov_ratio: 2e-4}}\n")
    cfg = load_config(str(p), ["rollout.reward_timeout_s=1e1"])
    assert cfg.optim.lr == 1e-6 and cfg.optim.min_lr == 1e-7
    assert cfg.rollout.reward_timeout_s == 10.0
    assert cfg.loss.build().clip_cov_ratio == 2e-4
    assert load_config(None, ["optim.lr=3e-6"]).optim.lr == 3e-6
    with pytest.raises(ConfigError, match="optim.lr must be a number, got 'fast'"):
        load_config(None, ["optim.lr=fast"])


@pytest.mark.parametrize("override,needle", [
    (["loss.algorithm=dapp"], "unknown algorithm preset 'dapp'; did you mean 'dapo'?"),
    (["loss.overrides={clip_ratio_hgh: 0.3}"], "loss.overrides.clip_ratio_hgh: unknown LossConfig "
                                               "field; did you mean 'clip_ratio_high'?"),
    (["loss.overrides={clip_ratio_low: 2.0}"], "clip_ratio_low=2.0 is out of range"),
    (["trainer.advantage=drgrpo"], "trainer.advantage='drgrpo' was renamed; use "
                                   "trainer.advantage='dr_grpo'"),
    (["trainer.advantage=rlo"], "did you mean 'rloo'?"),
    (["rollout.temperature=0"], "rollout.temperature must be > 0"),
    (["rollout.temperature=-1"], "rollout.temperature must be > 0"),
    (["rollout.top_p=0"], "rollout.top_p must be in (0, 1]"),
    (["rollout.top_p=1.5"], "rollout.top_p must be in (0, 1]"),
    (["rollout.dynamic_sampling=false", "rollout.gen_batch_size=64", "trainer.train_batch_size=8"],
     "applies only with rollout.dynamic_sampling=true"),
    (["rollout.val_temperature=-0.1"], "rollout.val_temperature must be >= 0"),
    (["actor.mini_batch_size=24"], "= 64 responses must be divisible by actor.mini_batch_size=24"),
    (["actor.mini_batch_size=16", "actor.micro_batch_size=3"],
     "actor.mini_batch_size=16 must be divisible by parallel.dp x actor.micro_batch_size"),
    (["actor.mini_batch_size=16", "parallel.dp=2", "actor.micro_batch_size=16"],
     "= 2 x 16 = 32"),
    (["actor.temperature=0.5", "rollout.temperature=0.6"], "actor.temperature=0.5 differs from "
                                                           "rollout.temperature=0.6"),
    (["sft.steps=2", "sft.batch_size=5", "parallel.dp=2"], "sft.batch_size=5 must be divisible"),
    (["model.preset=tinny"], "model preset 'tinny' is unknown; did you mean 'tiny'?"),
    (["data.task=chain_summ"], "data.task='chain_summ' is not a reasoning-gym task; did you "
                               "mean 'chain_sum'?"),
    (["rollout.filter_metric=accuracy"], "rollout.filter_metric='accuracy' is not one of"),
    (["trainer.keep_checkpoints=-1"], "trainer.keep_checkpoints must be >= 0"),
    (["trainer.kl_in_reward_coef=-1"], "trainer.kl_in_reward_coef must be >= 0"),
    (["trainer.kl_in_reward_coef=0.1"], "only used by trainer.advantage='reinforce_pp'"),
    (["optim.lr=[1,"], "is not valid YAML"),
])
def test_load_time_checks(override, needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace(")", r"\)")
                       .replace("[", r"\[").replace("?", r"\?").replace("+", r"\+")):
        load_config(None, override)


def test_malformed_yaml_is_a_config_error(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("trainer: {total_steps: 3\nrollout: {n: 2}\n")
    with pytest.raises(ConfigError, match="malformed YAML at line"):
        load_config(str(p))


def test_one_temperature():
    """The actor's log-prob temperature follows the sampling temperature."""
    cfg = load_config(None, ["rollout.temperature=0.6"])
    assert cfg.actor.temperature == 0.6
    cfg = load_config(None, ["rollout.temperature=0.6", "actor.temperature=0.6"])
    assert cfg.actor.temperature == 0.6


def test_dr_grpo_divides_by_max_response_length():
    """ALGORITHMS.md §3.2: the constant C is the max response length, not the padded length."""
    cfg = load_config(None, ["loss.algorithm=dr_grpo", "rollout.max_new_tokens=7",
                             "trainer.advantage=dr_grpo"])
    assert cfg.loss.build().loss_scale_factor == 7.0
    cfg = load_config(None, ["loss.algorithm=dr_grpo", "loss.overrides={loss_scale_factor: 3}"])
    assert cfg.loss.build().loss_scale_factor == 3.0
    assert load_config(None, []).loss.build().loss_scale_factor is None  # dapo: token-mean


def test_cli_config_errors_exit_2_without_traceback(capsys, tmp_path):
    from megatron_rl.cli.app import main

    bad = tmp_path / "bad.yaml"
    bad.write_text("rollout: [1,\n")
    for argv, needle in ((["train", "loss.algorithm=grp"], "did you mean 'grpo'"),
                         (["train", str(bad)], "malformed YAML"),
                         (["train", "optim.lr=abc"], "optim.lr must be a number"),
                         (["sft", "rollout.top_p=2"], "rollout.top_p must be in (0, 1]")):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and needle in err and "Traceback" not in err
        assert err.count("\n") == 1


def test_cli_train_without_yaml_and_overrides_after_options(capsys):
    from megatron_rl.cli.app import parse_args, split_config_arg

    args = parse_args(["train", "--check", "trainer.seed=3", "optim.lr=1e-6"])
    assert args.check_only and split_config_arg(args.config, args.overrides) == (
        None, ["trainer.seed=3", "optim.lr=1e-6"])
    args = parse_args(["train", "examples/tiny_dapo.yaml", "--check", "trainer.seed=3"])
    assert args.config == "examples/tiny_dapo.yaml" and args.overrides == ["trainer.seed=3"]
    from megatron_rl.cli.app import main

    assert main(["train", "trainer.seed=3", "--check", "optim.lr=1e-6"]) == 0
    assert "built-in recipe + 2 override(s)" in capsys.readouterr().out
