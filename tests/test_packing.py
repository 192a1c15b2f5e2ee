"""Sequence packing (issue 25): packed (THD) micro-batches give the padded path's numbers.

Fast tier: the pack layout (in-process); one spawn for SDPAttention on packed rows (per-sequence
loop, document mask, SDPA kernel) vs each sequence alone, with a negative control, and a whole
fp64 model packed vs padded (exact). Slow tier: one spawn per layout (TP1xPP1xDP1, TP2xPP2xDP1,
TP1xPP1xDP2) running DAPO, GSPO and Clip-Cov padded, packed, and packed in token-budget
micro-batches from identical weights and batch
(per-token log-probs/entropy, loss, metrics, gradients, updated weights; fp32, gloo) plus the
refusal of megatron's own local attention; 3 steps of the main recipe packed vs padded. GPU tier:
the varlen kernel and a bf16 update on CUDA."""

from __future__ import annotations

import inspect

import pytest
import torch

from megatron_rl.parallel.launch import spawn

GLOBAL_SEQS, SEQ, VOCAB = 8, 24, 256
# (prompt, response) per row: long-tailed, one row at the cap, one empty (an overlong-filtered
# or filler row), so packing removes real padding
SPANS = [(3, 12), (5, 3), (2, 22), (6, 4), (4, 0), (3, 7), (5, 2), (2, 9)]
# (pack_sequences, max_tokens_per_micro_batch): the padded reference first
VARIANTS = [(False, 0), (True, 0), (True, 32)]


def make_global_batch(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (GLOBAL_SEQS, SEQ), generator=g)
    mask = torch.zeros(GLOBAL_SEQS, SEQ, dtype=torch.bool)
    for b, (p, r) in enumerate(SPANS):
        mask[b, p:p + r] = True
        tokens[b, p + r:] = 0  # right padding
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5, 0.0, 0.8, -0.3, 0.2])[:, None].expand(
        GLOBAL_SEQS, SEQ).contiguous()
    noise = 0.3 * torch.randn(GLOBAL_SEQS, SEQ, generator=g)
    return {"tokens": tokens, "mask": mask, "advantages": adv * mask, "old_noise": noise}


def test_pack_layout():
    """Valid tokens only, positions restarting at 0, one filler segment, cu_seqlens, lengths."""
    from megatron_rl.actor.packing import PackedMicroBatches, row_lengths

    batch = make_global_batch()
    lens = row_lengths(batch["mask"])
    assert lens.tolist() == [p + r if r else 0 for p, r in SPANS]
    mbs = [{k: v[:4] for k, v in batch.items()}, {k: v[4:] for k, v in batch.items()}]
    packed = PackedMicroBatches(mbs, common=True, multiple=4)
    p0, p1 = packed.packs
    assert packed.seq_length == 60 and p0.tokens.shape == p1.tokens.shape == (1, 60)
    assert p0.params.qkv_format == "thd"
    assert p0.params.cu_seqlens_q.tolist() == [0, 15, 23, 47, 57, 60]
    assert p1.params.cu_seqlens_q.tolist() == [0, 10, 17, 28, 60]  # the empty row: no segment
    assert p0.params.max_seqlen_q == 24 and p1.params.max_seqlen_q == 32
    assert p0.position_ids[0, 15:23].tolist() == list(range(8))
    assert torch.equal(p0.tokens[0, 23:47], batch["tokens"][2])
    assert packed.used_tokens == 85 and packed.processed_tokens == 120
    per_micro = PackedMicroBatches(mbs, common=False)
    assert [p.tokens.shape[1] for p in per_micro.packs] == [57, 28]


def _attention_module(heads: int, groups: int):
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_rl.models.attention import SDPAttention
    from megatron_rl.models.builder import make_transformer_config
    from megatron_rl.models.config import ModelConfig

    cfg = ModelConfig(family="qwen2", vocab_size=64, hidden_size=16 * heads,
                      intermediate_size=64, num_hidden_layers=1, num_attention_heads=heads,
                      num_key_value_heads=groups, max_position_embeddings=64)
    return SDPAttention(make_transformer_config(cfg), 1, AttnMaskType.causal, "self")


