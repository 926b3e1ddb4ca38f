#!/usr/bin/env bash
# Installs what the project needs and builds the native extension in place.
# Without torch: torch 2.13.0 from pip (CPU machines, CI). With torch installed (GPU hosts): uses that torch.
set -euo pipefail
cd "$(dirname "$0")/.."
if python3 -c "import torch" 2>/dev/null; then
    echo "[install] using installed torch $(python3 -c 'import torch; print(torch.__version__)')"
else
    python3 -m pip install -q torch==2.13.0
fi
# numpy: torch.distributed.checkpoint (DCP) needs it for its object collectives; the CPU torch wheel does not pull it.
# transformers: examples/train_hf.py and the HuggingFace tests (the `test` extra of pyproject.toml).
# setuptools >= 64 and wheel: the editable build below runs without isolation, in this environment (a new virtual
# environment has neither wheel nor, on older Pythons, a recent enough setuptools).
python3 -c "import pybind11, ninja, pytest, numpy, transformers, wheel, setuptools; assert int(setuptools.__version__.split('.')[0]) >= 64" 2>/dev/null ||
    python3 -m pip install -q pybind11 ninja pytest numpy transformers wheel "setuptools>=64"
# The training frameworks of tests/integration/test_frameworks.py and examples/frameworks/ (pinned; torch itself is
# pinned to the installed build by a constraints file, so nothing here replaces it). By default only with a CPU build of
# torch (CI and development machines); on a GPU host they are optional, and the tests skip a framework that is not
# installed. MFSDP_FRAMEWORKS=0 skips this, =1 forces it.
#   torchtitan 0.3.0 is installed without its dependencies (it asks for wandb and torch_checkpointing, which its
#   train path does not import, and for datasets<4.8): what it imports is listed here instead; triton is imported at
#   load (torchtitan/distributed/minimal_async_ep/kernels.py), tensorboard by torch.utils.tensorboard; torchao by
#   torchtitan's float8 converter (TITAN_FLOAT8 in examples/frameworks/titan_configs.py).
FRAMEWORKS=(accelerate==1.15.0 lightning==2.6.6 spmd_types==0.2.3 tyro==1.0.17 docstring-parser==0.18.0
            typeguard==4.6.1 torchdata==0.11.0 datasets==5.2.0 einops==0.8.2 tensorboard==2.21.0 triton==3.9.0
            torchao==0.18.0)
want_frameworks=${MFSDP_FRAMEWORKS:-$(python3 -c "import torch; print(0 if torch.version.cuda else 1)")}
if [ "$want_frameworks" = 1 ]; then
    if python3 -c "
import importlib.metadata as md, sys
pins = dict(p.split('==') for p in sys.argv[1:])
sys.exit(any(md.version(n) != v for n, v in pins.items()))" torchtitan==0.3.0 "${FRAMEWORKS[@]}" 2>/dev/null; then
        echo "[install] frameworks already installed (torchtitan 0.3.0, accelerate, lightning, ...)"
    else
        constraints=$(mktemp)
        torch_before=$(python3 -c "import torch; print(torch.__version__)")
        echo "torch==$torch_before" > "$constraints"
        python3 -m pip install -q -c "$constraints" --no-deps torchtitan==0.3.0
        python3 -m pip install -q -c "$constraints" "${FRAMEWORKS[@]}"
        rm -f "$constraints"
        python3 -c "
import sys, torch, torchtitan, accelerate, lightning
assert torch.__version__ == sys.argv[1], ('torch changed', sys.argv[1], torch.__version__)
print('[install] frameworks: accelerate', accelerate.__version__, 'lightning', lightning.__version__,
      'torchtitan 0.3.0; torch', torch.__version__, 'unchanged')" "$torch_before"
    fi
fi
# --no-build-isolation: this build sees torch, so mfsdp_ext._C is compiled now (ahead of time), not at first import
python3 -m pip install -q --no-build-isolation --no-deps -e .
python3 -c "import mfsdp_ext; print('[install] mfsdp_ext', mfsdp_ext.__version__, mfsdp_ext.build_info())"
