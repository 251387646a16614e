"""The read-ahead's task on the event loop: it runs the plan (prefetch.ReadAheadPlan) whenever
woken (prefetch.Wake) and submits the batches it hands out to the fetcher, whose arrivals go
to arrivals.Arrivals, not back here.
"""
from __future__ import annotations

import logging

import trio

from .arrivals import Arrivals
from .fetch import Fetcher
from .prefetch import ReadAheadPlan, Wake

log = logging.getLogger("fusefs")


class Prefetcher:
    """Keeps the cache filled along the plans: runs the read-ahead's plan (ReadAheadPlan)
    on the event loop and submits the batches it hands out to the fetcher, which hands
    what they bring to the arrivals (arrivals.Arrivals), not back here. `wake()` after
    anything that may let it start more work (a new order, a use, a finished fetch).

    A batch reads its samples in the order's order and delivers each as its read is done
    (Fetcher.submit), so the reader of an order's first sample waits for one read, not k.
    """

    def __init__(self, plan: ReadAheadPlan, fetcher: Fetcher, arrivals: Arrivals, wake: Wake,
                 on_idle=None):
        """plan: what to read ahead; fetcher: the nodes, their request slots, what is in
        flight, and where batches are submitted; arrivals: what a batch's thread pushes
        into the kernel or hands the fast path (Arrivals.handling); wake: what the task waits on; on_idle(idle): told when
        the plan's `idle` changes (FastPath.idle: the readers' uses may then reach the core
        later), or None."""
        self.plan, self.fetcher, self.arrivals, self._wake = plan, fetcher, arrivals, wake
        self.on_idle, self._idle_told = on_idle, False
        self.readahead, self.low_water = plan.readahead, plan.low_water
        self.queued = plan.queued  # (read: tests, stats)
        self.running = fetcher.readahead_running  # each node's read-ahead batches not ended
        self.serving = False
        self.batches = 0

    @property
    def queues(self) -> list[list[int]]:
        """Each node's queue, head first (a copy: for the tests)."""
        return self.plan.queues

    def counters(self) -> dict:
        return {"prefetch_batches": self.batches, "readahead_bytes": self.readahead}

    def wake(self) -> None:
        self._wake.set()

    def used(self, nbytes: int) -> None:
        """A reader used a sample of nbytes: wake once a refill's worth was used."""
        if self.plan.used(nbytes):
            self._wake.set()

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Plan and dispatch whenever woken, until cancelled."""
        self.serving = True
        task_status.started()
        try:
            while True:
                await self._wake.wait()
                try:
                    self.schedule()
                except Exception:  # never let the read-ahead take the daemon down
                    log.exception("prefetch scheduling failed")
                await trio.sleep(0)  # let wakes pile up: plan once per burst, not per read
        finally:
            self.serving = False

    def reset(self) -> None:
        """A new order: forget the queued read-ahead of the old one (its reservations too);
        batches already running finish, and what they bring is kept only if still needed."""
        self.plan.reset()
        self._tell_idle()

    def rewind(self) -> None:
        """Walk the plans again from the readers' cursors (KernelView found the kernel
        dropped what it was thought to hold)."""
        self.plan.rewind()
        self._tell_idle()
        self.wake()

    def _tell_idle(self) -> None:
        if self.on_idle is not None and self.plan.idle != self._idle_told:
            self._idle_told = self.plan.idle
            self.on_idle(self._idle_told)

    def yield_room(self, nbytes: int, key: float) -> int:
        """ReadAheadPlan.yield_room: reservations of queued samples needed later than key
        given back until nbytes are freed; the bytes freed."""
        return self.plan.yield_room(nbytes, key)

    def take_queued(self, sid: int) -> list[int]:
        """ReadAheadPlan.take_queued: sid and the samples queued next on its node, for a
        reader that missed sid."""
        return self.plan.take_queued(sid)

    def advance(self, step: int | None = None) -> bool:
        return self.plan.advance(step)

    def schedule_now(self) -> None:
        """Plan and dispatch at once (a new order), not at the read-ahead task's next turn."""
        try:
            self.schedule()
        except Exception:  # never let the read-ahead take the daemon down
            log.exception("prefetch scheduling failed")
        self.wake()

    def schedule(self) -> None:
        if not self.serving:
            return
        if self.plan.due() and self.plan.step():
            self._wake.set()  # (the rest at the task's next turn: the loop serves meanwhile)
        self._tell_idle()
        self.dispatch()

    def dispatch(self) -> None:
        """Submit the batches the plan hands out (ReadAheadPlan.batches). Each is claimed
        at once: a reader of one of its samples meanwhile waits for this fetch instead of
        missing."""
        fetcher = self.fetcher
        for node, b in self.plan.batches(self.running):
            claimed = fetcher.claim(b)
            self.arrivals.fetched_elsewhere(b, claimed)
            if fetcher.submit(b, claimed, **self.arrivals.handling(b), readahead=True):
                self.batches += 1
