"""``from_tensor``: colocated servers receive handles to flattened buckets, not bytes over HTTP.

Each bucket is flattened once (one contiguous byte buffer + ``[name, dtype, shape, offset]``).
On GPU the buffer's CUDA IPC handle goes through SGLang's own serializer
(``MultiprocessingSerializer`` of a ``FlattenedTensorBucket``, ``load_format="flattened_bucket"``;
needs the ``sglang`` package in the trainer's environment), with SGLang's
``monkey_patch_torch_reductions`` applied, one payload per TP rank of each server. Each bucket's
buffers are dropped as soon as its requests return: CUDA IPC counts references (torch's
``CudaIPCSentData``), so the block stays allocated until every receiver has released its handle
(after synchronizing its stream), and one flattened bucket at a time is alive on the sender.

On CPU (our ``serve``) nothing is flattened: the request carries this process's pid and every
tensor's address (``load_format="megatron_rl_vm"``) and the servers copy each tensor straight
into their weights with ``process_vm_readv`` (one copy, while the sender makes the next bucket).
Where the OS refuses that (another PID namespace, ptrace restrictions), the buffer is one of two
``/dev/shm`` files reused for every bucket of every sync (packing the next bucket while the
servers copy the previous one; a fresh tmpfs page costs ~6x a copied one, so the files live as
long as the strategy: :meth:`FromTensor.close`, or at exit) and the request carries its path and
layout (``load_format="megatron_rl_shm"``); the servers keep each file mapped and copy straight
into their weights.
"""

from __future__ import annotations

import atexit
import json
import os
import uuid
from typing import Any

import torch

from megatron_rl.rollout.weight_sync.common import (
    Bucket,
    SyncStrategy,
    WeightSyncError,
    post_all,
    post_each,
)

VM_UNAVAILABLE = "megatron_rl_vm unavailable"  # a server's refusal of process_vm_readv buckets

SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else None


def bucket_layout(bucket: Bucket) -> tuple[int, list[list]]:
    """``(total bytes, [[name, dtype, shape, byte_offset], ...])`` of a flattened bucket."""
    meta, off = [], 0
    for name, t in bucket:
        meta.append([name, str(t.dtype).replace("torch.", ""), list(t.shape), off])
        off += t.numel() * t.element_size()
    return off, meta


def shm_path(directory: str | None = None) -> str:
    """A new file name in ``/dev/shm`` (else the temp dir)."""
    import tempfile

    return os.path.join(directory or SHM_DIR or tempfile.gettempdir(),
                        f"megatron_rl_wsync_{uuid.uuid4().hex}.bin")


def pack_into(mm: torch.Tensor, bucket: Bucket, meta: list[list]) -> None:
    """Copy every tensor of ``bucket`` into the byte buffer ``mm`` at its layout offset."""
    for (_, t), (_, _, _, off) in zip(bucket, meta):
        b = t.detach().contiguous().reshape(-1).view(torch.uint8)
        mm[off:off + b.numel()].copy_(b)


def write_shm(bucket: Bucket, directory: str | None = None) -> tuple[str, int, list[list]]:
    """Copy a CPU bucket straight into a new shared-memory file (one copy per tensor);
    returns ``(path, nbytes, layout)``."""
    nbytes, meta = bucket_layout(bucket)
    path = shm_path(directory)
    pack_into(torch.from_file(path, shared=True, size=max(1, nbytes), dtype=torch.uint8),
              bucket, meta)
    return path, nbytes, meta


class ShmSlot:
    """A reusable shared-memory file mapped here (grown when a bucket is bigger): pages are
    allocated once per sync, not once per bucket."""

    def __init__(self) -> None:
        self.path: str | None = None
        self.mm: torch.Tensor | None = None
        self.capacity = 0

    def ensure(self, nbytes: int) -> torch.Tensor:
        if nbytes > self.capacity:
            self.free()
            self.path, self.capacity = shm_path(), max(1, nbytes)
            self.mm = torch.from_file(self.path, shared=True, size=self.capacity,
                                      dtype=torch.uint8)
        return self.mm

    def free(self) -> None:
        if self.path is not None and os.path.exists(self.path):
            os.remove(self.path)
        self.path, self.mm, self.capacity = None, None, 0


