#!/usr/bin/env bash
# ncu of the decode kernels (scripts/profile_kernels.py --decode) on the lent GPU: one process per case, the
# case's third launch profiled; details to $OUT/ncu_<case>.txt. Usage: scripts/ncu_decode.sh N,K,M,TAG ...
set -uo pipefail
OUT=${OUT:-ncu-out}; mkdir -p "$OUT"
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
[[ -n $NCU ]] || { echo "no ncu on this machine"; exit 2; }
for case in "$@"; do
  name=${case//,/_}; f="$OUT/ncu_${name//\//_}.txt"  # TAG/P1 (a timing probe): no slash in the file name
  "$NCU" --clock-control none -k 'regex:(xshared_kernel|decode_kernel|mma_swap_kernel)' -s 2 -c 1 \
    --section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats \
    --section SchedulerStats --section InstructionStats --section MemoryWorkloadAnalysis --section SourceCounters \
    --metrics l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum,smsp__inst_executed.sum,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio,smsp__average_warps_issue_stalled_lg_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_mio_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_wait_per_issue_active.ratio,smsp__average_warps_issue_stalled_not_selected_per_issue_active.ratio,smsp__average_warps_issue_stalled_selected_per_issue_active.ratio,smsp__average_warps_issue_stalled_tex_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_dispatch_stall_per_issue_active.ratio,smsp__average_warps_issue_stalled_membar_per_issue_active.ratio,smsp__average_warps_issue_stalled_drain_per_issue_active.ratio,smsp__average_warps_issue_stalled_no_instruction_per_issue_active.ratio \
    python3 scripts/profile_kernels.py --decode "$case" > "$f" 2>&1
  echo "== $case: exit $?"
  grep -E "Duration|DRAM Throughput|L1/TEX Cache Throughput|L2 Cache Throughput|L2 Hit Rate|Registers Per|Achieved Occupancy|No Eligible|Warp Cycles Per Issued|bank_conflicts|inst_executed.sum|hmma_cycles|stalled" "$f" | head -40
done
