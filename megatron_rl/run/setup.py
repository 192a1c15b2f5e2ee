"""What a run is built from: datasets, tokenizer, reward function, rollout engine, actor.

Every command (``train``, ``eval``, ``sft``) builds these through the functions here, so the
dataset build + split, the tokenizer and the engine exist in one place each.
"""

from __future__ import annotations

from typing import Any, Callable

from megatron_rl.config.sections import RunConfig


def init_parallel(cfg: RunConfig):
    """torch.distributed + megatron parallel state for the run's layout, backend and timeouts."""
    from megatron_rl.parallel import runtime

    p = cfg.parallel
    runtime.set_deterministic(cfg.trainer.deterministic)  # before any CUDA kernel runs
    return runtime.init_parallel(tp=p.tp, pp=p.pp, dp=p.dp, cp=p.cp, ep=p.ep,
                                 seed=cfg.trainer.seed,
                                 backend=p.backend, timeout_s=p.timeout_s,
                                 host_timeout_s=p.host_timeout_s,
                                 socket_ifname=p.socket_ifname)


def build_datasets(cfg: RunConfig, tokenizer=None):
    """``(train_set, val_set)`` :class:`~megatron_rl.data.prompts.PromptDataset` s of the run's data
    (files when ``data.path`` is set, else the reasoning-gym task), split disjointly.

    Prompts are rendered for ``tokenizer`` (default: the run's): chat messages (and, with a chat
    template, plain prompts as one user message) through its chat template; prompts longer than
    ``data.max_prompt_length`` tokens are dropped and counted."""
    from megatron_rl.data.prompts import PromptDataset, train_val_split

    d = cfg.data
    tokenizer = tokenizer or make_tokenizer(cfg)
    full = (PromptDataset.from_files(d.path, d.prompt_key, d.answer_key) if d.path else
            PromptDataset.from_task(d.task, d.train_size + d.val_size, d.seed, **d.task_kwargs))
    full, dropped = render_prompts(full, tokenizer, d.chat_template, d.max_prompt_length)
    if dropped:
        print(f"[data] dropped {dropped} of {dropped + len(full)} prompts longer than "
              f"data.max_prompt_length={d.max_prompt_length} tokens", flush=True)
    if not len(full):
        raise ValueError(f"no prompt of {full.source} is within data.max_prompt_length="
                         f"{d.max_prompt_length} tokens")
    return train_val_split(full, d.val_size, seed=d.seed,
                           by="prompt" if d.split_by == "prompt" else None)


def render_prompts(dataset, tokenizer, use_template: bool, max_len: int):
    """``(dataset with rendered prompts, number dropped)``: ``row["prompt"]`` becomes the text
    the model sees (``row["raw_prompt"]`` keeps the original); rows whose prompt is longer than
    ``max_len`` tokens (0: no limit) are dropped."""
    from megatron_rl.data.prompts import PromptDataset
    from megatron_rl.data.tokenizer import render_prompt

    kept, dropped = [], 0
    for row in dataset.rows:
        text = render_prompt(tokenizer, row.get("messages", row["prompt"]), use_template)
        if max_len and len(tokenizer.encode(text)) > max_len:
            dropped += 1
            continue
        kept.append({**row, "raw_prompt": row["prompt"], "prompt": text})
    return PromptDataset(kept, dataset.source), dropped


def model_config(cfg: RunConfig):
    """The run's architecture (preset, HF ``config.json`` or converted checkpoint)."""
    from megatron_rl.convert.model_source import model_config as of_section

    return of_section(cfg.model)


def make_tokenizer(cfg: RunConfig):
    """The run's tokenizer: the HF tokenizer of the model directory (or ``model.tokenizer``),
    else the byte tokenizer of the tiny presets. Its vocabulary must fit the model's."""
    from megatron_rl.convert.model_source import tokenizer_dir
    from megatron_rl.data.tokenizer import HFTokenizer, check_vocab_fits
    from megatron_rl.rewards.tokenizer import ByteTokenizer

    path = tokenizer_dir(cfg.model)
    tok = HFTokenizer(path) if path else ByteTokenizer()
    check_vocab_fits(tok, model_config(cfg).vocab_size,
                     f"tokenizer {path or 'byte'} vs model.vocab_size")
    return tok


