#!/usr/bin/env bash
# Every check that needs a GPU, in one command that ends within DEADLINE_S seconds (default
# 560): for a GPU node lent for minutes. In order, each given what time is left:
#   1. the GPU tests of the step-time breakdown and the memory snapshot (tests/unit/test_gpu.py,
#      and the out-of-memory job of tests/e2e/test_gpu.py; about a minute)
#   2. `make bench-gpu` (bench/gpu.py): arms start while time is left for one more; a run cut
#      short keeps every finished arm
#   3. the other GPU tests (nccl, SyncBatchNorm, bf16 + compile, FSDP with offload), if time is
#      left
# Results in OUT (default .bench/gpu-checks): gpu.jsonl, gpu-table.md and each step's log.
# PYTHON (default python3) is the interpreter with torch; on a node that lacks the project's
# dependencies, install the wheels of bench/gpu_wheels.sh first (docs/benchmarks.md).
# BENCH_ARGS go to bench.gpu: `--device cpu --smoke` tries it all on a CPU, where the GPU tests
# skip (tests/e2e/test_bench_gpu.py).
#   bash bench/gpu_checks.sh [OUT] [DEADLINE_S]
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-.bench/gpu-checks}"
deadline="${2:-560}"
mkdir -p "$out"
left() { echo $((deadline - SECONDS)); }
python="${PYTHON:-python3}"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
{ nvidia-smi -L 2>&1; "$python" -c "import torch; print('torch', torch.__version__)"; } \
  | tee "$out/machine.txt"

failed=""
# The GPU tests run in the project's test harness (tests/conftest.py): without its packages
# they would all error at collection, so they are not started, and the run says so.
harness=$("$python" -c "
import importlib.util
def absent(name):
    try:
        return importlib.util.find_spec(name) is None
    except (ImportError, ValueError):
        return True
print(' '.join(m for m in ('pytest', 'mlflow', 'psutil') if absent(m)))")
[[ -z "$harness" ]] || echo "the GPU tests need ${harness// /, } here (bench/gpu_wheels.sh" \
  "--tracking): not run"
gpu_tests() {  # $1: the log's name, $2: seconds at most, $3: pytest's -k
  if [[ -n "$harness" ]]; then failed+=" $1"; return; fi
  timeout "$2" "$python" -m pytest -m gpu -q -rs -p no:cacheprovider \
    tests/unit/test_gpu.py tests/e2e/test_gpu.py -k "$3" 2>&1 | tee "$out/$1.log" | tail -15
  (( PIPESTATUS[0] == 0 )) || failed+=" $1"
}

first="device_clock or in_memory_data or out_of_gpu_memory"
gpu_tests pytest-breakdown-memory $(( $(left) > 420 ? 120 : $(left) / 4 )) "$first"

# The bench's estimate for its full size is ~8 minutes for its 10 arms (GPT-2's compiles most
# of it; not yet measured on a GPU): no arm starts later than 2.5 minutes before the deadline,
# and none runs past it.
arm_s=150
# shellcheck disable=SC2086 # BENCH_ARGS: words for bench.gpu
"$python" -m bench.gpu --out "$out/gpu.jsonl" --budget-s $(( $(left) - arm_s - 10 )) \
  --timeout-s "$arm_s" ${BENCH_ARGS:-} 2>&1 | tee "$out/bench-gpu.log" | tail -45
(( PIPESTATUS[0] == 0 )) || failed+=" bench-gpu"
[[ ! -s "$out/gpu.jsonl" ]] || "$python" -m bench.gpu_report "$out/gpu.jsonl" > "$out/gpu-table.md"

if (( $(left) > 60 )); then
  gpu_tests pytest-others $(( $(left) - 5 )) "not ($first)"
fi
echo "gpu checks done in ${SECONDS} s: $out${failed:+; failed:$failed}"
[[ -z "$failed" ]]
