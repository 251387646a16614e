"""An epoch's read order and how far the readers have got through it (pure, no I/O).

The plan counts uses: a sample is "used" each time a reader closes it. The k-th use of a
sample is matched to its k-th occurrence in the order, so a sample that occurs twice is
known to be needed until its second use, and `use()` says when a use was the last.

Readers do not consume the order exactly in sequence: DataLoader worker processes and
their prefetching interleave batches, and a reader may skip samples. The cursor is the
first occurrence not yet used; occurrences more than `skip_window` positions behind the
furthest use are taken as skipped (so a skipped sample cannot hold the cursor back). The
samples so passed wait in `passed` until the caller takes them: their next use moved on
without a use of theirs, and the cache's key for them must move on too (a reader's late
use of a passed occurrence counts for nothing). A late use says that the readers lag each
other by more than the window, not that they skip: the window grows to twice that lag (up
to MAX_SKIP_WINDOW), so readers that keep it stop having their samples passed, keyed as
needed next epoch and evicted before they read them (ImageNet's count with 4 readers
drifting apart refetched a third of its samples).

With the next epoch's order (Order.next), a sample's next use may lie beyond this order's
end: `distance` counts positions from the cursor through the rest of this order into the
next one, which is what the cache's eviction (furthest next use first) and the read-ahead
past the epoch's end go by.
"""
from __future__ import annotations

import numpy as np

from . import _plancore
from .order import Order

INF = float("inf")
SKIP_WINDOW = 4096  # positions behind the furthest use before an occurrence counts as skipped
MAX_SKIP_WINDOW = 1 << 16  # what late uses may widen it to
AHEAD_COVERED, AHEAD_BOUND = 1, 2  # why Plan.ahead stopped: the end of the orders; the depth


