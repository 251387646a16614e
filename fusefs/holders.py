"""Where a sample's bytes are held: one interface over every holder.

A sample's bytes may be held, at once or in turn, by
- the daemon's cache (cache.SampleCache: the byte budget and eviction by next use), which
  tells the fast path's table of every entry that comes or goes (its mirror: the fast
  path's C threads answer reads from those bytes, fastpath.py);
- an open handle whose read did not reach the sample's end (handles.Handles keeps them for
  its next read, within a cap);
- a worker thread pushing them into the kernel page cache (`pushing`: the loop answers a
  read of such a sample from here, never with a new fetch, which could wait for a thread
  slot that pushes hold);
- the kernel page cache (kernel_view.KernelView: what was pushed or read through and not
  dropped since).

Nothing else asks those parts for bytes: a read asks `get`, the fetches' arrivals `keep`,
the read-ahead `holds`, and a fetch thread `push`es here, or hands the fast path what the
cache will keep (`serve_early`) before the loop has it. The fast path keeps a read of a
sample it is to be handed that way waiting (`expect`, as the batch starts), and answers it
as the fetch thread hands the sample over: such a read never reaches the loop.
"""
from __future__ import annotations

from .cache import SampleCache
from .handles import Handles
from .kernel_view import KernelView


class Holders:
    def __init__(self, cache: SampleCache, handles: Handles, kernel_view: KernelView, serve=None,
                 table=None):
        """cache: the daemon's cache; handles: the open handles (the bytes each keeps);
        kernel_view: what the kernel page cache holds, and the push into it; serve(sid,
        bytes or None): the fast path's table (FastPath.hold, the cache's mirror too), which
        a fetch thread fills ahead of the cache (serve_early), or None; table: the fast path
        itself (FastPath: hold_many, and expect, which keeps the reads of samples to come
        waiting there), or None: serve is called per sample, and those reads go to the loop."""
        self.cache, self.handles, self.kernel_view = cache, handles, kernel_view
        self._serve = serve
        self._table = table if serve is not None else None
        # (the fast path's capsule, made once: a table kept in Python has none)
        api = getattr(self._table, "publish_api", None)
        self.publish_api = api() if api is not None else None
        self.waiting: set[int] = set()  # missed samples whose reads wait in the fast path for
        # their arrival (wait_for)
        self.pushing: dict[int, bytes] = {}  # sid -> bytes while a worker thread pushes them

    def get(self, sid: int) -> bytes | None:
        """Sample sid's bytes where the daemon holds them (the cache, or a push under way),
        or None."""
        data = self.cache.get(sid)
        if data is None:
            data = self.pushing.get(sid)  # (arrived, not kept, still being pushed)
        return data

    def kept_for(self, fh: int) -> bytes | None:
        """The bytes handle fh keeps between its reads, or None."""
        return self.handles.held.get(fh)

    def keep_for(self, fh: int, data: bytes) -> None:
        """Keep data for handle fh's next read, within the handles' cap."""
        self.handles.keep(fh, data)

    def holds(self, sid: int) -> bool:
        """Whether sample sid needs no fetch: the cache or the kernel page cache holds it."""
        return sid in self.cache or self.kernel_view.holds(sid)

    def keep(self, sid: int, data: bytes, key: float) -> bool:
        """Keep data in the cache if room can be made by evicting entries needed later than
        key; whether it was kept."""
        return self.cache.put(sid, data, key)

    def keep_many(self, items, keys, start: int = 0, served=()) -> int:
        """keep() of each (sid, data) of items[start:] until one is not kept: its index.
        served: those of them the fast path holds already (serve_early)."""
        return self.cache.put_many(items, keys, start, served)

    @property
    def serves_early(self) -> bool:
        """Whether a fetch thread can hand samples to the fast path (serve_early)."""
        return self._serve is not None

    def serve_early(self, items) -> None:
        """(A fetch's worker thread.) Fetched, checked samples, [(sid, bytes)], that the cache
        has room reserved for: the fast path answers their reads from now on, before the loop
        has them (a reader's read that comes meanwhile does not wait for the loop). The cache
        keeps them once the loop has them (its mirror holds the same bytes again); one it does
        not keep is let go of then (unserve). The reads that wait for them (expect) are
        answered here, in this thread."""
        if self._table is not None:
            self._table.hold_many(items)
            return
        serve = self._serve
        for sid, data in items:
            serve(sid, data)

    @property
    def expects(self) -> bool:
        """Whether the fast path can keep the reads of samples to come waiting (expect)."""
        return self._table is not None

    def hand_many(self, items) -> None:
        """(A fetch's worker thread.) Fetched, checked samples, [(sid, bytes)]: the reads
        that wait in the fast path for one (a miss: Reads.parked_misses) are answered from
        its bytes, which the fast path does not hold."""
        self._table.hand_many(items)

    def hand(self, sid: int, data: bytes) -> None:
        """(The loop.) The reads that wait in the fast path for sid are answered from data."""
        self._table.hand_many(((sid, data),))

    def let_go(self, sid: int) -> None:
        """(The loop.) The reads that wait in the fast path for sid go to the loop (where it
        is cached, the fast path holds it again and answers them)."""
        data = self.cache.get(sid)
        self._serve(sid, data)

    def wait_for(self, sid: int) -> None:
        """(The loop.) A read of sid, which is being fetched, waits in the fast path: it is
        answered when the sample arrives, or goes to the loop if its fetch fails (arrived)."""
        self.waiting.add(sid)

    def arrived(self, items) -> None:
        """(The loop.) Of a fetched group, [(sid, bytes | Exception)], the samples whose
        reads wait in the fast path (wait_for): answered from their bytes (where the worker
        thread did not), or, where the fetch failed, handed to the loop."""
        waiting = self.waiting
        got = dict(items)
        for sid in waiting.intersection(got):  # (few wait: not a look at each of items)
            waiting.discard(sid)
            r = got[sid]
            if isinstance(r, Exception):
                self.let_go(sid)
            else:
                self.hand(sid, r if type(r) is bytes else bytes(r))

    def expect(self, sids) -> None:
        """(The loop, as a batch starts.) sids will be handed to the fast path by the batch's
        thread (serve_early), or let go of (unserve: the fetch failed, or the cache did not
        keep them): until then a read of one waits in the fast path, not the loop."""
        self._table.expect(sids)

    def unserve(self, sids) -> None:
        """(The loop.) Of samples served early (or expected: their fetch may have failed),
        those the cache did not keep: the fast path lets them go (the reads that still wait
        for one go to the loop)."""
        cache, serve = self.cache, self._serve
        for sid in sids:
            if sid not in cache:
                serve(sid, None)

    @property
    def pushes(self) -> bool:
        """Whether fetched samples are pushed into the kernel page cache."""
        return self.kernel_view.pushes

    def push(self, items, announce) -> None:
        """(A fetch's worker thread.) Push fetched samples, [(sid, bytes)], into the kernel
        page cache: they are held here first, then announce() tells the loop that they
        arrived (a reader's read of one holds a lock of its pages until the loop answers it,
        from here, and the push waits for that lock), then they are pushed and let go of."""
        pushing = self.pushing
        pushing.update(items)
        announce()
        try:
            self.kernel_view.push(items)
        finally:
            for sid, _ in items:
                pushing.pop(sid, None)
