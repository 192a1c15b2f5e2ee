"""Asynchronous checkpoint saves (issue 42, item 3): the step goes on while the checkpoint is
written, ``latest`` moves only once the write is complete, a failed or killed write leaves the
previous checkpoint usable."""

import os
import signal
import threading

import pytest
import torch
from test_actor_checkpoint import _make_actor, _step_batch

from megatron_rl.parallel.launch import WorkerError, spawn

STEPS = 4


def _train_step(actor, step: int) -> None:
    batch, noise = _step_batch(step, 1)
    actor.add_old_logprobs(batch)
    batch["old_logp"] = batch["old_logp"] + noise * batch["mask"]
    actor.update(batch, step)


def _params(actor) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in actor.ddp.module.state_dict().items()
            if isinstance(v, torch.Tensor) and not k.endswith("_extra_state")}


def _patch_writer(wrap) -> None:
    """Wrap megatron's background write function (what the writer thread runs)."""
    from megatron.core.dist_checkpointing.strategies.filesystem_async import (
        FileSystemWriterAsync,
    )

    orig = FileSystemWriterAsync.__dict__["write_preloaded_data_multiproc"].__func__
    FileSystemWriterAsync.write_preloaded_data_multiproc = staticmethod(wrap(orig))


def _latest(root: str) -> str | None:
    from megatron_rl.actor.ckpt_index import latest_checkpoint

    path = latest_checkpoint(root)
    return None if path is None else os.path.basename(path)


def _copy_before_optimizer_step(actor, root: str) -> dict:
    """Save with the writer thread's host copy held back until the next optimizer step asks
    for it (were there no such wait: until that step is over). The optimizer step must run
    after the copy, and the checkpoint must hold the save's weights."""
    from megatron_rl.actor import checkpoint as ckpt
    from megatron_rl.actor.checkpoint import load_checkpoint

    gate, order = threading.Event(), []
    stage, wait_staged, opt_step = ckpt._stage_on_host, ckpt.PendingSave.wait_staged, None

    def held_stage(*a, **k):
        gate.wait()
        copies = stage(*a, **k)
        order.append("copied")
        return copies

    def waiting(self):
        gate.set()  # the step asks for the copy: let the writer thread make it now
        wait_staged(self)

    ckpt._stage_on_host, ckpt.PendingSave.wait_staged = held_stage, waiting
    opt_step = actor.optimizer.step
    actor.optimizer.step = lambda *a, **k: (order.append("optimizer step"), opt_step(*a, **k))[1]
    try:
        saved = _params(actor)
        actor.save(root, 1, {"data_position": 2})
        _train_step(actor, 2)  # runs while the copy has not started
        gate.set()
        actor.wait_for_save()
    finally:
        ckpt._stage_on_host, ckpt.PendingSave.wait_staged = stage, wait_staged
        del actor.optimizer.step
    load_checkpoint(os.path.join(root, "step_0000001"), actor.ddp, actor.optimizer)
    return {"copy_order": order, "held_copy_has_save_weights": all(
        torch.equal(saved[k], v) for k, v in _params(actor).items())}


def _async_worker(root: str, kill: bool) -> dict:
    from megatron_rl.actor.checkpoint import CheckpointWriteError, load_checkpoint
    from megatron_rl.parallel import runtime

    runtime.init_parallel(tp=1, pp=1, dp=1, timeout_s=120)
    actor = _make_actor(1, STEPS)
    actor.saver.async_save = True
    out: dict = {}
    _train_step(actor, 0)
    actor.save(root, 0, {"data_position": 1})
    out["latest_after_wait"] = (actor.wait_for_save(), _latest(root))

    # a write held back until the next step changed every parameter in place
    gate = threading.Event()
    _patch_writer(lambda orig: lambda *a, **k: (gate.wait(60), orig(*a, **k))[1])
    _train_step(actor, 1)
    saved = _params(actor)
    actor.save(root, 1, {"data_position": 2})
    out["latest_while_writing"] = _latest(root)
    _train_step(actor, 2)  # the step goes on while the checkpoint is being written
    out["changed_by_next_step"] = any(not torch.equal(saved[k], v)
                                      for k, v in _params(actor).items())
    gate.set()
    actor.wait_for_save()
    out["latest_after_write"] = _latest(root)
    load_checkpoint(os.path.join(root, "step_0000001"), actor.ddp)
    out["saved_weights_written"] = all(torch.equal(saved[k], v)
                                       for k, v in _params(actor).items())

    out.update(_copy_before_optimizer_step(actor, root + "_copy"))

    if kill:  # the process dies while its writer is still busy
        stop = threading.Event()
        _patch_writer(lambda orig: lambda *a, **k: (stop.wait(60), orig(*a, **k))[1])
        actor.save(root, 2, {"data_position": 3})
        os.kill(os.getpid(), signal.SIGKILL)

    def boom(orig):
        def write(*a, **k):
            orig(*a, **k)  # the shards are written and reported, then the writer dies
            raise OSError("injected: the disk went away during the background write")
        return write

    _patch_writer(boom)  # the writer thread fails before finalize
    actor.save(root, 2, {"data_position": 3})
    try:
        actor.wait_for_save()
        out["error"] = None
    except CheckpointWriteError as exc:
        out["error"] = str(exc)
    out["latest_after_failure"] = _latest(root)
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    out["stale_results"] = not filesystem_async._results_queue.empty()  # read by the next save
    out["left_over"] = sorted(n for n in os.listdir(root) if n.startswith("step_0000002"))
    info = actor.resume(root)  # resume reads the previous, complete checkpoint
    out["resumed"] = (info["step"], info["trainer"]["data_position"])
    runtime.shutdown()
    return out


