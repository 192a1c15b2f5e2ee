"""Prompts and tokenizers of a run: datasets (JSONL / Parquet / reasoning-gym) with a resumable
loader, and the Hugging Face tokenizer behind the byte tokenizer's small interface."""
