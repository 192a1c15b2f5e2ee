"""``rollout.sglang.colocate: true``: the SGLang servers share the trainer's GPUs, and the two sides
take turns with the device memory (docs/colocation.md). One step:

    rollout                        servers hold weights + KV cache; actor offloaded to the host
    release servers, onload actor  /release_memory_occupation (all tags); params, grads, optimizer
    old/ref log-probs, update      the actor alone on the device
    offload grads + optimizer      only the actor's parameters stay
    resume servers, weight sync    /resume_memory_occupation; the weights go by from_tensor
                                   (CUDA IPC on GPU) and are verified by the probe
    offload parameters             the actor is off the device; the next rollout starts

A GAE critic (``trainer.advantage: gae``) is on the device only for the values and the update: it
comes back with the actor after the rollout and leaves whole before the weight sync. A checkpoint
save in between takes parameters and optimizer state (actor and critic) back on the device while
the servers release only their KV cache. Every method is called on every rank (SPMD): rank 0 talks
to the servers, a host-group broadcast orders the ranks, and each rank moves its own actor shard.
With ``colocate`` off every method does nothing.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

from megatron_rl.parallel.runtime import broadcast_object


class Colocation:
    """The colocated step's memory hand-offs (module docstring) around one rank's actor (and
    critic)."""

    def __init__(self, cfg, actor, driver, critic=None) -> None:
        s = cfg.rollout.sglang
        self.enabled = cfg.rollout.engine == "sglang" and s.colocate
        self.driver = driver
        self.offload = self.critic_offload = None
        self.servers_released: list[str] = []  # rank 0's view of the servers' released tags
        if self.enabled:
            from megatron_rl.actor.offload import ActorOffload

            self.offload = ActorOffload(actor)
            if critic is not None:
                self.critic_offload = ActorOffload(critic)

    def _critic(self, action: str, groups=None) -> dict[str, int]:
        """Offload/onload ``groups`` (default all) of the critic, if there is one."""
        if self.critic_offload is None:
            return {}
        return getattr(self.critic_offload, action)(*([groups] if groups else []))

    # ---- servers (rank 0 posts; every rank waits for it) ----------------------------------
    def _servers(self, action: str, tags: list[str] | None) -> None:
        from megatron_rl.rollout import memory_occupation as mo

        err = None
        engine = self.driver.engine
        if engine is not None:  # rank 0
            try:
                urls = engine.fleet.urls
                if action == "release":
                    mo.release_servers(urls, tags)
                    self.servers_released = sorted({*self.servers_released,
                                                    *mo.resolve_tags(tags)})
                else:
                    todo = list(tags or self.servers_released)
                    if todo:  # only what was released (SGLang refuses the rest)
                        mo.resume_servers(urls, todo)
                    self.servers_released = [t for t in self.servers_released if t not in todo]
                    if todo and not self.servers_released:
                        self._check_servers(engine.fleet)
            except Exception as exc:  # noqa: BLE001 - every rank raises below
                err = f"{action}_memory_occupation: {exc}"
        err = broadcast_object(err)
        if err:
            raise RuntimeError(f"colocation: {err}")

    @staticmethod
    def _check_servers(fleet) -> None:
        """Once every region is back: one ``/health_generate`` per server (dead ones leave the
        router and restart, :meth:`~megatron_rl.rollout.fleet.Fleet.check_health`). The router
        does not probe colocated servers (its ``/health`` would generate on released memory:
        :func:`~megatron_rl.rollout.fleet.router_health_checks`), so this is their check."""
        dead = fleet.check_health()
        if dead:
            print(f"[colocation] after the resume, {dead} did not answer; removed from the "
                  "router", flush=True)

    # ---- the loop's hand-offs --------------------------------------------------------------
    def before_engine_start(self) -> None:
        """The actor leaves the device before the servers start (they size their KV cache from
        the free memory)."""
        if self.enabled:
            import torch.distributed as dist

            moved = self.offload.offload()
            critic = self._critic("offload")
            if dist.get_rank() == 0:
                print("[colocation] rank 0 actor offloaded to the host: " + ", ".join(
                    f"{g} {n / 2**20:.1f} MiB" for g, n in moved.items()) + (
                    f"; critic {sum(critic.values()) / 2**20:.1f} MiB" if critic else ""),
                    flush=True)

    def after_rollout(self, phases=None) -> None:
        """Servers release everything; the whole actor (and critic) comes back (timed as
        ``time/colocate_swap`` in ``phases``)."""
        if self.enabled:
            with phases("colocate_swap") if phases is not None else contextlib.nullcontext():
                self._servers("release", None)
                self.offload.onload()
                self._critic("onload")

    def sync(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` (the weight sync) with only the actor's parameters on the
        device and the servers resumed; the parameters leave afterwards."""
        if not self.enabled:
            return fn(*args, **kwargs)
        self._critic("offload")
        self.offload.offload(["grads", "optimizer"])
        self.offload.onload(["params"])
        self._servers("resume", None)  # whatever rank 0 released
        out = fn(*args, **kwargs)
        self.offload.offload(["params"])
        return out

    @contextlib.contextmanager
    def resident(self):
        """Parameters and optimizer state (actor and critic) on the device (a checkpoint save)
        while the servers free their KV cache; back to the rollout state afterwards."""
        if not self.enabled:
            yield
            return
        self._servers("release", ["kv_cache"])
        self.offload.onload(["params", "optimizer"])
        self._critic("onload", ["params", "optimizer"])
        try:
            yield
        finally:
            self.offload.offload(["params", "optimizer"])
            self._critic("offload", ["params", "optimizer"])
            self._servers("resume", ["kv_cache"])