def _attention_worker() -> dict:
    """SDPAttention on packed rows (both CPU modes and the SDPA kernel) vs each sequence alone."""
    from megatron_rl.actor.packing import pack_micro_batch
    from megatron_rl.parallel import runtime

    runtime.init_parallel(tp=1, pp=1, timeout_s=120)
    out = {}
    lens = [5, 9, 3]
    pk = pack_micro_batch(torch.zeros(3, 9, dtype=torch.long), lens, 20)  # filler of 3
    g = torch.Generator().manual_seed(0)
    for name, heads, groups in (("gqa", 4, 2), ("mha", 2, 2)):
        mod = _attention_module(heads, groups)
        q = torch.randn(20, heads, 16, generator=g, requires_grad=True)
        k = torch.randn(20, groups, 16, generator=g, requires_grad=True)
        v = torch.randn(20, groups, 16, generator=g, requires_grad=True)
        ref, start = [], 0  # each sequence (and the filler) alone, [S, B=1, h, D]
        for n in (*lens, 3):
            s = slice(start, start + n)
            start += n
            ref.append(mod(q[s, None], k[s, None], v[s, None], None).reshape(n, -1))
        ref = torch.cat(ref)
        (ref_grad,) = torch.autograd.grad((ref * ref).sum(), (q,))
        for mode in ("segments", "mask", "sdpa"):
            mod.packed_cpu_mode = "mask" if mode == "mask" else "segments"
            mod.use_sdpa_on_cpu = mode == "sdpa"
            o = mod(q, k, v, None, packed_seq_params=pk.params).reshape(20, -1)
            (gq,) = torch.autograd.grad((o * o).sum(), (q,))
            out[f"{name}_{mode}"] = max(float((o - ref).abs().max()),
                                        float((gq - ref_grad).abs().max()))
        mod.use_sdpa_on_cpu = False
        mod.packed_cpu_mode = "segments"
        # negative control: one segment spanning everything attends across sequences
        whole = pack_micro_batch(torch.zeros(1, 20, dtype=torch.long), [20], 20)
        o = mod(q, k, v, None, packed_seq_params=whole.params).reshape(20, -1)
        out[f"{name}_unpacked_differs"] = float((o - ref.detach()).abs().max())
    out["fp64"] = _fp64_model_check()
    out["rope"] = _host_rope_check()
    runtime.shutdown()
    return out


def _host_rope_check() -> dict:
    """A packed forward of the tiny model (local spec, unfused RoPE) with and without the host
    copy of ``cu_seqlens`` (:func:`forward_params`): which ``cu_seqlens`` megatron's RoPE got,
    and whether the hidden states are equal."""
    from megatron.core.transformer import attention as mc_attention

    from megatron_rl.actor.packing import PackedMicroBatches, forward_params, host_rope_model
    from megatron_rl.models.builder import build_gpt_model
    from megatron_rl.models.config import get_preset

    model = build_gpt_model(get_preset("tiny"), seed=3)
    batch = make_global_batch()
    pk = PackedMicroBatches([{"tokens": batch["tokens"], "mask": batch["mask"]}], common=False)
    p = pk.packs[0]
    seen = []
    rope = mc_attention.apply_rotary_pos_emb

    def spy(t, freqs, config, cu_seqlens=None, **kwargs):
        seen.append("host" if cu_seqlens is p.params.host_cu_seqlens else
                    "device" if cu_seqlens is p.params.cu_seqlens_q else "other")
        return rope(t, freqs, config, cu_seqlens=cu_seqlens, **kwargs)

    mc_attention.apply_rotary_pos_emb = spy
    try:
        hidden = {}
        with torch.no_grad():
            for host in (False, True):
                hidden[host] = model(p.tokens, p.position_ids, None,
                                     packed_seq_params=forward_params(p.params, host))
    finally:
        mc_attention.apply_rotary_pos_emb = rope
    return {"equal": torch.equal(hidden[True], hidden[False]), "seen": seen,
            "fusion": model.config.apply_rope_fusion, "flag": host_rope_model(model),
            "host_device": str(p.params.host_cu_seqlens.device),
            "host_equal": p.params.host_cu_seqlens.tolist() == p.params.cu_seqlens_q.tolist()}


def _fp64_model_check() -> tuple[float, float]:
    """A whole GPT model in fp64 (attention on SDPA in fp64, not megatron's fp32 softmax): packed
    vs padded log-probs (max abs) and gradients (relative L2). Exact up to fp64 rounding."""
    from megatron_rl.actor.packing import PackedMicroBatches
    from megatron_rl.models.attention import SDPAttention
    from megatron_rl.models.builder import build_gpt_model
    from megatron_rl.models.config import get_preset
    from megatron_rl.models.heads import response_logprob_entropy

    model = build_gpt_model(get_preset("tiny"), params_dtype=torch.float64, seed=3).double()
    for m in model.modules():
        if isinstance(m, SDPAttention):
            m.use_sdpa_on_cpu = True
    batch = make_global_batch()
    tokens, mask = batch["tokens"], batch["mask"]
    weights = torch.randn(mask.shape, generator=torch.Generator().manual_seed(1),
                          dtype=torch.float64)
    res = {}
    for pack in (False, True):
        model.zero_grad()
        if pack:
            pk = PackedMicroBatches([{"tokens": tokens, "mask": mask}], common=False)
            logp, ent = pk.logprob_entropy(model, pk.model_forward(model, 0), 0)
        else:
            pos = torch.arange(SEQ).unsqueeze(0).expand_as(tokens)
            logp, ent = response_logprob_entropy(model, model(tokens, pos, None), tokens, mask)
        (logp * weights + ent).sum().backward()
        res[pack] = (torch.cat([logp, ent]).detach(),
                     {k: p.grad.clone() for k, p in model.named_parameters()})
    return float((res[True][0] - res[False][0]).abs().max()), _l2_rel(res[True][1],
                                                                       res[False][1])


def test_packed_model_is_exact_in_fp64(attention):
    logp_entropy, grads = attention["fp64"]
    assert logp_entropy < 1e-12 and grads < 1e-12, attention["fp64"]


@pytest.fixture(scope="module")
def attention():
    (out,) = spawn(_attention_worker, 1, (), timeout_s=200)
    return out


@pytest.mark.parametrize("kind", ["gqa", "mha"])
def test_sdpa_packed_matches_per_sequence(attention, kind):
    for mode in ("segments", "mask", "sdpa"):
        assert attention[f"{kind}_{mode}"] < 1e-5, attention
    assert attention[f"{kind}_unpacked_differs"] > 1e-2, attention


def test_packed_rope_reads_host_cu_seqlens(attention):
    """Without fused RoPE (no TE), megatron's RoPE on packed rows gets the host copy of
    ``cu_seqlens`` (no device->host sync on CUDA) and computes the same hidden states."""
    r = attention["rope"]
    layers = 4  # the tiny preset; q and k per layer
    assert r["seen"] == ["device"] * 2 * layers + ["host"] * 2 * layers, r["seen"]
    assert r["equal"] and r["host_equal"] and r["host_device"] == "cpu"
    assert r["fusion"] is False and r["flag"] is True


def _one_rank_layout(monkeypatch) -> None:
    """megatron's parallel-state sizes of one rank, without process groups (in-process)."""
    from megatron.core import parallel_state as ps

    for name in ("get_tensor_model_parallel_world_size", "get_pipeline_model_parallel_world_size",
                 "get_expert_model_parallel_world_size"):
        monkeypatch.setattr(ps, name, lambda: 1)


def test_builder_sets_rope_fusion_per_availability(monkeypatch):
    """``apply_rope_fusion`` follows :func:`rope_fusion_available`: on where CUDA is present and
    megatron-core found TE's fused RoPE (both the ``sbhd`` and the packed ``thd`` kernel), off
    otherwise (the unfused path then reads ``cu_seqlens`` on the host)."""
    from megatron.core.models.common.embeddings import rope_utils

    from megatron_rl.models import builder
    from megatron_rl.models.config import get_preset

    _one_rank_layout(monkeypatch)
    cfg = get_preset("tiny")
    assert builder.rope_fusion_available() is (torch.cuda.is_available() and
                                               rope_utils.fused_apply_rotary_pos_emb_thd
                                               is not None)

    def kernel(*args, **kwargs):  # TE's kernels as megatron-core imports them
        raise AssertionError("not called while building a config")

    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb", kernel)
    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb_thd", kernel)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert builder.rope_fusion_available() is True
    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb_thd", None)  # an old TE
    assert builder.rope_fusion_available() is False
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb_thd", kernel)
    assert builder.rope_fusion_available() is False
    for available in (True, False):
        monkeypatch.setattr(builder, "rope_fusion_available", lambda a=available: a)
        assert builder.make_transformer_config(cfg).apply_rope_fusion is available


# ---- varlen_attn of older torch: keywords checked, per-sequence fallback (in-process) ----------
VARLEN_LENS = (5, 9, 3)  # + a filler segment of 3: 20 packed tokens


def varlen_2_9(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False,
               return_aux=None):
    """torch 2.9's signature (``is_causal``; no ``scale``/``window_size``/``enable_gqa``)."""
    raise AssertionError("a varlen_attn without scale/window_size must not be called")


def varlen_2_11(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None,
                scale=None, window_size=(-1, -1)):
    """torch 2.10/2.11's signature (no ``enable_gqa``): causal attention per ``cu_seq_q``
    segment, computed with SDPA (MHA only)."""
    assert query.shape[1] == key.shape[1], "MHA only: this varlen_attn has no enable_gqa"
    assert window_size == (-1, 0)
    return _sdpa_segments(query, key, value, cu_seq_q, scale)


def varlen_2_13(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None,
                scale=None, window_size=(-1, -1), enable_gqa=False, seqused_k=None,
                block_table=None, num_splits=None):
    """torch 2.12+'s signature (the one this project is tested with)."""
    assert window_size == (-1, 0) and enable_gqa == (query.shape[1] != key.shape[1])
    return _sdpa_segments(query, key, value, cu_seq_q, scale)


def _sdpa_segments(q, k, v, cu, scale) -> torch.Tensor:
    """``[T, h, D]`` causal attention within each segment of ``cu`` (a stub kernel's output)."""
    import torch.nn.functional as F

    outs, bounds = [], cu.tolist()
    for a, b in zip(bounds[:-1], bounds[1:]):
        qs, ks, vs = (x[a:b].transpose(0, 1) for x in (q, k, v))
        o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale,
                                           enable_gqa=qs.shape[0] != ks.shape[0])
        outs.append(o.transpose(0, 1))
    return torch.cat(outs)


def _standalone_attention(heads: int, groups: int):
    """An :class:`SDPAttention` built without process groups (TP size 1 given directly)."""
    from types import SimpleNamespace

    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_rl.models.attention import SDPAttention

    cfg = TransformerConfig(num_layers=1, hidden_size=16 * heads, num_attention_heads=heads,
                            num_query_groups=groups, kv_channels=16, attention_dropout=0.0)
    return SDPAttention(cfg, 1, AttnMaskType.causal, "self",
                        pg_collection=SimpleNamespace(tp=SimpleNamespace(size=lambda: 1)))


def _varlen_run(monkeypatch, stub, heads: int, groups: int) -> tuple[torch.Tensor, torch.Tensor,
                                                                      list]:
    """Packed attention with ``stub`` as the installed ``varlen_attn`` (rows made eligible for
    it on CPU) and without any: ``(output, per-sequence output, stub calls)``."""
    from megatron_rl.actor.packing import pack_micro_batch
    from megatron_rl.models import attention as attn_mod

    calls = []

    def spy(*args, **kwargs):
        calls.append(sorted(kwargs))
        return stub(*args, **kwargs)

    spy.__signature__ = inspect.signature(stub)
    pk = pack_micro_batch(torch.zeros(3, 9, dtype=torch.long), list(VARLEN_LENS), 20)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(20, heads, 16, generator=g)
    k, v = (torch.randn(20, groups, 16, generator=g) for _ in "kv")
    mod = _standalone_attention(heads, groups)
    mod.packed_cpu_mode = "segments"  # the per-sequence path
    per_sequence = mod(q, k, v, None, packed_seq_params=pk.params)
    monkeypatch.setattr(attn_mod, "_varlen_attn", spy)
    monkeypatch.setattr(attn_mod.SDPAttention, "_varlen_eligible",
                        staticmethod(lambda query, dropout: True))
    out = mod(q, k, v, None, packed_seq_params=pk.params)
    return out, per_sequence, calls


@pytest.mark.parametrize("stub,heads,groups", [(varlen_2_9, 4, 2), (varlen_2_9, 2, 2),
                                               (varlen_2_11, 4, 2)])
def test_varlen_attn_of_older_torch_falls_back_to_per_sequence_path(monkeypatch, stub, heads,
                                                                   groups):
    """A ``varlen_attn`` without the keywords a call needs is never called (torch 2.9: no
    ``scale``/``window_size``; 2.10-2.11 with GQA: no ``enable_gqa``); the packed rows take the
    per-sequence path and give its output exactly."""
    out, per_sequence, calls = _varlen_run(monkeypatch, stub, heads, groups)
    assert calls == []
    assert torch.equal(out, per_sequence)


@pytest.mark.parametrize("stub,heads,groups,keywords", [
    (varlen_2_11, 2, 2, ["scale", "window_size"]),  # MHA: enable_gqa not needed, not passed
    (varlen_2_13, 2, 2, ["scale", "window_size"]),
    (varlen_2_13, 4, 2, ["enable_gqa", "scale", "window_size"])])
def test_varlen_attn_gets_only_keywords_its_signature_has(monkeypatch, stub, heads, groups,
                                                          keywords):
    """A ``varlen_attn`` that takes the call's keywords is called once per forward with exactly
    those, and its signature is inspected once (cached)."""
    from megatron_rl.models.attention import varlen_keywords

    varlen_keywords.cache_clear()
    out, per_sequence, calls = _varlen_run(monkeypatch, stub, heads, groups)
    assert calls == [keywords]
    assert torch.allclose(out, per_sequence, atol=1e-5)
    assert varlen_keywords.cache_info().misses == 1


# -------------------------------------------------------------------------------------------------
LOSSES = ("dapo", "gspo", "clip_cov")


def _loss_config(name: str):
    from megatron_rl.loss import LossConfig

    if name == "clip_cov":
        return LossConfig.for_algorithm("clip_cov", clip_ratio_low=0.2, clip_ratio_high=0.28,
                                        clip_cov_ratio=0.05, clip_cov_lb=-100.0,
                                        clip_cov_ub=100.0, cov_stat_source="prepass")
    if name == "gspo":  # bounds narrow enough that the sequence-level clip acts
        return LossConfig.for_algorithm("gspo", clip_ratio_low=0.02, clip_ratio_high=0.02)
    return LossConfig.for_algorithm(name)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _l2_rel(a: dict, b: dict) -> float:
    """||a - b|| / ||b|| over all tensors of two same-keyed dicts (this rank's shards)."""
    diff = sum(float((a[k].detach().double() - b[k].detach().double()).pow(2).sum()) for k in b)
    return (diff / sum(float(b[k].detach().double().pow(2).sum()) for k in b)) ** 0.5


