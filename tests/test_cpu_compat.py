"""Each megatron-core CPU compatibility patch is needed: the path it covers fails without it.

One spawned 2-rank pipeline job (TP1xPP2, so P2P and the 1F1B schedule are exercised) switches
each patch off in turn, runs the path the patch documents, expects a failure, switches it back on
and expects success. A patch that stops being needed (e.g. after a megatron-core upgrade) makes
this test fail, so it gets removed instead of silently accumulating.
"""

import re
import traceback

import pytest
import torch

from megatron_rl.parallel import cpu_compat
from megatron_rl.parallel.launch import spawn


def _train_step(ddp, optimizer, batch) -> None:
    from megatron.core.pipeline_parallel import get_forward_backward_func

    tokens = batch[0]["tokens"]
    pos = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)

    def forward_step(data_iterator, model_chunk):
        out = model_chunk(next(data_iterator), pos, None)
        return out, lambda o: (o.float().pow(2).mean(), {})

    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter([tokens]),
                                model=[ddp], num_microbatches=1, seq_length=tokens.shape[1],
                                micro_batch_size=tokens.shape[0], forward_only=False)
    optimizer.step()


def _scenario(name: str, model, batch, ddp, optimizer, root: str) -> None:
    import os

    from megatron.core import dist_checkpointing, tensor_parallel

    from megatron_rl.actor.forward import forward_logprob_entropy

    if name == "clip_type_check":  # gradient clipping inside optimizer.step()
        _train_step(ddp, optimizer, batch)
    elif name == "synchronize":  # a dist_checkpointing save
        path = os.path.join(root, f"ckpt_{len(os.listdir(root))}")
        torch.distributed.barrier()
        if torch.distributed.get_rank() == 0:
            os.makedirs(path)
        torch.distributed.barrier()
        dist_checkpointing.save(model.sharded_state_dict(), path)
        torch.distributed.barrier()
    elif name == "rng_tracker":
        tensor_parallel.model_parallel_cuda_manual_seed(7)
    elif name == "tensor_cuda":  # tied embeddings across pipeline stages
        from megatron_rl.models.builder import build_gpt_model
        from megatron_rl.models.config import get_preset

        build_gpt_model(get_preset("tiny-llama"), seed=0)
    elif name == "half_optimizer_type_check":  # the bf16 actor's mixed-precision optimizer
        from megatron_rl.actor.optim import OptimConfig, build_optimizer, wrap_ddp
        from megatron_rl.actor.precision import set_precision, wrap_precision
        from megatron_rl.models.builder import build_gpt_model
        from megatron_rl.models.config import get_preset

        half = build_gpt_model(get_preset("tiny"), seed=0)
        set_precision(half, "bf16")
        build_optimizer(wrap_ddp(wrap_precision(half)), OptimConfig(lr=1e-3), total_steps=1)
    elif name == "distrib_optimizer_type_check":  # optim.use_distributed_optimizer
        from megatron_rl.actor.optim import OptimConfig, build_optimizer, wrap_ddp
        from megatron_rl.models.builder import build_gpt_model
        from megatron_rl.models.config import get_preset

        build_optimizer(wrap_ddp(build_gpt_model(get_preset("tiny"), seed=0), True),
                        OptimConfig(lr=1e-3, use_distributed_optimizer=True), total_steps=1)
    elif name == "moe_dtoh_stream":  # the MoE all-to-all dispatcher
        from megatron_rl.models.builder import build_gpt_model
        from megatron_rl.models.config import get_preset

        build_gpt_model(get_preset("tiny-qwen3-moe"), seed=0)
    elif name == "cp_pos_emb":  # the rotary table's CP split (both ranks as one CP group)
        from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

        emb = RotaryEmbedding(kv_channels=8, rotary_percent=1.0)(
            8, cp_group=torch.distributed.group.WORLD)
        assert emb.shape[0] == 4
    else:  # current_device (rotary, P2P shapes), cuda_factories (schedule counters, causal mask)
        forward_logprob_entropy(model, batch)


def _compat_worker(root: str) -> dict:
    from megatron_rl.actor.optim import OptimConfig, build_optimizer, wrap_ddp
    from megatron_rl.cli.check import make_batch
    from megatron_rl.models.builder import build_gpt_model
    from megatron_rl.models.config import get_preset
    from megatron_rl.parallel import runtime

    runtime.init_parallel(tp=1, pp=2, timeout_s=60)
    model = build_gpt_model(get_preset("tiny"), seed=0)
    batch = make_batch(1, 2, 16, 256)
    ddp = wrap_ddp(model)
    optimizer, _ = build_optimizer(ddp, OptimConfig(lr=1e-3, clip_grad=1e-3), total_steps=10)
    report = {}
    for name in cpu_compat.PATCH_NAMES:
        with cpu_compat.without(name):
            try:
                _scenario(name, model, batch, ddp, optimizer, root)
                failed_without = ""
            except Exception as e:  # noqa: BLE001 - any failure shows the patch is needed
                frames = [f.filename for f in traceback.extract_tb(e.__traceback__)]
                failed_without = (f"{type(e).__name__}: {e}", frames)
        _scenario(name, model, batch, ddp, optimizer, root)  # works again with the patch on
        report[name] = failed_without
    report["active"] = cpu_compat.active()
    runtime.shutdown()
    return report


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_every_patch_is_needed(tmp_path):
    reports = spawn(_compat_worker, 2, (str(tmp_path),), timeout_s=240)
    answers = {p.name: re.findall(r"[\w/]+\.py", p.answers) for p in cpu_compat.PATCHES}
    for rank, rep in enumerate(reports):
        assert rep["active"] == cpu_compat.PATCH_NAMES
        for name in cpu_compat.PATCH_NAMES:
            assert rep[name], f"rank {rank}: the path of patch {name!r} ran without it"
            message, frames = rep[name]
            # The failure comes from (one of) the megatron-core files the patch says it answers.
            assert any(f.endswith(a) for f in frames for a in answers[name]), (name, message,
                                                                               frames[-3:])


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
