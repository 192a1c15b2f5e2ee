"""Build megatron-core ``GPTModel`` actors for the current parallel layout.

The local layer spec (with PyTorch SDPA core attention, :mod:`megatron_rl.models.attention`) is
used on CPU (and wherever Transformer Engine is missing); the Transformer
Engine spec is used when TE imports on a CUDA machine. Parameter names differ between the two specs;
:mod:`megatron_rl.models.weights` maps both to one canonical naming.

:class:`ActorGPTModel` returns the last stage's final-norm hidden states ``[S, B, H]`` instead of
logits: the caller selects the response positions first and applies the output layer to those
rows only (:func:`megatron_rl.models.heads.response_logits`), so no prompt-token logits are made.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch
import torch.nn.functional as F

from megatron_rl.models.attention import masked_softmax_extension_available
from megatron_rl.models.config import ModelConfig, validate_for_layout


def transformer_engine_available() -> bool:
    """True when Transformer Engine can be used (CUDA present and the package importable)."""
    if not torch.cuda.is_available() or importlib.util.find_spec("transformer_engine") is None:
        return False
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # noqa: BLE001 - a broken TE install means "not available"
        return False
    return True


def make_transformer_config(cfg: ModelConfig, params_dtype: torch.dtype = torch.float32,
                            **overrides: Any):
    """megatron ``TransformerConfig`` for ``cfg`` in the current parallel layout."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.transformer_config import TransformerConfig

    tp = ps.get_tensor_model_parallel_world_size()
    pp = ps.get_pipeline_model_parallel_world_size()
    validate_for_layout(cfg, tp, pp)
    on_gpu = torch.cuda.is_available()
    kwargs: dict[str, Any] = dict(
        num_layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size,
        ffn_hidden_size=cfg.intermediate_size, num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_key_value_heads, kv_channels=cfg.kv_channels,
        normalization="RMSNorm", layernorm_epsilon=cfg.rms_norm_eps,
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        add_qkv_bias=cfg.qkv_bias, qk_layernorm=cfg.qk_layernorm,
        hidden_dropout=0.0, attention_dropout=0.0, init_method_std=cfg.init_method_std,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        params_dtype=params_dtype, pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16, fp16=params_dtype == torch.float16,
        # Full weights are built on CPU then sliced: every layout starts from identical weights.
        use_cpu_initialization=True,
        # Fusions need CUDA kernels; keep the plain paths on CPU.
        bias_activation_fusion=on_gpu, bias_dropout_fusion=on_gpu,
        # The fused softmax needs megatron's compiled extension (not in the wheel); the local
        # spec uses SDPA anyway (models/attention.py).
        masked_softmax_fusion=masked_softmax_extension_available(),
        apply_rope_fusion=False, persist_layer_norm=False, gradient_accumulation_fusion=False,
        attention_softmax_in_fp32=True,
        # p2p_communication.py calls torch.cuda.synchronize() after batched P2P when this is on;
        # gloo's P2P is synchronous once waited on, so the sync is not needed on CPU.
        batch_p2p_sync=on_gpu,
    )
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


class _HiddenStatesMixin:
    """Make the last pipeline stage return final-norm hidden states ``[S, B, H]``."""

    def _postprocess(self, hidden_states, *args, **kwargs):  # noqa: D401 - megatron hook
        if self.post_process and not getattr(self, "mtp_process", False):
            return hidden_states
        return super()._postprocess(hidden_states, *args, **kwargs)


def _actor_class():
    from megatron.core.models.gpt import GPTModel

    return type("ActorGPTModel", (_HiddenStatesMixin, GPTModel), {})


def build_gpt_model(cfg: ModelConfig, params_dtype: torch.dtype = torch.float32,
                    use_te: bool | None = None, seed: int | None = None,
                    **config_overrides: Any) -> torch.nn.Module:
    """Build this rank's pipeline stage of a ``GPTModel`` for ``cfg``.

    Must be called after :func:`megatron_rl.parallel.runtime.init_parallel`. With ``seed`` the
    weights are initialised layout-invariantly (:func:`megatron_rl.models.weights.
    init_layout_invariant`): the same seed gives the same model at every TP/PP layout. Without it,
    megatron's own initialisation is kept (weights are then expected from a checkpoint).
    The module is on the current CUDA device when CUDA is present, on CPU otherwise.
    """
    from megatron.core import parallel_state as ps

    if seed is not None:
        torch.manual_seed(seed)
    tcfg = make_transformer_config(cfg, params_dtype, **config_overrides)
    use_te = transformer_engine_available() if use_te is None else use_te
    if use_te:
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_layer_with_transformer_engine_spec,
        )
        spec = get_gpt_layer_with_transformer_engine_spec(qk_layernorm=cfg.qk_layernorm)
    else:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        spec = get_gpt_layer_local_spec(qk_layernorm=cfg.qk_layernorm, normalization="RMSNorm")
        from megatron_rl.models.attention import use_sdpa_core_attention

        use_sdpa_core_attention(spec)  # O(S) attention memory, no fused-softmax extension
    model = _actor_class()(
        config=tcfg, transformer_layer_spec=spec, vocab_size=cfg.vocab_size,
        max_sequence_length=cfg.max_position_embeddings,
        pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
        parallel_output=True, share_embeddings_and_output_weights=cfg.tie_word_embeddings,
        position_embedding_type="rope", rotary_base=int(cfg.rope_theta))
    model.model_config = cfg
    if seed is not None:
        from megatron_rl.models.weights import init_layout_invariant

        init_layout_invariant(model, cfg.init_method_std, seed)
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    return model
