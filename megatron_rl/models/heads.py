"""Response-token head: select response positions, apply the vocab-parallel output layer to those
rows only, and compute per-token log-prob and full-vocabulary entropy (or, with
``entropy_top_p < 1``, the entropy of the top-p nucleus, :mod:`megatron_rl.ops.top_p_entropy`).

Position convention: for a sequence ``tokens[b, 0:S]`` and a response mask ``mask[b, t]`` that is
true where ``tokens[b, t]`` is a response token, the log-prob of ``tokens[b, t]`` comes from the
hidden state at ``t - 1``. Prompt positions never reach the output layer.
"""

from __future__ import annotations

import torch

from megatron_rl.models.fused_head import fused_response_logprob_entropy
from megatron_rl.models.response_tokens import response_index
from megatron_rl.ops.top_p_entropy import vocab_parallel_top_p_entropy
from megatron_rl.ops.vocab_parallel import _default_tp_group, vocab_parallel_logprob_entropy


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
                             index: tuple[torch.Tensor, torch.Tensor] | None = None,
                             entropy_top_p: float = 1.0
                             ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-prob and entropy as ``[B, S]`` fp32 tensors (zero outside ``mask``).

    ``fused=True`` uses the fused linear + log-prob + entropy head
    (``megatron_rl.kernels.fused_head``: row-chunked GEMMs with a Triton elementwise pass on GPU,
    a torch one elsewhere), which never materialises the ``[N, V/TP]`` logits; same values.
    ``index``: this micro-batch's ``(b, t)`` from :func:`response_indices` (None: computed here,
    one host sync). ``entropy_top_p < 1``: the entropy is the top-p nucleus entropy (SIREN's
    vocabulary mask; with ``fused`` the response tokens' logits are materialised for it).
    """
    if entropy_top_p < 1.0 and compute_entropy:
        return _top_p_head(model, hidden, tokens, mask, temperature=temperature,
                           entropy_grad=entropy_grad, chunk_size=chunk_size, fused=fused,
                           index=index, top_p=entropy_top_p)
    if fused:
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


def _top_p_head(model: torch.nn.Module, hidden: torch.Tensor, tokens: torch.Tensor,
                mask: torch.Tensor, *, temperature: float, entropy_grad: bool,
                chunk_size: int | None, fused: bool,
                index: tuple[torch.Tensor, torch.Tensor] | None, top_p: float
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`response_logprob_entropy` with the nucleus entropy: the log-prob as usual, the
    entropy from the response tokens' vocab-parallel logits (``[B, S]`` fp32 each)."""
    b, t = response_index(mask) if index is None else index
    logp_full, _ = response_logprob_entropy(model, hidden, tokens, mask, temperature=temperature,
                                            compute_entropy=False, chunk_size=chunk_size,
                                            fused=fused, index=(b, t))
    logits = response_logits(model, hidden, b, t)
    if not entropy_grad:
        logits = logits.detach()
    ent = vocab_parallel_top_p_entropy(logits, top_p, _default_tp_group(),
                                       temperature=temperature, chunk_size=chunk_size)
    return logp_full, ent.new_zeros(tokens.shape).index_put((b, t), ent)
