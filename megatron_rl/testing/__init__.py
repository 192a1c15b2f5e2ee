"""Helpers that make tiny Hugging Face models, tokenizers and datasets at run time (tests, the
README walk-through; nothing is downloaded), and the fault-injection phase markers of
``tools/chaos.py`` (:mod:`megatron_rl.testing.chaos_hook`, inert unless enabled)."""