def _resume_worker(root: str) -> tuple[int, int]:
    from megatron_rl.parallel import runtime

    runtime.init_parallel(tp=1, pp=1, dp=1, timeout_s=120)
    actor = _make_actor(1, STEPS)
    info = actor.resume(root)
    runtime.shutdown()
    return info["step"], info["trainer"]["data_position"]


@pytest.mark.timeout(300)
def test_async_save_overlaps_step_and_survives_failed_write(tmp_path):
    root = str(tmp_path / "ckpt")
    out = spawn(_async_worker, 1, (root, False), timeout_s=240)[0]
    assert out["latest_after_wait"] == (os.path.join(root, "step_0000000"), "step_0000000")
    assert out["latest_while_writing"] == "step_0000000"  # not moved before the write completed
    assert out["changed_by_next_step"]
    assert out["latest_after_write"] == "step_0000001"
    assert out["saved_weights_written"]  # the weights of the save's step, not the next step's
    # the host copy runs in the writer thread; the next optimizer step waits for it
    assert out["copy_order"][0] == "copied" and "optimizer step" in out["copy_order"]
    assert out["held_copy_has_save_weights"]
    assert out["error"] and "injected: the disk went away" in out["error"]
    assert "step_0000001" in out["error"]  # names the checkpoint kept
    assert out["latest_after_failure"] == "step_0000001"
    assert out["left_over"] == []  # the partial step_0000002.tmp is removed
    assert not out["stale_results"]  # the abandoned save's write results were dropped
    assert out["resumed"] == (1, 2)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_async_save_killed_during_write_resumes_previous(tmp_path):
    root = str(tmp_path / "ckpt")
    with pytest.raises(WorkerError):
        spawn(_async_worker, 1, (root, True), timeout_s=240)
    assert _latest(root) == "step_0000001"
    assert spawn(_resume_worker, 1, (root,), timeout_s=240)[0] == (1, 2)


def test_async_save_config_is_validated():
    from megatron_rl.config.errors import ConfigError
    from megatron_rl.config.load import load_config

    assert load_config(None, []).trainer.async_save is False
    assert load_config(None, ["trainer.async_save=true"]).trainer.async_save is True
    with pytest.raises(ConfigError, match="trainer.async_save must be true or false"):
        load_config(None, ["trainer.async_save=3"])


@pytest.mark.gpu
def test_async_save_gpu_host_copy_in_writer_thread_after_training_stream():
    """CUDA: the writer thread's host copy waits for the training stream's last write before
    the save (the event recorded at the save) and lands in pinned host memory; a later write
    on the device does not reach it."""
    from megatron_rl.actor.checkpoint import _stage_on_host

    src = torch.randn(2048, 2048, device="cuda")
    want = src.double().mul(3).float().cpu()
    torch.cuda.synchronize()
    torch.cuda._sleep(50_000_000)  # the stream is busy when the update below is queued
    src.mul_(3)  # the training step's last update, still queued
    ready = torch.cuda.Event()
    ready.record()
    out: dict = {}
    writer = threading.Thread(target=lambda: out.update(
        buckets=_stage_on_host([("f", "k", ([], [("item", src)]))], [], ready)))
    writer.start()
    writer.join()
    src.add_(1)  # the next optimizer step
    copy = out["buckets"][0][2][1][0][1]
    assert not copy.is_cuda and copy.is_pinned()
    assert torch.equal(copy, want)