def make_engine(cfg: RunConfig, tokenizer):
    """The rollout engine (rank 0 only): the embedded ``transformers`` engine, with the run's
    architecture (its weights come from the actor by weight sync)."""
    from megatron_rl.rollout.embedded import EmbeddedEngine

    if cfg.rollout.engine == "sglang":  # a fleet behind sglang-router (rollout/sglang_client.py)
        from megatron_rl.rollout.sglang_client import make_sglang_engine

        return make_sglang_engine(cfg, tokenizer)
    from megatron_rl.parallel.runtime import device
    from megatron_rl.rollout.embedded import engine_placement

    dev, dtype = engine_placement(cfg.actor.precision, device())  # GPU: actor's precision
    engine = EmbeddedEngine(model_config(cfg), tokenizer.eos_id, tokenizer.pad_id,
                            per_request_seed=cfg.rollout.per_request_seed, device=dev,
                            dtype=dtype, return_routed_experts=cfg.actor.routing_replay == "r3")
    engine.partial = cfg.rollout.partial  # an update may run between decode steps (async)
    return engine


def score_fn(cfg: RunConfig) -> Callable[[dict, str], float]:
    """The reward function: ``rollout.reward_fn`` when given; for file datasets math-verify on the
    answer field; else the reasoning-gym task scorer."""
    if cfg.rollout.reward_fn:
        from megatron_rl.rewards.plugin import load_reward_fn

        return load_reward_fn(cfg.rollout.reward_fn)
    if cfg.data.path:
        from megatron_rl.rewards.math_verify_reward import math_reward_fn

        return math_reward_fn
    from megatron_rl.rewards.tasks import score

    return score


def make_actor(cfg: RunConfig, optim_cfg, loss_cfg, total_steps: int, full_state=None,
               entropy_controller=None, actor_cfg=None, ref_state=None,
               use_reference: bool = False, with_teacher: bool = False):
    """This rank's :class:`~megatron_rl.actor.actor.Actor` for the run's model and layout;
    ``with_teacher``: with the run's distillation teacher (``teacher`` section) beside it."""
    from megatron_rl.run.export import actor_class

    teacher_cfg, teacher_state = teacher_model(cfg) if with_teacher else (None, None)
    return actor_class(cfg)(model_config(cfg), actor_cfg or cfg.actor, optim_cfg, loss_cfg,
                            total_steps, seed=cfg.trainer.seed, full_state=full_state,
                            entropy_controller=entropy_controller, ref_state=ref_state,
                            use_reference=use_reference, teacher_cfg=teacher_cfg,
                            teacher_state=teacher_state)


def teacher_model(cfg: RunConfig):
    """``(teacher architecture, weight source)`` of the run's distillation teacher on the
    trainer ranks (``teacher.engine: actor``), else ``(None, None)`` (docs/distillation.md)."""
    from megatron_rl.config.teacher import actor_teacher, teacher_model_section
    from megatron_rl.convert.model_source import model_config as of_section
    from megatron_rl.convert.model_source import weight_source

    if not actor_teacher(cfg.teacher):
        return None, None
    section = teacher_model_section(cfg.teacher)
    return of_section(section), weight_source(section)


def loss_config(cfg: RunConfig):
    """The run's :class:`~megatron_rl.loss.LossConfig`: ``loss`` section, plus the distillation
    loss term when ``teacher.mode`` is ``loss`` (weight ``teacher.coef``)."""
    import dataclasses

    from megatron_rl.config.teacher import teacher_enabled

    built = cfg.loss.build()
    if teacher_enabled(cfg.teacher) and cfg.teacher.mode == "loss":
        built = dataclasses.replace(built, distill_loss_coef=cfg.teacher.coef).validate()
    return built


def make_critic(cfg: RunConfig, full_state=None):
    """This rank's :class:`~megatron_rl.critic.critic.Critic` (value model) for ``trainer.advantage:
    gae``: the actor's architecture and layout, initialised from the actor's initial weights."""
    from megatron_rl.critic.critic import Critic

    c = cfg.critic
    rows = cfg.trainer.train_batch_size * cfg.rollout.n
    per_step = c.ppo_epochs * max(1, rows // (c.mini_batch_size or cfg.actor.mini_batch_size
                                              or rows))
    return Critic(model_config(cfg), c, cfg.actor, cfg.trainer.total_steps * per_step,
                  seed=cfg.trainer.seed, full_state=full_state)


def entropy_controller(cfg: RunConfig) -> Any:
    """Skywork-OR1's adaptive entropy controller when the algorithm uses it, else None."""
    if cfg.loss.algorithm != "skywork_or1":
        return None
    from megatron_rl.loss import AdaptiveEntropyController

    return AdaptiveEntropyController()


def opt_steps_per_rl_step(cfg: RunConfig) -> int:
    """Optimizer steps one RL step takes (epochs x mini-batches)."""
    from megatron_rl.loss.ratio_one import updates_per_step

    return updates_per_step(cfg.trainer.train_batch_size * cfg.rollout.n,
                            cfg.actor.mini_batch_size, cfg.actor.ppo_epochs)
