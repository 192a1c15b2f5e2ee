"""SGLang's memory-occupation contract, for our ``serve`` and for the trainer's client calls.

SGLang (``srt/managers/io_struct.py``, ``scheduler_update_weights_mixin.py``; server started with
``--enable-memory-saver``):

- ``POST /release_memory_occupation {"tags": [...] | null}``: frees the named regions --
  ``"weights"``, ``"kv_cache"``, ``"cuda_graph"``; none/empty means all three. Refused unless the
  server is idle (no request in flight). The weights' contents are gone (only module buffers are
  kept, re-imported on resume); the KV cache is flushed.
- ``POST /resume_memory_occupation {"tags": [...] | null}``: re-allocates the named regions (none:
  all three). Every tag must have been released (SGLang's scheduler fails on a tag it does not
  hold). Resumed weights hold no meaningful values until the next weight update.
- Success answers HTTP 200; an error answers 400 ``{"error": {"message": ...}}``.

:class:`MemoryOccupation` is the server side used by :mod:`megatron_rl.rollout.serve`; it frees the
served model's parameter storages for real (resize to 0 bytes), zeroes resumed weights (SGLang
leaves them undefined; zeros give the uniform distribution, which the weight sync's probe would
catch, and a health check before the sync still answers, as SGLang's does), and refuses
generation and weight updates while the regions they need are released (real SGLang has no guard:
it would run on unmapped memory). :func:`release_servers` / :func:`resume_servers` are the
trainer's calls.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch

TAGS = ("kv_cache", "weights", "cuda_graph")  # SGLang's GPU_MEMORY_ALL_TYPES


def resolve_tags(tags) -> list[str]:
    """The request's ``tags`` (None/empty: all); ValueError naming an unknown tag."""
    if not tags:
        return list(TAGS)
    if not isinstance(tags, list) or any(t not in TAGS for t in tags):
        raise ValueError(f"tags={tags!r}: each tag must be one of {TAGS}")
    return list(dict.fromkeys(tags))


class MemoryOccupation:
    """Released regions of one served model (a ``torch.nn.Module``)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.released: set[str] = set()
        self._weights: list[tuple[torch.UntypedStorage, int, torch.Tensor]] = []
        self._buffers: list[tuple[str, torch.Tensor]] = []

    def release(self, tags, busy: int) -> None:
        """Free ``tags`` (``busy``: requests in flight, must be 0)."""
        tags = resolve_tags(tags)
        if busy:
            raise ValueError(f"release_memory_occupation should be called only when no ongoing "
                             f"request ({busy} in flight)")
        if "weights" in tags and "weights" not in self.released:
            self._buffers = [(n, b.detach().clone()) for n, b in self.model.named_buffers()]
            self._weights = []
            seen: set[int] = set()
            for t in [*self.model.parameters(), *self.model.buffers()]:
                st = t.untyped_storage()
                if st._cdata in seen or st.nbytes() == 0:
                    continue
                seen.add(st._cdata)
                self._weights.append((st, st.nbytes(), t))
                st.resize_(0)
        self.released.update(tags)

    def resume(self, tags) -> None:
        """Re-allocate ``tags``; every one must be released."""
        tags = resolve_tags(tags)
        missing = [t for t in tags if t not in self.released]
        if missing:
            raise ValueError(f"resume_memory_occupation: {missing} not released (released: "
                             f"{sorted(self.released)})")
        if "weights" in tags:
            for st, nbytes, _ in self._weights:
                st.resize_(nbytes)
            with torch.no_grad():
                for p in self.model.parameters():
                    p.zero_()
                bufs = dict(self.model.named_buffers())
                for name, saved in self._buffers:
                    bufs[name].copy_(saved)
            self._weights, self._buffers = [], []
        self.released.difference_update(tags)

    def check_can_generate(self) -> None:
        """ValueError while the weights or the KV cache are released."""
        held = sorted(self.released & {"weights", "kv_cache"})
        if held:
            raise ValueError(f"memory released ({held}): call /resume_memory_occupation before "
                             "generating")

    def check_weights_held(self) -> None:
        """ValueError while the weights are released (weight updates and reads)."""
        if "weights" in self.released:
            raise ValueError("weights released: call /resume_memory_occupation with tags "
                             "['weights'] first")


# ---- trainer side ---------------------------------------------------------------------------
def _post_all(urls: list[str], path: str, body: dict, timeout: float) -> None:
    from megatron_rl.rollout.fleet import http_json

    if not urls:
        return
    with ThreadPoolExecutor(len(urls)) as pool:
        list(pool.map(lambda u: http_json("POST", u + path, body, timeout=timeout), urls))


def release_servers(urls: list[str], tags: list[str] | None = None,
                    timeout: float = 600.0) -> None:
    """``/release_memory_occupation`` on every server (raises ``ServerError`` on a refusal)."""
    _post_all(urls, "/release_memory_occupation", {"tags": tags}, timeout)


def resume_servers(urls: list[str], tags: list[str] | None = None,
                   timeout: float = 600.0) -> None:
    """``/resume_memory_occupation`` on every server (raises ``ServerError`` on a refusal)."""
    _post_all(urls, "/resume_memory_occupation", {"tags": tags}, timeout)


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A writable byte view of contiguous CPU tensor ``t``'s memory. Not ``t.numpy()``: exporting
    to numpy marks the storage non-resizable for good, and releasing weights resizes it to 0."""
    import ctypes

    n = t.numel() * t.element_size()
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")
