"""Orders: how a rank's order is checked, costed and put in force.

An order comes in as bytes (order.py's format; the control socket, or `set` without a
mount). `prepare` does everything that costs time and touches nothing shared: it parses the
order, checks that every rank's orders together stay within the order budget, builds its
plan (plan.Plan) and what follows from the plans together (the pins of the static cache,
the local tier's priorities); `install` then puts it in force on the event loop, where it
only swaps objects in and re-keys the cache. `commit` runs `prepare` in a worker thread, one
commit at a time, so a large order (a million entries: seconds of numpy) never holds up
the loop's other requests.

The budget: what the plans of all ranks hold (Plan.cost) and the bytes of their orders
(kept for `.fusefs/order.<rank>`) together, at most `budget` bytes: by default a quarter of
the cache budget and at least what orders covering the dataset for every GPU of an 8-GPU
node take (default_budget). An order past it is refused with the figures, and the
previous one stays in force.
"""
from __future__ import annotations

import errno
import logging
from dataclasses import dataclass

import numpy as np
import trio

from . import order as orderfmt
from .entries import FsError
from .plan import Plan

log = logging.getLogger("fusefs")

CACHE_SHARE = 4   # the orders may take a quarter of the cache budget ...
NODE_RANKS = 8    # ... and at least what NODE_RANKS ranks' orders covering the dataset take


def default_budget(cache_bytes: int, n_files: int) -> int:
    """The orders' budget when the user sets none: a quarter of the cache budget, at least
    NODE_RANKS plans each holding its share of the dataset for this epoch and the next
    (with importance values)."""
    share = -(-n_files // NODE_RANKS)
    one = Plan.cost(n_files, share, share) + 2 * orderfmt.HEAD_SIZE + 16 * share
    return max(cache_bytes // CACHE_SHARE, NODE_RANKS * one)


@dataclass
class Prepared:
    """An order made ready to install: its plan, and what the plans together give."""
    rank: int
    data: bytes
    plan: Plan
    cost: int
    pins: tuple | None            # (ids, importance) for the static cache, or None
    priorities: np.ndarray | None  # the local tier's, or None


class Orders:
    def __init__(self, index, policy, cache, reads, prefetcher, stats, budget: int, *, local=None):
        """index: the samples' sizes; policy: the plans; cache: re-keyed and pinned by them;
        reads, prefetcher: told of a new order; stats: orders_accepted / orders_refused;
        budget: the bytes every rank's orders may hold together; local: the local tier."""
        self.index, self.policy, self.cache = index, policy, cache
        self.reads, self.prefetcher, self.stats, self.local = reads, prefetcher, stats, local
        self.budget = budget
        self.costs: dict[int, int] = {}        # rank -> the bytes its order in force holds
        self.refusals: dict[int, str] = {}     # rank -> why its last refused order was refused
        self._lock: trio.Lock | None = None    # one commit at a time (made in the loop)

    def counters(self) -> dict:
        return {"order_bytes": sum(self.costs.values()), "order_budget": self.budget,
                "order_refusals": {str(rank): why for rank, why in self.refusals.items()}}

    def limit(self) -> int:
        """The largest order (bytes) that could be accepted at all: the control socket
        refuses a larger one before reading it."""
        return min(orderfmt.size_limit(self.index.n_files), self.budget)

    def prepare(self, rank: int, data: bytes) -> Prepared:
        """Parse and cost the order, build its plan and what the plans together give, or
        FsError(EINVAL, why). Reads the other ranks' plans (their immutable parts) and
        changes nothing: any thread."""
        n_files = self.index.n_files
        others = self.room_taken(rank)
        counts = orderfmt.entries(data)
        if counts is not None:  # (refused on its headers alone: a refused order costs no parse)
            self._check_cost(Plan.cost(n_files, *counts) + len(data), others)
        try:
            order = orderfmt.parse(data, n_files)
        except orderfmt.OrderError as e:
            raise FsError(errno.EINVAL, str(e)) from None
        nxt = 0 if order.next is None else len(order.next)
        cost = Plan.cost(n_files, len(order), nxt) + len(data)
        self._check_cost(cost, others)
        plan = Plan(order, self.index.size)
        plans = {**self.policy.plans, rank: plan}
        pins = self.policy.pin_candidates(plans) if self.cache.static else None
        priorities = self.policy.tier_priorities(plans) if self.local is not None else None
        return Prepared(rank, data, plan, cost, pins, priorities)

    def room_taken(self, rank: int) -> int:
        """What the orders in force of ranks other than rank hold (an order for rank
        replaces rank's own)."""
        return sum(c for r, c in self.costs.items() if r != rank)

    def room(self, rank: int) -> int:
        """The bytes an order for rank may take of the order budget now: what the control
        socket lets a request for rank hold while it is read and prepared."""
        return self.budget - self.room_taken(rank)

    def _check_cost(self, cost: int, others: int) -> None:
        if others + cost > self.budget:
            raise FsError(errno.EINVAL, f"the orders of all ranks would hold {_mib(others + cost)} (this one "
                              f"{_mib(cost)}), more than the order budget of {_mib(self.budget)} "
                              "(fusefs mount --order-memory)")

    def _prepare_or_why(self, rank: int, data: bytes) -> Prepared | str:
        """prepare(), or why it refused: a reason, not the exception, comes back from the
        worker thread (trio's idle worker keeps its last result, and an exception's
        traceback would keep the refused order's bytes alive through prepare's frame)."""
        try:
            return self.prepare(rank, data)
        except FsError as e:
            return str(e)

    def install(self, p: Prepared) -> None:
        """Put a prepared order in force (the event loop)."""
        self.policy.put(p.rank, p.plan)
        self.costs[p.rank] = p.cost
        self.reads.new_order()
        self.prefetcher.reset()
        self.stats.orders_accepted += 1
        if p.pins is not None:
            self.cache.set_pins(*p.pins, self.index.size)
        if p.priorities is not None:
            self.local.set_priorities(p.priorities)
        self.cache.rekey_all(self.policy.keys)
        plan = p.plan
        log.info("rank %d: order of %d samples for epoch %d%s", p.rank, len(plan), plan.epoch,
                 f" (and {len(plan.next_ids)} of the next)" if len(plan.next_ids) else "")
        # the order's first samples are in flight before any reader can ask for them
        self.prefetcher.schedule_now()

    def refused(self, rank: int, why: str) -> None:
        self.stats.orders_refused += 1
        self.refusals[rank] = why  # (in the stats too)
        log.warning("order for rank %d refused, the previous one stays: %s", rank, why)

    def set(self, rank: int, data: bytes) -> None:
        """Replace rank's order with data's, or refuse it (FsError EINVAL): at once, on the
        caller's thread (a core without a mount, tests)."""
        try:
            prepared = self.prepare(rank, data)
        except FsError as e:
            self.refused(rank, str(e))
            raise
        self.install(prepared)

    async def commit(self, rank: int, data: bytes, before=None) -> None:
        """set(), with the preparing in a worker thread, one commit at a time; before(), if
        given, is called just before the order is put in force."""
        if self._lock is None:
            self._lock = trio.Lock()
        async with self._lock:
            prepared = await trio.to_thread.run_sync(self._prepare_or_why, rank, data)
            if isinstance(prepared, str):
                self.refused(rank, prepared)
                raise FsError(errno.EINVAL, prepared)
            if before is not None:
                before()
            self.install(prepared)


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"
