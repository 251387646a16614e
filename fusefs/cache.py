"""Sample caches: byte-budgeted maps from sample id to the sample's verified bytes."""
from __future__ import annotations

from collections import OrderedDict


class LRUCache:
    """Least-recently-used eviction within a byte budget.

    Used when no order is known: demand fetches and in-order scans. A sample larger
    than the whole budget is simply not kept.
    """

    def __init__(self, budget: int):
        if budget < 0:
            raise ValueError("cache budget must be >= 0")
        self.budget = budget
        self.used = 0
        self.evictions = 0
        self._data: OrderedDict[int, bytes] = OrderedDict()

    def __len__(self) -> int:
        return len(self._data)

    def __contains__(self, sid: int) -> bool:
        return sid in self._data

    def get(self, sid: int) -> bytes | None:
        data = self._data.get(sid)
        if data is not None:
            self._data.move_to_end(sid)
        return data

    def put(self, sid: int, data: bytes) -> None:
        if len(data) > self.budget:
            return
        old = self._data.pop(sid, None)
        if old is not None:
            self.used -= len(old)
        while self.used + len(data) > self.budget:
            _, victim = self._data.popitem(last=False)
            self.used -= len(victim)
            self.evictions += 1
        self._data[sid] = data
        self.used += len(data)

    def discard(self, sid: int) -> None:
        old = self._data.pop(sid, None)
        if old is not None:
            self.used -= len(old)
