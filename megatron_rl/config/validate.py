"""Cross-field checks of a loaded run config; every message names the field and the allowed
values."""

from __future__ import annotations

from megatron_rl.config.checks import ADVANTAGES
from megatron_rl.config.errors import ConfigError
from megatron_rl.config.sections import ParallelSection, RunConfig


def validate_run_config(cfg: RunConfig) -> None:
    """Cross-field checks; every message names the field and the allowed values."""
    from megatron_rl.convert.model_source import ModelSourceError, validate_model_section
    from megatron_rl.models.config import ModelConfigError

    try:
        validate_model_section(cfg.model, cfg.parallel.tp, cfg.parallel.pp)
    except (ModelSourceError, ModelConfigError) as exc:
        raise ConfigError(str(exc)) from exc
    for old, new in (("prompt_field", "prompt_key"), ("answer_field", "answer_key")):
        if getattr(cfg.data, old) is not None:
            raise ConfigError(f"data.{old} was renamed data.{new}; use data.{new}="
                              f"{getattr(cfg.data, old)!r}")
    if cfg.data.max_prompt_length < 0:
        raise ConfigError(f"data.max_prompt_length must be >= 0 (0 = no limit), got "
                          f"{cfg.data.max_prompt_length}")
    cfg.loss.build()
    validate_parallel_section(cfg.parallel)
    if cfg.trainer.advantage not in ADVANTAGES:
        raise ConfigError(f"trainer.advantage={cfg.trainer.advantage!r} is not one of "
                          f"{ADVANTAGES}")
    if cfg.rollout.engine not in ("embedded", "sglang"):
        raise ConfigError(f"rollout.engine={cfg.rollout.engine!r} is not one of "
                          "('embedded', 'sglang')")
    if cfg.rollout.engine == "sglang":
        from megatron_rl.rollout.fleet import validate_sglang_section

        validate_sglang_section(cfg.rollout.sglang)
    from megatron_rl.run.colocation import validate_colocation

    validate_colocation(cfg)
    for name in ("total_steps", "train_batch_size", "test_freq", "save_freq"):
        if getattr(cfg.trainer, name) < 1:
            raise ConfigError(f"trainer.{name} must be >= 1")
    if cfg.rollout.n < 1 or cfg.rollout.max_new_tokens < 1:
        raise ConfigError("rollout.n and rollout.max_new_tokens must be >= 1")
    if cfg.data.split_by not in ("prompt", "row"):
        raise ConfigError(f"data.split_by={cfg.data.split_by!r} is not one of ('prompt', 'row')")
    if not 0 < cfg.rollout.rv_filter_p <= 1:
        raise ConfigError(f"rollout.rv_filter_p must be in (0, 1], got {cfg.rollout.rv_filter_p}")
    validate_env_critic(cfg)
    rows = cfg.trainer.train_batch_size * cfg.rollout.n
    if rows % cfg.parallel.dp:
        raise ConfigError(f"trainer.train_batch_size x rollout.n = {rows} responses must be "
                          f"divisible by parallel.dp={cfg.parallel.dp}")


def validate_parallel_section(p: ParallelSection) -> None:
    """``parallel.backend`` and the two timeouts."""
    from megatron_rl.parallel.runtime import BACKENDS

    if p.backend not in BACKENDS:
        raise ConfigError(f"parallel.backend={p.backend!r} is not one of {BACKENDS}")
    for name in ("timeout_s", "host_timeout_s"):
        if not getattr(p, name) > 0:
            raise ConfigError(f"parallel.{name} must be > 0 seconds, got {getattr(p, name)}")


def validate_env_critic(cfg: RunConfig) -> None:
    """Checks of the ``env`` and ``critic`` sections (multi-turn runs, GAE)."""
    from megatron_rl.envs import ENVS

    e, c = cfg.env, cfg.critic
    if e.name is not None:
        if e.name not in ENVS:
            raise ConfigError(f"env.name={e.name!r} is not one of {ENVS} (or null)")
        lo = 2 if e.name == "frozenlake" else 5
        hi = 20 if e.name == "sokoban" else 64
        if not lo <= e.size <= hi:
            raise ConfigError(f"env.size={e.size} is out of range for {e.name}: [{lo}, {hi}]")
        if not 0 < e.success_rate <= 1:
            raise ConfigError(f"env.success_rate must be in (0, 1], got {e.success_rate}")
        for name in ("max_turns", "val_size", "boxes", "max_total_tokens"):
            if getattr(e, name) < 1:
                raise ConfigError(f"env.{name} must be >= 1, got {getattr(e, name)}")
        if e.invalid_penalty < 0 or e.step_penalty < 0:
            raise ConfigError("env.invalid_penalty and env.step_penalty must be >= 0")
    elif cfg.trainer.advantage == "gae":
        raise ConfigError("trainer.advantage='gae' needs a multi-turn environment (set env.name "
                          f"to one of {('frozenlake', 'sokoban')})")
    if not (0 <= c.gamma <= 1 and 0 <= c.lam <= 1):
        raise ConfigError(f"critic.gamma and critic.lam must be in [0, 1], got {c.gamma}, {c.lam}")
    if not c.cliprange_value > 0 or not c.lr > 0:
        raise ConfigError("critic.cliprange_value and critic.lr must be > 0")
    am = cfg.actor.mini_batch_size
    if c.mini_batch_size and (not am or am % c.mini_batch_size):
        raise ConfigError(f"critic.mini_batch_size={c.mini_batch_size} must divide "
                          f"actor.mini_batch_size={am} (rows are padded to the actor's "
                          "mini-batch); 0 = the actor's")
    if c.warmup_steps < 0 or c.ppo_epochs < 1 or c.mini_batch_size < 0:
        raise ConfigError("critic.warmup_steps >= 0, critic.ppo_epochs >= 1 and "
                          "critic.mini_batch_size >= 0 are required")
