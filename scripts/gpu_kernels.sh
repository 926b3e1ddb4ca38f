#!/usr/bin/env bash
# Native kernels on one GPU: build the extension, run the GPU kernel tests (and the CPU ones on this torch),
# then the kernel benchmark. Logs and results land under $OUT (default /tmp/out):
#   build.log  ptxas.txt  build_info.txt  pytest_gpu.log  pytest_cpu.log  bench.log  kernels_<gpu>.{md,json,png}
#
#   bash scripts/gpu_kernels.sh
#   OUT=benchmarks/results bash scripts/gpu_kernels.sh      # keep the tables in the repository
#   SIZES=1M,16M,256M bash scripts/gpu_kernels.sh           # fewer benchmark sizes
#
# Budget: build ~1-2 min on 16 cores, tests < 1 min, benchmark ~1 min; every step is capped by `timeout`.
set -uo pipefail
export PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export MAX_JOBS=${MAX_JOBS:-16}
SIZES=${SIZES:-1M,4M,16M,64M,256M,1G}

step() { echo; echo "== $* ($(date +%T))"; }
status=0

step "build: pip install --no-build-isolation --no-deps -e ."
t0=$(date +%s)
if ! MFSDP_PTXAS_VERBOSE=1 timeout 420 python3 -m pip install -v --no-build-isolation --no-deps -e . \
        > "$OUT/build.log" 2>&1; then
    tail -40 "$OUT/build.log"
    # keep the kernels testable when only the NCCL part (csrc/symm_comm.cpp) fails to build
    if grep -q "symm_comm" "$OUT/build.log"; then
        step "build failed in symm_comm: retrying without NCCL (MFSDP_NO_NCCL=1)"
        status=1
        if ! MFSDP_NO_NCCL=1 MFSDP_PTXAS_VERBOSE=1 timeout 420 python3 -m pip install -v --no-build-isolation \
                --no-deps -e . > "$OUT/build_no_nccl.log" 2>&1; then
            tail -40 "$OUT/build_no_nccl.log"; echo "BUILD FAILED"; exit 1
        fi
    else
        echo "BUILD FAILED"; exit 1
    fi
fi
echo "build took $(( $(date +%s) - t0 )) s"
# registers / spills of every kernel (ptxas -v), one line per kernel
grep -hE "Compiling entry|spill stores|Used [0-9]+ registers" "$OUT"/build*.log \
    | sed -E 's/.*Compiling entry function .(_Z[^ ]*). for .(sm_[0-9a]+)./\2 \1/; s/.*ptxas info *: *//' \
    | paste -d' ' - - - > "$OUT/ptxas.txt" || true
grep -c "" "$OUT/ptxas.txt" | xargs echo "kernels compiled:"
if grep -E "[1-9][0-9]* bytes spill stores" "$OUT/ptxas.txt" > /dev/null; then
    echo "kernels with spills:"; grep -E "[1-9][0-9]* bytes spill stores" "$OUT/ptxas.txt" | cut -c1-200
fi
python3 -c "import mfsdp_ext._native as n; print(n.build_info())" 2>&1 | tee "$OUT/build_info.txt"

step "pytest -m gpu tests/test_kernels.py"
timeout 300 python3 -m pytest -m gpu tests/test_kernels.py -q -rs -p no:cacheprovider 2>&1 | tee "$OUT/pytest_gpu.log"
[ "${PIPESTATUS[0]}" = 0 ] || status=1

step "pytest -m 'not gpu' tests/test_kernels.py (CPU kernels on this torch)"
timeout 180 python3 -m pytest -m "not gpu" tests/test_kernels.py -q -p no:cacheprovider > "$OUT/pytest_cpu.log" 2>&1
[ "$?" = 0 ] || status=1
tail -3 "$OUT/pytest_cpu.log"

step "benchmarks/kernels.py --out $OUT --sizes $SIZES"
timeout 300 python3 benchmarks/kernels.py --out "$OUT" --sizes "$SIZES" 2>&1 | tee "$OUT/bench.log"
[ "${PIPESTATUS[0]}" = 0 ] || status=1

step "done (status $status); files in $OUT"
ls -la "$OUT"
exit $status
