#!/bin/bash
# Tiny DAPO under SLURM on CPU: the mechanics of examples/dapo_32b.sh at toy scale.
# One srun task per rank (gloo on CPU), MASTER_ADDR/MASTER_PORT derived from SLURM by the
# program (megatron_rl/parallel/launch.py), checkpoints every MRL_SAVE_FREQ steps, and a
# requeued job (`scontrol requeue`, preemption, node failure) resumes from its last checkpoint;
# a step that fails (a rank dies) is restarted inside the allocation (trainer.max_restarts).
#
#   bash examples/tiny_slurm.sh [--sbatch-option ...] [key=value ...]
#       submits itself with the largest layout the partition's biggest node fits (one CPU per
#       task): 4 tasks (TP2 x PP2) on >= 4 CPUs, 2 (TP2) on 2-3 CPUs, 1 on 1 CPU; or refuses,
#       saying why, when MRL_NTASKS / MRL_LAYOUT ask for more CPUs than any node has.
#       Arguments starting with "-" go to sbatch (e.g. --wait, --output=x.out), the others are
#       key=value overrides of the config.
#   sbatch examples/tiny_slurm.sh [key=value ...]          # 2 tasks: TP2 (any node >= 2 CPUs)
#   sbatch --ntasks=4 examples/tiny_slurm.sh               # 4 tasks: TP2 x PP2
# Environment (all optional):
#   MRL_RUN_DIR   run directory: config, metrics, checkpoints (default $SLURM_SUBMIT_DIR/runs/
#                 tiny_slurm); put it on storage every node sees
#   MRL_CONFIG    config file (default examples/tiny_dapo.yaml)
#   MRL_STEPS     RL steps (default 10), MRL_SAVE_FREQ checkpoint interval (default 1)
#   MRL_LAYOUT    "TP PP DP" (default from the task count: 4 -> 2 2 1, 2 -> 2 1 1, n -> 1 1 n)
#   MRL_NTASKS    tasks to submit with (bash mode; default: what the node fits, see above)
#   MRL_PARTITION partition to submit to and read node CPUs from (bash mode; default: sbatch's)
#   MRL_NODE_CPUS CPUs per node instead of asking sinfo (bash mode)
#   MRL_PYTHON    interpreter (default python)
#   MRL_MAX_RESTARTS  in-job restarts of a failed srun step (default: trainer.max_restarts)
#   MRL_DRY_RUN=1 print the sbatch (bash mode) or srun (in the job) command instead of running it
#SBATCH --job-name=mrl-tiny
#SBATCH --nodes=1
#SBATCH --ntasks=2
#SBATCH --cpus-per-task=1
#SBATCH --time=00:30:00
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=slurm-%x-%j.out
set -euo pipefail

# "TP PP DP" for N tasks (MRL_LAYOUT wins).
layout_for() {
  if [[ -n ${MRL_LAYOUT:-} ]]; then echo "$MRL_LAYOUT"; return; fi
  case $1 in
    4) echo "2 2 1" ;;
    2) echo "2 1 1" ;;
    *) echo "1 1 $1" ;;
  esac
}

# The task count for a node of $1 CPUs: MRL_NTASKS, else the product of MRL_LAYOUT, else the
# largest of 4, 2, 1 that fits. Exit 2 naming why when it needs more CPUs than the node has.
tasks_for_cpus() {
  local cpus=$1 want
  if [[ -n ${MRL_NTASKS:-} ]]; then
    want=$MRL_NTASKS
  elif [[ -n ${MRL_LAYOUT:-} ]]; then
    local tp pp dp
    read -r tp pp dp <<<"$MRL_LAYOUT"
    want=$(( tp * pp * dp ))
  else
    for want in 4 2 1; do (( want <= cpus )) && break; done
  fi
  if (( want > cpus )); then
    echo "tiny_slurm: $want task(s) need a node with >= $want CPUs (one per task) but the" \
         "largest node${MRL_PARTITION:+ of partition $MRL_PARTITION} has $cpus; SLURM would keep" \
         "the job pending (reason PartitionConfig). Use MRL_NTASKS=<n <= $cpus> or a bigger" \
         "partition." >&2
    exit 2
  fi
  echo "$want"
}

