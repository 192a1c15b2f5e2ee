"""Policy losses by config name. Each entry is a pure ``(LossInputs, LossConfig) -> TokenLoss``."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable


class UnknownLossError(KeyError, ValueError):
    """``policy_loss`` names no registered loss; the message lists the valid names."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


@dataclass(frozen=True)
class PolicyLossSpec:
    """A registered loss. ``token_level``: composes with the ERC gate. ``forced_agg``: the
    aggregation the algorithm defines (overrides ``loss_agg_mode``). ``needs``: extra inputs."""

    name: str
    impl: Callable | str  # the function, or "module:function" (in megatron_rl.loss) imported on use
    section: str
    token_level: bool = True
    forced_agg: str | None = None
    needs: tuple[str, ...] = ()

    @property
    def fn(self) -> Callable:
        """The loss function (imported on first use: reading the registry, as config validation
        does, imports no torch)."""
        if callable(self.impl):
            return self.impl
        module, attr = self.impl.split(":")
        return getattr(importlib.import_module(f"megatron_rl.loss.{module}"), attr)


_REGISTRY: dict[str, PolicyLossSpec] = {}


def register_policy_loss(spec: PolicyLossSpec) -> PolicyLossSpec:
    """Add a loss under ``spec.name`` (refuses duplicates)."""
    if spec.name in _REGISTRY:
        raise ValueError(f"policy loss {spec.name!r} is already registered")
    _REGISTRY[spec.name] = spec
    return spec


def policy_loss_names() -> list[str]:
    return sorted(_REGISTRY)


def get_policy_loss(name: str) -> PolicyLossSpec:
    """The spec registered as ``name``; :class:`UnknownLossError` lists the valid names."""
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise UnknownLossError(f"policy_loss={name!r} is not a registered loss; valid names: "
                               f"{policy_loss_names()}") from None


for _spec in (
    PolicyLossSpec("ppo", "ppo:ppo_token_loss", "§1"),
    PolicyLossSpec("dapo", "ppo:ppo_token_loss", "§2.1 (= ppo; set clip_ratio_high=0.28)"),
    PolicyLossSpec("gspo", "gspo:gspo_token_loss", "§5", token_level=False,
                   forced_agg="seq-mean-token-mean"),
    PolicyLossSpec("gspo_token", "gspo:gspo_token_level_loss", "§5",
                   forced_agg="seq-mean-token-mean"),
    PolicyLossSpec("cispo", "cispo:cispo_token_loss", "§6"),
    PolicyLossSpec("gppo", "gppo:gppo_token_loss", "§7"),
    PolicyLossSpec("aspo", "aspo:aspo_token_loss", "§8", needs=("entropy",)),
    PolicyLossSpec("clip_cov", "cov:clip_cov_token_loss", "§4", needs=("cov_selected",)),
    PolicyLossSpec("kl_cov", "cov:kl_cov_token_loss", "§4", needs=("cov_selected",)),
    PolicyLossSpec("dcpo", "ppo:dcpo_token_loss", "§10.2"),
    PolicyLossSpec("gmpo", "gmpo:gmpo_token_loss", "GMPO (docs/losses-2025.md)",
                   token_level=False),
    PolicyLossSpec("sapo", "sapo:sapo_token_loss", "SAPO (docs/losses-2025.md)"),
    PolicyLossSpec("dppo_tv", "dppo:dppo_tv_token_loss", "DPPO Binary-TV (docs/losses-2025.md)"),
    PolicyLossSpec("dppo_kl", "dppo:dppo_kl_token_loss", "DPPO Binary-KL (docs/losses-2025.md)"),
    PolicyLossSpec("bapo", "bapo:bapo_token_loss", "BAPO (docs/losses-2025.md)",
                   needs=("bapo_bounds",)),
    PolicyLossSpec("nll", "nll:nll_token_loss", "supervised warm start (not in ALGORITHMS.md)"),
):
    register_policy_loss(_spec)
