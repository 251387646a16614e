"""The order and cache policy across ranks: which sample is needed when (pure, no I/O).

Each rank's plan (plan.Plan) counts its readers' uses along its order and, with the next
epoch's order, beyond it. From them the policy answers:

* `key(sid)` / `keys(sids)`: when a sample is needed next, as a point on one clock shared
  by all ranks (the nearest use over the plans, positions after each plan's cursor, plus
  the clock: the plans' mean cursor). Keys stay comparable while readers move on, so the
  cache keeps each entry's key until a use or a new order changes it.
* pins (the static share, by importance), and the local tier's priorities.
"""
from __future__ import annotations

import numpy as np

from .order import Order
from .plan import Plan

INF = float("inf")
# under several orders, at least this many samples have their keys computed at once (keys_of:
# numpy's fixed cost per call is about that of this many Python calls of Policy.key)
KEYS_AT_ONCE = 48


class Policy:
    def __init__(self, sizes: np.ndarray):
        self.sizes = sizes
        self.n_files = len(sizes)
        self.plans: dict[int, Plan] = {}

    @property
    def clock(self) -> float:
        """The plans' mean cursor: with one plan a key is then the absolute position of the
        next use (in the order, or past its end in the next one), which never drifts."""
        plans = self.plans
        if not plans:
            return 0.0
        return sum(p.cursor for p in plans.values()) / len(plans)

    def set_order(self, rank: int, order: Order) -> Plan:
        """rank's plan for order, put in force (what orders.Orders does in two steps)."""
        plan = Plan(order, self.sizes)
        self.put(rank, plan)
        return plan

    def put(self, rank: int, plan: Plan) -> None:
        """Put rank's plan in force (in place of its last one)."""
        self.plans[rank] = plan

    @property
    def ahead(self) -> bool:
        """Whether an order in force has positions not yet read (one read to its end needs
        nothing more until the next comes)."""
        return any(not plan.done for plan in self.plans.values())

    @property
    def single(self) -> Plan | None:
        """The one plan in force, where there is exactly one (its positions are then the
        keys themselves: `clock`), else None."""
        plans = self.plans
        if len(plans) != 1:
            return None
        for plan in plans.values():
            return plan

    # ---- next uses -------------------------------------------------------------------
    def key(self, sid: int) -> float:
        return self._nearest(sid, after_use=False)

    def key_after_use(self, sid: int) -> float:
        """key(sid) once the use a reader is making of it now is counted (for a sample
        fetched for a reader who missed it: that reader holds its bytes for this use), in
        the plan that `use` counts it in; the other plans' next uses stand."""
        return self._nearest(sid, after_use=True)

    def _nearest(self, sid: int, after_use: bool) -> float:
        plans = self.plans
        if len(plans) == 1:  # (the clock is its cursor: the key is the position itself)
            for plan in plans.values():
                return plan.position_after_use(sid) if after_use else plan.position_of(sid)
        best = INF
        for plan in plans.values():
            if after_use and plan.remaining(sid) > 0:
                d = plan.distance_after_use(sid)
                after_use = False  # (counted in the first plan that needs it, as use() does)
            else:
                d = plan.distance_of(sid)
            if d < best:
                best = d
        return best + self.clock

    def keys(self, sids: np.ndarray) -> np.ndarray:
        out = np.full(len(sids), INF)
        for plan in self.plans.values():
            np.minimum(out, plan.distance(sids), out=out)
        return out + self.clock

    def keys_of(self, sids: list[int]) -> list[float]:
        """key() of each of sids: under one order, their positions from one call of C
        (Plan.positions_of); else from one numpy pass (keys) where there are at least
        KEYS_AT_ONCE."""
        plans = self.plans
        if len(plans) == 1:
            for plan in plans.values():
                return plan.positions_of(sids)
        if len(sids) < KEYS_AT_ONCE:
            key = self.key
            return [key(s) for s in sids]
        return self.keys(np.array(sids, dtype=np.int64)).tolist()

    def next_use(self, sid: int) -> int | None:
        """How many positions ahead of its plan's cursor sid is needed next in the current
        orders (None: not again in them)."""
        best = None
        for plan in self.plans.values():
            pos = plan.next_position(sid)
            if pos is not None and (best is None or pos - plan.cursor < best):
                best = pos - plan.cursor
        return best

    def use(self, sid: int) -> tuple[Plan, list[int]] | None:
        """A reader closed sid: count it in the first plan that still needs it; that plan
        and the samples whose last use in it this completed (None: no plan needs it)."""
        for plan in self.plans.values():
            done = plan.use(sid)
            if done is not None:
                return plan, done
        return None

    # ---- importance: pins and the local tier ---------------------------------------------
    def importance_plans(self, plans: dict | None = None) -> list[Plan]:
        return [p for p in (self.plans if plans is None else plans).values() if p.importance is not None]

    def pin_candidates(self, plans: dict | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(ids, importance) over all ranks' orders that carry importance values (plans:
        these instead of the plans in force; their ids and importance are only read)."""
        plans = self.importance_plans(plans)
        if not plans:
            return np.zeros(0, np.int64), np.zeros(0, np.float32)
        return (np.concatenate([p.ids for p in plans]),
                np.concatenate([p.importance for p in plans]))

    def tier_priorities(self, plans: dict | None = None) -> np.ndarray:
        """What the local tier keeps when full (higher stays): the orders' importance values
        where some order carries them, else how soon the orders need a sample (minus its
        position); -inf for samples no such order names (plans: as pin_candidates)."""
        prio = np.full(self.n_files, -np.inf)
        plans = self.importance_plans(plans) or list((self.plans if plans is None else plans).values())
        for plan in plans:
            val = (plan.importance.astype(np.float64) if plan.importance is not None
                   else -np.arange(len(plan.ids), dtype=np.float64))
            cur = np.full(self.n_files, -np.inf)
            cur[plan.ids[::-1]] = val[::-1]  # reversed: the first occurrence wins
            np.maximum(prio, cur, out=prio)
        return prio

    def keeps_after_use(self, sid: int) -> bool:
        """Whether the local tier's priority of sid holds once the use it is being fetched
        for is over (importance orders keep theirs; else only if it is needed again)."""
        return bool(self.importance_plans()) or any(p.remaining(sid) > 1 for p in self.plans.values())