class FromTensor(SyncStrategy):
    name = "from_tensor"
    needs_session = True
    transport = "auto"  # CPU: "auto" (servers read this process, else shm files) | "shm"
    codec = None  # CUDA buckets: flatten + serialize (None: SGLangCodec)

    def send_bucket(self, bucket: Bucket, version: int) -> None:
        """CPU: the servers read the tensors straight out of this process (one copy,
        ``process_vm_readv``) while the next bucket is made; where they cannot, pack into one of
        two reused shared-memory slots while the previous bucket's POST (the servers copying
        it) is still running. CUDA: IPC handles."""
        if bucket and bucket[0][1].is_cuda:
            self._send_cuda(bucket)
            return
        if not hasattr(self, "_slots"):
            from concurrent.futures import ThreadPoolExecutor

            self._slots, self._n, self._pending = [ShmSlot(), ShmSlot()], 0, None
            self._pool = ThreadPoolExecutor(1)
            self._vm: bool | None = None  # servers can read this process: untried / yes / no
            self._token = torch.randint(0, 256, (16,), dtype=torch.uint8)
            atexit.register(self.close)
        if self.transport == "auto" and self._vm is not False and self._send_vm(bucket):
            return
        nbytes, meta = bucket_layout(bucket)
        slot = self._slots[self._n % 2]  # its last POST (bucket n-2) finished before n-1's began
        pack_into(slot.ensure(nbytes), bucket, meta)
        self._wait_pending()
        blob = json.dumps({"path": slot.path, "nbytes": nbytes, "tensors": meta})
        self._pending = self._pool.submit(
            post_all, self.urls, "/update_weights_from_tensor",
            {"serialized_named_tensors": [blob], "load_format": "megatron_rl_shm",
             "flush_cache": False})
        self._n += 1

    def _send_vm(self, bucket: Bucket) -> bool:
        """``load_format="megatron_rl_vm"``: this process's pid, a check token and every
        tensor's address; the servers copy each tensor into their weights with
        ``process_vm_readv`` (same host and PID namespace, and the OS lets a process of the same
        user read this one). The tensors stay referenced until the POST returned. False when a
        server cannot read this process (then the shared-memory path is used from now on)."""
        keep = [t.detach().contiguous() for _, t in bucket]
        blob = json.dumps({
            "pid": os.getpid(), "token": [self._token.data_ptr(), self._token.tolist()],
            "tensors": [[name, str(t.dtype).replace("torch.", ""), list(t.shape), t.data_ptr(),
                         t.numel() * t.element_size()] for (name, _), t in zip(bucket, keep)]})
        body = {"serialized_named_tensors": [blob], "load_format": "megatron_rl_vm",
                "flush_cache": False}
        self._wait_pending()
        if self._vm is None:  # the first bucket: find out whether the servers can read us
            try:
                post_all(self.urls, "/update_weights_from_tensor", body)
            except WeightSyncError as exc:
                if VM_UNAVAILABLE not in str(exc):
                    raise
                print(f"[weight_sync] from_tensor: a server cannot read this process ({exc}); "
                      "using shared-memory files", flush=True)
                self._vm = False
                return False
            self._vm = True
            return True

        def post(keep=keep) -> None:  # keep: alive until the servers copied them
            post_all(self.urls, "/update_weights_from_tensor", body)

        self._pending = self._pool.submit(post)
        return True

    def _wait_pending(self) -> None:
        pending, self._pending = getattr(self, "_pending", None), None
        if pending is not None:
            pending.result()

    def finish_send(self, version: int) -> None:
        """Wait for the last bucket's POST. The shared-memory files stay for the next sync (their
        pages are allocated once); :meth:`close` removes them."""
        self._wait_pending()

    def close(self) -> None:
        """Remove the shared-memory files (also at exit)."""
        for slot in getattr(self, "_slots", []):
            slot.free()

    def rank_devices(self, server: int, default: torch.device) -> list[torch.device]:
        """The device of each TP rank of server ``server`` (its ``tp_size`` from
        ``/server_info``) as this process numbers them: ``gpus[first + r]`` (``first``: the
        ranks of the servers before it) when the fleet placed servers on GPUs this process sees
        (the buffer is copied there, so each rank reads from its own GPU), else ``default`` (the
        receiver finds the sender's GPU by UUID)."""
        first = self.rank_offsets()[server]
        tp, gpus = self.tp_of(self.urls[server]), list(getattr(self, "gpus", None) or [])
        out = []
        for r in range(tp):
            k = first + r
            if k < len(gpus) and int(gpus[k]) < torch.cuda.device_count():
                out.append(torch.device("cuda", int(gpus[k])))
            else:
                out.append(default)
        return out

    def _send_cuda(self, bucket: Bucket) -> None:
        """CUDA IPC through SGLang's own serializer (:attr:`codec`, default :class:`SGLangCodec`:
        handles carry the device UUID; SGLang's receivers map it to their own device index), one
        payload per TP rank of every server (``serialized_named_tensors[tp_rank]``: each rank
        deserializes only its own, for CUDA-IPC refcounting). The flattened bucket and its copies
        are dropped when the requests return: a server still holding a handle keeps its block
        allocated (CUDA IPC reference counting), so nothing is freed under a receiver, and no more
        than one bucket's buffers are alive here."""
        buffers: list[torch.Tensor] = []
        bodies = tensor_update_bodies(bucket, [self.rank_devices(i, bucket[0][1].device)
                                               for i in range(len(self.urls))], buffers,
                                      self.codec)
        post_each(list(zip(self.urls, bodies)),
                  lambda ub: post_all([ub[0]], "/update_weights_from_tensor", ub[1]))
        buffers.clear()  # this bucket's last references here


