"""``rollout.sglang.colocate: true``: the SGLang servers share the trainer's GPUs, and the two sides
take turns with the device memory (docs/colocation.md). One step:

    rollout                        servers hold weights + KV cache; actor offloaded to the host
    release servers, onload actor  /release_memory_occupation (all tags); params, grads, optimizer
    old/ref log-probs, update      the actor alone on the device
    offload grads + optimizer      only the actor's parameters stay
    servers: weights only          /resume_memory_occupation ["weights"] (KV cache and CUDA graphs
                                   stay released; at the first sync they are released first)
    weight sync                    the weights go by from_tensor (CUDA IPC on GPU)
    offload parameters             inside the sync, once the weights are loaded
    servers: KV cache, CUDA graphs /resume_memory_occupation ["kv_cache", "cuda_graph"]; then the
                                   probe verifies the sync and the next rollout starts

This is the order slime and verl use: the sync's peak is the actor's parameters + the servers'
weights + the sync's buffers, never the KV cache on top.

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

from megatron_rl.parallel.runtime import broadcast_object, host_group

SYNC_RELEASED = ("kv_cache", "cuda_graph")  # released on the servers while the weights are sent


class Colocation:
    """The colocated step's memory hand-offs (module docstring) around one rank's actor (and
    critic)."""

    servers_generate = False  # as the sync's hooks: the servers' KV cache is released until
    # after_send, so the sync's health check must not generate

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
    def _server_call(self, action: str, tags: list[str] | None, check: bool = True
                     ) -> str | None:
        """Rank 0: release ``tags`` (None: all) the servers hold, or resume ``tags`` (None: all)
        they have released -- SGLang refuses the rest; the error, if any. Other ranks: None.
        ``check``: once every region is back, :meth:`_check_servers` (it generates: not while
        the fleet is paused)."""
        from megatron_rl.rollout import memory_occupation as mo

        engine = self.driver.engine
        if engine is None:
            return None
        try:
            wanted = mo.resolve_tags(tags)
            if action == "release":
                todo = [t for t in wanted if t not in self.servers_released]
                if todo:
                    mo.release_servers(engine.fleet.urls, todo)
                self.servers_released = sorted({*self.servers_released, *todo})
            else:
                todo = [t for t in wanted if t in self.servers_released]
                if todo:
                    mo.resume_servers(engine.fleet.urls, todo)
                self.servers_released = [t for t in self.servers_released if t not in todo]
                if check and todo and not self.servers_released:  # every region is back
                    self._check_servers(engine.fleet)
        except Exception as exc:  # noqa: BLE001 - every rank raises below
            return f"{action}_memory_occupation: {exc}"
        return None

    def _servers(self, action: str, tags: list[str] | None) -> None:
        """:meth:`_server_call` on rank 0, then every rank raises its error. A resume waits for
        every rank first (all have moved their memory off the device), and the broadcast makes
        every rank wait for the servers (none moves memory onto the device before they have
        released theirs)."""
        if action == "resume":
            _barrier()
        err = broadcast_object(self._server_call(action, tags))
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
        """The actor leaves the device on every rank before rank 0 starts the servers (they size
        their KV cache from the free memory)."""
        if self.enabled:
            import torch.distributed as dist

            moved = self.offload.offload()
            critic = self._critic("offload")
            _barrier()
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
        """``fn(*args, hooks=self, **kwargs)`` (the weight sync,
        :func:`~megatron_rl.rollout.sync.sync_weights`) in the order slime and verl use: the
        gradients and optimizer state (and the critic) leave; the servers hold only their weights
        (KV cache and CUDA graphs released where held, weights resumed); the actor's parameters
        come back; the weights are sent; :meth:`after_send` (called by the sync once the weights
        are loaded, before its probe) offloads the parameters and gives the servers their KV
        cache and CUDA graphs back."""
        if not self.enabled:
            return fn(*args, **kwargs)
        self._critic("offload")
        self.offload.offload(["grads", "optimizer"])
        self._servers("release", list(SYNC_RELEASED))  # the first sync: servers start whole
        self._servers("resume", ["weights"])
        self.offload.onload(["params"])
        out = fn(*args, hooks=self, **kwargs)
        self.offload.offload(["params"])  # no-ops when after_send ran
        self._servers("resume", None)
        return out

    # ---- hooks of the weight sync (every rank, once per attempt) --------------------------
    def before_send(self) -> None:
        """The actor's parameters on the device (again, when a failed sync is retried)."""
        self.offload.onload(["params"])

    def after_send(self) -> None:
        """The weights are loaded: the parameters leave the device on every rank, then (once all
        have: a host-group barrier; the sync calls this exactly once on every rank) rank 0
        resumes the servers' KV cache and CUDA graphs (what it released), so the probe can
        generate. No health check here: the fleet is paused until the sync continues generation
        (a generation would wait, and the server would be taken for dead); the sync's probe,
        which generates on every server after that, is their check."""
        try:
            self.offload.offload(["params"])
        finally:  # every rank reaches the barrier, also after a failed offload
            _barrier()
        err = self._server_call("resume", None, check=False)
        if err:
            raise RuntimeError(f"colocation: {err}")

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


def _barrier() -> None:
    """Every rank of the job has got here (host group)."""
    import torch.distributed as dist

    dist.barrier(group=host_group())
