"""Storage faults during a checkpoint write (issue 28, item 4) and checkpoint loading that cannot
run code (item 6).

A write that fails - a file-size limit on one rank (the kernel's EFBIG), a full disk (a small
tmpfs filled up: ENOSPC), a read-only run directory (the tmpfs remounted read-only: EROFS) - must
raise on every rank with an error naming the checkpoint kept, leave no partial directory, keep
``latest`` on the previous checkpoint, and that checkpoint must load with the weights it saved.
The tmpfs cases run in a private mount namespace (``unshare -rm``) and are skipped where that is
not allowed.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys

import pytest
import torch

from megatron_rl.parallel.launch import spawn

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _make_actor(dp: int):
    from test_actor_layout import GLOBAL_SEQS, loss_config

    from megatron_rl.actor.actor import Actor
    from megatron_rl.actor.optim import OptimConfig
    from megatron_rl.actor.train_step import ActorConfig
    from megatron_rl.models.config import get_preset

    return Actor(get_preset("tiny"), ActorConfig(micro_batch_size=GLOBAL_SEQS // dp // 2),
                 OptimConfig(lr=1e-3, adam_eps=1e-6), loss_config(), total_steps=4, seed=7)


def _train_step(actor, dp: int, step: int) -> None:
    from megatron.core import parallel_state as ps
    from test_actor_layout import GLOBAL_SEQS, make_global_batch

    r = ps.get_data_parallel_rank()
    rows = slice(r * GLOBAL_SEQS // dp, (r + 1) * GLOBAL_SEQS // dp)
    batch = {k: v[rows].clone() for k, v in make_global_batch(seed=100 + step).items()}
    batch.pop("old_noise")
    actor.update(actor.add_old_logprobs(batch), step)


def _inject(fault: str, root: str) -> None:
    """Make this process's next writes under ``root`` fail."""
    import resource
    import signal

    if fault == "fsize":  # the kernel refuses writes past 1 KiB with EFBIG
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1024, resource.RLIM_INFINITY))
    elif fault == "full":  # fill the tmpfs: ENOSPC
        with open(os.path.join(root, "filler"), "wb") as f:
            try:
                while True:
                    f.write(b"\0" * (1 << 20))
                    f.flush()
            except OSError:
                pass
    elif fault == "readonly":
        subprocess.run(["mount", "-o", "remount,ro", root], check=True)


def _undo(fault: str, root: str) -> None:
    import resource

    if fault == "fsize":
        resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    elif fault == "full":
        os.remove(os.path.join(root, "filler"))


def _fault_worker(root: str, fault: str, fault_rank: int, dp: int) -> dict:
    from megatron_rl.actor.checkpoint import CheckpointWriteError
    from megatron_rl.models.weights import gather_full_state_dict
    from megatron_rl.parallel import runtime

    runtime.init_parallel(tp=1, pp=1, dp=dp, timeout_s=120)
    rank = torch.distributed.get_rank()
    ckpt = os.path.join(root, "checkpoints")
    actor = _make_actor(dp)
    _train_step(actor, dp, 0)
    actor.save(ckpt, 0, {"next_step": 1})
    saved = gather_full_state_dict(actor.model)
    _train_step(actor, dp, 1)  # the weights move on
    if rank == fault_rank:
        _inject(fault, root)
    error = None
    try:
        actor.save(ckpt, 1, {"next_step": 2})
    except CheckpointWriteError as exc:
        error = str(exc)
    if rank == fault_rank:
        _undo(fault, root)
    listing = sorted(os.listdir(ckpt))
    latest = open(os.path.join(ckpt, "latest")).read()
    fresh = _make_actor(dp)
    info = fresh.resume(ckpt)
    loaded = gather_full_state_dict(fresh.model)
    same = rank != 0 or all(torch.equal(saved[k], loaded[k]) for k in saved)
    runtime.shutdown()
    return {"error": error, "listing": listing, "latest": latest, "step": info["step"],
            "next": info["trainer"]["next_step"], "same": same}


def _check(outs: list[dict], what: str) -> None:
    for o in outs:
        assert o["error"] is not None, "the failed write raised nothing"
        assert "checkpoint step_0000001 was not written" in o["error"], o["error"]
        assert "step_0000000 is kept and loadable" in o["error"], o["error"]
        assert what in o["error"] or "another rank's write failed" in o["error"], o["error"]
        assert o["listing"] == ["latest", "step_0000000"], o["listing"]  # no partial dir
        assert o["latest"] == "step_0000000" and o["step"] == 0 and o["next"] == 1
        assert o["same"], "the kept checkpoint does not hold the weights it saved"


@pytest.mark.slow
def test_write_fails_on_one_rank_of_two(tmp_path):
    """Rank 1 hits a file-size limit (EFBIG) mid-save: both ranks raise, nobody hangs."""
    outs = spawn(_fault_worker, 2, (str(tmp_path), "fsize", 1, 2), timeout_s=300)
    _check(outs, "File too large")
    assert any("File too large" in o["error"] for o in outs)


def _unshare_ok() -> bool:
    if not shutil.which("unshare") or not shutil.which("mount"):
        return False
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /mnt "
                            "2>/dev/null || mount -t tmpfs -o size=1m tmpfs /tmp"],
                           capture_output=True)
    return probe.returncode == 0


