"""Forward-only passes through megatron's pipeline schedule: per-token log-prob and entropy of
response tokens (the old-policy and reference passes of the RL step use this).
"""

from __future__ import annotations

from typing import Sequence

import torch

from megatron_rl.actor.cp_forward import cp_model_forward, cp_response_logprob_entropy
from megatron_rl.actor.moe_padding import padding_kwargs
from megatron_rl.models.heads import response_logprob_entropy
from megatron_rl.models.response_tokens import response_indices
from megatron_rl.parallel.context_parallel import (
    cp_size,
    padded_length,
)


def _position_ids(tokens: torch.Tensor) -> torch.Tensor:
    return torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0).expand_as(tokens)


def validate_micro_batches(micro_batches: Sequence[dict], variable: bool = False
                           ) -> tuple[int, int]:
    """All micro-batches must share one ``[B, S]`` shape (the pipeline's P2P buffers are fixed),
    unless ``variable`` (the model config's ``variable_seq_lengths``: the P2P sends each shape).

    Returns ``(B, S)`` (the largest of each with ``variable``).
    """
    if not micro_batches:
        raise ValueError("no micro-batches given")
    shapes = {tuple(mb["tokens"].shape) for mb in micro_batches}
    if len(shapes) != 1 and not variable:
        raise ValueError(f"micro-batches must share one [B, S] shape, got {sorted(shapes)}; pad "
                         "them to a common length")
    for i, mb in enumerate(micro_batches):
        if mb["mask"].shape != mb["tokens"].shape:
            raise ValueError(f"micro-batch {i}: mask shape {tuple(mb['mask'].shape)} != tokens "
                             f"shape {tuple(mb['tokens'].shape)}")
        if mb["mask"][:, 0].any():
            raise ValueError(f"micro-batch {i}: position 0 is marked as a response token; it "
                             "has no preceding position to be scored from")
    return max(s[0] for s in shapes), max(s[1] for s in shapes)


def variable_lengths(model: torch.nn.Module) -> bool:
    """Whether ``model`` (any wrapper of a megatron module) takes micro-batches of their own
    shapes (``config.variable_seq_lengths``, set with a token budget)."""
    return bool(getattr(getattr(model, "config", None), "variable_seq_lengths", False))


@torch.no_grad()
def forward_logprob_entropy(model: torch.nn.Module, micro_batches: Sequence[dict], *,
                            temperature: float = 1.0, compute_entropy: bool = True,
                            chunk_size: int | None = None, fused: bool = False,
                            pack: bool = False, routing=None, record_routing: bool = False,
                            entropy_top_p: float = 1.0) -> list[dict]:
    """Run ``micro_batches`` (dicts with ``tokens`` and ``mask``, ``[B, S]``) through the pipeline.

    ``pack``: run each micro-batch as one packed row (:mod:`megatron_rl.actor.packing`); same
    values. ``routing``: a :class:`~megatron_rl.actor.routing_replay.RoutingReplay`; each
    micro-batch's forward records its expert ids into ``mb["routed_experts"]`` (a view into the
    batch) when ``record_routing``, else replays them.

    Context parallelism (``parallel.cp`` > 1, padded rows): each rank runs its two chunks of
    every row (:mod:`megatron_rl.parallel.context_parallel`) and every CP rank returns the full
    ``[B, S]`` values.

    ``entropy_top_p < 1``: the entropy is the top-p nucleus entropy (SIREN's vocabulary mask).

    Returns, on the last pipeline stage, one dict per micro-batch with ``logp`` and ``entropy``
    (``[B, S]`` fp32, zero outside the mask); an empty list on the other stages.
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_rl.actor.precision import bare_model, model_call_kwargs

    bsz, seq = validate_micro_batches(micro_batches, variable_lengths(model))

    device = next(model.parameters()).device
    call_kwargs = model_call_kwargs(model)  # half precision: keep the hidden states as they are
    head = bare_model(model)

    from megatron.core import parallel_state as ps

    packed = None
    cp = cp_size()
    if pack:
        common = ps.get_pipeline_model_parallel_world_size() > 1  # fixed P2P shapes
        from megatron_rl.actor.packing import PackedMicroBatches  # imports megatron-core

        packed = PackedMicroBatches(micro_batches, common=common, device=device, cp=cp)
    # the response positions of every micro-batch: one host sync here, none per micro-batch
    index = response_indices([mb["mask"].to(device) for mb in micro_batches]) \
        if ps.is_pipeline_last_stage() and packed is None and cp == 1 \
        else [None] * len(micro_batches)

    def forward_step(data_iterator, model_chunk):
        i, mb = next(data_iterator)
        tokens = mb["tokens"].to(device)
        mask = mb["mask"].to(device)
        if routing is not None:
            routing.before_forward(mb, record_routing)
        if packed is not None:
            hidden = packed.model_forward(model_chunk, i, **call_kwargs)
        elif cp > 1:
            hidden = cp_model_forward(model_chunk, tokens, **call_kwargs,
                                      **padding_kwargs(model_chunk, mask))
        else:  # MoE: right padding stays out of the router's statistics
            hidden = model_chunk(tokens, _position_ids(tokens), None, **call_kwargs,
                                 **padding_kwargs(model_chunk, mask))
        if routing is not None:
            routing.after_forward()

        def collect(hidden_states, non_loss_data=True):
            kw = dict(temperature=temperature, compute_entropy=compute_entropy,
                      entropy_grad=False, chunk_size=chunk_size, fused=fused,
                      entropy_top_p=entropy_top_p)
            if packed is not None:
                logp, ent = packed.logprob_entropy(head, hidden_states, i, **kw)
            elif cp > 1:
                logp, ent = cp_response_logprob_entropy(head, hidden_states, tokens, mask, **kw)
            else:
                logp, ent = response_logprob_entropy(head, hidden_states, tokens, mask,
                                                     index=index[i], **kw)
            return {"logp": logp, "entropy": ent}

        return hidden, collect

    was_training = model.training
    model.eval()
    try:
        out = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(list(enumerate(micro_batches))),
            model=[model], num_microbatches=len(micro_batches),
            seq_length=padded_length(seq, cp) if packed is None else packed.seq_length,
            micro_batch_size=bsz if packed is None else packed.micro_batch_size,
            forward_only=True, collect_non_loss_data=True)
    finally:
        model.train(was_training)
        if routing is not None:
            routing.off()
    return list(out)
