"""Fetching samples from the backend: batched per storage node, deduplicated, read ahead.

The Fetcher runs batches of samples on one node as one blocking call in a worker thread
(the store coalesces samples that are adjacent or near each other in a chunk into one
read). Each node has its own bound on requests in flight, so one slow node cannot take
every thread. A sample being fetched is registered, and a second reader waits for that
fetch instead of fetching again.

The Prefetcher walks the current plans ahead of the readers: it takes the samples of the
plan windows that are neither cached nor being fetched, groups them by node, and starts
batches of up to k samples per node while the cache has room reserved for them.
"""
from __future__ import annotations

import errno
import logging
from collections import defaultdict

import numpy as np
import trio

log = logging.getLogger("fusefs")


class Pending:
    __slots__ = ("event", "data", "error")

    def __init__(self):
        self.event = trio.Event()
        self.data = None
        self.error = None


class Fetcher:
    def __init__(self, store, *, per_node: int = 4, batch: int = 16, max_gap: int = 256 << 10):
        self.store = store
        index = store.index
        self.chunk_node = np.array([c.node for c in index.chunks], dtype=np.int32)
        self.node_names = list(index.nodes)
        self.per_node = per_node
        self.batch = batch
        self.max_gap = max_gap
        self.limiters = [trio.CapacityLimiter(per_node) for _ in self.node_names]
        self.inflight: dict[int, Pending] = {}
        self.busy = [0] * len(self.node_names)  # batches started and not finished, per node
        self.node_stats = [dict(requests=0, reads=0, samples=0, bytes=0, errors=0)
                           for _ in self.node_names]

    def node_of(self, sid: int) -> int:
        return int(self.chunk_node[int(self.store.index.chunk[sid])])

    async def fetch(self, sids: list[int], deliver) -> None:
        """Fetch sids (one node) in one batch; deliver(sid, bytes | Exception) for each.

        Registers each sid as in flight first, so readers of them wait for this batch.
        """
        sids = [s for s in sids if s not in self.inflight]
        if not sids:
            return
        node = self.node_of(sids[0])
        pendings = {s: self.inflight.setdefault(s, Pending()) for s in sids}
        self.busy[node] += 1
        stats = self.node_stats[node]
        results = None
        try:
            results, nreads, nbytes = await trio.to_thread.run_sync(
                self.store.read_batch, sids, self.max_gap, limiter=self.limiters[node])
            stats["requests"] += 1
            stats["reads"] += nreads
            stats["bytes"] += nbytes
        except Exception as e:  # a bug, not a backend error (read_batch returns those)
            log.exception("fetch of %d samples from node %s failed", len(sids), self.node_names[node])
            results = {s: OSError(errno.EIO, f"internal error: {e}") for s in sids}
        finally:  # also when cancelled: waiters must never hang
            self.busy[node] -= 1
            for sid, p in pendings.items():
                r = results[sid] if results is not None else OSError(errno.EIO, "fetch cancelled")
                if isinstance(r, Exception):
                    p.error = r
                    stats["errors"] += 1
                else:
                    p.data = r
                    stats["samples"] += 1
                del self.inflight[sid]
                p.event.set()
                deliver(sid, r)

    def statistics(self) -> dict:
        return {name: dict(s, inflight=self.busy[i]) for i, (name, s)
                in enumerate(zip(self.node_names, self.node_stats))}


class Prefetcher:
    """Keeps the cache filled along the plans. `wake()` after anything that may let it
    start more work (a new order, a use, a finished fetch)."""

    def __init__(self, core):
        self.core = core
        self._wake = trio.Event()
        self.nursery = None
        self.batches = 0

    def wake(self) -> None:
        self._wake.set()

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self.nursery = nursery
            task_status.started()
            while True:
                await self._wake.wait()
                self._wake = trio.Event()
                try:
                    self.schedule()
                except Exception:  # never let the read-ahead take the daemon down
                    log.exception("prefetch scheduling failed")
                await trio.sleep(0)  # let wakes pile up: plan once per burst, not per read

    def candidates(self) -> list[int]:
        core = self.core
        plans = [p for p in core.plans.values() if not p.done]
        if not plans:
            return []
        share = core.cache.budget // len(plans)
        scan = int(4 * share / max(1.0, core.mean_size)) + 256  # positions, not the whole order
        out = []
        for plan in plans:
            for sid in plan.window(share, max_scan=scan).tolist():
                if sid not in core.cache and sid not in core.fetcher.inflight:
                    out.append(sid)
        return out

    def schedule(self) -> None:
        if self.nursery is None:
            return
        core, fetcher = self.core, self.core.fetcher
        by_node: dict[int, list[int]] = defaultdict(list)
        for sid in self.candidates():
            by_node[fetcher.node_of(sid)].append(sid)
        sizes = core.index.size
        for node, sids in by_node.items():
            i = 0
            while i < len(sids) and fetcher.busy[node] < fetcher.per_node:
                want = sids[i:i + fetcher.batch]
                fits = np.cumsum(sizes[want]) <= core.cache.free
                take = int(fits.sum())
                if take < max(1, len(want) // 2):
                    return  # wait until half a batch fits: no trickle of one-sample requests
                batch = want[:take]
                nbytes = int(sizes[batch].sum())
                core.cache.reserve(nbytes)
                i += take
                self.batches += 1
                self.nursery.start_soon(self._run_batch, batch, nbytes)

    async def _run_batch(self, batch: list[int], nbytes: int) -> None:
        unreserved = False

        def deliver(sid, result):
            nonlocal unreserved
            if not unreserved:
                self.core.cache.unreserve(nbytes)
                unreserved = True
            self.core.deliver(sid, result, prefetched=True)

        try:
            await self.core.fetcher.fetch(batch, deliver)
        finally:
            if not unreserved:
                self.core.cache.unreserve(nbytes)
            self.wake()
