#!/usr/bin/env bash
# One device-machine session's GPU figures for issue 61, run from the project root on the GPU host, every step
# bounded, its log and run directories under $OUT (a session has 15 minutes of device time: this takes about 6).
#
# The bundle (`../shared/gpu-bundle/c1`, copied to the ignored .gpubundle/c1) and the tree exceed the 64 MiB a call
# may carry, so its cubin stream travels alone first (the held machine keeps /tmp), and this script at once after:
#   call 1, carry [".gpubundle/part1"]:  mkdir -p /tmp/stage && cp .gpubundle/part1/cubin.xz.000 /tmp/stage/
#   call 2, carry [".gpubundle/c1"]:     bash benchmarks/gpu_session.sh
# (here, once: mkdir -p .gpubundle/part1 && mv .gpubundle/c1/data/cubin.xz.000 .gpubundle/part1/, and leave
# c1/wheels' loadgen and c1/optional out). STEPS picks steps: STEPS="probe train" bash benchmarks/gpu_session.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
O=${OUT:-/tmp/out}
mkdir -p "$O/runs"
exec > >(tee -a "$O/log") 2>&1
quiet="compat|FBGEMM|\[0m|\[33m|WARNING:root|^\s*$|^\s*cannot determine|│ t_"
# SIGABRT at the bound: faulthandler prints where each process was
step() { local t=$1; shift; echo "=== [$(date +%T)] $*"; timeout -s ABRT -k 5 "$t" "$@"; echo "=== rc=$? [$(date +%T)]"; }
nvidia-smi --query-gpu=name,memory.total,driver_version,power.limit,clocks.max.sm --format=csv
cp -n /tmp/stage/cubin.xz.000 .gpubundle/c1/data/ 2>/dev/null
[ -f /tmp/site/.assembled ] || { step 60 bash .gpubundle/c1/assemble.sh && touch /tmp/site/.assembled; }
export PYTHONPATH=/tmp/site:$PWD DLRM_LAB_MACHINE_DIR="$O/runs/machines"
lab="python3 -m dlrm_lab"
for s in ${STEPS:-smoke probe tests tbe train serve}; do
  case $s in
  smoke) step 60 python3 .gpubundle/c1/tools/gpu_smoke.py 2>&1 | grep -v -E "$quiet" | tail -12 ;;
  # first: a run that finds no profile probes in full before its first step (minutes on a GPU host)
  probe) step 60 $lab machine probe --quick --device cuda 2>&1 | grep -v -E "$quiet" | tail -12 ;;
  tests) step 60 python3 -m pytest -q -m gpu -p no:cacheprovider tests 2>&1 | tail -4 ;;
  tbe) step 60 python3 benchmarks/gpu_tbe.py --out "$O" ;;
  train)
    step 90 $lab train --preset dcnv2 --table-scale 0.25 --device cuda --steps 200 --batch-size 6912 --eval-every 200 \
      --metrics-dir "$O/runs" --no-progress 2>&1 | grep -v -E "$quiet" | tail -22
    step 90 $lab train --preset dcnv2 --table-scale 0.25 --device cuda --steps 200 --batch-size 6912 --eval-every 200 \
      --data-workers 0 --metrics-dir "$O/runs" --no-progress 2>&1 | grep -v -E "$quiet" | tail -22
    step 60 $lab train --preset kaggle --max-rows 1000000 --device cuda --steps 400 --batch-size 16384 \
      --eval-every 200 --metrics-dir "$O/runs" --no-progress 2>&1 | grep -v -E "$quiet" | tail -22 ;;
  serve)
    for build in fused eager; do
      step 60 $lab infer run --preset kaggle --max-rows 1000000 --device cuda --build $build --query-size mlperf \
        --qps auto --sla-ms auto --duration 6 --metrics-dir "$O/runs" --no-progress 2>&1 | grep -v -E "$quiet" | tail -8
    done ;;
  esac
done
(cd "$O" && tar czf runs.tgz runs && rm -rf runs)
