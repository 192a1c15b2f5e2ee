"""Spawn a local group of torch.distributed worker processes (gloo on CPU).

Used by the ``check`` command, the tests and the benchmarks. Every worker gets the torchrun
environment variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``),
so the code it runs is the same code that runs under ``torchrun`` or SLURM.

Results travel back as pickled bytes (the launcher itself never imports torch unless a result
holds tensors); a failure on any rank is re-raised in the parent with
that rank's traceback, a rank that dies without a report (killed, crashed) stops the group within
about two seconds with the rank, its pid and its exit code or signal named, and a group that does
not finish within ``timeout_s`` is killed. However the group ends, every rank and every process
below it (reward workers, checkpoint writers, rollout servers, the router) is stopped before
:func:`spawn` returns (:func:`megatron_rl.parallel.lifecycle.stop_tree`, bounded by
``STOP_BOUND_S``), and each rank kills its own process group when the launcher disappears (even
SIGKILLed: :func:`~megatron_rl.parallel.lifecycle.watch_parent`).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue as queue_mod
import signal
import socket
import time
import traceback
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from megatron_rl.parallel.backend import BACKENDS  # noqa: F401 - re-export
from megatron_rl.parallel.hostlist import expand_hostlist, tasks_per_node


class WorkerError(RuntimeError):
    """A worker process raised; the message holds its rank and traceback."""


def free_port() -> int:
    """Return a TCP port that is free on the loopback interface right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, env: dict, fn: Callable, args: tuple,
            out: Any, launcher: int | None = None, forked: bool = False) -> None:
    # Own process group, so the parent can kill anything this rank starts (e.g. reward workers,
    # checkpoint file writers) when the group fails or hangs; and the
    # group dies with the launcher, however the launcher ends.
    import torch

    os.setpgid(0, 0)
    if launcher is not None:
        from megatron_rl.parallel.lifecycle import watch_parent

        # spawn: the launcher is the parent. forkserver: the server is, and it exits with the
        # launcher (EOF on its pipe), which re-parents this rank just the same.
        watch_parent(os.getppid() if forked else launcher)
    os.environ.update(env)
    os.environ.update({
        "RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
    })
    torch.set_num_threads(max(1, int(env.get("MRL_THREADS_PER_RANK", "1"))))
    # megatron-core warns on import that apex/Transformer Engine are absent: expected on CPU.
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
    try:
        result = fn(*args)
        out.put((rank, "ok", pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL)))
    except BaseException:  # noqa: BLE001 - report every failure to the parent
        out.put((rank, "error", traceback.format_exc()))
    finally:
        if torch.distributed.is_initialized():
            try:
                torch.distributed.destroy_process_group()
            except Exception:  # noqa: BLE001 - best effort on the way out
                pass


