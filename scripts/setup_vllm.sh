#!/usr/bin/env bash
# Set up .venv-vllm: vLLM 0.33 beside kvservice, for the kvservice-vllm package (clients/vllm/) and
# vLLM's own test suites. Not needed by the README's two commands.
#
# torch is installed first and pinned (as scripts/setup.sh does: 2.13.0 is the CPU wheel on disk
# here); vLLM's wheel goes in without its dependency tree (it would pull another torch), then the
# modules its scheduler path imports (clients/vllm/requirements-vllm.txt), then kvservice-client,
# kvservice and kvservice-vllm in editable mode. The torch installed first stays the torch here
# (the last line checks it).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
V=.venv-vllm
if [ ! -x "$V/bin/python" ]; then
  "$PYTHON" -m venv "$V"
fi
"$V/bin/python" -m pip install -q --upgrade pip
"$V/bin/python" -m pip install -q "${KVSERVICE_TORCH_SPEC:-torch==2.13.0}"
"$V/bin/python" -m pip install -q --no-deps "vllm==0.33.0"
echo "setup_vllm: pip's resolver may print ERROR lines below about vLLM's own pins (e.g. 'vllm 0.33.0 requires" \
  "torch==2.14.0'): expected. vLLM goes in without its dependency tree; its scheduler, offload tiers and" \
  "tests run on what is installed here (the model runners, which need the rest, are not used)."
"$V/bin/python" -m pip install -q -r clients/vllm/requirements-vllm.txt
"$V/bin/python" -m pip install -q -e ./clients/python -e .
# Its one dependency (kvservice-client) is installed above; vLLM is not a dependency of it (its
# import checks the version), so this installs nothing else.
"$V/bin/python" -m pip install -q -e ./clients/vllm
want=$("$V/bin/python" -c 'import torch; print(torch.__version__)')
case "${KVSERVICE_TORCH_SPEC:-torch==2.13.0}" in
  torch==2.13.0) [ "${want%%+*}" = 2.13.0 ] || { echo "setup_vllm: torch $want was installed over torch 2.13.0" >&2; exit 1; } ;;
esac
echo "kvservice-vllm is set up in $V ($("$V/bin/python" -c 'import torch, vllm, kvservice_vllm; print("torch", torch.__version__, "vllm", vllm.__version__)'))"