# CPUs of the biggest responding node (MRL_NODE_CPUS wins).
node_cpus() {
  if [[ -n ${MRL_NODE_CPUS:-} ]]; then echo "$MRL_NODE_CPUS"; return; fi
  local out
  if ! out=$(sinfo -h -N -r ${MRL_PARTITION:+--partition="$MRL_PARTITION"} -o %c 2>&1); then
    echo "tiny_slurm: cannot read the nodes' CPUs (sinfo: $out); set MRL_NODE_CPUS or submit" \
         "with sbatch --ntasks=N examples/tiny_slurm.sh" >&2
    exit 2
  fi
  out=$(tr -d '+' <<<"$out" | sort -n | tail -1)
  if [[ -z $out ]]; then
    echo "tiny_slurm: sinfo lists no responding node${MRL_PARTITION:+ in partition" \
         "$MRL_PARTITION}" >&2
    exit 2
  fi
  echo "$out"
}

if [[ -z ${SLURM_JOB_ID:-} ]]; then  # bash mode: submit this script with a layout that fits
  sbatch_opts=() overrides=()
  for a in "$@"; do
    if [[ $a == -* ]]; then sbatch_opts+=("$a"); else overrides+=("$a"); fi
  done
  CPUS=$(node_cpus)
  NTASKS=$(tasks_for_cpus "$CPUS")
  read -r TP PP DP <<<"$(layout_for "$NTASKS")"
  cmd=(sbatch --ntasks="$NTASKS" ${MRL_PARTITION:+--partition="$MRL_PARTITION"}
       "${sbatch_opts[@]}" "$0" "${overrides[@]}")
  echo "[slurm] node CPUs $CPUS: $NTASKS task(s), TP$TP x PP$PP x DP$DP" >&2
  if [[ -n ${MRL_DRY_RUN:-} ]]; then
    printf '+'; printf ' %q' "${cmd[@]}"; printf '\n'
    exit 0
  fi
  exec "${cmd[@]}"
fi

REPO=${SLURM_SUBMIT_DIR:-$PWD}
RUN_DIR=${MRL_RUN_DIR:-$REPO/runs/tiny_slurm}
CONFIG=${MRL_CONFIG:-$REPO/examples/tiny_dapo.yaml}
PYTHON=${MRL_PYTHON:-python}
NTASKS=${SLURM_NTASKS:-2}
read -r TP PP DP <<<"$(layout_for "$NTASKS")"
echo "[slurm] job ${SLURM_JOB_ID:-?} attempt $(( ${SLURM_RESTART_COUNT:-0} + 1 )) on" \
     "${SLURM_JOB_NODELIST:-?}: $NTASKS task(s), TP$TP x PP$PP x DP$DP, run dir $RUN_DIR"

# Every task runs one rank: `python -m megatron_rl train` reads SLURM_PROCID / SLURM_NTASKS /
# SLURM_STEP_NODELIST itself. --kill-on-bad-exit: one failed rank ends the step (no hang).
cmd=(srun --kill-on-bad-exit=1 --ntasks="$NTASKS"
     "$PYTHON" -m megatron_rl train "$CONFIG"
     parallel.tp="$TP" parallel.pp="$PP" parallel.dp="$DP"
     trainer.total_steps="${MRL_STEPS:-10}" trainer.save_freq="${MRL_SAVE_FREQ:-1}"
     trainer.resume=true output_dir="$RUN_DIR" "$@")
if [[ -n ${MRL_DRY_RUN:-} ]]; then
  printf '+'; printf ' %q' "${cmd[@]}"; printf '\n'
  exit 0
fi
mkdir -p "$RUN_DIR"
# In-job restart: a failed step (a rank killed, a gloo timeout) is run again inside this
# allocation from the newest checkpoint, up to trainer.max_restarts times (read from the config;
# MRL_MAX_RESTARTS overrides), with trainer.restart_backoff_s between tries.
"$PYTHON" -m megatron_rl.cli.restart ${MRL_MAX_RESTARTS:+--max-restarts="$MRL_MAX_RESTARTS"} \
  -- "${cmd[@]}"
echo "[slurm] job ${SLURM_JOB_ID:-?} finished"
