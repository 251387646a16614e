"""The sample cache: verified sample bytes within one byte budget.

Two kinds of entries share the budget:

* planned: samples the current order still needs. They leave the cache when the plan
  says their last use is done (`drop`), so with an order the cache holds little more
  than what lies between the readers and the read-ahead;
* unplanned: everything else (reads without an order, or outside it, or needed only after
  more than a budget's worth of other samples when the order came), kept in LRU order.

* pinned: with a static share of the budget (`mount --static-cache`), the samples of
  highest importance in the orders, as many as fit in that share. They stay after their
  last use, across epochs, and are never evicted for other entries; a new order re-picks
  them (`set_pins`), and those no longer picked become ordinary entries.

When a new entry does not fit, unplanned entries go (oldest first); if it still does not
fit it is not kept. Planned entries are never pushed out: the read-ahead reserved their
room before fetching them, and a sample a reader missed (fetched without a reservation
when the budget was full) is not worth a refetch of one planned: its reader holds its
bytes anyway. Bytes reserved for fetches under way count against the budget too, so the
budget is never exceeded.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Callable

import numpy as np


class _SizedLRU(OrderedDict):
    """The LRU entries, with their total size kept up to date (`nbytes`)."""

    def __init__(self):
        super().__init__()
        self.nbytes = 0

    def __setitem__(self, sid, data):
        old = super().get(sid)
        if old is not None:
            self.nbytes -= len(old)
        super().__setitem__(sid, data)
        self.nbytes += len(data)

    def pop(self, sid, *default):
        if sid in self:
            data = super().pop(sid)
            self.nbytes -= len(data)
            return data
        if default:
            return default[0]
        raise KeyError(sid)

    def popitem(self, last=True):
        sid, data = super().popitem(last)
        self.nbytes -= len(data)
        return sid, data


class SampleCache:
    def __init__(self, budget: int, static: int = 0):
        if budget < 0:
            raise ValueError("cache budget must be >= 0")
        if not 0 <= static <= budget:
            raise ValueError("the static (pinned) share must lie between 0 and the budget")
        self.budget = budget
        self.static = static
        self.pin_set: set[int] = set()  # samples picked for pinning (cached or not yet)
        self._pinned: dict[int, bytes] = {}
        self.used = 0
        self.reserved = 0
        self.evictions = 0
        self.peak = 0
        self._planned: dict[int, bytes] = {}
        self._lru = _SizedLRU()

    def __len__(self) -> int:
        return len(self._planned) + len(self._lru) + len(self._pinned)

    def __contains__(self, sid: int) -> bool:
        return sid in self._planned or sid in self._lru or sid in self._pinned

    @property
    def pinned_bytes(self) -> int:
        return sum(len(d) for d in self._pinned.values())

    @property
    def pinned_samples(self) -> int:
        return len(self._pinned)

    @property
    def free(self) -> int:
        return self.budget - self.used - self.reserved

    @property
    def available(self) -> int:
        """Bytes a reservation can have: the free ones and those of LRU entries."""
        return self.free + self._lru.nbytes

    def get(self, sid: int) -> bytes | None:
        data = self._planned.get(sid)
        if data is None:
            data = self._pinned.get(sid)
        if data is None:
            data = self._lru.get(sid)
            if data is not None:
                self._lru.move_to_end(sid)
        return data

    def reserve(self, nbytes: int) -> bool:
        """Set nbytes aside for a fetch about to start, if they fit once unplanned (LRU)
        entries are evicted; planned entries are never evicted for a reservation."""
        while nbytes > self.free and self._lru:
            self._evict(self._lru.popitem(last=False)[1])
        if nbytes > self.free:
            return False
        self.reserved += nbytes
        self.peak = max(self.peak, self.used + self.reserved)
        return True

    def unreserve(self, nbytes: int) -> None:
        self.reserved -= nbytes

    def put(self, sid: int, data: bytes, next_use: int | None = None) -> bool:
        """Keep data, if it fits once unplanned entries are evicted; next_use is its
        position in the order (None: unplanned). Returns whether the data was kept."""
        self.drop(sid)
        need = len(data)
        while need > self.free and self._lru:
            self._evict(self._lru.popitem(last=False)[1])
        if need > self.free:
            return False
        if sid in self.pin_set:
            self._pinned[sid] = data
        else:
            (self._planned if next_use is not None else self._lru)[sid] = data
        self.used += need
        self.peak = max(self.peak, self.used + self.reserved)
        return True

    def _evict(self, data: bytes) -> None:
        self.used -= len(data)
        self.evictions += 1

    def drop(self, sid: int) -> bool:
        data = self._planned.pop(sid, None)
        if data is None:
            data = self._lru.pop(sid, None)
        if data is None:
            data = self._pinned.pop(sid, None)
        if data is None:
            return False
        self.used -= len(data)
        return True

    def release(self, sid: int) -> bool:
        """sid's last use in the orders is done: drop it unless it is pinned."""
        return sid not in self._pinned and self.drop(sid)

    def set_pins(self, ids: np.ndarray, importance: np.ndarray, sizes: np.ndarray) -> None:
        """Pick the samples to pin: by importance (highest first), as many as fit in the
        static share. Cached ones move to the pinned entries; those no longer picked
        become unplanned (a `replan` after this files them by the new order)."""
        pick: set[int] = set()
        if self.static and len(ids):
            ids = np.asarray(ids, dtype=np.int64)
            order = np.argsort(-np.asarray(importance, dtype=np.float64), kind="stable")
            ranked = ids[order]
            ranked = ranked[np.sort(np.unique(ranked, return_index=True)[1])]  # best occurrence
            fits = np.cumsum(sizes[ranked], dtype=np.int64) <= self.static
            pick = set(ranked[:int(np.argmin(fits)) if not fits.all() else len(ranked)].tolist())
        for sid in [s for s in self._pinned if s not in pick]:
            self._lru[sid] = self._pinned.pop(sid)
        for sid in pick:
            for src in (self._planned, self._lru):
                if sid in src:
                    self._pinned[sid] = src.pop(sid)
        self.pin_set = pick

    def replan(self, near: Callable[[int], bool]) -> None:
        """A new order: entries it needs soon enough to keep (near) become planned, the
        others unplanned (LRU). An entry the order needs only after more than the budget's
        worth of other samples would hold room that the read-ahead needs first: as an LRU
        entry it stays until that room is wanted, and `promote` makes it planned again if
        the read-ahead reaches it while it is still here."""
        for sid in list(self._planned):
            if not near(sid):
                self._lru[sid] = self._planned.pop(sid)
        for sid in list(self._lru):
            if near(sid):
                self._planned[sid] = self._lru.pop(sid)

    def promote(self, sid: int) -> None:
        """The read-ahead reached sid, which is cached: keep it until its use (planned)."""
        data = self._lru.pop(sid, None)
        if data is not None:
            self._planned[sid] = data
