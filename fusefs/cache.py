"""The daemon's sample cache: verified sample bytes within a byte budget.

Nothing leaves the cache until its room is needed. Then the entries go whose next use is
furthest away (Belady's rule): each entry carries a key, the point on the orders' clock
where it is needed next (policy.Policy.key; math.inf: no order needs it again), kept in an
indexed max-heap (`rekey` after every use moves the entry in it). Entries no order needs go
first, oldest first (so reading without an order works as an LRU cache). A fetch may only push
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
default): what an entry takes beyond its bytes (its bytes object, and the holes that evicted
samples of other sizes leave in the heap), as scripts/bench/bench_memory.py measures it
(about 1.1 KB per entry of 0.5-3 KB samples). Reservations are counted the same way.

The entries, reservations and eviction heap are fusefs._cachecore's (C: a group's samples
are put, reserved, settled and re-keyed in one call each, every step O(log n)); this
subclass keeps the rules that come seldom: pins, what open handles keep, a new order's keys.
"""
from __future__ import annotations

import math

import numpy as np

from ._cachecore import Entries

ENTRY_OVERHEAD = 1024  # bytes an entry costs beyond its sample's (bench_memory: ~1.1 KB)


class SampleCache(Entries):
    """Entries' methods (C): get(sid), `sid in cache`, len(cache), rekey(sid, key),
    rekey_many([sid, key, ...]), reserve_many(sids, sizes, keys), settle(sid),
    settle_many(items), holds_reservation(sid), reserved_among(sids),
    put_many(items, keys, start, told),
    drop(sid); its counters: budget, used, reserved, outside, peak, evictions, pinned_bytes,
    free."""

    def __init__(self, budget: int, static: int = 0, entry_overhead: int = ENTRY_OVERHEAD, mirror=None,
                 samples: int = 0):
        """budget bytes, of them static for the pinned entries; mirror: hold(sid, data) for
        every entry put from now on, hold(sid, None) for every one that leaves, or the fast
        path's capsule (pyfuse3.fast_path_publish_api(): the same told in C, no Python call
        an entry), or None;
        samples: the data set's count (the arrays' size from the start; else they grow)."""
        if budget < 0:
            raise ValueError("cache budget must be >= 0")
        if not 0 <= static <= budget:
            raise ValueError("the static (pinned) share must lie between 0 and the budget")
        super().__init__(budget, entry_overhead, mirror, samples)
        self.static = static
        self._pins: set[int] = set()  # samples picked for pinning (cached or not yet)
        self._readers: dict[int, int] = {}  # sid -> handles that keep its bytes
        self._apart: dict[int, int] = {}    # of those, sid -> bytes counted outside the entries

    def counters(self) -> dict:
        return {"cache_bytes": self.used, "cache_reserved": self.reserved, "cache_peak": self.peak,
                "cache_outside": self.outside,
                "cache_budget": self.budget, "cache_samples": len(self), "evictions": self.evictions,
                "cache_static": self.static, "pinned_samples": self.pinned_samples,
                "pinned_bytes": self.pinned_bytes, "pins_picked": len(self._pins)}

    @property
    def pin_set(self) -> set[int]:
        """The samples picked for pinning (set_pins), cached or not."""
        return self._pins

    @pin_set.setter
    def pin_set(self, sids) -> None:
        self._pins = set(sids)
        self._set_pinned(np.fromiter(self._pins, dtype=np.int64, count=len(self._pins)))

    @property
    def pinned_samples(self) -> int:
        return sum(1 for s in self._pins if s in self)

    def cost(self, size: int) -> int:
        """What an entry (or a reservation) of a sample of size bytes takes of the budget."""
        return size + self.overhead

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
        self._set_kept(sid, True)
        if self.get(sid) is not data:
            self._apart[sid] = len(data)
            self.outside += len(data)
            self._cover()

    def let_go_for_reader(self, sid: int) -> None:
        """A handle that kept sample sid's bytes (hold_for_reader) no longer does."""
        left = self._readers.pop(sid) - 1
        if left:
            self._readers[sid] = left
        else:
            self._set_kept(sid, False)
            self.outside -= self._apart.pop(sid, 0)

    def _left(self, sid: int, data: bytes) -> None:
        """(Entries, as an entry a handle keeps leaves the cache.) Its bytes are counted
        outside the entries (covered at the next put)."""
        if sid in self._readers and sid not in self._apart:
            self._apart[sid] = len(data)
            self.outside += len(data)

    def rekey_all(self, keys_of) -> None:
        """Every key changed (a new order, new pins): keys_of(sids array) -> their keys."""
        sids = np.frombuffer(self._cached_ids(), dtype=np.int64)
        keys = np.ascontiguousarray(keys_of(sids), dtype=np.float64) if len(sids) else np.zeros(0)
        self._set_keys(sids, keys)

    def reserve(self, sid: int, size: int, key: float = math.inf) -> bool:
        """Set room aside for a fetch about to start of sample sid, of size bytes, needed at
        key (see policy.Policy.key), evicting only entries needed later. A sample holds one
        reservation at most (True at once if it holds one)."""
        return self.reserve_many((sid,), (size,), (key,)) == 1

    def put(self, sid: int, data: bytes, key: float = math.inf) -> bool:
        """Keep data if room can be made by evicting entries needed later than key (its
        next use, math.inf: none planned). Returns whether it was kept."""
        return self.put_many(((sid, data),), (key,)) == 1

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
