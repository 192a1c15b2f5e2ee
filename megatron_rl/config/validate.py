"""Cross-field checks of a loaded run config; every message names the field and the allowed
values."""

from __future__ import annotations

import os

from megatron_rl.config.errors import ConfigError
from megatron_rl.config.schema import ADVANTAGES
from megatron_rl.config.sections import ParallelSection, RunConfig, SGLangSection
from megatron_rl.config.teacher import validate_teacher
from megatron_rl.convert.model_source import ModelSourceError, validate_model_section
from megatron_rl.envs import ENVS
from megatron_rl.models.config import ModelConfigError
from megatron_rl.parallel.backend import BACKENDS
from megatron_rl.rollout.fleet import LAUNCHERS, WEIGHT_SYNCS


def validate_run_config(cfg: RunConfig) -> None:
    """Cross-field checks; every message names the field and the allowed values."""
    try:
        model = validate_model_section(cfg.model, cfg.parallel.tp, cfg.parallel.pp,
                                       cfg.parallel.ep)
    except (ModelSourceError, ModelConfigError) as exc:
        raise ConfigError(str(exc)) from exc
    validate_routing_replay(cfg, model.is_moe)
    from megatron_rl.models.lora_config import LoraConfigError, lora_conflicts

    if cfg.actor.lora.enabled:
        for bad, why in lora_conflicts(cfg, model.is_moe):
            raise ConfigError(str(LoraConfigError(f"actor.lora cannot be combined with {bad}: "
                                                  f"{why}")))
    for old, new in (("prompt_field", "prompt_key"), ("answer_field", "answer_key")):
        if getattr(cfg.data, old) is not None:
            raise ConfigError(f"data.{old} was renamed data.{new}; use data.{new}="
                              f"{getattr(cfg.data, old)!r}")
    if cfg.data.max_prompt_length < 0:
        raise ConfigError(f"data.max_prompt_length must be >= 0 (0 = no limit), got "
                          f"{cfg.data.max_prompt_length}")
    cfg.loss.build()
    validate_parallel_section(cfg.parallel)
    validate_context_parallel(cfg, model.max_position_embeddings)
    if cfg.trainer.advantage not in ADVANTAGES:
        raise ConfigError(f"trainer.advantage={cfg.trainer.advantage!r} is not one of "
                          f"{ADVANTAGES}")
    if cfg.rollout.engine not in ("embedded", "sglang"):
        raise ConfigError(f"rollout.engine={cfg.rollout.engine!r} is not one of "
                          "('embedded', 'sglang')")
    if cfg.rollout.engine == "sglang":
        validate_sglang_section(cfg.rollout.sglang)
        if note := fp8_correction_note(cfg):
            import warnings

            warnings.warn(note, stacklevel=2)
    validate_colocation(cfg)
    validate_async(cfg)
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
    validate_collapse_metrics(cfg)
    validate_teacher(cfg)  # on-policy distillation: weights, layout, the student's tokenizer
    rows = cfg.trainer.train_batch_size * cfg.rollout.n
    if rows % cfg.parallel.dp:
        raise ConfigError(f"trainer.train_batch_size x rollout.n = {rows} responses must be "
                          f"divisible by parallel.dp={cfg.parallel.dp}")


def validate_routing_replay(cfg: RunConfig, moe: bool) -> None:
    """``actor.routing_replay`` r2/r3 need an MoE model; r3 needs routed experts from the rollout
    (not multi-turn episodes, whose turns are stitched from several requests)."""
    mode = cfg.actor.routing_replay
    if mode == "none":
        return
    if not moe:
        raise ConfigError(f"actor.routing_replay={mode!r} needs a mixture-of-experts model "
                          "(model.preset tiny-qwen3-moe or a Qwen3-MoE model.hf_path); this "
                          "model is dense: set actor.routing_replay=none")
    if mode == "r3" and cfg.env.name:
        raise ConfigError(f"actor.routing_replay='r3' is not supported with multi-turn "
                          f"env.name={cfg.env.name!r} (allowed there: 'none', 'r2')")
    if cfg.parallel.tp > 1:  # each TP rank routes a slice of the sequence (models/moe_tp.py)
        raise ConfigError(f"actor.routing_replay={mode!r} is not supported with "
                          f"parallel.tp={cfg.parallel.tp} (MoE at TP > 1 routes per sequence "
                          "slice); use parallel.tp=1 or actor.routing_replay=none")


def validate_parallel_section(p: ParallelSection) -> None:
    """``parallel.backend`` and the two timeouts."""
    if p.backend not in BACKENDS:
        raise ConfigError(f"parallel.backend={p.backend!r} is not one of {BACKENDS}")
    for name in ("timeout_s", "host_timeout_s"):
        if not getattr(p, name) > 0:
            raise ConfigError(f"parallel.{name} must be > 0 seconds, got {getattr(p, name)}")
    if (p.tp * p.dp) % p.ep:
        raise ConfigError(f"parallel.ep={p.ep} must divide the ranks of a pipeline stage, "
                          f"parallel.tp x parallel.dp = {p.tp * p.dp} (megatron-core carves "
                          "expert parallelism out of them)")


