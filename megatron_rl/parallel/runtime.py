"""Process-group setup: torchrun/SLURM environment -> torch.distributed -> megatron parallel_state.

One entry point, :func:`init_parallel`, does all of it:

1. read the launcher's environment (:func:`read_dist_env`: torchrun variables first, then SLURM's
   ``SLURM_PROCID`` / ``SLURM_NTASKS`` / ``SLURM_LOCALID`` / first host of ``SLURM_JOB_NODELIST``);
2. pick the backend (:func:`resolve_backend`: ``auto`` is NCCL when CUDA is usable, gloo
   otherwise; more ranks on a node than visible GPUs is refused; ``gloo`` hides CUDA from the rank)
   and initialise torch.distributed with a finite timeout, so a collective that can never complete
   raises instead of hanging forever; host objects travel over a separate gloo group with its own
   (long) timeout, since ranks wait there while rank 0 generates;
3. on CPU, enable the megatron-core CPU compatibility layer
   (:mod:`megatron_rl.parallel.cpu_compat`);
4. validate ``world = TP x PP x CP x DP`` and call ``parallel_state.initialize_model_parallel``.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Any, Mapping

import torch
import torch.distributed as dist

from megatron_rl.parallel.backend import (  # noqa: F401 - re-export
    BACKEND_ENV,
    BACKENDS,
    ParallelConfigError,
    resolve_backend,
)


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits in the job, as read from the launcher's environment."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    source: str  # "torchrun", "slurm" or "single"


@dataclass(frozen=True)
class ParallelLayout:
    """The layout this rank runs in."""

    tp: int
    pp: int
    dp: int
    rank: int
    world_size: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    backend: str
    cp: int = 1  # context-parallel size (each sequence split over cp ranks)
    cp_rank: int = 0


def first_slurm_host(nodelist: str) -> str:
    """Return the first host name of a SLURM node list.

    Examples: ``"gpu[003-005,9]"`` -> ``"gpu003"``; ``"a1,b2"`` -> ``"a1"``; ``"n[1-2]-ib"`` ->
    ``"n1-ib"``.
    """
    from megatron_rl.parallel.hostlist import expand_hostlist

    if not nodelist.strip():
        raise ParallelConfigError("SLURM_JOB_NODELIST is empty")
    try:
        return expand_hostlist(nodelist, use_scontrol=False)[0]
    except ValueError as exc:
        raise ParallelConfigError(str(exc)) from exc


def read_dist_env(environ: Mapping[str, str] | None = None) -> DistEnv:
    """Read rank/world/master from torchrun variables, else SLURM variables, else single process."""
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return DistEnv(
            rank=int(env["RANK"]), world_size=int(env["WORLD_SIZE"]),
            local_rank=int(env.get("LOCAL_RANK", "0")),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(env.get("MASTER_PORT", "29500")), source="torchrun")
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        job_id = int(env.get("SLURM_JOB_ID", "0") or 0)
        return DistEnv(
            rank=int(env["SLURM_PROCID"]), world_size=int(env["SLURM_NTASKS"]),
            local_rank=int(env.get("SLURM_LOCALID", "0")),
            master_addr=env.get("MASTER_ADDR") or first_slurm_host(
                env.get("SLURM_JOB_NODELIST", env.get("SLURM_NODELIST", "127.0.0.1"))),
            master_port=int(env.get("MASTER_PORT", str(10000 + job_id % 20000))),
            source="slurm")
    return DistEnv(rank=0, world_size=1, local_rank=0, master_addr="127.0.0.1",
                   master_port=int(env.get("MASTER_PORT", "29500")), source="single")




def default_backend() -> str:
    """NCCL when CUDA is usable, gloo otherwise."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def local_world_size(denv: DistEnv, environ: Mapping[str, str] | None = None) -> int:
    """Ranks on this node: ``LOCAL_WORLD_SIZE`` (torchrun, our spawn, srun plan), else SLURM's
    tasks per node of this node, else the whole world (one node); at least ``local_rank + 1``."""
    from megatron_rl.parallel.hostlist import tasks_per_node

    env = os.environ if environ is None else environ
    n = 0
    if env.get("LOCAL_WORLD_SIZE", "").isdigit():
        n = int(env["LOCAL_WORLD_SIZE"])
    elif denv.source == "slurm":
        per_node = tasks_per_node(env.get("SLURM_STEP_TASKS_PER_NODE")
                                  or env.get("SLURM_TASKS_PER_NODE") or "")
        node = int(env.get("SLURM_NODEID", "0") or 0)
        n = per_node[node] if node < len(per_node) else 0
    return max(n or denv.world_size, denv.local_rank + 1)




