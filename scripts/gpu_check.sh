#!/usr/bin/env bash
# One command on a GPU machine: the CUDA checks of the Triton backend, then the timing table (benchmarks/gpu.py).
# Needs only python3 with torch (CUDA) and triton; nothing is installed: the repository runs from src/.
#   bash scripts/gpu_check.sh            # results in $OUT if set (the device tool's folder), else benchmarks/results
#   LENGTHS="2048 8192" bash scripts/gpu_check.sh   # fewer lengths
#   TUNE=1 bash scripts/gpu_check.sh     # also every kernel under every launch configuration (+2 minutes)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="src:tests${PYTHONPATH:+:$PYTHONPATH}"
export TRITON_DEFAULT_FP_FUSION=1  # silences a deprecation notice of newer triton; the default of 3.6
results="${OUT:-benchmarks/results}"
mkdir -p "$results"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | tee "$results/gpu.txt"
python3 -c "import sys, torch, triton; print(sys.version.split()[0], 'torch', torch.__version__, 'cuda', \
torch.version.cuda, 'triton', triton.__version__, torch.cuda.get_device_name())" | tee -a "$results/gpu.txt"

# 1. correctness on the device (plain runner: the image may have no pytest); ~1 minute with compilation for the plain
#    kernels, plus the delta rule's (three dtypes, forward, adjoint and step kernels) and KDA's (bf16 and fp32; last,
#    check_kda_rule and check_kda_long_and_decoding: est. 30 s) — neither yet timed on a GPU
timeout 210 python3 tests/gpu_checks.py 2>&1 | tee "$results/gpu_checks.txt"
checks=${PIPESTATUS[0]}

# 2. timing: B=4, H=32, D=128, bf16, N = 2k … 64k; the decoding step; the delta rule at B=4, H=8, D=64, N = 8k, then
#    KDA beside it (each section's rows saved as they come); table on stdout, CSV beside it
# shellcheck disable=SC2086
timeout 240 python3 benchmarks/gpu.py --csv "$results/gpu_benchmark.csv" ${LENGTHS:+--lengths $LENGTHS} 2>&1 \
    | tee "$results/gpu_benchmark.txt"
bench=${PIPESTATUS[0]}

# 3. (TUNE=1) each kernel alone under the launch configurations worth trying, and the backward's host-side work
if [ "${TUNE:-0}" = 1 ]; then
    timeout 150 python3 benchmarks/gpu_tune.py --csv "$results/gpu_tune.csv" 2>&1 | tee "$results/gpu_tune.txt"
fi
echo "checks exit $checks, benchmark exit $bench; results in $results"
exit $(( checks != 0 || bench != 0 ))
