#!/usr/bin/env bash
# Installs what the project needs and builds the native extension in place.
# CPU machine / CI: torch 2.13.0 (CPU build) from pip. GPU machine: uses the torch already installed there.
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
# --no-build-isolation: this build sees torch, so mfsdp_ext._C is compiled now (ahead of time), not at first import
python3 -m pip install -q --no-build-isolation --no-deps -e .
python3 -c "import mfsdp_ext; print('[install] mfsdp_ext', mfsdp_ext.__version__, mfsdp_ext.build_info())"
