"""SGLang's dynamic LoRA adapters on our ``serve`` (``--enable-lora``): ``/load_lora_adapter``,
``/unload_lora_adapter`` and ``/generate``'s ``lora_path``, with SGLang 0.5.21's fields, rules and
messages (``srt/managers/tokenizer_control_mixin.py``, ``srt/lora/lora_manager.py``,
``srt/lora/lora_registry.py``, ``srt/managers/tokenizer_manager.py``):

- every LoRA request on a server started without ``--enable-lora`` is refused (HTTP 400,
  ``"LoRA is not enabled. Please set `--enable-lora` to enable LoRA."``; a generate request that
  names an adapter: SGLang's own message);
- ``--enable-lora`` needs ``--max-lora-rank`` and ``--lora-target-modules`` (no ``--lora-paths``
  here), as SGLang asserts at start;
- a load names a PEFT adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``);
  a name already loaded, a rank over ``--max-lora-rank`` or a target outside
  ``--lora-target-modules`` is refused with SGLang's message; the reply is
  ``{"success", "error_message", "loaded_adapters": {name: path}}``;
- an unload of a name that is not loaded is refused; an unload waits until the requests that use
  the adapter have finished (SGLang's ``wait_for_unload``);
- a generate request names its adapter in ``lora_path`` (a loaded name); a name that was loaded
  once and unloaded is loaded again from its path (SGLang's ``lora_ref_cache``); a name never
  loaded is refused (HTTP 400, ``{"error": {"message"}}``).

The adapter is applied as PEFT computes it: each target ``nn.Linear`` of the HF model adds
``(lora_alpha / r) · x Aᵀ Bᵀ`` (``use_rslora``: ``lora_alpha / sqrt(r)``) to its output while a
request that names the adapter runs its forward (a thread-local: each request runs in its own
handler thread and every forward holds the server's model lock). The base weights never change.
"""

from __future__ import annotations

import json
import math
import os
import threading
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch

# SGLang's get_normalized_target_modules (srt/lora/utils.py): fused q/k/v and gate/up
_FUSED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
          "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}
NOT_ENABLED = "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."
PEFT_PREFIX = "base_model.model."


def normalized(modules) -> set[str]:
    """Target module names as SGLang compares them (q/k/v -> ``qkv_proj``, gate/up ->
    ``gate_up_proj``; ``"all"`` kept)."""
    if isinstance(modules, str):
        return {"all"}
    return {_FUSED.get(m.rsplit(".", 1)[-1], m.rsplit(".", 1)[-1]) for m in modules}


class LoraRefused(ValueError):
    """A LoRA load/unload SGLang answers with ``success: false`` (HTTP 400)."""


class GenerateRefused(ValueError):
    """A generate request SGLang refuses with HTTP 400 ``{"error": {"message"}}``."""


@dataclass
class Adapter:
    """One loaded adapter: ``weights[module path] = (A [r, in], B [out, r])`` of the HF model."""

    name: str
    path: str
    lora_id: str
    scaling: float
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]
    users: int = 0  # requests using it (SGLang's registry counter)


def read_peft_dir(path: str, dtype: torch.dtype) -> tuple[dict, dict[str, tuple[torch.Tensor,
                                                                                  torch.Tensor]]]:
    """``(adapter_config.json, {HF module path: (A, B)})`` of a PEFT LoRA directory (CPU tensors
    in ``dtype``)."""
    from safetensors.torch import load_file

    if not os.path.isdir(path):
        raise LoraRefused(f"LoRA adapter path {path!r} is not a directory")
    with open(os.path.join(path, "adapter_config.json")) as f:
        conf = json.load(f)
    tensors = load_file(os.path.join(path, "adapter_model.safetensors"))
    mods: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in tensors.items():
        for part in ("lora_A", "lora_B"):
            tail = f".{part}.weight"
            if name.endswith(tail):
                mod = name[: -len(tail)]
                mod = mod[len(PEFT_PREFIX):] if mod.startswith(PEFT_PREFIX) else mod
                mods.setdefault(mod, {})[part] = t.to(dtype)
    weights = {m: (ab["lora_A"], ab["lora_B"]) for m, ab in mods.items()
               if "lora_A" in ab and "lora_B" in ab}
    return conf, weights


