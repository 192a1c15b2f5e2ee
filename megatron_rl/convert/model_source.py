"""Where a run's model comes from: a preset (random tiny demos), a Hugging Face directory
(``model.hf_path``: config.json + safetensors) or a converted megatron checkpoint
(``model.megatron_ckpt``: the output of ``convert hf-to-megatron``, any TP/PP).

Exactly one of the three decides the architecture (:func:`model_config`). The weights of the two
checkpoint sources are loaded by every rank into its own TP x PP stage only:

* :class:`HFShardSource` reads, for each parameter of the rank's stage, exactly the rows/columns of
  the HF tensors that make its TP shard (``safe_open(...).get_slice``, one file opened per read), so
  no rank ever holds the full model; ``bytes_read`` counts what was materialised.
* :class:`MegatronCkptSource` loads with megatron ``dist_checkpointing`` (reshards on load; each
  rank reads the chunks overlapping its own shard).

Both are passed where canonical full state dicts go (``Actor(full_state=...)``): anything with a
``load_into(model)`` method is a weight source.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from megatron_rl.models.config import ModelConfig

if TYPE_CHECKING:  # config loading imports this module and stays torch-free
    import torch

DEFAULT_PRESET = "tiny"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class ModelSourceError(ValueError):
    """The model section names no usable model; the message names the field."""


def source_kind(model_section) -> str:
    """``"preset"``, ``"hf"`` or ``"megatron"``; raises unless at most one source is set."""
    set_ = [n for n in ("preset", "hf_path", "megatron_ckpt") if getattr(model_section, n)]
    if len(set_) > 1:
        raise ModelSourceError(
            f"model: exactly one of model.preset, model.hf_path, model.megatron_ckpt decides the "
            f"architecture, got {', '.join(set_)} (set the others to null, e.g. model.preset=null)")
    if model_section.hf_path:
        return "hf"
    if model_section.megatron_ckpt:
        return "megatron"
    return "preset"


def model_config(model_section) -> ModelConfig:
    """The architecture: the preset, the HF ``config.json``, or the converted checkpoint's sidecar.

    Raises :class:`ModelSourceError` naming the field for a missing directory or an unsupported
    architecture (the message lists the supported ones)."""
    return _with_moe_options(_architecture(model_section), model_section)


def _with_moe_options(cfg: ModelConfig, model_section) -> ModelConfig:
    """Apply the run's MoE options (``model.moe_aux_loss_coeff``/``moe_z_loss_coeff``, a
    checkpoint's own pre-training values are not used; ``model.moe_grouped_gemm``, which needs
    Transformer Engine importable here)."""
    from megatron_rl.models.config import ModelConfigError

    coeffs = {n: float(getattr(model_section, n, 0.0) or 0.0)
              for n in ("moe_aux_loss_coeff", "moe_z_loss_coeff")}
    grouped = bool(getattr(model_section, "moe_grouped_gemm", False))
    if not cfg.is_moe:
        for n, v in coeffs.items():
            if v:
                raise ModelSourceError(f"model.{n}={v} needs a mixture-of-experts model (this "
                                       f"one is {cfg.family}); allowed: 0")
        if grouped:
            raise ModelSourceError(f"model.moe_grouped_gemm=true needs a mixture-of-experts "
                                   f"model (this one is {cfg.family}); allowed: false")
        return cfg
    if grouped:
        from megatron_rl.models.builder import transformer_engine_importable

        if not transformer_engine_importable():
            raise ModelSourceError(
                "model.moe_grouped_gemm=true needs Transformer Engine (transformer_engine."
                "pytorch does not import here; install the gpu extra: pip install -e '.[gpu]' "
                "on a CUDA machine); allowed without it: false (SequentialMLP experts)")
    try:
        return cfg.replace(moe_grouped_gemm=grouped, **coeffs)
    except ModelConfigError as exc:
        raise ModelSourceError(str(exc)) from exc


def _architecture(model_section) -> ModelConfig:
    from megatron_rl.convert.common import ConvertError
    from megatron_rl.models.config import get_preset

    kind = source_kind(model_section)
    if kind == "preset":
        return get_preset(model_section.preset or DEFAULT_PRESET)
    try:
        if kind == "hf":
            from megatron_rl.convert.registry import read_hf_config

            _require_dir("model.hf_path", model_section.hf_path)
            return read_hf_config(model_section.hf_path)[1]
        from megatron_rl.convert.megatron_to_hf import resolve_model_config

        _require_dir("model.megatron_ckpt", model_section.megatron_ckpt)
        return resolve_model_config(model_section.megatron_ckpt)[0]
    except ConvertError as exc:
        field = "model.hf_path" if kind == "hf" else "model.megatron_ckpt"
        raise ModelSourceError(f"{field}: {exc}") from exc


def hf_config_of(model_section) -> dict | None:
    """The source's original HF ``config.json`` dict (None for presets)."""
    kind = source_kind(model_section)
    if kind == "hf":
        with open(os.path.join(model_section.hf_path, "config.json")) as f:
            return json.load(f)
    if kind == "megatron":
        from megatron_rl.convert.ckpt_format import read_sidecar

        side = read_sidecar(model_section.megatron_ckpt) or {}
        return side.get("hf_config")
    return None


