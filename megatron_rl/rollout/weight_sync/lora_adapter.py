"""Adapter-only weight sync to SGLang servers started with LoRA (``actor.lora.sync: adapter``).

The servers keep the frozen base weights and run every rollout request with the policy's LoRA
adapter (SGLang's ``lora_path``). A sync:

1. the first sync to a server (and to a restarted one) sends the base weights with the run's
   strategy (``rollout.sglang.weight_sync``), adapters off: the servers may have started from
   ``model.hf_path``, random weights or the SFT warm start's predecessor;
2. every sync: the coordinator writes the adapters as a PEFT directory
   (``SYNC_DIR/lora/v{version}``: ``adapter_config.json`` + ``adapter_model.safetensors``, what
   :mod:`megatron_rl.convert.lora_export` exports) and, while generation is paused (mode
   ``abort``), posts ``/unload_lora_adapter {"lora_name"}`` (when loaded) and
   ``/load_lora_adapter {"lora_name", "lora_path"}`` to every server. The name stays
   :data:`ADAPTER_NAME`: requests that wait for ``/continue_generation`` resolve it to the new
   adapter, as they would see new merged weights.

The bytes of a sync are the adapter file's tensors (plus the base weights on a first sync).
"""

from __future__ import annotations

import os
import shutil
from typing import Mapping

import torch

from megatron_rl.rollout.fleet import ServerError, http_json
from megatron_rl.rollout.weight_sync.common import WeightSyncError, post_each

ADAPTER_NAME = "megatron_rl_policy"  # the adapter's name on every server (generate's lora_path)


def adapter_dir(sync_dir: str, version: int) -> str:
    """Where the adapter of ``version`` is written (shared storage the servers read)."""
    return os.path.join(sync_dir, "lora", f"v{version}")


def write_adapter(full: Mapping[str, torch.Tensor], lora, model_cfg, out_dir: str) -> int:
    """Write canonical full adapter tensors (:func:`megatron_rl.models.lora.gather_full_adapters`)
    as a PEFT LoRA directory; returns the bytes of its tensors."""
    import json

    from safetensors.torch import save_file

    from megatron_rl.convert.lora_export import (
        ADAPTER_CONFIG,
        ADAPTER_WEIGHTS,
        peft_config,
        peft_tensors,
    )

    tensors = {n: t.detach().cpu().contiguous() for n, t in
               peft_tensors(full, model_cfg).items()}
    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, ADAPTER_WEIGHTS), metadata={"format": "pt"})
    with open(os.path.join(out_dir, ADAPTER_CONFIG), "w") as f:
        json.dump(peft_config(lora, model_cfg), f, indent=2)
    return sum(t.numel() * t.element_size() for t in tensors.values())


def server_args_for(lora, model_cfg) -> list[str]:
    """SGLang server arguments that enable LoRA for the run's adapters: ``--enable-lora
    --max-lora-rank R --lora-target-modules <HF modules>`` (our ``serve`` takes the same)."""
    from megatron_rl.convert.lora_export import peft_config

    return ["--enable-lora", "--max-lora-rank", str(lora.rank), "--lora-target-modules",
            *peft_config(lora, model_cfg)["target_modules"]]


def check_lora_enabled(url: str) -> None:
    """Raise :class:`WeightSyncError` when the server at ``url`` was not started with LoRA
    (``/server_info``'s ``enable_lora``)."""
    try:
        info = http_json("GET", url + "/server_info", timeout=30.0)
    except ServerError as exc:
        raise WeightSyncError(f"cannot read {url}/server_info: {exc}") from None
    if not (isinstance(info, dict) and info.get("enable_lora")):
        raise WeightSyncError(
            f"{url} was not started with LoRA enabled: actor.lora.sync=adapter loads the "
            "adapters with SGLang's /load_lora_adapter, which needs --enable-lora "
            "--max-lora-rank R --lora-target-modules ... (servers the fleet starts get them; "
            "start attached servers with them, or set actor.lora.sync=merged)")


def _post(url: str, path: str, body: dict) -> dict:
    """POST a LoRA request; SGLang answers 400 with ``error_message`` when it refuses."""
    try:
        return http_json("POST", url + path, body, timeout=600.0)
    except ServerError as exc:
        raise WeightSyncError(f"{url}{path}: {exc}") from None


def load_adapter(urls: list[str], path: str, checked: set[str], name: str = ADAPTER_NAME
                 ) -> None:
    """On every server: check LoRA is enabled (once per server, ``checked``), unload the adapter
    ``name`` where loaded, load ``path`` under ``name``."""
    def one(url: str) -> None:
        if url not in checked:
            check_lora_enabled(url)
            checked.add(url)
        try:
            http_json("POST", url + "/unload_lora_adapter", {"lora_name": name}, timeout=600.0)
        except ServerError as exc:
            if "does not exist" not in str(exc):  # not loaded yet: nothing to unload
                raise WeightSyncError(f"{url}/unload_lora_adapter: {exc}") from None
        _post(url, "/load_lora_adapter", {"lora_name": name, "lora_path": path})

    post_each(urls, one)


def prune_adapters(sync_dir: str, version: int) -> None:
    """Remove the adapter directories of versions other than ``version``."""
    root = os.path.join(sync_dir, "lora")
    if not os.path.isdir(root):
        return
    for name in os.listdir(root):
        if name != f"v{version}":
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
