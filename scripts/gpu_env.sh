# Sourced by the GPU scripts: safe NCCL settings, the repository root on PYTHONPATH, and the output folder $OUT.
# NVLink multicast stays off (on shared hosts it can take GPUs out of service).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}

# $OUT: where logs and result tables go; default ./gpu_check_out (relative to the directory the script was started
# from), made absolute before the scripts move to the repository root.
OUT=${OUT:-gpu_check_out}
mkdir -p "$OUT"
export OUT=$(cd "$OUT" && pwd)

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
