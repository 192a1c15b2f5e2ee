"""megatron-core's distributed optimizer on torch's Adam (no NVIDIA apex, no Transformer Engine).

Without apex/TE, ``megatron/core/optimizer/distrib_optimizer.py`` (0.16.1) falls back to
``torch.optim.Adam``/``AdamW`` (``HAVE_APEX_OR_TE = False``). Training is right, but its
checkpoint code for that fallback keeps one global Adam ``step`` in the param groups and breaks in
three places, which :func:`install` answers (and nothing else):

1. ``DistributedOptimizer.state_dict`` asserts that the inner optimizer's per-parameter states hold
   exactly one ``step`` value. A fresh optimizer (before its first step) has no state, so the
   ``sharded_state_dict(is_loading=True)`` that prepares a load fails. Patch: a fresh optimizer's
   step is 0 (:func:`_state_dict`).
2. ``DistributedOptimizer.load_state_dict`` puts ONE shared ``step`` tensor into every
   parameter's state; torch's Adam increments ``state["step"]`` in place once per parameter, so
   after a resume every step adds the number of parameters and the bias correction is silently
   wrong. Patch: each parameter gets its own copy (:func:`_load_state_dict`), as megatron's
   standard optimizer does (``_restore_common_per_param_step`` deep-copies).
3. ``DistributedOptimizer._set_main_param_and_optimizer_states`` (called by every
   ``load_parameter_state_from_*``) copies each key of the parameter's optimizer state from the
   loaded tensors, but the loaded tensors never hold ``step`` (it is restored from the param
   groups), so torch Adam's ``step`` key raises ``KeyError: 'step'``. Patch: keep the state's own
   (already restored) step (:func:`_set_states`).

With apex or Transformer Engine the fused Adam keeps ``step`` in the param groups and megatron's
own code is right: :func:`install` does nothing. The checkpoint format itself is chosen by the
caller (:data:`SHARDING_TYPE`, see :mod:`megatron_rl.actor.checkpoint`).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch

# megatron's default ``fully_sharded_model_space`` fails at save ("flattened_range is not
# supported") and ``dp_reshardable`` cannot change TP/PP; ``fully_reshardable`` stores canonical
# param-shaped tensors, loadable at any TP/PP/DP layout.
SHARDING_TYPE = "fully_reshardable"

_UNDO: dict[str, Callable[[], None]] = {}
_INSTALLED: list[bool] = []  # non-empty once install() ran


def needed() -> bool:
    """True when megatron's distributed optimizer runs on torch's Adam (no apex / TE)."""
    from megatron.core.optimizer import distrib_optimizer

    return not distrib_optimizer.HAVE_APEX_OR_TE


def _first_param(optimizer: torch.optim.Optimizer) -> torch.Tensor | None:
    return next((p for g in optimizer.param_groups for p in g["params"]), None)


def _state_dict(orig: Callable[[Any], dict]) -> Callable[[Any], dict]:
    """``state_dict`` that reads step 0 from a fresh optimizer instead of asserting."""

    @functools.wraps(orig)
    def state_dict(self) -> dict:
        inner = self.optimizer
        param = _first_param(inner)
        if len(inner.state) > 0 or param is None:
            return orig(self)
        inner.state[param] = {"step": torch.tensor(0.0)}  # read by orig, removed right after
        try:
            return orig(self)
        finally:
            inner.state.pop(param, None)

    return state_dict


def unshare_steps(optimizer: torch.optim.Optimizer) -> None:
    """Give every parameter state of ``optimizer`` its own ``step`` tensor (in place)."""
    for state in optimizer.state.values():
        if isinstance(state.get("step"), torch.Tensor):
            state["step"] = state["step"].clone()


def _load_state_dict(orig: Callable[[Any, dict], None]) -> Callable[[Any, dict], None]:
    """``load_state_dict`` after which no two parameters share a ``step`` tensor."""

    @functools.wraps(orig)
    def load_state_dict(self, state_dict: dict) -> None:
        orig(self, state_dict)
        unshare_steps(self.optimizer)

    return load_state_dict


def _set_states(orig: Callable[..., None]) -> Callable[..., None]:
    """``_set_main_param_and_optimizer_states`` that keeps a torch-Adam state's own ``step``."""

    @functools.wraps(orig)
    def set_states(self, model_param: torch.nn.Parameter, tensors: dict) -> None:
        if "step" not in tensors:
            group_index, group_order = self.model_param_group_index_map[model_param]
            main = self.optimizer.param_groups[group_index]["params"][group_order]
            step = self.optimizer.state.get(main, {}).get("step")
            if step is not None:
                tensors = {**tensors, "step": step}  # copied onto itself
        orig(self, model_param, tensors)

    return set_states


# name -> (DistributedOptimizer method, wrapper); the numbers refer to the module docstring.
PATCHES: dict[str, tuple[str, Callable]] = {
    "fresh_state_dict": ("state_dict", _state_dict),  # 1
    "per_param_step": ("load_state_dict", _load_state_dict),  # 2
    "keep_step_on_load": ("_set_main_param_and_optimizer_states", _set_states),  # 3
}


def install(exclude: tuple[str, ...] = ()) -> bool:
    """Patch ``DistributedOptimizer`` when it runs on torch's Adam. Idempotent: once installed,
    later calls change nothing until :func:`uninstall` (``exclude`` leaves named patches out, for
    the test that shows each is needed). Returns whether any patch is active."""
    unknown = set(exclude) - set(PATCHES)
    if unknown:
        raise ValueError(f"unknown distopt_compat patch(es) {sorted(unknown)}; known: "
                         f"{tuple(PATCHES)}")
    if not needed():
        return False
    if _INSTALLED:
        return bool(_UNDO)
    _INSTALLED.append(True)
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for name, (method, wrap) in PATCHES.items():
        if name not in exclude and name not in _UNDO:
            orig = getattr(DistributedOptimizer, method)
            setattr(DistributedOptimizer, method, wrap(orig))
            _UNDO[name] = functools.partial(setattr, DistributedOptimizer, method, orig)
    return bool(_UNDO)


def uninstall() -> None:
    """Undo :func:`install`."""
    for name in list(_UNDO):
        _UNDO.pop(name)()
    _INSTALLED.clear()


def active() -> tuple[str, ...]:
    """Names of the patches applied right now."""
    return tuple(n for n in PATCHES if n in _UNDO)
