"""The rollout-engine interface every backend implements (embedded transformers engine here; an
SGLang fleet behind ``sglang-router`` later).

An engine generates completions with per-token log-probs, takes new weights as buckets of
HF-named full tensors (:func:`megatron_rl.convert.stream.iter_hf_weight_buckets`) and reports the
weight version it serves.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Protocol

import torch

Bucket = list[tuple[str, torch.Tensor]]


@dataclass(frozen=True)
class SamplingParams:
    """How to sample: ``n`` completions per prompt at ``temperature`` / ``top_p``."""

    n: int = 1
    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    greedy: bool = False
    validation: bool = False  # validation/eval requests: not counted in rollout/offpolicy_lag


@dataclass
class Completion:
    """One generated response. ``response_ids`` includes the EOS token when one was produced."""

    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float] = field(default_factory=list)
    finished: bool = True  # False: stopped at max_new_tokens (truncated)
    weight_version: int = -1  # the policy version that produced it (-1: unknown)
    token_versions: list[int] | None = None  # per response token, when versions changed mid-way
    # MoE routing replay (R3): top-k expert ids of every token the engine ran through the model,
    # [len(prompt_ids) + len(response_ids) - 1, moe_layers, top_k] int32 (rollout/routed_experts.py)
    routed_experts: torch.Tensor | None = None


class RolloutEngine(Protocol):
    """What the trainer needs from a rollout backend."""

    weight_version: int

    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 seed: int | None = None) -> list[list[Completion]]:
        """``params.n`` completions for each prompt, in prompt order."""

    def update_weights(self, buckets: Iterable[Bucket], version: int) -> str:
        """Load HF-named tensors; return a checksum of what was loaded."""
