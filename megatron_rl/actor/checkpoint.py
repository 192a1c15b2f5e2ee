"""Atomic, reshardable checkpoints with megatron ``dist_checkpointing``.

Layout of a checkpoint root::

    ROOT/latest                  text file naming the newest complete checkpoint ("step_0000012")
    ROOT/step_0000012/           dist_checkpointing dir: model + optimizer (sharded, reshardable)
    ROOT/step_0000012/trainer.pt common state: step, scheduler, trainer/controller state, data pos
    ROOT/step_0000012/rng/rank_00003.pt   per-rank RNG states (restored when the layout is equal)

A save writes ``step_N.tmp`` first; only after every rank finished does rank 0 fsync its files,
rename it and then replace ``latest`` (temp file + fsync + ``os.replace`` + fsync of the directory).
A crash at any point leaves the previous checkpoint and ``latest`` intact; stale ``*.tmp`` dirs are
ignored and cleaned up on the next save. A write that fails on any rank (disk full, read-only run
directory) fails the save on every rank together (no rank is left waiting in a collective) with a
:class:`CheckpointWriteError` that names the checkpoint kept; the partial ``step_N.tmp`` is removed.

Asynchronous saves (:func:`start_async_save`, :class:`CheckpointSaver` with ``async_save``): a
writer thread copies the shards to host memory and runs megatron's ``torch_dist`` writer while
training goes on (the next optimizer step or offload first waits for the copy:
:meth:`CheckpointSaver.wait_staged`), and :meth:`PendingSave.finalize` (the next save, a resume,
or exit) does the agreement, checks and publication above; until then ``latest`` names the
previous one.

Loading never unpickles arbitrary objects: ``trainer.pt`` and the RNG files are read with
``torch.load(weights_only=True)`` (plain containers, numbers, strings, tensors; old checkpoints'
numpy RNG states through an explicit allow-list), and the sharded checkpoint's pickled
``.metadata`` is screened by an allow-list unpickler before megatron reads it
(:func:`check_pickle_globals`). A checkpoint that needs anything else is refused.
"""

from __future__ import annotations

import copy
import errno
import functools
import os
import pickle
import random
import shutil
import threading
from typing import Any, Callable, NamedTuple

import numpy as np
import torch
import torch.distributed as dist

from megatron_rl.actor.ckpt_index import (  # noqa: F401 - re-export
    LATEST,
    CheckpointError,
    latest_checkpoint,
    step_dir_name,
)
from megatron_rl.actor.distopt_compat import SHARDING_TYPE
from megatron_rl.testing.chaos_hook import phase_begins


