"""Layout invariance of the Megatron actor: same weights, same batch -> same per-token log-prob and
entropy at TP1xPP1, TP2xPP2 and TP4xPP1 (weights resharded by megatron_rl.models.weights)."""

import pytest
import torch

from megatron_rl.cli.check import compare, make_batch, run_layout

ATOL = 1e-5


@pytest.fixture(scope="module")
def reference():
    batches = make_batch(micro_batches=2, batch=2, seq=24, vocab=256, seed=3)
    ref = run_layout(1, 1, "tiny", batches, None, seed=11)
    return batches, ref


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("tp,pp", [(2, 2), (4, 1)])
def test_layout_matches_tp1pp1(reference, tp, pp):
    batches, ref = reference
    got = run_layout(tp, pp, "tiny", batches, ref["state"], seed=99)
    dl, de, n = compare(ref["outs"], got["outs"], [b["mask"] for b in batches])
    assert n == sum(int(b["mask"].sum()) for b in batches) > 0
    assert dl <= ATOL and de <= ATOL, (dl, de)
    for g, b in zip(got["outs"], batches):  # nothing outside the response
        assert torch.all(g["logp"][~b["mask"]] == 0) and torch.all(g["entropy"][~b["mask"]] == 0)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_negative_control_without_resharding(reference):
    """A different initialisation (no weight loading) must be detected by the same comparison."""
    batches, ref = reference
    got = run_layout(2, 1, "tiny", batches, None, seed=99)
    dl, de, _ = compare(ref["outs"], got["outs"], [b["mask"] for b in batches])
    assert dl > 1e-3 and de > 1e-3


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-llama"])
def test_families_tp2pp2(preset):
    """Qwen3 (q/k norm) and Llama (tied embeddings, PP>1 copy of the embedding) reshard too."""
    batches = make_batch(1, 2, 16, 256, seed=5)
    ref = run_layout(1, 1, preset, batches, None, seed=1, temperature=0.7)
    got = run_layout(2, 2, preset, batches, ref["state"], seed=2, temperature=0.7, chunk_size=3)
    dl, de, _ = compare(ref["outs"], got["outs"], [b["mask"] for b in batches])
    assert dl <= ATOL and de <= ATOL, (dl, de)
