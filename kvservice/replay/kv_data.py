"""``replay --kv-data``: a worker beside the scheduler that moves real block contents and checks them.

The content of a block is a function of its hash and layer, so anyone can check it: a block's
bytes (the wire layout of ``kvservice.server.data_plane``: the group's views in order, row-major)
split into ``num_layers`` equal slices, layer ``l``'s slice is the little-endian int64 word
``xxh3_64(block_hash + l as 4 little-endian bytes)`` repeated (:func:`layer_word`). With today's
layouts the first axis of a group's block view is the layer, so the slices are the layers.

After every Step RPC the scheduler hands the worker what it learned (:meth:`KVDataWorker.admitted`,
:meth:`KVDataWorker.allocated`) and awaits :meth:`KVDataWorker.flush` before its next RPC:

- every block a request's allocation made full (``num_computed_tokens`` crossed its end) is
  written: ``shm`` through the attached memory (``kvservice_client.torch_view``), then marked
  written (``WriteBlocks`` chunks ``in_memory``, no bytes: the server cannot see stores into
  mapped memory), ``grpc`` by ``WriteBlocks`` naming the request (which the server checks against
  its write rule);
- at every admission, the blocks of the hit (``AllocateSlotsResponse.computed_block_ids``) are
  read back (``shm``: from the attached memory; ``grpc``: ``ReadBlocks`` by block id) and
  compared with the content their hashes name: a block id that does not hold its hash's data
  (a block-id bug that keeps the events consistent) is a mismatch.
- a hit can come before its block's bytes are written (vLLM registers a block's hash at
  allocation: a request admitted in the same step as the one computing its prefix hits blocks
  this worker writes only at the flush). Such a read is counted (``reads_before_written``):
  ``grpc`` reads it first and expects the server to refuse it (FAILED_PRECONDITION, "not written
  yet"; bytes served instead are a mismatch when they are not the hash's); both modes check it
  again after the flush's writes. A hit on a block whose bytes will never be written (its request
  was freed before this worker wrote it) is refused by the server too and counted
  (``reads_never_written``), never compared with old bytes.
- writes name the request's allocation (``allocation_id`` and epoch of its admission), so a write
  the server took for another admission of the same request id would be refused.

``sample`` N moves only blocks whose hash's last 8 bytes are 0 mod N (a hash decides, so a block
is either always moved and checked or never).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import xxhash

from kvservice_client._proto.kvservice.v1 import kv_cache_service_pb2 as pb
from kvservice_client.client import AsyncKVCacheClient, KVServiceError, StatusCode
from kvservice_client.data import amark_blocks_written, aread_blocks, awrite_blocks, block_ref
from kvservice_client.hashing import BlockHasher, resolve_block_hashes

__all__ = ["KVDataStats", "KVDataWorker", "block_bytes", "layer_word"]


def layer_word(block_hash: bytes, layer: int) -> int:
    """The int64 word layer ``layer`` of the block ``block_hash`` is filled with."""
    return int.from_bytes(xxhash.xxh3_64_digest(block_hash + layer.to_bytes(4, "little")), "little", signed=True)


def block_bytes(block_hash: bytes, num_layers: int, num_bytes: int) -> bytes:
    """The ``num_bytes`` bytes a block of ``num_layers`` equal layer slices holds under
    ``block_hash``: slice ``l`` is :func:`layer_word` ``(block_hash, l)`` repeated, little-endian.

    Raises:
        ValueError: ``num_bytes`` is not ``num_layers`` slices of whole 8-byte words.
    """
    layer_bytes, rest = divmod(num_bytes, num_layers)
    if rest or layer_bytes % 8:
        raise ValueError(f"{num_bytes} bytes are not {num_layers} layers of whole 8-byte words")
    return b"".join(
        layer_word(block_hash, layer).to_bytes(8, "little", signed=True) * (layer_bytes // 8)
        for layer in range(num_layers)
    )


@dataclass
class KVDataStats:
    """What the worker moved and checked (report.json's ``kv_data``).

    Attributes:
        mode: "shm" or "grpc".
        bytes_written, bytes_read: block bytes written and read back.
        write_s, read_s: wall time spent writing and reading, in seconds.
        blocks_written: blocks written.
        blocks_checked: hit blocks read back and compared.
        mismatches: hit blocks whose bytes were not their hash's content.
        sample: 1 in ``sample`` blocks moved (by hash).
    """

    mode: str
    bytes_written: int = 0
    bytes_read: int = 0
    write_s: float = 0.0
    read_s: float = 0.0
    blocks_written: int = 0
    blocks_checked: int = 0
    mismatches: int = 0
    reads_before_written: int = 0
    reads_never_written: int = 0
    writes_after_free: int = 0
    sample: int = 1
    lag: int = 0

    def to_dict(self) -> dict[str, Any]:
        """The report's ``kv_data`` object (GB/s are 1e9 bytes per second of time spent moving)."""
        return {
            "mode": self.mode,
            "bytes_written": self.bytes_written,
            "bytes_read": self.bytes_read,
            "write_gbps": self.bytes_written / self.write_s / 1e9 if self.write_s else None,
            "read_gbps": self.bytes_read / self.read_s / 1e9 if self.read_s else None,
            "blocks_written": self.blocks_written,
            "blocks_checked": self.blocks_checked,
            "mismatches": self.mismatches,
            "reads_before_written": self.reads_before_written,
            "reads_never_written": self.reads_never_written,
            "writes_after_free": self.writes_after_free,
            "sample": self.sample,
            "lag": self.lag,
        }


_Write = tuple[str, int, int, bytes, "_Tracked"]
"""A block to write: (request_id, group, block_id, block hash, the admission that computed it)."""


class _Tracked:
    """A request as the worker follows it: its block table per group and its block hashes."""

    __slots__ = ("tables", "digests", "allocation")

    def __init__(self, num_groups: int, allocation: tuple[int, str]) -> None:
        self.tables: list[list[int]] = [[] for _ in range(num_groups)]
        self.digests: list[bytes] = []
        self.allocation = allocation  # (allocation_id, epoch) of its admission


class KVDataWorker:
    """Writes newly computed blocks and checks hits (see the module docstring).

    Args:
        mode: "shm" (through ``view``) or "grpc" (WriteBlocks / ReadBlocks through ``client``).
        client: the service.
        metadata: its ``GetKVCacheGroupMetadata``.
        view: the attached memory (``kvservice_client.torch_view.KVCacheView``; shm mode).
        sample: move 1 in ``sample`` blocks (by hash).
        lag: write a step's blocks ``lag`` flushes later (a worker behind its scheduler, as an
            asynchronous one is): hits then come before their bytes, and requests are freed before
            their blocks are written.
    """

    def __init__(
        self,
        mode: str,
        client: AsyncKVCacheClient,
        metadata: pb.GetKVCacheGroupMetadataResponse,
        *,
        view: Any = None,
        sample: int = 1,
        lag: int = 0,
    ) -> None:
        if mode not in ("shm", "grpc"):
            raise ValueError(f"mode must be 'shm' or 'grpc'; got {mode!r}")
        if mode == "shm" and view is None:
            raise ValueError("shm mode needs the attached view")
        if sample < 1:
            raise ValueError(f"sample must be >= 1; got {sample}")
        if lag < 0:
            raise ValueError(f"lag must be >= 0; got {lag}")
        self.mode = mode
        self.client = client
        self.view = view
        self.sample = sample
        self.stats = KVDataStats(mode, sample=sample, lag=lag)
        self.lag = lag
        self.hasher = BlockHasher(metadata.hash_block_size, metadata.hash_algorithm, metadata.hash_seed)
        self.hash_block_size = metadata.hash_block_size
        self.block_sizes = [g.block_size for g in metadata.groups]
        self.num_layers = [g.num_layers for g in metadata.groups]
        self.bytes_per_block = [g.bytes_per_block for g in metadata.groups]
        self.chunk_bytes = metadata.max_data_chunk_bytes
        self._requests: dict[str, _Tracked] = {}
        self._writes: list[_Write] = []
        self._queue: deque[list[_Write]] = deque()  # the writes of the last `lag` flushes, oldest first
        self._pending: dict[tuple[int, int], int] = {}  # (group, block_id) -> queued writes of it
        self._deferred: dict[tuple[int, int], list[tuple[int, int, bytes]]] = {}  # checks awaiting a write
        self._dropped: dict[tuple[int, int], bytes] = {}  # shm: (group, block_id) -> hash never written
        self._checks: list[tuple[int, int, bytes]] = []  # (group, block_id, block hash)
        self._layer_shapes: dict[int, list[Any]] = {}

    # -- what the scheduler tells it --------------------------------------------------------------

    def admitted(self, request_id: str, token_ids: Sequence[int], response: pb.AllocateSlotsResponse) -> None:
        """A request was admitted with this allocation: check its hit, then (like :meth:`allocated`)
        write what it computed."""
        allocation = (response.allocation_id, response.epoch) if response.allocation_id else (0, "")
        tracked = self._requests[request_id] = _Tracked(len(self.block_sizes), allocation)
        self.hasher.extend(tracked.digests, token_ids)
        for g, (hit, new) in enumerate(zip(response.computed_block_ids, response.new_block_ids)):
            tracked.tables[g].extend(hit.block_ids)
            for position, block_id in enumerate(hit.block_ids):
                block_hash = self._group_hash(tracked, g, position)
                if block_id and self._sampled(block_hash):
                    self._checks.append((g, block_id, block_hash))
            tracked.tables[g].extend(new.block_ids)
        self._queue_writes(request_id, tracked, response.num_new_computed_tokens, response.num_computed_tokens)

    def allocated(
        self, request_id: str, token_ids: Sequence[int], num_computed_before: int, response: pb.AllocateSlotsResponse
    ) -> None:
        """A running request's allocation went through: its tokens were computed up to
        ``response.num_computed_tokens``."""
        tracked = self._requests[request_id]
        for g, new in enumerate(response.new_block_ids):
            tracked.tables[g].extend(new.block_ids)
        self.hasher.extend(tracked.digests, token_ids)
        self._queue_writes(request_id, tracked, num_computed_before, response.num_computed_tokens)

    def forget(self, request_id: str) -> None:
        """The request was freed (finished or preempted)."""
        self._requests.pop(request_id, None)

    # -- moving bytes -----------------------------------------------------------------------------

    async def flush(self) -> None:
        """Do the queued checks, then the writes that are due (this flush's with ``lag`` 0; those of
        ``lag`` flushes ago otherwise). Checks go first: they read blocks of the cache as the
        admission found it. A check of a block with a write still queued is a hit before its bytes:
        counted, tried over gRPC (the server must refuse it), and checked once the write is done, or
        counted as never written when its request was freed first."""
        checks, self._checks = self._checks, []
        self._queue.append(self._writes)
        for _r, g, block_id, _h, _t in self._writes:
            self._pending[(g, block_id)] = self._pending.get((g, block_id), 0) + 1
        self._writes = []
        if self.mode == "shm" and self._dropped:  # gRPC asks the server; through memory, only we know
            never = [c for c in checks if self._dropped.get((c[0], c[1])) == c[2]]
            self.stats.reads_never_written += len(never)
            checks = [c for c in checks if self._dropped.get((c[0], c[1])) != c[2]]
        early = [c for c in checks if (c[0], c[1]) in self._pending]
        ready = [c for c in checks if (c[0], c[1]) not in self._pending]
        self.stats.reads_before_written += len(early)
        if ready:
            await (self._check_shm(ready) if self.mode == "shm" else self._check_grpc(ready))
        if early and self.mode == "grpc":
            await self._read_before_written(early)
        for check in early:
            self._deferred.setdefault((check[0], check[1]), []).append(check)
        if len(self._queue) <= self.lag:
            return
        due = self._queue.popleft()
        live = [w for w in due if self._requests.get(w[0]) is w[4]]
        stale = [w for w in due if self._requests.get(w[0]) is not w[4]]
        for _r, g, block_id, _h, _t in due:
            key = (g, block_id)
            self._pending[key] -= 1
            if not self._pending[key]:
                del self._pending[key]
        if live:
            await (self._write_shm(live) if self.mode == "shm" else self._write_grpc(live))
        if stale:
            await self._write_after_free(stale)
        after: list[tuple[int, int, bytes]] = []
        for request_id, g, block_id, block_hash, tracked in due:
            written = self._requests.get(request_id) is tracked
            for check in self._deferred.pop((g, block_id), []):
                if written and check[2] == block_hash:
                    after.append(check)
                else:  # its computer was freed first (or the block reused before its bytes came)
                    self.stats.reads_never_written += 1
        if after:
            await (self._check_shm(after) if self.mode == "shm" else self._check_grpc(after))

    async def _write_after_free(self, writes: list[_Write]) -> None:
        """Writes whose request was freed (or freed and admitted again) before they were due:
        ``shm`` drops them (the block may hold another request's bytes by now); ``grpc`` sends them
        naming their old allocation and expects the server to refuse each (a write it took would
        land under a hash that is not the block's: a mismatch)."""
        self.stats.writes_after_free += len(writes)
        if self.mode == "shm":
            for _r, g, block_id, block_hash, _t in writes:
                self._dropped[(g, block_id)] = block_hash
            return
        for request_id, g, block_id, block_hash, tracked in writes:
            try:
                await awrite_blocks(
                    self.client,
                    request_id,
                    [(g, block_id, self.expected_bytes(g, block_hash))],
                    allocation=tracked.allocation if tracked.allocation[0] else None,
                    chunk_bytes=self.chunk_bytes,
                )
            except KVServiceError as err:
                if err.code != StatusCode.FAILED_PRECONDITION:
                    raise
                continue
            self.stats.mismatches += 1

    def _sampled(self, block_hash: bytes) -> bool:
        return self.sample == 1 or int.from_bytes(block_hash[-8:], "big") % self.sample == 0

    def _group_hash(self, tracked: _Tracked, group_idx: int, position: int) -> bytes:
        block_size = self.block_sizes[group_idx]
        if block_size == self.hash_block_size:
            return tracked.digests[position]
        return resolve_block_hashes(tracked.digests, self.hash_block_size, block_size)[position]

    def _queue_writes(self, request_id: str, tracked: _Tracked, computed_before: int, computed_after: int) -> None:
        for g, block_size in enumerate(self.block_sizes):
            table = tracked.tables[g]
            for position in range(computed_before // block_size, computed_after // block_size):
                block_id = table[position]
                if not block_id:
                    continue  # a position the group does not keep (sliding window)
                block_hash = self._group_hash(tracked, g, position)
                if self._sampled(block_hash):
                    self._writes.append((request_id, g, block_id, block_hash, tracked))

    def _words(self, group_idx: int, block_hash: bytes) -> list[int]:
        return [layer_word(block_hash, layer) for layer in range(self.num_layers[group_idx])]

    def expected_bytes(self, group_idx: int, block_hash: bytes) -> bytes:
        """The block's bytes its hash names (wire layout)."""
        return block_bytes(block_hash, self.num_layers[group_idx], self.bytes_per_block[group_idx])

    def _layer_views(self, group_idx: int, block_id: int) -> list[tuple[torch.Tensor, int, int]]:
        """Per view of the block: (its int64 view, first layer, layers it holds)."""
        views = self.view.block_view(group_idx, block_id)
        layer_bytes = self.bytes_per_block[group_idx] // self.num_layers[group_idx]
        out = []
        layer = 0
        for v in views:
            nbytes = v.numel() * v.element_size()
            n = nbytes // layer_bytes
            assert n * layer_bytes == nbytes and (n == 1 or v.shape[0] == n), "a view is not whole layers"
            out.append((v.view(torch.int64), layer, n))
            layer += n
        return out

    def _expected_tensor(self, v64: torch.Tensor, words: list[int]) -> torch.Tensor:
        word_tensor = torch.tensor(words, dtype=torch.int64, device=v64.device)
        return word_tensor.view(len(words), *([1] * (v64.dim() - 1))).expand_as(v64) if len(words) > 1 else word_tensor

    async def _write_shm(self, writes: list[_Write]) -> None:
        t0 = time.perf_counter()
        by_request: dict[str, list[tuple[int, int]]] = {}
        for request_id, g, block_id, block_hash, _tracked in writes:
            by_request.setdefault(request_id, []).append((g, block_id))
            self._dropped.pop((g, block_id), None)
            words = self._words(g, block_hash)
            for v64, first, n in self._layer_views(g, block_id):
                if n == 1:
                    v64.fill_(words[first])
                else:
                    v64.copy_(self._expected_tensor(v64, words[first : first + n]))
            self.stats.bytes_written += self.bytes_per_block[g]
        for request_id, blocks in by_request.items():
            await amark_blocks_written(self.client, request_id, blocks, allocation=self._allocation(request_id))
        self.stats.blocks_written += len(writes)
        self.stats.write_s += time.perf_counter() - t0

    def _allocation(self, request_id: str) -> tuple[int, str] | None:
        tracked = self._requests.get(request_id)
        return tracked.allocation if tracked is not None and tracked.allocation[0] else None

    async def _check_shm(self, checks: list[tuple[int, int, bytes]]) -> None:
        t0 = time.perf_counter()
        for g, block_id, block_hash in checks:
            words = self._words(g, block_hash)
            ok = True
            for v64, first, n in self._layer_views(g, block_id):
                if n == 1:
                    ok = ok and bool((v64 == words[first]).all())
                else:
                    ok = ok and torch.equal(v64, self._expected_tensor(v64, words[first : first + n]))
            self.stats.bytes_read += self.bytes_per_block[g]
            self.stats.blocks_checked += 1
            self.stats.mismatches += not ok
        self.stats.read_s += time.perf_counter() - t0

    async def _write_grpc(self, writes: list[_Write]) -> None:
        t0 = time.perf_counter()
        by_request: dict[str, list[tuple[int, int, bytes]]] = {}
        for request_id, g, block_id, block_hash, _tracked in writes:
            by_request.setdefault(request_id, []).append((g, block_id, block_hash))
        for request_id, blocks in by_request.items():
            allocation = self._allocation(request_id)
            response = await awrite_blocks(
                self.client,
                request_id,
                ((g, b, self.expected_bytes(g, h)) for g, b, h in blocks),
                allocation=allocation,
                chunk_bytes=self.chunk_bytes,
            )
            self.stats.bytes_written += response.num_bytes_written
            self.stats.blocks_written += response.num_blocks_written
        self.stats.write_s += time.perf_counter() - t0

    async def _check_grpc(self, checks: list[tuple[int, int, bytes]]) -> None:
        t0 = time.perf_counter()
        try:
            blocks = await aread_blocks(self.client, [block_ref(g, block_id=b) for g, b, _h in checks])
        except KVServiceError as err:
            if err.code != StatusCode.FAILED_PRECONDITION:
                raise
            # A block not written (its computer was freed first): read one by one, count those.
            for check in checks:
                try:
                    [block] = await aread_blocks(self.client, [block_ref(check[0], block_id=check[1])])
                except KVServiceError as one:
                    if one.code != StatusCode.FAILED_PRECONDITION:
                        raise
                    self.stats.reads_never_written += 1
                    continue
                self._compare(block, check)
        else:
            for block, check in zip(blocks, checks, strict=True):
                self._compare(block, check)
        self.stats.read_s += time.perf_counter() - t0

    def _compare(self, block: Any, check: tuple[int, int, bytes]) -> None:
        assert block.data is not None  # read by id: never evicted
        self.stats.bytes_read += len(block.data)
        self.stats.blocks_checked += 1
        self.stats.mismatches += block.data != self.expected_bytes(check[0], check[2])

    async def _read_before_written(self, checks: list[tuple[int, int, bytes]]) -> None:
        """Read blocks nobody wrote yet: the server must refuse each (FAILED_PRECONDITION); bytes
        it serves instead count as a mismatch unless they are the hash's."""
        for g, block_id, block_hash in checks:
            try:
                [block] = await aread_blocks(self.client, [block_ref(g, block_id=block_id)])
            except KVServiceError as err:
                if err.code != StatusCode.FAILED_PRECONDITION:
                    raise
                continue
            self.stats.mismatches += block.data != self.expected_bytes(g, block_hash)
