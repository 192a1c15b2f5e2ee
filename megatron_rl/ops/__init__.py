"""Vocab-parallel ops: per-token log-prob and entropy without gathering the vocabulary."""

from megatron_rl.ops.vocab_parallel import *  # noqa: F403 - the public API is its __all__
from megatron_rl.ops.vocab_parallel import __all__  # noqa: F401
