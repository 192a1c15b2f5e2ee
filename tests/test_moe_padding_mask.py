"""MoE router statistics leave padding out (megatron's ``padding_mask``, True = padding).

With ``model.moe_aux_loss_coeff`` and ``model.moe_z_loss_coeff`` > 0 the router's load-balancing
aux loss and z-loss average over the tokens they are told are valid. The actor's forward passes
mark right padding (unpacked rows) and the filler segment (packed rows) as padding, so adding
either leaves the router weights' gradient unchanged; packed and unpacked rows then give the same
router gradient too. A micro-batch with no valid token keeps one (finite gradients).
"""

import pytest
import torch

from megatron_rl.actor.moe_padding import keep_one_valid_, packed_padding_mask, row_padding_mask
from megatron_rl.parallel.launch import spawn

PRESET, VOCAB, SEQ, EXTRA = "tiny-qwen3-moe", 256, 12, 7
SPANS = [(2, 6), (3, 9), (1, 3), (4, 0)]  # (prompt, response); the last row has no response


# ---- the masks (pure) --------------------------------------------------------------------------
def test_padding_mask_marks_columns_after_the_last_response_token():
    mask = torch.zeros(3, 6, dtype=torch.bool)
    mask[0, 2:4] = True  # length 4
    mask[1, 1] = mask[1, 5] = True  # length 6 (a gap inside is not padding)
    got = row_padding_mask(mask)  # row 2: no response token, all padding
    want = torch.tensor([[0, 0, 0, 0, 1, 1], [0] * 6, [1] * 6], dtype=torch.bool)
    assert torch.equal(got, want)
    empty = row_padding_mask(torch.zeros(2, 3, dtype=torch.bool))  # a filler micro-batch
    assert int((~empty).sum()) == 1 and not empty[0, 0]
    assert torch.equal(packed_padding_mask(5, 3, torch.device("cpu")),
                       torch.tensor([[0, 0, 0, 1, 1]], dtype=torch.bool))
    assert torch.equal(packed_padding_mask(2, 0, torch.device("cpu")),
                       torch.tensor([[0, 1]], dtype=torch.bool))
    assert torch.equal(keep_one_valid_(torch.tensor([[True, False]])),
                       torch.tensor([[True, False]]))


# ---- the router's gradient (one rank) ----------------------------------------------------------
def make_batch(extra: int = 0) -> dict:
    """Right-padded rows of ``SEQ + extra`` columns (the extra ones random tokens, unmasked)."""
    g = torch.Generator().manual_seed(0)
    n, s = len(SPANS), SEQ + extra
    tokens = torch.randint(1, VOCAB, (n, SEQ), generator=g)
    tokens = torch.cat([tokens, torch.randint(1, VOCAB, (n, extra),
                                              generator=torch.Generator().manual_seed(9))], 1)
    mask = torch.zeros(n, s, dtype=torch.bool)
    for b, (p, r) in enumerate(SPANS):
        mask[b, p:p + r] = True
    adv = torch.tensor([1.0, -0.5, 0.7, 0.0])[:, None].expand(n, s)
    noise = torch.zeros(n, s)
    noise[:, :SEQ] = 0.2 * torch.randn(n, SEQ, generator=g)
    return {"tokens": tokens, "mask": mask, "advantages": (adv * mask).contiguous(),
            "noise": noise}


def _router_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        if ".router." in name:
            g = getattr(p, "main_grad", None)
            out[name] = (p.grad if g is None else g).detach().clone()
    return out


def _update_grads(cfg, extra: int, pack: bool) -> dict:
    """Router gradients of one actor update (two micro-batches of two rows)."""
    from megatron_rl.actor.actor import Actor
    from megatron_rl.actor.optim import OptimConfig
    from megatron_rl.actor.train_step import ActorConfig
    from megatron_rl.loss import LossConfig

    batch = make_batch(extra)
    noise = batch.pop("noise")
    actor = Actor(cfg, ActorConfig(micro_batch_size=2, pack_sequences=pack),
                  OptimConfig(lr=1e-3), LossConfig.for_algorithm("dapo"), total_steps=1, seed=7)
    actor.add_old_logprobs(batch)
    batch["old_logp"] = batch["old_logp"] + noise * batch["mask"]
    (metrics,) = actor.update(batch, 0)
    return {"grads": _router_grads(actor.model), "skipped": metrics["actor/skipped"]}


def _packed_grads(model: torch.nn.Module, rows: list[list[int]], common: bool) -> dict:
    """Router gradients of packed forwards of ``rows`` (micro-batches); ``common``: every packed
    row padded to the longest (the shorter ones get a filler segment)."""
    from megatron_rl.actor.packing import PackedMicroBatches

    batch = make_batch()
    mbs = [{k: batch[k][r] for k in ("tokens", "mask")} for r in rows]
    packed = PackedMicroBatches(mbs, common=common)
    model.zero_grad(set_to_none=True)
    g = torch.Generator().manual_seed(4)
    for i, p in enumerate(packed.packs):
        hidden = packed.model_forward(model, i)  # [T, 1, H]
        w = torch.randn(p.used, hidden.shape[-1], generator=g)
        (hidden[:p.used, 0] * w).sum().backward()
    grads = _router_grads(model)
    return {"grads": grads, "lengths": [p.tokens.shape[1] for p in packed.packs],
            "finite": all(bool(torch.isfinite(v).all()) for v in grads.values())}


def _worker() -> dict:
    from megatron_rl.models.builder import build_gpt_model
    from megatron_rl.models.config import get_preset
    from megatron_rl.parallel import runtime

    runtime.init_parallel(tp=1, pp=1, timeout_s=120)
    cfg = get_preset(PRESET).replace(moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.1)
    out = {"update": {(extra, pack): _update_grads(cfg, extra, pack)
                      for extra, pack in ((0, False), (EXTRA, False), (0, True))}}
    model = build_gpt_model(cfg, seed=7).train()
    out["packed"] = {common: _packed_grads(model, [[0, 1], [2, 3]], common)
                     for common in (False, True)}
    out["empty"] = _packed_grads(model, [[3]], False)  # no valid token at all
    runtime.shutdown()
    return out


def _max_rel(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).norm() / b[k].norm().clamp_min(1e-30)) for k in b)


@pytest.mark.timeout(600)
def test_router_padding_mask_keeps_padding_out_of_aux_and_z_losses():
    (out,) = spawn(_worker, 1, timeout_s=500)
    upd = out["update"]
    plain, padded, packed = upd[(0, False)], upd[(EXTRA, False)], upd[(0, True)]
    assert len(plain["grads"]) == 4  # one router per layer
    assert all(float(v.norm()) > 0 for v in plain["grads"].values())
    assert plain["skipped"] == padded["skipped"] == packed["skipped"] == 0.0
    assert _max_rel(padded["grads"], plain["grads"]) < 1e-6  # extra right padding
    assert _max_rel(packed["grads"], plain["grads"]) < 1e-5  # packed: no padding at all
    alone, common = out["packed"][False], out["packed"][True]
    assert alone["lengths"][0] != alone["lengths"][1]
    assert common["lengths"][0] == common["lengths"][1]  # a filler segment in the shorter
    assert _max_rel(common["grads"], alone["grads"]) < 1e-6
    assert out["empty"]["finite"]  # aux loss over zero valid tokens would be 0/0
