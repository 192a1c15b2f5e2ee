"""``from_distributed``: a process group between each sender and every server.

Once per sender: ``/init_weights_update_group`` to every server (its TP ranks, ``tp_size`` from
its ``/server_info``, join after those of the servers before it, from rank 1) while the sender
joins as rank 0, hosting the ``tcp://`` rendezvous on a free port of the interface the servers
reach it at (:func:`sender_address`), through the same steps as SGLang's
``init_custom_process_group`` (:mod:`.group`; gloo for CPU tensors, NCCL for CUDA ones).
Per bucket (inside SGLang's ``/begin_weight_update`` ... ``/end_weight_update`` session):
``/update_weights_from_distributed {names, dtypes, shapes, group_name}`` to every server, in
threads, while the sender broadcasts each tensor from rank 0. One group per pipeline stage
(``group_name = megatron_rl_stage{k}_g{n}``, new for each group), so stages send in parallel.
"""

from __future__ import annotations

import os
import socket
import threading
from datetime import timedelta
from urllib.parse import urlparse

from megatron_rl.parallel.netbind import routed_address
from megatron_rl.rollout.weight_sync.common import Bucket, SyncStrategy, WeightSyncError, post_all
from megatron_rl.rollout.weight_sync.group import join_weight_group, leave_weight_group


def free_port(host: str = "127.0.0.1") -> int:
    """A free TCP port on ``host`` (the probe binds that interface only, never all of them)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


_LOOPBACK = ("localhost", "127.0.0.1", "::1")


def sender_address(urls: list[str], override: str | None = None) -> str:
    """The address the servers reach this sender at: ``override``
    (``rollout.sglang.sender_address``); loopback when every server is local; else the interface
    routed to the servers, else the one routed to ``MASTER_ADDR``. Never the hostname's entry in
    ``/etc/hosts`` (127.0.1.1 on Debian/Ubuntu, unreachable from other nodes)."""
    if override:
        return override
    hosts = sorted({urlparse(u).hostname or "" for u in urls} - set(_LOOPBACK))
    if not hosts:
        return "127.0.0.1"
    for h in hosts + [os.environ.get("MASTER_ADDR", "")]:
        addr = routed_address(h) if h and h not in _LOOPBACK else None
        if addr and not addr.startswith("127."):
            return addr
    raise WeightSyncError(f"no network interface of this machine routes to the servers {hosts} "
                          "or MASTER_ADDR; set rollout.sglang.sender_address")


class FromDistributed(SyncStrategy):
    name = "from_distributed"
    needs_session = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.pg = None
        self.group_urls: list[str] = []
        self.backend = "gloo"
        self._generation = 0
        self.address_override: str | None = None  # rollout.sglang.sender_address
        self.group_timeout_s = 300.0

    @property
    def group_name(self) -> str:
        """Name of the current group: new for every group this sender makes (a server that
        missed the last ``/destroy_weights_update_group`` still holds the previous name)."""
        return f"megatron_rl_stage{self.sender}_g{self._generation}"

    def _init_group(self, backend: str) -> None:
        """(Re)make the group when the servers or the backend changed: POST
        ``/init_weights_update_group`` to every server (server ``i``'s TP ranks follow those of
        the servers before it, each server's TP size from its ``/server_info``; world size
        ``1 +`` all of them) while this sender joins as rank 0 through the same rendezvous as
        SGLang's ranks (:func:`~megatron_rl.rollout.weight_sync.group.join_weight_group`)."""
        if self.pg is not None and self.group_urls == self.urls and self.backend == backend:
            return
        offsets = self.rank_offsets()  # each server's tp_size (/server_info)
        self.close()
        self._generation += 1
        world = 1 + offsets[-1]
        addr = sender_address(self.urls, self.address_override)
        port = free_port(addr)
        errs: list[Exception] = []

        def join(i: int, u: str) -> None:
            try:
                post_all([u], "/init_weights_update_group",
                         {"master_address": addr, "master_port": port,
                          "rank_offset": 1 + offsets[i], "world_size": world,
                          "group_name": self.group_name, "backend": backend})
            except Exception as exc:  # noqa: BLE001 - reported below
                errs.append(exc)

        threads = [threading.Thread(target=join, args=(i, u), daemon=True)
                   for i, u in enumerate(self.urls)]
        for th in threads:
            th.start()
        try:
            pg = join_weight_group(backend, addr, port, world, 0, self.group_name,
                                   timedelta(seconds=self.group_timeout_s))
        except Exception as exc:  # noqa: BLE001 - a server that never joined
            for th in threads:
                th.join(timeout=5.0)
            raise WeightSyncError(f"weight update group {self.group_name} at {addr}:{port}: "
                                  f"{exc!r}; servers: {errs}") from None
        for th in threads:
            th.join()
        if errs:
            leave_weight_group(pg)
            raise WeightSyncError(f"init_weights_update_group failed: {errs[0]}")
        self.pg, self.group_urls, self.backend = pg, list(self.urls), backend

    def send_bucket(self, bucket: Bucket, version: int) -> None:
        self._init_group("nccl" if bucket and bucket[0][1].is_cuda else "gloo")
        body = {"names": [n for n, _ in bucket],
                "dtypes": [str(t.dtype).replace("torch.", "") for _, t in bucket],
                "shapes": [list(t.shape) for _, t in bucket], "group_name": self.group_name,
                "flush_cache": False}
        errs: list[Exception] = []

        def post() -> None:
            try:
                post_all(self.urls, "/update_weights_from_distributed", body)
            except Exception as exc:  # noqa: BLE001 - re-raised below
                errs.append(exc)

        th = threading.Thread(target=post, daemon=True)
        th.start()
        from megatron_rl.rollout.fp8 import wire_view

        for _, t in bucket:
            self.pg.broadcast(wire_view(t.detach().contiguous()), 0).wait()
        th.join()
        if errs:
            raise WeightSyncError(f"update_weights_from_distributed failed: {errs[0]}")

    def close(self) -> None:
        """Destroy the group on the servers (best effort: some may be dead) and here."""
        if self.pg is not None:
            for u in self.group_urls:
                try:
                    post_all([u], "/destroy_weights_update_group",
                             {"group_name": self.group_name}, timeout=30.0)
                except WeightSyncError:
                    pass
            leave_weight_group(self.pg)
        self.pg = None

