"""``from_tensor``: colocated servers receive handles to flattened buckets, not bytes over HTTP.

Each bucket is flattened once (one contiguous byte buffer + ``[name, dtype, shape, offset]``).
On GPU the buffer's CUDA IPC handle goes through SGLang's own serializer
(``MultiprocessingSerializer`` of a ``FlattenedTensorBucket``, ``load_format="flattened_bucket"``;
needs the ``sglang`` package in the trainer's environment). On CPU (our ``serve``) the buffer is a
``/dev/shm`` file and the request carries its path and layout (``load_format="megatron_rl_shm"``);
the file is removed once every server has copied it.
"""

from __future__ import annotations

import json
import os
import uuid

import torch

from megatron_rl.rollout.weight_sync.common import Bucket, SyncStrategy, post_all

SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else None


def bucket_layout(bucket: Bucket) -> tuple[int, list[list]]:
    """``(total bytes, [[name, dtype, shape, byte_offset], ...])`` of a flattened bucket."""
    meta, off = [], 0
    for name, t in bucket:
        meta.append([name, str(t.dtype).replace("torch.", ""), list(t.shape), off])
        off += t.numel() * t.element_size()
    return off, meta


def write_shm(bucket: Bucket, directory: str | None = None) -> tuple[str, int, list[list]]:
    """Copy a CPU bucket straight into a new shared-memory file (one copy per tensor);
    returns ``(path, nbytes, layout)``."""
    import tempfile

    nbytes, meta = bucket_layout(bucket)
    path = os.path.join(directory or SHM_DIR or tempfile.gettempdir(),
                        f"megatron_rl_wsync_{uuid.uuid4().hex}.bin")
    mm = torch.from_file(path, shared=True, size=max(1, nbytes), dtype=torch.uint8)
    for (_, t), (_, _, _, off) in zip(bucket, meta):
        b = t.detach().contiguous().reshape(-1).view(torch.uint8)
        mm[off:off + b.numel()].copy_(b)
    return path, nbytes, meta


class FromTensor(SyncStrategy):
    name = "from_tensor"

    def send_bucket(self, bucket: Bucket, version: int) -> None:
        if bucket and bucket[0][1].is_cuda:
            self._send_cuda(bucket)
            return
        path, nbytes, meta = write_shm(bucket)
        try:
            blob = json.dumps({"path": path, "nbytes": nbytes, "tensors": meta})
            post_all(self.urls, "/update_weights_from_tensor",
                     {"serialized_named_tensors": [blob], "load_format": "megatron_rl_shm",
                      "flush_cache": False})
        finally:
            os.remove(path)

    def _send_cuda(self, bucket: Bucket) -> None:
        try:
            from sglang.srt.utils import MultiprocessingSerializer
            from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket
        except ImportError as exc:
            raise RuntimeError("from_tensor with CUDA tensors needs the sglang package in the "
                               "trainer's environment (CUDA IPC handles are made by its "
                               "serializer); use from_disk or from_distributed") from exc
        fb = FlattenedTensorBucket(named_tensors=[(n, t.detach()) for n, t in bucket])
        data = MultiprocessingSerializer.serialize(
            {"flattened_tensor": fb.get_flattened_tensor(), "metadata": fb.get_metadata()},
            output_str=True)
        post_all(self.urls, "/update_weights_from_tensor",
                 {"serialized_named_tensors": [data] * self.server_tp,  # one per server TP rank
                  "load_format": "flattened_bucket",
                  "flush_cache": False})