class ServedLora:
    """The LoRA state of one server: registry (name -> :class:`Adapter`), the paths of every name
    ever loaded, and forward hooks on the target linears."""

    def __init__(self, model: torch.nn.Module, enabled: bool = False,
                 max_rank: int | None = None, target_modules: list[str] | None = None) -> None:
        self.model, self.enabled = model, enabled
        self.max_rank = max_rank
        self.targets = set(target_modules or [])
        if enabled and not (max_rank and self.targets):
            raise ValueError("When no initial --lora-paths is provided, you need to specify both "
                             "--max-lora-rank and --lora-target-modules for LoRA initialization.")
        self.registry: dict[str, Adapter] = {}
        self.cache: dict[str, str] = {}  # every name ever loaded -> its path (implicit reload)
        self.cond = threading.Condition()
        self.local = threading.local()  # .adapter: the adapter of this thread's request
        self.dtype = next(model.parameters()).dtype
        if enabled:
            self._hook_targets()

    # ---- forward ----------------------------------------------------------------------------
    def _hook_targets(self) -> None:
        """A forward hook on every ``nn.Linear`` named like a target module."""
        for name, mod in self.model.named_modules():
            if isinstance(mod, torch.nn.Linear) and (
                    normalized([name]) <= normalized(self.targets) or "all" in self.targets):
                mod.register_forward_hook(self._hook(name))

    def _hook(self, name: str):
        def hook(_mod, args, out):
            ad = getattr(self.local, "adapter", None)
            if ad is None or name not in ad.weights:
                return out
            a, b = ad.weights[name]
            x = args[0]
            return out + torch.matmul(torch.matmul(x, a.to(x.device).t()),
                                      b.to(x.device).t()) * ad.scaling
        return hook

    @contextmanager
    def using(self, lora_path: str | None) -> Iterator[None]:
        """Run this thread's request with adapter ``lora_path`` (None: the base model): resolve
        the name (SGLang's rules), count the request as a user of the adapter until it ends."""
        if not lora_path:
            yield
            return
        ad = self.acquire(lora_path)
        self.local.adapter = ad
        try:
            yield
        finally:
            self.local.adapter = None
            with self.cond:
                ad.users -= 1
                self.cond.notify_all()

    def acquire(self, name: str) -> Adapter:
        """The loaded adapter ``name`` with one more user; a name unloaded earlier is loaded again
        from its path; refused (``GenerateRefused``) without ``--enable-lora`` or for a name never
        loaded."""
        if not self.enabled:
            raise GenerateRefused(
                f"LoRA adapter '{name}' was requested, but LoRA is not enabled. Please launch "
                "the server with --enable-lora flag and preload adapters using --lora-paths or "
                "/load_lora_adapter endpoint.")
        with self.cond:
            if name not in self.registry:
                if name not in self.cache:
                    raise GenerateRefused(f"Got LoRA adapter that has never been loaded: {name}\n"
                                          f"All loaded adapters: {self.cache.keys()}.")
                try:
                    self._load_locked(name, self.cache[name])
                except LoraRefused as exc:
                    raise GenerateRefused(f"Failed to implicitly load LoRA adapter {name}: "
                                          f"{exc}") from None
            ad = self.registry[name]
            ad.users += 1
            return ad

    # ---- load / unload ----------------------------------------------------------------------
    def result(self, success: bool, error: str = "") -> dict:
        """SGLang's ``LoRAUpdateOutput`` body."""
        return {"success": success, "error_message": error,
                "loaded_adapters": {a.name: a.path for a in self.registry.values()}}

    def load(self, req: dict) -> dict:
        """``/load_lora_adapter {"lora_name", "lora_path", "pinned"}``."""
        if not self.enabled:
            raise LoraRefused(NOT_ENABLED)
        name, path = req["lora_name"], req["lora_path"]
        with self.cond:
            self._load_locked(name, path)
            return self.result(True)

    def _load_locked(self, name: str, path: str) -> None:
        for ad in self.registry.values():
            if ad.name == name:
                raise LoraRefused(f"Failed to load LoRA adapter {name} because it is already "
                                  "loaded")
        try:
            conf, weights = read_peft_dir(path, self.dtype)
        except (OSError, KeyError, json.JSONDecodeError) as exc:
            raise LoraRefused(str(exc)) from None
        if conf.get("use_dora"):
            raise LoraRefused(f"Failed to load {name} because LoRA serving currently doesn't "
                              "support DoRA adapters")
        rank = int(conf["r"])
        mods = normalized(conf.get("target_modules") or [])
        fits = "all" in mods or "all" in self.targets or mods <= normalized(self.targets)
        if rank > int(self.max_rank) or not fits:
            raise LoraRefused(
                f"LoRA adapter {name} with rank {rank} is incompatible with the current LoRA "
                "memory pool configuration. Please ensure that the LoRA adapter's rank is within "
                "the configured `--max-lora-rank` and that the target modules are included in "
                "`--lora-target-modules`.")
        alpha = float(conf["lora_alpha"])
        scaling = alpha / math.sqrt(rank) if conf.get("use_rslora") else alpha / rank
        known = dict(self.model.named_modules())
        missing = [m for m in weights if m not in known]
        if missing:
            raise LoraRefused(f"LoRA adapter {name}: modules {missing[:3]} are not in the model")
        self.registry[name] = Adapter(name, path, uuid.uuid4().hex, scaling, weights)
        self.cache[name] = path

    def unload(self, req: dict) -> dict:
        """``/unload_lora_adapter {"lora_name"}``: waits for the adapter's running requests."""
        if not self.enabled:
            raise LoraRefused(NOT_ENABLED)
        name = req["lora_name"]
        with self.cond:
            if name not in self.registry:
                raise LoraRefused(f"LoRA with name {name} does not exist. Loaded LoRAs: "
                                  f"odict_keys({list(self.registry)})")
            ad = self.registry.pop(name)
            self.cond.wait_for(lambda: ad.users == 0)
            return self.result(True)

    def server_info(self) -> dict:
        """SGLang's LoRA server arguments as ``/server_info`` reports them."""
        return {"enable_lora": self.enabled, "max_lora_rank": self.max_rank,
                "lora_target_modules": sorted(self.targets) if self.enabled else None,
                "lora_paths": [] if self.enabled else None, "max_loras_per_batch": 8}
