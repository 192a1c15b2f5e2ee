"""Prompt datasets and a deterministic, resumable prompt loader.

* :class:`PromptDataset`: rows ``{"prompt": str, "answer": str, ...}`` from JSONL or Parquet
  files (DAPO-Math style; the prompt and answer field names are configurable and may be dotted
  paths into nested fields, e.g. ``reward_model.ground_truth``) or generated from a
  reasoning-gym task (:meth:`PromptDataset.from_task`). A row without a prompt or an answer is a
  ``ValueError`` naming the file and the line (JSONL, 1-based) or row (Parquet, 0-based).
  Chat-style prompts (a list of ``{"role", "content"}`` messages, the verl/DAPO-Math layout) are
  kept whole in ``row["messages"]`` (rendered later with the tokenizer's chat template, see
  :func:`megatron_rl.run.setup.build_datasets`); ``row["prompt"]`` is the last user message.
  ``answer_key=None`` reads ``answer``, else ``reward_model.ground_truth`` (DEFAULT_ANSWER_KEYS).
* :class:`PromptLoader`: batches of rows; epoch ``e`` visits the rows in the permutation given by
  ``(seed, e)``; the last partial batch of an epoch is dropped (every batch is full).
  ``state_dict()`` / ``load_state_dict()`` restore the position exactly.
* :func:`train_val_split`: disjoint deterministic split, by row or by distinct prompt.
"""

from __future__ import annotations

import json
import os
import random
from typing import Any, Iterator, Sequence

DEFAULT_ANSWER_KEYS = ("answer", "reward_model.ground_truth")
ID_KEYS = ("id", "uid")  # row identifiers that must be unique within a dataset


def _get(row: dict, key: str) -> Any:
    cur: Any = row
    for part in key.split("."):
        if not isinstance(cur, dict) or part not in cur:
            return None
        cur = cur[part]
    return cur


def _messages(p: Any) -> list[dict] | None:
    if hasattr(p, "tolist"):
        p = p.tolist()
    if isinstance(p, (list, tuple)) and p and all(isinstance(m, dict) and "content" in m
                                                  for m in p):
        return [{"role": str(m.get("role", "user")), "content": str(m["content"])} for m in p]
    return None


def _prompt_text(p: Any) -> Any:
    if isinstance(p, (list, tuple)) and p and isinstance(p[-1], dict) and "content" in p[-1]:
        users = [m for m in p if m.get("role", "user") == "user"]
        return (users or list(p))[-1]["content"]
    if hasattr(p, "tolist"):  # numpy array from parquet
        return _prompt_text(p.tolist())
    return p