class CheckpointWriteError(CheckpointError):
    """A checkpoint could not be written; the previous one is kept (named in the message)."""


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint file needs objects outside the allow-list to load (refused, never run)."""


# Globals the pickled DCP ``.metadata`` of a sharded checkpoint may name: torch's checkpoint
# metadata classes, torch dtypes/sizes/memory formats, a few containers.
DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.planner",
               "torch.distributed.checkpoint._extension")
SAFE_GLOBALS = {("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset"),
                ("builtins", "slice"), ("torch", "Size"), ("torch.serialization", "_get_layout"),
                ("torch._utils", "_rebuild_tensor_v2"),
                ("torch.storage", "_load_from_bytes"), ("datetime", "timedelta"),
                ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
                ("megatron.core.dist_checkpointing.strategies.torch", "MCoreMetadata")}


def _allowed_global(module: str, name: str) -> bool:
    if (module, name) in SAFE_GLOBALS or module in DCP_MODULES:
        return True
    import torch as _torch

    # torch.float32, torch.contiguous_format, ...: plain attributes, not callables that run code
    return module == "torch" and isinstance(getattr(_torch, name, None),
                                            (_torch.dtype, _torch.memory_format, _torch.layout))


class _AllowListUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if not _allowed_global(module, name):
            raise pickle.UnpicklingError(f"global {module}.{name} is not allowed")
        return super().find_class(module, name)


def check_pickle_globals(path: str) -> None:
    """Unpickle ``path`` with an allow-list of globals (no other code can run); raises
    :class:`UnsafeCheckpointError` naming the file and the refused global."""
    try:
        with open(path, "rb") as f:
            _AllowListUnpickler(f).load()
    except pickle.UnpicklingError as exc:
        raise UnsafeCheckpointError(
            f"{path}: refusing to load: {exc} (a checkpoint holds only tensors and plain data; "
            "this file may run code when unpickled - do not load it)") from None


def safe_torch_load(path: str) -> Any:
    """``torch.load(path, weights_only=True)``, allowing only old numpy RNG states beyond plain
    data; anything else is an :class:`UnsafeCheckpointError` naming the file."""
    import numpy as _np

    extra = [_np.ndarray, _np.dtype]
    for mod in ("numpy._core.multiarray", "numpy.core.multiarray"):
        try:
            extra.append(__import__(mod, fromlist=["_reconstruct"])._reconstruct)
            break
        except (ImportError, AttributeError):
            continue
    dtypes = getattr(_np, "dtypes", None)
    if dtypes is not None and hasattr(dtypes, "UInt32DType"):
        extra.append(dtypes.UInt32DType)
    try:
        with torch.serialization.safe_globals(extra):
            return torch.load(path, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UnsafeCheckpointError(
            f"{path}: refusing to load: it needs objects outside the allow-list ({first}); a "
            "checkpoint holds only tensors and plain data - this file may run code when "
            "unpickled, do not load it") from None


def read_meta(path: str) -> dict[str, Any]:
    """The common state of checkpoint ``path`` (``trainer.pt``), loaded without running code."""
    meta_path = os.path.join(path, "trainer.pt")
    if not os.path.exists(meta_path):
        raise CheckpointError(f"{path} is not a megatron_rl checkpoint (no trainer.pt)")
    return safe_torch_load(meta_path)


def _rng_device() -> str:
    """The device type whose generators the megatron RNG tracker holds here."""
    from megatron_rl.parallel.runtime import device

    return device().type


def _rng_state() -> dict[str, Any]:
    from megatron.core import tensor_parallel

    tracker = tensor_parallel.get_cuda_rng_tracker()
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    return {"torch": torch.get_rng_state(),
            "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss],
            "python": list(random.getstate()), "device": _rng_device(),
            "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
            "tracker": {k: v.clone() for k, v in tracker.get_states().items()}}


def saved_rng_device(state: dict[str, Any]) -> str:
    """Device type the tracker states of ``state`` belong to (older checkpoints: inferred)."""
    return state.get("device") or ("cuda" if state.get("cuda") is not None else "cpu")


def _set_rng_state(state: dict[str, Any]) -> bool:
    """Restore host RNGs always; CUDA and tracker states only when saved on this device type
    (a CPU generator state is not a CUDA one). Returns whether the tracker was restored."""
    from megatron.core import tensor_parallel

    torch.set_rng_state(state["torch"])
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    keys = keys.numpy() if isinstance(keys, torch.Tensor) else np.asarray(keys)
    np.random.set_state((kind, keys.astype(np.uint32), pos, has_gauss, gauss))
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
    if saved_rng_device(state) != _rng_device():
        return False
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])
    return True


def _layout_key() -> tuple[int, ...]:
    """(TP, PP, DP), plus CP when it is > 1 (keys of CP-1 checkpoints are unchanged)."""
    from megatron.core import parallel_state as ps

    cp = ps.get_context_parallel_world_size()
    return (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(),
            ps.get_data_parallel_world_size()) + ((cp,) if cp > 1 else ())


def _sharded_state(model, optimizer, is_loading: bool, main_from=None
                   ) -> tuple[dict, dict[int, torch.Tensor]]:
    """The model (its fp32 main weights when ``main_from`` is a mixed-precision optimizer) and
    the optimizer state, as megatron sharded state dicts; and the fp32 tensors the model part's
    half-precision params point at (``{}`` for fp32 actors)."""
    from megatron_rl.actor.precision import (
        distributed_optimizers,
        fresh_main_buffers,
        main_param_map,
        optimizer_main_tensors,
        point_sharded_at_main,
    )

    module = getattr(model, "module", model)
    from megatron_rl.models import lora

    if lora.adapters_of(module):  # LoRA: the adapters only (the base comes from its source)
        model_sd = lora.sharded_state_dict(module, prefix="model.")
    else:
        model_sd = module.sharded_state_dict(prefix="model.")
    sd = {"model": model_sd}
    if optimizer is not None:
        # The distributed optimizer's format (ignored by the standard one): loadable at any
        # TP/PP/DP layout (megatron_rl/actor/distopt_compat.py).
        sd["optimizer"] = optimizer.sharded_state_dict(
            model_sd, is_loading=is_loading,
            metadata={"distrib_optim_sharding_type": SHARDING_TYPE})
    mains: dict[int, torch.Tensor] = {}
    if main_from is not None:
        if not distributed_optimizers(main_from):
            mains = main_param_map(main_from)
        elif is_loading:  # full fp32 weights land here; each rank then keeps its DP shard
            mains = fresh_main_buffers(main_from)
        else:  # the main weights megatron's fully_reshardable state already gathered
            mains = optimizer_main_tensors(main_from, sd["optimizer"])
        point_sharded_at_main(model_sd, main_from, mains)  # after the optimizer mapped params
    return sd, mains


def save_checkpoint(root: str, step: int, model, optimizer, scheduler,
                    trainer_state: dict[str, Any] | None = None) -> str:
    """Save atomically; collective over all ranks. Returns the checkpoint path.

    Raises :class:`CheckpointWriteError` on every rank when any rank's write fails (disk full,
    read-only directory, ...): ``latest`` still names the previous checkpoint, which stays
    loadable, and the partial directory is removed."""
    from megatron.core import dist_checkpointing

    from megatron_rl.util.sync_save import use_in_process_results_queue

    plan = _begin_save(root, step)
    # The model part holds the fp32 main weights whatever the precision.
    sharded, _ = _sharded_state(model, optimizer, is_loading=False, main_from=optimizer)
    err = None
    use_in_process_results_queue()
    try:
        dist_checkpointing.save(sharded, plan.tmp)
    except Exception as exc:  # noqa: BLE001 - a write error on any rank (DCP re-raises it)
        err = exc
    if err is None:
        err = _write_common(plan.tmp, step, model, scheduler, trainer_state)
    return _finish_save(plan, err)


class _SavePlan(NamedTuple):
    """Where one save writes (``tmp``), publishes (``final``) and which checkpoint it keeps."""

    root: str
    step: int
    tmp: str
    final: str
    kept: str | None

    def fail(self, exc: BaseException | None) -> None:
        """Collective: raise :class:`CheckpointWriteError` on every rank if any rank failed."""
        _agree_or_raise(exc, self.step, self.root, self.tmp, self.kept, dist.get_rank())


def _begin_save(root: str, step: int) -> _SavePlan:
    """Collective: rank 0 makes a fresh ``step_N.tmp`` (removing stale ones)."""
    final = os.path.join(root, step_dir_name(step))
    plan = _SavePlan(root, step, final + ".tmp", final, _kept_checkpoint(root))
    err = None
    if dist.get_rank() == 0:
        try:
            _prepare_tmp(root, plan.tmp)
        except OSError as exc:
            err = exc
    plan.fail(err)
    return plan


def _common_files(step: int, model, scheduler,
                  trainer_state: dict[str, Any] | None) -> dict[str, Any]:
    """This rank's RNG states, and (rank 0) ``trainer.pt``: ``{relative path: object}``,
    snapshots taken now (training may change the live objects afterwards)."""
    from megatron_rl.actor.precision import precision_of

    rank = dist.get_rank()
    files: dict[str, Any] = {os.path.join("rng", f"rank_{rank:05d}.pt"): _rng_state()}
    if rank == 0:
        files["trainer.pt"] = copy.deepcopy({
            "step": step, "layout": _layout_key(), "precision": precision_of(model),
            "scheduler": scheduler.state_dict() if scheduler is not None else None,
            "trainer": trainer_state or {}})
    return files


def _write_files(tmp: str, files: dict[str, Any]) -> BaseException | None:
    """Save and fsync each of :func:`_common_files`' objects under ``tmp``; the error, if any."""
    try:
        os.makedirs(os.path.join(tmp, "rng"), exist_ok=True)
        for rel, obj in files.items():
            _durable_save(obj, os.path.join(tmp, rel))
    except Exception as exc:  # noqa: BLE001 - torch.save's writer raises RuntimeError too
        return exc
    return None


