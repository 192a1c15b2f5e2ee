#!/bin/bash
# DAPO on Qwen3-30B-A3B (mixture of experts, 128 experts, top-8) on a SLURM cluster of 8-GPU (80 GB)
# nodes: a heterogeneous job of
#   group 0: the Megatron actor, TP1 x PP1 x DP16 x EP8 = 16 ranks on 2 nodes, one srun task per
#            GPU (each node's 8 ranks form one expert-parallel group, so the token all-to-all
#            stays on NVLink; expert-DP 2; full recomputation; layout and per-GPU memory from
#            `python -m megatron_rl plan examples/dapo_qwen3_30b_a3b.yaml`: 62.2 GiB of 80);
#   group 1: the SGLang fleet, 4 servers x TP4 on 2 nodes (one srun task per server), behind
#            one sglang-router on the fleet's first node.
#
#   mkdir -p logs && sbatch examples/dapo_qwen3_30b_a3b.sh   # from the repository on shared storage
#   sbatch examples/dapo_qwen3_30b_a3b.sh trainer.total_steps=50   # extra args: config overrides
# (SLURM does not create the directory of --output: without logs/ the job fails silently.)
#
# Recipe (the run config is examples/dapo_qwen3_30b_a3b.yaml, which cites it in full): slime's
# scripts/run-qwen3-30B-A3B.sh (github.com/THUDM/slime): Megatron TP4 + sequence parallel, PP1,
# CP1, EP8, expert TP1, full recomputation; 8 prompts x 4 samples per rollout, global batch 32,
# max response 8192, temperature 0.8; lr 1e-6 constant, weight decay 0.1, Adam betas 0.9 / 0.98;
# eps-clip 0.2 / 0.28, no KL, TIS; colocated with SGLang (8 GPUs per engine) on one node with
# Megatron's CPU Adam. Where ours differs:
#   - placement: 16 actor GPUs (TP1 x DP16, EP8 per node; distributed optimizer, no CPU
#     offload; slime's TP4 x EP8 also fits: TP 4 and DP 4 below and in the YAML) and 16 rollout
#     GPUs (SGLang TP4), the weights pushed from the actor to the fleet after every step;
#   - batch: 64 prompts x 8 samples = 512 responses per step, 4 optimizer steps, DAPO dynamic
#     sampling and overlong shaping; fixed micro-batches of one sequence instead of dynamic
#     token batches (--max-tokens-per-gpu 20480);
#   - token-level TIS min(rho, 2) instead of the geometric level.
#
# Shared storage (every node sees it): the repository (submit from it), MRL_SHARED (/shared):
# the model (MODEL_PATH), the data (TRAIN_FILE), the run directory (MRL_RUN_DIR: config,
# metrics, checkpoints, per-server logs). The job's own log: logs/ under the submit directory.
# Automatic resume: --requeue plus trainer.resume=true; a requeued (preempted, node failure,
# `scontrol requeue`) or resubmitted job continues from the newest checkpoint in MRL_RUN_DIR.
# MRL_DRY_RUN=1 prints the srun commands instead of running them (no SLURM needed).
#
#SBATCH --job-name=dapo-qwen3-30b-a3b
#SBATCH --time=24:00:00
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=logs/%x-%j.out
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=12
# --mem=0: all of the node; a checkpoint load needs ~77 GiB host RAM per rank (`plan`).
#SBATCH --mem=0
#SBATCH --exclusive
#SBATCH hetjob
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=2
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=48
#SBATCH --mem=0
#SBATCH --exclusive
set -euo pipefail

REPO=${MRL_REPO:-${SLURM_SUBMIT_DIR:-$PWD}}
SHARED=${MRL_SHARED:-/shared}
RUN_DIR=${MRL_RUN_DIR:-$SHARED/runs/dapo_qwen3_30b_a3b}
CONFIG=${MRL_CONFIG:-$REPO/examples/dapo_qwen3_30b_a3b.yaml}
MODEL_PATH=${MODEL_PATH:-$SHARED/models/Qwen3-30B-A3B}
TRAIN_FILE=${TRAIN_FILE:-$SHARED/data/dapo-math-17k.parquet}
PYTHON=${MRL_PYTHON:-python}
DRY=${MRL_DRY_RUN:-0}

GPUS_PER_NODE=8
ACTOR_TP=1 ACTOR_PP=1 ACTOR_DP=16 ACTOR_EP=8   # examples/dapo_qwen3_30b_a3b.yaml: parallel
SERVER_TP=4                                # GPUs per SGLang server
SERVERS_PER_NODE=$(( GPUS_PER_NODE / SERVER_TP ))
SGLANG_PORT=${SGLANG_PORT:-30000}          # server i on a node listens on SGLANG_PORT + i
ROUTER_PORT=${ROUTER_PORT:-30080}
MAX_LEN=$(( 2048 + 8192 ))                 # prompt + response tokens

# ---- the shared body: fleet, router and actor (examples/slurm_hetjob.sh) ----------------------
# shellcheck source=slurm_hetjob.sh
source "$REPO/examples/slurm_hetjob.sh"
