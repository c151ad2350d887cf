"""``kvservice watch``: the live KV event stream, one readable line per event."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TextIO

import grpc

from kvservice_client.client import AsyncKVCacheClient, KVServiceError
from kvservice_client.convert import proto_to_batch
from kvservice_client.events import AllBlocksCleared, BlockRemoved, BlockStored, ExternalBlockHash, KVCacheEvent

__all__ = ["EventFormatter", "watch_events"]


def short_hash(block_hash: ExternalBlockHash | None) -> str:
    """The first 8 hex digits of a hash (ints as 16-digit big-endian hex)."""
    if block_hash is None:
        return "-"
    text = block_hash.hex() if isinstance(block_hash, bytes) else f"{block_hash:016x}"
    return text[:8]


class EventFormatter:
    """Formats events; tracks each stored hash's block position to print token spans.

    A block's span is known when its chain is known from block 0 (parent None) or from a hash seen
    earlier on this stream; otherwise it prints ``?``.
    """

    def __init__(self, max_tracked: int = 1_000_000) -> None:
        self._end_block: list[dict[ExternalBlockHash, int]] = []
        self._max_tracked = max_tracked

    def _group(self, group_idx: int) -> dict[ExternalBlockHash, int]:
        while len(self._end_block) <= group_idx:
            self._end_block.append({})
        return self._end_block[group_idx]

    def format(self, seq: int, event: KVCacheEvent, *, snapshot: bool = False) -> str:
        """One line: seq, type, group, kind, window, session, hashes (shortened), token span."""
        tag = f"seq={seq}{'*' if snapshot else ''}"
        if isinstance(event, AllBlocksCleared):
            for group in self._end_block:
                group.clear()
            return f"{tag} AllBlocksCleared"
        assert isinstance(event, (BlockStored, BlockRemoved)), f"not a KV event: {event!r}"
        g = event.group_idx if event.group_idx is not None else 0
        kind = event.kv_cache_spec_kind or "?"
        window = event.kv_cache_spec_sliding_window
        head = f"{tag} {type(event).__name__} group={g} kind={kind} window={window if window is not None else '-'}"
        hashes = " ".join(short_hash(h) for h in event.block_hashes[:4])
        if len(event.block_hashes) > 4:
            hashes += f" ...(+{len(event.block_hashes) - 4})"
        if isinstance(event, BlockRemoved):
            group = self._group(g)
            for h in event.block_hashes:
                group.pop(h, None)
            return f"{head} blocks={len(event.block_hashes)} [{hashes}]"
        assert isinstance(event, BlockStored)
        group = self._group(g)
        parent = event.parent_block_hash
        start = 0 if parent is None else group.get(parent)
        if start is not None:
            for i, h in enumerate(event.block_hashes):
                if len(group) < self._max_tracked:
                    group[h] = start + i + 1
            span = f"tokens[{start * event.block_size}:{(start + len(event.block_hashes)) * event.block_size})"
        else:
            span = f"tokens[?:+{len(event.token_ids)})"
        extra = " reused" if event.reused else ""
        session = event.session_id if event.session_id is not None else "-"
        return (
            f"{head} session={session} parent={short_hash(parent)} blocks={len(event.block_hashes)} "
            f"[{hashes}] {span}{extra}"
        )


_RESYNC_CODES = (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.OUT_OF_RANGE)
"""Codes of a resume that cannot continue where it was (another epoch, below retention)."""

_FATAL_CODES = (
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.UNIMPLEMENTED,
    grpc.StatusCode.NOT_FOUND,
)
"""Codes a retry cannot fix: the watch ends with them."""


async def watch_events(
    target: str,
    *,
    snapshot: bool = False,
    start_seq: int | None = None,
    group_idxs: Sequence[int] = (),
    token: str | None = None,
    out: TextIO | None = None,
    max_batches: int | None = None,
    credentials: grpc.ChannelCredentials | None = None,
    reconnect: bool = True,
    max_backoff_s: float = 5.0,
) -> int:
    """Stream ``target``'s events and print one line per event.

    With ``reconnect`` (the default) a stream that ends (the server stopped or restarted, the
    connection dropped, the stream fell behind) is reopened, with exponential backoff up to
    ``max_backoff_s`` seconds while the server cannot be reached, and resumes from the next seq in
    the same epoch, so no batch is printed twice or skipped. When the epoch changed (the server
    restarted) or the next seq left retention, a line starting ``# epoch changed`` (or ``# resume
    refused``) says so, and then: with ``snapshot``, a snapshot of the new cached set follows
    (``resync from a snapshot``); without, the watch follows the new epoch live from its head. A
    batch is never printed as if it continued another epoch.

    Args:
        target: the server's ``host:port``.
        snapshot: start with a snapshot of the cached set (else live, or from ``start_seq``); and
            resync from one after an epoch change.
        start_seq: replay retained batches from this seq, then follow live.
        group_idxs: only these groups' events (empty: all).
        token: bearer token sent on every call.
        out: where lines go (default stdout).
        max_batches: stop after this many batches (None: until the stream ends).
        credentials: channel credentials (TLS, mutual TLS) for a secure channel; None: plain text.
        reconnect: reopen ended streams (False: one-shot, the first end is raised).
        max_backoff_s: longest wait between reconnect attempts, seconds.

    Returns:
        Batches printed (stops after ``max_batches`` when given).

    Raises:
        kvservice_client.client.KVServiceError: the target cannot be reached at the start, or the
            stream ended with a status a retry cannot fix (or any status without ``reconnect``);
            the message says which, with the code.
    """
    import asyncio
    import sys

    out = out or sys.stdout
    formatter = EventFormatter()
    num_batches = 0
    epoch: str | None = None  # the epoch of the batches printed so far
    next_seq = start_seq  # where a resume continues (None: not yet known)
    want_snapshot = snapshot
    backoff_s = 0.0
    async with AsyncKVCacheClient(target, token=token, credentials=credentials) as client:
        while True:
            try:
                meta = await client.get_kv_cache_group_metadata()
            except KVServiceError as e:
                unreachable = e.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
                if epoch is None or not reconnect or not unreachable:
                    what = "cannot reach" if unreachable else "refused by"
                    raise KVServiceError(e.code, f"{what} {target}: {e.code.name}: {e.message}") from e
                backoff_s = min(max_backoff_s, max(0.05, backoff_s * 2))
                await asyncio.sleep(backoff_s)
                continue
            if epoch is None:
                print(
                    f"# {target}: epoch {meta.epoch}, head seq {meta.head_seq}, {len(meta.groups)} group(s), "
                    f"hash {meta.hash_algorithm}",
                    file=out,
                    flush=True,
                )
            elif meta.epoch != epoch:
                next_seq = _resync(
                    out, snapshot, f"# epoch changed {epoch} -> {meta.epoch} (the server restarted)", meta.head_seq
                )
                want_snapshot = snapshot
                epoch = None
                formatter = EventFormatter()  # the old epoch's chains mean nothing now
            elif next_seq is not None and not want_snapshot:
                print(f"# reconnected to {target}: epoch {epoch}, resuming from seq {next_seq}", file=out, flush=True)
            if want_snapshot:
                stream = client.stream_events(snapshot=True, group_idxs=group_idxs)
            elif next_seq is not None:
                stream = client.stream_events(start_seq=next_seq, epoch=epoch or None, group_idxs=group_idxs)
            else:
                stream = client.stream_events(group_idxs=group_idxs)
            try:
                async for msg in stream:
                    backoff_s = 0.0
                    if epoch is None:
                        epoch = msg.epoch or meta.epoch
                    batch = proto_to_batch(msg)
                    for event in batch.events:
                        print(formatter.format(msg.seq, event, snapshot=msg.snapshot), file=out, flush=True)
                    if not (msg.snapshot and msg.snapshot_more):
                        next_seq = msg.seq + 1
                        want_snapshot = False
                    num_batches += 1
                    if max_batches is not None and num_batches >= max_batches:
                        return num_batches
                if epoch is None:
                    epoch = meta.epoch
                raise KVServiceError(grpc.StatusCode.UNAVAILABLE, "the stream ended without a status")
            except KVServiceError as e:
                if epoch is None:
                    epoch = meta.epoch
                if not reconnect or e.code in _FATAL_CODES:
                    raise KVServiceError(e.code, f"stream ended: {e.code.name}: {e.message}") from e
                if e.code in _RESYNC_CODES:
                    if e.code == grpc.StatusCode.FAILED_PRECONDITION:
                        continue  # another epoch: the metadata says which, next round
                    next_seq = _resync(out, snapshot, f"# resume refused: {e.code.name}: {e.message}", None)
                    want_snapshot = snapshot
                    continue
                if next_seq is None:
                    next_seq = meta.head_seq + 1
                print(f"# stream ended: {e.code.name}: {e.message}; reconnecting", file=out, flush=True)
                backoff_s = min(max_backoff_s, max(0.05, backoff_s * 2))
                await asyncio.sleep(backoff_s)


def _resync(out: TextIO, snapshot: bool, why: str, head_seq: int | None) -> int | None:
    """Print why the watch cannot continue where it was and what it does instead; the next seq
    to follow (None: live, or a snapshot's)."""
    if snapshot:
        print(f"{why}: resync from a snapshot", file=out, flush=True)
        return None
    where = f"from seq {head_seq + 1}" if head_seq is not None else "from the head"
    print(
        f"{why}: following live {where}; blocks announced before are not shown (--snapshot resyncs)",
        file=out,
        flush=True,
    )
    return None if head_seq is None else head_seq + 1