def tokenizer_dir(model_section) -> str | None:
    """Directory of the run's HF tokenizer, or None for the byte tokenizer.

    ``model.tokenizer`` when set (``"byte"``: the byte tokenizer); else the HF directory, or the
    tokenizer assets a conversion copied (``megatron_ckpt/hf_assets``) when they exist."""
    from megatron_rl.convert.ckpt_format import ASSETS

    explicit = getattr(model_section, "tokenizer", None)
    if explicit:
        return None if explicit == "byte" else explicit
    kind = source_kind(model_section)
    cand = (model_section.hf_path if kind == "hf" else
            os.path.join(model_section.megatron_ckpt, ASSETS) if kind == "megatron" else None)
    if cand and any(os.path.isfile(os.path.join(cand, f)) for f in TOKENIZER_FILES):
        return cand
    return None


def validate_model_section(model_section, tp: int, pp: int, ep: int = 1) -> ModelConfig:
    """Load-time checks: one source, readable config, supported architecture, layout fits, and
    (HF) every tensor present with the shape config.json implies (headers only)."""
    from megatron_rl.convert.common import ConvertError
    from megatron_rl.models.config import ModelConfigError, validate_for_layout

    cfg = model_config(model_section)
    try:
        validate_for_layout(cfg, tp, pp, ep)
    except ModelConfigError as exc:
        raise ModelSourceError(f"model ({source_kind(model_section)}): {exc}") from exc
    if source_kind(model_section) == "hf":
        from megatron_rl.convert.hf_io import HFCheckpoint
        from megatron_rl.convert.hf_to_megatron import validate_hf_checkpoint
        from megatron_rl.convert.registry import mapping_for

        try:
            validate_hf_checkpoint(HFCheckpoint(model_section.hf_path), cfg, mapping_for(cfg))
        except ConvertError as exc:
            raise ModelSourceError(f"model.hf_path: {exc}") from exc
    tok = getattr(model_section, "tokenizer", None)
    if tok and tok != "byte" and not os.path.isdir(tok):
        raise ModelSourceError(f"model.tokenizer={tok!r} is not a directory (allowed: 'byte' or "
                               "a Hugging Face tokenizer directory)")
    return cfg


def _require_dir(field: str, path: str) -> None:
    if not os.path.isdir(path):
        raise ModelSourceError(f"{field}={path!r} is not a directory")


def weight_source(model_section) -> Any:
    """The weight source of a checkpoint-backed model section (None for presets)."""
    kind = source_kind(model_section)
    if kind == "hf":
        return HFShardSource(model_section.hf_path, model_config(model_section))
    if kind == "megatron":
        return MegatronCkptSource(model_section.megatron_ckpt)
    return None


# --- HF: each rank reads its own slices ---------------------------------------------------------
@dataclass(frozen=True)
class SliceRead:
    """Read rows/columns ``[start, stop)`` along ``dim`` of HF tensor ``name`` (dim None: all)."""

    name: str
    dim: int | None = None
    start: int = 0
    stop: int = 0


def shard_reads(tmap, cfg: ModelConfig, partitioned: bool, dim: int, tp: int,
                rank: int) -> list[SliceRead]:
    """The HF slices that make TP rank ``rank``'s shard of canonical tensor ``tmap`` (pure).

    QKV: the rank's contiguous KV groups of q/k/v (weight or bias); fc1: its rows of gate and of
    up; other partitioned tensors: their chunk along ``dim``; the rest whole."""
    from megatron_rl.convert.common import FC1, QKV, hf_shapes

    if not partitioned or tp == 1:
        return [SliceRead(n) for n in tmap.hf]
    shapes = hf_shapes(tmap, cfg)
    if tmap.kind == QKV:
        ng, d = cfg.num_key_value_heads, cfg.kv_channels
        hpg, per = cfg.num_attention_heads // ng, ng // tp
        q, k, v = tmap.hf
        return [SliceRead(q, 0, rank * per * hpg * d, (rank + 1) * per * hpg * d),
                SliceRead(k, 0, rank * per * d, (rank + 1) * per * d),
                SliceRead(v, 0, rank * per * d, (rank + 1) * per * d)]
    if tmap.kind == FC1:
        rows = shapes[tmap.hf[0]][0] // tp
        return [SliceRead(n, 0, rank * rows, (rank + 1) * rows) for n in tmap.hf]
    (name,) = tmap.hf
    size = shapes[name][dim] // tp
    return [SliceRead(name, dim, rank * size, (rank + 1) * size)]


def assemble_shard(tmap, pieces: list[torch.Tensor], cfg: ModelConfig, tp: int) -> torch.Tensor:
    """This rank's local parameter from its HF slices (QKV interleave over its own groups;
    fc1 ``[gate_r; up_r]``)."""
    import torch

    from megatron_rl.convert.common import FC1, QKV

    if tmap.kind == QKV:
        q, k, v = pieces
        groups = cfg.num_key_value_heads // tp  # this rank's KV groups
        rest = tuple(q.shape[1:])
        parts = (q.reshape(groups, -1, *rest), k.reshape(groups, -1, *rest),
                 v.reshape(groups, -1, *rest))
        return torch.cat(parts, dim=1).reshape(-1, *rest)
    if tmap.kind == FC1:
        return torch.cat(pieces, dim=0)
    (t,) = pieces
    return t


