"""vLLM's scheduler with its KV cache manager on kvservice.

``vllm serve MODEL --scheduler-cls kvservice_vllm.Scheduler --additional-config
'{"kvservice": {"target": "HOST:PORT"}}'`` (or ``kvservice_vllm.AsyncScheduler`` with async
scheduling) builds vLLM's own scheduler, then :func:`install` replaces its in-process
``KVCacheManager`` by :class:`kvservice_vllm.manager.RemoteKVCacheManager`.

The ``kvservice`` entry of ``--additional-config`` (each key also an environment variable):

* ``target`` (``KVSERVICE_TARGET``): ``HOST:PORT``, ``unix:PATH`` or ``embedded`` (a private
  server in this process, laid out from the scheduler's ``KVCacheConfig``);
* ``token`` (``KVSERVICE_TOKEN``): a ``scheduler`` token, when the server checks tokens;
* ``tls`` (``KVSERVICE_TLS``: ``1``), ``root_certificates`` (``KVSERVICE_ROOT_CERTIFICATES``: a PEM
  file): TLS to the server, as ``kvservice_client.KVCacheClient`` takes them;
* ``owner`` (``KVSERVICE_OWNER``): the name the scheduler claims the pool under (default
  ``vllm-HOST-PID``); ``claim_ttl_s`` (``KVSERVICE_CLAIM_TTL_S``, default 30);
* ``timeout_s`` (``KVSERVICE_TIMEOUT_S``, default 60): the deadline of one round trip;
* ``worker_token`` (``KVSERVICE_WORKER_TOKEN``): a ``worker`` token for ``kvservice_vllm.Worker``;
* ``kv_cache_on_pool`` (``KVSERVICE_KV_CACHE_ON_POOL``): whether the workers' KV cache is the
  server's pool, so the scheduler reports the blocks each finished step completed as written
  (``auto``, the default: when ``--worker-cls`` is ``kvservice_vllm.Worker`` or a subclass of it;
  ``true`` for a worker of another name that stores into the attached pool; ``false``).
"""

from __future__ import annotations

import functools
import os
import socket
import weakref
from pathlib import Path
from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler as _VllmAsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler as _VllmScheduler

from kvservice_vllm.layout import UnsupportedKVCacheConfig, check_server_layout, group_kinds
from kvservice_vllm.manager import RemoteKVCacheManager

__all__ = ["AsyncScheduler", "Scheduler", "install", "kv_cache_on_pool", "kvservice_settings"]

_ENV = {
    "target": "KVSERVICE_TARGET",
    "token": "KVSERVICE_TOKEN",
    "tls": "KVSERVICE_TLS",
    "root_certificates": "KVSERVICE_ROOT_CERTIFICATES",
    "owner": "KVSERVICE_OWNER",
    "claim_ttl_s": "KVSERVICE_CLAIM_TTL_S",
    "timeout_s": "KVSERVICE_TIMEOUT_S",
    "worker_token": "KVSERVICE_WORKER_TOKEN",
    "kv_cache_on_pool": "KVSERVICE_KV_CACHE_ON_POOL",
}

_POOL_WORKERS = frozenset({"kvservice_vllm.Worker", "kvservice_vllm.worker.Worker"})
"""``--worker-cls`` names of :class:`kvservice_vllm.worker.Worker`."""


def kvservice_settings(vllm_config: Any) -> dict[str, Any]:
    """The ``kvservice`` settings: ``--additional-config``'s ``kvservice`` entry over the
    environment variables.

    Raises:
        ValueError: an unknown key (naming it and the known ones).
    """
    settings = {key: os.environ[env] for key, env in _ENV.items() if os.environ.get(env)}
    additional = getattr(vllm_config, "additional_config", None) or {}
    given = additional.get("kvservice") or {}
    unknown = set(given) - set(_ENV)
    if unknown:
        raise ValueError(f"additional_config.kvservice: unknown keys {sorted(unknown)} (known: {', '.join(_ENV)})")
    settings.update(given)
    return settings


def kv_cache_on_pool(vllm_config: Any, settings: dict[str, Any]) -> bool:
    """Whether the engine's KV cache is the kvservice pool (its workers store into the attached
    memory), so that reporting a computed block as written is true: the ``kv_cache_on_pool``
    setting, or with ``auto`` (the default) whether ``parallel_config.worker_cls`` is
    ``kvservice_vllm.Worker`` (by either name, or a class derived from it). A scheduler over a
    remote manager with vLLM's own workers keeps the KV in the workers' memory: nothing is reported.

    Raises:
        ValueError: a ``kv_cache_on_pool`` that is neither auto nor a boolean (naming it).
    """
    value = settings.get("kv_cache_on_pool", "auto")
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes"):
        return True
    if text in ("0", "false", "no"):
        return False
    if text != "auto":
        raise ValueError(f"kvservice kv_cache_on_pool: {value!r}; auto, true or false")
    worker_cls = getattr(getattr(vllm_config, "parallel_config", None), "worker_cls", None)
    if isinstance(worker_cls, type):
        from kvservice_vllm.worker import Worker

        return issubclass(worker_cls, Worker)
    return worker_cls in _POOL_WORKERS


