"""The weight-update process group, joined exactly as SGLang's receivers join it.

Every SGLang TP rank handles ``/init_weights_update_group`` with
``init_custom_process_group(backend, init_method="tcp://ADDR:PORT", world_size, rank,
group_name)`` (``sglang/srt/utils/common.py``): a ``tcp://`` rendezvous (rank 0 hosts the
``TCPStore``), the store wrapped in ``PrefixStore(group_name)``, then torch's
``_new_process_group_helper`` (which adds its own ``"{group_name}/"`` and ``"{device}/"``
prefixes) outside the default group. A sender that builds a bare ``TCPStore`` +
``ProcessGroupGloo/NCCL`` uses other store keys and never meets them. :func:`join_weight_group`
goes through the same steps (our own code, for processes without the ``sglang`` package), so the
trainer's sender (rank 0) and every SGLang rank (``rank_offset + tp_rank``) meet, on NCCL (GPU)
or gloo (CPU). The host's store holds the same keys but listens on ``master_address`` only
(:func:`megatron_rl.parallel.netbind.rendezvous_store`), not on every interface.

The group is never split from the trainer's communicator. A default group made with
``init_process_group(device_id=...)`` (the trainer on NCCL: :func:`megatron_rl.parallel.runtime.
init_distributed`) carries ``bound_device_id``, and torch's ``_new_process_group_helper`` then
builds every new NCCL group with ``split_from`` = the default group's communicator (its test
``is_initialized() and _get_default_group().bound_device_id``, torch 2.13). The first collective
runs ``ncclCommSplit``, collective over *every* trainer rank, and never publishes the unique id
that SGLang's ranks (joining without ``device_id``) wait for in the store: both sides hang.
:func:`unbound_default_group` clears ``bound_device_id`` around the helper call and restores it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from datetime import timedelta

import torch.distributed as dist

DEFAULT_TIMEOUT = timedelta(seconds=300)
_UNBOUND_LOCK = threading.Lock()  # guards _UNBOUND (never held while a group is being made)
_UNBOUND: dict = {"depth": 0, "saved": None}  # blocks inside unbound_default_group; the binding


@contextlib.contextmanager
def unbound_default_group() -> Iterator[None]:
    """Within the block, the default group (if any) has no ``bound_device_id``, so torch makes
    new groups with their own communicator (store rendezvous) instead of splitting the default
    one; the binding is restored when the last such block of this process exits, also when it
    raises. Blocks in several threads overlap safely; none waits for another (a gloo group's
    helper blocks until every rank joined)."""
    if not dist.is_initialized():
        yield
        return
    from torch.distributed.distributed_c10d import _get_default_group

    default = _get_default_group()
    with _UNBOUND_LOCK:
        if _UNBOUND["depth"] == 0:
            _UNBOUND["saved"] = default.bound_device_id
            default.bound_device_id = None
        _UNBOUND["depth"] += 1
    try:
        yield
    finally:
        with _UNBOUND_LOCK:
            _UNBOUND["depth"] -= 1
            if _UNBOUND["depth"] == 0:
                default.bound_device_id, _UNBOUND["saved"] = _UNBOUND["saved"], None


def join_weight_group(backend: str, master_address: str, master_port: int, world_size: int,
                      rank: int, group_name: str, timeout: timedelta = DEFAULT_TIMEOUT):
    """Join (rank 0: host) the group ``group_name``; returns the ``ProcessGroup``.

    Blocks until all ``world_size`` ranks have joined. ``group_name`` must be new in this
    process (destroy the previous group with :func:`leave_weight_group` first).
    """
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
        rendezvous,
    )

    from megatron_rl.parallel import netbind

    if rank == 0:  # the host's store listens on master_address only (torch's: every interface)
        store = netbind.rendezvous_store(master_address, master_port, world_size, True, timeout,
                                         master_address)
    else:
        store, rank, world_size = next(rendezvous(f"tcp://{master_address}:{master_port}", rank,
                                                  world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    with netbind.gloo_interface(_gloo_ifname(master_address, rank)), unbound_default_group():
        pg, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), store,
                                          group_name=group_name, backend_options=None,
                                          timeout=timeout, device_id=None)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def _gloo_ifname(master_address: str, rank: int) -> str | None:
    """The interface this rank's gloo sockets of the group bind: loopback for a loopback host;
    the host's: the interface that holds ``master_address``; a joining rank's: the interface
    routed to it. None (gloo's default, the hostname's interface) when none is found."""
    from megatron_rl.parallel import netbind

    if netbind.is_loopback(master_address):
        return netbind.loopback_interface()
    local = master_address if rank == 0 else netbind.routed_address(master_address)
    return netbind.interface_of(local) if local else None


def leave_weight_group(pg) -> None:
    """Destroy a group made by :func:`join_weight_group` (its name can then be reused)."""
    if pg is None:
        return
    try:
        dist.destroy_process_group(pg)
    except (ValueError, RuntimeError, KeyError, AssertionError):
        pass
