"""Install megatron_rl.

CPU machines: ``pip install torch==2.13.0 -e .[test]`` (pinning torch first keeps pip on the CPU
wheel; a loose torch requirement can pull a multi-GB CUDA build).
"""
from setuptools import find_packages, setup

setup(
    name="megatron_rl",
    version="0.1.0",
    description="RL post-training on megatron-core with exact, layout-invariant entropy control",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_rl", "megatron_rl.*"]),
    package_data={"megatron_rl.data": ["eval_sets/*.jsonl"]},  # shipped evaluation sets
    install_requires=[
        "torch>=2.4",
        "megatron-core>=0.16",
        "pyyaml",
        "numpy",
        "nvidia-ml-py",
        "psutil",  # megatron-core dist_checkpointing needs it but does not declare it
        "transformers>=4.51",  # embedded rollout engine, HF conversion
        "safetensors",
        "reasoning-gym",  # verifiable tasks
        "math-verify",
        "matplotlib",  # plot
        "gymnasium>=1.0",  # FrozenLake (multi-turn envs)
        "sglang-router",  # rollout.engine=sglang: the router in front of the rollout fleet
    ],
    extras_require={
        "test": ["pytest>=7", "pytest-timeout", "ruff", "pyarrow", "triton", "peft"],
        "logging": ["tensorboard", "wandb"],
        # NVIDIA's apex is optional and never installed from PyPI (the PyPI package of that name
        # is an unrelated project).
        "gpu": ["transformer-engine[pytorch]", "nvidia-ml-py"],
        "sglang": ["sglang"],  # real SGLang servers (GPU); CPU runs use our `serve`
    },
    entry_points={"console_scripts": ["megatron-rl=megatron_rl.cli.app:run"]},
)