class SGLangCodec:
    """SGLang's ``FlattenedTensorBucket`` (one contiguous buffer + metadata) and
    ``MultiprocessingSerializer`` (a CUDA IPC handle, base64) for ``load_format=
    "flattened_bucket"``, with ``monkey_patch_torch_reductions`` for CUDA tensors (handles name
    the device by UUID). Needs the ``sglang`` package in the trainer's environment."""

    def __init__(self) -> None:
        try:
            from sglang.srt.utils import MultiprocessingSerializer
            from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
            from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket
        except ImportError as exc:
            raise RuntimeError("from_tensor with CUDA tensors needs the sglang package in the "
                               "trainer's environment (CUDA IPC handles are made by its "
                               "serializer); use from_disk or from_distributed") from exc
        self._serializer, self._bucket = MultiprocessingSerializer, FlattenedTensorBucket
        self._patch = monkey_patch_torch_reductions

    def flatten(self, bucket: Bucket) -> tuple[torch.Tensor, Any]:
        """``(flat buffer on the bucket's device, metadata)``: a new buffer of the bucket's
        bytes."""
        if bucket[0][1].is_cuda:  # handles carry device UUIDs (the patch is for CUDA tensors)
            self._patch()
        fb = self._bucket(named_tensors=[(n, t.detach()) for n, t in bucket])
        return fb.get_flattened_tensor(), fb.get_metadata()

    def serialize(self, flat: torch.Tensor, meta: Any) -> str:
        """One TP rank's payload: ``{"flattened_tensor", "metadata"}``, serialized."""
        return self._serializer.serialize({"flattened_tensor": flat, "metadata": meta},
                                          output_str=True)


def tensor_update_bodies(bucket: Bucket, devices_per_server: list[list[torch.device]],
                         keep: list, codec=None) -> list[dict]:
    """``/update_weights_from_tensor`` bodies, one per server: the bucket flattened once
    (``codec.flatten``, default :class:`SGLangCodec`), copied to each TP rank's device where that
    differs, serialized once per rank (``codec.serialize``). Every buffer is appended to ``keep``
    (the caller drops them once the requests returned)."""
    codec = codec if codec is not None else SGLangCodec()
    flat, meta = codec.flatten(bucket)
    bodies = []
    for devices in devices_per_server:
        payloads = []
        for dev in devices:
            t = flat if dev == flat.device else flat.to(dev)
            if t.is_cuda:
                torch.cuda.current_stream(t.device).synchronize()  # written before read
            keep.append(t)
            payloads.append(codec.serialize(t, meta))
        bodies.append({"serialized_named_tensors": payloads, "load_format": "flattened_bucket",
                       "flush_cache": False})
    return bodies
