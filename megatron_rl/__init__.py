"""megatron_rl: RL post-training of LLMs on megatron-core (see README.md)."""

from megatron_rl.util.lazy_compile import install as _defer_megatron_compile

_defer_megatron_compile()  # megatron-core imports without TorchInductor (util/lazy_compile.py)