class PromptDataset:
    def __init__(self, rows: Sequence[dict], source: str = "<memory>"):
        self.rows = list(rows)
        self.source = source

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        return self.rows[i]

    def __iter__(self):
        return iter(self.rows)

    @staticmethod
    def _normalise(raw: dict, prompt_key: str, answer_key: str | None, where: str) -> dict:
        if not isinstance(raw, dict):
            raise ValueError(f"{where}: expected a JSON object, got {type(raw).__name__}")
        messages = _messages(_get(raw, prompt_key))
        prompt = _prompt_text(_get(raw, prompt_key))
        hint = ""
        if answer_key is None:
            answer_key = next((k for k in DEFAULT_ANSWER_KEYS if _get(raw, k) is not None),
                              DEFAULT_ANSWER_KEYS[0])
            hint = f" (nor {DEFAULT_ANSWER_KEYS[1]!r}; set data.answer_key)"
        answer = _get(raw, answer_key)
        if prompt is None:
            raise ValueError(f"{where}: row has no prompt field {prompt_key!r} "
                             f"(fields: {sorted(raw)}); set data.prompt_key to the field that "
                             "holds the prompt")
        if isinstance(prompt, bytes):
            prompt = _utf8(prompt, f"{where}: prompt field {prompt_key!r}")
        if not isinstance(prompt, (str, int, float)) or not str(prompt).strip():
            raise ValueError(f"{where}: prompt field {prompt_key!r} is empty or not text (got "
                             f"{prompt!r:.80}); every row needs a non-empty prompt string or a "
                             "list of chat messages (fix or remove the row)")
        if answer is None or (isinstance(answer, str) and not answer.strip()):
            raise ValueError(f"{where}: row has no answer field {answer_key!r}{hint} "
                             f"(fields: {sorted(raw)}); every prompt needs an answer to score")
        if isinstance(answer, bytes):
            answer = _utf8(answer, f"{where}: answer field {answer_key!r}")
        if hasattr(answer, "tolist"):
            answer = answer.tolist()
        row = {k: v for k, v in raw.items() if k not in (prompt_key, answer_key)}
        row["prompt"] = str(prompt)
        if messages is not None:
            row["messages"] = messages
        row["answer"] = answer if isinstance(answer, str) else json.dumps(answer) \
            if isinstance(answer, (list, dict)) else str(answer)
        return row

    @classmethod
    def from_jsonl(cls, path: str, prompt_key: str = "prompt", answer_key: str | None = None
                   ) -> PromptDataset:
        rows = []
        with open(path, "rb") as f:
            for lineno, raw_line in enumerate(f, 1):
                where = f"{path}:{lineno}"
                line = _utf8(raw_line, where)
                if not line.strip():
                    continue
                try:
                    raw = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{where}: invalid JSON ({e})") from None
                rows.append(cls._normalise(raw, prompt_key, answer_key, where))
        return cls(rows, path)

    @classmethod
    def from_parquet(cls, path: str, prompt_key: str = "prompt", answer_key: str | None = None
                     ) -> PromptDataset:
        try:
            import pyarrow.parquet as pq
        except ImportError as e:  # pragma: no cover
            raise ImportError("reading Parquet needs pyarrow: pip install pyarrow") from e
        try:
            table = pq.read_table(path)
        except Exception as e:  # noqa: BLE001 - arrow raises several types for a bad file
            raise ValueError(f"{path}: not a readable Parquet file ({type(e).__name__}: {e})"
                             ) from None
        top = prompt_key.split(".")[0]
        if top not in table.column_names:
            raise ValueError(f"{path}: no column {top!r} for data.prompt_key={prompt_key!r} "
                             f"(columns: {table.column_names}); set data.prompt_key")
        rows = [cls._normalise(raw, prompt_key, answer_key, f"{path} row {i}")
                for i, raw in enumerate(table.to_pylist())]
        return cls(rows, path)

    @classmethod
    def from_files(cls, paths: str | Sequence[str], prompt_key: str = "prompt",
                   answer_key: str | None = None) -> PromptDataset:
        """JSONL (``.jsonl``/``.json``) or Parquet (``.parquet``) files, concatenated."""
        if isinstance(paths, str):
            paths = [paths]
        rows: list[dict] = []
        n_before = 0
        for p in paths:
            if not os.path.exists(p):
                raise FileNotFoundError(f"prompt dataset file not found: {p}")
            ext = os.path.splitext(p)[1].lower()
            if ext == ".parquet":
                rows += cls.from_parquet(p, prompt_key, answer_key).rows
            elif ext in (".jsonl", ".json"):
                rows += cls.from_jsonl(p, prompt_key, answer_key).rows
            else:
                raise ValueError(f"{p}: unsupported dataset format {ext!r} "
                                 "(expected .jsonl, .json or .parquet)")
            if len(rows) == n_before:
                raise ValueError(f"{p}: the file has no rows")
            n_before = len(rows)
        check_unique_ids(rows, ",".join(paths))
        return cls(rows, ",".join(paths))

    @classmethod
    def from_task(cls, name: str | None = None, size: int = 1000, seed: int = 0,
                  **task_kwargs) -> PromptDataset:
        """Generated rows of a reasoning-gym task (see :mod:`megatron_rl.rewards.tasks`)."""
        from megatron_rl.rewards.tasks import DEFAULT_TASK, make_task_dataset

        name = name or DEFAULT_TASK
        return cls(make_task_dataset(name, size, seed, **task_kwargs), f"task:{name}")


