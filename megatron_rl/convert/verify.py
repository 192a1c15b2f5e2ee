"""Numerical checks of a conversion: full-vocabulary logits of our megatron model (any TP/PP layout)
and of the ``transformers`` model on the same tokens."""

from __future__ import annotations

import torch


@torch.no_grad()
def megatron_logits(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor | None:
    """Logits ``[B, S, V]`` (fp32) of ``tokens [B, S]`` through megatron's pipeline schedule.

    TP shards of the vocabulary are all-gathered. Returns the logits on every rank of the last
    pipeline stage, None on the other stages. Collective over the model-parallel group.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    bsz, seq = tokens.shape
    device = next(model.parameters()).device
    tokens = tokens.to(device)
    pos = torch.arange(seq, device=device).unsqueeze(0).expand_as(tokens)

    def forward_step(data_iterator, chunk):
        hidden = chunk(next(data_iterator), pos, None)

        def collect(hidden_states, non_loss_data=True):
            weight = (chunk.shared_embedding_or_output_weight()
                      if chunk.share_embeddings_and_output_weights else None)
            logits, _ = chunk.output_layer(hidden_states, weight=weight)  # [S, B, V/TP]
            full = gather_from_tensor_model_parallel_region(logits)  # [S, B, V]
            return full.transpose(0, 1).float().contiguous()

        return hidden, collect

    model.eval()
    out = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter([tokens]), model=[model],
        num_microbatches=1, seq_length=seq, micro_batch_size=bsz, forward_only=True,
        collect_non_loss_data=True)
    return out[0] if ps.is_pipeline_last_stage() else None


@torch.no_grad()
def hf_logits(hf_dir: str, tokens: torch.Tensor) -> torch.Tensor:
    """Logits ``[B, S, V]`` (fp32) of the ``transformers`` model saved in ``hf_dir`` (local
    files only; eager attention)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32,
                                                 attn_implementation="eager",
                                                 local_files_only=True)
    model.eval()
    return model(input_ids=tokens).logits.float()
