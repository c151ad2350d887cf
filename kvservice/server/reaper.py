"""The request reaper: frees requests whose scheduler stopped calling (``request_idle_timeout_s``).

A remote scheduler that crashes or loses its connection never frees its requests, and their blocks
would stay held until the server stops. With ``request_idle_timeout_s`` set, a request not called
(GetComputedBlocks or AllocateSlots that succeeded, unary or inside a Step) for that many seconds is
freed by the engine's ``free``, exactly as a ``Free`` call would free it: same events, same
free-queue order. The events of one pass are published as one batch. A later call for a reaped
request gets NOT_FOUND.

The reaper also ends a scheduler's claim on the pool once it lapsed (``claim_ttl_s`` after the
owner's last ManagerStep): its requests and the blocks it popped are freed, as ``release`` would.

The reaper sleeps until the least recently called request's deadline or the claim's, whichever is
first (nothing can become idle sooner: a call only moves its time later), so it wakes only when
there may be work; a tier lease (or a lapsed put lease's hold) added meanwhile wakes it to sleep
until that one's deadline instead, if it comes first (``TierStore.on_deadline``).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable

from kvservice.core.engine import KVCacheEngine

logger = logging.getLogger(__name__)

__all__ = ["RequestReaper"]


class _Woken(Exception):
    """The reaper's sleep ended early: a tier deadline was added."""


class RequestReaper:
    """Frees requests idle for ``idle_timeout_s`` seconds, on the server's event loop.

    Args:
        engine: the request table (its ``clock`` must be the loop's clock, ``time.monotonic``, for
            the sleeps to match; :meth:`reap` alone works with any clock).
        publish: appends the engine's pending events to the event log as one batch (the
            servicer's ``publish``).
        idle_timeout_s: seconds without a call after which a request is freed (> 0, finite).

    Attributes:
        num_reaped_requests: requests freed by the reaper since start.
        reaped_request_ids: the most recent reaped ids (up to 1024), oldest first.

    Raises:
        ValueError: ``idle_timeout_s`` is not a finite number > 0.
    """

    def __init__(self, engine: KVCacheEngine, publish: Callable[[], None], idle_timeout_s: float) -> None:
        if not 0 < idle_timeout_s < float("inf"):
            raise ValueError(f"request_idle_timeout_s must be a finite number > 0 seconds; got {idle_timeout_s}")
        self.engine = engine
        self.publish = publish
        self.idle_timeout_s = idle_timeout_s
        self.num_reaped_requests = 0
        self.reaped_request_ids: deque[str] = deque(maxlen=1024)
        self._reaped = asyncio.Event()
        # The sleep in progress (a future the timer or a new tier deadline completes; no task).
        self._sleep: asyncio.Future[None] | None = None
        if engine.tier is not None:
            engine.tier.on_deadline = self._wake
        self._task: asyncio.Task | None = None

    def reap(self) -> list[str]:
        """Free the idle requests now (one pass), publish their events as one batch, log their ids.

        Returns:
            The ids freed, least recently called first (empty when none was idle).
        """
        tier = self.engine.tier
        if tier is not None and tier.expire(self.engine.clock()):  # lapsed tier leases: unpinned / freed, no event
            logger.info("ended tier leases past their deadline (%d since start)", tier.num_expired)
        owner = self.engine.claim.owner if self.engine.claim is not None else None
        released = self.engine.expire_claim()
        if released or (owner is not None and self.engine.claim is None):
            logger.info(
                "released the pool's claim of scheduler %r, which lapsed: freed its %d request(s)", owner, len(released)
            )
        request_ids = released + self.engine.free_idle_requests(self.idle_timeout_s)
        if not request_ids:
            if owner is not None and self.engine.claim is None:
                self.publish()  # its popped blocks were freed
            return request_ids
        self.publish()
        self.num_reaped_requests += len(request_ids)
        self.reaped_request_ids.extend(request_ids)
        logger.info(
            "freed %d request(s) idle for %g s or more (request_idle_timeout_s): %s",
            len(request_ids),
            self.idle_timeout_s,
            ", ".join(request_ids),
        )
        # Wake every waiter of wait_reaped; those that need more wait again.
        self._reaped.set()
        self._reaped.clear()
        return request_ids

    async def wait_reaped(self, num_requests: int) -> None:
        """Return once :attr:`num_reaped_requests` >= ``num_requests`` (no polling; wrap it in a
        timeout to bound the wait)."""
        while self.num_reaped_requests < num_requests:
            await self._reaped.wait()

    async def run(self) -> None:
        """Reap forever: sleep until the next request may become idle, reap, repeat."""
        engine = self.engine
        while True:
            deadline = engine.next_idle_deadline(self.idle_timeout_s)
            lease_deadline = engine.tier.next_deadline() if engine.tier is not None else None
            if lease_deadline is not None and (deadline is None or lease_deadline < deadline):
                deadline = lease_deadline  # a tier lease lapses first: end it then
            delay = self.idle_timeout_s if deadline is None else deadline - engine.clock()
            if await self._sleep_for(max(delay, 0.0)):  # 0 still yields to the calls
                continue  # a tier deadline added meanwhile: maybe an earlier one
            try:
                self.reap()
            except Exception:  # a bug here must not stop reaping; it is logged
                logger.exception("request reaper pass failed")
                await asyncio.sleep(self.idle_timeout_s)

    async def _sleep_for(self, delay: float) -> bool:
        """Sleep ``delay`` seconds, or less when :meth:`_wake` is called meanwhile: whether it was."""
        loop = asyncio.get_running_loop()
        sleep: asyncio.Future[None] = loop.create_future()

        def wake_up() -> None:
            if not sleep.done():
                sleep.set_result(None)

        timer = loop.call_later(delay, wake_up)
        self._sleep = sleep
        woken = False
        try:
            await sleep
        except _Woken:
            woken = True
        finally:
            timer.cancel()
            self._sleep = None
        return woken

    def _wake(self) -> None:
        """A tier lease or lapsed hold was added (``TierStore.on_deadline``): end the sleep in
        progress, so the next one is until the earliest deadline."""
        sleep = self._sleep
        if sleep is not None and not sleep.done():
            sleep.set_exception(_Woken())

    def start(self) -> asyncio.Task:
        """Start :meth:`run` as a task on the running loop."""
        assert self._task is None, "reaper already started"
        self._task = asyncio.get_running_loop().create_task(self.run(), name="kvservice-request-reaper")
        return self._task

    async def stop(self) -> None:
        """Cancel the task and wait for it to end."""
        task, self._task = self._task, None
        if task is None:
            return
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