def validate_context_parallel(cfg: RunConfig, max_positions: int) -> None:
    """``parallel.cp`` > 1 (each sequence split over cp ranks, docs/parallelism.md): the paths
    that cannot split a sequence are refused here, naming the fields. Rows are padded to a
    multiple of ``2 x cp`` inside the forward, so the model's position table must hold that
    padding: ``max_position_embeddings`` a multiple of ``2 x cp``."""
    cp = cfg.parallel.cp
    if cp == 1:
        return
    if cfg.actor.routing_replay != "none":
        raise ConfigError(f"parallel.cp={cp} is not supported with actor.routing_replay="
                          f"{cfg.actor.routing_replay!r} (routed experts are recorded per whole "
                          "sequence); use actor.routing_replay=none or parallel.cp=1")
    if cfg.parallel.ep > 1:
        raise ConfigError(f"parallel.cp={cp} with parallel.ep={cfg.parallel.ep} is not "
                          "supported (allowed with parallel.cp > 1: parallel.ep=1)")
    if max_positions % (2 * cp):
        raise ConfigError(f"parallel.cp={cp}: the model's max_position_embeddings "
                          f"({max_positions}) is not a multiple of 2 x parallel.cp = {2 * cp}; "
                          "sequences are padded to a multiple of 2 x cp, so the longest padded "
                          "sequence would not fit the position table")


def validate_env_critic(cfg: RunConfig) -> None:
    """Checks of the ``env`` and ``critic`` sections (multi-turn runs, GAE)."""
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


def validate_collapse_metrics(cfg: RunConfig) -> None:
    """``trainer.collapse_metrics``: RAGEN-2 diagnostics of a multi-turn run's first replies
    (ranges and choices are checked with every field, :mod:`megatron_rl.config.schema`)."""
    c = cfg.trainer.collapse_metrics
    if not c.enabled:
        return
    if not cfg.env.name:
        raise ConfigError("trainer.collapse_metrics.enabled needs a multi-turn environment (set "
                          f"env.name to one of {ENVS}); single-turn runs have no first reply")
    if c.reasoning == "think" and not (c.think_open and c.think_close):
        raise ConfigError("trainer.collapse_metrics.think_open and think_close must be "
                          "non-empty with reasoning: think")


def validate_sglang_section(s: SGLangSection) -> None:
    """Load-time checks of ``rollout.sglang``; messages name the field and the allowed values."""
    if s.launcher not in LAUNCHERS:
        raise ConfigError(f"rollout.sglang.launcher={s.launcher!r} is not one of {LAUNCHERS}")
    if s.weight_sync not in WEIGHT_SYNCS:
        raise ConfigError(f"rollout.sglang.weight_sync={s.weight_sync!r} is not one of "
                          f"{WEIGHT_SYNCS}")
    for u in s.servers:
        if not isinstance(u, str) or not u.startswith(("http://", "https://")):
            raise ConfigError(f"rollout.sglang.servers: {u!r} is not an http(s):// URL")
    if not s.servers and s.num_servers < 1:
        raise ConfigError("rollout.sglang.num_servers must be >= 1 when rollout.sglang.servers "
                          "is empty")
    for name in ("tp_size", "concurrency", "server_threads"):
        if getattr(s, name) < 1:
            raise ConfigError(f"rollout.sglang.{name} must be >= 1, got {getattr(s, name)}")
    if s.max_retries < 0 or s.max_offpolicy_lag < -1 or s.probe_length < 0 or s.spot_checks < 0:
        raise ConfigError("rollout.sglang: max_retries, probe_length, spot_checks must be >= 0 "
                          "and max_offpolicy_lag >= -1")
    if not 0 < s.mem_fraction_static <= 1:
        raise ConfigError(f"rollout.sglang.mem_fraction_static must be in (0, 1], got "
                          f"{s.mem_fraction_static}")
    if s.serve_rules not in ("0.5.21", "0.5.20"):
        raise ConfigError(f"rollout.sglang.serve_rules={s.serve_rules!r} is not one of "
                          "('0.5.21', '0.5.20')")
    if s.flush_retries < 0:
        raise ConfigError(f"rollout.sglang.flush_retries must be >= 0, got {s.flush_retries}")
    validate_quantization(s)
    if not isinstance(s.extra_args, list):
        raise ConfigError(f"rollout.sglang.extra_args must be a list, got {s.extra_args!r}")
    if s.python is not None and not os.path.isfile(str(s.python)):
        raise ConfigError(f"rollout.sglang.python={s.python!r} is not a file (an interpreter "
                          "with sglang installed; unset: the trainer's)")
    if s.probe_tolerance is not None and not s.probe_tolerance > 0:
        raise ConfigError("rollout.sglang.probe_tolerance must be > 0 (or null: from the "
                          "actor's and the servers' precisions)")
    if s.gpus and len(s.gpus) < s.num_servers * s.tp_size and not s.servers:
        raise ConfigError(f"rollout.sglang.gpus lists {len(s.gpus)} GPUs; num_servers x tp_size "
                          f"= {s.num_servers * s.tp_size} are needed")


