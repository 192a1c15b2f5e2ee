#!/bin/bash
# Tiny DAPO under SLURM on CPU: the mechanics of examples/dapo_32b.sh at toy scale.
# One srun task per rank (gloo on CPU), MASTER_ADDR/MASTER_PORT derived from SLURM by the
# program (megatron_rl/parallel/launch.py), checkpoints every MRL_SAVE_FREQ steps, and a
# requeued job (`scontrol requeue`, preemption, node failure) resumes from its last checkpoint.
#
#   sbatch examples/tiny_slurm.sh                       # 4 tasks: TP2 x PP2 x DP1
#   sbatch --ntasks=2 examples/tiny_slurm.sh sft.steps=0   # 2 tasks: TP2 x PP1; extra args are
#                                                          # key=value overrides of the config
# Environment (all optional):
#   MRL_RUN_DIR   run directory: config, metrics, checkpoints (default $SLURM_SUBMIT_DIR/runs/
#                 tiny_slurm); put it on storage every node sees
#   MRL_CONFIG    config file (default examples/tiny_dapo.yaml)
#   MRL_STEPS     RL steps (default 10), MRL_SAVE_FREQ checkpoint interval (default 1)
#   MRL_LAYOUT    "TP PP DP" (default from the task count: 4 -> 2 2 1, 2 -> 2 1 1, n -> 1 1 n)
#   MRL_PYTHON    interpreter (default python)
#SBATCH --job-name=mrl-tiny
#SBATCH --nodes=1
#SBATCH --ntasks=4
#SBATCH --cpus-per-task=1
#SBATCH --time=00:30:00
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=slurm-%x-%j.out
set -euo pipefail

REPO=${SLURM_SUBMIT_DIR:-$PWD}
RUN_DIR=${MRL_RUN_DIR:-$REPO/runs/tiny_slurm}
CONFIG=${MRL_CONFIG:-$REPO/examples/tiny_dapo.yaml}
PYTHON=${MRL_PYTHON:-python}
NTASKS=${SLURM_NTASKS:-4}
if [[ -n ${MRL_LAYOUT:-} ]]; then
  read -r TP PP DP <<<"$MRL_LAYOUT"
else
  case $NTASKS in
    4) TP=2 PP=2 DP=1 ;;
    2) TP=2 PP=1 DP=1 ;;
    *) TP=1 PP=1 DP=$NTASKS ;;
  esac
fi
mkdir -p "$RUN_DIR"
echo "[slurm] job ${SLURM_JOB_ID:-?} attempt $(( ${SLURM_RESTART_COUNT:-0} + 1 )) on" \
     "${SLURM_JOB_NODELIST:-?}: $NTASKS task(s), TP$TP x PP$PP x DP$DP, run dir $RUN_DIR"

# Every task runs one rank: `python -m megatron_rl train` reads SLURM_PROCID / SLURM_NTASKS /
# SLURM_STEP_NODELIST itself. --kill-on-bad-exit: one failed rank ends the step (no hang).
srun --kill-on-bad-exit=1 --ntasks="$NTASKS" \
  "$PYTHON" -m megatron_rl train "$CONFIG" \
  parallel.tp="$TP" parallel.pp="$PP" parallel.dp="$DP" \
  trainer.total_steps="${MRL_STEPS:-10}" trainer.save_freq="${MRL_SAVE_FREQ:-1}" \
  trainer.resume=true output_dir="$RUN_DIR" "$@"
echo "[slurm] job ${SLURM_JOB_ID:-?} finished"