def spawn(fn: Callable, world_size: int, args: Sequence = (), timeout_s: float = 600.0,
          env: dict | None = None, handle_signals: bool = False,
          preload: Sequence[str] = ()) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` fresh processes; return the per-rank results.

    ``fn`` must be importable (module level). It should call
    :func:`megatron_rl.parallel.runtime.init_distributed` itself, which reads the environment this
    launcher sets. Raises :class:`WorkerError` if any rank fails and :class:`TimeoutError` if the
    group does not finish in ``timeout_s`` seconds; in both cases every worker is terminated.
    ``handle_signals`` (the CLI launcher, main thread): SIGTERM/SIGINT/SIGHUP raise
    :class:`~megatron_rl.parallel.lifecycle.StopSignal` after every rank has been stopped.
    ``preload``: modules the rank forkserver imports once (:func:`start_context`).
    """
    import contextlib

    from megatron_rl.parallel.lifecycle import stop_signals

    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    with stop_signals() if handle_signals else contextlib.nullcontext():
        return _spawn(fn, world_size, args, timeout_s, env, preload)


START_METHOD_ENV = "MRL_START_METHOD"  # forkserver | spawn (default: see start_context)
# What the forkserver imports once, so that its ranks start without importing them again.
# (Third-party modules only; importing forkserver_init first imports megatron_rl, whose hook keeps
# megatron-core from importing TorchInductor.)
FORKSERVER_PRELOAD = ("megatron_rl.parallel.forkserver_init", "torch", "torch.distributed",
                      "megatron.core", "megatron.core.models.gpt", "megatron.core.optimizer",
                      "megatron.core.distributed")
PRELOAD_ENV = "MRL_FORKSERVER_PRELOAD"  # comma-separated modules the forkserver imports as well
# Variables read when a library is imported: a group that sets one must start fresh interpreters.
IMPORT_TIME_ENV = ("TRITON_INTERPRET",)


def start_context(preload: Sequence[str] = (), env: Mapping[str, str] | None = None):
    """The multiprocessing context ranks start from (``MRL_START_METHOD`` overrides the default).

    * ``forkserver``, the default on machines without a GPU driver: every rank is a fork of one
      server process per launcher that imported torch and megatron-core once (N ranks pay one
      import; a process that starts many groups, like the test suite, pays it once).
    * ``spawn``, the default where a GPU driver is present: a fresh interpreter per rank. A
      module that queries CUDA at import (megatron-core and Transformer Engine may) would leave
      the driver initialised in a forkserver, and CUDA cannot be used in a fork of that.

    ``preload`` (and ``MRL_FORKSERVER_PRELOAD``, comma-separated) names more modules for the
    server to import; only the first group a process starts sets them. A group whose ``env``
    sets a variable that libraries read at import (:data:`IMPORT_TIME_ENV`) is spawned."""
    from megatron_rl.parallel.backend import gpu_driver_present

    method = os.environ.get(START_METHOD_ENV) or (
        "spawn" if gpu_driver_present() or set(env or ()) & set(IMPORT_TIME_ENV)
        else "forkserver")
    if method not in ("spawn", "forkserver"):
        raise ValueError(f"{START_METHOD_ENV}={method!r} is not one of ('spawn', 'forkserver')")
    ctx = mp.get_context(method)
    if method == "forkserver":
        extra = [m for m in os.environ.get(PRELOAD_ENV, "").split(",") if m]
        ctx.set_forkserver_preload([*FORKSERVER_PRELOAD, *preload, *extra])
    return ctx


def _spawn(fn: Callable, world_size: int, args: Sequence, timeout_s: float,
           env: dict | None, preload: Sequence[str]) -> list[Any]:
    ctx = start_context(preload, env)
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, dict(env or {}), fn,
                                                tuple(args), out, os.getpid(),
                                                ctx.get_start_method() == "forkserver"),
                         daemon=False)
             for r in range(world_size)]
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout_s
    try:
        for p in procs:
            p.start()
        while len(results) + len(errors) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(
                    f"{world_size}-process group did not finish within {timeout_s:.0f}s "
                    f"(finished ranks: {sorted(results)}, failed ranks: {sorted(errors)})")
            try:
                rank, status, payload = out.get(timeout=min(remaining, 1.0))
            except queue_mod.Empty:
                dead = [r for r, p in enumerate(procs)
                        if p.exitcode not in (None, 0) and r not in results and r not in errors]
                if dead:
                    # Give the dead rank's queue message a moment to arrive, then give up.
                    time.sleep(0.5)
                    if out.empty():
                        raise WorkerError(_dead_ranks_message(procs, dead)) from None
                continue
            if status == "ok":
                results[rank] = pickle.loads(payload)
            else:
                errors[rank] = payload
                # One failed rank usually leaves its peers blocked in a collective: give them
                # a short grace period to fail on their own, then stop waiting.
                deadline = min(deadline, time.monotonic() + 20.0)
        if errors:
            first = min(errors)
            raise WorkerError(f"rank {first} of {world_size} failed:\n{errors[first]}")
        return [results[r] for r in range(world_size)]
    except TimeoutError:
        if errors:
            first = min(errors)
            raise WorkerError(f"rank {first} of {world_size} failed (others then hung):\n"
                              f"{errors[first]}") from None
        raise
    finally:
        _stop_ranks(procs)


def _dead_ranks_message(procs: list, dead: list[int]) -> str:
    """``rank 2 (pid 123) died (killed by SIGKILL) without a report; stopping ...``."""
    from megatron_rl.parallel.lifecycle import describe_exit

    said = "; ".join(f"rank {r} (pid {procs[r].pid}) died ({describe_exit(procs[r].exitcode)})"
                     for r in dead)
    alive = [r for r, p in enumerate(procs) if p.exitcode is None]
    return f"{said} without a report" + (f"; stopping the other ranks {alive}" if alive else "")


def _stop_ranks(procs: list) -> None:
    """Stop every rank and every process below them (SIGTERM, then SIGKILL after 10 s), reap
    the ranks, and kill what is left of their process groups."""
    from megatron_rl.parallel.lifecycle import STOP_SIGNALS, stop_tree

    # A stop signal arriving now waits until the cleanup is done (then it is handled as usual).
    old = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        stop_tree([p.pid for p in procs if p.pid is not None and p.exitcode is None])
        for p in procs:
            if p.pid is not None:
                p.join(timeout=5)
                _kill_group(p.pid)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _kill_group(pgid: int | None) -> None:
    """Kill what is left of a worker's process group (its orphaned children)."""
    if pgid is None:
        return
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


# ---- launch rules: torchrun / srun / inside an allocation / local spawn -------------------------

LOCAL_SPAWN_VAR = "MRL_LOCAL_SPAWN"


@dataclass(frozen=True)
class LaunchPlan:
    """How ``train``/``eval``/``sft`` start their ranks, decided from the environment.

    ``mode`` is ``"torchrun"`` (run this process's rank in place), ``"srun"`` (the same, with the
    torchrun variables in ``env`` derived from SLURM's), ``"refuse"`` (inside a SLURM allocation
    without per-task ``srun``: ``message`` says what to run instead) or ``"local"`` (spawn the
    ranks on this machine). ``world_size`` is the number of ranks the launcher started (0 for
    ``refuse``/``local``: the config decides)."""

    mode: str
    env: dict[str, str] = field(default_factory=dict)
    world_size: int = 0
    message: str = ""


def slurm_master_port(job_id: int, step_id: int = 0, restart: int = 0) -> int:
    """Rendezvous port of one ``srun`` step, the same on every task of it: derived from the job
    id (and the step id and restart count, so that a second step or a requeued run does not meet
    the sockets of the previous one), in 20000..39999."""
    return 20000 + (job_id * 97 + step_id * 13 + restart * 7) % 20000


def launch_mode(environ: Mapping[str, str] | None = None,
                expand: Callable[[str], list[str]] = expand_hostlist) -> LaunchPlan:
    """Decide how to start the ranks (see :class:`LaunchPlan`). Rules, first match wins:

    1. torchrun variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``): run in place;
    2. a task of an ``srun`` step (``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_STEP_ID``): run
       rank ``SLURM_PROCID`` in place; ``MASTER_ADDR`` is the first host of the step's node list
       (``SLURM_STEP_NODELIST``, else ``SLURM_JOB_NODELIST``), ``MASTER_PORT`` comes from the job
       id, unless either is already set;
    3. inside an allocation (``SLURM_JOB_ID``) but not in an ``srun`` step, e.g. the batch script
       itself: refuse (``srun`` must start one task per rank), unless ``MRL_LOCAL_SPAWN=1``;
    4. otherwise: spawn the ranks locally.
    """
    env = os.environ if environ is None else environ
    if all(k in env for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")):
        return LaunchPlan("torchrun", world_size=int(env["WORLD_SIZE"]))
    if all(k in env for k in ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_STEP_ID")):
        return _srun_plan(env, expand)
    if env.get("SLURM_JOB_ID") and env.get(LOCAL_SPAWN_VAR) != "1":
        return LaunchPlan("refuse", message=(
            f"inside SLURM allocation {env['SLURM_JOB_ID']} but not in an srun step: start one "
            "task per rank with `srun python -m megatron_rl train CONFIG ...` (tasks = TP x PP x "
            f"DP), or set {LOCAL_SPAWN_VAR}=1 to spawn all ranks on this node"))
    return LaunchPlan("local")


def _srun_plan(env: Mapping[str, str], expand: Callable[[str], list[str]]) -> LaunchPlan:
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or ""
    world = int(env["SLURM_NTASKS"])
    out = {"RANK": env["SLURM_PROCID"], "WORLD_SIZE": str(world),
           "LOCAL_RANK": env.get("SLURM_LOCALID", "0"),
           "MASTER_ADDR": env.get("MASTER_ADDR") or (expand(nodelist)[0] if nodelist
                                                     else "127.0.0.1"),
           "MASTER_PORT": env.get("MASTER_PORT") or str(slurm_master_port(
               _int(env.get("SLURM_JOB_ID")), _int(env.get("SLURM_STEP_ID")),
               _int(env.get("SLURM_RESTART_COUNT"))))}
    per_node = tasks_per_node(env.get("SLURM_STEP_TASKS_PER_NODE")
                              or env.get("SLURM_TASKS_PER_NODE") or "")
    node = _int(env.get("SLURM_NODEID"))
    if node < len(per_node):
        out["LOCAL_WORLD_SIZE"] = str(per_node[node])
    return LaunchPlan("srun", env=out, world_size=world)


def _int(value: str | None) -> int:
    return int(value) if value and value.isdigit() else 0


def threads_per_rank(environ: Mapping[str, str] | None = None) -> int | None:
    """CPU threads for one rank started in place: ``MRL_THREADS_PER_RANK``, else SLURM's
    ``SLURM_CPUS_PER_TASK``; None leaves torch's default."""
    env = os.environ if environ is None else environ
    for key in ("MRL_THREADS_PER_RANK", "SLURM_CPUS_PER_TASK"):
        if _int(env.get(key)) > 0:
            return _int(env[key])
    return None