def _in_tmpfs(tmp_path, fault: str) -> list[dict]:
    """Run ``_fault_worker`` (one rank) with its run directory on a private 64 MiB tmpfs."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    out = tmp_path / "out.json"
    code = (f"import json, test_storage_faults as t; from megatron_rl.parallel.launch import spawn;"
            f"json.dump(spawn(t._fault_worker, 1, ({str(mnt)!r}, {fault!r}, 0, 1), "
            f"timeout_s=300), open({str(out)!r}, 'w'))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, HERE,
                                                        os.environ.get("PYTHONPATH", "")])}
    res = subprocess.run(["unshare", "-rm", "sh", "-c",
                          f"mount -t tmpfs -o size=64m tmpfs {mnt} && exec {sys.executable} -c "
                          f"\"{code}\""], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return json.load(open(out))


@pytest.mark.slow
@pytest.mark.skipif(not _unshare_ok(), reason="needs unshare -rm and tmpfs mounts")
def test_full_disk_keeps_previous_checkpoint(tmp_path):
    _check(_in_tmpfs(tmp_path, "full"), "is full: 0 bytes free")


@pytest.mark.slow
@pytest.mark.skipif(not _unshare_ok(), reason="needs unshare -rm and tmpfs mounts")
def test_read_only_run_dir_keeps_previous_checkpoint(tmp_path):
    _check(_in_tmpfs(tmp_path, "readonly"), "is read-only")


# ---- loading cannot run code (item 6) ------------------------------------------------------------
class _Evil:
    """Unpickling this runs a shell command (it creates a marker file)."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _fake_checkpoint(root, evil_in: str, marker: str) -> str:
    ckpt = root / "checkpoints" / "step_0000000"
    ckpt.mkdir(parents=True)
    (root / "checkpoints" / "latest").write_text("step_0000000")
    meta = {"step": 0, "layout": (1, 1, 1), "precision": "fp32", "scheduler": None,
            "trainer": {"next_step": 1}}
    if evil_in == "trainer.pt":
        meta["trainer"]["payload"] = _Evil(marker)
    torch.save(meta, ckpt / "trainer.pt")
    if evil_in == ".metadata":
        with open(ckpt / ".metadata", "wb") as f:
            pickle.dump({"state_dict_metadata": _Evil(marker)}, f)
    return str(ckpt)


@pytest.mark.parametrize("evil_in", ["trainer.pt", ".metadata"])
def test_malicious_checkpoint_is_refused(tmp_path, evil_in):
    from megatron_rl.actor.checkpoint import UnsafeCheckpointError, load_checkpoint

    marker = str(tmp_path / "pwned")
    path = _fake_checkpoint(tmp_path, evil_in, marker)
    with pytest.raises(UnsafeCheckpointError, match="refusing to load") as err:
        load_checkpoint(path, model=None)  # refused before any model or collective is touched
    assert os.path.basename(path) in str(err.value) and not os.path.exists(marker)


def test_resume_preflight_refuses_malicious_metadata(tmp_path):
    """``train`` reads the newest checkpoint's metadata before starting: refused, nothing runs."""
    from megatron_rl.actor.checkpoint import UnsafeCheckpointError
    from megatron_rl.config.load import load_config
    from megatron_rl.run.guard import preflight

    marker = str(tmp_path / "pwned")
    _fake_checkpoint(tmp_path, "trainer.pt", marker)
    with pytest.raises(UnsafeCheckpointError):
        preflight(load_config(None, [f"output_dir={tmp_path}"]), log=lambda *_: None)
    assert not os.path.exists(marker)


def test_plain_pickles_pass_the_allow_list(tmp_path):
    """The screen is not vacuous: torch's own checkpoint metadata passes it."""
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        TensorProperties,
        TensorStorageMetadata,
    )

    from megatron_rl.actor.checkpoint import check_pickle_globals

    md = Metadata({"w": TensorStorageMetadata(TensorProperties(dtype=torch.float32),
                                              torch.Size([2, 3]),
                                              [ChunkStorageMetadata(torch.Size([0, 0]),
                                                                    torch.Size([2, 3]))])})
    p = tmp_path / ".metadata"
    with open(p, "wb") as f:
        pickle.dump(md, f)
    check_pickle_globals(str(p))


# ---- ports bind loopback or the configured interface (item 6) ------------------------------------
def test_servers_default_to_loopback():
    """``serve``, the router and fleet-started servers listen on rollout.sglang.host, by default
    127.0.0.1; the weight-sync store's port probe binds the chosen address only."""
    from megatron_rl.cli.app import build_parser
    from megatron_rl.config.sections import SGLangSection
    from megatron_rl.rollout.fleet import router_command, server_command
    from megatron_rl.rollout.weight_sync.from_distributed import free_port

    args = build_parser().parse_args(["serve", "--model-path", "x"])
    assert args.host == "127.0.0.1"
    s = SGLangSection()
    assert s.host == "127.0.0.1"
    for cmd in (server_command(s, 5, "m", None), router_command(s.host, 5)):
        assert cmd[cmd.index("--host") + 1] == "127.0.0.1"
    port = free_port("127.0.0.1")
    import socket

    with socket.socket() as sock:  # the probed port is free on loopback
        sock.bind(("127.0.0.1", port))
