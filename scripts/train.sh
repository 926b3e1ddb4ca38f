#!/usr/bin/env bash
# The main job: trains the example GPT with mfsdp_ext.fully_shard on all GPUs, or on 2 CPU processes (gloo).
set -euo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
ngpu=$(python3 -c "import torch; print(torch.cuda.device_count())")
nproc=$(( ngpu > 0 ? ngpu : 2 ))
exec torchrun --standalone --nproc-per-node "$nproc" examples/train_gpt.py --impl ours "$@"
