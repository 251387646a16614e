"""The learning half of the activation-swap scheduler, without torch: a plan is one bit per
unit (1: swap it), an action flips one unit's bit or keeps the plan, and the Q table over
(plan, action) learns, on-policy and epsilon-greedily, which plan is fastest within a memory
budget (or best by the w trade-off) from each round's step time and peak memory.
swap.SwapScheduler is this learner over a model's hooks and measurements (swap.py's
docstring has the rules); `segments` cuts a forward into units, `largest_batch` finds the
largest batch that fits."""
from __future__ import annotations

import numpy as np


class PlanLearner:
    """Learns a plan over units (names, or objects with a name: see unit_name) from
    observe(t, m) each round. budget: the most memory a chosen plan may use, in bytes, or as
    a share of the no-swap plan's (a float <= 1); None: the w trade-off."""

    def __init__(self, units, *, budget: float | None = None, w: float = 0.5, alpha: float = 0.5,
                 gamma: float = 0.9, epsilon: float = 0.5, epsilon_decay: float = 0.9,
                 epsilon_min: float = 0.02, patience: int = 5, seed: int = 0):
        if not 0.0 <= w <= 1.0:
            raise ValueError(f"w must lie in [0, 1], got {w}")
        if budget is not None and budget <= 0:
            raise ValueError(f"budget must be positive (bytes, or a share <= 1), got {budget}")
        self.units = list(units)
        self.n_actions = len(self.units) + 1  # flip unit i, or keep the plan
        self.q = np.zeros((2 ** len(self.units), self.n_actions))
        self.budget = budget
        self.w, self.alpha, self.gamma = w, alpha, gamma
        self.epsilon, self.epsilon_decay, self.epsilon_min = epsilon, epsilon_decay, epsilon_min
        self.patience = patience
        self.rng = np.random.default_rng(seed)
        self.plan = 0
        self.baseline: tuple[float, float] | None = None  # (t0, m0) of the no-swap plan
        self.best: tuple[float, int] | None = None         # (reward, plan), within the budget
        self.lowest: tuple[float, int] | None = None       # (memory, plan): if none is within
        self.measured: dict[int, tuple[float, float]] = {}  # plan -> (step s, memory), last
        self.failed: set[int] = set()                       # plans that ran out of memory
        self.converged = False
        self.rounds = 0
        self._kept = 0
        self._action: int | None = None
        self._prev_plan = 0

    # ---- plans ---------------------------------------------------------------------------
    def unit_name(self, u) -> str:
        if isinstance(u, str):
            return u
        return u.__name__ if isinstance(u, type) else f"segment {u}"

    def plan_dict(self, plan: int | None = None) -> dict:
        plan = self.plan if plan is None else plan
        return {self.unit_name(u): bool(plan >> i & 1) for i, u in enumerate(self.units)}

    def apply_plan(self) -> None:
        """Put the current plan in force (after `plan` was changed); here, nothing to do."""

    def blocked(self, u) -> bool:
        """Whether unit u may not be swapped (here: none may not)."""
        return False

    def allowed(self, plan: int, action: int) -> bool:
        """An action may not turn on swapping for a unit marked unswappable, nor lead to a
        plan that ran out of memory."""
        if action == len(self.units):
            return True
        u = self.units[action]
        if self.blocked(u) and not plan >> action & 1:
            return False
        return self.next_plan(plan, action) not in self.failed

    def next_plan(self, plan: int, action: int) -> int:
        return plan if action == len(self.units) else plan ^ (1 << action)

    def choose(self, plan: int) -> int:
        """Epsilon-greedy over the allowed actions."""
        acts = [a for a in range(self.n_actions) if self.allowed(plan, a)]
        if self.rng.random() < self.epsilon:
            return int(self.rng.choice(acts))
        q = self.q[plan, acts]
        return int(acts[int(np.flatnonzero(q == q.max())[0])])

    def update(self, s: int, a: int, r: float, s2: int, a2: int) -> float:
        """Q(s,a) <- Q(s,a) + alpha (r + gamma Q(s',a') - Q(s,a)); returns the new value."""
        self.q[s, a] += self.alpha * (r + self.gamma * self.q[s2, a2] - self.q[s, a])
        return float(self.q[s, a])

    def budget_bytes(self) -> float | None:
        if self.budget is None or self.baseline is None:
            return None
        return self.budget * self.baseline[1] if self.budget <= 1 else float(self.budget)

    def within_budget(self, m: float) -> bool:
        limit = self.budget_bytes()
        return limit is None or m <= limit

    def reward(self, t: float, m: float) -> float:
        """With a budget: 1 - t / t0 for a plan within it (the no-swap plan, if within,
        scores 0; slower plans less), and 1 + (m - budget) / m0 less for one over it, so
        every plan within the budget beats every plan over it and, over it, less memory
        scores more. Without: r_time + w (r_mem - r_time) + 1, r_time = -t / t0,
        r_mem = -m / m0."""
        t0, m0 = self.baseline
        if self.budget is not None:
            r = 1.0 - t / t0
            limit = self.budget_bytes()
            return r if m <= limit else r - 1.0 - (m - limit) / max(m0, 1.0)
        r_time, r_mem = -t / t0, -m / max(m0, 1.0)
        return 1.0 + r_time + self.w * (r_mem - r_time)

    def observe(self, t: float, m: float) -> None:
        """End of a round with the current plan's step time t and memory m: learn, move."""
        self.rounds += 1
        if self.baseline is None:  # the first round runs the no-swap plan: the reference
            self.baseline = (t, m)
        self.measured[self.plan] = (t, m)
        r = self.reward(t, m)
        if self.within_budget(m) and (self.best is None or r > self.best[0]):
            self.best = (r, self.plan)
        if self.lowest is None or m < self.lowest[0]:
            self.lowest = (m, self.plan)
        if self.converged:
            return
        if self._action is None:
            self._action = self.choose(self.plan)
        else:  # r is the reward of the previous action, which led to this plan
            a2 = self.choose(self.plan)
            self.update(self._prev_plan, self._action, r, self.plan, a2)
            self._action = a2
        self.epsilon = max(self.epsilon_min, self.epsilon * self.epsilon_decay)
        greedy_keep = int(np.argmax(self.q[self.plan])) == len(self.units) and self.q[self.plan].any()
        self._kept = self._kept + 1 if greedy_keep else 0
        if self._kept >= self.patience:
            self.use_best()
            return
        self._prev_plan = self.plan
        self.plan = self.next_plan(self.plan, self._action)
        self.apply_plan()

    def chosen(self) -> int:
        """The plan to train with: the best measured within the budget, else the one with
        the least memory measured."""
        if self.best is not None:
            return self.best[1]
        return self.lowest[1] if self.lowest is not None else 0

    def use_best(self) -> None:
        """Stop learning and use the chosen plan."""
        self.converged = True
        self.plan = self.chosen()
        self.apply_plan()

    def penalise(self) -> None:
        """The current plan ran out of memory: never tried again, the action that led to it
        penalised, and the best plan so far (or none) in force."""
        self.failed.add(self.plan)
        if self._action is not None:
            self.q[self._prev_plan, self._action] += self.alpha * (-10.0 - self.q[self._prev_plan, self._action])
        self._action = None
        self.plan = self.best[1] if self.best is not None else 0
        self.apply_plan()

    # ---- persistence ---------------------------------------------------------------------
    def save(self, path: str) -> None:
        np.savez(path, q=self.q, types=np.array([self.unit_name(u) for u in self.units]),
                 plan=self.plan, best_plan=-1 if self.best is None else self.best[1])

    def load(self, path: str) -> None:
        with np.load(path) as z:
            names = [str(n) for n in z["types"]]
            mine = [self.unit_name(u) for u in self.units]
            if names != mine:
                raise ValueError(f"Q table is for units {names}, this scheduler has {mine}")
            self.q = z["q"].copy()
            self.plan = int(z["plan"])
        self.apply_plan()


def segments(saved_by: dict, k: int) -> dict:
    """{module: segment} for k contiguous segments of the forward (saved_by's order) with
    about equal saved bytes each (no segment skipped; the last may stay empty)."""
    total = sum(saved_by.values()) or 1
    out, acc, prev = {}, 0, -1
    for m, n in saved_by.items():
        prev = out[m] = min(k - 1, prev + 1, int(k * (acc + n / 2) / total))  # no empty one between
        acc += n
    return out


def largest_batch(fits, start: int, limit: int = 1 << 20) -> int:
    """The largest batch size b <= limit with fits(b) true, to within 1/16 of it, for a
    fits() that is monotone (true up to some size, false beyond): doubles from start, then
    bisects. fits(b) runs one training step at batch b and says whether it had the memory.
    Returns 0 when not even a batch of 1 fits."""
    lo, hi = 0, max(1, start)  # fits(lo) (or lo == 0), and hi is still to be tried
    while fits(hi):
        lo = hi
        if hi >= limit:
            return lo
        hi = min(2 * hi, limit)
    while hi - lo > max(1, lo // 16):  # now not fits(hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo
