"""The planner: parameter counts vs the real megatron model, memory vs hand-computed numbers,
fit flags, the layout search and the CLI on examples/dapo_32b.yaml; mixture-of-experts models
(total vs active parameters, expert state over EP / expert-DP, the all-to-all, EP in the search,
examples/dapo_qwen3_30b_a3b.yaml)."""

from __future__ import annotations

import dataclasses
import os
import re

import pytest

from megatron_rl.cli.app import main
from megatron_rl.config.load import load_config
from megatron_rl.models.config import get_preset
from megatron_rl.parallel.launch import spawn
from megatron_rl.plan.inputs import GIB, PlanError, PlanInputs, inputs_from_config
from megatron_rl.plan.layout_search import search
from megatron_rl.plan.memory import (
    activation_bytes,
    active_params,
    actor_state_bytes,
    checkpoint_host_bytes,
    expert_layer_params,
    optimizer_state_bytes,
    stage_expert_params,
    stage_params,
    total_params,
)
from megatron_rl.plan.report import make_plan
from megatron_rl.plan.step_time import (
    ALLTOALL,
    CP_KV,
    alltoall_bytes,
    alltoall_seconds,
    cp_kv_bytes,
    cp_kv_seconds,
    step_flops,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DAPO_32B = os.path.join(ROOT, "examples", "dapo_32b.yaml")
DAPO_MOE = os.path.join(ROOT, "examples", "dapo_qwen3_30b_a3b.yaml")
DAPO_CP = os.path.join(ROOT, "examples", "dapo_qwen3_8b_32k.yaml")
TINY = get_preset("tiny")  # h 128, f 256, 4 layers, 8 heads, 4 KV heads, head dim 16, V 256
# h 64, 4 layers, 4 heads x 16, 2 KV heads, V 256 untied; 8 experts, top-2, expert FFN 32
TINY_MOE = get_preset("tiny-qwen3-moe")


def test_tiny_param_count_by_hand():
    # per layer: QKV 128*(128+2*64) + bias 256, proj 128*128, SwiGLU 3*128*256, 2 norms 2*128
    layer = 128 * 256 + 256 + 128 * 128 + 3 * 128 * 256 + 2 * 128
    assert total_params(TINY) == 4 * layer + 128 + 2 * 256 * 128  # + final norm + emb + head
    # TP2 x PP2: stage 0 = 2 layers' TP shards + half the embedding
    split = 128 * 256 + 256 + 128 * 128 + 3 * 128 * 256
    assert stage_params(TINY, 2, 2, 0) == 2 * (split // 2 + 256) + 128 * 128
    assert stage_params(TINY, 2, 2, 1) == 2 * (split // 2 + 256) + 128 + 128 * 128


def _count_worker(layouts: tuple) -> list[dict]:
    """Parameters of the real megatron model on this rank, per (preset, tp, pp, ep) layout, and
    those of its routed experts (the builder tags them ``mrl_expert``; at EP > 1 megatron-core
    keeps the same ones out of the dense DP buffer, ``allreduce=False``)."""
    from megatron.core import parallel_state as ps

    from megatron_rl.models.builder import build_gpt_model
    from megatron_rl.parallel import runtime

    out = []
    for preset, tp, pp, ep in layouts:
        runtime.init_parallel(tp=tp, pp=pp, ep=ep, timeout_s=120)
        params = list(build_gpt_model(get_preset(preset), seed=1).parameters())
        expert = [p for p in params if getattr(p, "mrl_expert", False)]
        if ep > 1:
            assert {id(p) for p in expert} == {id(p) for p in params
                                               if not getattr(p, "allreduce", True)}
        out.append({"stage": ps.get_pipeline_model_parallel_rank(),
                    "numel": sum(p.numel() for p in params),
                    "expert": sum(p.numel() for p in expert)})
    runtime.shutdown()
    return out


@pytest.mark.slow
def test_stage_params_match_real_model_tp2_pp2():
    """Dense TP2 x PP2 and MoE PP2 x DP2 x EP2 on 4 ranks: the planner's per-GPU counts."""
    for r in spawn(_count_worker, 4, ((("tiny", 2, 2, 1), ("tiny-qwen3-moe", 1, 2, 2)),),
                   timeout_s=300):
        dense, moe = r
        assert dense["numel"] == stage_params(TINY, 2, 2, dense["stage"]), dense
        assert moe["numel"] == stage_params(TINY_MOE, 1, 2, moe["stage"], 2), moe
        assert moe["expert"] == stage_expert_params(TINY_MOE, 2, 2) == 2 * 4 * 3 * 64 * 32


def test_moe_param_counts_by_hand_and_vs_the_real_model():
    """tiny-qwen3-moe by hand, and the real megatron model built at EP1 (one process):
    total, expert and active parameters."""
    attn = 64 * (64 + 2 * 32) + 64 * 64  # QKV + output projection, no bias
    rep = 2 * 64 + 2 * 16 + 8 * 64  # two RMSNorms, q/k norms, router [8, 64]
    expert = 3 * 64 * 32  # SwiGLU fc1 [64, 64] + fc2 [64, 32]
    outer = 64 + 2 * 256 * 64  # final norm, embedding, output layer
    assert expert_layer_params(TINY_MOE) == 8 * expert
    assert total_params(TINY_MOE) == 4 * (attn + rep + 8 * expert) + outer == 281280
    assert active_params(TINY_MOE) == 4 * (attn + rep + 2 * expert) + outer
    assert active_params(TINY) == total_params(TINY)
    (real,), = spawn(_count_worker, 1, ((("tiny-qwen3-moe", 1, 1, 1),),), timeout_s=300)
    assert real["numel"] == total_params(TINY_MOE) == stage_params(TINY_MOE, 1, 1, 0, 1)
    assert real["expert"] == 4 * 8 * expert == stage_expert_params(TINY_MOE, 1, 1)
    # FLOPs follow the active parameters: a forward is 2 x active body per token
    x = PlanInputs(model=TINY_MOE, precision="fp32", prompt_len=24, response_len=8,
                   responses_per_step=4)
    attn_flops = 4 * 32 * 2 * 4 * 4 * 16 * 32  # tokens x 2 L heads d x seq (causal)
    fwd = 4 * 32 * 2 * 4 * (attn + rep + 2 * expert) + attn_flops + 4 * 8 * 2 * 256 * 64
    assert step_flops(x)["old-policy log-probs"] == fwd


def test_qwen3_30b_a3b_preset_matches_the_model_card():
    """30.5B parameters in total, 29.9B without embeddings, 3.3B active (Qwen's model card)."""
    m = get_preset("qwen3-30b-a3b")
    emb = 2 * 151936 * 2048
    assert round(total_params(m) / 1e9, 1) == 30.5
    assert round((total_params(m) - emb) / 1e9, 1) == 29.9
    assert round(active_params(m) / 1e9, 2) == 3.35


def test_moe_memory_shrinks_with_ep_by_hand():
    """Qwen3-30B-A3B, TP1 x PP1 x DP16: the experts' weights and gradients shrink as 1/EP; their
    distributed-optimizer state is sharded over expert-DP = 16 / EP, so per GPU it stays the same
    (megatron-core shards each buffer over its own group); the dense parts do not move."""
    m = get_preset("qwen3-30b-a3b")
    experts = 48 * 128 * 3 * 2048 * 768
    base = PlanInputs(model=m, dp=16, precision="bf16", recompute="full",
                      distributed_optimizer=True, prompt_len=2048, response_len=8192,
                      n_micro=8, responses_per_step=512)
    ref = actor_state_bytes(base, 0)
    dense = {k: v for k, v in ref.items() if k.startswith("dense ")}
    assert dense == optimizer_state_bytes(total_params(m) - experts, base, prefix="dense ")
    for ep in (1, 2, 4, 8, 16):
        x = dataclasses.replace(base, ep=ep)
        assert x.expert_dp == 16 // ep
        got = actor_state_bytes(x, 0)
        assert got["expert weights"] == experts * 2 / ep
        assert got["expert gradients (fp32)"] == experts * 4 / ep
        assert got["expert main weights (fp32)"] == experts * 4 / ep / (16 // ep)
        assert got["expert Adam moments (fp32)"] == experts * 8 / 16
        assert {k: v for k, v in got.items() if k.startswith("dense ")} == dense
        assert activation_bytes(x) == activation_bytes(base)
        plain = actor_state_bytes(dataclasses.replace(x, distributed_optimizer=False), 0)
        assert plain["expert Adam moments (fp32)"] == experts * 8 / ep
    # per token and layer (bf16, GPU kernels): norms, attention / TP, and the MoE layer's top-8
    # copies (expert in + out, SwiGLU) + fp32 router scores, / TP (each TP rank routes 1 / tp)
    from megatron_rl.plan.memory import layer_activation_elems

    moe = 8 * (2 * 2048 + 3 * 768) + 2 * 128 * 4 / 2
    for tp in (1, 2):
        x = dataclasses.replace(base, tp=tp, dp=16 // tp, ep=8)
        attn = (4096 + 2 * 512 + 4096) / tp
        assert layer_activation_elems(x) == (4 * 2048 + attn + moe / tp, 0.0)
    totals = [make_plan(dataclasses.replace(base, ep=ep)).actor_total for ep in (1, 2, 4, 8)]
    assert totals == sorted(totals, reverse=True) and totals[0] - totals[-1] > 20 * GIB
    with pytest.raises(PlanError, match="num_experts=128 is not divisible by expert_parallel"):
        make_plan(dataclasses.replace(base, ep=3))
    with pytest.raises(PlanError, match=r"ep=32 must divide the ranks of a pipeline stage"):
        make_plan(dataclasses.replace(base, ep=32))


def test_moe_all_to_all_by_hand():
    """Dispatch + combine per layer per pass direction, (EP-1)/EP leaving the rank, NVLink inside
    a node and the NIC across nodes; none for a dense model or at EP1."""
    x = PlanInputs(model=TINY_MOE, dp=4, ep=4, precision="bf16", prompt_len=24, response_len=8,
                   responses_per_step=8, n_micro=2)
    one = 8 * 32 / 4 * 2 * 64 * 2  # this rank's tokens x top-2 x hidden x bf16
    # old-policy forward + update forward and backward, each a dispatch and a combine
    assert alltoall_bytes(x) == 2 * 3 * 4 * one * 3 / 4
    full = dataclasses.replace(x, recompute="full", use_ref=True)  # + recompute + reference
    assert alltoall_bytes(full) == 2 * 5 * 4 * one * 3 / 4
    assert alltoall_seconds(x) == pytest.approx(alltoall_bytes(x) / 200e9)  # one node
    wide = dataclasses.replace(x, dp=16, ep=8, gpus_per_node=4)  # 3 peers local, 4 remote
    assert alltoall_seconds(wide) == pytest.approx(alltoall_bytes(wide) * 4 / 7 / 40e9)
    assert make_plan(x).seconds[ALLTOALL] == pytest.approx(alltoall_seconds(x))
    assert alltoall_bytes(dataclasses.replace(x, ep=1)) == 0
    assert ALLTOALL not in make_plan(dataclasses.replace(x, ep=1)).seconds
    assert ALLTOALL not in make_plan(PlanInputs(model=TINY)).seconds


def test_search_includes_expert_parallelism():
    """MoE layouts take every EP that divides num_experts and TP x DP; a dense model EP1 only."""
    m = get_preset("qwen3-30b-a3b")
    x = PlanInputs(model=m, dp=16, precision="bf16", distributed_optimizer=True,
                   prompt_len=2048, response_len=8192, n_micro=8, responses_per_step=512)
    plans = search(x, 16, recompute=("full",))
    eps = {p.inputs.ep for p in plans}
    assert eps == {1, 2, 4, 8, 16}
    for p in plans:
        i = p.inputs
        assert (i.tp * i.dp) % i.ep == 0 and i.actor_gpus == 16
        assert i.tp == 1 or i.ep > 1  # TP > 1 MoE layers need EP > 1 (models/moe_tp.py)
        assert p.layout == f"TP{i.tp}xPP{i.pp}xDP{i.dp}xEP{i.ep}"
    assert {p.inputs.tp for p in plans} == {1, 2, 4}  # 4 KV heads
    assert plans[0].fits
    assert not any(p.fits for p in plans if p.inputs.pp == 1 and p.inputs.ep == 1)
    dense = search(dataclasses.replace(x, model=get_preset("qwen2.5-7b")), 16,
                   recompute=("full",))
    assert {p.inputs.ep for p in dense} == {1} and "EP" not in dense[0].layout


def test_optimizer_state_by_hand():
    n = 1000
    fp32 = optimizer_state_bytes(n, PlanInputs(model=TINY, precision="fp32"))
    assert sum(fp32.values()) == 16 * n  # weights 4 + grads 4 + Adam 8, no separate main copy
    bf16 = optimizer_state_bytes(n, PlanInputs(model=TINY, precision="bf16", dp=4,
                                               distributed_optimizer=True))
    assert bf16 == {"weights": 2 * n, "main weights (fp32)": 4 * n / 4,
                    "gradients (fp32)": 4 * n, "Adam moments (fp32)": 8 * n / 4}


def test_checkpoint_host_memory_by_hand():
    x = PlanInputs(model=TINY, precision="bf16", tp=2, pp=2, dp=2, distributed_optimizer=True)
    worst = max(stage_params(TINY, 2, 2, s) for s in (0, 1))
    # fp32 main weights + 2 Adam moments, + the model part's fp32 weights on a bf16 load
    assert checkpoint_host_bytes(x) == 16 * worst
    assert checkpoint_host_bytes(dataclasses.replace(x, precision="fp32")) == 12 * worst
    assert checkpoint_host_bytes(dataclasses.replace(x, distributed_optimizer=False)) == 0


def test_activations_by_hand():
    x = PlanInputs(model=TINY, precision="bf16", device="gpu", micro_batch_size=2,
                   prompt_len=24, response_len=8, n_micro=4)
    tokens = 2 * 32
    per_token = 4 * 128 + (128 + 2 * 64 + 128) + 3 * 256  # norms, q k v + out, SwiGLU
    assert sum(activation_bytes(x).values()) == 4 * tokens * per_token * 2
    full = activation_bytes(dataclasses.replace(x, recompute="full"))
    assert sum(full.values()) == 4 * tokens * 128 * 2 + tokens * per_token * 2
    # pipeline: the first stage holds min(pp, n_micro) micro-batches of its layers
    pp2 = activation_bytes(dataclasses.replace(x, pp=2))
    assert sum(pp2.values()) == 2 * 2 * tokens * per_token * 2
    # CPU path: composite RMSNorm (3 tensors each) and plain SwiGLU (4f); SDPA as on GPU
    cpu = activation_bytes(dataclasses.replace(x, device="cpu", precision="fp32"))
    per_token_cpu = 6 * 128 + (128 + 2 * 64 + 128) + 4 * 256
    assert sum(cpu.values()) == 4 * tokens * per_token_cpu * 4


def test_context_parallel_memory_and_kv_exchange_by_hand():
    """CP: each rank holds 1/cp of the tokens plus the K/V gathered from the other CP ranks; the
    head scores 1/cp of the response rows; the K/V exchange per layer and pass direction goes
    over NVLink while TP x CP fits a node; optimizer state shards over DP x CP."""
    x = PlanInputs(model=TINY, precision="bf16", device="gpu", micro_batch_size=2,
                   prompt_len=24, response_len=8, n_micro=4, responses_per_step=8)
    per_token = 4 * 128 + (128 + 2 * 64 + 128) + 3 * 256  # as in test_activations_by_hand
    cp2 = dataclasses.replace(x, cp=2)
    gathered = 2 * 32 * (2 * 4 * 16) / 2  # rows x tokens x K/V per token x (cp - 1) / cp
    assert sum(activation_bytes(cp2).values()) == 4 * (32 * per_token + gathered) * 2
    assert cp2.actor_gpus == 2 and make_plan(cp2).layout == "TP1xPP1xCP2xDP1"
    # old-policy forward + update forward and backward, 4 layers, 8 rows of 32 tokens, bf16
    assert cp_kv_bytes(cp2) == 3 * 4 * 8 * 32 * (2 * 4 * 16 * 2) / 2
    assert cp_kv_seconds(cp2) == pytest.approx(cp_kv_bytes(cp2) / 200e9)
    wide = dataclasses.replace(cp2, tp=8, cp=2)  # TP8 x CP2 spans two nodes
    assert cp_kv_seconds(wide) == pytest.approx(cp_kv_bytes(wide) / 40e9)
    assert make_plan(cp2).seconds[CP_KV] == pytest.approx(cp_kv_seconds(cp2))
    assert CP_KV not in make_plan(x).seconds and cp_kv_bytes(x) == 0
    opt = optimizer_state_bytes(1000, dataclasses.replace(cp2, dp=2, distributed_optimizer=True))
    assert opt["Adam moments (fp32)"] == 8 * 1000 / 4
    with pytest.raises(PlanError, match="cp=2 with ep=2"):
        PlanInputs(model=TINY_MOE, dp=2, ep=2, cp=2).validate()


def test_search_includes_context_parallelism():
    """Dense models: every CP that divides the GPUs (up to max_cp); MoE models: CP 1."""
    x = PlanInputs(model=get_preset("qwen3-8b"), dp=16, precision="bf16",
                   distributed_optimizer=True, prompt_len=2048, response_len=32768, n_micro=4,
                   responses_per_step=64)
    plans = search(x, 16, recompute=("none",))
    assert {p.inputs.cp for p in plans} == {1, 2, 4, 8}  # max_cp 8
    assert all(p.inputs.actor_gpus == 16 for p in plans)
    assert any("CP" in p.layout for p in plans if p.fits)
    moe = PlanInputs(model=get_preset("qwen3-30b-a3b"), dp=16, precision="bf16",
                     distributed_optimizer=True, n_micro=8, responses_per_step=512)
    assert {p.inputs.cp for p in search(moe, 16, recompute=("full",))} == {1}


def test_dapo_qwen3_8b_32k_yaml_plans_with_cp(capsys):
    """The long-context recipe: 32k responses, CP2, and the plan's verdict with and without CP."""
    cfg = load_config(DAPO_CP)
    p = cfg.parallel
    assert (p.tp, p.pp, p.cp, p.dp) == (4, 1, 2, 2)
    assert cfg.rollout.max_new_tokens >= 32768
    assert main(["plan", DAPO_CP]) == 0
    out = capsys.readouterr().out
    assert "verdict: TP4xPP1xCP2xDP2 FITS" in out and f"{CP_KV} " in out
    assert main(["plan", DAPO_CP, "parallel.cp=1", "parallel.dp=4"]) == 1  # no CP: no fit
    assert "verdict: TP4xPP1xDP4 DOES NOT FIT" in capsys.readouterr().out


def test_32b_layouts_flagged():
    m = get_preset("qwen2.5-32b")
    base = PlanInputs(model=m, tp=8, pp=1, dp=8, precision="bf16", micro_batch_size=1,
                      prompt_len=2048, response_len=20480, n_micro=64,
                      responses_per_step=8192, gpu_mem_gb=80)
    good = make_plan(dataclasses.replace(base, recompute="full", distributed_optimizer=True))
    assert good.fits and good.actor_total < 80 * GIB
    # no recompute: 64 layers of 22.5k-token activations cannot fit
    assert not make_plan(dataclasses.replace(base, distributed_optimizer=True)).fits
    # TP1: 32.8B params x 18 bytes on one GPU
    tp1 = make_plan(dataclasses.replace(base, tp=1, dp=64, recompute="full"))
    assert not tp1.fits and tp1.actor["gradients (fp32)"] > 100 * GIB
    with pytest.raises(PlanError, match="divisible"):
        make_plan(dataclasses.replace(base, tp=3))


def test_search_ranks_fitting_layouts_first():
    m = get_preset("qwen2.5-32b")
    x = PlanInputs(model=m, tp=8, pp=1, dp=8, precision="bf16", distributed_optimizer=True,
                   micro_batch_size=1, prompt_len=2048, response_len=20480, n_micro=64,
                   responses_per_step=8192)
    plans = search(x, 64)
    assert plans and plans[0].fits
    assert all(p.inputs.actor_gpus == 64 and p.inputs.tp <= 8 for p in plans)
    fits = [p.fits for p in plans]
    assert fits == sorted(fits, reverse=True)  # every fitting layout before every other
    assert any(not f for f in fits)
    n_fit = sum(fits)
    times = [sum(p.seconds.values()) for p in plans[:n_fit]]
    assert times == sorted(times)
    # the global mini-batch stays the same at every layout
    assert {p.inputs.n_micro * p.inputs.dp for p in plans} == {512}


def test_dapo_32b_yaml_loads_and_plans(capsys):
    cfg = load_config(DAPO_32B)
    assert (cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.dp) == (8, 1, 8)
    assert cfg.rollout.max_new_tokens == 20480 and cfg.rollout.overlong_buffer == 4096
    loss = cfg.loss.build()
    assert (loss.clip_ratio_low, loss.clip_ratio_high, loss.loss_agg_mode) == (
        0.2, 0.28, "token-mean")
    assert cfg.trainer.train_batch_size * cfg.rollout.n == 8192 and cfg.optim.lr == 1e-6
    x = inputs_from_config(cfg, recompute="full", servers=16, server_tp=4)
    assert x.n_micro == 64 and x.servers == 16
    rc = main(["plan", DAPO_32B, "--recompute", "full", "--servers", "16", "--server-tp", "4"])
    out = capsys.readouterr().out
    assert rc == 0 and "verdict: TP8xPP1xDP8 FITS" in out
    assert "rollout: 16 servers x TP4 = 64 GPUs" in out
    assert "no communication:" in out and "expert" not in out  # a dense plan: no MoE lines
    # without recomputation the same layout is flagged and the command says so
    rc = main(["plan", DAPO_32B, "--recompute", "none"])
    assert rc == 1 and "DOES NOT FIT" in capsys.readouterr().out


def test_plan_cli_search_and_errors(capsys):
    rc = main(["plan", DAPO_32B, "--search", "--gpus", "64", "--recompute", "full",
               "--top", "5"])
    out = capsys.readouterr().out
    assert rc == 0 and "rank" in out and "best: TP" in out
    assert main(["plan", DAPO_32B, "--gpus", "60"]) == 2
    assert "not a multiple" in capsys.readouterr().err


def test_dapo_32b_config_has_the_fleet_and_the_memory_settings():
    from megatron_rl.config.load import load_config

    cfg = load_config(DAPO_32B)
    assert cfg.rollout.engine == "sglang"
    sg = cfg.rollout.sglang
    assert (sg.num_servers, sg.tp_size, sg.mem_fraction_static) == (16, 4, 0.85)
    assert (cfg.actor.precision, cfg.actor.recompute, cfg.actor.offload_ref) == ("bf16", "full",
                                                                                 True)
    assert cfg.rollout.n == 16 and cfg.parallel.tp == 8


def test_colocated_layout_memory_is_the_peak_of_its_phases(capsys):
    """Qwen2.5-7B on 8 x 80 GiB, servers on the actor's GPUs: each phase by hand, the verdict
    from the largest phase; the same numbers as a sum would not fit."""
    from megatron_rl.plan.inputs import HOST_LINK_GBPS, RUNTIME_RESERVE_GIB, SERVER_RESERVE_GIB

    m = get_preset("qwen2.5-7b")
    x = PlanInputs(model=m, tp=2, pp=1, dp=4, precision="bf16", recompute="full",
                   distributed_optimizer=True, micro_batch_size=1, prompt_len=1024,
                   response_len=4096, n_micro=16, responses_per_step=512, servers=4,
                   server_tp=2, server_mem_fraction=0.6, gpu_mem_gb=80, colocate=True,
                   sync_bucket_mb=64)
    p = make_plan(x)
    sep = make_plan(dataclasses.replace(x, colocate=False))
    assert sep.colocated is None and p.actor == sep.actor
    weights = total_params(m) * 2 / 2  # bf16 over server TP2
    budget = 0.6 * 80 * GIB
    assert p.server["weights"] == weights
    params = stage_params(m, 2, 1, 0) * 2
    reserve = RUNTIME_RESERVE_GIB * GIB
    emb = m.vocab_size * m.hidden_size * 2  # the largest tensor the stream gathers (> a bucket)
    sync = {"weight sync (actor params + server weights + sync buffers)":
            params + weights + SERVER_RESERVE_GIB * GIB + reserve + 2 * emb + emb}
    want = {"rollout (server budget + trainer runtime)": budget + reserve,
            "update (actor + released server)": sep.actor_total + SERVER_RESERVE_GIB * GIB,
            **sync}
    assert p.colocated == pytest.approx(want)
    assert p.colocated_peak == max(want.values())
    assert p.fits  # the peak fits ...
    assert want["rollout (server budget + trainer runtime)"] + \
        want["update (actor + released server)"] > 80 * GIB  # ... the sum would not
    swap = 2 * sum(optimizer_state_bytes(stage_params(m, 2, 1, 0), x).values()) / \
        (HOST_LINK_GBPS * 1e9)
    assert p.seconds["colocation swaps (host<->device)"] == pytest.approx(swap)
    # the servers' KV cache is released during the sync: a larger budget grows the rollout
    # phase only, until it no longer fits
    big = make_plan(dataclasses.replace(x, server_mem_fraction=0.99))
    assert max(big.colocated, key=big.colocated.get).startswith("rollout")
    assert {k: v for k, v in big.colocated.items() if k.startswith("weight sync")} == \
        pytest.approx(sync)
    assert not big.fits
    with pytest.raises(PlanError, match="colocate: 8 servers x TP2 need 16 GPUs"):
        make_plan(dataclasses.replace(x, servers=8))


def test_plan_colocated_sync_buffers_equal_the_from_tensor_sender_peak():
    """The planner's weight-sync buffers equal the bytes the real sender path keeps at its peak:
    the sync's own loop and ``from_tensor``'s CUDA-IPC path (torch codec, requests stubbed) fed
    by the stream's ``bucketize`` over fresh tensors (TP-gathered ones) of the size of the tiny
    model's largest tensor, counted through the garbage collector. A sender that kept every
    flattened bucket until the probe held one more bucket per request."""
    import torch
    from ipc_sender import sender_pass

    from megatron_rl.convert.stream import bucketize
    from megatron_rl.plan.memory import stream_tensor_bytes, sync_transient_bytes

    x = PlanInputs(model=get_preset("tiny"), tp=2, pp=1, dp=1, precision="fp32",
                   sync_bucket_mb=1, colocate=True)
    t = int(stream_tensor_bytes(x))
    assert t == 2 * 256 * 128 * 4 and 2**20 % t == 0  # fc1 [2F, H] in fp32: 4 per bucket

    def gathered():
        for i in range(3 * 2**20 // t):  # three full buckets
            yield f"w{i}", torch.full((t // 4,), float(i))

    run = sender_pass(bucketize(gathered(), x.sync_bucket_mb * 2**20))
    assert run["err"] is None and run["sent"] == 3 * 2**20
    # a bucket, its flattened copy and the next tensor (already gathered): 2 MiB + 256 KiB
    assert run["peak"] == sync_transient_bytes(x) == 2 * 2**20 + t


def test_plan_cli_reads_colocate_from_the_config(capsys):
    rc = main(["plan", os.path.join(ROOT, "examples", "tiny_dapo.yaml"), "rollout.engine=sglang",
               "rollout.sglang.colocate=true", "rollout.sglang.weight_sync=from_tensor",
               "rollout.sglang.num_servers=1", "--gpu-mem-gb", "80"])
    out = capsys.readouterr().out
    assert rc == 0 and "peak (max of the phases, not their sum)" in out
    assert "colocation swaps (host<->device)" in out


def test_response_length_sample_and_padding_costs():
    """The log-normal sample has the requested mean (before the cap) and p95; padding costs
    order padded > token budget > packed, and packed has no padding."""
    from megatron_rl.plan.lengths import LengthsError, lognormal_sample, padding_costs

    s = lognormal_sample(2000, 6000, 20000, n=2000)
    assert abs(s.mean / 2000 - 1) < 0.03
    assert abs(sorted(s.lengths)[int(0.95 * len(s.lengths))] / 6000 - 1) < 0.03
    padded, budget, packed = padding_costs(s, 500, 2 * 20500, rows_per_rank=64)
    assert padded.tokens == 20500 and packed.tokens == pytest.approx(500 + s.mean)
    assert padded.tokens > budget.tokens >= packed.tokens
    assert padded.pad_fraction > budget.pad_fraction > packed.pad_fraction == 0.0
    assert padded.attn > budget.attn >= packed.attn
    with pytest.raises(LengthsError, match="p95=30000 exceeds the cap"):
        lognormal_sample(2000, 30000, 20000)
    with pytest.raises(LengthsError, match="need 0 < mean < p95"):
        lognormal_sample(7000, 6000, 20000)


def test_length_histogram_written_by_runs_is_read_by_plan(tmp_path, capsys):
    """``response_lengths.json`` accumulates over steps; ``plan --lengths-file`` prices it."""
    import json

    from megatron_rl.metrics.response_lengths import write_histogram
    from megatron_rl.plan.lengths import read_histogram

    write_histogram(str(tmp_path), [100] * 30, 20480)
    path = write_histogram(str(tmp_path), [20480] * 10, 20480)
    data = json.load(open(path))
    assert sum(data["counts"]) == 40 and data["counts"][-1] == 10
    s = read_histogram(path, n=400)
    assert s.cap == 20480 and len(s.lengths) == 400
    assert abs(s.mean - (30 * 160 + 10 * 20320) / 40) < 1  # bin midpoints
    assert main(["plan", DAPO_32B, "--recompute", "full", "--lengths-file", path]) in (0, 1)
    out = capsys.readouterr().out
    assert f"histogram {path} (40 responses)" in out
    rows = {line.split()[0]: line for line in out.splitlines()
            if line.strip().startswith(("padded ", "token budget", "packed "))}
    assert set(rows) == {"padded", "token", "packed"}
    assert re.search(r"\d\.\d\dx", rows["packed"]) and "0.0%" in rows["packed"]
    assert main(["plan", DAPO_32B, "--lengths-file", str(tmp_path / "missing.json")]) == 2
    assert "not a response-length histogram" in capsys.readouterr().err


def test_dapo_qwen3_30b_a3b_yaml_cites_slime_and_fits(capsys):
    """The MoE recipe: slime's settings it keeps, its layout with EP, and the plan's verdict."""
    cfg = load_config(DAPO_MOE)
    p = cfg.parallel
    assert (p.tp, p.pp, p.dp, p.ep) == (1, 1, 16, 8)
    assert cfg.rollout.max_new_tokens == 8192 and cfg.rollout.temperature == 0.8
    assert (cfg.optim.lr, cfg.optim.adam_beta2, cfg.optim.weight_decay) == (1e-6, 0.98, 0.1)
    loss = cfg.loss.build()
    assert (loss.clip_ratio_low, loss.clip_ratio_high) == (0.2, 0.28)
    assert "scripts/run-qwen3-30B-A3B.sh" in open(DAPO_MOE).read()
    rc = main(["plan", DAPO_MOE])
    out = capsys.readouterr().out
    assert rc == 0 and "verdict: TP1xPP1xDP16xEP8 FITS" in out
    assert "3.35B active params per token (8 of 128 experts" in out
    assert "16 experts x 48 layers (EP 8; optimizer state sharded over expert-DP 2" in out
    assert f"{ALLTOALL} " in out and "the MoE all-to-all only" in out
    assert main(["plan", DAPO_MOE, "--ep", "3"]) == 2
    assert "num_experts=128 is not divisible by expert_parallel_size=3" in \
        capsys.readouterr().err
    assert main(["plan", DAPO_MOE, "--gpus", "8", "--pp", "1"]) == 1  # one node: no fit


# ---- rollout from the response lengths, asynchronous totals (issue 38 item 7) ------------------
def test_partial_plan_decode_steps_hand_vectors():
    """Continuous batching: each freed slot takes the next request; the round ends with the
    last request (the makespan in decode steps)."""
    from megatron_rl.plan.rollout_time import decode_steps

    assert decode_steps([10, 10, 10, 40], 4) == 40  # all in flight: the longest response
    assert decode_steps([10, 10, 10, 40], 2) == 50  # slot A: 10, 10; slot B: 10, then 40
    assert decode_steps([40, 10, 10, 10], 2) == 40  # the long one first: B runs 10, 10, 10
    assert decode_steps([10, 10, 10, 40], 1) == 70  # one slot: the sum
    assert decode_steps([7], 16) == 7


def _tiny_rollout(concurrency: int, lengths=(10, 20, 30, 40), cap=64):
    from megatron_rl.plan.lengths import LengthSample
    from megatron_rl.plan.rollout_time import rollout_cost

    x = PlanInputs(model=TINY, prompt_len=16, response_len=cap, responses_per_step=8,
                   servers=2, concurrency=concurrency)
    return rollout_cost(x, LengthSample(tuple(lengths), cap, "hand"))


def test_partial_plan_rollout_priced_from_lengths_by_hand():
    """8 responses on 2 servers = 4 each, lengths 10, 20, 30, 40 (any order), cap 64."""
    all_in = _tiny_rollout(4)  # 4 in flight: 40 steps (the longest); at the cap 1 x 64
    assert (all_in.requests, all_in.slots, all_in.steps, all_in.steps_at_cap,
            all_in.longest) == (4, 4, 40, 64, 40)
    one = _tiny_rollout(1)  # 1 in flight: 10 + 20 + 30 + 40 = 100 steps; at the cap 4 x 64
    assert (one.slots, one.steps, one.steps_at_cap) == (1, 100, 256)
    # a step costs `slots` tokens however many are busy: 4 x 40 vs 1 x 100 token-steps
    assert all_in.decode_s / one.decode_s == pytest.approx(160 / 100)
    assert one.prefill_s == all_in.prefill_s > 0  # prompts: no length effect
    # at the cap, the same contexts: 4 slots x 64 steps vs 1 slot x 256 steps
    assert all_in.decode_at_cap_s == pytest.approx(one.decode_at_cap_s)
    assert all_in.seconds == all_in.prefill_s + all_in.decode_s


def test_partial_plan_totals_sync_and_async_by_hand():
    """Synchronous: phases in sequence; asynchronous: max(rollout, actor) + sync."""
    from megatron_rl.plan.rollout_time import step_totals, sync_seconds

    assert step_totals(10.0, 30.0, 1.0) == (41.0, 31.0)  # generation-bound
    assert step_totals(30.0, 10.0, 1.0) == (41.0, 31.0)  # training-bound
    x = PlanInputs(model=TINY, servers=2, server_tp=4, inter_node_gbps=40.0)
    assert sync_seconds(x) == pytest.approx(total_params(TINY) * 2 / 4 / 40e9)
    assert sync_seconds(dataclasses.replace(x, servers=0)) == 0.0


def test_partial_plan_dapo_32b_prints_both_totals(capsys):
    """The 32B recipe: the rollout at the assumed lengths is below the padded upper bound,
    both totals are printed, and ``rollout.max_staleness=1`` marks the asynchronous one."""
    p = make_plan(inputs_from_config(load_config(DAPO_32B)))
    sync_t, async_t = p.totals()
    roll, sync = p.seconds["rollout (one generation round)"], p.seconds["weight sync"]
    actor = sync_t - roll - sync
    assert sync_t == pytest.approx(sum(p.seconds.values()))
    assert async_t == pytest.approx(max(roll, actor) + sync) and async_t < sync_t
    assert roll < 0.5 * p.rollout.seconds_at_cap  # mean response 28 % of the cap
    assert p.rollout.longest == 20480 and p.rollout.steps >= 20480
    assert main(["plan", DAPO_32B, "rollout.max_staleness=1"]) == 0
    out = capsys.readouterr().out
    sync_line = next(ln for ln in out.splitlines() if "total, synchronous" in ln)
    async_line = next(ln for ln in out.splitlines() if "total, asynchronous" in ln)
    assert "this config" in async_line and "this config" not in sync_line
