#!/usr/bin/env bash
# The just-in-time build on a GPU machine, as a user without --no-build-isolation gets it: a fresh virtual
# environment (torch from the system: --system-site-packages), mfsdp_ext installed from a clean copy of the checkout
# without its ahead-of-time build (MFSDP_BUILD_EXT=0: what pip's isolated build does; no network needed), then
# `import mfsdp_ext` outside the checkout compiles CPU + CUDA + NCCL into a fresh cache, and a second import loads it.
# Fails unless the loaded build is just-in-time, from the cache, with CUDA and NCCL, and its CUDA cast gives the CPU
# kernel's bits. Budget: one CUDA compile (~1-3 min with MAX_JOBS=16).
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"
unset PYTHONPATH  # gpu_env.sh puts the checkout there: here the installed package must load
T=$(mktemp -d -t gpu_jit.XXXX)
tar -C "$ROOT" --exclude=./.git --exclude=./build --exclude='*.egg-info' --exclude='*.so' -cf - . | (mkdir "$T/src" && tar -C "$T/src" -xf -)
python3 -m venv --system-site-packages "$T/venv" || exit 1
# torch may live outside the system site-packages (a user site or a PYTHONPATH entry),
# which a venv does not see: point the venv at the directory torch imports from
TORCH_SITE=$(python3 -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))') || exit 1
"$T/venv/bin/python" -c 'import torch' 2>/dev/null ||
    echo "$TORCH_SITE" > "$("$T/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/system_torch.pth"
MFSDP_BUILD_EXT=0 "$T/venv/bin/pip" install -q --no-build-isolation --no-deps "$T/src" || exit 1
cd "$T"
status=0
for attempt in first second; do
    echo "== $attempt import"
    TORCH_EXTENSIONS_DIR="$T/cache" MAX_JOBS=${MAX_JOBS:-16} "$T/venv/bin/python" - "$T" <<'PY' || status=1
import os, sys, time
t0 = time.perf_counter()
import torch, mfsdp_ext
from mfsdp_ext import _native
print(f"import took {time.perf_counter() - t0:.1f} s; mfsdp_ext from {os.path.dirname(mfsdp_ext.__file__)}")
info = mfsdp_ext.build_info()
print("build_info:", info)
src = torch.randn(1 << 20, generator=torch.Generator().manual_seed(0))
cpu, gpu = torch.empty(src.shape, dtype=torch.bfloat16), torch.empty(src.shape, dtype=torch.bfloat16, device="cuda")
_native.cast(src, cpu)
_native.cast(src.cuda(), gpu)
same = torch.equal(cpu, gpu.cpu())
print("CUDA cast == CPU cast (bits):", same)
ok = (info["build"] == "just-in-time" and info["path"].startswith(os.path.join(sys.argv[1], "cache"))
      and info["cuda"] and info["nccl"] and same and mfsdp_ext.__file__.startswith(os.path.join(sys.argv[1], "venv")))
sys.exit(0 if ok else 1)
PY
done
rm -rf "$T"
exit $status