class Plan:
    """Memory: Plan.cost(...) bytes, for n_files samples and orders of n and m entries: 25
    bytes an entry of this order, 16 of the next, 17 a sample of the dataset (positions are
    int32: an order has at most order.entry_limit entries)."""

    def __init__(self, order: Order, sizes: np.ndarray, skip_window: int = SKIP_WINDOW):
        n_files = len(sizes)
        self.ids = np.ascontiguousarray(order.ids, dtype=np.int64)
        self.epoch = order.epoch
        self.importance = order.importance
        self.sizes = sizes
        self.skip_window = skip_window
        # positions grouped by sample, and where each sample's run starts
        self._by_sample = np.argsort(self.ids, kind="stable").astype(np.int32)
        self._first = np.searchsorted(self.ids[self._by_sample], np.arange(n_files + 1)).astype(np.int32)
        self.total = np.diff(self._first)  # occurrences per sample
        self.uses = np.zeros(n_files, dtype=np.int32)
        self.consumed = np.zeros(len(self.ids), dtype=bool)
        self.cursor = 0
        self.frontier = 0  # one past the furthest position used
        self.skipped = 0
        self.late = 0  # uses of occurrences passed as skipped (each widened the window)
        self.passed: list[int] = []  # samples whose occurrence the cursor passed unused (Core.use)
        self.was_passed = np.zeros(n_files, dtype=bool)  # its last occurrence passed, no use since
        nxt = order.next
        self.next_ids = (np.zeros(0, np.int64) if nxt is None
                         else np.ascontiguousarray(nxt.ids, dtype=np.int64))
        # the first position of each sample in the next order (-1: not in it)
        self.next_first = np.full(n_files, -1, dtype=np.int32)
        self.next_first[self.next_ids[::-1]] = np.arange(len(self.next_ids), dtype=np.int32)[::-1]
        # bytes of the positions before each position, through this order and the next
        self._cum = np.concatenate([[0], np.cumsum(sizes[np.concatenate([self.ids, self.next_ids])],
                                                   dtype=np.int64)])
        # The per-sample paths (several calls per sample read) read single elements through
        # memoryviews of these arrays (`_v`): a Python int or bool, 2-4 times faster than a
        # numpy scalar and its arithmetic. The arrays stay the one copy (the views share it).
        self.ids_v, self.consumed_v = memoryview(self.ids), memoryview(self.consumed)
        self.next_ids_v = memoryview(self.next_ids)
        self._uses_v, self._total_v = memoryview(self.uses), memoryview(self.total)
        self._by_sample_v, self._first_v = memoryview(self._by_sample), memoryview(self._first)
        self._next_first_v, self._cum_v = memoryview(self.next_first), memoryview(self._cum)
        self._was_passed_v = memoryview(self.was_passed)
        # (what _plancore counts a batch of uses in, and walks ahead through)
        self._arrays = (self.uses, self.total, self._by_sample, self._first, self.consumed, self.next_first,
                        self.was_passed, self.ids)
        self._ahead = (self.ids, self.consumed, self.next_ids, self._cum)

    def __len__(self) -> int:
        return len(self.ids)

    @staticmethod
    def cost(n_files: int, n: int, m: int) -> int:
        """The bytes a plan holds for n_files samples, an order of n entries and a next one
        of m (what `nbytes` is once built): ids, by sample, consumed, cumulative sizes; the
        next order's ids and cumulative sizes; per sample its first position, occurrences,
        uses and first position in the next order."""
        return (8 + 4 + 1) * n + 8 * m + 8 * (n + m + 1) + 4 * (n_files + 1) + 13 * n_files

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.ids, self._by_sample, self.consumed, self._cum, self.next_ids,
                                      self._first, self.total, self.uses, self.next_first, self.was_passed))

    @property
    def done(self) -> bool:
        return self.cursor >= len(self.ids)

    def remaining(self, sid: int) -> int:
        """Uses of sid still ahead in this order."""
        return self._total_v[sid] - self._uses_v[sid]

    def next_position(self, sid: int) -> int | None:
        uses = self._uses_v[sid]
        if uses >= self._total_v[sid]:
            return None
        return self._by_sample_v[self._first_v[sid] + uses]

    def bytes_between(self, start: int, end: int) -> int:
        """Bytes of the samples at positions start..end-1 (through this order and the next)."""
        return self._cum_v[end] - self._cum_v[start]

    def distance(self, sids: np.ndarray) -> np.ndarray:
        """For each of sids, how many positions after the cursor it is needed next, in this
        order or, after its last use here, in the next one (inf: never)."""
        sids = np.asarray(sids, dtype=np.int64)
        uses = self.uses[sids]
        here = uses < self.total[sids]
        out = np.full(len(sids), np.inf)
        at = self._first[sids[here]] + uses[here]
        out[here] = self._by_sample[at].astype(np.int64) - self.cursor
        nxt = self.next_first[sids[~here]].astype(np.int64)
        later = np.where(nxt >= 0, (len(self.ids) - self.cursor) + nxt, np.inf)
        out[~here] = later
        return out

    def distance_of(self, sid: int) -> float:
        return self.position_of(sid) - self.cursor

    def distance_after_use(self, sid: int) -> float:
        """distance_of(sid) once the use a reader is making of it now is counted."""
        return self.position_after_use(sid) - self.cursor

    def position_of(self, sid: int) -> float:
        """Where sid is needed next: its next position in this order, or len(self) plus its
        first position in the next one (inf: never)."""
        pos = self.next_position(sid)
        return self._position_in_next(sid) if pos is None else pos

    def positions_of(self, sids) -> list:
        """position_of() of each of sids, in one call of fusefs._plancore (C)."""
        return _plancore.positions_of(self._arrays, sids)

    def ahead(self, pos: int, depth: int, most: int, step: int, skip: tuple, flags: tuple) -> tuple:
        """The read-ahead's walk (prefetch.ReadAheadPlan.advance), from position pos through
        this order and then the next one, in one call of fusefs._plancore (C): up to `most`
        samples not consumed, in none of the containers of skip (`sid in c`) and set in none
        of the arrays of flags (a byte a sample each; at most four), looking at fewer than
        step positions (-1: no bound) and staying within depth bytes of the frontier: (sids,
        their positions, the position it got to, positions looked at, why it stopped: 0 (it
        may go on), AHEAD_COVERED (the end of the orders) or AHEAD_BOUND (as deep as it may
        look))."""
        return _plancore.ahead(self._ahead, pos, self.frontier, depth, most, step, skip, flags)

    def position_after_use(self, sid: int) -> float:
        """position_of(sid) once the use a reader is making of it now is counted."""
        uses = self._uses_v[sid]
        left = self._total_v[sid] - uses
        if left >= 2:
            return self._by_sample_v[self._first_v[sid] + uses + 1]
        return self._position_in_next(sid) if left == 1 else self.position_of(sid)

    def _position_in_next(self, sid: int) -> float:
        """len(self) plus sid's first position in the next order (inf: not in it)."""
        nxt = self._next_first_v[sid]
        return len(self.ids) + nxt if nxt >= 0 else INF

    def use(self, sid: int) -> list[int] | None:
        """Record one use of sid; return the samples whose last use this completed (None:
        this order does not need sid again, and nothing was recorded). One sample's use
        per reader's close: what next_position and _mark do, inline."""
        uses, total = self._uses_v[sid], self._total_v[sid]
        if uses >= total:
            if self._was_passed_v[sid]:
                self._late_use(sid)
            return None
        pos = self._by_sample_v[self._first_v[sid] + uses]
        self.consumed_v[pos] = True
        self._uses_v[sid] = uses = uses + 1
        finished = [sid] if uses == total else []
        if pos >= self.frontier:
            self.frontier = pos + 1
        # (the cursor moves only if it stood here, or now lags the furthest use too far)
        if pos == self.cursor or self.cursor < self.frontier - self.skip_window:
            finished += self._advance()
        return finished

    def use_many(self, sids) -> list:
        """use() of each of sids in turn, for the batched path of a single plan
        (core.Core.answered), in one call of fusefs._plancore (C): the samples whose use was
        counted, each followed by where it is needed next after that use (position_of),
        [sid, position, sid, position, ...]; a sample this order no longer needs is left out.
        The samples whose last use was completed are not returned (only the local tier asks
        for them, per sample); the cursor's passed samples go to `passed`, as use() leaves
        them."""
        out, self.cursor, self.frontier, self.skip_window, skipped, late = _plancore.use_many(
            self._arrays, sids, self.cursor, self.frontier, self.skip_window, MAX_SKIP_WINDOW, self.passed)
        self.skipped += skipped
        self.late += late
        return out

    def _mark(self, sid: int, pos: int) -> list[int]:
        self.consumed_v[pos] = True
        uses = self._uses_v[sid] = self._uses_v[sid] + 1
        return [sid] if uses == self._total_v[sid] else []

    def _advance(self) -> list[int]:
        finished = []
        n = len(self.ids)
        consumed = self.consumed_v
        while self.cursor < n and (consumed[self.cursor]
                                   or self.cursor < self.frontier - self.skip_window):
            if not consumed[self.cursor]:  # skipped by the readers
                sid = self.ids_v[self.cursor]
                if self.next_position(sid) == self.cursor:
                    finished += self._mark(sid, self.cursor)
                    self.skipped += 1
                    self.passed.append(sid)
                    if self._uses_v[sid] >= self._total_v[sid]:  # (its last: a later use is late)
                        self._was_passed_v[sid] = True
            self.cursor += 1
        return finished

    def _late_use(self, sid: int) -> None:
        """A reader used sid after the cursor passed its last occurrence as skipped: the
        readers lag each other by more than the window, which grows to twice that lag."""
        self._was_passed_v[sid] = False
        self.late += 1
        lag = self.frontier - self._by_sample_v[self._first_v[sid] + self._total_v[sid] - 1]
        self.skip_window = min(MAX_SKIP_WINDOW, max(self.skip_window, 2 * lag))

    def window(self, budget: int, max_scan: int = 65536) -> np.ndarray:
        """Sample ids of the not-yet-used occurrences from the cursor on, in order, whose
        sizes add up to at most budget bytes (each sample once)."""
        seg = slice(self.cursor, min(len(self.ids), self.cursor + max_scan))
        ids = self.ids[seg][~self.consumed[seg]]
        if not len(ids):
            return ids
        ids = ids[np.sort(np.unique(ids, return_index=True)[1])]
        end = int(np.searchsorted(np.cumsum(self.sizes[ids], dtype=np.int64), budget, side="right"))
        return ids[:end]
