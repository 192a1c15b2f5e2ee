"""Durable rollout bank (``rollout.durable_bank``): finished rollout groups survive a killed job.

Every generation round's scored groups (one prompt's ``rollout.n`` responses: token ids,
behaviour log-probs, rewards, weight versions -- everything the trainer builds its batch from)
are appended to ``OUTPUT_DIR/rollout_bank.bin`` when the round returns, before the trainer uses
them. After a resume from the checkpoint of step ``S`` the rounds banked for steps ``>= S`` under
the weights of that run's history (version ``<= S``) and within the staleness the step allows
(``step - version <= rollout.max_staleness``; synchronous: the version of the step itself) are
reused instead of regenerated; every other group is dropped when the bank is opened.

File format: a sequence of records, each ``MAGIC (4 bytes) | payload length (uint32 LE) |
CRC-32 of the payload (uint32 LE) | payload`` with a UTF-8 JSON payload (one group). Reading
stops at the first record that is incomplete or whose checksum does not match (a SIGKILL during
an append tears at most the record being written); the file is then cut back to the last good
record. fsync policy: one ``write`` + ``flush`` + ``fsync`` per generation round, so a round the
trainer may train on is on disk first; rewrites (open, prune) go to a temporary file that is
fsynced and renamed over the bank, then the directory is fsynced.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import threading
import zlib
from typing import Any

import torch

FILE_NAME = "rollout_bank.bin"
MAGIC = b"MRB1"
HEADER = struct.Struct("<4sII")  # magic, payload length, CRC-32 of the payload
FORMAT = 1


def _default(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):  # routed experts [L, layers, k] int32 (host)
        return {"__tensor__": str(obj.dtype).split(".")[-1], "shape": list(obj.shape),
                "data": obj.reshape(-1).tolist()}
    raise TypeError(f"rollout bank: cannot store a {type(obj).__name__}")


def _hook(obj: dict) -> Any:
    if "__tensor__" in obj:
        return torch.tensor(obj["data"], dtype=getattr(torch, obj["__tensor__"])).reshape(
            obj["shape"])
    return obj


def encode_record(obj: dict) -> bytes:
    """One framed record: header (magic, length, CRC-32) + JSON payload."""
    payload = json.dumps(obj, default=_default, separators=(",", ":")).encode()
    return HEADER.pack(MAGIC, len(payload), zlib.crc32(payload)) + payload


def read_records(path: str) -> tuple[list[dict], int, int]:
    """``(records, good_bytes, file_bytes)``: the records before the first torn or corrupt one
    (a missing file reads as empty)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return [], 0, 0
    records, pos = [], 0
    while pos + HEADER.size <= len(data):
        magic, n, crc = HEADER.unpack_from(data, pos)
        payload = data[pos + HEADER.size:pos + HEADER.size + n]
        if magic != MAGIC or len(payload) != n or zlib.crc32(payload) != crc:
            break
        try:
            records.append(json.loads(payload, object_hook=_hook))
        except ValueError:
            break
        pos += HEADER.size + n
    return records, pos, len(data)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:  # some file systems cannot fsync a directory
        pass
    finally:
        os.close(fd)


def _rewrite(path: str, records: list[dict]) -> None:
    """Replace the bank with ``records`` (temp file, fsync, rename, fsync of the directory)."""
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(b"".join(encode_record(r) for r in records))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(os.path.abspath(path)))


