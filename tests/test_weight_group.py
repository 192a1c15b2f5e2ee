"""The weight-update group is never split from the trainer's communicator (issue 36, item 1).

A trainer on NCCL inits its default group with ``device_id`` (``parallel/runtime.py``), which sets
the default group's ``bound_device_id``; torch 2.13's ``_new_process_group_helper`` then takes a
split source from the default group (``_get_split_source``) and builds every new NCCL group by
``ncclCommSplit`` over all trainer ranks, which SGLang's ranks never join: the first sync hangs.
:func:`megatron_rl.rollout.weight_sync.group.join_weight_group` clears ``bound_device_id`` around
the helper and restores it.

CPU: a gloo default group given the same ``bound_device_id`` that ``device_id=cuda:0`` leaves, a
spy on torch's ``_get_split_source``. GPU (``-m gpu``): a real NCCL default group bound to
``cuda:0`` (world size 1: NCCL refuses two ranks of one communicator on one GPU, so the SGLang
side cannot join on a one-GPU machine) and the real NCCL communicators' split counter.
"""

from __future__ import annotations

import datetime

import pytest
import torch

from megatron_rl.parallel.launch import free_port, spawn


def _bound_device_worker() -> dict:
    """One gloo rank whose default group is bound to ``cuda:0`` (as ``device_id`` binds it on a
    GPU); join a world-size-1 weight group, then fail to make one (a duplicate name), with a spy
    on torch's split-source lookup."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    from megatron_rl.parallel import runtime
    from megatron_rl.rollout.weight_sync.group import (
        join_weight_group,
        leave_weight_group,
        unbound_default_group,
    )

    runtime.init_distributed(backend="gloo", timeout_s=120)
    default = c10d._get_default_group()
    bound = torch.device("cuda", 0)
    default.bound_device_id = bound
    split_lookups: list[str] = []
    real = c10d._get_split_source

    def spy(pg):
        split_lookups.append(str(pg.bound_device_id))
        return real(pg)

    c10d._get_split_source = spy
    out: dict = {}
    try:
        timeout = datetime.timedelta(seconds=60)
        pg = join_weight_group("gloo", "127.0.0.1", free_port(), 1, 0, "mrl_bound_g1", timeout)
        t = torch.arange(4.0)
        pg.broadcast(t, 0).wait()
        out["bound_after_join"] = default.bound_device_id
        try:  # the helper raises (the name exists): the binding must come back all the same
            join_weight_group("gloo", "127.0.0.1", free_port(), 1, 0, "mrl_bound_g1", timeout)
            out["error"] = None
        except ValueError as exc:
            out["error"] = str(exc)
        out["bound_after_error"] = default.bound_device_id
        try:
            with unbound_default_group():
                out["bound_inside"] = default.bound_device_id
                raise RuntimeError("inside")
        except RuntimeError:
            out["bound_after_raise"] = default.bound_device_id
        with unbound_default_group():  # overlapping blocks (two threads' joins): the last restores
            with unbound_default_group():
                pass
            out["bound_after_inner"] = default.bound_device_id
        out["bound_after_outer"] = default.bound_device_id
        leave_weight_group(pg)
    finally:
        c10d._get_split_source = real
    out["split_lookups"] = split_lookups
    default.bound_device_id = None  # a CPU build cannot run a barrier bound to cuda:0
    dist.barrier()
    runtime.shutdown()
    return out


def test_weight_group_clears_bound_device_and_never_splits():
    """No split source is looked up while the group is made; the default group is bound to its
    device again afterwards, also after the helper raised."""
    (out,) = spawn(_bound_device_worker, 1, timeout_s=300)
    assert out["split_lookups"] == [], out["split_lookups"]
    assert out["bound_after_join"] == torch.device("cuda", 0)
    assert out["error"] and "already been created" in out["error"]
    assert out["bound_after_error"] == torch.device("cuda", 0)
    assert out["bound_inside"] is None and out["bound_after_raise"] == torch.device("cuda", 0)
    assert out["bound_after_inner"] is None
    assert out["bound_after_outer"] == torch.device("cuda", 0)


# ---- GPU: real NCCL communicators ---------------------------------------------------------------
def _nccl_split_worker() -> dict:
    """A trainer default group on NCCL bound to ``cuda:0`` (``init_distributed`` passes
    ``device_id``); one weight group made by :func:`join_weight_group` and, as the control, one
    made by torch's helper directly (what ``join_weight_group`` did before): the default
    communicator's split count after a broadcast on each."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    from megatron_rl.parallel import runtime
    from megatron_rl.rollout.weight_sync.group import join_weight_group, leave_weight_group

    runtime.init_distributed(backend="nccl", timeout_s=120)
    default = c10d._get_default_group()
    dev = torch.device("cuda", 0)
    parent = default._get_backend(dev)
    out = {"bound": str(default.bound_device_id), "count0": parent.comm_split_count()}
    timeout = datetime.timedelta(seconds=60)
    pg = join_weight_group("nccl", "127.0.0.1", free_port(), 1, 0, "mrl_gpu_g1", timeout)
    t = torch.ones(8, device=dev)
    pg.broadcast(t, 0).wait()
    torch.cuda.synchronize(dev)
    out["count_ours"] = parent.comm_split_count()
    out["bound_after"] = str(default.bound_device_id)
    leave_weight_group(pg)
    store = c10d.PrefixStore("mrl_gpu_ctl", dist.HashStore())
    ctl, _ = c10d._new_process_group_helper(1, 0, [], c10d.Backend("nccl"), store,
                                            group_name="mrl_gpu_ctl", backend_options=None,
                                            timeout=timeout, device_id=None)
    c10d._world.pg_group_ranks[ctl] = {0: 0}  # as join_weight_group registers its group
    ctl.broadcast(t, 0).wait()
    torch.cuda.synchronize(dev)
    out["count_control"] = parent.comm_split_count()
    leave_weight_group(ctl)
    runtime.shutdown()
    return out


@pytest.mark.gpu
def test_weight_group_bound_device_no_nccl_split_on_gpu():
    """The weight group's NCCL communicator is made from the store (no ``ncclCommSplit`` of the
    trainer's communicator), while a group made the old way is split from it (the control shows
    the counter moves)."""
    (out,) = spawn(_nccl_split_worker, 1, timeout_s=300)
    assert out["bound"] == "cuda:0" and out["bound_after"] == "cuda:0", out
    assert out["count_ours"] == out["count0"], out
    assert out["count_control"] == out["count_ours"] + 1, out