def hide_cuda() -> None:
    """Make this process a CPU process (``parallel.backend: gloo``): ``CUDA_VISIBLE_DEVICES=""``.

    Only works before CUDA is initialised in the process; raises a clear error otherwise."""
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    if torch.cuda.is_available():
        raise ParallelConfigError(
            "parallel.backend=gloo runs the ranks on the CPU, but CUDA was already initialised in "
            "this process; start it with CUDA_VISIBLE_DEVICES= (empty)")


def choose_backend(requested: str | None = None) -> str:
    """Resolve ``requested`` (None or ``"auto"``: ``$MRL_PARALLEL_BACKEND``, else ``auto``) for
    this process. Chosen gloo on a machine with GPUs hides CUDA (:func:`hide_cuda`)."""
    req = requested if requested not in (None, "auto") else os.environ.get(BACKEND_ENV) or "auto"
    if req == "gloo":
        if os.environ.get("CUDA_VISIBLE_DEVICES") != "":
            hide_cuda()
        return "gloo"
    denv = read_dist_env()
    return resolve_backend(req, local_world_size(denv), torch.cuda.device_count())


def validate_layout(world_size: int, tp: int, pp: int, dp: int | None = None, cp: int = 1,
                    ep: int = 1) -> int:
    """Check the sizes and return DP (``world / (TP x PP x CP)``). Errors name every size
    involved.

    Expert parallelism splits each MoE layer's experts over ``ep`` ranks of one pipeline stage
    (expert tensor parallelism 1): megatron-core needs ``TP x DP`` (the ranks of a stage) to be a
    multiple of ``ep``."""
    for name, val in (("tensor_parallel_size", tp), ("pipeline_parallel_size", pp),
                      ("context_parallel_size", cp), ("expert_parallel_size", ep)):
        if not isinstance(val, int) or val < 1:
            raise ParallelConfigError(f"{name} must be a positive integer, got {val!r}")
    if world_size % (tp * pp * cp) != 0:
        raise ParallelConfigError(
            f"world size {world_size} is not divisible by tensor_parallel_size ({tp}) x "
            f"pipeline_parallel_size ({pp}) x context_parallel_size ({cp}) = {tp * pp * cp}")
    implied = world_size // (tp * pp * cp)
    if dp is not None and dp != implied:
        raise ParallelConfigError(
            f"world size {world_size} != tensor_parallel_size ({tp}) x pipeline_parallel_size "
            f"({pp}) x context_parallel_size ({cp}) x data_parallel_size ({dp}) = "
            f"{tp * pp * cp * dp}")
    if (tp * implied) % ep:
        raise ParallelConfigError(
            f"expert_parallel_size={ep} must divide the ranks of a pipeline stage: "
            f"tensor_parallel_size ({tp}) x data_parallel_size ({implied}) = {tp * implied}")
    if cp > 1 and ep > 1:
        raise ParallelConfigError(
            f"context_parallel_size={cp} with expert_parallel_size={ep} is not supported "
            "(allowed with cp > 1: expert_parallel_size 1)")
    return implied


def set_deterministic(enabled: bool) -> None:
    """``trainer.deterministic``: bit-reproducible GPU kernels at a cost (docs/gpu.md). Sets
    ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (read when cuBLAS starts: call before the first GEMM),
    ``torch.use_deterministic_algorithms`` (ops without a deterministic kernel warn), cuDNN
    deterministic without autotuning, and SDPA's math backend only (flash / memory-efficient /
    cuDNN attention backward passes accumulate in a nondeterministic order)."""
    if not enabled:
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    torch.backends.cuda.enable_flash_sdp(False)
    torch.backends.cuda.enable_mem_efficient_sdp(False)
    torch.backends.cuda.enable_cudnn_sdp(False)
    torch.backends.cuda.enable_math_sdp(True)


