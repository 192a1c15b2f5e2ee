"""Byte-level tokenizer for the tiny models (vocab 256).

Text is encoded as its UTF-8 bytes, one id per byte. Two control bytes are reserved and never
occur in task text: ``pad_id = 0`` (NUL) and ``eos_id = 1`` (SOH). ``encode`` raises
``ValueError`` on text that contains either byte (silently dropping them would change the task).
``decode`` stops at the first ``eos_id``, drops ``pad_id`` and decodes with ``errors="replace"``
(a sampled model may emit invalid UTF-8 sequences).

Prompt template (``apply_prompt``): the compact task prompt itself, e.g. ``"3+4="``; the model
answers with the digits and then ``eos``. Prompts are kept short (< 48 bytes) for the tiny models.
"""

from __future__ import annotations

from typing import Iterable

MAX_PROMPT_BYTES = 48


class ByteTokenizer:
    vocab_size = 256
    pad_id = 0
    eos_id = 1
    # Aliases in the Hugging Face naming, for code that expects them.
    pad_token_id = 0
    eos_token_id = 1

    def encode(self, text: str, add_eos: bool = False) -> list[int]:
        """UTF-8 bytes of ``text`` (plus ``eos_id`` if ``add_eos``). Raises ``ValueError`` if the
        text contains the reserved bytes 0x00/0x01."""
        data = text.encode("utf-8")
        if b"\x00" in data or b"\x01" in data:
            raise ValueError(
                "ByteTokenizer: text contains a reserved control byte (0x00 = pad, 0x01 = eos): "
                f"{text[:60]!r}"
            )
        ids = list(data)
        if add_eos:
            ids.append(self.eos_id)
        return ids

    def decode(self, ids: Iterable[int]) -> str:
        """Bytes up to (excluding) the first ``eos_id``; ``pad_id`` dropped; invalid UTF-8 is
        replaced with U+FFFD."""
        out = bytearray()
        for i in ids:
            i = int(i)
            if i == self.eos_id:
                break
            if i == self.pad_id:
                continue
            if not 0 <= i < 256:
                raise ValueError(f"ByteTokenizer: id {i} outside the byte vocabulary [0, 256)")
            out.append(i)
        return out.decode("utf-8", errors="replace")

    def apply_prompt(self, question: str) -> str:
        """The prompt text for a (compact) question: the question itself, ending in ``=``.

        ``"3+4"`` → ``"3+4="``; a question already ending in ``=`` is left as is. Raises
        ``ValueError`` if the prompt would exceed ``MAX_PROMPT_BYTES`` bytes."""
        q = question.strip()
        prompt = q if q.endswith("=") else q + "="
        if len(prompt.encode("utf-8")) > MAX_PROMPT_BYTES:
            raise ValueError(
                f"prompt of {len(prompt.encode('utf-8'))} bytes exceeds {MAX_PROMPT_BYTES} bytes "
                f"for the tiny byte models: {prompt[:60]!r}"
            )
        return prompt

    def __len__(self) -> int:
        return self.vocab_size
