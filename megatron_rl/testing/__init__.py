"""Helpers that make tiny Hugging Face models, tokenizers and datasets at run time (tests, the
README walk-through); nothing is downloaded."""
