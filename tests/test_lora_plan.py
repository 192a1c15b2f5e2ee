"""The planner with LoRA (issue 40): adapter parameter counts by hand, the frozen base without
gradients or optimizer state, no reference copy, and the one-node 32B recipe that fits per
`plan` (including `--search`)."""

from __future__ import annotations

import dataclasses
import os

from megatron_rl.cli.app import main
from megatron_rl.config.load import load_config
from megatron_rl.models.config import get_preset
from megatron_rl.plan.inputs import inputs_from_config
from megatron_rl.plan.memory import actor_breakdown, lora_layer_params
from megatron_rl.plan.report import make_plan

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LORA_32B = os.path.join(ROOT, "examples", "dapo_lora_32b.yaml")
ALL = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


def test_adapter_counts_by_hand():
    """tiny: H 128, QKV out (8 + 2x4) x 16 = 256, ffn 256. rank 4, TP1: qkv 4x128 + 256x4,
    proj 4x128 + 128x4, fc1 4x128 + 512x4, fc2 4x256 + 128x4 = 6656 per layer; the actor's
    optimizer holds 4 x 6656 = 26624 (tests/test_lora.py). TP2: B of column-parallel and A of
    row-parallel layers halve: 512+512, 256+512, 512+1024, 512+512 = 4352."""
    m = get_preset("tiny")
    assert lora_layer_params(m, 4, 1, ALL) == 6656
    assert lora_layer_params(m, 4, 2, ALL) == 4352
    assert lora_layer_params(m, 4, 1, ("linear_qkv",)) == 4 * 128 + 256 * 4


def test_lora_plan_has_frozen_base_and_no_reference_copy():
    cfg = load_config(LORA_32B, ["loss.overrides.use_kl_loss=true",
                                 "loss.overrides.kl_loss_coef=0.001"])
    x = inputs_from_config(cfg)
    _, lora = actor_breakdown(x)
    _, full = actor_breakdown(dataclasses.replace(x, lora_rank=0))
    assert "gradients (fp32)" in full and "gradients (fp32)" not in lora
    assert lora["weights (frozen base)"] == full["weights"]  # the same bf16 base
    assert lora["reference model (the base, adapters off: no copy)"] == 0.0
    adapter_state = sum(v for k, v in lora.items() if k.startswith("LoRA adapter"))
    full_state = full["gradients (fp32)"] + full["Adam moments (fp32)"] + \
        full["main weights (fp32)"]
    assert adapter_state < 0.05 * full_state


def test_dapo_lora_32b_fits_one_node(capsys):
    cfg = load_config(LORA_32B)
    assert cfg.actor.lora.rank == 64 and cfg.actor.lora.scaling == 2.0
    gpus = cfg.parallel.tp * cfg.parallel.pp * cfg.parallel.dp + \
        cfg.rollout.sglang.num_servers * cfg.rollout.sglang.tp_size
    assert gpus == 8
    assert main(["plan", LORA_32B]) == 0
    out = capsys.readouterr().out
    assert "verdict: TP4xPP1xDP1 FITS" in out and "weights (frozen base)" in out
    # full fine-tuning at the same layout does not fit (the reason for LoRA here)
    x = inputs_from_config(cfg)
    assert make_plan(x).fits and not make_plan(dataclasses.replace(x, lora_rank=0)).fits
    assert main(["plan", LORA_32B, "--search", "--gpus", "4", "--top", "3"]) == 0
    assert "best: TP" in capsys.readouterr().out
