"""What a run is built from: datasets, tokenizer, reward function, rollout engine, actor.

Every command (``train``, ``eval``, ``sft``) builds these through the functions here, so the
dataset build + split, the tokenizer and the engine exist in one place each.
"""

from __future__ import annotations

from typing import Any, Callable

from megatron_rl.config import RunConfig


def build_datasets(cfg: RunConfig):
    """``(train_set, val_set)`` :class:`~megatron_rl.data.PromptDataset` s of the run's data
    (files when ``data.path`` is set, else the reasoning-gym task), split disjointly."""
    from megatron_rl.data import PromptDataset, train_val_split

    d = cfg.data
    full = (PromptDataset.from_files(d.path, d.prompt_field, d.answer_field) if d.path else
            PromptDataset.from_task(d.task, d.train_size + d.val_size, d.seed, **d.task_kwargs))
    return train_val_split(full, d.val_size, seed=d.seed,
                           by="prompt" if d.split_by == "prompt" else None)


def make_tokenizer(cfg: RunConfig):
    """The run's tokenizer (the byte tokenizer of the tiny presets)."""
    from megatron_rl.rewards.tokenizer import ByteTokenizer

    return ByteTokenizer()


def make_engine(cfg: RunConfig, tokenizer):
    """The rollout engine (rank 0 only): the embedded ``transformers`` engine."""
    from megatron_rl.models.config import get_preset
    from megatron_rl.rollout.embedded import EmbeddedEngine

    return EmbeddedEngine(get_preset(cfg.model.preset), tokenizer.eos_id, tokenizer.pad_id)


def score_fn(cfg: RunConfig) -> Callable[[dict, str], float]:
    """The reward function: ``rollout.reward_fn`` when given, else the task scorer."""
    if cfg.rollout.reward_fn:
        from megatron_rl.rewards.plugin import load_reward_fn

        return load_reward_fn(cfg.rollout.reward_fn)
    from megatron_rl.rewards.tasks import score

    return score


def make_actor(cfg: RunConfig, optim_cfg, loss_cfg, total_steps: int, full_state=None,
               entropy_controller=None, actor_cfg=None, ref_state=None):
    """This rank's :class:`~megatron_rl.actor.actor.Actor` for the run's model and layout."""
    from megatron_rl.actor.actor import Actor
    from megatron_rl.models.config import get_preset

    return Actor(get_preset(cfg.model.preset), actor_cfg or cfg.actor, optim_cfg, loss_cfg,
                 total_steps, seed=cfg.trainer.seed, full_state=full_state,
                 entropy_controller=entropy_controller, ref_state=ref_state)


def entropy_controller(cfg: RunConfig) -> Any:
    """Skywork-OR1's adaptive entropy controller when the algorithm uses it, else None."""
    if cfg.loss.algorithm != "skywork_or1":
        return None
    from megatron_rl.loss import AdaptiveEntropyController

    return AdaptiveEntropyController()


def opt_steps_per_rl_step(cfg: RunConfig) -> int:
    """Optimizer steps one RL step takes (epochs x mini-batches)."""
    rows = cfg.trainer.train_batch_size * cfg.rollout.n
    mini = cfg.actor.mini_batch_size or rows
    return cfg.actor.ppo_epochs * max(1, rows // mini)
