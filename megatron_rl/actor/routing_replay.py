"""MoE routing replay in the actor (``actor.routing_replay``, docs/moe.md).

- ``r2``: the old-logp pass records every MoE layer's top-k expert ids; the update's forward
  passes replay them (the update routes like the old policy did).
- ``r3``: the old-logp pass and the update replay the rollout engine's ids (the batch's
  ``routed_experts``).

Only the expert *ids* are replayed: megatron-core's ``RouterReplay`` (REPLAY_FORWARD) gathers the
current router's scores at the given ids, so the gate weights are recomputed from the current
router logits and stay differentiable.

Batch key ``routed_experts``: ``[N, S, num_layers, top_k]`` int32 (global layer order; -1 where a
position has no ids: a response's last token and padding, whose routing reaches no scored
log-prob). Each pipeline stage reads and writes only its own layers; under expert parallelism the
router runs before the token dispatch, on this rank's tokens, so ids need no exchange.
"""

from __future__ import annotations

import torch

from megatron_rl.actor.actor_config import ROUTING_REPLAY_MODES as MODES  # noqa: F401

KEY = "routed_experts"


class RoutingReplayError(RuntimeError):
    """A batch cannot be replayed (no ids where the mode needs them, wrong shape)."""


class RoutingReplay:
    """Record / replay switch over every megatron ``TopKRouter`` of one model stage.

    A private ``RouterReplay`` per router (taken out of megatron-core's class-level instance list,
    which would otherwise grow with every model a process builds and mix models).
    """

    def __init__(self, model: torch.nn.Module, mode: str) -> None:
        from megatron.core.transformer.moe.router import TopKRouter
        from megatron.core.transformer.moe.router_replay import RouterReplay

        if mode not in MODES[1:]:
            raise ValueError(f"actor.routing_replay={mode!r}: RoutingReplay needs one of "
                             f"{MODES[1:]}")
        self.mode = mode
        self.routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
        if not self.routers:
            raise RoutingReplayError(f"actor.routing_replay={mode!r} needs an MoE model (a "
                                     "family with experts, e.g. qwen3_moe); this one has no "
                                     "router")
        for r in self.routers:
            if r.router_replay is None:
                r.router_replay = RouterReplay()
                RouterReplay.global_router_replay_instances.remove(r.router_replay)
        self.layers = [int(r.layer_number) - 1 for r in self.routers]  # global, 0-based
        self.top_k = int(self.routers[0].topk)
        self._record_into: torch.Tensor | None = None

    def _set(self, action) -> None:
        for r in self.routers:
            r.router_replay.set_router_replay_action(action)

    def off(self) -> None:
        """Route normally (no record, no replay); drops the held ids."""
        for r in self.routers:
            r.router_replay.clear_router_replay_action()
            r.router_replay.clear_indices()
        self._record_into = None

    def record(self, dst: torch.Tensor) -> None:
        """The next forward records its ids; :meth:`after_forward` writes them into ``dst``
        (``[B, S, num_layers, top_k]``, a view into the batch's ``routed_experts``)."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        self._set(RouterReplayAction.RECORD)
        self._record_into = dst

    def replay(self, ids: torch.Tensor) -> None:
        """The next forward routes micro-batch ``ids`` ``[B, S, num_layers, top_k]``; positions
        without ids (-1) get experts ``0..k-1`` (they feed no scored log-prob)."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        if ids.dim() != 4 or ids.shape[3] != self.top_k or ids.shape[2] <= max(self.layers):
            raise RoutingReplayError(f"routed_experts has shape {tuple(ids.shape)}; expected "
                                     f"[B, S, >{max(self.layers)} layers, top_k={self.top_k}]")
        b, s = ids.shape[:2]
        fill = torch.arange(self.top_k, device=ids.device, dtype=ids.dtype)
        for r, layer in zip(self.routers, self.layers):
            t = ids[:, :, layer, :]
            t = torch.where(t < 0, fill, t).transpose(0, 1).reshape(s * b, self.top_k)
            r.router_replay.target_topk_idx = t.long()  # tokens in megatron's [S, B] order
        self._set(RouterReplayAction.REPLAY_FORWARD)
        self._record_into = None

    def after_forward(self) -> None:
        """After a recording forward: every layer's ids into the ``record`` destination."""
        dst = self._record_into
        if dst is None:
            return
        b, s = dst.shape[:2]
        for r, layer in zip(self.routers, self.layers):
            got = r.router_replay.get_recorded_indices()
            dst[:, :, layer, :] = got.view(s, b, self.top_k).transpose(0, 1).to(dst.dtype)
        self._record_into = None

    def before_forward(self, mb: dict, recording: bool) -> None:
        """Set up one micro-batch's forward: record into ``mb[KEY]`` or replay it."""
        if KEY not in mb:
            raise RoutingReplayError(
                f"actor.routing_replay={self.mode!r}: the batch has no {KEY!r} (r3 needs a "
                "rollout engine that returns routed experts: the embedded engine, or SGLang "
                "servers started with --enable-return-routed-experts)")
        if recording:
            self.record(mb[KEY])
        else:
            self.replay(mb[KEY])


def new_record_buffer(batch: dict, num_layers: int, top_k: int) -> torch.Tensor:
    """``[N, S, num_layers, top_k]`` int32 of -1 on the batch tokens' device."""
    n, s = batch["tokens"].shape
    return torch.full((n, s, num_layers, top_k), -1, dtype=torch.int32,
                      device=batch["tokens"].device)
