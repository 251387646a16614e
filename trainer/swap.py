"""Learn which saved activations to swap from accelerator memory to CPU memory (Q-learning).

Swapping (SwapHooks): while a module of a chosen layer type runs its forward, the tensors
autograd saves for backward go through torch.autograd.graph.saved_tensors_hooks. For a
type the plan swaps, each such tensor is copied to CPU memory (pinned, non-blocking on
CUDA) and the device copy is released; backward brings it back. On CUDA the copy back is
started ahead of time on a side stream: when backward unpacks a swapped tensor, the one
packed just before it (the next that backward will need) is already coming back.
Parameters are never swapped (they stay resident anyway), nor are tensors that cannot make
the round trip (not dense/strided): a layer type that saves such a tensor is marked
unswappable and the scheduler never swaps it. Gradients are identical with and without
swapping (the bytes are the same).

Memory accounting works everywhere: SwapHooks counts the bytes of saved tensors that stay
resident and those swapped in each step; on CUDA the scheduler uses
torch.cuda.max_memory_allocated instead.

The scheduler (SwapScheduler). A plan is one bit per layer type (1: swap); an action flips
one type's bit (or keeps the plan: action T). Each round (`steps_per_round` training steps)
measures the mean step time and peak memory of the current plan; with t and m normalised
by the no-swap plan's (lower is better), the reward is
    r = 1 + r_time + w * (r_mem - r_time),   r_time = -t / t0,  r_mem = -m / m0
(the +1 makes the no-swap plan score 0)
and the Q table over (plan, action) is updated on-policy:
    Q(s, a) <- Q(s, a) + alpha * (r + gamma * Q(s', a') - Q(s, a))
with a' the next action, chosen epsilon-greedily (epsilon decays per round). The plan has
converged when the greedy action has been "keep" for `patience` rounds; from then on the
best plan found is used without exploring. The Q table saves to and loads from disk, so a
later run (or a pre-training pass on a subset, `pretrain`) starts from what was learned.

    sched = SwapScheduler(model, w=0.5)
    for x, y in loader:
        with sched.step():                    # times the step, applies the plan
            loss = criterion(model(x), y)
            loss.backward()
        opt.step(); opt.zero_grad()
    sched.save("swap_q.npz")
"""
from __future__ import annotations

import contextlib
import time

import numpy as np
import torch
from torch import nn

DEFAULT_TYPES = (nn.Conv2d, nn.BatchNorm2d, nn.ReLU, nn.Linear, nn.MaxPool2d,
                 nn.MultiheadAttention, nn.LayerNorm, nn.GELU)


