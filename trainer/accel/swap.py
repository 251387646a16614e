"""Learn which saved activations to swap from accelerator memory to CPU memory (Q-learning),
within a memory budget.

Swapping (SwapHooks): while a module of a chosen layer type runs its forward, the tensors
autograd saves for backward go through torch.autograd.graph.saved_tensors_hooks. For a
unit the plan swaps, each such tensor is copied to a host buffer as soon as it is saved
(on CUDA: pinned, on a side stream that waits for the compute stream, so the copy
overlaps the forward that follows) and the device copy is released once the copy is done;
backward brings it back. The host buffers are stretches of one pool (PinnedPool), sized
once after the first step (which swaps nothing) from the most any plan could swap, capped by
`host_limit`, and reused from step to step: no step allocates host memory after that one. On CUDA the copy back runs ahead on the side stream:
when backward unpacks a swapped tensor, the one packed just before it (the next that
backward will need) starts coming back. Parameters are never swapped, nor are tensors
that cannot make the round trip (not dense/strided): their unit is marked unswappable.
Gradients are identical with and without swapping (the bytes are the same).

Units. Whole layer types are too coarse on a GPU: every Conv2d input of ResNet-50 is
gigabytes, more than a step's compute can hide on the host link. The default unit is a
segment of the forward: the modules of the chosen types in forward order, cut into K
(default 6) contiguous parts of about equal saved bytes, measured in the first step. A
segment's tensors are saved at one time and needed back at another, so which segments to
swap is a choice between how much each saves and how much compute lies between its
forward and its backward to hide the transfers. 2^K plans: small enough to learn in tens
of rounds. `units="types"` keeps one unit per layer type.

The scheduler (SwapScheduler). A plan is one bit per unit (1: swap); an action flips one
unit's bit (or keeps the plan). The first step is a warm-up, not measured (it sizes the
swap pool and cuts the segments). Each round (`steps_per_round` steps) measures the median
step time t and the peak memory m of the current plan (CUDA: max_memory_allocated; else
the hooks' count of the saved bytes that stay resident). With a budget B (bytes, or a
share of the no-swap plan's memory m0), the reward is 1 - t / t0 for a plan within B and
1 + (m - B) / m0 less for one over it: every plan within the budget beats every plan over
it. Without a budget, the w trade-off: r = 1 + r_time + w (r_mem - r_time), r_time =
-t / t0, r_mem = -m / m0. The Q table over (plan, action) is updated on-policy,
    Q(s, a) <- Q(s, a) + alpha * (r + gamma * Q(s', a') - Q(s, a)),
with a' chosen epsilon-greedily (alpha 0.5, gamma 0.9, epsilon decaying per round). The
plan has converged when the greedy action has been "keep" for `patience` rounds; then the
fastest plan measured within the budget is used (never one over it; if none was within,
the one with the least memory). A plan that runs out of memory (device, or pinned host
memory) is penalised and never tried again, and `run()` repeats the step with the best
plan so far. The Q table saves to and loads from disk.

    sched = SwapScheduler(model, budget=0.6, device="cuda")
    for x, y in loader:
        sched.run(lambda: criterion(model(x), y).backward())   # plan applied, measured
        opt.step(); opt.zero_grad()
    sched.save("swap_q.npz")
"""
from __future__ import annotations

import contextlib
import logging
import time

import numpy as np
import torch
from torch import nn

from .qplan import PlanLearner, largest_batch, segments  # noqa: F401 (largest_batch: part of the API)

log = logging.getLogger("trainer.accel.swap")

DEFAULT_TYPES = (nn.Conv2d, nn.BatchNorm2d, nn.ReLU, nn.Linear, nn.MaxPool2d,
                 nn.MultiheadAttention, nn.LayerNorm, nn.GELU)


class SwapOutOfMemory(RuntimeError):
    """A host buffer for a swapped tensor could not be allocated (pinned memory exhausted)."""


def is_oom(e: BaseException) -> bool:
    """Whether e means "out of memory", on the device or for a pinned host buffer (CUDA
    reports the latter as a plain AcceleratorError / RuntimeError)."""
    return (isinstance(e, SwapOutOfMemory) or type(e).__name__ == "OutOfMemoryError"
            or isinstance(e, RuntimeError) and "out of memory" in str(e))


