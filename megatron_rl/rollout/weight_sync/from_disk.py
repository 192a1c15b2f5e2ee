"""``from_disk``: safetensors on shared storage + ``/update_weights_from_disk``.

Each sender (one per pipeline stage) writes its own buckets as ``stage{k}-{b}.safetensors``
into ``SYNC_DIR/v{version}`` in parallel with the other stages; the coordinator then posts
``/update_weights_from_disk {"model_path": that dir, "weight_version": version}`` to every server
(``config.json`` of the served model is copied next to the shards, as SGLang's loader wants).
Only the newest version directory is kept.
"""

from __future__ import annotations

import os
import shutil

from megatron_rl.rollout.weight_sync.common import Bucket, SyncStrategy, post_all


class FromDisk(SyncStrategy):
    name = "from_disk"

    def version_dir(self, version: int) -> str:
        return os.path.join(self.sync_dir, f"v{version}")

    def start_send(self, version: int) -> None:
        self._n = 0
        os.makedirs(self.version_dir(version), exist_ok=True)

    def send_bucket(self, bucket: Bucket, version: int) -> None:
        from safetensors.torch import save_file

        path = os.path.join(self.version_dir(version), f"stage{self.sender}-{self._n:05d}"
                                                       ".safetensors")
        save_file({n: t.detach().contiguous().cpu() for n, t in bucket}, path + ".tmp")
        os.replace(path + ".tmp", path)
        self._n += 1

    def commit(self, version: int) -> None:
        d = self.version_dir(version)
        if self.model_path and os.path.isfile(os.path.join(self.model_path, "config.json")):
            shutil.copy(os.path.join(self.model_path, "config.json"), d)
        post_all(self.urls, "/update_weights_from_disk",
                 {"model_path": d, "weight_version": str(version), "flush_cache": False,
                  "abort_all_requests": False,  # flushed by super().commit, with retries
                  "load_format": "safetensors"})  # what we wrote (the server may start dummy)
        super().commit(version)
        for name in os.listdir(self.sync_dir):
            if name.startswith("v") and name != f"v{version}":
                shutil.rmtree(os.path.join(self.sync_dir, name), ignore_errors=True)
