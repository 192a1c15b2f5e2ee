"""Fused kernels: linear head + vocab-parallel log-prob + entropy (Triton on GPU, torch on CPU).

Nothing here imports Triton at import time; the Triton kernels load only when that backend runs.
"""

from megatron_rl.kernels.fused_head import (
    FusedLinearLogProbEntropy,
    fused_linear_logprob_entropy,
    resolve_backend,
    triton_available,
)

__all__ = [
    "FusedLinearLogProbEntropy",
    "fused_linear_logprob_entropy",
    "resolve_backend",
    "triton_available",
]
