"""Load-time checks of a run config, collected in one place.

Everything that would otherwise be found only after the SFT warm start (or silently do the wrong
thing) is checked here, when the config is loaded: sampling parameters, batch divisibility, names
of algorithms / estimators / loss fields (with the closest known name suggested), the single
temperature, and the constant of the Dr.GRPO aggregation. Every error is one line naming the field
and the allowed values (:class:`~megatron_rl.config.errors.ConfigError`).
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, Mapping

from megatron_rl.config.errors import ConfigError, closest
from megatron_rl.config.eval_sets import normalize_eval_sets
from megatron_rl.config.schema import ADVANTAGES, FILTER_METRICS, check_ranges

RENAMED_ADVANTAGES = {"drgrpo": "dr_grpo"}
SUM_NORM_MODES = ("seq-mean-token-sum-norm", "token-sum-norm")


def _error(msg: str) -> Exception:
    return ConfigError(msg)


def as_float(value: Any) -> Any:
    """``"1e-6"`` -> ``1e-6`` (PyYAML 1.1 reads exponents without a dot as strings); other
    values unchanged."""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


# ---- names ---
def check_advantage(name: str) -> None:
    """``trainer.advantage`` is a known estimator (old names: an error naming the new one)."""
    if name in RENAMED_ADVANTAGES:
        raise _error(f"trainer.advantage={name!r} was renamed; use "
                     f"trainer.advantage={RENAMED_ADVANTAGES[name]!r}")
    if name not in ADVANTAGES:
        raise _error(f"trainer.advantage={name!r} is not one of {ADVANTAGES}"
                     f"{closest(name, ADVANTAGES)}")


def normalize_loss(cfg) -> None:
    """``loss.algorithm`` and ``loss.overrides`` name known presets/fields (closest suggested);
    float fields written as ``1e-6`` become numbers; then the loss config is built (its range
    errors become config errors naming ``loss.overrides.<field>``)."""
    from megatron_rl.loss.config import PRESETS, LossConfig, LossConfigError

    alg = cfg.loss.algorithm
    if alg not in PRESETS:
        raise _error(f"loss.algorithm: unknown algorithm preset {alg!r}{closest(alg, PRESETS)} "
                     f"(allowed: {', '.join(sorted(PRESETS))})")
    hints = typing.get_type_hints(LossConfig)
    known = sorted(f.name for f in dataclasses.fields(LossConfig))
    fixed = {}
    for key, value in cfg.loss.overrides.items():
        if key not in hints:
            raise _error(f"loss.overrides.{key}: unknown LossConfig field{closest(key, known)} "
                         f"(allowed: {', '.join(known)})")
        if hints[key] in (float, float | None):
            value = as_float(value)
        fixed[key] = value
    cfg.loss.overrides = fixed
    try:
        cfg.loss.build()
    except LossConfigError as exc:
        raise _error(f"loss.overrides / loss.algorithm={alg!r}: {exc}") from exc


def check_names(cfg) -> None:
    """``model.preset``, ``data.task`` (reasoning-gym, when no ``data.path``) and
    ``rollout.filter_metric`` are known names (closest suggested)."""
    from megatron_rl.models.config import PRESETS

    p = cfg.model.preset
    if p is not None and p not in PRESETS:
        raise _error(f"model.preset: model preset {p!r} is unknown{closest(p, PRESETS)} "
                     f"(known: {', '.join(sorted(PRESETS))})")
    if cfg.rollout.filter_metric not in FILTER_METRICS:
        raise _error(f"rollout.filter_metric={cfg.rollout.filter_metric!r} is not one of "
                     f"{FILTER_METRICS}{closest(cfg.rollout.filter_metric, FILTER_METRICS)}")
    from megatron_rl.rewards.tasks import PROMPT_BUILDERS

    # the compact-prompt tasks are reasoning-gym tasks (tests/test_rewards.py checks it): no
    # need to import the whole gym (seconds) to know their names
    if not cfg.data.path and cfg.data.task not in PROMPT_BUILDERS:
        from megatron_rl.rewards.tasks import known_tasks

        tasks = known_tasks()
        if cfg.data.task not in tasks:
            raise _error(f"data.task={cfg.data.task!r} is not a reasoning-gym task"
                         f"{closest(cfg.data.task, tasks)} (or set data.path to a "
                         "JSONL/Parquet file)")


# ---- sampling and temperature ---
def check_sampling(cfg) -> None:
    """Temperature > 0, top_p in (0, 1], validation sampling sane."""
    r = cfg.rollout
    if not r.temperature > 0:
        raise _error(f"rollout.temperature must be > 0 (allowed: (0, inf)), got {r.temperature}")
    if not 0 < r.top_p <= 1:
        raise _error(f"rollout.top_p must be in (0, 1], got {r.top_p}")
    if not r.val_temperature >= 0:
        raise _error(f"rollout.val_temperature must be >= 0 (0 = greedy), got "
                     f"{r.val_temperature}")
    if r.val_n < 1:
        raise _error(f"rollout.val_n must be >= 1, got {r.val_n}")
    if r.gen_batch_size < 0:
        raise _error(f"rollout.gen_batch_size must be >= 0 (0 = trainer.train_batch_size), got "
                     f"{r.gen_batch_size}")
    tb = cfg.trainer.train_batch_size
    if not r.dynamic_sampling and r.gen_batch_size not in (0, tb):
        # one round of gen_batch_size prompts would be trained on whole: more rows than the LR
        # schedule and the mini-batch plan assume
        raise _error(f"rollout.gen_batch_size={r.gen_batch_size} applies only with "
                     f"rollout.dynamic_sampling=true; without it set 0 or "
                     f"trainer.train_batch_size ({tb})")


def one_temperature(cfg, raw: Mapping[str, Any]) -> None:
    """The actor's log-prob temperature is the rollout temperature: setting ``actor.temperature``
    to another value is an error; otherwise it follows ``rollout.temperature``."""
    actor_raw = raw.get("actor") if isinstance(raw.get("actor"), Mapping) else {}
    t = float(cfg.rollout.temperature)
    if "temperature" in actor_raw and float(cfg.actor.temperature) != t:
        raise _error(f"actor.temperature={cfg.actor.temperature} differs from "
                     f"rollout.temperature={t}: one temperature drives sampling and the actor's "
                     "log-probs; set rollout.temperature only")
    cfg.actor = dataclasses.replace(cfg.actor, temperature=t)


# ---- batch shapes ---
def check_batching(cfg) -> None:
    """Rollout batch x samples splits into whole mini-batches, and each mini-batch into whole
    micro-batches on every DP rank."""
    rows = cfg.trainer.train_batch_size * cfg.rollout.n
    dp, micro = cfg.parallel.dp, cfg.actor.micro_batch_size
    if cfg.actor.max_tokens_per_micro_batch:  # micro-batches are cut by tokens, not rows
        micro = 1
    mini = cfg.actor.mini_batch_size
    what = (f"trainer.train_batch_size x rollout.n = {cfg.trainer.train_batch_size} x "
            f"{cfg.rollout.n} = {rows} responses")
    if rows % dp:
        raise _error(f"{what} must be divisible by parallel.dp={dp}")
    if cfg.sft.steps > 0 and cfg.sft.batch_size % dp:
        raise _error(f"sft.batch_size={cfg.sft.batch_size} must be divisible by "
                     f"parallel.dp={dp}")
    check_token_budget(cfg)
    if mini == 0:
        return
    if rows % mini:
        raise _error(f"{what} must be divisible by actor.mini_batch_size={mini} (allowed: a "
                     f"divisor of {rows}, or 0 = the whole batch)")
    if mini % (dp * micro):
        raise _error(f"actor.mini_batch_size={mini} must be divisible by parallel.dp x "
                     f"actor.micro_batch_size = {dp} x {micro} = {dp * micro}")


def check_token_budget(cfg) -> None:
    """``actor.max_tokens_per_micro_batch`` must hold the longest single sequence:
    ``data.max_prompt_length + rollout.max_new_tokens`` (with ``data.max_prompt_length: 0``, no
    limit, only the response is known here: a longer row is refused when it arrives)."""
    budget = cfg.actor.max_tokens_per_micro_batch
    if not budget:
        return
    prompt = cfg.data.max_prompt_length
    longest = prompt + cfg.rollout.max_new_tokens if prompt else cfg.rollout.max_new_tokens + 1
    if budget < longest:
        what = (f"data.max_prompt_length + rollout.max_new_tokens = {prompt} + "
                f"{cfg.rollout.max_new_tokens} = {longest}" if prompt else
                f"1 prompt token + rollout.max_new_tokens = {longest}")
        raise _error(f"actor.max_tokens_per_micro_batch={budget} is smaller than the longest "
                     f"single sequence ({what}); raise it to at least {longest} or set it to 0 "
                     "(row-count micro-batches)")


def ratio_one_warning(cfg) -> str | None:
    """One line when a loss that acts through ``pi/pi_old`` gets one on-policy update per step
    (its ratio is then 1 at every token: see :mod:`megatron_rl.loss.ratio_one`), else None."""
    from megatron_rl.loss.ratio_one import acting_at_ratio_one, inert_at_ratio_one, updates_per_step

    rows = cfg.trainer.train_batch_size * cfg.rollout.n
    if updates_per_step(rows, cfg.actor.mini_batch_size, cfg.actor.ppo_epochs) > 1:
        return None
    built = cfg.loss.build()
    inert = inert_at_ratio_one(built)
    if not inert:
        return None
    acting = acting_at_ratio_one(built)
    if cfg.loss.algorithm == "skywork_or1":
        acting.append("the adaptive entropy bonus")
    still = f" (still acting: {'; '.join(acting)})" if acting else ""
    return (f"[config] warning: loss.algorithm={cfg.loss.algorithm} with actor.mini_batch_size="
            f"{cfg.actor.mini_batch_size} and actor.ppo_epochs={cfg.actor.ppo_epochs} takes one "
            f"on-policy update per step ({rows} responses): pi/pi_old = 1 at every token, so "
            f"{' and '.join(inert)} never act and the update is a plain policy gradient{still}; "
            f"set actor.mini_batch_size to a divisor of {rows} below it, or actor.ppo_epochs > 1 "
            "(docs/algorithms-and-losses.md#on-policy-updates-ratio--1)")


# ---- advantages ---
def check_reinforce_pp(cfg) -> None:
    """``trainer.kl_in_reward_coef`` >= 0 and only used where a KL-in-reward term exists."""
    coef = cfg.trainer.kl_in_reward_coef
    if not coef >= 0:
        raise _error(f"trainer.kl_in_reward_coef must be >= 0, got {coef}")
    if coef > 0 and cfg.trainer.advantage != "reinforce_pp":
        raise _error(f"trainer.kl_in_reward_coef={coef} is only used by "
                     f"trainer.advantage='reinforce_pp' (got {cfg.trainer.advantage!r}); set it "
                     "to 0 or use reinforce_pp")


def dr_grpo_constant(cfg) -> None:
    """Dr.GRPO (ALGORITHMS.md §3.2) divides each sequence's token sum by a constant, the maximum
    response length: the ``*-sum-norm`` modes get ``loss_scale_factor = rollout.max_new_tokens``
    unless it is set explicitly (never each batch's padded length)."""
    built = cfg.loss.build()
    if built.loss_agg_mode in SUM_NORM_MODES and built.loss_scale_factor is None:
        cfg.loss.overrides = {**cfg.loss.overrides,
                              "loss_scale_factor": float(cfg.rollout.max_new_tokens)}


def check_trainer(cfg) -> None:
    t = cfg.trainer
    if t.keep_checkpoints < 0:
        raise _error(f"trainer.keep_checkpoints must be >= 0 (0 = keep all), got "
                     f"{t.keep_checkpoints}")


def check_actor_lora(cfg, raw: Mapping[str, Any]) -> None:
    """``actor.lora.rank`` given as 0 (or less) is an error (docs/lora.md)."""
    from megatron_rl.models.lora_config import LoraConfigError, check_lora_rank

    try:
        check_lora_rank(raw, cfg.actor.lora)
    except LoraConfigError as exc:
        raise ConfigError(str(exc)) from None


def check_run_config(cfg, raw: Mapping[str, Any]) -> None:
    """All load-time checks (``raw``: the merged YAML + overrides mapping the config was built
    from). May normalise ``cfg`` in place: the actor temperature, loss override numbers, the
    Dr.GRPO constant."""
    check_advantage(cfg.trainer.advantage)
    check_names(cfg)
    check_ranges(cfg)  # every number in its range, every choice allowed
    check_actor_lora(cfg, raw)
    check_sampling(cfg)
    one_temperature(cfg, raw)
    normalize_loss(cfg)
    check_batching(cfg)
    check_reinforce_pp(cfg)
    check_trainer(cfg)
    dr_grpo_constant(cfg)
    normalize_eval_sets(cfg)  # data.eval_sets: complete entries, every field checked