def _refuse_unsupported(scheduler: Any) -> None:
    """Refuse what kvservice's manager does not hold (each named with the setting that asks for it).

    Raises:
        UnsupportedKVCacheConfig: the first such feature.
    """
    checks = [
        (getattr(scheduler, "use_eagle_block_drop", False), "EAGLE's last-block drop (speculative_config: eagle/MTP)"),
        (getattr(scheduler, "num_hash_lookahead_tokens", 0), "num_hash_lookahead_tokens"),
        (getattr(scheduler, "num_prefill_lookahead", 0), "num_prefill_lookahead (multi-module MTP)"),
        (getattr(scheduler, "dcp_world_size", 1) > 1, "decode context parallelism (dcp_world_size > 1)"),
        (getattr(scheduler, "has_mamba_layers", False), "Mamba layers"),
        (
            getattr(scheduler, "hash_block_size", scheduler.block_size) != scheduler.block_size,
            f"hash_block_size {getattr(scheduler, 'hash_block_size', None)} != block_size {scheduler.block_size}",
        ),
        (
            getattr(scheduler.kv_cache_config, "prefix_cache_retention_interval", None) is not None,
            "prefix_cache_retention_interval (sparse retention)",
        ),
        (getattr(scheduler, "aux_output_connector", None) is not None, "aux outputs (aux_output_config)"),
    ]
    for asked, what in checks:
        if asked:
            raise UnsupportedKVCacheConfig(f"kvservice-vllm does not support {what} yet")
    group_kinds(scheduler.kv_cache_config)


