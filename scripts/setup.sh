#!/usr/bin/env bash
# Set up a virtual environment in .venv with kvservice, kvservice-client and the test tools.
#
# torch is installed first and pinned to 2.13.0: on the build machines that exact release is a CPU
# wheel on disk, while any looser spec can pull a multi-GB CUDA build. pyproject.toml keeps a range
# for users elsewhere; set KVSERVICE_TORCH_SPEC to install another build (e.g. a CUDA one).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "${KVSERVICE_TORCH_SPEC:-torch==2.13.0}"
.venv/bin/python -m pip install -q -e ./clients/python -e '.[dev]'
echo "kvservice is set up in .venv ($(.venv/bin/python -c 'import torch, kvservice; print("torch", torch.__version__)'))"
