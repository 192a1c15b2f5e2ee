"""Fused response-token head: the same contract as :func:`megatron_rl.models.heads.
response_logprob_entropy`, computed from hidden states and the output weight's vocab shard by
:func:`megatron_rl.kernels.fused_head.fused_linear_logprob_entropy` -- no ``[N, V/TP]`` logits
tensor.

What megatron's ``output_layer`` (a ``ColumnParallelLinear``) would do, and what this does instead:

* weight: ``model.shared_embedding_or_output_weight()`` when the embeddings are tied, else
  ``model.output_layer.weight`` -- the same ``[V/TP, H]`` parameter. Under megatron DDP the
  weight's gradient is added straight into its fp32 ``main_grad`` (``use_main_grad=True``: no
  ``[V/TP, H]`` gradient buffer); without DDP it comes back as ``.grad`` as for any parameter.
  With tied embeddings the embedding's own gradient still reaches ``main_grad`` through DDP's
  hook (see :mod:`megatron_rl.kernels.fused_head`);
* input gradient: ``ColumnParallelLinear`` all-reduces it over TP (``copy_to_tensor_model_parallel_
  region``); the fused op does that all-reduce itself in backward (one SUM over the TP group);
* no bias (``GPTModel``'s output layer has none; a model with one is rejected);
* sequence parallelism is not supported (``hidden`` must be the full ``[S, B, H]``), as in
  :mod:`megatron_rl.models.heads`.
"""

from __future__ import annotations

import torch

from megatron_rl.kernels.fused_head import fused_linear_logprob_entropy
from megatron_rl.models.response_tokens import response_index

__all__ = ["fused_response_logprob_entropy", "output_weight"]


def output_weight(model: torch.nn.Module) -> torch.Tensor:
    """This rank's ``[V/TP, H]`` output weight (the embedding when the two are tied)."""
    layer = model.output_layer
    if getattr(layer, "bias", None) is not None:
        raise NotImplementedError("fused head: output layers with a bias are not supported")
    config = getattr(model, "config", None)
    if getattr(config, "sequence_parallel", False):
        raise NotImplementedError("fused head: sequence_parallel is not supported")
    if getattr(model, "share_embeddings_and_output_weights", False):
        return model.shared_embedding_or_output_weight()
    return layer.weight


def fused_response_logprob_entropy(model: torch.nn.Module, hidden: torch.Tensor,
                                   tokens: torch.Tensor, mask: torch.Tensor, *,
                                   temperature: float = 1.0, compute_entropy: bool = True,
                                   entropy_grad: bool = True, chunk_size: int | None = None,
                                   backend: str = "auto",
                                   index: tuple[torch.Tensor, torch.Tensor] | None = None,
                                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-prob and entropy as ``[B, S]`` fp32 tensors (zero outside ``mask``).

    Args:
        model: the last pipeline stage of the actor ``GPTModel`` (has ``output_layer``).
        hidden: final-norm hidden states ``[S, B, H]``; row ``t - 1`` predicts token ``t``.
        tokens: ``[B, S]`` token ids; mask: ``[B, S]`` response mask (position 0 never set).
        temperature, compute_entropy, entropy_grad: as in ``response_logprob_entropy``.
        chunk_size: rows per chunk (None: sized to ~8% of the ``[N, V/TP]`` logits).
        backend: ``"auto"`` (Triton on CUDA when installed, torch otherwise), ``"torch"``,
            ``"triton"``.
        index: precomputed ``(b, t)`` of ``mask`` (``response_tokens.response_indices``); None:
            here.
    """
    b, t = response_index(mask) if index is None else index
    weight = output_weight(model)
    h = hidden[t - 1, b]                          # [N, H] response rows only
    logp, ent = fused_linear_logprob_entropy(
        h, weight, tokens[b, t], temperature=temperature, compute_entropy=compute_entropy,
        entropy_grad=entropy_grad, chunk_size=chunk_size, backend=backend, use_main_grad=True)
    logp_full = logp.new_zeros(tokens.shape).index_put((b, t), logp)
    ent_full = None if ent is None else ent.new_zeros(tokens.shape).index_put((b, t), ent)
    return logp_full, ent_full
