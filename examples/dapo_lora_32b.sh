#!/bin/bash
# DAPO with LoRA on Qwen2.5-32B on ONE 8-GPU (80 GB) node, no SLURM needed (docs/lora.md):
#   GPUs 0-3: the Megatron actor, TP4 (4 local ranks started by `train`), frozen bf16 base +
#             rank-64 adapters, full recomputation;
#   GPUs 4-7: one SGLang server, TP4 (started by `train`: rollout.sglang.gpus), receiving merged
#             weights after every step.
# The run config is examples/dapo_lora_32b.yaml; `python -m megatron_rl plan
# examples/dapo_lora_32b.yaml` gives 29.9 GiB per actor GPU of 80 (the same layout with full
# fine-tuning needs 128 GPUs: examples/dapo_32b.sh).
#
#   bash examples/dapo_lora_32b.sh                          # from the repository root
#   bash examples/dapo_lora_32b.sh trainer.total_steps=50   # extra args: config overrides
#   MRL_DRY_RUN=1 bash examples/dapo_lora_32b.sh            # print the command only
#
# Paths (override in the environment): MODEL_PATH (HF directory of Qwen2.5-32B), TRAIN_FILE
# (DAPO-Math-17k Parquet), MRL_RUN_DIR (run directory: config, metrics, adapter checkpoints with
# their PEFT and merged HF exports). A rerun resumes from the newest checkpoint.
set -euo pipefail

MODEL_PATH=${MODEL_PATH:-/shared/models/Qwen2.5-32B}
TRAIN_FILE=${TRAIN_FILE:-/shared/data/dapo-math-17k.parquet}
MRL_RUN_DIR=${MRL_RUN_DIR:-/shared/runs/dapo_lora_32b}

CMD=(python -m megatron_rl train examples/dapo_lora_32b.yaml
     model.preset=null "model.hf_path=${MODEL_PATH}" "data.path=${TRAIN_FILE}"
     "trainer.output_dir=${MRL_RUN_DIR}" "$@")

if [[ "${MRL_DRY_RUN:-0}" == "1" ]]; then
  printf '%q ' "${CMD[@]}"; echo
  exit 0
fi
exec "${CMD[@]}"
