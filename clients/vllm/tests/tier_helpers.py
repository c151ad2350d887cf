"""Helpers of the tier tests and benchmark: a kvservice server on a background event-loop thread
(restartable on the same Unix socket) and a vLLM instance's tiering manager with the kvservice tier.

An :class:`Instance` is what one vLLM engine's scheduler holds: vLLM 0.33's own
``TieringOffloadingSpec`` built from an ``OffloadingConfig``, its ``TieringOffloadingManager``
(CPU primary tier in vLLM's shared region, the kvservice tier loaded by ``module_path``), driven
by the calls vLLM's ``OffloadingConnector`` makes (``prepare_store`` / ``complete_store`` for a
GPU->CPU store, ``lookup`` / ``on_schedule_end`` / ``prepare_load`` for a hit). The GPU side is
played by writing and reading the primary rows. Waits are on the tier's threads, never sleeps.
"""

from __future__ import annotations

import hashlib
import itertools
import uuid
from collections.abc import Sequence
from typing import Any

import torch
from vllm.v1.kv_offload.base import (
    LookupResult,
    OffloadKey,
    ReqContext,
    ScheduleEndContext,
    make_offload_key,
)
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from kvservice_vllm.embedded import EmbeddedTierServer
from kvservice_vllm.tier import KVServiceTier
from kvservice_vllm.tier_client import rows_of

CHUNK_BYTES = 4096
"""One offload chunk here: a page (vLLM rounds a chunk up to 4096 bytes), no padding."""
BLOCK_SIZE = 16


def chunk_key(name: str, group_idx: int = 0) -> OffloadKey:
    """A key whose block hash is a sha256 digest (32 bytes, as vLLM's sha256_cbor hashes are)."""
    return make_offload_key(hashlib.sha256(name.encode()).digest(), group_idx)


def chunk_bytes_of(key: OffloadKey, size: int = CHUNK_BYTES) -> bytes:
    """A chunk's content: a function of its key (as the replay's --kv-data makes block bytes)."""
    seed = int.from_bytes(hashlib.sha256(key).digest()[:8], "little")
    generator = torch.Generator().manual_seed(seed)
    return bytes(torch.randint(0, 256, (size,), dtype=torch.uint8, generator=generator).numpy())


def tier_server(*, num_blocks: int = 32, chunk_bytes: int = CHUNK_BYTES, **settings: Any) -> EmbeddedTierServer:
    """``kvservice serve --device cpu --kv-cache-layout opaque:CHUNK_BYTES`` in this process."""
    return EmbeddedTierServer(chunk_bytes, num_blocks=num_blocks, block_size=BLOCK_SIZE, **settings)


_request_ids = itertools.count()


