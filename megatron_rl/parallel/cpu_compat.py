"""megatron-core on a CPU-only machine: the smallest set of patches that lets the real code run.

megatron-core assumes CUDA on a few paths we need (model construction, the pipeline schedules,
attention). Each :class:`Patch` below answers one such call, names the megatron-core file it
answers, and can be switched off; ``tests/test_cpu_compat.py`` switches each one off in turn and
shows the path it covers then fails, so no dead patch survives a megatron-core upgrade unnoticed.

The layer is enabled by :func:`megatron_rl.parallel.runtime.init_parallel` only when the backend is
gloo and CUDA is absent; :func:`enable` refuses to run when CUDA is available.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Callable

import torch

_UNDO: dict[str, Callable[[], None]] = {}


@dataclass(frozen=True)
class Patch:
    """One compatibility patch: what it answers and how to apply it (returns an undo)."""

    name: str
    answers: str
    apply: Callable[[], Callable[[], None]]


def _set_attr(obj: object, attr: str, value: object) -> Callable[[], None]:
    old = getattr(obj, attr)
    setattr(obj, attr, value)
    return lambda: setattr(obj, attr, old)


def _chain(*undos: Callable[[], None]) -> Callable[[], None]:
    def undo() -> None:
        for u in reversed(undos):
            u()
    return undo


# --- patch 1: RNG tracker on the CPU generator -------------------------------------------------
def _patch_rng_tracker() -> Callable[[], None]:
    from megatron.core.tensor_parallel import random as mrandom

    def get_state(*_args, **_kwargs) -> torch.Tensor:
        return torch.get_rng_state()

    def set_state(new_state: torch.Tensor, *_args, **_kwargs) -> None:
        torch.set_rng_state(new_state)

    def add(self, name: str, seed: int) -> None:
        self._is_initialized = True
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        self.seeds_.add(seed)
        if name in self.states_:
            raise Exception(f"rng state {name} already exists")
        orig = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(orig)

    return _chain(_set_attr(mrandom, "_get_cuda_rng_state", get_state),
                  _set_attr(mrandom, "_set_cuda_rng_state", set_state),
                  _set_attr(mrandom.CudaRNGStatesTracker, "add", add))


# --- patch 2: torch.cuda.current_device() -> CPU device ------------------------------------------
def _patch_current_device() -> Callable[[], None]:
    # Callers pass the result as ``device=``; "cpu" keeps those tensors on the host.
    return _set_attr(torch.cuda, "current_device", lambda: "cpu")


# --- patch 3: device="cuda" tensor factories -> CPU ---------------------------------------------
_FACTORIES = ("empty", "zeros", "ones", "full", "tensor", "arange", "randn", "rand", "empty_like",
              "zeros_like", "ones_like")


def _is_cuda_device(device: object) -> bool:
    if device is None:
        return False
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, int):
        return True  # an integer device index means a CUDA ordinal
    return isinstance(device, str) and device.startswith("cuda")


def _cpu_factory(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = "cpu"
        return fn(*args, **kwargs)
    wrapper.__megatron_rl_cpu__ = True
    return wrapper


def _patch_cuda_factories() -> Callable[[], None]:
    import importlib

    proxy = _TorchProxy()
    return _chain(*(_set_attr(importlib.import_module(f"megatron.core.{m}"), "torch", proxy)
                    for m in _FACTORY_MODULES))


# megatron-core modules whose ``torch.<factory>(..., device="cuda")`` calls we redirect.
_FACTORY_MODULES = ("transformer.utils", "pipeline_parallel.schedules", "optimizer.optimizer",
                    "optimizer.clip_grads", "utils", "optimizer.grad_scaler")


class _TorchProxy:
    """``torch`` as seen by one megatron module, with CUDA factory devices sent to the CPU."""

    def __getattr__(self, name: str):
        attr = getattr(torch, name)
        if name in _FACTORIES:
            return _cpu_factory(attr)
        return attr


# --- patch 4: Tensor.cuda() is the identity ---------------------------------------------------
def _patch_tensor_cuda() -> Callable[[], None]:
    # Without CUDA every ``.cuda()`` call fails, so mapping it to the identity can only turn a
    # certain failure into the CPU behaviour; it never changes a working path.
    return _set_attr(torch.Tensor, "cuda", lambda self, *a, **k: self)


# --- patch 5: the fp32 grad-clipping type check -----------------------------------------------
@contextlib.contextmanager
def _cuda_float_type_names():
    """While active, ``t.type()`` of a float32/bf16/fp16 CPU tensor reads
    ``torch.cuda.FloatTensor`` / ``BFloat16Tensor`` / ``HalfTensor``."""
    orig = torch.Tensor.type
    names = {torch.float32: "torch.cuda.FloatTensor", torch.bfloat16: "torch.cuda.BFloat16Tensor",
             torch.float16: "torch.cuda.HalfTensor"}

    def type_(self, *args, **kwargs):
        if not args and not kwargs and self.dtype in names and not self.is_cuda:
            return names[self.dtype]
        return orig(self, *args, **kwargs)

    torch.Tensor.type = type_
    try:
        yield
    finally:
        torch.Tensor.type = orig


def _patch_clip_type_check() -> Callable[[], None]:
    import megatron.core.optimizer.optimizer as mopt

    orig = mopt.clip_grad_by_total_norm_fp32

    @functools.wraps(orig)
    def clip(*args, **kwargs):
        with _cuda_float_type_names():  # scoped to this call only
            return orig(*args, **kwargs)

    return _set_attr(mopt, "clip_grad_by_total_norm_fp32", clip)


def _type_names_in_init(cls: type) -> Callable[[], None]:
    """``cls.__init__`` runs with CUDA tensor type names (its parameter type check)."""
    orig = cls.__init__

    @functools.wraps(orig)
    def init(self, *args, **kwargs):
        with _cuda_float_type_names():  # scoped to the constructor only
            orig(self, *args, **kwargs)

    return _set_attr(cls, "__init__", init)


# --- patch 7: the mixed-precision optimizer's parameter type check ----------------------------
def _patch_half_optimizer_type_check() -> Callable[[], None]:
    import megatron.core.optimizer.optimizer as mopt

    return _type_names_in_init(mopt.Float16OptimizerWithFloat16Params)


# --- patch 8: the distributed optimizer's parameter type check -------------------------------
def _patch_distrib_optimizer_type_check() -> Callable[[], None]:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return _type_names_in_init(DistributedOptimizer)


# --- patch 6: torch.cuda.synchronize() is a no-op ----------------------------------------------
def _patch_synchronize() -> Callable[[], None]:
    # There is no device queue to wait for on a CPU-only machine.
    return _set_attr(torch.cuda, "synchronize", lambda *a, **k: None)


# --- patch 7: the MoE all-to-all dispatcher's device-to-host copy stream -----------------------
def _patch_moe_dtoh_stream() -> Callable[[], None]:
    # The alltoall dispatcher makes a CUDA side stream when built and, at its "dtoh point",
    # copies its split sizes to the host on it as numpy arrays (what all_to_all_single takes).
    # On a CPU-only machine they already are host tensors: the replacement only converts them to
    # numpy at the same point, with no stream to wait for.
    from megatron.core.transformer.moe import token_dispatcher as td

    cls = td.MoEAlltoAllTokenDispatcher

    def as_numpy(x):
        return x.numpy() if torch.is_tensor(x) else x

    def dtoh_on_cpu(self, point: str, tokens_per_expert=None):
        if not self.drop_and_pad and point == self.cuda_dtoh_point:
            self.input_splits = as_numpy(self.input_splits)
            self.output_splits = as_numpy(self.output_splits)
            self.output_splits_tp = as_numpy(self.output_splits_tp)
        return tokens_per_expert

    return _chain(_set_attr(cls, "cuda_dtoh_stream", object()),
                  _set_attr(cls, "_maybe_dtoh_and_synchronize", dtoh_on_cpu))


# --- patch 10: the CP split of the rotary table without pinned memory ------------------------
def _patch_cp_pos_emb() -> Callable[[], None]:
    # get_pos_emb_on_this_cp_rank builds its two chunk indices in pinned host memory and copies
    # them to the GPU; without CUDA there is no pinned allocator. Same split, on the table's
    # device. rotary_pos_embedding.py imported the name, so both modules are patched.
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.models.common.embeddings import rotary_pos_embedding as rpe

    def on_this_cp_rank(pos_emb: torch.Tensor, seq_dim: int, cp_group) -> torch.Tensor:
        if cp_group is None:
            raise ValueError("cp_group must be provided to get positional embedding per CP rank")
        size, rank = cp_group.size(), cp_group.rank()
        idx = torch.tensor([rank, 2 * size - rank - 1], device=pos_emb.device)
        shape = pos_emb.shape
        pos_emb = pos_emb.view(*shape[:seq_dim], 2 * size, -1, *shape[seq_dim + 1:])
        pos_emb = pos_emb.index_select(seq_dim, idx)
        return pos_emb.view(*pos_emb.shape[:seq_dim], -1, *pos_emb.shape[seq_dim + 2:])

    return _chain(_set_attr(rope_utils, "get_pos_emb_on_this_cp_rank", on_this_cp_rank),
                  _set_attr(rpe, "get_pos_emb_on_this_cp_rank", on_this_cp_rank))


PATCHES: tuple[Patch, ...] = (
    Patch("rng_tracker", "tensor_parallel/random.py: CudaRNGStatesTracker.add/fork and "
          "model_parallel_cuda_manual_seed read and set torch.cuda RNG states", _patch_rng_tracker),
    Patch("current_device", "models/common/embeddings/rotary_pos_embedding.py and "
          "pipeline_parallel/p2p_communication.py build tensors on torch.cuda.current_device()",
          _patch_current_device),
    Patch("cuda_factories", "transformer/utils.py (default causal attention mask), "
          "pipeline_parallel/schedules.py (token counters) and optimizer/optimizer.py "
          "(FP32Optimizer loss scale), optimizer/clip_grads.py and utils.py (grad-norm buffers "
          "of the local multi-tensor fallbacks) create tensors with device='cuda'",
          _patch_cuda_factories),
    Patch("tensor_cuda", "models/common/language_module/language_module.py: "
          "setup_embeddings_and_output_layer moves the tied embedding copy with .cuda() before "
          "all-reducing it (tied embeddings, PP > 1)", _patch_tensor_cuda),
    Patch("clip_type_check", "optimizer/clip_grads.py: clip_grad_by_total_norm_fp32 asserts "
          "grad.type() == 'torch.cuda.FloatTensor' (gradient clipping, clip_grad > 0)",
          _patch_clip_type_check),
    Patch("synchronize", "dist_checkpointing/strategies/filesystem_async.py: preload_tensors "
          "calls torch.cuda.synchronize() before writing a checkpoint", _patch_synchronize),
    Patch("half_optimizer_type_check", "optimizer/optimizer.py: Float16OptimizerWithFloat16Params "
          "(bf16/fp16 actor) only accepts params whose .type() is torch.cuda.{Half,BFloat16,"
          "Float}Tensor", _patch_half_optimizer_type_check),
    Patch("distrib_optimizer_type_check", "optimizer/distrib_optimizer.py: DistributedOptimizer "
          "(optim.use_distributed_optimizer) only accepts params whose .type() is "
          "torch.cuda.{Half,BFloat16,Float}Tensor", _patch_distrib_optimizer_type_check),
    Patch("moe_dtoh_stream", "transformer/moe/token_dispatcher.py: MoEAlltoAllTokenDispatcher "
          "makes a torch.cuda.Stream when built and copies split sizes to the host on it "
          "(mixture-of-experts models)", _patch_moe_dtoh_stream),
    Patch("cp_pos_emb", "models/common/embeddings/rope_utils.py: get_pos_emb_on_this_cp_rank "
          "(context parallelism) puts the rotary table's chunk indices in pinned memory",
          _patch_cp_pos_emb),
)
PATCH_NAMES = tuple(p.name for p in PATCHES)


def enable(exclude: tuple[str, ...] = ()) -> None:
    """Apply every patch except those named in ``exclude`` (idempotent). CPU only."""
    if torch.cuda.is_available():
        raise RuntimeError("megatron_rl.parallel.cpu_compat must never be enabled when CUDA is "
                           "available")
    unknown = set(exclude) - set(PATCH_NAMES)
    if unknown:
        raise ValueError(f"unknown cpu_compat patch(es) {sorted(unknown)}; known: {PATCH_NAMES}")
    for patch in PATCHES:
        if patch.name not in exclude and patch.name not in _UNDO:
            _UNDO[patch.name] = patch.apply()


def disable(names: tuple[str, ...] | None = None) -> None:
    """Undo the named patches (all when ``names`` is None)."""
    for name in list(names if names is not None else _UNDO):
        undo = _UNDO.pop(name, None)
        if undo is not None:
            undo()


def active() -> tuple[str, ...]:
    """Names of the patches applied right now."""
    return tuple(n for n in PATCH_NAMES if n in _UNDO)


@contextlib.contextmanager
def without(name: str):
    """Temporarily undo one patch (used by the tests that prove each patch is needed)."""
    was_active = name in _UNDO
    disable((name,))
    try:
        yield
    finally:
        if was_active:
            enable(exclude=tuple(n for n in PATCH_NAMES if n != name))
