"""A sample's bytes for a reader, and what happens when a fetch brings them.

The read path, top to bottom: `Reads.fetch(sid)` answers from the cache, from a fetch
under way (the reader waits for it), or starts a fetch of its own with companions (the
samples queued next on its node, or a scan's next samples of its chunk). Every fetch runs
as a task of `Reads.nursery` (Core.run opens it), in a batch on one node
(fetch.Fetcher: worker threads, retries, per-node bounds). As each sample arrives,
`deliver` keeps it where the orders need it before something cached (cache.py, by
policy.py's keys), offers it to the local tier, and the worker thread pushes it into the
kernel page cache (kernel_view.KernelView.push), after the event loop has it, unless the
cache keeps it for the fast path, whose answers to its reads leave its pages there. A sample
the kernel holds is neither pushed again nor read ahead; a read that reaches the daemon for
one shows that the kernel dropped its pages (`lost`).
"""
from __future__ import annotations

import collections
import errno
import functools
import logging
import os
import time

import numpy as np
import trio

from .entries import FsError
from .fetch import FetchCancelled
from .prefetch import Prefetcher
from .store import CorruptSample

log = logging.getLogger("fusefs")

# A sample whose fetch gave up (its node did not answer within --io-timeout; not with
# --io-timeout 0, where a read tries once) is answered EIO at once for GAVE_UP_S while its
# node is still down: the kernel tries a read-ahead that failed again at once, as a read of
# its own, which would otherwise wait as long again. At most GAVE_UP_MAX samples are
# remembered (the oldest go first).
GAVE_UP_S = 5.0
GAVE_UP_MAX = 4096
# a group of at least this many fetched samples has its keys computed at once (numpy's fixed
# cost per call is about that of this many Python calls of Policy.key)
KEYS_AT_ONCE = 16