def init_distributed(backend: str | None = None, timeout_s: float = 600.0,
                     host_timeout_s: float | None = None, socket_ifname: str = "") -> DistEnv:
    """Initialise torch.distributed from the environment (idempotent).

    ``backend``: ``auto`` | ``nccl`` | ``gloo`` (None: ``$MRL_PARALLEL_BACKEND`` or auto; see
    :func:`choose_backend`). ``timeout_s`` bounds every collective of the default (and megatron's)
    groups; ``host_timeout_s`` (default ``timeout_s``) bounds the host-object group, where ranks
    wait while rank 0 generates a rollout. Where the rendezvous store and gloo listen
    (:func:`megatron_rl.parallel.netbind.bind_plan`): loopback when ``MASTER_ADDR`` is loopback
    (a local spawn), the address of ``socket_ifname`` (``parallel.socket_ifname``) when set.
    """
    from megatron_rl.parallel import netbind

    denv = read_dist_env()
    if dist.is_initialized():
        return denv
    backend = choose_backend(backend)
    extra: dict[str, Any] = {}
    if backend == "nccl":
        dev = torch.device("cuda", denv.local_rank)  # resolve_backend: local_rank < GPU count
        torch.cuda.set_device(dev)
        extra["device_id"] = dev  # binds the communicator to this rank's GPU up front
    try:
        bind = netbind.bind_plan(denv.master_addr, socket_ifname, denv.rank)
    except netbind.BindError as exc:
        raise ParallelConfigError(str(exc)) from exc
    if bind.gloo_ifname is not None:  # every gloo group of this process, made from now on
        os.environ[netbind.GLOO_IFNAME_VAR] = bind.gloo_ifname
    if socket_ifname and not netbind.is_loopback(denv.master_addr):
        os.environ["NCCL_SOCKET_IFNAME"] = socket_ifname  # NCCL's bootstrap sockets
    timeout = datetime.timedelta(seconds=timeout_s)
    if bind.store_address is None or netbind.agent_hosts_store():
        dist.init_process_group(
            backend=backend, init_method=f"tcp://{denv.master_addr}:{denv.master_port}",
            rank=denv.rank, world_size=denv.world_size, timeout=timeout, **extra)
    else:
        try:
            store = netbind.rendezvous_store(denv.master_addr, denv.master_port,
                                             denv.world_size, denv.rank == 0, timeout,
                                             bind.store_address)
        except netbind.BindError as exc:
            raise ParallelConfigError(str(exc)) from exc
        dist.init_process_group(backend=backend, store=store, rank=denv.rank,
                                world_size=denv.world_size, timeout=timeout, **extra)
    _make_host_group(timeout_s if host_timeout_s is None else host_timeout_s, timeout_s)
    return denv


def init_parallel(tp: int = 1, pp: int = 1, dp: int | None = None, cp: int = 1,
                  seed: int = 1234, backend: str | None = None,
                  timeout_s: float = 600.0, host_timeout_s: float | None = None,
                  socket_ifname: str = "", ep: int = 1) -> ParallelLayout:
    """Set up torch.distributed and megatron ``parallel_state`` for a TP x PP x CP x DP layout
    (``cp``: context-parallel size, each sequence split over ``cp`` ranks, see
    :mod:`megatron_rl.parallel.context_parallel`; ``ep``: expert-parallel size of MoE layers,
    carved out of TP x DP).

    Raises :class:`ParallelConfigError` (before any collective) when the sizes do not fit the world
    or the backend cannot run this many ranks on this node's GPUs.
    """
    denv = read_dist_env()
    dp = validate_layout(denv.world_size, tp, pp, dp, cp, ep)
    backend = choose_backend(backend) if not dist.is_initialized() else dist.get_backend()
    if backend == "gloo" and not torch.cuda.is_available():
        from megatron_rl.parallel import cpu_compat
        cpu_compat.enable()
    init_distributed(backend, timeout_s, host_timeout_s, socket_ifname)
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        context_parallel_size=cp,
        # experts are never split inside (expert TP 1; megatron's default would be tp)
        expert_model_parallel_size=ep, expert_tensor_parallel_size=1,
        distributed_timeout_minutes=timeout_s / 60.0)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return current_layout(backend)