class Instance:
    """One vLLM engine's tiering manager (vLLM's own classes) with the kvservice tier.

    Args:
        target: the server.
        num_chunks: chunks in the CPU primary tier.
        chunk_bytes: bytes per chunk (``worker_kv_bytes_per_block`` of one worker, one block per
            chunk: a page-aligned size has no padding).
        **tier_options: the tier entry's other keys (``transport``, ``lease_ttl_s`` ...).
    """

    def __init__(self, target: str, *, num_chunks: int = 64, chunk_bytes: int = CHUNK_BYTES, **tier_options: Any):
        tier_config = {"type": "KVServiceTier", "module_path": "kvservice_vllm.tier", "target": target, **tier_options}
        self.config = offloading_config(num_chunks=num_chunks, chunk_bytes=chunk_bytes, secondary_tiers=[tier_config])
        self.spec = TieringOffloadingSpec(self.config)
        self.manager: Any = self.spec.get_manager()
        tier = self.manager.secondary_tiers[0]
        assert isinstance(tier, KVServiceTier)
        self.tier: KVServiceTier = tier
        self.rows = rows_of(self.manager.primary_tier.get_kv_memoryview())

    def step(self) -> None:
        """The end of a scheduler step (vLLM's connector calls on_schedule_end last, then takes events)."""
        self.manager.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))
        list(self.manager.take_events())

    def settle(self) -> None:
        """Step until the tier's lookups and jobs have answered and vLLM has taken their results."""
        for _ in range(20):
            self.tier.wait_lookups()
            self.tier.drain_jobs()
            self.step()
            if not self.manager.has_pending_work():
                return
        raise AssertionError("the tiering manager still has pending work after 20 steps")

    def store(self, keys: Sequence[OffloadKey], data: dict[OffloadKey, bytes] | None = None) -> None:
        """A request computed these chunks: the GPU->CPU store (rows written), then vLLM cascades
        them to the kvservice tier; returns once the tier's store job has reported."""
        ctx = ReqContext(req_id=f"store-{next(_request_ids)}")
        self.manager.on_new_request(ctx)
        out = self.manager.prepare_store(list(keys), ctx)
        assert out is not None, "the primary tier refused the store"
        for key, chunk_id in zip(out.keys_to_store, out.store_spec.block_ids):
            payload = (data or {}).get(key) or chunk_bytes_of(key, self.rows.shape[1])
            self.rows[int(chunk_id)].copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
        self.manager.complete_store(list(keys), ctx, success=True)
        self.step()
        self.settle()
        self.manager.on_request_finished(ctx)

    def lookup(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> list[LookupResult]:
        return [self.manager.lookup(key, ctx) for key in keys]

    def fetch(self, keys: Sequence[OffloadKey]) -> dict[OffloadKey, bytes | None]:
        """A new request's hit: look the keys up until every answer is final (promoting hits from
        the kvservice tier into the primary tier), then read each hit's primary row (None: a miss)."""
        ctx = ReqContext(req_id=f"fetch-{next(_request_ids)}")
        self.manager.on_new_request(ctx)
        results = self.lookup(keys, ctx)
        for _ in range(20):
            if all(r in (LookupResult.HIT, LookupResult.MISS) for r in results):
                break
            self.step()
            self.settle()
            results = self.lookup(keys, ctx)
        else:
            raise AssertionError(f"lookups not final after 20 steps: {results}")
        hits = [k for k, r in zip(keys, results) if r is LookupResult.HIT]
        found: dict[OffloadKey, bytes | None] = dict.fromkeys(keys)
        if hits:
            spec = self.manager.prepare_load(hits, ctx)
            for key, chunk_id in zip(hits, spec.block_ids):
                found[key] = bytes(self.rows[int(chunk_id)].numpy())
            self.manager.complete_load(hits, ctx)
        self.manager.on_request_finished(ctx)
        self.step()
        return found

    def shutdown(self) -> None:
        self.manager.shutdown()


def offloading_config(
    *, num_chunks: int, chunk_bytes: int, secondary_tiers: list[dict[str, Any]], world_size: int = 1
) -> OffloadingConfig:
    """vLLM's ``OffloadingConfig`` for one full-attention group of ``BLOCK_SIZE``-token blocks, one
    block per chunk, ``chunk_bytes`` per block over ``world_size`` workers."""
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=BLOCK_SIZE, layer_names=("layer.0",), group_id=0),),
        worker_kv_bytes_per_block=chunk_bytes // world_size,
        enable_kv_cache_events=False,
        extra_config={
            "spec_name": "TieringOffloadingSpec",
            "cpu_bytes_to_use": num_chunks * max(chunk_bytes, 4096),
            "secondary_tiers": secondary_tiers,
        },
        engine_id=f"kvs-tier-test-{uuid.uuid4().hex[:12]}",
        model=OffloadingModelConfig(name="test-model", dtype="float16", max_model_len=4096),
        cache=OffloadingCacheConfig(tokens_per_hash=BLOCK_SIZE, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=0,
            world_size=world_size,
            tp_size=world_size,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=False,
        ),
    )


WAIT_S = 30
"""A bound on every wait of a test on an event or a thread, seconds (never reached when things work)."""


def key_of(name: str) -> bytes:
    """The offload key ``name`` (group 0) names."""
    return chunk_key(name)


def hash_of(name: str) -> bytes:
    """The 32-byte block hash of key ``name`` (the key without its 4-byte group index)."""
    return key_of(name)[:-4]


def data_of(name: str) -> bytes:
    """The bytes of key ``name``'s chunk (a function of the key)."""
    return chunk_bytes_of(key_of(name))


def named_rows(*names: str) -> torch.Tensor:
    """Rows holding the chunks of ``names``, in order."""
    rows = torch.zeros((max(1, len(names)), CHUNK_BYTES), dtype=torch.uint8)
    for i, name in enumerate(names):
        rows[i].copy_(torch.frombuffer(bytearray(data_of(name)), dtype=torch.uint8))
    return rows


def row_bytes(rows: torch.Tensor, i: int) -> bytes:
    return bytes(rows[i].numpy())