def _write_common(tmp: str, step: int, model, scheduler,
                  trainer_state: dict[str, Any] | None) -> BaseException | None:
    """This rank's RNG states, and (rank 0) ``trainer.pt``; returns the error, if any."""
    try:
        files = _common_files(step, model, scheduler, trainer_state)
    except Exception as exc:  # noqa: BLE001 - reported to every rank
        return exc
    return _write_files(tmp, files)


def _finish_save(plan: _SavePlan, err: BaseException | None) -> str:
    """Collective: agree on the write, then rank 0 publishes it (rename + ``latest``)."""
    phase_begins("checkpoint", plan.step)  # fault injection: files written, not yet renamed
    plan.fail(err)
    err = None
    if dist.get_rank() == 0:
        try:
            _publish(plan.root, plan.tmp, plan.final, plan.step)
        except OSError as exc:
            err = exc
    plan.fail(err)
    return plan.final


def _stage_on_host(write_buckets: list, pool: list[torch.Tensor],
                   ready: torch.cuda.Event | None = None) -> list:
    """Copies of the tensors of megatron's write buckets in host memory, owned by the save.

    Runs in the writer thread. megatron's own ``preload_tensors`` returns CPU tensors as they
    are (``.to("cpu")`` is a no-op there), so on CPU the writer would read parameters the next
    step is updating. The copies go into ``pool``'s buffers, reused from the previous save when
    the shapes match (no page faults on a fresh allocation; pinned memory for device tensors).
    Device tensors: the copies wait for ``ready`` (recorded on the training thread's stream at
    the save) and one sync per device waits for them before the writer reads the copies."""
    sources = [t for _, _, (_, tensor_data) in write_buckets for _, t in tensor_data]
    if [(t.shape, t.dtype) for t in pool] != [(t.shape, t.dtype) for t in sources]:
        pool[:] = [torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda) for t in sources]
    devices = {t.device for t in sources if t.is_cuda}
    for dev in devices:  # after the training thread's last write to the tensors
        torch.cuda.current_stream(dev).wait_event(ready)
    with torch.no_grad():
        for buf, t in zip(pool, sources, strict=True):
            buf.copy_(t.detach(), non_blocking=t.is_cuda)
    for dev in devices:
        torch.cuda.current_stream(dev).synchronize()  # the writer reads the host copies
    copies = iter(pool)
    return [(file_name, storage_key, (bytes_data, [(item, next(copies)) for item, _ in td]))
            for file_name, storage_key, (bytes_data, td) in write_buckets]


