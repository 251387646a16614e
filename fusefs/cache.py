"""The daemon's sample cache: verified sample bytes within a byte budget.

Nothing leaves the cache until its room is needed. Then the entries go whose next use is
furthest away (Belady's rule): each entry carries a key, the point on the orders' clock
where it is needed next (policy.Policy.key; math.inf: no order needs it again), kept in a
max-heap with lazy deletion (`rekey` after every use). Entries no order needs go first,
oldest first (so reading without an order works as an LRU cache). A fetch may only push
out entries needed later than the sample it brings (`reserve(nbytes, key)`), so the
read-ahead never evicts what a reader needs sooner, and a sample a reader missed (key
inf) is kept only where room can be made that way (its reader holds its bytes anyway).

The cache can tell another holder of every entry that comes or goes (`mirror`: the fast
path's thread answers reads from the entries it is told of, fastpath.py).

Pinned entries (`set_pins`: the samples of highest importance, within the static share of
the budget) are never evicted. Bytes reserved for fetches under way count against the
budget too, so the budget is never exceeded by the cache. The bytes open handles keep
between their reads are counted too (hold_for_reader: once, the cache's entry of the same
bytes costing nothing more until it leaves), and covered by evicting entries no order
needs; never one an order needs, nor is a fetch refused for them. The cache keeps the
ledger of reservations, one per sample (`reserve(sid, size, key)`): each is settled exactly once (`settle(sid)`, when the
sample arrives, or when the fetch it was for is given up); settling a sample that holds none
does nothing, so no caller needs to know who reserved what.

An entry costs the budget its sample's bytes and `entry_overhead` more (ENTRY_OVERHEAD by
default): what an entry takes beyond its bytes (its Python objects, its place in the
eviction heap, and the holes that evicted samples of other sizes leave in the heap), as
scripts/bench/bench_memory.py measures it (about 1.1 KB per entry of 0.5-3 KB samples).
Reservations are counted the same way.
"""
from __future__ import annotations

import heapq
import itertools
import math

import numpy as np

ENTRY_OVERHEAD = 1024  # bytes an entry costs beyond its sample's (bench_memory: ~1.1 KB)


