"""Embedded rollout engine: weights streamed from the Megatron actor (TP1 and TP2xPP2) into the
transformers model reproduce the actor's per-token log-probs; a bad sync fails loudly."""

import pytest
import torch

from megatron_rl.parallel.launch import spawn

EOS, PAD = 1, 0


def _engine_worker(tp: int, pp: int, preset: str) -> dict | None:
    from megatron.core import parallel_state as ps

    from megatron_rl.actor.forward import forward_logprob_entropy
    from megatron_rl.convert.stream import iter_hf_weight_buckets
    from megatron_rl.models.builder import build_gpt_model
    from megatron_rl.models.config import get_preset
    from megatron_rl.parallel import runtime
    from megatron_rl.rollout.embedded import EmbeddedEngine
    from megatron_rl.rollout.engine import SamplingParams

    runtime.init_parallel(tp=tp, pp=pp, timeout_s=120)
    cfg = get_preset(preset)
    model = build_gpt_model(cfg, seed=3)
    rank0 = torch.distributed.get_rank() == 0
    engine = EmbeddedEngine(cfg, EOS, PAD) if rank0 else None
    buckets = iter_hf_weight_buckets(model, bucket_bytes=64 * 1024, broadcast_pp=True)
    if rank0:
        checksum = engine.update_weights(buckets, version=1)
    else:
        for _ in buckets:
            pass
    # Rank 0 samples; everybody scores the same sequences with the Megatron actor.
    box = [None]
    if rank0:
        prompts = [[50, 51, 52], [60, 61, 62, 63, 64]]
        comps = engine.generate(prompts, SamplingParams(n=2, max_new_tokens=6, temperature=0.8),
                                seed=0)
        box[0] = [c for group in comps for c in group]
    torch.distributed.broadcast_object_list(box, src=0)
    comps = box[0]
    seq = max(len(c.prompt_ids) + len(c.response_ids) for c in comps)
    tokens = torch.zeros(len(comps), seq, dtype=torch.long)
    mask = torch.zeros(len(comps), seq, dtype=torch.bool)
    engine_lp = torch.zeros(len(comps), seq)
    for i, c in enumerate(comps):
        full = c.prompt_ids + c.response_ids
        tokens[i, :len(full)] = torch.tensor(full)
        mask[i, len(c.prompt_ids):len(full)] = True
        engine_lp[i, len(c.prompt_ids):len(full)] = torch.tensor(c.logprobs)
    outs = forward_logprob_entropy(model, [{"tokens": tokens, "mask": mask}], temperature=0.8)
    out = None
    if ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0:
        diff = float((outs[0]["logp"] - engine_lp)[mask].abs().max())
        out = {"diff": diff, "n": int(mask.sum())}
    if rank0:
        out = dict(out or {}, checksum=checksum, version=engine.weight_version)
    runtime.shutdown()
    return out


def run(tp, pp, preset="tiny") -> dict:
    merged: dict = {}
    for r in spawn(_engine_worker, tp * pp, (tp, pp, preset), timeout_s=300):
        merged.update(r or {})
    return merged


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("tp,pp,preset", [(1, 1, "tiny"), (2, 2, "tiny"), (1, 2, "tiny-llama")])
def test_engine_matches_actor_logprobs(tp, pp, preset):
    res = run(tp, pp, preset)
    assert res["version"] == 1 and len(res["checksum"]) == 64
    assert res["n"] > 0
    assert res["diff"] < 1e-4, res


def test_bad_sync_fails_loudly():
    from megatron_rl.models.config import get_preset
    from megatron_rl.rollout.embedded import EmbeddedEngine, WeightSyncError

    engine = EmbeddedEngine(get_preset("tiny"), EOS, PAD)
    params = dict(engine.model.named_parameters())
    good = [(n, p.detach().clone()) for n, p in params.items()]
    with pytest.raises(WeightSyncError, match="did not send"):
        engine.update_weights([good[:-1]], version=1)
    with pytest.raises(WeightSyncError, match="does not have"):
        engine.update_weights([good + [("model.nope.weight", torch.zeros(1))]], version=1)
    name, t = good[0]
    with pytest.raises(WeightSyncError, match="shape mismatch"):
        engine.update_weights([[(name, t[:1])]], version=1)
    assert engine.update_weights([good], version=2) and engine.weight_version == 2
