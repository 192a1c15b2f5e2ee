# Shared body of the heterogeneous-job recipes (examples/dapo_32b.sh, examples/dapo_qwen3_30b_a3b.sh),
# sourced by them after they set: REPO SHARED RUN_DIR CONFIG MODEL_PATH TRAIN_FILE PYTHON DRY
# GPUS_PER_NODE ACTOR_TP ACTOR_PP ACTOR_DP [ACTOR_EP] [ACTOR_CP] SERVER_TP SERVERS_PER_NODE SGLANG_PORT
# ROUTER_PORT MAX_LEN. Group 1 gets the SGLang fleet and its router, group 0 the actor (one srun
# task per GPU); the recipe's own arguments ("$@") are config overrides of the actor's `train`.
# Not a job script of its own.
ACTOR_EP=${ACTOR_EP:-1}
ACTOR_CP=${ACTOR_CP:-1}

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
LAYOUT="TP$ACTOR_TP x PP$ACTOR_PP"
if (( ACTOR_CP > 1 )); then LAYOUT+=" x CP$ACTOR_CP"; fi
LAYOUT+=" x DP$ACTOR_DP"
if (( WORLD != ACTOR_TP * ACTOR_PP * ACTOR_CP * ACTOR_DP )); then
  echo "[slurm] actor group has ${#ACTOR_HOSTS[@]} nodes x $GPUS_PER_NODE GPUs = $WORLD ranks but" \
       "$LAYOUT needs $(( ACTOR_TP * ACTOR_PP * ACTOR_CP * ACTOR_DP ))" >&2
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

wait_healthy() {  # every URL answers /health within 30 minutes (a large model loads slowly)
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
EP_ARGS=()
(( ACTOR_EP > 1 )) && EP_ARGS=(parallel.ep="$ACTOR_EP")
(( ACTOR_CP > 1 )) && EP_ARGS+=(parallel.cp="$ACTOR_CP")
rc=0
run srun --het-group=0 --ntasks-per-node="$GPUS_PER_NODE" --kill-on-bad-exit=1 \
  --cpus-per-task=12 "$PYTHON" -m megatron_rl train "$CONFIG" \
  model.preset=null model.hf_path="$MODEL_PATH" data.path="$TRAIN_FILE" \
  parallel.tp="$ACTOR_TP" parallel.pp="$ACTOR_PP" parallel.dp="$ACTOR_DP" "${EP_ARGS[@]}" \
  output_dir="$RUN_DIR" trainer.resume=true "${ROLLOUT_ARGS[@]}" "$@" || rc=$?
echo "[slurm] job ${SLURM_JOB_ID:-?} actor exited with $rc"
exit "$rc"
