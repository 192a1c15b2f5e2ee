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

PIDS=()
run() {  # run a command, or print it under MRL_DRY_RUN=1
  if [[ $DRY == 1 ]]; then echo "+ $*"; else "$@"; fi
}
run_bg() {  # the same, in the background (its pid in PIDS)
  if [[ $DRY == 1 ]]; then echo "+ $* &"; else "$@" & PIDS+=($!); fi
}
hosts() {  # host names of a SLURM node list, one per line
  scontrol show hostnames "$1" 2>/dev/null || "$PYTHON" -m megatron_rl.parallel.hostlist "$1"
}

NEED_HET="submit with sbatch: a heterogeneous job (actor group 0, fleet group 1)"
ACTOR_NODELIST=${SLURM_JOB_NODELIST_HET_GROUP_0:?$NEED_HET}
FLEET_NODELIST=${SLURM_JOB_NODELIST_HET_GROUP_1:?$NEED_HET}
mapfile -t ACTOR_HOSTS < <(hosts "$ACTOR_NODELIST")
mapfile -t FLEET_HOSTS < <(hosts "$FLEET_NODELIST")
WORLD=$(( ${#ACTOR_HOSTS[@]} * GPUS_PER_NODE ))
if (( WORLD != ACTOR_TP * ACTOR_PP * ACTOR_DP )); then
  echo "[slurm] actor group has ${#ACTOR_HOSTS[@]} nodes x $GPUS_PER_NODE GPUs = $WORLD ranks but" \
       "TP$ACTOR_TP x PP$ACTOR_PP x DP$ACTOR_DP needs $(( ACTOR_TP * ACTOR_PP * ACTOR_DP ))" >&2
  exit 2
fi
if (( GPUS_PER_NODE % ACTOR_EP )); then  # EP groups are consecutive ranks: keep each in one node
  echo "[slurm] EP$ACTOR_EP does not divide the $GPUS_PER_NODE GPUs of a node" >&2
  exit 2
fi

# NCCL: Megatron's TP overlap wants one CUDA connection; fail fast instead of hanging on a dead
# peer; keep NCCL off loopback/docker interfaces (site-specific: set NCCL_SOCKET_IFNAME and
# NCCL_IB_HCA to your fabric); the actor->fleet weight push is an NCCL group across both groups.
export CUDA_DEVICE_MAX_CONNECTIONS=1
export TORCH_NCCL_ASYNC_ERROR_HANDLING=1
export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-^lo,docker0}
export NCCL_IB_TIMEOUT=${NCCL_IB_TIMEOUT:-22}
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH}

mkdir -p "$RUN_DIR/logs"
echo "[slurm] job ${SLURM_JOB_ID:-?} attempt $(( ${SLURM_RESTART_COUNT:-0} + 1 )):" \
     "actor ${#ACTOR_HOSTS[@]} nodes ($ACTOR_NODELIST, MASTER_ADDR=${ACTOR_HOSTS[0]})," \
     "fleet ${#FLEET_HOSTS[@]} nodes ($FLEET_NODELIST), run dir $RUN_DIR"

# ---- rollout fleet: SERVERS_PER_NODE SGLang servers (TP4) per fleet node, then the router -----
URLS=()
for h in "${FLEET_HOSTS[@]}"; do
  for (( i = 0; i < SERVERS_PER_NODE; i++ )); do URLS+=("http://$h:$(( SGLANG_PORT + i ))"); done
done
ROUTER_URL="http://${FLEET_HOSTS[0]}:$ROUTER_PORT"
# shellcheck disable=SC2016  # expanded by each task's bash: its port from SLURM_LOCALID
SERVER_CMD='exec "$0" -m sglang.launch_server --model-path "$1" --tp-size "$2" --host 0.0.0.0'
SERVER_CMD+=' --port $(( $3 + SLURM_LOCALID )) --context-length "$4" --mem-fraction-static 0.85'
run_bg srun --het-group=1 --ntasks-per-node="$SERVERS_PER_NODE" --gpus-per-task="$SERVER_TP" \
  --cpus-per-task=48 --output="$RUN_DIR/logs/sglang-%j-%t.log" \
  bash -c "$SERVER_CMD" "$PYTHON" "$MODEL_PATH" "$SERVER_TP" "$SGLANG_PORT" "$MAX_LEN"
run_bg srun --het-group=1 --nodes=1 --ntasks=1 --overlap --gres=none \
  --output="$RUN_DIR/logs/router-%j.log" \
  "$PYTHON" -m sglang_router.launch_router --host 0.0.0.0 --port "$ROUTER_PORT" \
  --worker-urls "${URLS[@]}"
stop_fleet() { (( ${#PIDS[@]} )) && kill "${PIDS[@]}" 2>/dev/null; wait 2>/dev/null || true; }
trap stop_fleet EXIT

wait_healthy() {  # every URL answers /health within 30 minutes (the 30B load takes a while)
  [[ $DRY == 1 ]] && return 0
  local deadline=$(( SECONDS + 1800 )) url
  for url in "$@"; do
    until curl -sf -o /dev/null "$url/health"; do
      (( SECONDS < deadline )) || { echo "[slurm] $url not healthy after 30 min" >&2; return 1; }
      sleep 10
    done
  done
}
wait_healthy "${URLS[@]}" "$ROUTER_URL"

# ---- the actor: one srun task per GPU, every task runs its rank --------------------------------
# Each task sees all 8 GPUs of its node and picks LOCAL_RANK (NVLink P2P between the ranks stays
# possible); srun >= 22.05 does not inherit --cpus-per-task from sbatch, hence given again.
# torch.distributed rendezvous on the first actor host; the port is derived from the job id by
# the program (megatron_rl/parallel/launch.py), the same on every task.
export MASTER_ADDR=${ACTOR_HOSTS[0]}
URL_LIST=$(printf '"%s",' "${URLS[@]}")
if [[ -n ${MRL_ROLLOUT_ARGS:-} ]]; then
  read -r -a ROLLOUT_ARGS <<<"$MRL_ROLLOUT_ARGS"
else
  ROLLOUT_ARGS=(rollout.engine=sglang "rollout.sglang.servers=[${URL_LIST%,}]"
                "rollout.sglang.router_url=$ROUTER_URL" rollout.sglang.weight_sync=from_distributed)
fi
rc=0
run srun --het-group=0 --ntasks-per-node="$GPUS_PER_NODE" --kill-on-bad-exit=1 \
  --cpus-per-task=12 "$PYTHON" -m megatron_rl train "$CONFIG" \
  model.preset=null model.hf_path="$MODEL_PATH" data.path="$TRAIN_FILE" \
  parallel.tp="$ACTOR_TP" parallel.pp="$ACTOR_PP" parallel.dp="$ACTOR_DP" parallel.ep="$ACTOR_EP" \
  output_dir="$RUN_DIR" trainer.resume=true "${ROLLOUT_ARGS[@]}" "$@" || rc=$?
echo "[slurm] job ${SLURM_JOB_ID:-?} actor exited with $rc"
exit "$rc"
