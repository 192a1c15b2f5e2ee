#!/bin/bash
# DAPO on Qwen2.5-32B on a SLURM cluster of 8-GPU (80 GB) nodes: a heterogeneous job of
#   group 0: the Megatron actor, TP8 x PP1 x DP8 = 64 ranks on 8 nodes, one srun task per GPU
#            (full recomputation; layout and per-GPU memory from `python -m megatron_rl plan
#            examples/dapo_32b.yaml`, see examples/dapo_32b.yaml and the README);
#   group 1: the SGLang fleet, 16 servers x TP4 on 8 nodes (one srun task per server), behind
#            one sglang-router on the fleet's first node.
#
#   mkdir -p logs && sbatch examples/dapo_32b.sh     # from the repository on shared storage
#   sbatch examples/dapo_32b.sh trainer.total_steps=50   # extra args: config overrides
# (SLURM does not create the directory of --output: without logs/ the job fails silently.)
#
# Recipe (the run config is examples/dapo_32b.yaml): the DAPO paper (Yu et al. 2025, "DAPO: An
# Open-Source LLM Reinforcement Learning System at Scale", arXiv:2503.14476) and verl's
# recipe/dapo/run_dapo_qwen2.5_32b.sh (github.com/volcengine/verl): Clip-Higher eps_low 0.2 /
# eps_high 0.28, token-level loss (token-mean over the mini-batch), dynamic sampling (groups
# with all-equal accuracy dropped, generation batch 3 x 512 prompts, <= 10 rounds), overlong
# reward shaping with a 4096-token buffer and max response 20480 (prompts <= 2048), AdamW lr 1e-6
# (10 warm-up steps as in verl; the paper says 20), weight decay 0.1, grad clip 1.0, no KL
# term, 512 prompts x 16 responses per step, mini-batch 32 prompts = 16 optimizer steps per
# step, temperature 1.0, top-p 1.0, checkpoints and validation every 5 steps.
# Where ours differs:
#   - placement: verl colocates an FSDP actor (Ulysses SP8, parameter + optimizer offload) with
#     vLLM TP4 on the same 16 nodes; here the same 128 GPUs are split into 64 actor GPUs
#     (Megatron TP8, distributed optimizer, no offload) and 64 rollout GPUs (SGLang TP4), and
#     the weights are pushed from the actor to the fleet after every step;
#   - batching: fixed micro-batches of one sequence per DP rank instead of verl's dynamic token
#     batching (ppo_max_token_len_per_gpu);
#   - validation: 1 sample per prompt at temperature 1.0 (the paper reports avg@32 on AIME 2024
#     with top-p 0.7);
#   - the SGLang engine options (rollout.engine=sglang and the servers' URLs, ROLLOUT_ARGS
#     below) belong to the SGLang-fleet issue; set MRL_ROLLOUT_ARGS if its option names differ.
#
# Shared storage (every node sees it): the repository (submit from it), MRL_SHARED (/shared):
# the model (MODEL_PATH), the data (TRAIN_FILE), the run directory (MRL_RUN_DIR: config,
# metrics, checkpoints, per-server logs). The job's own log: logs/ under the submit directory.
# Automatic resume: --requeue plus trainer.resume=true; a requeued (preempted, node failure,
# `scontrol requeue`) or resubmitted job continues from the newest checkpoint in MRL_RUN_DIR.
# MRL_DRY_RUN=1 prints the srun commands instead of running them (no SLURM needed).
#
#SBATCH --job-name=dapo-32b
#SBATCH --time=48:00:00
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=logs/%x-%j.out
#SBATCH --nodes=8
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=12
# --mem=0: all of the node; a checkpoint load needs ~61 GiB host RAM per rank (`plan`).
#SBATCH --mem=0
#SBATCH --exclusive
#SBATCH hetjob
#SBATCH --nodes=8
#SBATCH --ntasks-per-node=2
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=48
#SBATCH --mem=0
#SBATCH --exclusive
set -euo pipefail

REPO=${MRL_REPO:-${SLURM_SUBMIT_DIR:-$PWD}}
SHARED=${MRL_SHARED:-/shared}
RUN_DIR=${MRL_RUN_DIR:-$SHARED/runs/dapo_32b}
CONFIG=${MRL_CONFIG:-$REPO/examples/dapo_32b.yaml}
MODEL_PATH=${MODEL_PATH:-$SHARED/models/Qwen2.5-32B}
TRAIN_FILE=${TRAIN_FILE:-$SHARED/data/dapo-math-17k.parquet}
PYTHON=${MRL_PYTHON:-python}
DRY=${MRL_DRY_RUN:-0}

GPUS_PER_NODE=8
ACTOR_TP=8 ACTOR_PP=1 ACTOR_DP=8          # examples/dapo_32b.yaml: parallel
SERVER_TP=4                                # GPUs per SGLang server
SERVERS_PER_NODE=$(( GPUS_PER_NODE / SERVER_TP ))
SGLANG_PORT=${SGLANG_PORT:-30000}          # server i on a node listens on SGLANG_PORT + i
ROUTER_PORT=${ROUTER_PORT:-30080}
MAX_LEN=$(( 2048 + 20480 ))                # prompt + response tokens

# ---- the shared body: fleet, router and actor (examples/slurm_hetjob.sh) ----------------------
# shellcheck source=slurm_hetjob.sh
source "$REPO/examples/slurm_hetjob.sh"
