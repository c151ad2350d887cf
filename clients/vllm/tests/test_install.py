"""install(): what it refuses, the one-scheduler claim, a server that goes away, the surface."""

from __future__ import annotations

import asyncio
import inspect
import re
import threading
from pathlib import Path

import kvservice_vllm
import pytest
import vllm.v1.core.kv_cache_manager as vllm_manager
import vllm.v1.core.sched.scheduler as vllm_scheduler
from kvservice_vllm.drive import TraceItem, make_scheduler, run_trace
from kvservice_vllm.layout import UnsupportedKVCacheConfig, layout_toml

POOL = dict(num_blocks=256, max_num_batched_tokens=512, max_model_len=2048, num_layers=2)
ITEMS = [TraceItem(f"r{i}", list(range(i, i + 100)), [7] * 5, i) for i in range(6)]


class _Server:
    """A kvservice server on a loop thread, laid out as a scheduler's KV cache config."""

    def __init__(self, scheduler, tmp_path: Path, **overrides) -> None:
        from kvservice.server.app import start_server

        layout = tmp_path / "layout.toml"
        layout.write_text(layout_toml(scheduler.kv_cache_config, max_model_len=scheduler.max_model_len))
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        settings = dict(
            host="127.0.0.1",
            port=0,
            kv_cache_layout=str(layout),
            num_blocks=scheduler.kv_cache_config.num_blocks,
            max_model_len=scheduler.max_model_len,
            device="meta",
            hash_algorithm=scheduler.cache_config.prefix_caching_hash_algo,
            grace_seconds=0.0,
        )
        settings.update(overrides)
        self.running = asyncio.run_coroutine_threadsafe(start_server(**settings), self.loop).result()
        self.address = self.running.address

    def stop(self) -> None:
        if self.loop.is_running():
            asyncio.run_coroutine_threadsafe(self.running.stop(0), self.loop).result()
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join()


def test_a_real_target_runs_the_trace_as_vllms_own_manager(tmp_path):
    native, remote = make_scheduler(**POOL), make_scheduler(**POOL)
    server = _Server(remote, tmp_path)
    try:
        kvservice_vllm.install(remote, server.address)
        assert run_trace(remote, ITEMS).records == run_trace(native, ITEMS).records
        remote.shutdown()
        assert server.running.engine.claim is None  # shutdown ended the claim
        assert server.running.engine.requests == {}
    finally:
        server.stop()


@pytest.mark.parametrize(
    ("override", "field"),
    [
        (dict(num_blocks=300), "groups[0].num_blocks: the server has 300, vLLM's config 256"),
        (dict(hash_seed="another"), "hash_seed: the server's is 'another'"),
        (dict(hash_algorithm="sha256_cbor"), "hash_algorithm: the server has 'sha256_cbor'"),
        (dict(block_size=32), "groups[0].block_size: the server has 32, vLLM's config 16"),
    ],
)
def test_a_server_laid_out_otherwise_is_refused_naming_the_field(tmp_path, override, field):
    scheduler = make_scheduler(**POOL)
    server = _Server(scheduler, tmp_path, **override)
    try:
        with pytest.raises(ValueError, match=re.escape(field)):
            kvservice_vllm.install(scheduler, server.address)
        assert server.running.engine.claim is None  # refused before it claimed anything
    finally:
        server.stop()


def test_a_second_scheduler_on_the_pool_is_refused_naming_the_owner(tmp_path):
    first, second = make_scheduler(**POOL), make_scheduler(**POOL)
    server = _Server(first, tmp_path)
    try:
        kvservice_vllm.install(first, server.address, owner="engine-a")
        with pytest.raises(
            kvservice_vllm.RemoteManagerError,
            match="FAILED_PRECONDITION: owner: the pool is owned by scheduler 'engine-a'",
        ):
            kvservice_vllm.install(second, server.address, owner="engine-b")
        first.shutdown()
        kvservice_vllm.install(second, server.address, owner="engine-b")  # the claim ended with the first
        second.shutdown()
    finally:
        server.stop()


def test_a_server_that_goes_away_mid_run_stops_the_scheduler_with_a_clear_error(tmp_path):
    scheduler = make_scheduler(**POOL)
    server = _Server(scheduler, tmp_path)
    kvservice_vllm.install(scheduler, server.address, timeout_s=5)
    server.stop()
    with pytest.raises(kvservice_vllm.RemoteManagerError, match="UNAVAILABLE"):
        run_trace(scheduler, ITEMS)
    with pytest.raises(kvservice_vllm.RemoteManagerError, match="stopped after an error"):
        scheduler.kv_cache_manager.reset_prefix_cache()


@pytest.mark.parametrize(
    ("mutate", "what"),
    [
        (lambda s: setattr(s, "has_mamba_layers", True), "Mamba layers"),
        (lambda s: setattr(s, "num_prefill_lookahead", 2), "num_prefill_lookahead"),
        (lambda s: setattr(s, "use_eagle_block_drop", True), "EAGLE"),
        (lambda s: setattr(s, "dcp_world_size", 2), "decode context parallelism"),
    ],
)
def test_what_kvservice_does_not_hold_is_refused_by_name(mutate, what):
    scheduler = make_scheduler(**POOL)
    mutate(scheduler)
    with pytest.raises(UnsupportedKVCacheConfig, match=re.escape(what)):
        kvservice_vllm.install(scheduler, "embedded")


def test_no_target_is_refused_saying_where_to_give_one(monkeypatch):
    monkeypatch.delenv("KVSERVICE_TARGET", raising=False)
    with pytest.raises(ValueError, match="KVSERVICE_TARGET"):
        kvservice_vllm.install(make_scheduler(**POOL))


def test_the_additional_config_names_the_target_and_unknown_keys_are_refused():
    scheduler = make_scheduler(**POOL)
    scheduler.vllm_config.additional_config = {"kvservice": {"target": "embedded", "owner": "from-config"}}
    manager = kvservice_vllm.install(scheduler)
    assert manager.owner == "from-config"
    scheduler.shutdown()
    scheduler = make_scheduler(**POOL)
    scheduler.vllm_config.additional_config = {"kvservice": {"targt": "embedded"}}
    with pytest.raises(ValueError, match=r"additional_config.kvservice: unknown keys \['targt'\]"):
        kvservice_vllm.install(scheduler)


def _manager_attributes_the_scheduler_reads() -> set[str]:
    source = inspect.getsource(vllm_scheduler)
    return set(re.findall(r"kv_cache_manager\.([a-z_]+)", source))


def test_the_remote_manager_has_every_part_of_vllms_manager_the_scheduler_reads():
    """vLLM's manager surface, pinned: every attribute vLLM 0.33's scheduler reads of its KV cache
    manager exists on the remote one, and each method takes vLLM's parameters (names, order,
    defaults). A vLLM that changes it fails here."""
    names = _manager_attributes_the_scheduler_reads()
    assert len(names) >= 25
    scheduler = make_scheduler(**POOL)
    manager = kvservice_vllm.install(scheduler, "embedded")
    try:
        for name in sorted(names):
            assert hasattr(manager, name), name
            theirs = getattr(vllm_manager.KVCacheManager, name, None)
            if callable(theirs) and not isinstance(theirs, property):
                ours = getattr(type(manager), name)
                want = [(p.name, p.default) for p in inspect.signature(theirs).parameters.values()]
                have = [(p.name, p.default) for p in inspect.signature(ours).parameters.values()]
                assert have == want, name
    finally:
        scheduler.shutdown()
