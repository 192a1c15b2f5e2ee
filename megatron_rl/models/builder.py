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

import contextlib
import importlib.util
from typing import Any, Iterator

import torch
import torch.nn.functional as F

from megatron_rl.models.attention import masked_softmax_extension_available
from megatron_rl.models.config import ModelConfig, validate_for_layout


def transformer_engine_importable() -> bool:
    """True when ``transformer_engine.pytorch`` imports (the gpu extra is installed)."""
    if importlib.util.find_spec("transformer_engine") is None:
        return False
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # noqa: BLE001 - a broken TE install means "not available"
        return False
    return True


_LOCAL_SPEC_ONLY: list[bool] = []  # non-empty inside local_spec_only()


@contextlib.contextmanager
def local_spec_only() -> Iterator[None]:
    """Inside the block :func:`build_gpt_model` (``use_te=None``) builds megatron's local spec
    even where Transformer Engine is available: LoRA adapters (:mod:`megatron_rl.models.lora`)
    hook megatron's own ``ColumnParallelLinear``/``RowParallelLinear``, not TE's fused
    layer-norm linears."""
    _LOCAL_SPEC_ONLY.append(True)
    try:
        yield
    finally:
        _LOCAL_SPEC_ONLY.pop()


def transformer_engine_available() -> bool:
    """True when Transformer Engine can be used (CUDA present and the package importable)."""
    return torch.cuda.is_available() and transformer_engine_importable()


def rope_fusion_available() -> bool:
    """True when megatron-core's fused RoPE kernels can run: CUDA is present and
    ``rope_utils`` imported both fused functions (``sbhd`` and packed ``thd``), which megatron-core
    0.16 takes from its Transformer Engine extension (None without TE)."""
    if not torch.cuda.is_available():
        return False
    from megatron.core.models.common.embeddings import rope_utils

    return (rope_utils.fused_apply_rotary_pos_emb is not None
            and rope_utils.fused_apply_rotary_pos_emb_thd is not None)


