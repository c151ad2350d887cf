"""A bounded concurrent soak of one kvservice server: schedulers, watchers that get killed, restarts.

One in-process server (``start_server``, check_invariants on, a small pool so blocks are evicted)
is driven by ``num_schedulers`` scheduler clients and followed by ``num_watchers`` watchers, all on
one asyncio loop:

* **Schedulers** (each an :class:`AsyncKVCacheClient` on its own channel, with its own seeded RNG)
  run requests whose prompts share prefixes (so blocks are shared and cached): GetComputedBlocks,
  AllocateSlots (chunked prefill, then decode appends), Free, occasional Steps batching decodes and
  frees, rare ResetPrefixCache. A refused allocation preempts (free, retry later). A call that
  fails UNAVAILABLE/CANCELLED (the server went away) or NOT_FOUND (it came back empty) makes the
  scheduler wait for the channel, read the server's epoch, free what it still holds and start its
  requests again.
* **Watchers** are lineages: each keeps a mirror (an unbounded :class:`PrefixIndex`) fed by an
  :class:`EventWatcher`. Lineages are killed at seeded points (the consuming task cancelled, the
  channel closed under the watcher, or an outage during which the lineage stays dead) and
  reconnected: a new watcher resumes from the lineage's last applied (seq, epoch), or starts from
  a snapshot when the lineage was inside one. After a server restart nobody tells the watchers:
  each must notice the new epoch and rebuild from a snapshot by itself.
* **Director**: at seeded points of the run it drains every scheduler and resets the prefix cache
  (one AllBlocksCleared), and it stops the server and starts a new one on the same port (a new
  epoch) while the schedulers run.

Checks (all counted in :class:`SoakReport`; :attr:`SoakReport.problems` lists every failure):

* the server's own invariant check after every mutating call and Step (``check_invariants``);
* per lineage, the applied (epoch, seq) sequence (:func:`check_applied_sequence`): within an epoch
  strictly consecutive from a snapshot watermark or a resume point, across kills; a live batch of
  another epoch only after a snapshot of it;
* at the end, once every lineage has applied the server's head seq: each mirror equals the event
  log's cached set and the block pool's (nothing lost, nothing extra); no request or block is left.

The run is bounded by ``ops_per_scheduler`` (deterministic op counts; the test) or by
``duration_s`` of wall time (longer runs from the command line)::

    .venv/bin/python -m tests.soak --duration-s 180 --seed 1
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import json
import logging
import os
import random
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

os.environ.setdefault("GRPC_VERBOSITY", "ERROR")  # gRPC core's INFO lines (GOAWAY on restart) are noise here

import click  # noqa: E402
import grpc  # noqa: E402

from kvservice.server.app import RunningServer, start_server  # noqa: E402
from kvservice.server.settings import at_least, check_fields, positive, setting  # noqa: E402
from kvservice_client.client import AsyncKVCacheClient, KVServiceError, StepBuilder, step_results  # noqa: E402
from kvservice_client.hashing import block_hash_to_int  # noqa: E402
from kvservice_client.watcher import EventWatcher, PrefixIndex, RetryPolicy, WatchedBatch  # noqa: E402

__all__ = [
    "AppliedRecord",
    "SoakConfig",
    "SoakReport",
    "check_applied_sequence",
    "main",
    "run_soak",
]

logger = logging.getLogger("kvservice.soak")

CHANNEL_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.use_local_subchannel_pool", 1),  # each client its own connection
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 500),
]
"""Client channels: their own connection, and quick reconnection after a server restart."""

WATCHER_CHANNEL_OPTIONS: list[tuple[str, Any]] = [
    *CHANNEL_OPTIONS,
    ("grpc.http2.bdp_probe", 0),  # a small, fixed receive window: a stalled watcher holds up the
    ("grpc.http2.lookahead_bytes", 4096),  # server's writes soon, and falls behind its bound
]
"""Watcher channels: as CHANNEL_OPTIONS, with a small HTTP/2 receive window."""

HANG_GUARD_S = 120.0
"""Bound of any one wait on the server or a watcher: a hang becomes a failure, never a pass (no
figure depends on it)."""

TRANSPORT_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED})
"""Statuses of a call the server dropped (stopping, restarting): the outcome is unknown."""


# =============================================================================================
# Configuration and report


@dataclass(frozen=True)
class SoakConfig:
    """One soak run.

    Attributes:
        num_schedulers: scheduler clients (>= 1).
        num_watchers: watcher lineages (>= 1).
        seed: seeds every random choice (prompts, ops, kill points and modes).
        ops_per_scheduler: RPCs each scheduler makes (a Step is one); bounds the run by op counts.
            Ignored when ``duration_s`` is set.
        duration_s: bound the run by wall time instead, in seconds (schedulers run until then).
        num_restarts: times the server is stopped and a new one started on the same port, at
            evenly spread points of the run.
        num_drain_resets: times every scheduler is drained and the prefix cache reset.
        num_kills: watcher kills, at seeded points of the run (>= 0).
        preset: the server's model KV layout.
        block_size: tokens per block.
        num_blocks: blocks in the pool, null block included (small: eviction happens).
        max_model_len: longest request, in tokens.
        max_live_requests: requests one scheduler keeps registered at once.
        event_max_batches: batches the server retains (small: a long outage resumes below it and
            gets OUT_OF_RANGE).
        max_subscriber_lag: batches a watcher may fall behind before the server ends its stream.
        port: the server's port (0: a free one; restarts reuse it).
    """

    num_schedulers: int = setting(8, check=at_least(1))
    num_watchers: int = setting(8, check=at_least(1))
    seed: int = 0
    ops_per_scheduler: int = setting(300, check=at_least(1))
    duration_s: float | None = setting(None, check=positive("seconds"))
    num_restarts: int = setting(1, check=at_least(0))
    num_drain_resets: int = setting(1, check=at_least(0))
    num_kills: int = setting(16, check=at_least(0))
    preset: str = "qwen-2.5-0.5b"
    block_size: int = setting(4, check=at_least(1))
    num_blocks: int = 96
    max_model_len: int = 128
    max_live_requests: int = setting(3, check=at_least(1))
    event_max_batches: int = setting(64, check=at_least(1))
    max_subscriber_lag: int = setting(64, check=at_least(1))
    port: int = setting(0, check=at_least(0))

    def __post_init__(self) -> None:
        check_fields(self)  # the same checks as the server's settings (kvservice.server.settings)
        if self.max_model_len < 4 * self.block_size:
            raise ValueError(
                f"max_model_len must be >= 4 blocks ({4 * self.block_size} tokens); got {self.max_model_len}"
            )


@dataclass
class SoakReport:
    """The figures of one run.

    Attributes:
        wall_s: the run's wall time, in seconds.
        ops: RPCs the schedulers made, by type (``step_ops`` counts the ops inside Steps).
        scheduler: scheduler events (requests started, finished, preempted, restarted after a
            server restart, prefix-hit tokens, dropped calls, resets done/refused ...).
        watcher: watcher events (kills by mode, new watchers resuming or from a snapshot, the
            watchers' own reconnects and resyncs by reason, batches/events/snapshots applied).
        num_restarts: server restarts done.
        epochs: the server epochs, in order.
        head_seqs: per epoch, the last seq it published.
        num_drain_resets: drains that ended with a successful ResetPrefixCache.
        num_invariant_checks: the servers' invariant checks (all epochs).
        num_invariant_failures: checks that failed (must be 0).
        num_sequence_checks: applied batches checked for order (all lineages).
        num_final_mirrors_checked: lineages whose mirror was compared with the server at the end.
        num_cached_blocks_final: (group, hash) pairs cached at the end.
        problems: everything that went wrong (empty for a clean run): sequence violations, mirror
            mismatches, invariant failures, unexpected errors, leaks.
    """

    wall_s: float = 0.0
    ops: Counter[str] = field(default_factory=Counter)
    scheduler: Counter[str] = field(default_factory=Counter)
    watcher: Counter[str] = field(default_factory=Counter)
    num_restarts: int = 0
    epochs: list[str] = field(default_factory=list)
    head_seqs: dict[str, int] = field(default_factory=dict)
    num_drain_resets: int = 0
    num_invariant_checks: int = 0
    num_invariant_failures: int = 0
    num_sequence_checks: int = 0
    num_final_mirrors_checked: int = 0
    num_cached_blocks_final: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Nothing lost, nothing broken."""
        return not self.problems

    def to_json(self) -> dict[str, Any]:
        """The report as plain JSON types."""
        out = dataclasses.asdict(self)
        for key in ("ops", "scheduler", "watcher"):
            out[key] = dict(sorted(getattr(self, key).items()))
        out["ok"] = self.ok
        return out

    def render(self) -> str:
        """The figures as text, one per line."""

        def counts(c: Counter[str]) -> str:
            return ", ".join(f"{k} {v:,}" for k, v in sorted(c.items())) or "none"

        lines = [
            f"wall time: {self.wall_s:.1f} s",
            f"scheduler ops ({sum(v for k, v in self.ops.items() if k != 'step_ops'):,} RPCs): {counts(self.ops)}",
            f"scheduler events: {counts(self.scheduler)}",
            f"watcher events: {counts(self.watcher)}",
            f"server restarts: {self.num_restarts}; epochs (last seq): "
            + ", ".join(f"{e[:8]} ({self.head_seqs.get(e, 0):,})" for e in self.epochs),
            f"drain + ResetPrefixCache: {self.num_drain_resets}",
            f"invariant checks: {self.num_invariant_checks:,} run, {self.num_invariant_failures} failed",
            f"applied-sequence checks: {self.num_sequence_checks:,} batches",
            f"final mirrors equal to the server's cached set: {self.num_final_mirrors_checked} "
            f"({self.num_cached_blocks_final:,} blocks cached at the end)",
            f"lost or broken: {len(self.problems)}" + "".join(f"\n  - {p}" for p in self.problems[:50]),
        ]
        return "\n".join(lines)


# =============================================================================================
# Applied-sequence check


class RecordKind(str, enum.Enum):
    """What a lineage did, as :class:`AppliedRecord` notes it."""

    START_SNAPSHOT = "start_snapshot"
    """A new watcher started from a snapshot (the next batch must be one)."""
    RESUME = "resume"
    """A new watcher resumed after (epoch, seq): its first batch must be seq + 1 (or a snapshot)."""
    SNAPSHOT = "snapshot"
    """A snapshot batch (part) was applied; seq = its watermark."""
    BATCH = "batch"
    """A live batch was applied."""


@dataclass(frozen=True, slots=True)
class AppliedRecord:
    """One step of a lineage's history.

    Attributes:
        kind: what happened.
        epoch: the epoch (None for START_SNAPSHOT).
        seq: the seq (a snapshot's watermark; the last seq applied before a RESUME).
        more: a snapshot part followed by another (same seq and epoch).
    """

    kind: RecordKind
    epoch: str | None = None
    seq: int = 0
    more: bool = False


def check_applied_sequence(records: Sequence[AppliedRecord]) -> tuple[int, list[str]]:
    """Check a lineage's applied batches: nothing skipped, nothing repeated, no epoch crossed blind.

    Rules: within an epoch, live batches are strictly consecutive from the last snapshot's
    watermark or the last live batch, whichever came last, across the lineage's watchers (a RESUME
    must name exactly the lineage's position); a snapshot may come at any time (a resync) but never
    rewinds its epoch below what was applied; the parts of a snapshot share its seq and epoch and
    nothing comes between them; a live batch needs a position in its own epoch (after a restart, a
    snapshot of the new epoch first); a watcher started from a snapshot gets one first.

    Returns:
        (batches checked, one message per violation).
    """
    problems: list[str] = []
    pos: tuple[str, int] | None = None  # (epoch, last seq) applied, complete
    in_snapshot: tuple[str, int] | None = None
    expect_snapshot = False
    num_checked = 0
    for i, rec in enumerate(records):
        where = f"record {i} ({rec.kind.value} epoch {str(rec.epoch)[:8]} seq {rec.seq})"
        if rec.kind is RecordKind.START_SNAPSHOT:
            expect_snapshot = True
            in_snapshot = None
        elif rec.kind is RecordKind.RESUME:
            if in_snapshot is not None or pos != (rec.epoch, rec.seq):
                problems.append(
                    f"{where}: resumes from a position the lineage is not at ({pos}, in snapshot {in_snapshot})"
                )
            expect_snapshot = False
            pos = (rec.epoch, rec.seq) if rec.epoch is not None else pos
        elif rec.kind is RecordKind.SNAPSHOT:
            num_checked += 1
            assert rec.epoch is not None
            if in_snapshot is not None:
                if in_snapshot != (rec.epoch, rec.seq):
                    problems.append(f"{where}: a snapshot part of another position than {in_snapshot}")
            elif pos is not None and pos[0] == rec.epoch and rec.seq < pos[1]:
                problems.append(f"{where}: a snapshot rewinds epoch to seq {rec.seq} after seq {pos[1]} was applied")
            expect_snapshot = False
            if rec.more:
                in_snapshot = (rec.epoch, rec.seq)
            else:
                in_snapshot = None
                pos = (rec.epoch, rec.seq)
        else:
            num_checked += 1
            assert rec.epoch is not None
            if in_snapshot is not None:
                problems.append(f"{where}: a live batch inside snapshot {in_snapshot}")
            elif expect_snapshot:
                problems.append(f"{where}: a live batch where a snapshot was asked for")
            elif pos is None:
                problems.append(f"{where}: a live batch with no position")
            elif pos[0] != rec.epoch:
                problems.append(f"{where}: a live batch of a new epoch without its snapshot (was at {pos})")
            elif rec.seq != pos[1] + 1:
                what = "skipped" if rec.seq > pos[1] + 1 else "repeated"
                problems.append(f"{where}: {what}: expected seq {pos[1] + 1}")
            in_snapshot = None
            pos = (rec.epoch, rec.seq)
    return num_checked, problems


# =============================================================================================
# Plumbing


class Signal:
    """Wake waiters when something changed; they re-check their condition (no polling, no sleeps)."""

    def __init__(self) -> None:
        self._future: asyncio.Future[None] | None = None

    def notify(self) -> None:
        """Wake every current waiter."""
        if self._future is not None and not self._future.done():
            self._future.set_result(None)
        self._future = None

    async def wait_until(self, predicate: Callable[[], bool], what: str, timeout_s: float = HANG_GUARD_S) -> None:
        """Return once ``predicate()`` holds, re-checked at every notify.

        Raises:
            TimeoutError: not reached within ``timeout_s`` seconds (a hang, named by ``what``).
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not predicate():
            if self._future is None:
                self._future = loop.create_future()
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise TimeoutError(f"soak: waited {timeout_s} s for {what}")
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._future), remaining)


class Progress:
    """How far the run is, 0..1: scheduler ops done over ops planned, or wall time over duration."""

    def __init__(self, config: SoakConfig) -> None:
        self.num_ops = 0
        self.planned_ops = config.num_schedulers * config.ops_per_scheduler
        self.duration_s = config.duration_s
        self.start = time.monotonic()
        self.signal = Signal()

    def op_done(self) -> None:
        """Count one scheduler op and wake the waiters."""
        self.num_ops += 1
        self.signal.notify()

    def fraction(self) -> float:
        """The part of the run done, 0..1."""
        if self.duration_s is not None:
            return min(1.0, (time.monotonic() - self.start) / self.duration_s)
        return min(1.0, self.num_ops / self.planned_ops)

    async def reach(self, fraction: float) -> None:
        """Return once the run is ``fraction`` done."""
        if self.duration_s is not None:
            await asyncio.sleep(max(0.0, self.start + fraction * self.duration_s - time.monotonic()))
            return
        # Ops stop while the director drains; the guard covers one whole run, not one wait.
        await self.signal.wait_until(
            lambda: self.fraction() >= fraction, f"{fraction:.0%} of the ops", 10 * HANG_GUARD_S
        )


class Harness:
    """What every task shares: the current server, the report, the pause protocol."""

    def __init__(self, config: SoakConfig, report: SoakReport) -> None:
        self.config = config
        self.report = report
        self.progress = Progress(config)
        self.running: RunningServer | None = None
        self.servers: list[RunningServer] = []
        self.address = ""
        # Pause protocol (drain + reset): schedulers park at their next op.
        self.pause_requested = False
        self.resumed = asyncio.Event()
        self.resumed.set()
        self.parked: set[int] = set()
        self.finished: set[int] = set()
        self.parked_signal = Signal()

    async def start(self) -> None:
        """Start a server (on the previous one's port after the first; check_invariants on)."""
        config = self.config
        port = self.running.port if self.running is not None else config.port
        self.running = await start_server(
            host="127.0.0.1",
            port=port,
            device="meta",
            preset=config.preset,
            block_size=config.block_size,
            num_blocks=config.num_blocks,
            max_model_len=config.max_model_len,
            grace_seconds=0.0,
            event_max_batches=config.event_max_batches,
            max_subscriber_lag=config.max_subscriber_lag,
            check_invariants=True,
        )
        self.servers.append(self.running)
        self.address = self.running.address
        self.report.epochs.append(self.running.event_log.epoch)
        logger.info("soak: server %s epoch %s", self.address, self.running.event_log.epoch)

    async def restart(self) -> None:
        """Stop the server (streams end UNAVAILABLE, calls in flight are cancelled) and start a new one
        on the same port: a new epoch, an empty cache."""
        assert self.running is not None
        await self.running.stop(0)
        await self.start()
        self.report.num_restarts += 1

    def problem(self, message: str) -> None:
        """Record something lost or broken (and log it at ERROR)."""
        logger.error("soak: %s", message)
        self.report.problems.append(message)


def _new_client(address: str, options: list[tuple[str, Any]] = CHANNEL_OPTIONS) -> AsyncKVCacheClient:
    return AsyncKVCacheClient(address, options=options, timeout=30.0)


async def _wait_connected(client: AsyncKVCacheClient) -> None:
    """Wait for the channel to be connected (gRPC reconnects on its own)."""
    await asyncio.wait_for(client.channel.channel_ready(), HANG_GUARD_S)


# =============================================================================================
# Schedulers


@dataclass
class _Req:
    rid: str
    prompt: list[int]
    target_len: int
    mode: str
    num_tokens: int = 0
    num_computed: int = 0
    admitted: bool = False

    def __post_init__(self) -> None:
        self.num_tokens = len(self.prompt)


class _ServerChanged(Exception):
    """The scheduler's calls failed because the server went away or came back empty."""

    def __init__(self, message: str, *, not_found: bool = False) -> None:
        super().__init__(message)
        self.not_found = not_found


class Scheduler:
    """One scheduler client: seeded requests over shared prefixes, one RPC per op.

    Args:
        idx: its index (request ids and the session id carry it).
        harness: the shared state.
        families: prompt prefixes shared by every scheduler.
    """

    def __init__(self, idx: int, harness: Harness, families: list[list[int]]) -> None:
        self.idx = idx
        self.harness = harness
        self.config = harness.config
        self.rng = random.Random(f"{harness.config.seed}/scheduler/{idx}")
        self.families = families
        self.reqs: dict[str, _Req] = {}
        self.retry: list[tuple[list[int], int, str]] = []  # prompts to run again (preempted, restarted)
        self.refused: list[str] = []  # requests whose allocation was refused: preempted after the op
        self.next_id = 0
        self.epoch = ""
        self.client: AsyncKVCacheClient | None = None
        self.stats = harness.report.scheduler
        self.ops = harness.report.ops

    # -- the loop -------------------------------------------------------------------------------

    async def run(self) -> None:
        """Make the scheduler's ops (or run until the duration is over), then free everything."""
        h = self.harness
        self.client = _new_client(h.address)
        try:
            await self._read_epoch()
            num_ops = 0
            while self._more(num_ops):
                if h.pause_requested:
                    await self._park()
                    continue
                try:
                    await self._one_op()
                    await self._preempt_refused()
                except _ServerChanged as changed:
                    await self._recover(changed.not_found)
                except KVServiceError as err:
                    h.problem(f"scheduler {self.idx}: unexpected {err}")
                    await self._recover(False)
                num_ops += 1
                h.progress.op_done()
            await self._drain()
        finally:
            h.finished.add(self.idx)
            h.parked_signal.notify()
            await self.client.close()

    def _more(self, num_ops: int) -> bool:
        if self.config.duration_s is not None:
            return self.harness.progress.fraction() < 1.0
        return num_ops < self.config.ops_per_scheduler

    async def _park(self) -> None:
        h = self.harness
        await self._drain()
        h.parked.add(self.idx)
        h.parked_signal.notify()
        await asyncio.wait_for(h.resumed.wait(), HANG_GUARD_S)
        h.parked.discard(self.idx)

    async def _drain(self) -> None:
        """Free every request this scheduler holds (recovering from a restart if one hits)."""
        while True:
            try:
                for rid in list(self.reqs):
                    await self._call("free", self._client().free(rid))
                    del self.reqs[rid]
                    self.stats["requests_drained"] += 1
                return
            except _ServerChanged as changed:
                await self._recover(changed.not_found)

    # -- RPCs and recovery ----------------------------------------------------------------------

    def _client(self) -> AsyncKVCacheClient:
        assert self.client is not None
        return self.client

    async def _call(self, op: str, coro: Any) -> Any:
        """Await one RPC, counting it; a dropped call or an unknown request raises _ServerChanged."""
        self.ops[op] += 1
        try:
            return await coro
        except KVServiceError as err:
            if err.code in TRANSPORT_CODES:
                self.stats["calls_dropped"] += 1
                raise _ServerChanged(str(err)) from None
            if err.code == grpc.StatusCode.NOT_FOUND:
                self.stats["not_found"] += 1
                raise _ServerChanged(str(err), not_found=True) from None
            raise

    async def _read_epoch(self) -> str:
        """The server's epoch, once it answers (a server that is stopping is retried after a short
        backoff: the channel may still look connected to it)."""
        while True:
            try:
                await _wait_connected(self._client())
                meta = await self._client().get_kv_cache_group_metadata()
                self.epoch = meta.epoch
                return meta.epoch
            except KVServiceError as err:
                if err.code not in TRANSPORT_CODES:
                    raise
                await asyncio.sleep(0.05)  # a retry backoff, not a synchronization

    async def _recover(self, not_found: bool) -> None:
        """After a dropped call or NOT_FOUND: wait for the server, free whatever it still holds of
        ours (ignoring NOT_FOUND) and run every request again from the start.

        A NOT_FOUND from the same epoch means scheduler and server disagree: a problem.
        """
        while True:
            before = self.epoch
            epoch = await self._read_epoch()
            if epoch != before:
                self.stats["epoch_changes_seen"] += 1
            elif not_found:
                self.harness.problem(f"scheduler {self.idx}: NOT_FOUND for a request of the current epoch")
            else:
                self.stats["recoveries_same_epoch"] += 1
            try:
                for rid, req in list(self.reqs.items()):
                    try:
                        await self._client().free(rid)
                    except KVServiceError as err:
                        if err.code in TRANSPORT_CODES:
                            raise
                        if err.code != grpc.StatusCode.NOT_FOUND:
                            self.harness.problem(f"scheduler {self.idx}: unexpected {err} freeing {rid}")
                    del self.reqs[rid]
                    self.retry.append((req.prompt, req.target_len, req.mode))
                    self.stats["requests_restarted"] += 1
                self.refused.clear()
                return
            except KVServiceError:
                not_found = False
                continue

    async def _preempt_refused(self) -> None:
        """Free the requests whose allocation was refused and queue them to run again."""
        while self.refused:
            rid = self.refused.pop()
            req = self.reqs.get(rid)
            if req is None:
                continue
            await self._call("free", self._client().free(rid))
            del self.reqs[rid]
            self.retry.append((req.prompt, req.target_len, req.mode))
            self.stats["requests_preempted"] += 1

    # -- ops ------------------------------------------------------------------------------------

    def _new_prompt(self) -> tuple[list[int], int, str]:
        rng = self.rng
        if self.retry:
            return self.retry.pop(0)
        family = rng.choice(self.families)
        prefix = family[: rng.choice([0, 1, 2, 3, 5, 8, 12]) * self.config.block_size + rng.choice([0, 0, 1, 3])]
        suffix = [rng.randrange(1, 24) for _ in range(rng.randint(1, 3 * self.config.block_size))]
        prompt = (prefix + suffix)[: self.config.max_model_len - 1]
        target_len = min(self.config.max_model_len, len(prompt) + rng.randint(1, 24))
        return prompt, target_len, rng.choice(["incremental", "full"])

    async def _one_op(self) -> None:
        rng = self.rng
        roll = rng.random()
        if roll < 0.005:
            response = await self._call("reset_prefix_cache", self._client().reset_prefix_cache())
            self.stats["resets_done" if response.reset else "resets_refused"] += 1
            return
        if roll < 0.02:
            await self._call("get_usage", self._client().get_usage())
            return
        if roll < 0.17 and any(r.admitted for r in self.reqs.values()):
            await self._step()
            return
        if (len(self.reqs) < self.config.max_live_requests and rng.random() < 0.35) or not self.reqs:
            await self._register()
            return
        req = self.reqs[rng.choice(sorted(self.reqs))]
        if rng.random() < 0.03:
            await self._free(req, "requests_aborted")
        elif not req.admitted or req.num_computed < req.num_tokens:
            await self._prefill(req)
        elif req.num_tokens >= req.target_len:
            await self._free(req, "requests_finished")
        else:
            await self._decode(req)

    async def _register(self) -> None:
        prompt, target_len, mode = self._new_prompt()
        rid = f"s{self.idx}-{self.next_id}"
        self.next_id += 1
        response = await self._call(
            "get_computed_blocks",
            self._client().get_computed_blocks(rid, prompt, session_id=f"sched-{self.idx}", kv_cache_report_mode=mode),
        )
        self.reqs[rid] = _Req(rid, prompt, target_len, mode)
        self.stats["requests_started"] += 1
        self.stats["hit_tokens_looked_up"] += response.num_computed_tokens

    async def _free(self, req: _Req, why: str) -> None:
        await self._call("free", self._client().free(req.rid))
        del self.reqs[req.rid]
        self.stats[why] += 1

    async def _prefill(self, req: _Req) -> None:
        chunk = self.rng.choice([4, 8, 16, 64])
        response = await self._call("allocate_slots", self._client().allocate_slots(req.rid, chunk))
        self._allocated(req, response)

    async def _decode(self, req: _Req) -> None:
        n = min(self.rng.randint(1, 4), req.target_len - req.num_tokens)
        tokens = [self.rng.randrange(1, 24) for _ in range(n)]
        response = await self._call("allocate_slots", self._client().allocate_slots(req.rid, n, new_token_ids=tokens))
        if self._allocated(req, response):
            self.stats["decode_tokens"] += n

    def _allocated(self, req: _Req, response: Any) -> bool:
        if not response.allocated:
            # The pool is full: preempt (free and run again later), as vLLM's recompute preemption.
            self.stats["allocations_refused"] += 1
            self.refused.append(req.rid)
            return False
        if not req.admitted:
            self.stats["hit_tokens_admitted"] += response.num_new_computed_tokens
        req.admitted = True
        req.num_tokens = response.num_tokens
        req.num_computed = response.num_computed_tokens
        return True

    async def _step(self) -> None:
        """One Step: a decode token for some admitted requests, frees of finished ones."""
        builder = StepBuilder()
        planned: list[tuple[str, _Req | None, list[int]]] = []
        for rid in sorted(self.reqs):
            req = self.reqs[rid]
            if not req.admitted or self.rng.random() < 0.3:
                continue
            if req.num_tokens >= req.target_len:
                builder.free(rid)
                planned.append(("free", req, []))
            elif req.num_computed >= req.num_tokens:
                tokens = [self.rng.randrange(1, 24)]
                builder.allocate_slots(rid, 1, new_token_ids=tokens)
                planned.append(("decode", req, tokens))
            else:
                builder.allocate_slots(rid, 8)
                planned.append(("prefill", req, []))
        if not planned or self.rng.random() < 0.2:
            builder.get_usage()
            planned.append(("usage", None, []))
        response = await self._call("step", self._client().step(builder))
        self.ops["step_ops"] += len(planned)
        if response.epoch != self.epoch:
            raise _ServerChanged(f"Step answered from epoch {response.epoch}")
        for (what, req, _tokens), result in zip(planned, step_results(response)):
            if isinstance(result, KVServiceError):
                if result.code == grpc.StatusCode.NOT_FOUND:
                    raise _ServerChanged(str(result), not_found=True)
                raise result
            if req is None:
                continue
            if what == "free":
                del self.reqs[req.rid]
                self.stats["requests_finished"] += 1
            elif what in ("decode", "prefill"):
                if self._allocated(req, result) and what == "decode":
                    self.stats["decode_tokens"] += 1


# =============================================================================================
# Watchers


class KillMode(str, enum.Enum):
    """How a watcher lineage is killed."""

    CANCEL = "cancel"
    """Its consuming task is cancelled and the watcher closed; a new one starts at once."""
    CLOSE_CHANNEL = "close_channel"
    """Its channel is closed under the live watcher, which fails; a new one starts at once."""
    OUTAGE = "outage"
    """Cancelled, and the lineage stays dead until the run has moved on (its resume point may
    then be below the server's retention: OUT_OF_RANGE, or in a past epoch)."""
    STALL = "stall"
    """Not killed: its consumer stops reading until the run has moved on; the server ends the
    stream once it is ``max_subscriber_lag`` behind (RESOURCE_EXHAUSTED) and the watcher resyncs by
    itself."""


class Lineage:
    """A watcher and its successors: one mirror, one applied history, across kills.

    Args:
        idx: the lineage's index.
        harness: the shared state.
    """

    def __init__(self, idx: int, harness: Harness) -> None:
        self.idx = idx
        self.harness = harness
        self.index = PrefixIndex()
        self.records: list[AppliedRecord] = []
        self.pos: tuple[str, int] | None = None  # (epoch, seq) of the last complete state applied
        self.in_snapshot = False
        self.signal = Signal()
        self.client: AsyncKVCacheClient | None = None
        self.watcher: EventWatcher | None = None
        self.task: asyncio.Task[None] | None = None
        self.stats = harness.report.watcher
        self.reading = asyncio.Event()  # cleared while stalled
        self.reading.set()

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self) -> None:
        """Start a new watcher: resume from the lineage's position, else from a snapshot."""
        assert self.task is None or self.task.done()
        self.client = _new_client(self.harness.address, WATCHER_CHANNEL_OPTIONS)
        retry = RetryPolicy(max_retries=None, initial_backoff_s=0.05, max_backoff_s=1.0, connect_timeout_s=5.0)
        if self.pos is not None and not self.in_snapshot:
            epoch, seq = self.pos
            self.records.append(AppliedRecord(RecordKind.RESUME, epoch, seq))
            self.watcher = EventWatcher(self.client, start_seq=seq + 1, epoch=epoch, retry=retry)
            self.stats["watchers_resumed"] += 1
        else:
            self.records.append(AppliedRecord(RecordKind.START_SNAPSHOT))
            self.watcher = EventWatcher(self.client, retry=retry)
            self.stats["watchers_from_snapshot"] += 1
        self.task = asyncio.get_running_loop().create_task(self._consume(self.watcher), name=f"soak-watcher-{self.idx}")

    async def _consume(self, watcher: EventWatcher) -> None:
        try:
            async for watched in watcher:
                self._apply(watched)
                if not self.reading.is_set():
                    await self.reading.wait()
        except asyncio.CancelledError:
            raise
        except Exception as err:  # the watcher gave up or its channel was closed under it
            self.stats[f"watcher_ended_{type(err).__name__}"] += 1
            logger.info("soak: watcher %d ended: %r", self.idx, err)

    def _apply(self, watched: WatchedBatch) -> None:
        self.index.apply_batch(watched.batch)
        stats = self.stats
        stats["batches_applied"] += 1
        stats["events_applied"] += len(watched.batch.events)
        if watched.snapshot:
            stats["snapshot_parts_applied"] += 1
            self.records.append(AppliedRecord(RecordKind.SNAPSHOT, watched.epoch, watched.seq, watched.snapshot_more))
            self.in_snapshot = watched.snapshot_more
        else:
            self.records.append(AppliedRecord(RecordKind.BATCH, watched.epoch, watched.seq))
            self.in_snapshot = False
        if not self.in_snapshot:
            self.pos = (watched.epoch, watched.seq)
        self.signal.notify()

    async def stop(self, mode: KillMode = KillMode.CANCEL) -> None:
        """Kill the current watcher (and keep its stats)."""
        watcher, client, task = self.watcher, self.client, self.task
        assert watcher is not None and client is not None and task is not None
        self.reading.set()
        if mode is KillMode.CLOSE_CHANNEL and not task.done():
            await client.close()
            try:
                # The watcher fails on its closed channel (and the consumer ends); bounded.
                await asyncio.wait_for(asyncio.shield(task), HANG_GUARD_S / 4)
            except asyncio.TimeoutError:
                self.stats["close_channel_fell_back_to_cancel"] += 1
        if not task.done():
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await watcher.close()
        await client.close()
        self._collect(watcher)
        self.watcher = self.client = self.task = None

    def _collect(self, watcher: EventWatcher) -> None:
        stats = self.stats
        stats["watcher_internal_reconnects"] += watcher.stats.num_reconnects
        for reason, n in watcher.stats.resyncs.items():
            stats[f"resync_{reason.value}"] += n

    async def wait_caught_up(self, epoch: str, head_seq: int) -> None:
        """Wait until the lineage has applied everything up to ``head_seq`` of ``epoch``."""
        await self.signal.wait_until(
            lambda: self.pos == (epoch, head_seq) and not self.in_snapshot,
            f"watcher {self.idx} to reach seq {head_seq} of epoch {epoch[:8]} (at {self.pos})",
        )


async def _kill_watchers(harness: Harness, lineages: list[Lineage], rng: random.Random) -> None:
    """Kill lineages at seeded points of the run and reconnect them."""
    config = harness.config
    points = sorted(rng.uniform(0.02, 0.9) for _ in range(config.num_kills))
    later: list[asyncio.Task[None]] = []
    loop = asyncio.get_running_loop()
    modes = [list(KillMode)[i % len(KillMode)] for i in range(len(points))]  # every mode, when kills allow
    rng.shuffle(modes)
    for point, mode in zip(points, modes):
        await harness.progress.reach(point)
        until = min(point + rng.uniform(0.05, 0.15), 0.95)
        alive = [lineage for lineage in lineages if lineage.task is not None and lineage.reading.is_set()]
        if not alive:  # every lineage is in an outage or a stall
            harness.report.watcher["kills_skipped"] += 1
            continue
        lineage = rng.choice(alive)
        harness.report.watcher[f"kills_{mode.value}"] += 1
        if mode is KillMode.STALL:
            lineage.reading.clear()
            later.append(loop.create_task(_unstall(harness, lineage, until)))
            continue
        await lineage.stop(mode)
        if mode is KillMode.OUTAGE:
            later.append(loop.create_task(_outage(harness, lineage, until)))
        else:
            lineage.start()
    await asyncio.gather(*later)


async def _outage(harness: Harness, lineage: Lineage, until: float) -> None:
    await harness.progress.reach(until)
    lineage.start()


async def _unstall(harness: Harness, lineage: Lineage, until: float) -> None:
    await harness.progress.reach(until)
    lineage.reading.set()


# =============================================================================================
# Director: drains + resets, restarts


async def _drain_and_reset(harness: Harness, client_holder: list[AsyncKVCacheClient]) -> None:
    """Park every scheduler (each frees what it holds), reset the prefix cache, resume."""
    config = harness.config
    harness.resumed.clear()
    harness.pause_requested = True
    try:
        await harness.parked_signal.wait_until(
            lambda: len(harness.parked | harness.finished) == config.num_schedulers, "every scheduler to park"
        )
        while True:
            client = client_holder[0]
            try:
                response = await client.reset_prefix_cache()
                break
            except KVServiceError as err:
                if err.code not in TRANSPORT_CODES:
                    raise
                await _wait_connected(client)
        if response.reset:
            harness.report.num_drain_resets += 1
        else:
            usage = await client_holder[0].get_usage()
            harness.problem(
                f"ResetPrefixCache refused with every scheduler drained ({usage.num_running_requests} running, "
                f"{usage.num_waiting_requests} waiting, {usage.num_free_blocks} of {usage.num_total_blocks} free)"
            )
    finally:
        harness.pause_requested = False
        harness.resumed.set()


async def _direct(harness: Harness, rng: random.Random) -> None:
    """Drains + resets and restarts, at points of the run."""
    config = harness.config
    actions: list[tuple[float, str]] = []
    for i in range(config.num_drain_resets):
        actions.append(((i + 0.5) / (config.num_drain_resets + 1) + rng.uniform(-0.05, 0.05), "reset"))
    for i in range(config.num_restarts):
        actions.append(((i + 1) / (config.num_restarts + 1) + rng.uniform(-0.05, 0.05), "restart"))
    actions.sort()
    client = _new_client(harness.address)
    holder = [client]
    try:
        for point, action in actions:
            await harness.progress.reach(point)
            if action == "reset":
                await _drain_and_reset(harness, holder)
            else:
                await harness.restart()
    finally:
        await client.close()


# =============================================================================================
# The run


def _families(config: SoakConfig) -> list[list[int]]:
    rng = random.Random(f"{config.seed}/families")
    length = 12 * config.block_size
    return [[rng.randrange(100, 5000) for _ in range(length)] for _ in range(6)]


def _pool_hashes(running: RunningServer) -> list[set[Any]]:
    return [
        {block_hash_to_int(h) for h in hash_map.hashes()}
        for hash_map in running.engine.manager.block_pool.cached_block_hash_to_block
    ]


async def run_soak(config: SoakConfig) -> SoakReport:
    """Run one soak (see the module docstring) and return its figures.

    Raises:
        TimeoutError: a wait hung for HANG_GUARD_S seconds (named in the message).
        ValueError: a bad setting.
    """
    report = SoakReport()
    harness = Harness(config, report)
    started = time.monotonic()
    await harness.start()
    rng = random.Random(f"{config.seed}/director")
    lineages = [Lineage(i, harness) for i in range(config.num_watchers)]
    try:
        for lineage in lineages:
            lineage.start()
        families = _families(config)
        schedulers = [Scheduler(i, harness, families) for i in range(config.num_schedulers)]
        tasks = [asyncio.get_running_loop().create_task(s.run(), name=f"soak-scheduler-{s.idx}") for s in schedulers]
        tasks.append(asyncio.get_running_loop().create_task(_direct(harness, rng), name="soak-director"))
        tasks.append(asyncio.get_running_loop().create_task(_kill_watchers(harness, lineages, rng), name="soak-killer"))
        try:
            await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        await _final_check(harness, lineages)
    finally:
        for lineage in lineages:
            if lineage.task is not None:
                await lineage.stop()
        report.wall_s = time.monotonic() - started
        for running in harness.servers:
            report.head_seqs[running.event_log.epoch] = running.event_log.head_seq
            report.num_invariant_checks += running.servicer.num_invariant_checks
            report.num_invariant_failures += running.servicer.num_invariant_failures
            for message in running.servicer.invariant_failures:
                report.problems.append(f"invariant check failed (epoch {running.event_log.epoch[:8]}): {message}")
        assert harness.running is not None
        await harness.running.stop(0)
    if report.num_invariant_checks == 0:
        report.problems.append("no invariant check ran")
    return report


async def _final_check(harness: Harness, lineages: list[Lineage]) -> None:
    """Every lineage catches up with the server's head; every mirror equals its cached set."""
    running = harness.running
    assert running is not None
    report = harness.report
    log = running.event_log
    epoch, head_seq = log.epoch, log.head_seq
    for lineage in lineages:
        await lineage.wait_caught_up(epoch, head_seq)
    assert (log.epoch, log.head_seq) == (epoch, head_seq), "the server moved while the run was quiet"
    running.engine.check_invariants()
    cached = running.snapshots.mirror.cached_hashes()
    pool = _pool_hashes(running)
    if cached != pool:
        harness.problem(
            f"the event log's mirror ({sum(map(len, cached))} blocks) != the pool's ({sum(map(len, pool))})"
        )
    report.num_cached_blocks_final = sum(map(len, cached))
    for lineage in lineages:
        held = lineage.index.snapshot()
        mirror = [held.get(g, set()) for g in range(log.num_groups)]
        if mirror != cached:
            missing = sum(len(c - m) for c, m in zip(cached, mirror))
            extra = sum(len(m - c) for c, m in zip(cached, mirror))
            harness.problem(
                f"watcher {lineage.idx}: mirror differs from the cached set: {missing} missing, {extra} extra"
            )
        report.num_final_mirrors_checked += 1
        num_checked, problems = check_applied_sequence(lineage.records)
        report.num_sequence_checks += num_checked
        for problem in problems:
            harness.problem(f"watcher {lineage.idx}: {problem}")
        epochs_applied = {r.epoch for r in lineage.records if r.kind in (RecordKind.BATCH, RecordKind.SNAPSHOT)}
        if epoch not in epochs_applied:
            harness.problem(f"watcher {lineage.idx} never applied a batch of the last epoch")
    engine = running.engine
    if engine.requests:
        harness.problem(f"{len(engine.requests)} requests left registered at the end")
    usage = engine.get_usage()
    if usage.num_free_blocks != usage.num_total_blocks:
        harness.problem(f"{usage.num_total_blocks - usage.num_free_blocks} blocks still held at the end")


# =============================================================================================
# Command line


@click.command()
@click.option(
    "--duration-s",
    type=click.FloatRange(min=0, min_open=True),
    help="Run for this long (wall time) instead of a fixed number of ops.",
)
@click.option(
    "--ops-per-scheduler",
    type=click.IntRange(min=1),
    default=300,
    show_default=True,
    help="RPCs per scheduler (without --duration-s).",
)
@click.option(
    "--schedulers",
    "num_schedulers",
    type=click.IntRange(min=1),
    default=8,
    show_default=True,
    help="Scheduler clients.",
)
@click.option(
    "--watchers", "num_watchers", type=click.IntRange(min=1), default=8, show_default=True, help="Watcher lineages."
)
@click.option("--seed", type=int, default=0, show_default=True, help="Seeds every random choice.")
@click.option(
    "--restarts",
    "num_restarts",
    type=click.IntRange(min=0),
    default=1,
    show_default=True,
    help="Server restarts on the same port.",
)
@click.option(
    "--resets",
    "num_drain_resets",
    type=click.IntRange(min=0),
    default=1,
    show_default=True,
    help="Drains + ResetPrefixCache.",
)
@click.option(
    "--kills",
    "num_kills",
    type=click.IntRange(min=0),
    help="Watcher kills [2 per watcher; 2 per watcher per minute with --duration-s].",
)
@click.option(
    "--num-blocks",
    type=click.IntRange(min=2),
    default=96,
    show_default=True,
    help="Blocks in the pool (null block included).",
)
@click.option("--block-size", type=click.IntRange(min=1), default=4, show_default=True, help="Tokens per block.")
@click.option(
    "--max-model-len", type=click.IntRange(min=1), default=128, show_default=True, help="Longest request, in tokens."
)
@click.option(
    "--event-max-batches", type=click.IntRange(min=1), default=64, show_default=True, help="Batches the server retains."
)
@click.option(
    "--max-subscriber-lag",
    type=click.IntRange(min=1),
    default=64,
    show_default=True,
    help="Batches a watcher may fall behind.",
)
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Also write the figures here.")
@click.option(
    "--log-level", type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"]), default="WARNING", show_default=True
)
def main(json_path: str | None, log_level: str, num_kills: int | None, **options: Any) -> None:
    """Soak one kvservice server with schedulers, killed watchers and restarts; print the figures.

    Exits 1 when anything was lost or broken.
    """
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if num_kills is None:
        per_watcher = 2 if options["duration_s"] is None else max(2, round(2 * options["duration_s"] / 60))
        num_kills = per_watcher * options["num_watchers"]
    try:
        config = SoakConfig(num_kills=num_kills, **options)
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    report = asyncio.run(run_soak(config))
    click.echo(report.render())
    if json_path:
        with open(json_path, "w") as f:
            json.dump(report.to_json(), f, indent=2)
    sys.exit(0 if report.ok else 1)


if __name__ == "__main__":
    main()
