#!/usr/bin/env bash
# The style tools CI runs (pinned, so a new release cannot fail a commit that passed): ruff over the repository and
# mypy over the package (settings in pyproject.toml). Installs them when missing.
set -euo pipefail
cd "$(dirname "$0")/.."
RUFF=0.17.6 MYPY=2.4.1
python3 -c "
import importlib.metadata as md, sys
sys.exit(md.version('ruff') != sys.argv[1] or md.version('mypy') != sys.argv[2])" "$RUFF" "$MYPY" 2>/dev/null ||
    python3 -m pip install -q "ruff==$RUFF" "mypy==$MYPY"
python3 -m ruff check .
python3 -m mypy
