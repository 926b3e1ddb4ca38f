#!/usr/bin/env bash
# NCCL symmetric memory on a GPU machine: the collectives' GPU test
# (tests/comm/test_symm_mem.py::test_symmetric_collectives; fully_shard on symmetric memory, the other GPU tests of that
# file, runs in gpu_check.sh's tests stage), then the collectives benchmark (ours vs plain torch vs torch's symmetric
# pool) on 2 GPUs and, when present, on 4.
# The extension must be built first (scripts/gpu_check.sh build, or pip install --no-build-isolation --no-deps -e .).
# SKIP_PYTEST=1 runs the benchmark only.
#
#   bash scripts/gpu_symm.sh                 # results under $OUT (default ./gpu_check_out)
#   SIZES=1,8 ITERS_SCALE=0.5 bash scripts/gpu_symm.sh
#
# Budget: about 3 minutes with 2 GPUs (pytest ~40 s, each torchrun ~40-60 s); every step is capped by
# `timeout`, so a hang costs at most its cap.
set -uo pipefail

source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"
SIZES=${SIZES:-1,8,64,256}
ITERS_SCALE=${ITERS_SCALE:-1.0}
TEST_TIMEOUT=${TEST_TIMEOUT:-120}
BENCH_TIMEOUT=${BENCH_TIMEOUT:-100}

NGPU=$(python3 -c 'import torch; print(torch.cuda.device_count())')
{
    echo "date: $(date -Is)"
    nvidia-smi -L 2>/dev/null
    python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda,
        "nccl", torch.cuda.nccl.version() if torch.cuda.is_available() else None)'
    python3 -c '
from mfsdp_ext import _C
from mfsdp_ext.comm import symmetric as symm_mem
print("symm_mem.is_available:", symm_mem.is_available())
print("symm_comm_build_info:", _C.symm_comm_build_info())
'
    env | grep -E '^(NCCL_|TORCH_SYMM|NVSHMEM_)' | sort
} 2>&1 | tee "$OUT/symm_env.txt"

status=0
if [ "${SKIP_PYTEST:-0}" != 1 ]; then
    echo "== pytest -m gpu tests/comm/test_symm_mem.py -k symmetric_collectives"
    timeout -k 10 "$TEST_TIMEOUT" python3 -m pytest -m gpu -rs -q -s tests/comm/test_symm_mem.py -k symmetric_collectives 2>&1 | tee "$OUT/symm_pytest.log"
    rc=${PIPESTATUS[0]}
    [ "$rc" = 0 ] || { echo "!! pytest exited $rc"; status=1; }
fi

run_bench() {  # $1 = number of GPUs
    local n=$1
    echo "== benchmarks/collectives.py on $n GPUs (sizes $SIZES MiB)"
    timeout -k 10 "$BENCH_TIMEOUT" torchrun --standalone --nproc-per-node "$n" benchmarks/collectives.py \
        --out "$OUT" --sizes-mib "$SIZES" --iters-scale "$ITERS_SCALE" 2>&1 | tee "$OUT/collectives_${n}gpu.log"
    local rc=${PIPESTATUS[0]}
    [ "$rc" = 0 ] || { echo "!! collectives benchmark on $n GPUs exited $rc"; status=1; }
}

if [ "$NGPU" -ge 2 ]; then
    run_bench 2
else
    echo "!! $NGPU GPU(s): the collectives benchmark needs at least 2"
    status=1
fi
if [ "$NGPU" -ge 4 ]; then run_bench 4; fi

echo "== done: results in $OUT"
ls "$OUT" | grep -E '^(collectives_|symm_)' || true
exit $status
