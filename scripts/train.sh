#!/usr/bin/env bash
# The main job: trains the example GPT with mfsdp_ext.fully_shard on all GPUs, or on 2 CPU processes (gloo).
# Flags go to examples/train_gpt.py, e.g.
#   bash scripts/train.sh --ckpt-dir ckpt --ckpt-every 20     # a DCP checkpoint every 20 steps
#   bash scripts/train.sh --ckpt-dir ckpt --resume            # continue from the latest complete one
set -euo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's mfsdp_ext, whatever else is installed
ngpu=$(python3 -c "import torch; print(torch.cuda.device_count())")
nproc=$(( ngpu > 0 ? ngpu : 2 ))
exec torchrun --standalone --nproc-per-node "$nproc" examples/train_gpt.py --impl ours "$@"
