"""What snapshot work may take from everyone else: a loop share for work in steps, a byte budget for writes.

* :data:`YIELD_EVERY_TOKENS`: the step of every piece of snapshot work on the loop (a cut's
  production, a part's encoding, an event's size), in token ids.
* :class:`HalfShare`: such work takes at most about half of the loop however long it is.
* :class:`ByteBudget`: snapshot bytes being written, over every stream, within a size and a rate.

docs/ARCHITECTURE.md §4.7 states the rules; :mod:`kvservice.server.snapshot` says who uses these.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import AsyncIterator, Callable

__all__ = [
    "DEFAULT_SNAPSHOT_BYTES_IN_FLIGHT",
    "DEFAULT_SNAPSHOT_BYTES_PER_S",
    "YIELD_EVERY_TOKENS",
    "ByteBudget",
    "HalfShare",
]

DEFAULT_SNAPSHOT_BYTES_IN_FLIGHT = 1024 * 1024
"""The default :class:`ByteBudget` of snapshot part bytes being written, over all streams
(``max_snapshot_bytes_in_flight``)."""

DEFAULT_SNAPSHOT_BYTES_PER_S = 64 * 1024 * 1024
"""The default rate of that budget, bytes per second (``max_snapshot_bytes_per_s``): a snapshot of a
million 16-token blocks (about 100 MB) streams in under 2 s."""

YIELD_EVERY_TOKENS = 1_024
"""A cut in production yields to the loop after about this many token ids of events (and at every
part boundary), a part is serialized in steps of about this many, and a snapshot event carries at
most about this many (at least one block): so a snapshot holds the loop for about 64 blocks'
worth of work at a time (at 1M cached blocks of 16 tokens, with one snapshot client, the loop
thread's CPU between two turns had p99 3.3 ms at 8,192 and 1.75 ms at 2,048 here)."""


class HalfShare:
    """Yields for a task doing snapshot work in steps (a cut's production, a part's encoding), so
    that it takes at most about half of the loop's time however long it is: between steps it
    yields a turn (``sleep(0)``), and once its steps since the last pause add up to
    ``PAUSE_AFTER_S`` it sleeps that long (one timer per couple of milliseconds, not per step:
    the loop's timers round up to 1 ms). Other calls so wait behind at most one step, and a
    machine the server shares with its clients keeps CPU for them.

    Why ``PAUSE_AFTER_S`` is 2 ms: measured with the segment cut on issue 15's stall row
    (``scripts/bench/bounded_bench.py stall --blocks 1048576 --clients 1``, GetUsage p99 while a
    client loops 1M-block snapshots over its idle p99 in the same run; a loaded 2-core machine,
    load average 0.6-1.9, the server run from copies of the tree differing only in this value),
    2 ms, 1 ms and 0.5 ms gave medians 1.87x (8 runs, 0.94-3.06x), 2.12x (8 runs, 1.04-2.75x)
    and 1.70x (5 runs, 1.27-2.28x): no pause clearly better for the other calls, within the runs'
    spread; while the snapshots the client got through in 11 s of load fell from 4.5 to 3.75 and
    2.8 (mean): a shorter pause makes each snapshot slower, and a cut in production holds the
    event log's batches back from the mirror for longer. (With the block-by-block cut this
    replaced, 1 ms and 0.5 ms had helped: 2.4-2.9x against 3.4-4.0x at 2 ms; its cut cost about
    ten times the CPU, so its pacing mattered more.)"""

    PAUSE_AFTER_S = 0.002

    def __init__(self) -> None:
        self._started = time.perf_counter()
        self._worked = 0.0

    async def step(self) -> None:
        """Yield between two steps (the time since the last one returned counts as work)."""
        self._worked += time.perf_counter() - self._started
        if self._worked >= self.PAUSE_AFTER_S:
            await asyncio.sleep(self._worked)
            self._worked = 0.0
        else:
            await asyncio.sleep(0)
        self._started = time.perf_counter()


class ByteBudget:
    """Snapshot bytes being written, shared by every snapshot stream: at most ``max_bytes`` in
    flight, at most ``bytes_per_s`` on average, one writer let in per turn of the loop.

    A part's encoded bytes count from before its write until the write completes (the client
    took it, or gRPC buffered it within its HTTP/2 flow-control window). A writer waits (first
    come, first served) while its part would take ``in_flight`` above ``max_bytes`` (a part bigger
    than the whole budget goes alone, when nothing else is in flight), while the rate's bucket
    (``max_bytes`` deep) is in debt, and until the loop's next turn after the last writer let in.
    Starting a write copies and frames its bytes on the loop (about 0.1 ms per 100 KB here), so
    another call waits behind at most one part's write start however many streams read snapshots,
    and the rate bounds what snapshot writing (and encoding, and the readers' parsing, where they
    share the machine) takes from everything else.

    A write bigger than ``max_bytes`` (a whole ``TakeEvents`` snapshot answer, one message; a part
    above the budget) is charged ``num_bytes / max_bytes`` times its size against the rate. It is
    copied in one write start, so at the same byte rate it holds the loop as long in all as the
    parts would, but in holds that many times longer, which every other call arriving meanwhile
    waits out; charged so, such holds come that many times less often, and the share of the
    others' calls that meet one stays what parts give (issue 26: one client looping 4 MB
    ``TakeEvents`` snapshots otherwise took the other calls' p99 to 3-4.5x their idle p99 here).

    A write that has not completed ``hold_s`` after it was let in (its client stopped reading,
    or reads slowly) stops counting then (:meth:`held`): it is still in flight in gRPC, bounded
    per stream by one message and cut by the stream's own write timeout, but it no longer holds
    the budget, so clients that stop reading mid-snapshot delay every other snapshot stream by
    ``hold_s`` per wave of blocked writes that fills ``max_bytes``, not until their streams are cut
    (issue 15: no client stalls the others). Writers are let in first come, first served, so blocked
    writes that do not fit in ``max_bytes`` together take turns: N such streams whose parts are P
    bytes delay the others by up to about ``hold_s * N / max(1, max_bytes // P)`` (measured on a real
    server: 1 MiB, parts of 32,768 token ids (about 183 KB), 12 clients that read one part and
    stopped: another client's 11.5 MB snapshot took 1.87 s instead of 0.59 s). The writes let go
    stay within ``max_let_go_bytes`` (the memory such clients hold in the server); beyond it a
    blocked write keeps counting until it completes, its stream is cut, or room frees up.

    Args:
        max_bytes: bytes in flight, and the bucket's depth (>= 1).
        bytes_per_s: average bytes per second let in (>= 1).
        hold_s: the longest one write counts in flight, seconds (> 0), while the writes let go
            and not yet complete stay within ``max_let_go_bytes``.
        max_let_go_bytes: bytes of writes let go at ``hold_s`` and not yet complete, at most
            (>= 0; default 16 x ``max_bytes``): so snapshot parts held in gRPC for clients that
            stopped reading stay within ``max_bytes + max_let_go_bytes`` however many there are;
            beyond it a blocked write keeps counting (and is asked again every ``hold_s``).

    Attributes:
        in_flight: bytes acquired and not yet released.
        peak: the most ``in_flight`` has been.
        num_waits: acquisitions that had to wait (for bytes, the rate, or the loop's next turn).
        num_bytes: bytes let in so far.
        num_let_go: writes through :meth:`held` that stopped counting at ``hold_s`` so far (a count:
            it stays when they complete later).
        let_go_bytes: bytes of the writes let go that have not completed yet.
    """

    def __init__(
        self,
        max_bytes: int,
        bytes_per_s: float = float("inf"),
        hold_s: float = 0.5,
        max_let_go_bytes: int | None = None,
    ) -> None:
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1; got {max_bytes}")
        if not bytes_per_s >= 1:
            raise ValueError(f"bytes_per_s must be >= 1; got {bytes_per_s}")
        if not hold_s > 0:
            raise ValueError(f"hold_s must be > 0; got {hold_s}")
        self.max_bytes = max_bytes
        self.bytes_per_s = bytes_per_s
        self.hold_s = hold_s
        self.max_let_go_bytes = 16 * max_bytes if max_let_go_bytes is None else max_let_go_bytes
        if self.max_let_go_bytes < 0:
            raise ValueError(f"max_let_go_bytes must be >= 0; got {max_let_go_bytes}")
        self.num_let_go = 0
        self.let_go_bytes = 0
        self.in_flight = 0
        self.peak = 0
        self.num_waits = 0
        self.num_bytes = 0
        self._waiters: deque[tuple[int, asyncio.Future[None]]] = deque()
        self._closed_until_next_turn = False
        self._credit = float(max_bytes)  # the rate's bucket, bytes (negative: in debt)
        self._credit_at = time.monotonic()

    def _fits(self, num_bytes: int) -> bool:
        return not self._closed_until_next_turn and (
            self.in_flight == 0 or self.in_flight + num_bytes <= self.max_bytes
        )

    def _refill(self) -> float:
        if self.bytes_per_s == float("inf"):
            return float(self.max_bytes)
        now = time.monotonic()
        self._credit = min(float(self.max_bytes), self._credit + (now - self._credit_at) * self.bytes_per_s)
        self._credit_at = now
        return self._credit

    def _take(self, num_bytes: int) -> None:
        self.in_flight += num_bytes
        self.peak = max(self.peak, self.in_flight)
        self.num_bytes += num_bytes
        if self.bytes_per_s != float("inf"):  # a write above the budget: charged for its one long hold
            self._credit -= num_bytes * max(1.0, num_bytes / self.max_bytes)
        self._closed_until_next_turn = True
        loop = asyncio.get_running_loop()
        if self._credit < 0:  # in debt: the next writer waits until the bucket is back at 0
            loop.call_later(-self._credit / self.bytes_per_s, self._next_turn)
        else:
            loop.call_soon(self._next_turn)  # runs in the loop's next turn

    def _next_turn(self) -> None:
        self._closed_until_next_turn = False
        self._wake()

    async def acquire(self, num_bytes: int) -> None:
        """Wait until ``num_bytes`` fit, the rate allows and it is this writer's turn, then count
        them in flight (pair with :meth:`release`)."""
        if not self._waiters and self._fits(num_bytes) and self._refill() >= 0:
            self._take(num_bytes)
            return
        self.num_waits += 1
        waiter = (num_bytes, asyncio.get_running_loop().create_future())
        self._waiters.append(waiter)
        try:
            await waiter[1]
        except BaseException:
            if waiter[1].done() and not waiter[1].cancelled():
                self.release(num_bytes)  # let in, then cancelled before it ran: hand it on
            else:
                self._waiters.remove(waiter)
                self._wake()
            raise

    def release(self, num_bytes: int) -> None:
        """Count ``num_bytes`` out of flight and let the next waiter in (when the turn and the rate allow)."""
        self.in_flight -= num_bytes
        self._wake()

    @contextlib.asynccontextmanager
    async def held(self, num_bytes: int) -> AsyncIterator[None]:
        """Count ``num_bytes`` in flight (:meth:`acquire`) for the write made in the ``async with``
        body, until it completes or ``hold_s`` passes, whichever comes first."""
        finish = await self.admit(num_bytes)
        try:
            yield
        finally:
            finish()

    async def admit(self, num_bytes: int) -> Callable[[], None]:
        """Count ``num_bytes`` in flight (:meth:`acquire`) for a write that completes later, until
        the returned function is called (the write completed or failed) or ``hold_s`` passes,
        whichever comes first (:meth:`held` is this around an ``async with`` body; a unary answer
        calls it when its RPC is done). Calling it again does nothing."""
        await self.acquire(num_bytes)
        counted = True
        finished = False
        loop = asyncio.get_running_loop()
        timer: list[asyncio.TimerHandle] = []  # the pending one

        def let_go() -> None:
            nonlocal counted
            if self.let_go_bytes + num_bytes > self.max_let_go_bytes:  # memory bound: keep counting, ask again
                timer[0] = loop.call_later(self.hold_s, let_go)
                return
            counted = False
            self.num_let_go += 1
            self.let_go_bytes += num_bytes
            self.release(num_bytes)

        def finish() -> None:
            nonlocal finished
            if finished:
                return
            finished = True
            timer[0].cancel()
            if counted:
                self.release(num_bytes)
            else:
                self.let_go_bytes -= num_bytes

        timer.append(loop.call_later(self.hold_s, let_go))
        return finish

    def _wake(self) -> None:
        waiters = self._waiters
        if waiters and self._fits(waiters[0][0]):
            if self._refill() < 0:  # in debt, and no timer pending (it would have closed the turn)
                self._closed_until_next_turn = True
                asyncio.get_running_loop().call_later(-self._credit / self.bytes_per_s, self._next_turn)
                return
            num_bytes, future = waiters.popleft()
            self._take(num_bytes)
            future.set_result(None)
