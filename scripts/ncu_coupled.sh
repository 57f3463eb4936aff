#!/usr/bin/env bash
# EXPERIMENT (session 28): ncu of scripts/probe_coupled.py --ncu VARIANT at 12288->6144 M = 16, the third launch.
set -uo pipefail
OUT=${OUT:-ncu-out}; mkdir -p "$OUT"
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
[[ -n $NCU ]] || { echo "no ncu on this machine"; exit 2; }
for v in "$@"; do
  f="$OUT/ncu_coupled_${ONLY:-12288}_$v.txt"
  "$NCU" --clock-control none -k 'regex:(xshared_kernel|coupled_kernel)' -s 2 -c 1 \
    --section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats \
    --section SchedulerStats --section InstructionStats --section MemoryWorkloadAnalysis \
    --metrics smsp__inst_executed.sum,smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio,smsp__average_warps_issue_stalled_wait_per_issue_active.ratio,smsp__average_warps_issue_stalled_not_selected_per_issue_active.ratio,smsp__average_warps_issue_stalled_selected_per_issue_active.ratio,smsp__average_warps_issue_stalled_no_instruction_per_issue_active.ratio,smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_dispatch_stall_per_issue_active.ratio,smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_mio_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_membar_per_issue_active.ratio,smsp__average_warps_issue_stalled_lg_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_sleeping_per_issue_active.ratio,smsp__average_warps_issue_stalled_branch_resolving_per_issue_active.ratio,smsp__average_warps_issue_stalled_misc_per_issue_active.ratio,sm__cycles_active.avg,gpc__cycles_elapsed.max \
    python3 scripts/probe_coupled.py --out "$OUT" --only "${ONLY:-12288}" --m 16 --ncu "$v" > "$f" 2>&1
  echo "== $v: exit $?"
  grep -E "Duration|DRAM Throughput|Registers Per|Block Size|Achieved Occupancy|Theoretical Occupancy|Issued Warp|Eligible|Warp Cycles Per Issued|inst_executed.sum|stalled|cycles_active.avg|elapsed.max|Waves" "$f" | head -40
done
