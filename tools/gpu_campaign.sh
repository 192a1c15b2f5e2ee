#!/usr/bin/env bash
# The GPU campaign in one command (docs/gpu.md "The GPU campaign"): every GPU path, in the order
# that matters most when device time is short, each phase under its own time limit, all inside
# one overall budget. Run on the GPU machine from the project root, through the wheel carrier:
#
#   bash .gpucarry/on_device.sh bash tools/gpu_campaign.sh
#
# Every phase writes its log to $OUT/campaign/<phase>.log (OUT defaults to ./campaign_out);
# benchmark tools that write JSON put it in $OUT/campaign/. The last lines are a summary:
# one `campaign: <phase> rc=<exit status> s=<seconds>` line per phase (rc 124: out of time).
#
# CAMPAIGN_BUDGET_S: seconds for all phases together (default 540, so one 600 s device call
# leaves time to copy results back). CAMPAIGN_PHASES: a space-separated subset, in order.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/campaign_out}
LOG=$OUT/campaign
mkdir -p "$LOG"
BUDGET=${CAMPAIGN_BUDGET_S:-540}
PHASES=${CAMPAIGN_PHASES:-"gpu_tier weight_sync actor_mfu fused_head ref_offload ckpt lora moe"}
START=$(date +%s)
SUMMARY=()

# phase NAME LIMIT_S CMD...: run CMD for at most LIMIT_S seconds, or what is left of the budget.
phase() {
  local name=$1 limit=$2
  shift 2
  case " $PHASES " in *" $name "*) ;; *) return 0 ;; esac
  local left=$(( BUDGET - ($(date +%s) - START) ))
  if (( left < 20 )); then
    SUMMARY+=("campaign: $name rc=skipped s=0 (budget spent)")
    return 0
  fi
  (( limit > left )) && limit=$left
  echo "== $name (limit ${limit}s): $*"
  local t0=$(date +%s)
  timeout --signal=TERM --kill-after=10 "$limit" "$@" > "$LOG/$name.log" 2>&1
  local rc=$?
  local dt=$(( $(date +%s) - t0 ))
  tail -n 15 "$LOG/$name.log"
  SUMMARY+=("campaign: $name rc=$rc s=$dt")
}

python3 -c "import torch; print('device', torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu (no CUDA)')" \
  | tee "$LOG/device.txt"
nvidia-smi > "$LOG/nvidia-smi.txt" 2>&1 || true

# 1. the gpu-marked tier (all must pass, none skipped for want of a GPU)
phase gpu_tier 240 python3 -m pytest -q -m gpu -rfEs --junitxml "$LOG/gpu_tier.xml"
# 6. weight sync: CUDA IPC and NCCL, 0.5B shape, vs device-to-device copy
phase weight_sync 90 python3 tools/bench_weight_sync.py --models 0.5b \
  --strategies from_tensor,from_distributed --syncs 2 --skip-7b
# 3. actor throughput and MFU, 0.5B then 1.5B, beside the transformers anchor
phase actor_mfu 150 python3 tools/bench_actor_step.py --mfu --presets qwen2.5-0.5b qwen2.5-1.5b
# 4. fused LM head at TP1 / TP4 vocab shards
phase fused_head 90 python3 tools/bench_fused_head.py --tp 1,4 --repeats 3
# 7. reference offload, bf16
phase ref_offload 45 python3 tools/bench_ref_offload.py --preset qwen2.5-0.5b --precision bf16
# issue 42: async checkpoint stall with pinned host buffers
phase ckpt 45 python3 tools/bench_ckpt.py
# LoRA at 0.5B in bf16
phase lora 60 python3 tools/bench_lora.py --preset qwen2.5-0.5b --precision bf16
# 8. MoE experts and routing replay
phase moe 60 python3 tools/bench_moe.py

printf '%s\n' "${SUMMARY[@]}" | tee "$LOG/summary.txt"
