"""``from_tensor``'s CUDA-IPC sender path without SGLang, for tests: what it keeps alive.

- :class:`TorchCodec`: the codec :class:`~megatron_rl.rollout.weight_sync.from_tensor.FromTensor`
  uses, made of torch alone -- a bucket flattened into one new ``uint8`` buffer (the allocation
  SGLang's ``FlattenedTensorBucket`` makes) and, for CUDA buffers, serialized with torch's own
  CUDA IPC reductions (``ForkingPickler`` + base64, what SGLang's ``MultiprocessingSerializer``
  does). It records a weak reference to every buffer it makes (:meth:`TorchCodec.alive`).
- :class:`AnyDeviceSender`: a ``FromTensor`` that sends every bucket that way, CPU tensors too.
- :class:`LiveBytes`: bytes of the tensor storages alive now that were not alive at its start,
  found through the garbage collector (independent of the code under test).
- :func:`ipc_receiver`: a process that opens each CUDA IPC handle, copies the bytes into its own
  buffer and drops the handle before it answers, as an SGLang TP worker loading weights does.
"""

from __future__ import annotations

import base64
import gc
import io
import warnings
import weakref
from typing import Any

import torch

from megatron_rl.rollout.weight_sync.from_tensor import FromTensor


class TorchCodec:
    """``flatten``/``serialize`` of a bucket with torch only (module docstring)."""

    def __init__(self) -> None:
        self._made: list[weakref.ref] = []

    def flatten(self, bucket: list[tuple[str, torch.Tensor]]) -> tuple[torch.Tensor, list]:
        """A new ``uint8`` buffer of the bucket's bytes (on its device) and its layout
        ``[[name, dtype, shape, byte offset], ...]``."""
        parts = [t.detach().contiguous().reshape(-1).view(torch.uint8) for _, t in bucket]
        flat = torch.cat(parts)
        meta, off = [], 0
        for (name, t), p in zip(bucket, parts):
            meta.append([name, str(t.dtype), list(t.shape), off])
            off += p.numel()
        self._made.append(weakref.ref(flat))
        return flat, meta

    def serialize(self, flat: torch.Tensor, meta: list) -> str:
        """CUDA: a base64 pickle carrying the buffer's IPC handle (torch's reductions); CPU: the
        layout only (no receiver reads CPU buffers here)."""
        if not flat.is_cuda:
            return repr(meta)
        from multiprocessing.reduction import ForkingPickler

        import torch.multiprocessing  # noqa: F401 - registers torch's tensor reductions

        buf = io.BytesIO()
        ForkingPickler(buf).dump({"flattened_tensor": flat, "metadata": meta})
        return base64.b64encode(buf.getvalue()).decode()

    def alive(self) -> int:
        """How many buffers this codec made are still alive."""
        return sum(r() is not None for r in self._made)


class AnyDeviceSender(FromTensor):
    """``FromTensor`` whose every bucket takes the CUDA-IPC path (``_send_cuda``), CPU buckets
    included, with a :class:`TorchCodec`."""

    def __init__(self, urls: list[str]) -> None:
        super().__init__(urls, "/unused", server_tp=1)  # stand-in servers: no /server_info
        self.codec = TorchCodec()

    def send_bucket(self, bucket, version: int) -> None:
        self._send_cuda(bucket)


class LiveBytes:
    """Bytes of tensor storages alive now and not alive when this was made (every tensor the
    garbage collector sees; the storages alive at the start are held, so their addresses are
    not reused). :meth:`probe` records the peak."""

    def __init__(self) -> None:
        self._held = self._tensors()
        self._base = {t.untyped_storage().data_ptr() for t in self._held}
        self.peak = 0

    @staticmethod
    def _tensors() -> list[torch.Tensor]:
        with warnings.catch_warnings():  # isinstance() wakes deprecated lazy module attributes
            warnings.simplefilter("ignore")
            return [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]

    def now(self) -> int:
        """Bytes of the new storages alive now."""
        seen: dict[int, int] = {}
        for t in self._tensors():
            st = t.untyped_storage()
            if st.data_ptr() not in self._base and st.nbytes():
                seen[st.data_ptr()] = st.nbytes()
        return sum(seen.values())

    def probe(self) -> int:
        n = self.now()
        self.peak = max(self.peak, n)
        return n


def ipc_receiver(conn) -> None:
    """Receive base64 ``TorchCodec`` payloads over ``conn`` until ``None``: open each handle,
    copy the bytes into a buffer of this process, drop the handle (torch synchronizes the stream
    and releases the sender's reference count), then answer the number of bytes copied."""
    import pickle

    import torch.multiprocessing  # noqa: F401 - registers torch's tensor reductions

    own: torch.Tensor | None = None
    while (payload := conn.recv()) is not None:
        got: Any = pickle.loads(base64.b64decode(payload))
        flat = got["flattened_tensor"]
        if own is None or own.numel() < flat.numel():
            own = torch.empty(flat.numel(), dtype=torch.uint8, device=flat.device)
        own[:flat.numel()].copy_(flat)
        n, cuda = flat.numel(), flat.is_cuda
        del got, flat
        if cuda:
            torch.cuda.synchronize()
        conn.send(n)


def sender_pass(buckets, urls: tuple[str, ...] = ("http://server-a", "http://server-b"),
                post=None) -> dict:
    """Drain ``buckets`` through the sync's own loop (``megatron_sync._send_all``) into an
    :class:`AnyDeviceSender`, with the HTTP request replaced for the pass by ``post(body)``
    (default: accept). Returns ``{"peak": the most new bytes alive at any bucket or request
    (:class:`LiveBytes`), "flats_at_post": flattened buffers alive at each request,
    "flats_after": alive after the pass, "sent": bytes sent, "err": the pass's error}``."""
    import threading

    from megatron_rl.rollout.weight_sync import from_tensor as ft
    from megatron_rl.rollout.weight_sync.megatron_sync import _send_all

    sender = AnyDeviceSender(list(urls))
    live, lock = LiveBytes(), threading.Lock()
    flats: list[int] = []

    def post_all(targets, path, body=None, timeout=600.0):  # the request, stubbed
        assert path == "/update_weights_from_tensor" and body["load_format"] == "flattened_bucket"
        with lock:
            flats.append(sender.codec.alive())
            live.probe()
        return [post(body) if post is not None else {"success": True} for _ in targets]

    def probed():
        for bucket in buckets:
            with lock:
                live.probe()
            yield bucket
            del bucket  # hold nothing while the stream makes the next one

    real, ft.post_all = ft.post_all, post_all
    try:
        sent, err = _send_all(sender, probed(), 1)
    finally:
        ft.post_all = real
    return {"peak": live.peak, "flats_at_post": flats, "flats_after": sender.codec.alive(),
            "sent": sent, "err": err}
