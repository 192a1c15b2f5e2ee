"""Each megatron-core CPU compatibility patch is needed: the path it covers fails without it.

One spawned 2-rank pipeline job (TP1xPP2, so P2P and the 1F1B schedule are exercised) switches
each patch off in turn, runs the path the patch documents, expects a failure, switches it back on
and expects success. A patch that stops being needed (e.g. after a megatron-core upgrade) makes
this test fail, so it gets removed instead of silently accumulating.
"""

import pytest
import torch

from megatron_rl.parallel import cpu_compat
from megatron_rl.parallel.launch import spawn


def _scenario(name: str, model, batch) -> None:
    from megatron.core import tensor_parallel

    from megatron_rl.actor.forward import forward_logprob_entropy

    if name == "rng_tracker":
        tensor_parallel.model_parallel_cuda_manual_seed(7)
    elif name == "tensor_cuda":  # tied embeddings across pipeline stages
        from megatron_rl.models.builder import build_gpt_model
        from megatron_rl.models.config import get_preset

        build_gpt_model(get_preset("tiny-llama"), seed=0)
    else:  # current_device (rotary, P2P shapes), cuda_factories (schedule counters, causal mask)
        forward_logprob_entropy(model, batch)


def _compat_worker() -> dict:
    from megatron_rl.check import make_batch
    from megatron_rl.models.builder import build_gpt_model
    from megatron_rl.models.config import get_preset
    from megatron_rl.parallel import runtime

    runtime.init_parallel(tp=1, pp=2, timeout_s=60)
    model = build_gpt_model(get_preset("tiny"), seed=0)
    batch = make_batch(1, 2, 16, 256)
    report = {}
    for name in cpu_compat.PATCH_NAMES:
        with cpu_compat.without(name):
            try:
                _scenario(name, model, batch)
                failed_without = ""
            except Exception as e:  # noqa: BLE001 - any failure shows the patch is needed
                failed_without = f"{type(e).__name__}: {e}"
        _scenario(name, model, batch)  # must work again with the patch back on
        report[name] = failed_without
    report["active"] = cpu_compat.active()
    runtime.shutdown()
    return report


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_every_patch_is_needed():
    reports = spawn(_compat_worker, 2, timeout_s=240)
    for rank, rep in enumerate(reports):
        assert rep["active"] == cpu_compat.PATCH_NAMES
        for name in cpu_compat.PATCH_NAMES:
            assert rep[name], f"rank {rank}: the path of patch {name!r} ran without it"
            assert "CUDA" in rep[name] or "cuda" in rep[name], (name, rep[name])


def test_never_enabled_with_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(RuntimeError, match="never be enabled when CUDA is available"):
        cpu_compat.enable()


def test_unknown_patch_name():
    with pytest.raises(ValueError, match="unknown cpu_compat patch"):
        cpu_compat.enable(exclude=("nope",))


def test_patches_document_what_they_answer():
    for p in cpu_compat.PATCHES:
        assert ".py" in p.answers, p.name
