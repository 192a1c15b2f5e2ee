"""``rollout.sglang.colocate: true``: the SGLang servers share the trainer's GPUs, and the two sides
take turns with the device memory (docs/colocation.md). One step:

    rollout                        servers hold weights + KV cache; actor offloaded to the host
    release servers, onload actor  /release_memory_occupation (all tags); params, grads, optimizer
    old/ref log-probs, update      the actor alone on the device
    offload grads + optimizer      only the actor's parameters stay
    resume servers, weight sync    /resume_memory_occupation; the weights go by from_tensor
                                   (CUDA IPC on GPU) and are verified by the probe
    offload parameters             the actor is off the device; the next rollout starts

A checkpoint save in between takes parameters and optimizer state back on the device while the
servers release only their KV cache. Every method is called on every rank (SPMD): rank 0 talks
to the servers, a host-group broadcast orders the ranks, and each rank moves its own actor shard.
With ``colocate`` off every method does nothing.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

from megatron_rl.config.errors import ConfigError


def validate_colocation(cfg) -> None:
    """Config rules of ``rollout.sglang.colocate``; messages name the fields and the allowed
    values. (Servers started on the trainer's GPUs without colocation are refused when they would
    start: :func:`server_gpus` -- a config may list its servers only on the command line.)"""
    s = cfg.rollout.sglang
    if not s.colocate:
        return
    if cfg.rollout.engine != "sglang":
        raise ConfigError(f"rollout.sglang.colocate=true needs rollout.engine='sglang', got "
                          f"{cfg.rollout.engine!r}")
    if s.weight_sync == "from_distributed":
        raise ConfigError("rollout.sglang.colocate=true needs rollout.sglang.weight_sync in "
                          "('from_tensor', 'from_disk'), got 'from_distributed' (NCCL cannot "
                          "join two ranks on one GPU; colocated weights go by CUDA IPC: "
                          "from_tensor)")
    if cfg.trainer.advantage == "gae":
        raise ConfigError("rollout.sglang.colocate=true does not offload the critic: "
                          "trainer.advantage='gae' is not available with it (allowed: grpo, "
                          "dr_grpo, rloo, reinforce_pp, reinforce_pp_baseline)")


PLACEMENT_ERROR = (
    "rollout.sglang.launcher='sglang' with empty rollout.sglang.gpus would start the SGLang "
    "servers on the trainer's GPUs while the actor keeps all its memory: set rollout.sglang.gpus "
    "to GPUs the trainer does not use (a separate fleet), list running servers in "
    "rollout.sglang.servers, or set rollout.sglang.colocate=true (share the trainer's GPUs; the "
    "actor is offloaded during rollout and the servers release their memory during the update)")


def on_cpu(s) -> bool:
    """Whether started SGLang servers run on the CPU (``--device cpu`` in ``extra_args``)."""
    args = [str(a) for a in (getattr(s, "extra_args", None) or [])]
    return any(a == "--device=cpu" or (a == "--device" and args[k + 1:k + 2] == ["cpu"])
               for k, a in enumerate(args))


def server_gpus(s, i: int) -> list[str]:
    """CUDA device ids of started server ``i``: ``rollout.sglang.gpus``, or -- colocated SGLang
    servers with no list -- the trainer's own GPUs, ``tp_size`` per server from its first GPU
    (through the trainer's ``CUDA_VISIBLE_DEVICES`` when set). An SGLang server with neither is
    refused (:data:`PLACEMENT_ERROR`)."""
    import os

    if s.gpus:
        gpus = [str(g) for g in s.gpus]
    elif s.launcher == "sglang" and s.colocate:
        visible = [g for g in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if g]
        n = s.num_servers * s.tp_size
        gpus = visible[:n] if visible else [str(g) for g in range(n)]
    elif s.launcher == "sglang" and not on_cpu(s):
        raise ConfigError(PLACEMENT_ERROR)
    else:
        gpus = []  # our CPU serve, or SGLang started with --device cpu
    return gpus[i * s.tp_size:(i + 1) * s.tp_size]


class Colocation:
    """The colocated step's memory hand-offs (module docstring) around one rank's actor."""

    def __init__(self, cfg, actor, driver) -> None:
        s = cfg.rollout.sglang
        self.enabled = cfg.rollout.engine == "sglang" and s.colocate
        self.driver = driver
        self.offload = None
        self.servers_released: list[str] = []  # rank 0's view of the servers' released tags
        if self.enabled:
            from megatron_rl.actor.offload import ActorOffload

            self.offload = ActorOffload(actor)

    # ---- servers (rank 0 posts; every rank waits for it) ----------------------------------
    def _servers(self, action: str, tags: list[str] | None) -> None:
        from megatron_rl.rollout import memory_occupation as mo
        from megatron_rl.run.driver import broadcast_object

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
            except Exception as exc:  # noqa: BLE001 - every rank raises below
                err = f"{action}_memory_occupation: {exc}"
        err = broadcast_object(err)
        if err:
            raise RuntimeError(f"colocation: {err}")

    # ---- the loop's hand-offs --------------------------------------------------------------
    def before_engine_start(self) -> None:
        """The actor leaves the device before the servers start (they size their KV cache from
        the free memory)."""
        if self.enabled:
            import torch.distributed as dist

            moved = self.offload.offload()
            if dist.get_rank() == 0:
                print("[colocation] rank 0 actor offloaded to the host: " + ", ".join(
                    f"{g} {n / 2**20:.1f} MiB" for g, n in moved.items()), flush=True)

    def after_rollout(self, phases=None) -> None:
        """Servers release everything; the whole actor comes back (timed as
        ``time/colocate_swap`` in ``phases``)."""
        if self.enabled:
            with phases("colocate_swap") if phases is not None else contextlib.nullcontext():
                self._servers("release", None)
                self.offload.onload()

    def sync(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` (the weight sync) with only the actor's parameters on the
        device and the servers resumed; the parameters leave afterwards."""
        if not self.enabled:
            return fn(*args, **kwargs)
        self.offload.offload(["grads", "optimizer"])
        self.offload.onload(["params"])
        self._servers("resume", None)  # whatever rank 0 released
        out = fn(*args, **kwargs)
        self.offload.offload(["params"])
        return out

    @contextlib.contextmanager
    def resident(self):
        """Parameters and optimizer state on the device (a checkpoint save) while the servers
        free their KV cache; back to the rollout state afterwards."""
        if not self.enabled:
            yield
            return
        self._servers("release", ["kv_cache"])
        self.offload.onload(["params", "optimizer"])
        try:
            yield
        finally:
            self.offload.offload(["params", "optimizer"])
            self._servers("resume", ["kv_cache"])