def _utf8(data: bytes, where: str) -> str:
    """``data`` decoded as UTF-8; a ``ValueError`` naming ``where`` and the bad byte otherwise."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{where}: not UTF-8 text (byte 0x{data[e.start]:02x} at offset "
                         f"{e.start}); re-encode the file as UTF-8, e.g. "
                         "`iconv -f latin1 -t utf-8 IN > OUT`") from None


def check_unique_ids(rows: Sequence[dict], source: str) -> None:
    """Rows that carry an ``id`` (or ``uid``) field must not share one: ``ValueError`` naming the
    id and both rows (0-based, in file order)."""
    for key in ID_KEYS:
        seen: dict[str, int] = {}
        for i, row in enumerate(rows):
            if key not in row:
                continue
            ident = json.dumps(row[key], sort_keys=True, default=str)
            if ident in seen:
                raise ValueError(f"{source}: duplicate {key} {row[key]!r} in rows {seen[ident]} "
                                 f"and {i}; ids must be unique (drop the duplicate row or give it "
                                 "a new id)")
            seen[ident] = i


def train_val_split(dataset: PromptDataset, val_size: int | float, seed: int = 0,
                    by: str | None = "prompt") -> tuple[PromptDataset, PromptDataset]:
    """Deterministic disjoint split. ``val_size``: a count, or a fraction if < 1.

    ``by="prompt"`` splits the distinct prompts (no prompt text appears in both sets; the count
    or fraction then refers to distinct prompts); ``by=None`` splits rows. Order within each
    part follows the original dataset."""
    if by is None:
        keys = list(range(len(dataset)))
        key_of = list(range(len(dataset)))
    else:
        key_of = [r[by] for r in dataset.rows]
        keys = list(dict.fromkeys(key_of))
    n_val = int(round(val_size * len(keys))) if isinstance(val_size, float) and val_size < 1 \
        else int(val_size)
    if not 0 < n_val < len(keys):
        raise ValueError(f"val_size={val_size} gives {n_val} of {len(keys)} "
                         f"{'distinct ' + by + 's' if by else 'rows'}; need 0 < n < total")
    perm = list(keys)
    random.Random(seed).shuffle(perm)
    val_keys = set(perm[:n_val])
    train = [r for r, k in zip(dataset.rows, key_of) if k not in val_keys]
    val = [r for r, k in zip(dataset.rows, key_of) if k in val_keys]
    return (PromptDataset(train, dataset.source + "[train]"),
            PromptDataset(val, dataset.source + "[val]"))


class PromptLoader:
    """Infinite iterator over full batches (lists of rows), epoch after epoch.

    The order of epoch ``e`` is ``random.Random(f"{seed}:{e}")``'s shuffle of the row indices
    (``shuffle=False``: dataset order). ``state_dict()`` records (epoch, position); a loader
    restored with ``load_state_dict()`` yields exactly the batches the original would have yielded
    next."""

    def __init__(self, dataset: PromptDataset | Sequence[dict], batch_size: int, seed: int = 0,
                 shuffle: bool = True):
        self.dataset = dataset
        self.batch_size = int(batch_size)
        self.seed = int(seed)
        self.shuffle = shuffle
        if self.batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        if len(dataset) < self.batch_size:
            raise ValueError(f"dataset has {len(dataset)} rows < batch_size {self.batch_size}")
        self.epoch = 0
        self.pos = 0  # index into this epoch's order of the next row
        self._order_epoch = -1
        self._order: list[int] = []

    @property
    def batches_per_epoch(self) -> int:
        return len(self.dataset) // self.batch_size

    def _epoch_order(self) -> list[int]:
        if self._order_epoch != self.epoch:
            order = list(range(len(self.dataset)))
            if self.shuffle:
                random.Random(f"{self.seed}:{self.epoch}").shuffle(order)
            self._order, self._order_epoch = order, self.epoch
        return self._order

    def next_batch(self) -> list[dict]:
        if self.pos + self.batch_size > len(self.dataset):
            self.epoch += 1
            self.pos = 0
        order = self._epoch_order()
        idx = order[self.pos: self.pos + self.batch_size]
        self.pos += self.batch_size
        return [self.dataset[i] for i in idx]

    def __iter__(self) -> Iterator[list[dict]]:
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos, "seed": self.seed,
                "batch_size": self.batch_size, "num_rows": len(self.dataset),
                "shuffle": self.shuffle}

    def load_state_dict(self, state: dict) -> None:
        for k in ("seed", "batch_size", "num_rows", "shuffle"):
            mine = self.state_dict()[k]
            if k in state and state[k] != mine:
                raise ValueError(f"PromptLoader.load_state_dict: {k} differs (checkpoint "
                                 f"{state[k]!r}, loader {mine!r}); the position would not match")
        self.epoch = int(state["epoch"])
        self.pos = int(state["pos"])
