"""vLLM 0.33 on kvservice: vLLM's own scheduler with its KV cache manager on a kvservice server.

``kvservice_vllm.Scheduler`` / ``kvservice_vllm.AsyncScheduler`` (``--scheduler-cls``) and
``kvservice_vllm.install(scheduler, target)`` replace the scheduler's in-process
``KVCacheManager`` by :class:`kvservice_vllm.manager.RemoteKVCacheManager`, which answers vLLM's
manager calls from a kvservice server (``target``: ``HOST:PORT``, ``unix:PATH`` or ``"embedded"``).
See ``clients/vllm/README.md``.

Importing the package checks the installed vLLM is 0.33.x (``ImportError`` otherwise:
:mod:`kvservice_vllm._vllm_version`), as vLLM is not one of its declared dependencies.
"""

import kvservice_vllm._vllm_version  # noqa: F401  # first: refuses a vLLM other than 0.33.x
from kvservice_vllm.layout import UnsupportedKVCacheConfig, layout_toml
from kvservice_vllm.manager import RemoteKVCacheManager, RemoteManagerError
from kvservice_vllm.scheduler import AsyncScheduler, Scheduler, install

__all__ = [
    "AsyncScheduler",
    "RemoteKVCacheManager",
    "RemoteManagerError",
    "Scheduler",
    "UnsupportedKVCacheConfig",
    "Worker",
    "install",
    "layout_toml",
]


def __getattr__(name: str) -> object:
    """``kvservice_vllm.Worker`` (``--worker-cls``), imported on first use: vLLM's GPU worker
    module is heavy and a scheduler process does not need it."""
    if name == "Worker":
        from kvservice_vllm.worker import Worker

        return Worker
    raise AttributeError(f"module 'kvservice_vllm' has no attribute {name!r}")