class HFShardSource:
    """Loads a rank's TP x PP stage straight from an HF safetensors directory.

    ``bytes_read`` / ``tensors_read`` count what this process materialised from the files (the
    sum of its slices); ``own_bytes`` the size of its stage's parameters in the file dtype."""

    def __init__(self, hf_dir: str, cfg: ModelConfig):
        from megatron_rl.convert.hf_io import HFCheckpoint

        self.hf_dir, self.cfg = hf_dir, cfg
        self.ckpt = HFCheckpoint(hf_dir)
        self.bytes_read = self.tensors_read = self.own_bytes = 0

    def describe(self) -> dict:
        """What to save so a resumed run finds the same weights (see warm_start)."""
        return {"kind": "hf", "path": self.hf_dir, "model_config": asdict(self.cfg)}

    def read(self, req: SliceRead) -> torch.Tensor:
        """One slice, read from its file (opened for this read only)."""
        from safetensors import safe_open

        from megatron_rl.convert.common import ConvertError

        if req.name not in self.ckpt.info:
            raise ConvertError(f"missing tensor {req.name!r} in {self.hf_dir}")
        path = os.path.join(self.hf_dir, self.ckpt.info[req.name].file)
        with safe_open(path, framework="pt") as f:
            sl = f.get_slice(req.name)
            if req.dim is None:
                t = sl[:]
            elif req.dim == 0:
                t = sl[req.start:req.stop]
            else:
                t = sl[:, req.start:req.stop]
        self.bytes_read += t.numel() * t.element_size()
        self.tensors_read += 1
        return t

    def load_into(self, model: torch.nn.Module) -> None:
        """Fill ``model`` (this rank's stage) from the HF files; no collective."""
        import torch
        from megatron.core import parallel_state as ps

        from megatron_rl.convert.registry import mapping_for
        from megatron_rl.models.weights import (
            EMBEDDING,
            WeightsError,
            _tied,
            iter_local_params,
            tp_info,
        )

        cfg = self.cfg
        tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
        index = {m.canonical: m for m in mapping_for(cfg).tensor_maps(cfg)}
        targets = [(name, param) for _, name, param in iter_local_params(model)]
        if _tied(model) and getattr(model, "post_process", False) and not getattr(
                model, "pre_process", True):
            targets.append((EMBEDDING, model.output_layer.weight))  # last stage's tied copy
        elem = torch.empty((), dtype=self.ckpt.main_dtype()).element_size()
        with torch.no_grad():
            for name, param in targets:
                if name not in index:
                    raise WeightsError(f"model parameter {name!r} has no HF tensor for "
                                       f"{cfg.family}")
                partitioned, dim = tp_info(param)
                if name == EMBEDDING:
                    partitioned, dim = True, 0
                tmap = index[name]
                pieces = [self.read(r) for r in shard_reads(tmap, cfg, partitioned, dim, tp, rank)]
                local = assemble_shard(tmap, pieces, cfg, tp if partitioned else 1)
                if tuple(local.shape) != tuple(param.shape):
                    raise WeightsError(f"shape mismatch for {name!r}: HF shard "
                                       f"{tuple(local.shape)} vs model {tuple(param.shape)} at "
                                       f"tensor_parallel_size={tp}")
                param.copy_(local.to(param.dtype))
                self.own_bytes += param.numel() * elem
                del pieces, local


class MegatronCkptSource:
    """Loads a rank's stage from a ``convert hf-to-megatron`` checkpoint (any saved TP/PP)."""

    def __init__(self, ckpt_dir: str):
        self.ckpt_dir = ckpt_dir

    def describe(self) -> dict:
        return {"kind": "megatron", "path": self.ckpt_dir}

    def load_into(self, model: torch.nn.Module) -> None:
        """Collective over all ranks (``dist_checkpointing.load``)."""
        from megatron_rl.convert.hf_to_megatron import load_megatron_checkpoint

        load_megatron_checkpoint(model, self.ckpt_dir)


def source_from_description(desc: dict) -> Any:
    """Inverse of ``describe()``."""
    if desc["kind"] == "hf":
        return HFShardSource(desc["path"], ModelConfig(**desc["model_config"]))
    if desc["kind"] == "megatron":
        return MegatronCkptSource(desc["path"])
    raise ModelSourceError(f"unknown weight source {desc!r}")


def build_model_from_source(cfg: ModelConfig, source, params_dtype: torch.dtype | None = None
                            ) -> torch.nn.Module:
    """This rank's stage, built without random init and filled from ``source`` (``params_dtype``
    None: fp32)."""
    import torch

    params_dtype = torch.float32 if params_dtype is None else params_dtype
    from megatron_rl.convert.hf_to_megatron import build_uninitialized_model

    model = build_uninitialized_model(cfg, params_dtype)
    source.load_into(model)
    return model
