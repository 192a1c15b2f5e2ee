"""Vocab-parallel ops: per-token log-prob and entropy without gathering the vocabulary."""

from megatron_rl.ops.vocab_parallel import (
    VocabParallelLogProbEntropy,
    check_tp_consistency,
    naive_logprob_entropy,
    reference_logprob_entropy,
    vocab_parallel_logprob_entropy,
)

__all__ = [
    "VocabParallelLogProbEntropy",
    "check_tp_consistency",
    "naive_logprob_entropy",
    "reference_logprob_entropy",
    "vocab_parallel_logprob_entropy",
]