def current_layout(backend: str | None = None) -> ParallelLayout:
    """The layout of this rank, read from megatron ``parallel_state``."""
    from megatron.core import parallel_state as ps

    return ParallelLayout(
        tp=ps.get_tensor_model_parallel_world_size(),
        pp=ps.get_pipeline_model_parallel_world_size(),
        dp=ps.get_data_parallel_world_size(),
        rank=dist.get_rank(), world_size=dist.get_world_size(),
        tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        dp_rank=ps.get_data_parallel_rank(),
        backend=backend or dist.get_backend(),
        cp=ps.get_context_parallel_world_size(), cp_rank=ps.get_context_parallel_rank())


def is_rank0() -> bool:
    """True on global rank 0 (the rollout driver's rank)."""
    return dist.get_rank() == 0


def last_stage_rank() -> int:
    """Global rank of the last pipeline stage's TP-rank-0, DP-rank-0 process (where the loss and
    the update metrics live). Collective (one small all-reduce); the same on every rank."""
    from megatron.core import parallel_state as ps

    mine = (ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0
            and ps.get_data_parallel_rank() == 0 and ps.get_context_parallel_rank() == 0)
    t = torch.tensor([dist.get_rank() if mine else dist.get_world_size()], dtype=torch.int64,
                     device="cpu")  # a host int: over the gloo host group
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=host_group())
    return int(t.item())


def first_replica() -> bool:
    """True on the ranks of DP replica 0 and CP rank 0: the one copy of the weights that sends
    them (weight sync) or reports them. Weights are replicated over DP and over CP."""
    from megatron.core import parallel_state as ps

    return ps.get_data_parallel_rank() == 0 and ps.get_context_parallel_rank() == 0


def shutdown() -> None:
    """Tear down megatron parallel_state and torch.distributed (safe to call twice)."""
    from megatron.core import parallel_state as ps

    global _HOST_GROUP
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    _HOST_GROUP = None
    if dist.is_initialized():
        dist.destroy_process_group()


# ---- device and host collectives ---------------------------------------------------------------
# ``None`` until torch.distributed is initialised; then the gloo group every host-object
# collective uses (WORLD itself when the default backend is already gloo).
_HOST_GROUP: Any = None


def backend_is_nccl() -> bool:
    """True when the default process group's backend includes NCCL (CUDA tensor collectives)."""
    return dist.is_available() and dist.is_initialized() and "nccl" in str(
        dist.get_backend()).lower()


def device() -> torch.device:
    """The one place that decides where the actor's tensors live.

    CUDA (the current device) when the default process group is NCCL, or when no process group
    exists and CUDA is usable; CPU otherwise (gloo means every collective takes CPU tensors).
    """
    if dist.is_available() and dist.is_initialized():
        if backend_is_nccl():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _make_host_group(timeout_s: float = 600.0, world_timeout_s: float | None = None) -> None:
    """Create the gloo host group (collective: every rank calls it, right after init).

    WORLD itself when the default backend is gloo and the timeouts are equal; a separate gloo group
    with ``timeout_s`` otherwise."""
    global _HOST_GROUP
    if not backend_is_nccl() and (world_timeout_s is None or world_timeout_s == timeout_s):
        _HOST_GROUP = dist.group.WORLD
        return
    _HOST_GROUP = dist.new_group(backend="gloo",
                                 timeout=datetime.timedelta(seconds=timeout_s))


def host_group():
    """The gloo process group over all ranks for host objects and host (CPU) tensors.

    WORLD when the default backend is gloo; a separate gloo group (made by
    :func:`init_distributed`) when it is NCCL, so pickled objects and CPU scalars never go
    through NCCL (which only moves CUDA tensors).
    """
    if _HOST_GROUP is None:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("host_group() needs torch.distributed to be initialised")
        _make_host_group()  # process group made outside init_distributed: every rank gets here
    return _HOST_GROUP


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """``obj`` (any picklable host object) from global rank ``src`` on every rank, over gloo."""
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=host_group())
    return box[0]


def move_batch_(batch: dict[str, Any], dev: torch.device | str | None = None) -> dict[str, Any]:
    """Move every tensor of ``batch`` to ``dev`` (default :func:`device`) in place; returns it.

    Tensors already there are kept as they are (no copy), so calling it twice costs nothing.
    """
    dev = torch.device(dev) if dev is not None else device()
    for k, v in batch.items():
        if isinstance(v, torch.Tensor) and v.device != dev:
            batch[k] = v.to(dev, non_blocking=dev.type == "cuda")
    return batch