class SwapHooks:
    """Applies a plan ({layer type: swap?}) to a model's forward passes and counts bytes."""

    def __init__(self, model: nn.Module, types):
        self.types = list(types)
        self.swap = {t: False for t in self.types}
        self.unswappable: set = set()
        self.params = {p.data_ptr() for p in model.parameters()}
        self.resident_bytes = self.swapped_bytes = 0
        # False: the hooks step aside entirely (no saved_tensors_hooks of their own), so an
        # outer context such as torch.autograd.graph.save_on_cpu sees every saved tensor.
        self.enabled = True
        self._stack: list = []
        self._pending: list = []  # swapped items in pack order (CUDA read-ahead)
        self._side = None
        self._handles = []
        for m in model.modules():
            t = type(m)
            if t in self.swap:
                self._handles.append(m.register_forward_pre_hook(self._enter(t)))
                self._handles.append(m.register_forward_hook(self._exit))

    def _enter(self, t):
        def hook(module, args):
            if not self.enabled:
                self._stack.append(None)
                return
            ctx = torch.autograd.graph.saved_tensors_hooks(
                lambda x: self._pack(t, x), self._unpack)
            ctx.__enter__()
            self._stack.append(ctx)
        return hook

    def _exit(self, module, args, out):
        ctx = self._stack.pop()
        if ctx is not None:
            ctx.__exit__(None, None, None)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()

    def reset_counts(self) -> None:
        self.resident_bytes = self.swapped_bytes = 0
        self._pending.clear()

    # ---- pack / unpack -------------------------------------------------------------------
    def _pack(self, t, x):
        nbytes = x.numel() * x.element_size()
        if x.layout != torch.strided:
            self.unswappable.add(t)  # cannot make the round trip: this type stays resident
            self.resident_bytes += nbytes
            return ("keep", x)
        if not self.swap[t] or t in self.unswappable or x.data_ptr() in self.params:
            self.resident_bytes += nbytes
            return ("keep", x)
        self.swapped_bytes += nbytes
        if x.device.type == "cuda":
            host = torch.empty(x.size(), dtype=x.dtype, layout=x.layout, pin_memory=True)
            host.copy_(x, non_blocking=True)
        else:  # CPU-only: the copy stands in for the transfer (same bytes, same cost shape)
            host = x.detach().clone()
        item = {"host": host, "device": x.device, "back": None, "event": None}
        if x.device.type == "cuda":
            self._pending.append(item)  # for the read-ahead in backward; dropped when unpacked
        return ("swap", item)

    def _unpack(self, packed):
        kind, item = packed
        if kind == "keep":
            return item
        if item["device"].type != "cuda":
            return item["host"]
        if item["back"] is None:
            item["back"] = item["host"].to(item["device"], non_blocking=True)
        else:
            torch.cuda.current_stream().wait_event(item["event"])
        self._prefetch_before(item)
        return item["back"]

    def _prefetch_before(self, item) -> None:
        """Start bringing back the swapped tensor packed just before item (backward's next),
        and forget item (backward has it now). Backward unpacks roughly in reverse order of
        packing, so item is usually the last pending one: the search is short."""
        k = next((i for i in range(len(self._pending) - 1, -1, -1) if self._pending[i] is item), None)
        if k is None:
            return
        del self._pending[k]
        if k == 0:
            return
        prev = self._pending[k - 1]
        if prev["back"] is not None:
            return
        if self._side is None:
            self._side = torch.cuda.Stream(device=prev["device"])
        with torch.cuda.stream(self._side):
            prev["back"] = prev["host"].to(prev["device"], non_blocking=True)
            prev["event"] = torch.cuda.Event()
            prev["event"].record(self._side)