def _staged_request(request, pool: list[torch.Tensor], ready: torch.cuda.Event | None):
    """``request`` with its write buckets replaced by host copies (:func:`_stage_on_host`)."""
    args = list(request.async_fn_args)  # (rank, write_buckets, results_queue)
    args[1] = _stage_on_host(args[1], pool, ready)
    return request._replace(async_fn_args=tuple(args))


class PendingSave:
    """A checkpoint being written by a background thread: it first copies the shards to host
    memory (``stage``), then runs megatron's asynchronous ``torch_dist`` writer. Whatever
    changes the parameters or optimizer state next must call :meth:`wait_staged` first.
    ``latest`` moves only in :meth:`finalize` (collective), after every rank's write completed
    and was fsynced."""

    def __init__(self, plan: _SavePlan, request, error: BaseException | None,
                 stage: Callable[[Any], Any] | None = None,
                 files: dict[str, Any] | None = None) -> None:
        self.plan = plan
        self._request = request
        self._stage = stage  # request -> request writing host copies (runs in the thread)
        self._files = files or {}  # the small RNG/trainer files (written by the thread)
        self._error = error  # of the synchronous part (planning, state snapshots)
        self._staged = threading.Event()  # set once the writer no longer reads live tensors
        self._thread: threading.Thread | None = None
        if request is not None and error is None and request.async_fn is not None:
            self._thread = threading.Thread(target=self._write, name="ckpt-writer", daemon=True)
            self._thread.start()
        else:
            self._staged.set()

    def _write(self) -> None:
        try:
            if self._stage is not None:
                self._request = self._stage(self._request)
        except BaseException as exc:  # noqa: BLE001 - reported to every rank in finalize
            self._error = exc
            return
        finally:
            self._staged.set()
        try:
            self._error = _write_files(self.plan.tmp, self._files)
            if self._error is None:
                self._request.async_fn(*self._request.async_fn_args,
                                       **self._request.async_fn_kwargs)
        except BaseException as exc:  # noqa: BLE001 - reported to every rank in finalize
            self._error = exc

    def wait_staged(self) -> None:
        """Block until the shards are copied to host memory (not a collective). Call it
        before the parameters or optimizer state change (optimizer step, offload)."""
        self._staged.wait()

    @property
    def staged(self) -> bool:
        """Whether the host copy is done (the live tensors may change)."""
        return self._staged.is_set()

    @property
    def path(self) -> str:
        return self.plan.final

    def _drop_write_results(self) -> None:
        """Empty this rank's write-results queue when the save is abandoned (another rank's
        write failed), so that the next save does not read these results as its own."""
        args = self._request.async_fn_args if self._request is not None else ()
        results = args[2] if len(args) > 2 else None
        while results is not None and not results.empty():
            results.get_nowait()

    def finalize(self) -> str:
        """Collective: wait for this rank's writer, gather every rank's results (megatron's
        finalize writes the metadata), then publish. Raises :class:`CheckpointWriteError` on
        every rank when any rank's write failed (the previous checkpoint stays ``latest``)."""
        if self._thread is not None:
            self._thread.join()
        try:  # every rank's writer is done before megatron's collectives
            self.plan.fail(self._error)
        except CheckpointWriteError:
            self._drop_write_results()
            raise
        err = None
        try:
            for fn in self._request.finalize_fns:
                fn()
        except Exception as exc:  # noqa: BLE001 - megatron raises on every rank together
            err = exc
        if err is None and dist.get_rank() == 0:
            err = _verify_written(self.plan.tmp, dist.get_world_size())
        return _finish_save(self.plan, err)


