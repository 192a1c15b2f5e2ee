"""Response-token head: select response positions, apply the vocab-parallel output layer to those
rows only, and compute per-token log-prob and full-vocabulary entropy.

Position convention: for a sequence ``tokens[b, 0:S]`` and a response mask ``mask[b, t]`` that is
true where ``tokens[b, t]`` is a response token, the log-prob of ``tokens[b, t]`` comes from the
hidden state at ``t - 1``. Prompt positions never reach the output layer.
"""

from __future__ import annotations

from typing import Sequence

import torch

from megatron_rl.ops.vocab_parallel import vocab_parallel_logprob_entropy


def response_index(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(b, t)`` index tensors ``[N]`` of response tokens in ``mask [B, S]`` (row-major order).

    Position 0 cannot be scored (nothing precedes it), so it must not be marked.
    """
    if mask.dim() != 2:
        raise ValueError(f"response mask must be [B, S], got shape {tuple(mask.shape)}")
    b, t = mask.bool().nonzero(as_tuple=True)
    return b, t


def response_indices(masks: Sequence[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """:func:`response_index` of every micro-batch mask ``[B, S]`` (all one shape) with a single
    host sync for the mini-batch (the token counts) instead of one ``nonzero`` sync per
    micro-batch; same order, same values. The indices live on the masks' device."""
    if not masks:
        return []
    for m in masks:
        if m.dim() != 2:
            raise ValueError(f"response mask must be [B, S], got shape {tuple(m.shape)}")
    stacked = torch.stack([m.bool() for m in masks])  # [M, B, S]
    counts = stacked.flatten(1).sum(1).tolist()  # the one host sync per mini-batch
    idx = torch.nonzero_static(stacked, size=sum(counts))  # [N, 3] (mb, b, t), no sync
    return [(part[:, 1], part[:, 2]) for part in idx.split(counts)]


def response_logits(model: torch.nn.Module, hidden: torch.Tensor, b: torch.Tensor,
                    t: torch.Tensor) -> torch.Tensor:
    """Vocab-parallel logits ``[N, V/TP]`` for the response tokens at ``(b, t)``.

    ``hidden`` is the last stage's final-norm output ``[S, B, H]``; row ``t - 1`` predicts token t.
    """
    h = hidden[t - 1, b]  # [N, H]
    weight = None
    if getattr(model, "share_embeddings_and_output_weights", False):
        weight = model.shared_embedding_or_output_weight()
    logits, _ = model.output_layer(h.unsqueeze(1), weight=weight)  # [N, 1, V/TP]
    return logits.squeeze(1)


def response_logprob_entropy(model: torch.nn.Module, hidden: torch.Tensor, tokens: torch.Tensor,
                             mask: torch.Tensor, *, temperature: float = 1.0,
                             compute_entropy: bool = True, entropy_grad: bool = True,
                             chunk_size: int | None = None, fused: bool = False,
                             index: tuple[torch.Tensor, torch.Tensor] | None = None
                             ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-prob and entropy as ``[B, S]`` fp32 tensors (zero outside ``mask``).

    ``fused=True`` uses the fused linear + log-prob + entropy head
    (``megatron_rl.kernels.fused_head``: row-chunked GEMMs with a Triton elementwise pass on GPU,
    a torch one elsewhere), which never materialises the ``[N, V/TP]`` logits; same values.
    ``index``: this micro-batch's ``(b, t)`` from :func:`response_indices` (None: computed here,
    one host sync).
    """
    if fused:
        from megatron_rl.models.fused_head import fused_response_logprob_entropy

        return fused_response_logprob_entropy(
            model, hidden, tokens, mask, temperature=temperature,
            compute_entropy=compute_entropy, entropy_grad=entropy_grad, chunk_size=chunk_size,
            index=index)
    b, t = response_index(mask) if index is None else index
    logits = response_logits(model, hidden, b, t)
    logp, ent = vocab_parallel_logprob_entropy(
        logits, tokens[b, t], temperature=temperature, compute_entropy=compute_entropy,
        entropy_grad=entropy_grad, chunk_size=chunk_size)
    logp_full = logp.new_zeros(tokens.shape).index_put((b, t), logp)
    ent_full = None if ent is None else ent.new_zeros(tokens.shape).index_put((b, t), ent)
    return logp_full, ent_full
