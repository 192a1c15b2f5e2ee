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


def flatten_bucket(bucket: Bucket) -> tuple[torch.Tensor, list[list]]:
    """``(uint8 buffer, [[name, dtype, shape, byte_offset], ...])`` on the bucket's device."""
    parts, meta, off = [], [], 0
    for name, t in bucket:
        b = t.detach().contiguous().reshape(-1).view(torch.uint8)
        meta.append([name, str(t.dtype).replace("torch.", ""), list(t.shape), off])
        parts.append(b)
        off += b.numel()
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8), meta


def write_shm(flat: torch.Tensor, directory: str | None = None) -> str:
    """Copy a CPU byte buffer into a new shared-memory file; returns its path."""
    import tempfile

    path = os.path.join(directory or SHM_DIR or tempfile.gettempdir(),
                        f"megatron_rl_wsync_{uuid.uuid4().hex}.bin")
    mm = torch.from_file(path, shared=True, size=max(1, flat.numel()), dtype=torch.uint8)
    mm[:flat.numel()].copy_(flat)
    return path


class FromTensor(SyncStrategy):
    name = "from_tensor"

    def send_bucket(self, bucket: Bucket, version: int) -> None:
        if bucket and bucket[0][1].is_cuda:
            self._send_cuda(bucket)
            return
        flat, meta = flatten_bucket(bucket)
        path = write_shm(flat)
        try:
            blob = json.dumps({"path": path, "nbytes": int(flat.numel()), "tensors": meta})
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
                 {"serialized_named_tensors": [data], "load_format": "flattened_bucket",
                  "flush_cache": False})