def _invariance_worker(tp: int, pp: int, dp: int) -> dict | None:
    """Packed vs padded, same weights/batch/layout, for each loss: old-pass log-probs/entropy,
    loss/metrics, this rank's gradient shards and updated weights of one update."""
    from megatron.core import parallel_state as ps

    from megatron_rl.actor.actor import Actor
    from megatron_rl.actor.optim import OptimConfig
    from megatron_rl.actor.packing import PackingBackendError, check_packing_backend
    from megatron_rl.actor.train_step import ActorConfig
    from megatron_rl.models.config import get_preset
    from megatron_rl.parallel import runtime

    runtime.init_parallel(tp=tp, pp=pp, dp=dp, timeout_s=120)
    dpr = ps.get_data_parallel_rank()
    rows = slice(dpr * GLOBAL_SEQS // dp, (dpr + 1) * GLOBAL_SEQS // dp)
    full = make_global_batch()
    last = ps.is_pipeline_last_stage()
    res: dict = {"logp": 0.0, "entropy": 0.0, "loss": 0.0, "grad": 0.0, "weight": 0.0,
                 "metrics": 0.0, "pad": {}}
    for loss in LOSSES:
        actors, hist = {}, {}
        # padded; packed; packed in token-budget micro-batches (the budget counts packed tokens)
        for variant in VARIANTS:
            pack, budget = variant
            batch = {k: v[rows].clone() for k, v in full.items()}
            noise = batch.pop("old_noise")
            actor = Actor(get_preset("tiny"), ActorConfig(
                micro_batch_size=GLOBAL_SEQS // dp // 2, pack_sequences=pack,
                max_tokens_per_micro_batch=budget),
                OptimConfig(lr=1e-3, adam_eps=1e-6, clip_grad=1.0), _loss_config(loss),
                total_steps=1, seed=7)
            actor.add_old_logprobs(batch)
            if last:
                batch["old_logp"] = batch["old_logp"] + noise * batch["mask"]
            hist[variant] = (batch, actor.update(batch, 0))
            actors[variant] = actor
        b0, h0 = hist[VARIANTS[0]]
        p0 = dict(actors[VARIANTS[0]].model.named_parameters())
        for variant in VARIANTS[1:]:
            b1, h1 = hist[variant]
            if last:
                res["logp"] = max(res["logp"], _rel(b1["old_logp"], b0["old_logp"]))
                res["entropy"] = max(res["entropy"], _rel(b1["old_entropy"], b0["old_entropy"]))
                for m0, m1 in zip(h0, h1, strict=True):
                    res["loss"] = max(res["loss"], abs(m1["actor/loss"] - m0["actor/loss"])
                                      / max(abs(m0["actor/loss"]), 1e-30))
                    for k, v in m0.items():
                        if k in ("actor/pad_fraction", "actor/tokens_per_micro_batch"):
                            continue
                        res["metrics"] = max(res["metrics"], abs(m1[k] - v) / max(abs(v), 1e-6))
                res["pad"][f"{loss}/{variant}"] = (
                    h0[0]["actor/pad_fraction"], h1[0]["actor/pad_fraction"],
                    h0[0]["actor/tokens_per_micro_batch"], h1[0]["actor/tokens_per_micro_batch"])
            p1 = dict(actors[variant].model.named_parameters())
            res[f"grad_{loss}/{variant}"] = _l2_rel({k: p.main_grad for k, p in p1.items()},
                                                    {k: p.main_grad for k, p in p0.items()})
            res["grad"] = max(res["grad"], res[f"grad_{loss}/{variant}"])
            res["weight"] = max(res["weight"], _l2_rel(p1, p0))
    if tp == pp == dp == 1:  # megatron's own local attention cannot run packed rows: refused
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        from megatron_rl.models.builder import make_transformer_config

        plain = GPTModel(config=make_transformer_config(get_preset("tiny")),
                         transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=VOCAB,
                         max_sequence_length=64)
        try:
            check_packing_backend(plain)
            res["refusal"] = None
        except PackingBackendError as e:
            res["refusal"] = str(e)
    keep = last and ps.get_tensor_model_parallel_rank() == 0 and dpr == 0
    runtime.shutdown()
    return res if keep else None


def run_layout(tp: int, pp: int, dp: int) -> dict:
    outs = spawn(_invariance_worker, tp * pp * dp, (tp, pp, dp), timeout_s=500)
    (res,) = [r for r in outs if r is not None]
    return res


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("tp,pp,dp", [(1, 1, 1), (2, 2, 1), (1, 1, 2)])
def test_packed_update_matches_padded(tp, pp, dp):
    res = run_layout(tp, pp, dp)
    assert res["logp"] <= 1e-5 and res["entropy"] <= 1e-5, res
    assert res["loss"] <= 1e-6, res
    # measured: log-probs, entropy and loss bit-identical, gradients <= 5.6e-7 (GEMMs of other
    # shapes round differently; in fp64 the same comparison is exact to 1e-15)
    assert res["grad"] <= 1e-6 and res["weight"] <= 1e-6, res
    assert res["metrics"] <= 1e-5, res
    for loss, (pad_padded, pad_packed, tpm_padded, tpm_packed) in res["pad"].items():
        assert pad_packed < pad_padded and tpm_packed < tpm_padded, (loss, res["pad"])
    if tp == pp == dp == 1:
        msg = res["refusal"]
        assert msg and "DotProductAttention" in msg and "pack_sequences=false" in msg, msg


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_packed_run_matches_padded(tmp_path):
    """The main recipe, 3 RL steps, packed vs padded: identical rewards and accuracies; the
    packed run processes fewer tokens per micro-batch. Both runs in one spawned rank."""
    from megatron_rl.run.serial_runs import train_each
    from tests.test_trainer import metrics

    short = ["parallel.tp=1", "parallel.pp=1", "sft.steps=10", "trainer.total_steps=3",
             "trainer.test_freq=3", "trainer.save_freq=3", "data.val_size=16",
             "rollout.dynamic_sampling=false", "trainer.plots=false"]
    jobs = [(str(pack), "examples/tiny_dapo.yaml",
             [*short, f"output_dir={tmp_path / str(pack)}",
              f"actor.pack_sequences={str(pack).lower()}"])
            for pack in (False, True)]
    results = spawn(train_each, 1, (jobs,), timeout_s=850, env={"CUDA_VISIBLE_DEVICES": ""})[0]
    assert not [r["error"] for r in results.values() if "error" in r], results
    runs = {pack: metrics(tmp_path / str(pack)) for pack in (False, True)}
    assert len(runs[True]) == len(runs[False]) > 0
    discrete = [k for k in runs[False][-1] if k.startswith(("reward", "val/", "acc", "rollout/"))
                and not any(w in k for w in ("time", "logp", "mismatch"))]
    assert discrete, sorted(runs[False][-1])
    for r0, r1 in zip(runs[False], runs[True]):
        assert {k: r0.get(k) for k in discrete} == {k: r1.get(k) for k in discrete}
        if "actor/pad_fraction" in r0:
            assert r1["actor/pad_fraction"] < r0["actor/pad_fraction"], (r0, r1)
    print(discrete)


def _gpu_worker() -> dict:
    """On CUDA: SDPAttention on packed rows (bf16: the varlen kernel; fp32: per-sequence SDPA)
    vs each sequence alone, and a bf16 actor update packed vs padded."""
    from megatron_rl.actor.actor import Actor
    from megatron_rl.actor.optim import OptimConfig
    from megatron_rl.actor.packing import pack_micro_batch
    from megatron_rl.actor.train_step import ActorConfig
    from megatron_rl.models import attention as attn_mod
    from megatron_rl.models.config import get_preset
    from megatron_rl.parallel import runtime

    runtime.init_parallel(tp=1, pp=1, dp=1, timeout_s=120)
    # torch 2.13's varlen_attn takes every keyword of the call (else the per-sequence path runs)
    out: dict = {"varlen": attn_mod._varlen_attn is not None and attn_mod.varlen_call_kwargs(
        attn_mod._varlen_attn, 0.25, True) is not None}
    lens = [5, 9, 3]
    pk = pack_micro_batch(torch.zeros(3, 9, dtype=torch.long, device="cuda"), lens, 20)
    mod = _attention_module(4, 2).cuda()
    g = torch.Generator(device="cuda").manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        q = torch.randn(20, 4, 16, generator=g, device="cuda", dtype=dtype)
        k, v = (torch.randn(20, 2, 16, generator=g, device="cuda", dtype=dtype) for _ in "kv")
        ref, start = [], 0
        for n in (*lens, 3):
            s = slice(start, start + n)
            start += n
            ref.append(mod(q[s, None], k[s, None], v[s, None], None).reshape(n, -1))
        o = mod(q, k, v, None, packed_seq_params=pk.params).reshape(20, -1)
        out[str(dtype)] = float((o.float() - torch.cat(ref).float()).abs().max())
    grads = {}
    for pack in (False, True):
        batch = {k: v.cuda() for k, v in make_global_batch().items()}
        noise = batch.pop("old_noise")
        actor = Actor(get_preset("tiny"), ActorConfig(micro_batch_size=4, precision="bf16",
                                                      pack_sequences=pack),
                      OptimConfig(lr=1e-3, clip_grad=1.0), _loss_config("dapo"), total_steps=1,
                      seed=7)
        actor.add_old_logprobs(batch)
        out[f"logp_{pack}"] = batch["old_logp"].float().cpu()
        batch["old_logp"] = batch["old_logp"] + noise * batch["mask"]
        out[f"metrics_{pack}"] = actor.update(batch, 0)[-1]
        grads[pack] = {k: p.main_grad.float() for k, p in actor.model.named_parameters()}
    out["grad"] = _l2_rel(grads[True], grads[False])
    runtime.shutdown()
    return out


@pytest.mark.gpu
@pytest.mark.timeout(600)
def test_packing_on_cuda():
    (res,) = spawn(_gpu_worker, 1, (), timeout_s=500)
    assert res["varlen"]
    assert res["torch.float32"] < 1e-4 and res["torch.bfloat16"] < 3e-2, res
    assert float((res["logp_True"] - res["logp_False"]).abs().max()) < 0.1
    m0, m1 = res["metrics_False"], res["metrics_True"]
    assert m1["actor/loss"] == pytest.approx(m0["actor/loss"], rel=2e-2, abs=1e-3)
    assert m1["actor/pad_fraction"] < m0["actor/pad_fraction"]
    assert res["grad"] < 0.1, res["grad"]  # bf16 (padded vs packed kernels round differently)


def _rope_sync_worker(fused: bool) -> dict:
    """On CUDA, the tiny model in bf16: one packed forward (autograd on, as in training) under
    ``torch.cuda.set_sync_debug_mode("error")``, where any device->host sync raises. ``fused``:
    megatron's fused RoPE (TE's kernels); else the local spec's unfused RoPE, which reads the
    host copy of ``cu_seqlens``."""
    import traceback

    from megatron_rl.actor.packing import PackedMicroBatches, host_rope_model
    from megatron_rl.models.builder import build_gpt_model
    from megatron_rl.models.config import get_preset
    from megatron_rl.parallel import runtime

    runtime.init_parallel(tp=1, pp=1, dp=1, timeout_s=120)
    model = build_gpt_model(get_preset("tiny"), torch.bfloat16, use_te=None if fused else False,
                            seed=3, apply_rope_fusion=fused).bfloat16()
    batch = {k: v.cuda() for k, v in make_global_batch().items()}
    pk = PackedMicroBatches([{"tokens": batch["tokens"], "mask": batch["mask"]}], common=False)
    pk.model_forward(model, 0)  # warm-up: lazy device state (RoPE frequencies, cuBLAS handles)
    torch.cuda.synchronize()
    error, hidden = None, None
    torch.cuda.set_sync_debug_mode("error")
    try:
        hidden = pk.model_forward(model, 0)
    except RuntimeError:
        error = traceback.format_exc()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    out = {"error": error, "fusion": model.config.apply_rope_fusion,
           "host_rope": host_rope_model(model),
           "finite": hidden is not None and bool(torch.isfinite(hidden).all())}
    runtime.shutdown()
    return out


@pytest.mark.gpu
@pytest.mark.timeout(300)
@pytest.mark.parametrize("fused", [False, True], ids=["unfused_host_cu", "fused_te"])
def test_packed_forward_rope_has_no_host_syncs_on_cuda(fused):
    """A packed forward on CUDA makes no device->host sync: with TE's fused RoPE, and without TE
    with megatron's unfused RoPE reading ``cu_seqlens`` from the host (before: two syncs per
    RoPE call, q and k, in every layer). The fused case needs TE (skipped without it)."""
    if fused:
        from megatron_rl.models.builder import rope_fusion_available

        if not rope_fusion_available():
            pytest.skip("fused RoPE needs Transformer Engine (megatron-core's fused kernels)")
    (res,) = spawn(_rope_sync_worker, 1, (fused,), timeout_s=240)
    assert res["fusion"] is fused and res["host_rope"] is (not fused), res
    assert res["error"] is None, res["error"]
    assert res["finite"], res