def _verify_written(tmp: str, world_size: int) -> BaseException | None:
    """The error when ``tmp`` lacks a file of a complete checkpoint (DCP metadata, megatron's
    ``metadata.json``, ``trainer.pt``, every rank's RNG file), else None."""
    need = [".metadata", "metadata.json", "trainer.pt"] + [
        os.path.join("rng", f"rank_{r:05d}.pt") for r in range(world_size)]
    missing = [n for n in need if not os.path.isfile(os.path.join(tmp, n))]
    if missing:
        return CheckpointWriteError(f"{tmp} is incomplete after the write: missing {missing}")
    return None


def start_async_save(root: str, step: int, model, optimizer, scheduler,
                     trainer_state: dict[str, Any] | None = None,
                     host_pool: list[torch.Tensor] | None = None) -> PendingSave:
    """Begin a checkpoint save that completes in the background; collective.

    On this thread: megatron's save planning and snapshots of the RNG/trainer state. A writer
    thread then copies the model/optimizer shards to host memory and writes every file while
    the next steps run; call :meth:`PendingSave.wait_staged` before anything changes the
    parameters or the optimizer state (:class:`CheckpointSaver` users:
    :meth:`CheckpointSaver.wait_staged`, which the actor and critic call before each optimizer
    step and offload). Call :meth:`PendingSave.finalize` on every rank (before the next save, a
    resume, or exit) to wait for it and move ``latest``. Until then ``latest`` names the
    previous checkpoint, so a crash during the write leaves that one usable. ``host_pool``:
    host buffers reused by the next save (only once this one is finalized)."""
    from megatron.core import dist_checkpointing

    from megatron_rl.util.sync_save import use_in_process_results_queue

    plan = _begin_save(root, step)
    sharded, _ = _sharded_state(model, optimizer, is_loading=False, main_from=optimizer)
    use_in_process_results_queue()  # the writer thread runs in this process
    request, err, stage = None, None, None
    try:
        request = dist_checkpointing.save(sharded, plan.tmp, async_sharded_save=True)
        if request.preload_fn is not None:  # the writer thread copies instead
            ready = torch.cuda.Event() if torch.cuda.is_available() else None
            if ready is not None:
                ready.record()  # after this thread's last write to the parameters
            stage = functools.partial(_staged_request, ready=ready,
                                      pool=host_pool if host_pool is not None else [])
        request = request._replace(preload_fn=None)
    except Exception as exc:  # noqa: BLE001 - reported to every rank in finalize
        err = exc
    files = None
    if err is None:
        try:  # snapshots now; the writer thread writes them
            files = _common_files(step, model, scheduler, trainer_state)
        except Exception as exc:  # noqa: BLE001 - reported to every rank in finalize
            err = exc
    return PendingSave(plan, request, err, stage, files)


