"""What ``key=value`` overrides mean beyond setting a value: the model source the command line
picks replaces the recipe's, and an unknown key gets the closest known one suggested.

Pure functions over plain dicts and dataclass types (no import of :mod:`megatron_rl.config`);
:func:`megatron_rl.config.load.load_config` calls them.
"""

from __future__ import annotations

import dataclasses
import difflib
import sys
import typing
from typing import Any, Mapping

from megatron_rl.util.progress import is_rank0

# Mutually exclusive keys, per section: exactly one decides (model_source.source_kind).
EXCLUSIVE = {"model": ("preset", "hf_path", "megatron_ckpt")}
_printed: set[str] = set()


class OverrideConflict(ValueError):
    """The command line itself sets two mutually exclusive keys."""


def _chosen(section: Any, keys: tuple[str, ...]) -> list[str]:
    if not isinstance(section, Mapping):
        return []
    return [k for k in keys if section.get(k) not in (None, "")]


def resolve_exclusive(recipe: Mapping[str, Any], overrides: Mapping[str, Any],
                      recipe_name: str) -> tuple[dict, list[str]]:
    """``recipe`` with the exclusive keys the overrides replace set to None.

    A source set on the command line (``model.hf_path=X``) wins over the one the recipe sets
    (``model.preset: tiny``): the recipe's is cleared. Returns the new recipe dict and one info
    line per cleared key. Raises :class:`OverrideConflict` when the overrides set two sources.
    """
    out = dict(recipe)
    notes: list[str] = []
    for section, keys in EXCLUSIVE.items():
        mine = _chosen(overrides.get(section), keys)
        if len(mine) > 1:
            raise OverrideConflict(
                f"{section}: exactly one of {', '.join(f'{section}.{k}' for k in keys)} decides, "
                f"but the command line sets {', '.join(mine)} (keep one; a source the recipe "
                "sets is replaced by the command line's)")
        if not mine:
            continue
        given = overrides[section]  # keys the command line sets itself (e.g. preset=null)
        theirs = [k for k in _chosen(recipe.get(section), keys) if k not in given]
        if not theirs:
            continue
        out[section] = {**recipe[section], **{k: None for k in theirs}}
        for k in theirs:
            notes.append(f"[config] {section}.{mine[0]} from the command line replaces "
                         f"{section}.{k}={recipe[section][k]!r} of {recipe_name} (cleared)")
    return out, notes


def print_notes(notes: list[str]) -> None:
    """Each note once per process, on stderr, on rank 0."""
    for note in notes:
        if note not in _printed and is_rank0():
            _printed.add(note)
            print(note, file=sys.stderr, flush=True)


# ---- did you mean ------------------------------------------------------------------------------
def dotted_keys(root: type, prefix: str = "") -> list[str]:
    """Every dotted field path of the dataclass ``root`` (nested dataclasses expanded)."""
    hints = typing.get_type_hints(root)
    out = []
    for f in dataclasses.fields(root):
        path = f"{prefix}{f.name}"
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            out += dotted_keys(tp, path + ".")
        else:
            out.append(path)
    return out


def suggest_key(full: str, root: type, known_here: list[str] | None = None) -> str:
    """``"; did you mean 'trainer.seed'?"`` for the unknown dotted key ``full``: the closest
    field of the section it names (``trainer.sed``, ``model.hf``), the closest section
    (``traner.seed``), or the same field in other sections (``seed`` -> ``trainer.seed``,
    ``data.seed``, ...); else the keys known where it was given (``known_here``)."""
    paths = dotted_keys(root)
    children: dict[str, list[str]] = {}  # section ("" = top level) -> its fields and sections
    for p in paths:
        parts = p.split(".")
        for i in range(len(parts)):
            kids = children.setdefault(".".join(parts[:i]), [])
            if parts[i] not in kids:
                kids.append(parts[i])
    sec, _, leaf = full.rpartition(".")

    def near(name: str, known: list[str]) -> list[str]:
        starts = [k for k in known if k.startswith(name) and len(name) >= 2]
        return difflib.get_close_matches(name, known, n=1) or starts[:1]

    cands: list[str] = []
    if sec in children:  # a known section: the closest field in it
        cands = [_join(sec, n) for n in near(leaf, children[sec])]
    elif sec:  # a misspelt section
        for s in difflib.get_close_matches(sec, [k for k in children if k], n=3, cutoff=0.6):
            cands = [_join(s, n) for n in near(leaf, children[s])]
            if cands:
                break
    if not cands:  # the field exists in another section
        cands = [p for p in paths if p.rpartition(".")[2] == leaf]
    if not cands:  # a near field name anywhere
        leaves = sorted({p.rpartition(".")[2] for p in paths})
        close = difflib.get_close_matches(leaf, leaves, n=1, cutoff=0.8)
        cands = [p for p in paths if close and p.rpartition(".")[2] == close[0]]
    if len(cands) > 1:
        return f"; did you mean one of {', '.join(map(repr, cands[:4]))}?"
    if cands:
        return f"; did you mean {cands[0]!r}?"
    if known_here:
        return f"; known keys here: {', '.join(known_here)}"
    return ""


def _join(section: str, leaf: str) -> str:
    return f"{section}.{leaf}" if section else leaf


def _common_prefix(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a.split("."), b.split(".")):
        if x != y:
            break
        n += 1
    return n


def closest_name(name: str, known: typing.Iterable[str]) -> str:
    """``"; did you mean 'x'?"`` for the closest of ``known``, else ``""``."""
    close = difflib.get_close_matches(str(name), list(known), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""
