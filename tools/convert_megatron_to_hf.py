"""Convert a megatron dist_checkpointing checkpoint to Hugging Face sharded safetensors +
config.json (loadable with ``transformers`` ``from_pretrained``).

    python tools/convert_megatron_to_hf.py --ckpt ckpt/qwen7b --out hf/qwen7b --dtype bfloat16
    torchrun --nproc-per-node 4 tools/convert_megatron_to_hf.py --ckpt ... --out ...

No model is built; peak memory is about one output shard. Under torchrun each rank writes every
WORLD_SIZE-th shard. Same as ``python -m megatron_rl convert megatron-to-hf``.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # a checkout

from megatron_rl.convert.cli import add_megatron_to_hf_args, run_megatron_to_hf  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_megatron_to_hf_args(p)
    return run_megatron_to_hf(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