class SwapScheduler:
    """Learns a swap plan over the layer types present in model (see the module docstring)."""

    def __init__(self, model: nn.Module, types=DEFAULT_TYPES, *, w: float = 0.5,
                 alpha: float = 0.5, gamma: float = 0.9, epsilon: float = 0.5,
                 epsilon_decay: float = 0.9, epsilon_min: float = 0.02, steps_per_round: int = 2,
                 patience: int = 5, seed: int = 0, device=None):
        if not 0.0 <= w <= 1.0:
            raise ValueError(f"w must lie in [0, 1], got {w}")
        present = {type(m) for m in model.modules()}
        self.types = [t for t in types if t in present]
        self.hooks = SwapHooks(model, self.types)
        self.n_actions = len(self.types) + 1  # flip type i, or keep the plan
        self.q = np.zeros((2 ** len(self.types), self.n_actions))
        self.w, self.alpha, self.gamma = w, alpha, gamma
        self.epsilon, self.epsilon_decay, self.epsilon_min = epsilon, epsilon_decay, epsilon_min
        self.steps_per_round, self.patience = steps_per_round, patience
        self.rng = np.random.default_rng(seed)
        self.device = device
        self.plan = 0
        self.baseline: tuple[float, float] | None = None  # (t0, m0) of the no-swap plan
        self.best: tuple[float, int] | None = None         # (reward, plan)
        self.converged = False
        self.rounds = 0
        self._kept = 0
        self._times: list[float] = []
        self._mems: list[float] = []
        self._action: int | None = None
        self._prev_plan = 0
        self.apply_plan()

    # ---- plans ---------------------------------------------------------------------------
    def plan_dict(self, plan: int | None = None) -> dict:
        plan = self.plan if plan is None else plan
        return {t.__name__: bool(plan >> i & 1) for i, t in enumerate(self.types)}

    def apply_plan(self) -> None:
        """Set the hooks to the current plan (after `plan` was changed by hand)."""
        for i, t in enumerate(self.types):
            self.hooks.swap[t] = bool(self.plan >> i & 1) and t not in self.hooks.unswappable

    def allowed(self, plan: int, action: int) -> bool:
        """An action may not turn on swapping for a type marked unswappable."""
        if action == len(self.types):
            return True
        t = self.types[action]
        return not (t in self.hooks.unswappable and not plan >> action & 1)

    def next_plan(self, plan: int, action: int) -> int:
        return plan if action == len(self.types) else plan ^ (1 << action)

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

    def reward(self, t: float, m: float) -> float:
        """r_time + w (r_mem - r_time), shifted by +1 so the no-swap plan scores 0 and a
        better plan scores above it (unvisited actions, at Q = 0, then are not preferred
        over a known improvement)."""
        t0, m0 = self.baseline
        r_time, r_mem = -t / t0, -m / max(m0, 1.0)
        return 1.0 + r_time + self.w * (r_mem - r_time)

    # ---- measuring -----------------------------------------------------------------------
    def _memory(self) -> float:
        if self.device is not None and torch.device(self.device).type == "cuda":
            return float(torch.cuda.max_memory_allocated(self.device))
        return float(self.hooks.resident_bytes)

    @contextlib.contextmanager
    def step(self):
        """Wrap one training step (forward + backward): applies the plan, measures."""
        self.hooks.reset_counts()
        cuda = self.device is not None and torch.device(self.device).type == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
            torch.cuda.synchronize(self.device)
        t0 = time.perf_counter()
        yield self
        if cuda:
            torch.cuda.synchronize(self.device)
        self._times.append(time.perf_counter() - t0)
        self._mems.append(self._memory())
        if len(self._times) >= self.steps_per_round:
            self.observe(float(np.median(self._times)), float(np.max(self._mems)))
            self._times.clear()
            self._mems.clear()

    def observe(self, t: float, m: float) -> None:
        """End of a round with the current plan's step time t and memory m: learn, move."""
        self.rounds += 1
        if self.baseline is None:  # the first round runs the no-swap plan: the reference
            self.baseline = (t, m)
        r = self.reward(t, m)
        if self.best is None or r > self.best[0]:
            self.best = (r, self.plan)
        if self.converged:
            return
        if self._action is None:
            self._action = self.choose(self.plan)
        else:  # r is the reward of the previous action, which led to this plan
            a2 = self.choose(self.plan)
            self.update(self._prev_plan, self._action, r, self.plan, a2)
            self._action = a2
        self.epsilon = max(self.epsilon_min, self.epsilon * self.epsilon_decay)
        greedy_keep = int(np.argmax(self.q[self.plan])) == len(self.types) and self.q[self.plan].any()
        self._kept = self._kept + 1 if greedy_keep else 0
        if self._kept >= self.patience:
            self.use_best()
            return
        self._prev_plan = self.plan
        self.plan = self.next_plan(self.plan, self._action)
        self.apply_plan()

    def use_best(self) -> None:
        """Stop learning and use the best plan measured so far."""
        self.converged = True
        if self.best is not None:
            self.plan = self.best[1]
        self.apply_plan()

    def pretrain(self, step_fn, batches, rounds: int = 30) -> int:
        """Learn on a subset before real training: step_fn(batch) does forward + backward
        (and may skip the optimizer); returns the plan reached."""
        k = 0
        while self.rounds < rounds and not self.converged:
            with self.step():
                step_fn(batches[k % len(batches)])
            k += 1
        return self.plan

    # ---- persistence ---------------------------------------------------------------------
    def save(self, path: str) -> None:
        np.savez(path, q=self.q, types=np.array([t.__name__ for t in self.types]),
                 plan=self.plan, best_plan=-1 if self.best is None else self.best[1])

    def load(self, path: str) -> None:
        with np.load(path) as z:
            names = [str(n) for n in z["types"]]
            if names != [t.__name__ for t in self.types]:
                raise ValueError(f"Q table is for layer types {names}, this model has "
                                 f"{[t.__name__ for t in self.types]}")
            self.q = z["q"].copy()
            self.plan = int(z["plan"])
        self.apply_plan()


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