def fingerprint(cfg) -> str:
    """What a banked sample depends on besides its prompt and weights: the model, the sampling
    settings and the seeds. A bank written under another fingerprint is not reused."""
    r = cfg.rollout
    keys = {"model": cfg.to_dict()["model"], "n": r.n, "temperature": r.temperature,
            "top_p": r.top_p, "max_new_tokens": r.max_new_tokens, "engine": r.engine,
            "per_request_seed": r.per_request_seed, "seed": cfg.trainer.seed,
            "reward_fn": r.reward_fn, "data": cfg.to_dict()["data"]}
    return hashlib.sha256(json.dumps(keys, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _versions(samples: list[dict]) -> tuple[int, int]:
    """(oldest, newest) policy version of a group's tokens (-1 when any is unknown)."""
    vs = [v for s in samples for v in (s.get("token_versions") or [s.get("weight_version", -1)])]
    return (min(vs), max(vs)) if vs else (-1, -1)


def reusable(rec: dict, resume_step: int, max_staleness: int, fp: str) -> bool:
    """Whether a banked group may be trained on after a resume from the checkpoint of step
    ``resume_step``: same fingerprint, a step not trained yet, every token from a version of
    the resumed history (``<= resume_step``), and no older than the step allows."""
    if rec.get("format") != FORMAT or rec.get("fingerprint") != fp:
        return False
    oldest, newest = rec["oldest"], rec["newest"]
    return (rec["step"] >= resume_step and 0 <= oldest and newest <= resume_step
            and rec["step"] - oldest <= max_staleness)


class RolloutBank:
    """The bank of one run directory (rank 0). :meth:`open` once (fresh run or resume), then
    :meth:`take` / :meth:`append` per generation round and :meth:`prune` at checkpoints; safe
    to call from the rollout producer thread and the trainer's thread."""

    def __init__(self, path: str, fp: str) -> None:
        self.path, self.fp = path, fp
        self.lock = threading.Lock()
        self._rounds: dict[tuple[int, int], list[dict]] = {}  # reusable, not taken yet
        self.reused_groups = 0
        self.banked_groups = 0

    def open(self, resume_step: int | None, max_staleness: int) -> dict[str, int]:
        """Read the bank; keep the complete rounds reusable after a resume from step
        ``resume_step`` (None: a fresh run, nothing is kept); rewrite the file with them.
        Returns counts: ``kept`` / ``dropped`` groups and ``torn_bytes`` cut off the end."""
        records, good, size = read_records(self.path)
        keep = [r for r in records if resume_step is not None
                and reusable(r, resume_step, max_staleness, self.fp)]
        rounds: dict[tuple[int, int], dict[int, dict]] = {}
        for r in keep:  # a round banked twice: the later one
            rounds.setdefault((r["step"], r["round"]), {})[r["prompt_index"]] = r
        self._rounds = {k: [v[i] for i in sorted(v)] for k, v in rounds.items()
                        if len(v) == next(iter(v.values()))["groups"]}  # whole or not at all
        kept = [r for k in sorted(self._rounds) for r in self._rounds[k]]
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        _rewrite(self.path, kept)
        return {"kept": len(kept), "dropped": len(records) - len(kept),
                "torn_bytes": size - good}

    def take(self, step: int, round_i: int, prompts: list[list[int]]
             ) -> list[list[dict]] | None:
        """The banked groups of generation round ``round_i`` of ``step`` (prompt order; each
        group's samples without ``uid``: the caller numbers the groups), or None when the round
        is not banked or was banked for other prompts (then it is dropped)."""
        with self.lock:
            groups = self._rounds.pop((step, round_i), None)
        if groups is None:
            return None
        if any(g["prompt_index"] >= len(prompts) or any(
                s["prompt_ids"] != prompts[g["prompt_index"]] for s in g["samples"])
               for g in groups):
            return None
        self.reused_groups += len(groups)
        return [[dict(s) for s in g["samples"]] for g in groups]

    def append(self, step: int, round_i: int, records: list[dict]) -> None:
        """Bank a generation round's scored records (grouped by ``uid``; each record carries
        its ``prompt_index``): one fsynced append."""
        groups: dict[int, list[dict]] = {}
        for r in records:
            groups.setdefault(r["uid"], []).append({k: v for k, v in r.items() if k != "uid"})
        blob = []
        for samples in groups.values():
            oldest, newest = _versions(samples)
            blob.append(encode_record({
                "format": FORMAT, "fingerprint": self.fp, "step": step, "round": round_i,
                "prompt_index": samples[0]["prompt_index"], "groups": len(groups),
                "oldest": oldest, "newest": newest, "samples": samples}))
        with self.lock, open(self.path, "ab") as f:
            f.write(b"".join(blob))
            f.flush()
            os.fsync(f.fileno())
        self.banked_groups += len(groups)

    def prune(self, before_step: int) -> None:
        """Drop the groups of steps before ``before_step`` (trained and checkpointed)."""
        with self.lock:
            records, _, _ = read_records(self.path)
            kept = [r for r in records if r["step"] >= before_step]
            if len(kept) != len(records):
                _rewrite(self.path, kept)