def make_transformer_config(cfg: ModelConfig, params_dtype: torch.dtype = torch.float32,
                            **overrides: Any):
    """megatron ``TransformerConfig`` for ``cfg`` in the current parallel layout."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.transformer_config import TransformerConfig

    tp = ps.get_tensor_model_parallel_world_size()
    pp = ps.get_pipeline_model_parallel_world_size()
    ep = ps.get_expert_model_parallel_world_size()
    cp = ps.get_context_parallel_world_size()
    validate_for_layout(cfg, tp, pp, ep)
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
        # context parallelism: SDPAttention gathers K/V itself (models/attention.py); TE's
        # attention exchanges K/V in a ring ("p2p"), overlapped with the attention compute
        context_parallel_size=cp, cp_comm_type="p2p" if cp > 1 else None,
        params_dtype=params_dtype, pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16, fp16=params_dtype == torch.float16,
        # Full weights are built on CPU then sliced: every layout starts from identical weights.
        use_cpu_initialization=True,
        # Fusions need CUDA kernels; keep the plain paths on CPU.
        bias_activation_fusion=on_gpu, bias_dropout_fusion=on_gpu,
        # The fused softmax needs megatron's compiled extension (not in the wheel); the local
        # spec uses SDPA anyway (models/attention.py).
        masked_softmax_fusion=masked_softmax_extension_available(),
        # Fused RoPE where TE provides it: the unfused packed (THD) path reads cu_seqlens on the
        # host (see actor/packing.py forward_params for how it stays sync-free without TE).
        apply_rope_fusion=rope_fusion_available(), persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        attention_softmax_in_fp32=True,
        # p2p_communication.py calls torch.cuda.synchronize() after batched P2P when this is on;
        # gloo's P2P is synchronous once waited on, so the sync is not needed on CPU.
        batch_p2p_sync=on_gpu,
    )
    if cfg.is_moe:
        define_missing_te_moe_names()
        kwargs.update(moe_kwargs(cfg, ep))
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


_TE_MOE_NAMES = ("fused_compute_score_for_moe_aux_loss", "fused_moe_aux_loss", "fused_permute",
                 "fused_permute_with_probs", "fused_sort_chunks_by_index",
                 "fused_sort_chunks_by_index_with_probs", "fused_topk_with_score_function",
                 "fused_unpermute", "te_general_gemm")


def define_missing_te_moe_names() -> None:
    """megatron-core 0.16 ``transformer/moe/moe_utils.py`` imports its TE kernels in a ``try``
    and, without TE, leaves the names undefined, yet ``RouterGatingLinearFunction`` tests
    ``te_general_gemm is not None`` (a ``NameError`` on every router call). Define the missing
    names as ``None``, the value its checks expect when TE is absent. Idempotent; a no-op with TE.
    """
    from megatron.core.transformer.moe import moe_utils

    for name in _TE_MOE_NAMES:
        if not hasattr(moe_utils, name):
            setattr(moe_utils, name, None)


def moe_kwargs(cfg: ModelConfig, ep: int) -> dict[str, Any]:
    """``TransformerConfig`` fields of a mixture-of-experts model (megatron-core ``MoELayer``).

    Routing follows Hugging Face's Qwen3-MoE: fp32 softmax over all experts, top-k, and with
    ``norm_topk_prob`` the k probabilities renormalised to sum to 1. megatron's
    ``moe_router_pre_softmax=False`` (top-k of the logits, then softmax over those k) is the same
    function, so it stands for ``norm_topk_prob=True``; ``pre_softmax=True`` (softmax, then top-k
    without renormalising) for ``False``. Tokens travel with the ``alltoall`` dispatcher; no token
    is dropped (no capacity factor). Expert tensor parallelism is 1: experts are split whole over
    ``expert_parallel_size`` ranks. ``moe_grouped_gemm`` follows ``cfg.moe_grouped_gemm``
    (:func:`build_gpt_model` then builds ``TEGroupedMLP`` experts).
    """
    return dict(
        num_moe_experts=cfg.num_experts, moe_ffn_hidden_size=cfg.moe_intermediate_size,
        moe_router_topk=cfg.num_experts_per_tok, moe_router_score_function="softmax",
        moe_router_pre_softmax=not cfg.norm_topk_prob, moe_router_dtype="fp32",
        moe_token_dispatcher_type="alltoall",
        moe_router_load_balancing_type="aux_loss" if cfg.moe_aux_loss_coeff > 0 else "none",
        moe_aux_loss_coeff=float(cfg.moe_aux_loss_coeff),
        moe_z_loss_coeff=float(cfg.moe_z_loss_coeff) if cfg.moe_z_loss_coeff > 0 else None,
        expert_model_parallel_size=ep, expert_tensor_parallel_size=1,
        moe_grouped_gemm=cfg.moe_grouped_gemm, moe_permute_fusion=False, moe_router_fusion=False)


def _check_grouped_experts(model: torch.nn.Module) -> None:
    """With ``moe_grouped_gemm`` every MoE layer must hold ``TEGroupedMLP`` experts: an old TE
    without ``GroupedLinear`` makes megatron fall back to the legacy ``GroupedMLP``
    (transformer_engine_spec_provider.py:73-78), whose ``weight1``/``weight2`` tensors
    (``[H, E*2*ffn]``) models/weights.py does not map."""
    from megatron.core.transformer.moe.experts import TEGroupedMLP

    for name, module in model.named_modules():
        if name.endswith(".mlp.experts") and not isinstance(module, TEGroupedMLP):
            raise RuntimeError(f"model.moe_grouped_gemm=true built {type(module).__name__} at "
                               f"{name} (needs TEGroupedMLP: Transformer Engine >= 1.7 with "
                               "GroupedLinear); allowed with this TE: false")


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
    if use_te is None:
        use_te = transformer_engine_available() and not _LOCAL_SPEC_ONLY
    if cfg.moe_grouped_gemm and not (use_te and transformer_engine_available()):
        raise RuntimeError(
            "model.moe_grouped_gemm=true needs Transformer Engine on a CUDA machine (the gpu "
            "extra: pip install -e '.[gpu]'); allowed without it: false")
    if use_te:
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_layer_with_transformer_engine_spec,
        )
        # moe_grouped_gemm=True: TESpecProvider.grouped_mlp_modules (megatron-core 0.16.1
        # extensions/transformer_engine_spec_provider.py:61-73) picks TEGroupedMLP with
        # TEColumn/RowParallelGroupedLinear (transformer/moe/experts.py:512), reached through
        # gpt_layer_specs.py:171-228 -> get_moe_module_spec_for_backend (moe_module_specs.py:32).
        spec = get_gpt_layer_with_transformer_engine_spec(
            num_experts=cfg.num_experts or None, moe_grouped_gemm=cfg.moe_grouped_gemm,
            qk_layernorm=cfg.qk_layernorm)
    else:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        # MoE: SequentialMLP experts (one megatron MLP per expert; no TE / grouped GEMM needed)
        spec = get_gpt_layer_local_spec(num_experts=cfg.num_experts or None,
                                        moe_grouped_gemm=False, qk_layernorm=cfg.qk_layernorm,
                                        normalization="RMSNorm")
        from megatron_rl.models.attention import use_sdpa_core_attention

        use_sdpa_core_attention(spec)  # O(S) attention memory, no fused-softmax extension
    if cfg.is_moe and ps.get_tensor_model_parallel_world_size() > 1:
        from megatron_rl.models.moe_tp import sequence_chunk_moe_layer

        spec.submodules.mlp.module = sequence_chunk_moe_layer()  # TP ranks split the sequence
    model = _actor_class()(
        config=tcfg, transformer_layer_spec=spec, vocab_size=cfg.vocab_size,
        max_sequence_length=cfg.max_position_embeddings,
        pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
        parallel_output=True, share_embeddings_and_output_weights=cfg.tie_word_embeddings,
        position_embedding_type="rope", rotary_base=int(cfg.rope_theta))
    model.model_config = cfg
    # packed rows: megatron's unfused RoPE may read cu_seqlens from the host (SDPAttention
    # accepts the host copy; TE's attention and fused RoPE need them on the device)
    model.host_rope_cu_seqlens = not use_te and not tcfg.apply_rope_fusion
    if cfg.moe_grouped_gemm:
        _check_grouped_experts(model)
    if cfg.is_moe:
        from megatron_rl.models.weights import mark_expert_params

        mark_expert_params(model)
    if seed is not None:
        from megatron_rl.models.weights import init_layout_invariant

        init_layout_invariant(model, cfg.init_method_std, seed)
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    return model