def install(scheduler: Any, target: str | None = None, **settings: Any) -> RemoteKVCacheManager:
    """Replace a built vLLM scheduler's KV cache manager by one on a kvservice server.

    Args:
        scheduler: a vLLM 0.33 ``Scheduler`` (or ``AsyncScheduler``), already built.
        target: ``HOST:PORT``, ``unix:PATH`` or ``"embedded"``; None: the ``kvservice`` settings'
            (:func:`kvservice_settings`).
        **settings: other ``kvservice`` settings, over the scheduler's.

    Returns:
        The remote manager (now ``scheduler.kv_cache_manager``). A KV connector is bound to it;
        ``scheduler.shutdown()`` ends its claim on the pool (and stops an embedded server).

    Raises:
        ValueError: no target, or an unknown setting.
        UnsupportedKVCacheConfig: a feature kvservice's manager does not hold (named).
        ValueError: the server's pool is not the scheduler's (the field named, both values).
        kvservice_client.KVServiceError: the server cannot be reached.
    """
    from vllm.v1.core.kv_cache_utils import get_none_hash_seed

    from kvservice_client import KVCacheClient

    config = {**kvservice_settings(scheduler.vllm_config), **settings}
    if target is not None:
        config["target"] = target
    if not config.get("target"):
        raise ValueError(
            "kvservice target: none given (install(scheduler, 'HOST:PORT'), --additional-config "
            '\'{"kvservice": {"target": "HOST:PORT"}}\' or KVSERVICE_TARGET)'
        )
    _refuse_unsupported(scheduler)
    kv_cache_config = scheduler.kv_cache_config
    cache_config = scheduler.cache_config
    enable_caching = bool(cache_config.enable_prefix_caching)
    hash_algorithm = cache_config.prefix_caching_hash_algo
    hash_seed = get_none_hash_seed()
    server = None
    address = config["target"]
    if address == "embedded":
        from kvservice_vllm.embedded import EmbeddedServer

        server = EmbeddedServer(
            kv_cache_config,
            max_model_len=scheduler.max_model_len,
            enable_prefix_caching=enable_caching,
            hash_algorithm=hash_algorithm,
            hash_seed=hash_seed,
        )
        address = server.address
    client = None
    try:
        tls = str(config.get("tls", "")).lower() in ("1", "true", "yes")
        root = config.get("root_certificates")
        client = KVCacheClient(
            address,
            token=config.get("token"),
            tls=tls or root is not None,
            root_certificates=Path(root).read_bytes() if root else None,
        )
        if server is None:
            check_server_layout(
                client.get_kv_cache_group_metadata(),
                kv_cache_config,
                hash_block_size=scheduler.block_size,
                enable_prefix_caching=enable_caching,
                hash_algorithm=hash_algorithm,
                hash_seed=hash_seed,
            )
        manager = RemoteKVCacheManager(
            client,
            kv_cache_config,
            max_model_len=scheduler.max_model_len,
            enable_caching=enable_caching,
            log_stats=scheduler.log_stats,
            watermark=scheduler.scheduler_config.watermark,
            max_in_flight_tokens=getattr(scheduler.vllm_config, "max_in_flight_tokens", None),
            owner=config.get("owner") or f"vllm-{socket.gethostname()}-{os.getpid()}-{id(scheduler):x}",
            claim_ttl_s=float(config.get("claim_ttl_s", 30.0)),
            enable_kv_cache_events=bool(getattr(scheduler, "enable_kv_cache_events", False)),
            needs_kv_cache_zeroing=bool(getattr(kv_cache_config, "needs_kv_cache_zeroing", False)),
            timeout_s=float(config.get("timeout_s", 60.0)),
        )
        manager.mark_blocks_written = kv_cache_on_pool(scheduler.vllm_config, config)
        manager.claim()
    except BaseException:
        if client is not None:
            client.close()
        if server is not None:
            server.stop()
        raise
    manager._scheduler = scheduler
    sched = scheduler.scheduler_config
    manager.free_queue_horizon = min(
        kv_cache_config.num_blocks, 2 * (sched.max_num_batched_tokens // scheduler.block_size + sched.max_num_seqs) + 64
    )
    scheduler.kv_cache_manager = manager
    if getattr(scheduler, "connector", None) is not None:
        scheduler.connector.bind_kv_cache_manager(manager)
    scheduler.kvservice_server = server
    _wrap(scheduler, manager)
    weakref.finalize(scheduler, _close, manager, client, server)
    return manager


def _close(manager: RemoteKVCacheManager, client: Any, server: Any) -> None:
    try:
        manager.close()
    except Exception:  # the server may be gone: nothing more to release
        pass
    finally:
        client.close()
        if server is not None:
            server.stop()


def _wrap(scheduler: Any, manager: RemoteKVCacheManager) -> None:
    """``schedule()`` sends the queued manager calls before it returns; ``shutdown()`` ends the
    claim (and stops an embedded server) after vLLM's own shutdown; with the KV cache on the pool,
    ``update_from_output()`` queues the blocks the finished step completed as written.

    Why there: vLLM hands a step's ``ModelRunnerOutput`` to ``update_from_output`` only once every
    worker finished the step, while ``num_computed_tokens`` advances when the step is scheduled
    (and the async scheduler schedules the next step before this one's output is back). The
    reports ride on the next round trip (``ManagerStepRequest.written_blocks``), which the next
    ``schedule()`` makes anyway: no round trip of their own, and no thread to order against the
    scheduler's calls; the server applies them before that step's calls, so a request freed by
    this output is still the blocks' owner when they are marked.
    """
    schedule = scheduler.schedule
    shutdown = scheduler.shutdown
    update_from_output = scheduler.update_from_output

    @functools.wraps(update_from_output)
    def update_from_output_and_report(scheduler_output: Any, model_runner_output: Any) -> Any:
        steps = manager.before_step_output(scheduler.requests, scheduler_output.num_scheduled_tokens)
        outputs = update_from_output(scheduler_output, model_runner_output)
        if steps:
            manager.after_step_output(steps)
        return outputs

    @functools.wraps(schedule)
    def schedule_and_flush(*args: Any, **kwargs: Any) -> Any:
        output = schedule(*args, **kwargs)
        manager.flush()
        return output

    @functools.wraps(shutdown)
    def shutdown_and_release(*args: Any, **kwargs: Any) -> Any:
        try:
            return shutdown(*args, **kwargs)
        finally:
            server = scheduler.kvservice_server
            try:
                manager.close()
            finally:
                manager._client.close()
                if server is not None:
                    server.stop()

    scheduler.schedule = schedule_and_flush
    scheduler.shutdown = shutdown_and_release
    if manager.mark_blocks_written:
        scheduler.update_from_output = update_from_output_and_report


class Scheduler(_VllmScheduler):
    """vLLM 0.33's ``Scheduler`` with its KV cache manager on kvservice (``--scheduler-cls
    kvservice_vllm.Scheduler``; the target from ``--additional-config`` or ``KVSERVICE_TARGET``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        install(self)


class AsyncScheduler(_VllmAsyncScheduler):
    """vLLM 0.33's ``AsyncScheduler`` with its KV cache manager on kvservice (``--scheduler-cls
    kvservice_vllm.AsyncScheduler``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        install(self)
