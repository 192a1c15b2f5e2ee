"""Tokenizers of a run: a Hugging Face tokenizer (from the model directory) behind the same small
interface as the byte tokenizer of the tiny models.

The interface everything else uses: ``encode(text, add_eos=False) -> list[int]``,
``decode(ids) -> str`` (stops at EOS, drops special tokens), ``eos_id``, ``pad_id``,
``vocab_size`` (ids are ``< vocab_size``), and :meth:`render_prompt` (a prompt given as text or as
chat messages -> the text the model sees).
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence


class TokenizerError(ValueError):
    """The tokenizer does not fit the model or cannot be loaded; the message names the field."""


class HFTokenizer:
    """``transformers.AutoTokenizer`` (local files only) with the byte tokenizer's interface.

    ``eos_id`` is the tokenizer's EOS token; ``pad_id`` its PAD token, else EOS. Text is encoded
    without added special tokens (a rendered chat template already holds them as text)."""

    def __init__(self, path: str):
        from transformers import AutoTokenizer

        try:
            self.tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError) as exc:
            raise TokenizerError(f"tokenizer in {path!r} cannot be loaded: {exc}") from exc
        if self.tok.eos_token_id is None:
            raise TokenizerError(f"tokenizer in {path!r} has no eos_token; set one in "
                                 "tokenizer_config.json")
        self.path = path
        self.eos_id = int(self.tok.eos_token_id)
        self.pad_id = int(self.tok.pad_token_id if self.tok.pad_token_id is not None
                          else self.eos_id)
        self.eos_token_id, self.pad_token_id = self.eos_id, self.pad_id
        self.vocab_size = len(self.tok)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tok, "chat_template", None))

    def encode(self, text: str, add_eos: bool = False) -> list[int]:
        """Token ids of ``text`` (plus ``eos_id`` if ``add_eos``)."""
        ids = list(self.tok.encode(text, add_special_tokens=False))
        return ids + [self.eos_id] if add_eos else ids

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids`` up to (excluding) the first EOS; special tokens dropped."""
        ids = [int(i) for i in ids]
        if self.eos_id in ids:
            ids = ids[:ids.index(self.eos_id)]
        return self.tok.decode(ids, skip_special_tokens=True)

    def render_prompt(self, prompt: Any, use_template: bool = True) -> str:
        """Chat messages (or a plain text, as one user message) through the chat template with
        the generation prompt; without a template, the text itself (messages: contents joined)."""
        messages = as_messages(prompt)
        if use_template and self.has_chat_template:
            return self.tok.apply_chat_template(messages, add_generation_prompt=True,
                                                tokenize=False)
        return prompt if isinstance(prompt, str) else "\n".join(m["content"] for m in messages)

    def save_pretrained(self, out_dir: str) -> None:
        self.tok.save_pretrained(out_dir)

    def __len__(self) -> int:
        return self.vocab_size


def as_messages(prompt: Any) -> list[dict]:
    """``[{"role", "content"}, ...]`` of a prompt given as text or messages (numpy arrays from
    Parquet included)."""
    if hasattr(prompt, "tolist"):
        prompt = prompt.tolist()
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    if isinstance(prompt, Sequence) and all(isinstance(m, dict) and "content" in m
                                            for m in prompt) and prompt:
        return [{"role": m.get("role", "user"), "content": str(m["content"])} for m in prompt]
    raise TokenizerError(f"a prompt must be a string or a list of {{'role', 'content'}} chat "
                         f"messages, got {str(prompt)[:80]!r}")


def render_prompt(tokenizer, prompt: Any, use_template: bool = True) -> str:
    """The prompt text ``tokenizer`` will encode: the HF tokenizer's rendering, or for the byte
    tokenizer the text (messages: the last user message, as for the tiny task prompts)."""
    if hasattr(tokenizer, "render_prompt"):
        return tokenizer.render_prompt(prompt, use_template)
    if isinstance(prompt, str):
        return prompt
    msgs = as_messages(prompt)
    users = [m for m in msgs if m["role"] == "user"]
    return (users or msgs)[-1]["content"]


def check_vocab_fits(tokenizer, model_vocab: int, where: str) -> None:
    """Every id the tokenizer can produce must be a row of the model's (padded) vocabulary."""
    n = int(getattr(tokenizer, "vocab_size", len(tokenizer)))
    if n > model_vocab:
        raise TokenizerError(f"{where}: the tokenizer has {n} tokens but the model's vocab_size is "
                             f"{model_vocab}; the tokenizer does not belong to this model "
                             "(set model.tokenizer to the model's tokenizer directory)")