class CheckpointSaver:
    """Saves checkpoints synchronously or asynchronously (``trainer.async_save``), with at most
    one save in flight: a new save, :meth:`wait` and a resume first finish the pending one."""

    def __init__(self, async_save: bool = False) -> None:
        self.async_save = async_save
        self.pending: PendingSave | None = None
        self._host_pool: list[torch.Tensor] = []  # host copies of this rank's shards, reused

    def save(self, root: str, step: int, model, optimizer, scheduler,
             trainer_state: dict[str, Any] | None = None) -> str:
        """Collective. Returns the checkpoint's path (not yet ``latest`` when asynchronous)."""
        self.wait()
        if not self.async_save:
            return save_checkpoint(root, step, model, optimizer, scheduler, trainer_state)
        self.pending = start_async_save(root, step, model, optimizer, scheduler, trainer_state,
                                        self._host_pool)
        return self.pending.path

    def wait_staged(self) -> None:
        """Block until the pending save (if any) copied the shards to host memory; not a
        collective. Call before changing the parameters or optimizer state."""
        if self.pending is not None:
            self.pending.wait_staged()

    def wait(self) -> str | None:
        """Collective: finish the pending save (if any); its path, or None."""
        pending, self.pending = self.pending, None
        return pending.finalize() if pending is not None else None


def _kept_checkpoint(root: str) -> str | None:
    try:
        return latest_checkpoint(root)
    except (OSError, CheckpointError):
        return None


def _prepare_tmp(root: str, tmp: str) -> None:
    os.makedirs(root, exist_ok=True)
    for name in os.listdir(root):  # leftovers of a crashed save
        if name.endswith(".tmp"):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    os.makedirs(tmp)


def _durable_save(obj: Any, path: str) -> None:
    """``torch.save`` then fsync, so that a later rename publishes complete bytes."""
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _fsync_tree(path: str) -> None:
    """fsync every file under ``path`` and the directories themselves."""
    for dirpath, _, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(dirpath)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as exc:  # some file systems cannot fsync a directory
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def _publish(root: str, tmp: str, final: str, step: int) -> None:
    """Rank 0: make ``tmp`` durable, rename it to ``final``, then point ``latest`` at it."""
    _fsync_tree(tmp)
    if os.path.exists(final):
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(root)
    pointer = os.path.join(root, LATEST + ".tmp")
    try:
        with open(pointer, "w") as f:
            f.write(step_dir_name(step))
            f.flush()
            os.fsync(f.fileno())
        os.replace(pointer, os.path.join(root, LATEST))
    except OSError:
        _remove_quietly(pointer)
        raise
    _fsync_dir(root)


def _remove_quietly(path: str) -> None:
    try:
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        elif os.path.exists(path):
            os.remove(path)
    except OSError:
        pass


def _diagnose(root: str) -> str:
    """``" (the file system of ROOT is full / read-only)"`` when it is, else ``""``."""
    path = root
    while path and not os.path.exists(path):
        path = os.path.dirname(path)
    try:
        st = os.statvfs(path or ".")
    except OSError:
        return ""
    if st.f_flag & os.ST_RDONLY:
        return f" (the file system of {root} is read-only)"
    free = st.f_bavail * st.f_frsize
    if free < (1 << 20):
        return f" (the file system of {root} is full: {free} bytes free)"
    return ""


