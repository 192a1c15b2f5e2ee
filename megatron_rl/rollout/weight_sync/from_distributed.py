"""``from_distributed``: a process group between each sender and every server.

Once per sender: a ``TCPStore`` on a free port of the sender, ``/init_weights_update_group`` to
every server (server ``i`` joins as rank ``1 + i*tp``; the sender is rank 0) while the sender
joins as rank 0 (gloo for CPU tensors, NCCL for CUDA ones). Per bucket:
``/update_weights_from_distributed {names, dtypes, shapes, group_name}`` to every server, in
threads, while the sender broadcasts each tensor from rank 0. One group per pipeline stage
(``group_name = megatron_rl_stage{k}``), so stages send in parallel.
"""

from __future__ import annotations

import socket
import threading
from datetime import timedelta
from urllib.parse import urlparse

import torch.distributed as dist

from megatron_rl.rollout.weight_sync.common import Bucket, SyncStrategy, WeightSyncError, post_all


def free_port(host: str = "127.0.0.1") -> int:
    """A free TCP port on ``host`` (the probe binds that interface only, never all of them)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def sender_address(urls: list[str]) -> str:
    """The address servers reach this process at (loopback when every server is local)."""
    hosts = {urlparse(u).hostname for u in urls}
    if hosts <= {"127.0.0.1", "localhost"}:
        return "127.0.0.1"
    return socket.gethostbyname(socket.gethostname())


class FromDistributed(SyncStrategy):
    name = "from_distributed"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.pg = None
        self.group_urls: list[str] = []
        self.backend = "gloo"

    @property
    def group_name(self) -> str:
        return f"megatron_rl_stage{self.sender}"

    def _init_group(self, backend: str) -> None:
        if self.pg is not None and self.group_urls == self.urls and self.backend == backend:
            return
        self.close()
        world = 1 + len(self.urls) * self.server_tp
        addr = sender_address(self.urls)
        port = free_port(addr)
        store = dist.TCPStore(addr, port, world, is_master=True, timeout=timedelta(seconds=120),
                              wait_for_workers=False)
        errs: list[Exception] = []

        def join(i: int, u: str) -> None:
            try:
                post_all([u], "/init_weights_update_group",
                         {"master_address": addr, "master_port": port,
                          "rank_offset": 1 + i * self.server_tp, "world_size": world,
                          "group_name": self.group_name, "backend": backend})
            except Exception as exc:  # noqa: BLE001 - reported below
                errs.append(exc)

        threads = [threading.Thread(target=join, args=(i, u), daemon=True)
                   for i, u in enumerate(self.urls)]
        for th in threads:
            th.start()
        pg_cls = dist.ProcessGroupNCCL if backend == "nccl" else dist.ProcessGroupGloo
        self.pg = pg_cls(store, 0, world)
        for th in threads:
            th.join()
        if errs:
            raise WeightSyncError(f"init_weights_update_group failed: {errs[0]}")
        self.store, self.group_urls, self.backend = store, list(self.urls), backend

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
        for _, t in bucket:
            self.pg.broadcast(t.detach().contiguous(), 0).wait()
        th.join()
        if errs:
            raise WeightSyncError(f"update_weights_from_distributed failed: {errs[0]}")

    def close(self) -> None:
        if self.pg is not None:
            try:
                post_all(self.group_urls, "/destroy_weights_update_group",
                         {"group_name": self.group_name})
            except WeightSyncError:
                pass
        self.pg = None