class SampleCache:
    def __init__(self, budget: int, static: int = 0, entry_overhead: int = ENTRY_OVERHEAD, mirror=None):
        """budget bytes, of them static for the pinned entries; mirror: hold(sid, data) for
        every entry put from now on, hold(sid, None) for every one that leaves, or None."""
        if budget < 0:
            raise ValueError("cache budget must be >= 0")
        if not 0 <= static <= budget:
            raise ValueError("the static (pinned) share must lie between 0 and the budget")
        self.budget = budget
        self.static = static
        self.overhead = entry_overhead
        self.pin_set: set[int] = set()  # samples picked for pinning (cached or not yet)
        self.pinned_bytes = 0
        self.used = 0
        self.reserved = 0
        self.outside = 0  # bytes open handles keep that are not entries (hold_for_reader)
        self._readers: dict[int, int] = {}  # sid -> handles that keep its bytes
        self._apart: dict[int, int] = {}    # of those, sid -> bytes counted outside the entries
        self._reservations: dict[int, int] = {}  # sid -> what its reservation costs the budget
        self.evictions = 0
        self.peak = 0
        self._entries: dict[int, bytes] = {}
        self._key: dict[int, float] = {}   # sid -> its current key
        self._heap: list = []              # (-key, seq, sid); stale items skipped
        self._seq = itertools.count()
        self._mirror = mirror  # hold(sid, bytes or None), told of every entry that comes or goes

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, sid: int) -> bool:
        return sid in self._entries


    def counters(self) -> dict:
        return {"cache_bytes": self.used, "cache_reserved": self.reserved, "cache_peak": self.peak,
                "cache_outside": self.outside,
                "cache_budget": self.budget, "cache_samples": len(self), "evictions": self.evictions,
                "cache_static": self.static, "pinned_samples": self.pinned_samples,
                "pinned_bytes": self.pinned_bytes, "pins_picked": len(self.pin_set)}

    @property
    def pinned_samples(self) -> int:
        return sum(1 for s in self.pin_set if s in self._entries)

    def cost(self, size: int) -> int:
        """What an entry (or a reservation) of a sample of size bytes takes of the budget."""
        return size + self.overhead

    @property
    def free(self) -> int:
        return self.budget - self.used - self.reserved

    def hold_for_reader(self, sid: int, data: bytes) -> None:
        """An open handle keeps data, sample sid's bytes, between its reads: counted once,
        whoever holds them. The cache's own entry (the same bytes) costs nothing more until
        it leaves the cache while held; other bytes count at once (`outside`). Entries no
        order needs are evicted to cover what handles keep (`_cover`); an entry an order
        needs never is (it would be fetched again), nor is a fetch refused for them: where
        the orders need every entry, what handles keep (at most their cap) is the budget's
        only overrun."""
        readers = self._readers
        if sid in readers:
            readers[sid] += 1
            return
        readers[sid] = 1
        if self._entries.get(sid) is not data:
            self._apart[sid] = len(data)
            self.outside += len(data)
            self._cover()

    def _cover(self) -> None:
        """Evict entries no order needs (oldest first) while entries, reservations and what
        handles keep apart from the entries are past the budget."""
        heap, entries, current = self._heap, self._entries, self._key
        while self.used + self.reserved + self.outside > self.budget and heap:
            neg, _, sid = heap[0]
            if sid not in entries or current[sid] != -neg:  # (stale)
                heapq.heappop(heap)
                continue
            if -neg != math.inf:
                return
            heapq.heappop(heap)
            self._evict(sid)

    def let_go_for_reader(self, sid: int) -> None:
        """A handle that kept sample sid's bytes (hold_for_reader) no longer does."""
        left = self._readers.pop(sid) - 1
        if left:
            self._readers[sid] = left
        else:
            self.outside -= self._apart.pop(sid, 0)

    def _left(self, sid: int, data: bytes) -> None:
        """sid's entry left the cache: bytes a handle still keeps are counted outside it
        (covered at the next put)."""
        if sid in self._readers and sid not in self._apart:
            self._apart[sid] = len(data)
            self.outside += len(data)

    def get(self, sid: int) -> bytes | None:
        return self._entries.get(sid)

    def rekey(self, sid: int, key: float) -> None:
        """sid (if cached) is needed next at key now (a use moved it on)."""
        if sid in self._entries and self._key[sid] != key:
            self._key[sid] = key
            if sid not in self.pin_set:
                self._push(sid, key)

    def rekey_many(self, pairs) -> None:
        """rekey() of each (sid, key) in pairs, given flat: [sid, key, sid, key, ...]."""
        entries, current, pins, heap, seq = self._entries, self._key, self.pin_set, self._heap, self._seq
        push = heapq.heappush
        it = iter(pairs)
        for sid, key in zip(it, it):
            if sid in entries and current[sid] != key:
                current[sid] = key
                if sid not in pins:
                    push(heap, (-key, next(seq), sid))
        if len(heap) > 2 * len(entries) + 1024:
            self._rebuild_heap()

    def rekey_all(self, keys_of) -> None:
        """Every key changed (a new order, new pins): keys_of(sids array) -> their keys."""
        self._heap = []  # (its items go first, so the new ones take their memory)
        sids = np.fromiter(self._entries, dtype=np.int64, count=len(self._entries))
        keys = keys_of(sids).tolist() if len(sids) else []
        self._key.update(zip(sids.tolist(), keys))  # (in place: one table, not two at once)
        self._rebuild_heap()

    def _rebuild_heap(self) -> None:
        """The eviction heap from the current keys (pinned entries are never in it)."""
        pins = self.pin_set
        self._heap = []  # the stale items go before the new ones are made
        self._heap = [(-k, next(self._seq), s) for s, k in self._key.items() if s not in pins]
        heapq.heapify(self._heap)

    def _make_room(self, nbytes: int, key: float, gone: list | None = None) -> bool:
        """Evict entries needed later than key (or never), furthest first, until nbytes
        are free; evict nothing if that cannot free enough. gone: a list the evicted
        samples are added to, for the caller to tell the mirror of (None: told here)."""
        short = nbytes - (self.budget - self.used - self.reserved)  # bytes still to free
        if short <= 0:
            return True
        heap, entries, current, overhead = self._heap, self._entries, self._key, self.overhead
        pop, taken = heapq.heappop, {}
        while heap and short > 0:
            neg, seq, sid = heap[0]
            # stale: evicted, dropped or re-keyed since; or an item of the same key as the
            # one taken (an entry put again, or re-keyed back, under the same key)
            if sid not in entries or current[sid] != -neg or sid in taken:
                pop(heap)
                continue
            if not (-neg > key or -neg == math.inf):
                break
            taken[sid] = pop(heap)
            short -= len(entries[sid]) + overhead
        if short > 0:
            for item in taken.values():
                heapq.heappush(heap, item)
            return False
        for sid in taken:
            self._evict(sid, gone)
        return True

    def _evict(self, sid: int, gone: list | None = None) -> None:
        data = self._entries.pop(sid)
        del self._key[sid]
        self.used -= len(data) + self.overhead
        self.evictions += 1
        if sid in self._readers:
            self._left(sid, data)
        if gone is not None:
            gone.append(sid)
        elif self._mirror is not None:
            self._mirror(sid, None)

    def reserve(self, sid: int, size: int, key: float = math.inf) -> bool:
        """Set room aside for a fetch about to start of sample sid, of size bytes, needed at
        key (see policy.Policy.key), evicting only entries needed later. A sample holds one
        reservation at most (True at once if it holds one)."""
        return self.reserve_many((sid,), (size,), (key,)) == 1

    def reserve_many(self, sids, sizes, keys) -> int:
        """reserve() of each of sids (sizes[i] bytes, needed at keys[i]) in turn, until one
        finds no room: how many did (len(sids): all). A run of the read-ahead's samples in
        one call; the mirror is told of the entries evicted for them once the run is
        reserved."""
        res, overhead, budget = self._reservations, self.overhead, self.budget
        gone: list[int] = []
        done = len(sids)
        for i, sid in enumerate(sids):
            if sid in res:
                continue
            need = sizes[i] + overhead
            if need > budget - self.used - self.reserved and not self._make_room(need, keys[i], gone):
                done = i
                break
            res[sid] = need
            self.reserved += need
            if self.used + self.reserved > self.peak:
                self.peak = self.used + self.reserved
        mirror = self._mirror
        if mirror is not None:
            for sid in gone:
                mirror(sid, None)
        return done

    def settle(self, sid: int) -> int:
        """Give back sample sid's reservation (it arrived, or its fetch is not needed): the
        bytes it held, 0 if it held none (settled already, or never reserved)."""
        need = self._reservations.pop(sid, 0)
        self.reserved -= need
        return need

    def settle_many(self, items) -> None:
        """settle() of the sample of each (sid, _) of items (a fetched group's)."""
        res, freed = self._reservations, 0
        for sid, _ in items:
            freed += res.pop(sid, 0)
        self.reserved -= freed

    def holds_reservation(self, sid: int) -> bool:
        return sid in self._reservations

    def put(self, sid: int, data: bytes, key: float = math.inf) -> bool:
        """Keep data if room can be made by evicting entries needed later than key (its
        next use, math.inf: none planned). Returns whether it was kept."""
        return self.put_many(((sid, data),), (key,)) == 1

    def put_many(self, items, keys, start: int = 0, told=()) -> int:
        """put() of each (sid, data) of items[start:], needed at keys[i], in order, until one
        is not kept: returns its index (len(items): every one kept). A fetched group's
        samples, without a call each. (A sample cached already is dropped first, kept or
        not.) told: samples the mirror holds with these very bytes already (the fast path
        was handed them by their fetch thread: Holders.serve_early), not told again."""
        entries, current, pins, heap, seq, mirror = (self._entries, self._key, self.pin_set,
                                                     self._heap, self._seq, self._mirror)
        overhead, push = self.overhead, heapq.heappush
        kept = len(items)
        for i in range(start, len(items)):
            sid, data = items[i]
            key = keys[i]
            dropped = sid in entries and self.drop(sid)
            need = len(data) + overhead
            if need > self.budget - self.used - self.reserved and not self._make_room(need, key):
                kept = i
                break
            entries[sid] = data
            current[sid] = key
            if mirror is not None and (dropped or sid not in told):
                mirror(sid, data)
            if sid in pins:
                self.pinned_bytes += need
            else:
                push(heap, (-key, next(seq), sid))
            self.used += need
            if self.used + self.reserved > self.peak:
                self.peak = self.used + self.reserved
        if len(heap) > 2 * len(entries) + 1024:
            self._rebuild_heap()
        if self.outside:
            self._cover()
        return kept

    def _push(self, sid: int, key: float) -> None:
        """sid's item on the eviction heap; its earlier ones stay, stale (lazy deletion),
        until the heap holds as many stale items as entries: then it is rebuilt (amortized
        O(1) a push). A stale item is about 150 bytes of Python objects that the entry
        overhead must cover: docs/HOTPATH.md, "Memory through the epoch"."""
        heapq.heappush(self._heap, (-key, next(self._seq), sid))
        if len(self._heap) > 2 * len(self._entries) + 1024:
            self._rebuild_heap()

    def drop(self, sid: int) -> bool:
        data = self._entries.pop(sid, None)
        if data is None:
            return False
        del self._key[sid]
        self.used -= len(data) + self.overhead
        if sid in self._readers:
            self._left(sid, data)
        if sid in self.pin_set:
            self.pinned_bytes -= len(data) + self.overhead
        if self._mirror is not None:
            self._mirror(sid, None)
        return True

    def set_pins(self, ids: np.ndarray, importance: np.ndarray, sizes: np.ndarray) -> None:
        """Pick the samples to pin: by importance (highest first), as many as fit in the
        static share. Those no longer picked become ordinary entries."""
        pick: set[int] = set()
        if self.static and len(ids):
            ids = np.asarray(ids, dtype=np.int64)
            order = np.argsort(-np.asarray(importance, dtype=np.float64), kind="stable")
            ranked = ids[order]
            ranked = ranked[np.sort(np.unique(ranked, return_index=True)[1])]  # best occurrence
            fits = np.cumsum(sizes[ranked].astype(np.int64) + self.overhead) <= self.static
            pick = set(ranked[:int(np.argmin(fits)) if not fits.all() else len(ranked)].tolist())
        self.pin_set = pick
        self.pinned_bytes = sum(len(self._entries[s]) + self.overhead for s in pick if s in self._entries)
        self._rebuild_heap()
