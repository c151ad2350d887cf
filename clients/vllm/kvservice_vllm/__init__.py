"""vLLM 0.33 on kvservice: vLLM's own scheduler with its KV cache manager on a kvservice server.

``kvservice_vllm.Scheduler`` / ``kvservice_vllm.AsyncScheduler`` (``--scheduler-cls``) and
``kvservice_vllm.install(scheduler, target)`` replace the scheduler's in-process
``KVCacheManager`` by :class:`kvservice_vllm.manager.RemoteKVCacheManager`, which answers vLLM's
manager calls from a kvservice server (``target``: ``HOST:PORT``, ``unix:PATH`` or ``"embedded"``).
See ``clients/vllm/README.md``.
"""

from kvservice_vllm.layout import UnsupportedKVCacheConfig, layout_toml
from kvservice_vllm.manager import RemoteKVCacheManager, RemoteManagerError
from kvservice_vllm.scheduler import AsyncScheduler, Scheduler, install

__all__ = [
    "AsyncScheduler",
    "RemoteKVCacheManager",
    "RemoteManagerError",
    "Scheduler",
    "UnsupportedKVCacheConfig",
    "install",
    "layout_toml",
]
