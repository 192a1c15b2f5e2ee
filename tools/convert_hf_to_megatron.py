"""Convert a Hugging Face checkpoint (config.json + safetensors) to a megatron dist_checkpointing
checkpoint that loads at any TP/PP layout.

    python tools/convert_hf_to_megatron.py --hf-dir Qwen2.5-7B --out ckpt/qwen7b --tp 2 --pp 2
    torchrun --nproc-per-node 8 tools/convert_hf_to_megatron.py --hf-dir ... --out ... --tp 2 --pp 4

Without torchrun it spawns TP*PP local ranks; each holds its model stage plus one full tensor.
Same as ``python -m megatron_rl convert hf-to-megatron``.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # a checkout

from megatron_rl.convert.cli import add_hf_to_megatron_args, run_hf_to_megatron  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_hf_to_megatron_args(p)
    return run_hf_to_megatron(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