def validate_quantization(s: SGLangSection) -> None:
    """``rollout.sglang.quantization`` (null | ``fp8``) and ``fp8_scale_fmt`` (``float32`` |
    ``ue8m0``), and SGLang arguments that contradict them."""
    from megatron_rl.rollout.quant_choices import QUANTIZATIONS, SCALE_FMTS

    if s.quantization is not None and s.quantization not in QUANTIZATIONS:
        raise ConfigError(f"rollout.sglang.quantization={s.quantization!r} is not one of "
                          f"{QUANTIZATIONS} (or null: the actor's dtype)")
    if s.fp8_scale_fmt not in SCALE_FMTS:
        raise ConfigError(f"rollout.sglang.fp8_scale_fmt={s.fp8_scale_fmt!r} is not one of "
                          f"{SCALE_FMTS}")
    args = [str(a) for a in s.extra_args] if isinstance(s.extra_args, list) else []
    given = [args[k + 1] for k, a in enumerate(args[:-1]) if a == "--quantization"] + \
        [a.split("=", 1)[1] for a in args if a.startswith("--quantization=")]
    want = s.quantization or None
    if given and given[-1] != want:
        raise ConfigError(f"rollout.sglang.extra_args has --quantization {given[-1]} but "
                          f"rollout.sglang.quantization is {want!r}: set the quantization there "
                          "(the weight sync must send what the servers load)")


def fp8_correction_note(cfg) -> str | None:
    """The load-time note for FP8 rollouts without a rollout correction (None otherwise)."""
    if cfg.rollout.sglang.quantization != "fp8" or cfg.loss.rollout_correction != "none":
        return None
    return ("rollout.sglang.quantization=fp8 with loss.rollout_correction=none: FP8 servers "
            "sample from a policy further from the bf16 actor's than bf16 servers do (see "
            "rollout/logp_mismatch_mean); the FP8 recipes set loss.rollout_correction=icepop "
            "(or tis) to correct it (docs/sglang.md, examples/tiny_dapo_fp8.yaml)")


def validate_async(cfg) -> None:
    """``rollout.max_staleness``: an int in [0, 64]; K > 0 (asynchronous rollouts) runs with the
    single-turn prompt loop and a separate rollout fleet or the embedded engine."""
    k = cfg.rollout.max_staleness
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= 64:
        raise ConfigError(f"rollout.max_staleness must be an int in [0, 64] (0 = synchronous), "
                          f"got {k!r}")
    if cfg.rollout.durable_bank and cfg.env.name:
        raise ConfigError(f"rollout.durable_bank=true banks single-turn prompt rollouts; "
                          f"env.name={cfg.env.name!r} (multi-turn episodes) is not banked: set "
                          "rollout.durable_bank=false")
    if k == 0:
        return
    if cfg.env.name:
        raise ConfigError(f"rollout.max_staleness={k} needs single-turn prompts; env.name="
                          f"{cfg.env.name!r} (multi-turn episodes) runs only with "
                          "rollout.max_staleness=0")
    if cfg.rollout.sglang.colocate and cfg.rollout.engine == "sglang":
        raise ConfigError(f"rollout.max_staleness={k} needs the servers to generate while the "
                          "actor trains; rollout.sglang.colocate=true makes them take turns "
                          "with the GPUs: set rollout.sglang.colocate=false or "
                          "rollout.max_staleness=0")


def validate_colocation(cfg) -> None:
    """Config rules of ``rollout.sglang.colocate``; messages name the fields and the allowed
    values. (Servers started on the trainer's GPUs without colocation are refused when they would
    start: :func:`server_gpus` -- a config may list its servers only on the command line.)"""
    s = cfg.rollout.sglang
    if not s.colocate:
        return
    if cfg.rollout.engine != "sglang":
        raise ConfigError(f"rollout.sglang.colocate=true needs rollout.engine='sglang', got "
                          f"{cfg.rollout.engine!r}")
    if s.weight_sync == "from_distributed":
        raise ConfigError("rollout.sglang.colocate=true needs rollout.sglang.weight_sync in "
                          "('from_tensor', 'from_disk'), got 'from_distributed' (NCCL cannot "
                          "join two ranks on one GPU; colocated weights go by CUDA IPC: "
                          "from_tensor)")
