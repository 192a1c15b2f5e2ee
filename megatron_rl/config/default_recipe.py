"""The built-in recipe of ``python -m megatron_rl train [key=value ...]`` without a YAML: the
tiny DAPO demo (``examples/tiny_dapo.yaml``) on one process — a random tiny Qwen2 with the byte
tokenizer, an SFT warm start, then DAPO on 1-digit ``a+b`` / ``a-b`` (reasoning-gym chain_sum).
The dataclass defaults alone are not a run that learns (a random model gets no reward)."""

from __future__ import annotations

DEFAULT_RECIPE: dict = {
    "model": {"preset": "tiny"},
    "parallel": {"tp": 1, "pp": 1, "dp": 1},
    "data": {"task": "chain_sum", "train_size": 2000, "val_size": 64, "split_by": "row",
             "seed": 0},
    "sft": {"steps": 80, "batch_size": 32, "lr": 0.003},
    "rollout": {"n": 8, "temperature": 1.0, "max_new_tokens": 4, "val_temperature": 1.0,
                "val_n": 4, "dynamic_sampling": True, "gen_batch_size": 16,
                "max_num_gen_batches": 40},
    "actor": {"micro_batch_size": 16, "mini_batch_size": 32, "ppo_epochs": 1},
    "optim": {"lr": 0.0005, "weight_decay": 0.0, "clip_grad": 1.0},
    "loss": {"algorithm": "dapo"},
    "trainer": {"total_steps": 60, "train_batch_size": 16, "test_freq": 20, "save_freq": 20,
                "output_dir": "runs/default"},
}
