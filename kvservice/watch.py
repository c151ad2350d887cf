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
        g = event.group_idx if event.group_idx is not None else 0  # type: ignore[attr-defined]  # dispatch on type(event) is X, which mypy does not narrow from the KVCacheEvent base
        kind = event.kv_cache_spec_kind or "?"  # type: ignore[attr-defined]  # dispatch on type(event) is X, which mypy does not narrow from the KVCacheEvent base
        window = event.kv_cache_spec_sliding_window  # type: ignore[attr-defined]  # dispatch on type(event) is X, which mypy does not narrow from the KVCacheEvent base
        head = f"{tag} {type(event).__name__} group={g} kind={kind} window={window if window is not None else '-'}"
        hashes = " ".join(short_hash(h) for h in event.block_hashes[:4])  # type: ignore[attr-defined]  # dispatch on type(event) is X, which mypy does not narrow from the KVCacheEvent base
        if len(event.block_hashes) > 4:  # type: ignore[attr-defined]  # dispatch on type(event) is X, which mypy does not narrow from the KVCacheEvent base
            hashes += f" ...(+{len(event.block_hashes) - 4})"  # type: ignore[attr-defined]  # dispatch on type(event) is X, which mypy does not narrow from the KVCacheEvent base
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
) -> int:
    """Stream ``target``'s events and print one line per event until the stream ends.

    Args:
        target: the server's ``host:port``.
        snapshot: start with a snapshot of the cached set (else live, or from ``start_seq``).
        start_seq: replay retained batches from this seq, then follow live.
        group_idxs: only these groups' events (empty: all).
        token: bearer token sent on every call.
        out: where lines go (default stdout).
        max_batches: stop after this many batches (None: until the stream ends).
        credentials: channel credentials (TLS, mutual TLS) for a secure channel; None: plain text.

    Returns:
        Batches printed (stops after ``max_batches`` when given).

    Raises:
        kvservice_client.client.KVServiceError: the target cannot be reached, or the stream ended
            with an error status (the message says which, with the code).
    """
    import sys

    out = out or sys.stdout
    formatter = EventFormatter()
    num_batches = 0
    async with AsyncKVCacheClient(target, token=token, credentials=credentials) as client:
        try:
            meta = await client.get_kv_cache_group_metadata()
        except KVServiceError as e:
            what = "cannot reach" if e.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED) else "refused by"
            raise KVServiceError(e.code, f"{what} {target}: {e.code.name}: {e.message}") from e
        print(
            f"# {target}: epoch {meta.epoch}, head seq {meta.head_seq}, {len(meta.groups)} group(s), "
            f"hash {meta.hash_algorithm}",
            file=out,
            flush=True,
        )
        try:
            async for msg in client.stream_events(snapshot=snapshot, start_seq=start_seq, group_idxs=group_idxs):
                batch = proto_to_batch(msg)
                for event in batch.events:
                    print(formatter.format(msg.seq, event, snapshot=msg.snapshot), file=out, flush=True)
                num_batches += 1
                if max_batches is not None and num_batches >= max_batches:
                    break
        except KVServiceError as e:
            raise KVServiceError(e.code, f"stream ended: {e.code.name}: {e.message}") from e
    return num_batches
