"""pytest plugin for vLLM's own test suites: every vLLM scheduler built while a test runs gets its
KV cache manager replaced through ``kvservice_vllm.install(scheduler, "embedded")``.

Load it with ``-p kvservice_embedded_plugin`` (its folder on ``PYTHONPATH``), from a folder holding
vLLM's ``tests/`` (``scripts/vllm_tests.py`` does both).
"""

from __future__ import annotations

import kvservice_vllm
from vllm.v1.core.sched.scheduler import Scheduler

_init = Scheduler.__init__


def _init_then_install(self, *args, **kwargs):
    _init(self, *args, **kwargs)
    kvservice_vllm.install(self, "embedded")


Scheduler.__init__ = _init_then_install