def _agree_or_raise(exc: BaseException | None, step: int, root: str, tmp: str, kept: str | None,
                    rank: int) -> None:
    """Collective: every rank learns whether any rank failed; then all raise together."""
    from megatron_rl.parallel.runtime import host_group

    flag = torch.tensor([0 if exc is None else 1], dtype=torch.int64)  # host int, gloo group
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=host_group())
    if not int(flag.item()):
        return
    if rank == 0:
        _remove_quietly(tmp)  # a partial write must not fill the disk or look like a checkpoint
    dist.barrier(group=host_group())  # every rank raises after the cleanup
    kept_msg = (f"the previous checkpoint {kept} is kept and loadable (`latest` still names it)"
                if kept else "no earlier checkpoint exists")
    why = (f"{type(exc).__name__}: {exc}" if exc is not None else "another rank's write failed"
           ) + _diagnose(root)
    raise CheckpointWriteError(f"checkpoint {step_dir_name(step)} was not written ({why}); "
                               f"{kept_msg}; free disk space or make the run directory "
                               "writable, then resume") from exc


def load_checkpoint(path: str, model, optimizer=None, scheduler=None,
                    restore_rng: bool = True) -> dict[str, Any]:
    """Load a checkpoint saved at any TP/PP/DP layout into this layout; collective.

    Returns ``{"step", "trainer", "rng_restored"}``. RNG states are restored only when the layout is
    unchanged (per-rank states do not map across layouts) and the device type is (a checkpoint
    saved on CPU resumed on GPU restores only the host RNGs).
    """
    from megatron.core import dist_checkpointing

    meta = read_meta(path)
    if os.path.exists(os.path.join(path, ".metadata")):
        check_pickle_globals(os.path.join(path, ".metadata"))  # before megatron unpickles it
    from megatron_rl.actor.precision import copy_main_to_model, precision_of, set_distopt_main

    saved_precision = meta.get("precision", "fp32")
    same_precision = saved_precision == precision_of(model)
    if optimizer is not None and not same_precision and dist.get_rank() == 0:
        print(f"[checkpoint] {path} was saved in {saved_precision}, this actor runs in "
              f"{precision_of(model)}: loading the fp32 weights; the optimizer moments restart",
              flush=True)
    load_opt = optimizer if same_precision else None
    # fp32 weights are read into the main params (mixed precision), then re-rounded.
    sd, mains = _sharded_state(model, load_opt, is_loading=True, main_from=optimizer)
    targets = {k: v.data for k, v in sd["model"].items()
               if isinstance(getattr(v, "data", None), torch.Tensor)}
    state = dist_checkpointing.load(sd, path)
    module = getattr(model, "module", model)
    _load_model_part(module, state["model"], path)
    with torch.no_grad():  # the main params themselves (no-op when loaded in place)
        for k, t in targets.items():
            if k in state["model"] and t is not state["model"][k] and t.dtype == torch.float32:
                t.copy_(state["model"][k])
    if load_opt is not None:
        load_opt.load_state_dict(state["optimizer"])
    copy_main_to_model(optimizer)
    set_distopt_main(optimizer, mains)  # distributed optimizer: this rank's main shards
    if scheduler is not None and meta["scheduler"] is not None:
        scheduler.load_state_dict(meta["scheduler"])
    rng_ok = False
    if restore_rng and tuple(meta["layout"]) == _layout_key():
        rng_path = os.path.join(path, "rng", f"rank_{dist.get_rank():05d}.pt")
        if os.path.exists(rng_path):
            rng_ok = _set_rng_state(safe_torch_load(rng_path))
    return {"step": meta["step"], "trainer": meta["trainer"], "rng_restored": rng_ok}


def _load_model_part(module, loaded: dict, path: str) -> None:
    """Copy the loaded model part into ``module``: every tensor (strict), or with LoRA the
    adapter tensors (an adapter-only checkpoint; the frozen base is loaded from its source)."""
    from megatron_rl.models import lora

    if not lora.adapters_of(module):
        module.load_state_dict(_strip_prefix(loaded, "model."), strict=True)
        return
    with torch.no_grad():
        for name, param, _ in lora.adapter_params(module):
            t = loaded.get("model." + name)
            if t is None:
                raise CheckpointError(f"{path} has no adapter tensor {name!r} (not a LoRA "
                                      "checkpoint of this actor.lora.targets)")
            if t is not param:
                param.copy_(t.to(param.dtype))


def _strip_prefix(sd: dict, prefix: str) -> dict:
    return {k[len(prefix):] if k.startswith(prefix) else k: v for k, v in sd.items()}
