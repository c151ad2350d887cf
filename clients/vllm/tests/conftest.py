"""Tests of kvservice-vllm: they need vLLM 0.33 (.venv-vllm, scripts/setup_vllm.sh) and kvservice."""

import os

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
pytest.importorskip("vllm")
