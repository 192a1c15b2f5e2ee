"""The experts a rollout engine routed each token to (routing replay R3, docs/moe.md).

Layout, as real SGLang returns it (``--enable-return-routed-experts`` on the server, request field
``return_routed_experts``): ``[seqlen - 1, num_layers, top_k]`` int32, one row per token the engine
ran through the model (every prompt token and every generated token but the last), top-k expert
ids per MoE layer; on the wire ``meta_info["routed_experts"]`` is the base64 of its raw
little-endian int32 bytes.
"""

from __future__ import annotations

import base64
import threading
from contextlib import contextmanager
from typing import Iterator

import numpy as np
import torch


def moe_gates(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The router (``mlp.gate``) of every sparse-MoE decoder layer of a ``transformers`` causal
    LM, in layer order; ``[]`` for a dense model."""
    layers = getattr(getattr(model, "model", model), "layers", [])
    return [layer.mlp.gate for layer in layers
            if hasattr(layer.mlp, "gate") and hasattr(layer.mlp, "experts")]


class RoutingCapture:
    """Top-k expert ids of every forward call of a ``transformers`` MoE model (forward hooks on
    the routers). ``calls[i]`` is ``[tokens_i, num_layers, top_k]`` int32 on the model's device
    (no host sync per forward; :meth:`result` copies once), tokens in the model's ``[batch, seq]``
    row-major order. Only forwards run by the thread that opened
    :meth:`active` are recorded (a server runs other requests' forwards on the same model)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.gates = moe_gates(model)
        if not self.gates:
            raise ValueError("routed experts were asked for, but the engine's model has no MoE "
                             "layers")
        self.top_k = int(model.config.num_experts_per_tok)
        self.calls: list[torch.Tensor] = []
        self._layer: list[torch.Tensor] = []
        self._thread: int | None = None

    def _hook(self, module: torch.nn.Module, args, out) -> None:
        if threading.get_ident() != self._thread:
            return
        if isinstance(out, tuple):  # transformers 5: (logits, top-k weights, top-k ids)
            ids = out[2]
        else:  # transformers 4: the gate is a Linear giving the router logits
            ids = torch.topk(out.float(), self.top_k, dim=-1).indices
        self._layer.append(ids.reshape(-1, self.top_k).to(torch.int32))
        if len(self._layer) == len(self.gates):
            self.calls.append(torch.stack(self._layer, dim=1))
            self._layer = []

    def result(self, rows: int = 1) -> torch.Tensor | None:
        """Every call's ids on the host, ``[rows, total tokens / rows, layers, k]`` (one copy;
        ``rows``: the batch size of the forwards); None when nothing ran."""
        if not self.calls:
            return None
        return torch.cat([c.view(rows, -1, *c.shape[1:]) for c in self.calls], 1).cpu()

    @contextmanager
    def active(self) -> Iterator[RoutingCapture]:
        """Hooks installed for the ``with`` block only."""
        self._thread = threading.get_ident()
        handles = [g.register_forward_hook(self._hook) for g in self.gates]
        try:
            yield self
        finally:
            for h in handles:
                h.remove()


def encode(ids: torch.Tensor) -> str:
    """SGLang's wire form: base64 of the int32 bytes
    (detokenizer_manager.py ``_b64_encode_per_request``)."""
    return base64.b64encode(ids.to(torch.int32).contiguous().numpy().tobytes()).decode("ascii")


def decode(text: str, num_layers: int, top_k: int) -> torch.Tensor:
    """``[rows, num_layers, top_k]`` int32 from :func:`encode`'s string."""
    flat = np.frombuffer(base64.b64decode(text), dtype=np.int32)
    if flat.size % (num_layers * top_k):
        raise ValueError(f"routed_experts has {flat.size} ids, not a multiple of num_layers x "
                         f"top_k = {num_layers} x {top_k}")
    return torch.from_numpy(flat.copy()).view(-1, num_layers, top_k)
