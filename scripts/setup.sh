#!/usr/bin/env bash
# Idempotent install into .venv: torch first (the CPU build that pip finds locally; an open range
# with no torch installed would pull a multi-GB CUDA build), then this package with its dev extra
# (the tools of the tests, ruff, and the experiments extra: Hydra, W&B, matplotlib, tqdm).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
if ! .venv/bin/python -c "import glm_mtp, torch, pytest, hypothesis, xdist, transformers, hydra, wandb, matplotlib, tqdm" >/dev/null 2>&1 \
   || [ ! -x .venv/bin/ruff ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q "torch==${TORCH_VERSION:-2.13.0}"
  # The one notice left is setuptools' "Editable installation." (setuptools
  # editable finder for the src layout); silence that one only.
  PYTHONWARNINGS="ignore:Editable installation." .venv/bin/python -m pip install -q -e ".[dev]"
fi
