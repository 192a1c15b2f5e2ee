#!/bin/bash
# DAPO on Qwen3-8B with 32k-token responses, context parallel, on a SLURM cluster of 8-GPU
# (80 GB) nodes: a heterogeneous job of
#   group 0: the Megatron actor, TP4 x PP1 x CP2 x DP2 = 16 ranks on 2 nodes, one srun task per
#            GPU (megatron orders ranks TP, then CP: each TP4 x CP2 block is one node, so the
#            CP K/V exchange stays on NVLink; layout and per-GPU memory from
#            `python -m megatron_rl plan examples/dapo_qwen3_8b_32k.yaml`: 55.2 GiB of 80);
#   group 1: the SGLang fleet, 4 servers x TP4 on 2 nodes (one srun task per server), behind
#            one sglang-router on the fleet's first node.
#
#   mkdir -p logs && sbatch examples/dapo_qwen3_8b_32k.sh   # from the repository on shared storage
#   sbatch examples/dapo_qwen3_8b_32k.sh trainer.total_steps=50   # extra args: config overrides
# (SLURM does not create the directory of --output: without logs/ the job fails silently.)
#
# The run config is examples/dapo_qwen3_8b_32k.yaml (its comments explain the layout and the
# 32768-token cap: Qwen3-8B's native context is 40960 positions).
#
# Shared storage (every node sees it): the repository (submit from it), MRL_SHARED (/shared):
# the model (MODEL_PATH), the data (TRAIN_FILE), the run directory (MRL_RUN_DIR: config,
# metrics, checkpoints, per-server logs). The job's own log: logs/ under the submit directory.
# Automatic resume: --requeue plus trainer.resume=true; a requeued (preempted, node failure,
# `scontrol requeue`) or resubmitted job continues from the newest checkpoint in MRL_RUN_DIR.
# MRL_DRY_RUN=1 prints the srun commands instead of running them (no SLURM needed).
#
#SBATCH --job-name=dapo-qwen3-8b-32k
#SBATCH --time=24:00:00
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=logs/%x-%j.out
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=12
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
RUN_DIR=${MRL_RUN_DIR:-$SHARED/runs/dapo_qwen3_8b_32k}
CONFIG=${MRL_CONFIG:-$REPO/examples/dapo_qwen3_8b_32k.yaml}
MODEL_PATH=${MODEL_PATH:-$SHARED/models/Qwen3-8B}
TRAIN_FILE=${TRAIN_FILE:-$SHARED/data/dapo-math-17k.parquet}
PYTHON=${MRL_PYTHON:-python}
DRY=${MRL_DRY_RUN:-0}

GPUS_PER_NODE=8
ACTOR_TP=4 ACTOR_PP=1 ACTOR_CP=2 ACTOR_DP=2   # examples/dapo_qwen3_8b_32k.yaml: parallel
SERVER_TP=4                                # GPUs per SGLang server
SERVERS_PER_NODE=$(( GPUS_PER_NODE / SERVER_TP ))
SGLANG_PORT=${SGLANG_PORT:-30000}          # server i on a node listens on SGLANG_PORT + i
ROUTER_PORT=${ROUTER_PORT:-30080}
MAX_LEN=$(( 2048 + 32768 ))                # prompt + response tokens

# ---- the shared body: fleet, router and actor (examples/slurm_hetjob.sh) ----------------------
# shellcheck source=slurm_hetjob.sh
source "$REPO/examples/slurm_hetjob.sh"
