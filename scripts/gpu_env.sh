# Sourced by the GPU scripts: safe NCCL settings, the repository root on PYTHONPATH, and $OUT.
# NVLink multicast must stay off on these machines (it can take shared GPUs out of service).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-$ROOT/benchmarks/results/gpu}
mkdir -p "$OUT"