class PinnedPool:
    """Host memory for swapped tensors: one buffer (pinned when `pin`), allocated once and
    handed out by a pointer that goes back to its start at each step. `reserve(nbytes)`
    sizes it, once (the scheduler does after the first step, from the most that step could
    swap: every byte saved inside the hooked modules), capped by `limit` bytes (the user's
    bound; None: none). `take(x)` hands out the next stretch, shaped like x, aligned to
    ALIGN bytes; `release_all()` gives every stretch back at the start of a step, when the
    previous step's transfers are done. Nothing is allocated after `reserve`: a step that
    would need more than the pool, or a take before the pool is sized, raises
    SwapOutOfMemory (the scheduler penalises the plan, as for device memory), so swapping
    stays within host memory by construction (torch's pinned allocator, asked per tensor,
    caches what it frees and grew the host's memory step after step)."""

    ALIGN = 512

    def __init__(self, pin: bool, limit: int | None = None):
        self.pin = pin
        self.limit = limit
        self._arena: torch.Tensor | None = None
        self._at = 0
        self.bytes = 0  # the pool's size (0 until reserved)
        self.used = 0   # handed out this step

    @property
    def sized(self) -> bool:
        return self._arena is not None

    @staticmethod
    def room(sizes) -> int:
        """The pool that holds tensors of these byte sizes in one step."""
        align = PinnedPool.ALIGN
        return sum((n + align - 1) // align * align for n in sizes)

    def reserve(self, nbytes: int) -> None:
        if self._arena is not None:
            raise RuntimeError("the swap pool is sized once")
        n = max(0, int(nbytes) if self.limit is None else min(int(nbytes), int(self.limit)))
        try:
            self._arena = torch.empty(n, dtype=torch.uint8, pin_memory=self.pin)
        except RuntimeError as e:
            raise SwapOutOfMemory(f"no host memory for a swap pool of {n} bytes: {e}") from e
        self.bytes = n

    def take(self, x: torch.Tensor) -> torch.Tensor:
        n = x.numel() * x.element_size()
        if self._arena is None:
            raise SwapOutOfMemory("the swap pool is not sized yet (the first step sizes it)")
        start = (self._at + self.ALIGN - 1) // self.ALIGN * self.ALIGN
        if start + n > self.bytes:
            raise SwapOutOfMemory(f"the swap pool ({self.bytes} bytes) cannot hold this step's "
                                  f"swapped tensors ({start + n} bytes and more)")
        self._at = start + n
        self.used = self._at
        return self._arena[start:start + n].view(x.dtype).view(x.shape)

    def release_all(self) -> None:
        self._at = self.used = 0


class SwapHooks:
    """Applies a plan ({unit: swap?}) to a model's forward passes and counts bytes.

    A unit is a layer type (the default) or any key `set_units` maps modules to (the
    scheduler's segments of the forward). Per step it records the bytes each module saves
    and the order in which modules first save (the forward's order)."""

    def __init__(self, model: nn.Module, types, host_limit: int | None = None):
        self.types = list(types)
        self.unit_of = {m: type(m) for m in model.modules() if type(m) in self.types}
        self.swap = {t: False for t in self.types}
        self.unswappable: set = set()
        self.params = {p.data_ptr() for p in model.parameters()}
        self.resident_bytes = self.swapped_bytes = 0
        self.saved_by: dict = {}  # module -> bytes saved this step, in first-save order
        self.saved_sizes: list = []  # the byte size of each tensor saved in a hooked module
        self.pool = PinnedPool(pin=next(model.parameters(), torch.empty(0)).is_cuda, limit=host_limit)
        # False: the hooks step aside entirely (no saved_tensors_hooks of their own), so an
        # outer context such as torch.autograd.graph.save_on_cpu sees every saved tensor.
        self.enabled = True
        self.skip: set = set()  # modules whose hooks step aside (e.g. inside a checkpoint)
        self._stack: list = []
        self._pending: list = []  # swapped items in pack order (CUDA read-ahead)
        self._side = None
        self._handles = []
        for m in self.unit_of:
            self._handles.append(m.register_forward_pre_hook(self._enter(m)))
            self._handles.append(m.register_forward_hook(self._exit))
        # around the whole forward: counts what is saved outside the hooked modules (the
        # loss, a custom Function's saves), so resident_bytes is every saved byte
        self._handles.append(model.register_forward_pre_hook(self._enter(None)))
        self._handles.append(model.register_forward_hook(self._exit))

    def set_units(self, unit_of: dict) -> None:
        """Map modules to units (those left out are never swapped); swap nothing."""
        self.unit_of = {m: unit_of.get(m) for m in self.unit_of}
        self.swap = {u: False for u in set(unit_of.values())}
        self.unswappable = set()

    def _enter(self, m):
        def hook(module, args):
            if not self.enabled or module in self.skip:
                self._stack.append(None)
                return
            ctx = torch.autograd.graph.saved_tensors_hooks(
                lambda x: self._pack(m, x), self._unpack)
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
        """Start of a step: counts to zero, host buffers back to the pool (the caller has
        synchronised: the last step's transfers are done)."""
        self.resident_bytes = self.swapped_bytes = 0
        self.saved_by = {}
        self.saved_sizes = []
        self._pending.clear()
        self.pool.release_all()

    # ---- pack / unpack -------------------------------------------------------------------
    def _pack(self, m, x):
        if x.layout == torch.strided and x.data_ptr() in self.params:  # resident anyway
            return ("keep", x)
        nbytes = x.numel() * x.element_size()
        if m is None:  # saved outside the hooked modules: counted, kept
            self.resident_bytes += nbytes
            return ("keep", x)
        self.saved_by[m] = self.saved_by.get(m, 0) + nbytes
        self.saved_sizes.append(nbytes)
        unit = self.unit_of.get(m)
        if x.layout != torch.strided:
            self.unswappable.add(unit)  # cannot make the round trip: this unit stays resident
            self.resident_bytes += nbytes
            return ("keep", x)
        if not self.swap.get(unit) or unit in self.unswappable or not self.pool.sized:
            # (nothing is swapped before the first step has sized the pool)
            self.resident_bytes += nbytes
            return ("keep", x)
        host = self.pool.take(x)
        self.swapped_bytes += nbytes
        item = {"host": host, "device": x.device, "back": None, "event": None}
        if x.device.type == "cuda":  # device to host on the side stream, as soon as saved
            side = self._side_stream(x.device)
            side.wait_stream(torch.cuda.current_stream(x.device))
            with torch.cuda.stream(side):
                host.copy_(x, non_blocking=True)
            x.record_stream(side)  # its memory is not reused before the copy is done
            self._pending.append(item)  # for the read-ahead in backward; dropped when unpacked
        else:  # CPU-only: the copy stands in for the transfer (same bytes, same cost shape)
            host.copy_(x)
        return ("swap", item)

    def _side_stream(self, device):
        if self._side is None:
            self._side = torch.cuda.Stream(device=device)
        return self._side

    def _bring_back(self, item) -> None:
        """Host to device on the side stream (after the item's own device-to-host copy)."""
        with torch.cuda.stream(self._side):
            item["back"] = item["host"].to(item["device"], non_blocking=True)
            item["event"] = torch.cuda.Event()
            item["event"].record(self._side)

    def _unpack(self, packed):
        kind, item = packed
        if kind == "keep":
            return item
        if item["device"].type != "cuda":
            return item["host"]
        if item["back"] is None:
            self._bring_back(item)
        current = torch.cuda.current_stream(item["device"])
        current.wait_event(item["event"])
        item["back"].record_stream(current)
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
        if prev["back"] is None:
            self._bring_back(prev)


class SwapScheduler(PlanLearner):
    """Learns a swap plan for model (see the module docstring).

    units: "segments" (default): the modules of the chosen types, in forward order, split
    into `segments` contiguous parts of about equal saved bytes (measured in the first
    step); "types": one unit per layer type. budget: the most memory a chosen plan may use,
    in bytes, or as a share of the no-swap plan's (a float <= 1); None: the w trade-off.
    host_limit: the most host memory (bytes) the swap pool may take (None: as much as the
    first step saves in the hooked modules); a plan that needs more is treated as one that
    ran out of memory. Make the first step one of the largest batches: it sizes the pool.
    """

    def __init__(self, model: nn.Module, types=DEFAULT_TYPES, *, budget: float | None = None,
                 units: str = "segments", segments: int = 6, w: float = 0.5,
                 alpha: float = 0.5, gamma: float = 0.9, epsilon: float = 0.5,
                 epsilon_decay: float = 0.9, epsilon_min: float = 0.02, steps_per_round: int = 2,
                 patience: int = 5, seed: int = 0, device=None, host_limit: int | None = None):
        if units not in ("segments", "types"):
            raise ValueError(f"units must be 'segments' or 'types', got {units!r}")
        present = {type(m) for m in model.modules()}
        self.types = [t for t in types if t in present]
        self.hooks = SwapHooks(model, self.types, host_limit)
        self.unit_kind = units
        if units == "segments":
            self.hooks.set_units({})  # nothing swappable until the first step has measured
            self._profiled = False
        else:
            self._profiled = True
        super().__init__(list(range(max(1, segments))) if units == "segments" else list(self.types),
                         budget=budget, w=w, alpha=alpha, gamma=gamma, epsilon=epsilon,
                         epsilon_decay=epsilon_decay, epsilon_min=epsilon_min, patience=patience,
                         seed=seed)
        self.steps_per_round = steps_per_round
        self.device = device
        self._times: list[float] = []
        self._mems: list[float] = []
        self.apply_plan()

    def apply_plan(self) -> None:
        """Set the hooks to the current plan (after `plan` was changed by hand)."""
        for i, u in enumerate(self.units):
            self.hooks.swap[u] = bool(self.plan >> i & 1) and u not in self.hooks.unswappable

    def blocked(self, u) -> bool:
        return u in self.hooks.unswappable

    # ---- measuring -----------------------------------------------------------------------
    def _cuda(self) -> bool:
        return self.device is not None and torch.device(self.device).type == "cuda"

    def _memory(self) -> float:
        if self._cuda():
            return float(torch.cuda.max_memory_allocated(self.device))
        return float(self.hooks.resident_bytes)

    @contextlib.contextmanager
    def step(self):
        """Wrap one training step (forward + backward): applies the plan, measures."""
        cuda = self._cuda()
        if cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        self.hooks.reset_counts()
        t0 = time.perf_counter()
        yield self
        if cuda:
            torch.cuda.synchronize(self.device)
        if self._profiled:  # (the first step is a warm-up: on a GPU its peak holds the
            # libraries' one-time workspaces, which made the no-swap reference too high)
            self._times.append(time.perf_counter() - t0)
            self._mems.append(self._memory())
        if not self.hooks.pool.sized:  # the first step: the most any plan can swap
            self.hooks.pool.reserve(PinnedPool.room(self.hooks.saved_sizes))
        if not self._profiled:  # the first step, with nothing swapped: cut the segments
            self.hooks.set_units(segments(self.hooks.saved_by, len(self.units)))
            self._profiled = True
            self.apply_plan()
        if len(self._times) >= self.steps_per_round:
            self.observe(float(np.median(self._times)), float(np.max(self._mems)))
            self._times.clear()
            self._mems.clear()

    def run(self, fn, *args):
        """One training step fn(*args) (forward + backward) under the plan, measured. If it
        runs out of memory (device, or pinned host buffers for the swap), the plan is
        penalised, never tried again, and the step runs again with the best plan so far (or
        none): a plan that does not fit costs one step, never the training."""
        try:
            with self.step():
                return fn(*args)
        except Exception as e:
            if not is_oom(e):
                raise
            self.out_of_memory(e)
        with self.step():
            return fn(*args)

    def out_of_memory(self, error=None) -> None:
        """The current plan ran out of memory: penalise it, fall back."""
        self._times.clear()
        self._mems.clear()
        self.hooks.reset_counts()  # (the pool stays: it is sized once)
        if self._cuda():
            torch.cuda.empty_cache()
        self.penalise()
        log.warning("swap plan ran out of memory (%s): back to %s", error, self.plan_dict())

    def pretrain(self, step_fn, batches, rounds: int = 30) -> int:
        """Learn on a subset before real training: step_fn(batch) does forward + backward
        (and may skip the optimizer); returns the plan reached."""
        k = 0
        while self.rounds < rounds and not self.converged:
            self.run(step_fn, batches[k % len(batches)])
            k += 1
        return self.plan