class Reads:
    def __init__(self, index, store, cache, policy, fetcher, stats, kernel_view, *, local=None,
                 readahead: int | None = None, on_idle=None, cache_answered: bool = False):
        """index: sizes, chunks and paths (for log lines); store: chunk paths (for log
        lines); cache, policy: where bytes are kept and by what rule; fetcher: batches,
        in-flight fetches; stats: the daemon's counters; kernel_view: what the kernel page
        cache holds (kernel_view.KernelView), which fetched samples are pushed into; local:
        the local tier or None. The read-ahead (prefetch.Prefetcher, `readahead` bytes
        ahead of the readers; None: its default; on_idle: told when it has covered its
        orders, or no longer) is made here: it runs its batches through fetch_batch, and a
        miss takes along the samples it has queued. cache_answered: the reads of the cache's
        samples are answered outside the loop (the fast path), so a fetched sample the cache
        keeps is not pushed into the kernel page cache: its readers' reads leave its pages
        there (KernelView.read_through), one copy fewer than a push."""
        self.cache_answered = cache_answered
        self.index, self.store, self.cache, self.policy = index, store, cache, policy
        self.fetcher, self.stats, self.local = fetcher, stats, local
        self.kernel_view = kernel_view
        self.prefetcher = Prefetcher(index, policy, cache, fetcher, self.fetch_batch, readahead,
                                     kernel_holds=kernel_view.holds, on_idle=on_idle)
        self.corrupt: dict[int, str] = {}  # samples whose stored bytes fail their checksum
        self.gave_up: collections.OrderedDict[int, float] = collections.OrderedDict()  # sid -> when
        self._recent = collections.deque(maxlen=32)  # recently read samples (scan detection)
        self.nursery: trio.Nursery | None = None  # where fetches of missed samples run (Core.run)

    def counters(self) -> dict:
        return {"corrupt_samples": len(self.corrupt)}

    def lost(self, sid: int) -> None:
        """A read of sample sid reached the daemon: if the kernel was taken to hold its
        pages, it dropped some (KernelView.lost); when it has dropped many, the read-ahead
        goes back to the cursors to fetch what it skipped (Prefetcher.rewind)."""
        if self.kernel_view.lost(sid):
            self.prefetcher.rewind()

    def forgot(self, sid: int) -> None:
        """The kernel forgot sample sid's inode, and with it its pages: as lost() if the
        kernel was taken to hold them and the orders still need sid (the read-ahead passed
        over it as held and would not come back for it: its reader would miss)."""
        view = self.kernel_view
        needed = view.holds(sid) and self.policy.next_use(sid) is not None
        if view.forgot(sid, needed):
            self.prefetcher.rewind()

    def answered(self, sid: int, end: bool, held: bool) -> None:
        """A read of sample sid was answered from its cached bytes outside the loop (the
        fast path): as fetch() would count it, and as the daemon's read (Core.read) would
        tell what the kernel holds (end: the read reached the sample's end; held: the
        kernel was taken to hold its pages when the read was answered, so it had dropped
        them. Not held now: a push that ended after the read, waiting for the pages it
        held, may have set it since)."""
        if held:
            self.lost(sid)
        self._recent.append(sid)
        self.stats.hits += 1
        if end:
            self.kernel_view.read_through(sid)

    def new_order(self) -> None:
        """A new order: the kernel's drops are counted afresh."""
        self.kernel_view.new_order()

    async def fetch(self, sid: int) -> bytes:
        """Sample sid's verified bytes, from the cache, a fetch under way, or the backend."""
        self._recent.append(sid)
        if sid in self.corrupt:  # known bad: do not read it again
            self.stats.eio += 1
            raise FsError(errno.EIO, self.corrupt[sid])
        if self.gave_up and sid in self.gave_up:
            self._gave_up_lately(sid)
        data = self.cache.get(sid)
        if data is None:
            data = self.fetcher.pushing.get(sid)  # (arrived, not kept, still being pushed)
        if data is not None:
            self.stats.hits += 1
            return data
        pending = self.fetcher.inflight.get(sid)
        if pending is not None:
            self.stats.read_waits += 1
            t0 = time.perf_counter()
            await pending.wait()
            waited = time.perf_counter() - t0
            self.stats.wait_s += waited
            self.stats.wait_hist.observe(waited)
            result = pending.error or pending.data
        else:
            self.stats.misses += 1
            result = await self._fetch_missed(sid)
        if isinstance(result, Exception):
            self.stats.eio += 1
            raise FsError(errno.EIO, str(result))
        return result

    def _gave_up_lately(self, sid: int) -> None:
        """FsError(EIO) if sample sid's fetch gave up within GAVE_UP_S and its node is still
        down; else it is forgotten."""
        waited = time.monotonic() - self.gave_up[sid]
        if waited < GAVE_UP_S and self.fetcher.is_down(self.fetcher.node_of(sid)):
            self.stats.eio += 1
            self.stats.eio_at_once += 1
            raise FsError(errno.EIO, f"its fetch gave up {waited:.1f} s ago, and its node is still down")
        del self.gave_up[sid]

    async def _fetch_missed(self, sid: int):
        """Fetch a sample no one is fetching, with companions: the next samples queued for
        read-ahead on its node up to a batch, or, reading without an order, the next k-1
        samples of its chunk when the reads look like a scan. The reader has its sample as
        soon as its read is done; the companions' reads go on in the background."""
        if self.nursery is None:
            raise RuntimeError("a read before Core.run: start the core's tasks first")
        k = self.fetcher.batch - 1
        batch = [sid] + [s for s in self.prefetcher.take_queued(sid) if s != sid]
        if not self.policy.plans and sid - 1 in self._recent:
            chunk = self.index.chunk
            end = min(sid + 1 + k, self.index.n_files)
            batch += [s for s in range(sid + 1, end) if chunk[s] == chunk[sid]
                      and s not in self.cache and s not in self.fetcher.inflight]
        claimed = self.fetcher.claim(batch)
        self.nursery.start_soon(functools.partial(self.fetch_batch, batch, keep=sid, claimed=claimed))
        pending = claimed[sid]
        await pending.wait()
        return pending.error or pending.data

    async def fetch_batch(self, sids: list[int], keep: int | None = None, claimed=None) -> None:
        """Fetch sids (one node) as one batch, each sample delivered as it arrives. A sample's
        reservation in the cache (the read-ahead's) is settled as it arrives, or at once for
        one someone else is already fetching. `keep`: the sample a reader missed (see
        deliver). `claimed`: the fetcher's claim on sids, made by the caller (Fetcher.fetch)."""
        cache, inflight = self.cache, self.fetcher.inflight
        for sid in sids:
            if sid in inflight and not (claimed and sid in claimed):
                cache.settle(sid)

        def deliver(items):
            settle = cache.settle
            for s, _ in items:
                settle(s)
            self.deliver_many(items, keep)

        push = self.kernel_view.push if self.kernel_view.pushes else None
        unpushed = set()
        if push is not None:
            if self.cache_answered:  # (reserved: the cache keeps it as it arrives)
                unpushed = {s for s in sids if cache.holds_reservation(s)}
            if keep is not None:
                unpushed.add(keep)
        await self.fetcher.fetch(sids, deliver, claimed, push=push, unpushed=unpushed,
                                 waited=keep is not None)

    def deliver_many(self, items, missed: int | None = None) -> None:
        """deliver() of each (sid, result) of a group of reads (the fetched ones kept in the
        group's order); `missed`: the sample of a reader who missed it. The keys of a large
        group come from one numpy pass over the plans (Policy.keys), not a Python call each,
        and the cache keeps the group's samples in one call (SampleCache.put_many)."""
        ok = []
        for item in items:
            sid, r = item
            if sid == missed or isinstance(r, Exception):
                self.deliver(sid, r, missed=sid == missed)
            else:
                ok.append(item)
        if not ok:
            return
        if len(ok) < KEYS_AT_ONCE:
            key = self.policy.key
            keys = [key(sid) for sid, _ in ok]
        else:
            keys = self.policy.keys(np.array([sid for sid, _ in ok], dtype=np.int64)).tolist()
        if self.local is not None:  # (each offered to the local tier first)
            for (sid, r), key in zip(ok, keys):
                self._keep(sid, r, key)
            return
        cache, at = self.cache, 0
        while at < len(ok):
            at = cache.put_many(ok, keys, at)
            if at < len(ok):
                self._keep_refused(*ok[at], keys[at])
                at += 1

    def deliver(self, sid: int, result, missed: bool = False) -> None:
        """A fetch finished: keep the bytes if the orders need them before something cached
        (a missed sample: its next use after its reader's; that reader holds its bytes)."""
        if isinstance(result, Exception):
            if isinstance(result, FetchCancelled):
                return
            if isinstance(result, CorruptSample):
                if sid not in self.corrupt:
                    self.corrupt[sid] = str(result)
                    log.error("EIO: %s", result)
            else:
                if self.fetcher.io_timeout > 0:  # (it waited for the node: not again at once)
                    self.gave_up[sid] = time.monotonic()
                    self.gave_up.move_to_end(sid)
                    if len(self.gave_up) > GAVE_UP_MAX:
                        self.gave_up.popitem(last=False)
                if not self.fetcher.is_down(self.fetcher.node_of(sid)):
                    # (a node that is down: its failed samples are counted, and told in one
                    # line when it answers again: fetch.Node.answered)
                    chunk = int(self.index.chunk[sid])
                    log.error("EIO: node %s: %s: sample %s: backend read failed: %s",
                              self.fetcher.node_names[self.fetcher.node_of(sid)], self.store.chunk_path(chunk),
                              os.fsdecode(self.index.file_path(sid)), result)
            return
        self._keep(sid, result, self.policy.key_after_use(sid) if missed else self.policy.key(sid))

    def _keep(self, sid: int, result: bytes, key: float) -> None:
        """A fetched sample's bytes, needed next at key: offered to the local tier, kept in
        the cache if the orders need them before something cached."""
        if self.local is not None and sid not in self.local:  # (cheap test first)
            self.local.offer(sid, result, float(self.local.priority[sid])
                             if self.policy.keeps_after_use(sid) else -np.inf)
        if not self.cache.put(sid, result, key):
            self._keep_refused(sid, result, key)

    def _keep_refused(self, sid: int, result: bytes, key: float) -> None:
        """A fetched sample the cache refused (room only from entries needed sooner): the
        budget is reserved for read-ahead needed later than key, so some is taken back for
        it."""
        if key != float("inf") and self.prefetcher.yield_room(self.cache.cost(len(result)), key):
            self.cache.put(sid, result, key)
