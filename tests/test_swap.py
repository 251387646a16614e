"""The activation-swap scheduler: identical gradients, the Q update, epsilon-greedy choice,
convergence on a toy reward, unswappable units never swapped, segments of equal bytes,
a memory budget never exceeded by the chosen plan, running out of memory handled as a
penalty, host buffers reused; scripts/bench/bench_swap.py end to end."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from torch import nn

from trainer import SwapHooks, SwapScheduler
from trainer.accel.swap import PinnedPool, SwapOutOfMemory


def cnn():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(16 * 8 * 8, 10))


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 64), nn.GELU(), nn.LayerNorm(64),
                         nn.Linear(64, 5))


def grads(model, x, y, swap_all: bool):
    hooks = None
    if swap_all:
        hooks = SwapHooks(model, {type(m) for m in model.modules()} - {nn.Sequential})
        for t in hooks.swap:
            hooks.swap[t] = True
        nn.functional.cross_entropy(model(x), y).backward()  # a first step sizes the pool
        hooks.pool.reserve(PinnedPool.room(hooks.saved_sizes))
        hooks.reset_counts()
    model.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    out = [p.grad.clone() for p in model.parameters()]
    if hooks:
        assert hooks.swapped_bytes > 0
        hooks.remove()
    return out


@pytest.mark.parametrize("make,shape,classes", [(cnn, (16, 1, 16, 16), 10), (mlp, (32, 20), 5)])
def test_gradients_identical_with_and_without_swapping(make, shape, classes):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, classes, (shape[0],), generator=torch.Generator().manual_seed(2))
    plain = grads(make(), x, y, False)
    swapped = grads(make(), x, y, True)
    assert all(torch.equal(a, b) for a, b in zip(plain, swapped))


def test_disabled_hooks_let_an_outer_save_on_cpu_see_every_saved_tensor():
    """Nested saved_tensors_hooks: the innermost wins. Enabled, the per-layer hooks take the
    layers' saved tensors from an outer context; disabled, they step aside."""
    model = cnn()
    hooks = SwapHooks(model, {nn.Conv2d, nn.BatchNorm2d, nn.ReLU, nn.Linear})
    x = torch.randn(4, 1, 16, 16)

    def outer_packs():
        seen = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: seen.append(t.shape) or t, lambda t: t):
            model(x).sum().backward()
        return len(seen)

    hooks.reset_counts()
    inside = outer_packs()
    assert hooks.resident_bytes > 0
    hooks.enabled = False
    hooks.reset_counts()
    aside = outer_packs()
    assert hooks.resident_bytes == 0 and aside > inside
    hooks.remove()


class SparseSave(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x.detach().to_sparse())  # backward needs a sparse tensor back
        return x * 2

    @staticmethod
    def backward(ctx, g):
        (sp,) = ctx.saved_tensors
        assert sp.layout == torch.sparse_coo
        return g * 2


class SparseLayer(nn.Module):
    def forward(self, x):
        return SparseSave.apply(x)


def test_never_swaps_a_type_backward_cannot_bring_back(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), SparseLayer(), nn.ReLU(), nn.Linear(16, 2))
    s = SwapScheduler(model, types=(nn.Linear, SparseLayer, nn.ReLU), units="types", seed=0, epsilon=1.0,
                      epsilon_decay=1.0, steps_per_round=1)
    x, y = torch.randn(32, 8), torch.randint(0, 2, (32,))
    for _ in range(40):
        with s.step():
            nn.functional.cross_entropy(model(x), y).backward()
        assert not s.hooks.swap[SparseLayer]
    assert SparseLayer in s.hooks.unswappable
    k = s.types.index(SparseLayer)
    assert not s.allowed(0, k)
    s.save(str(tmp_path / "q.npz"))
    again = SwapScheduler(model, types=(nn.Linear, SparseLayer, nn.ReLU), units="types")
    again.load(str(tmp_path / "q.npz"))
    assert np.array_equal(again.q, s.q)


def deep_cnn():
    torch.manual_seed(0)
    layers = [nn.Conv2d(1, 8, 3, padding=1), nn.ReLU()]
    for _ in range(5):
        layers += [nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU()]
    return nn.Sequential(*layers, nn.Flatten(), nn.Linear(8 * 16 * 16, 10))


def test_segment_plans_swap_their_part_and_keep_gradients_identical():
    x = torch.randn(8, 1, 16, 16, generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, 10, (8,), generator=torch.Generator().manual_seed(2))
    plain = grads(deep_cnn(), x, y, False)
    model = deep_cnn()
    s = SwapScheduler(model, segments=4, steps_per_round=1)

    def step():
        model.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
    s.run(step)  # the first step (a warm-up, not measured) cuts the segments, nothing swapped
    assert s.hooks.swapped_bytes == 0 and list(s.measured) == [] and len(s.plan_dict()) == 4
    total = s.hooks.resident_bytes
    by_unit = {}
    for m, n in s.hooks.saved_by.items():
        by_unit[s.hooks.unit_of[m]] = by_unit.get(s.hooks.unit_of[m], 0) + n
    assert set(by_unit) == {0, 1, 2, 3} and max(by_unit.values()) < 0.5 * sum(by_unit.values())
    s.converged = True  # plans by hand from here
    for plan in (0b0001, 0b1000, 0b1111):
        s.plan = plan
        s.apply_plan()
        s.run(step)
        assert [p.grad for p in model.parameters()] and all(
            torch.equal(p.grad, g) for p, g in zip(model.parameters(), plain))
        assert 0 < s.hooks.swapped_bytes <= total
    assert s.hooks.resident_bytes + s.hooks.swapped_bytes == total


def _scheduled(segments: int, **kw):
    """(scheduler, model, step, plans run): a scheduler over deep_cnn, and a training step
    of a fixed batch that records the plan each run had."""
    model = deep_cnn()
    s = SwapScheduler(model, segments=segments, steps_per_round=1, seed=0, **kw)
    x, y = torch.randn(4, 1, 16, 16), torch.randint(0, 10, (4,))
    ran = []

    def step():
        ran.append(s.plan)
        model.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
    return s, model, step, ran


def test_a_plan_that_runs_out_of_memory_is_penalised_and_the_step_repeated():
    s, model, step, ran = _scheduled(4)
    s.run(step)  # the warm-up: measures the segments

    def no_host_memory(t):
        raise SwapOutOfMemory("pinned memory exhausted (test)")
    s.hooks.pool.take = no_host_memory
    s._prev_plan, s._action, s.plan = 0, 0, 0b0001  # as if the learner had just flipped segment 0
    s.apply_plan()
    s.run(step)  # must not raise
    assert ran[-2:] == [0b0001, 0] and 0b0001 in s.failed
    assert s.q[0, 0] < -1 and not s.allowed(0, 0)  # penalised, never tried again
    assert all(p.grad is not None for p in model.parameters())


def test_the_first_step_is_a_warm_up_that_the_no_swap_reference_leaves_out(monkeypatch):
    """The budget is a share of the no-swap reference, so the reference must be a steady
    step's peak, not the first step's (on a GPU it can hold one-time allocations: on the
    GPU node a plan learned for 60% measured 69.5% of the steady no-swap peak)."""
    s, model, step, ran = _scheduled(4, budget=0.6)
    monkeypatch.setattr(s, "_memory", lambda: 10.0 if len(ran) == 1 else 4.0)  # the step's peak
    s.run(step)
    assert s.baseline is None and s.rounds == 0
    s.run(step)
    assert s.baseline[1] == 4.0 and s.budget_bytes() == pytest.approx(0.6 * 4.0)


def test_the_pool_is_one_buffer_sized_once_and_handed_out_again_each_step():
    pool = PinnedPool(pin=False, limit=4096)
    a, b = torch.randn(3, 5), torch.zeros(7, dtype=torch.float64)
    with pytest.raises(SwapOutOfMemory, match="not sized yet"):
        pool.take(a)
    pool.reserve(PinnedPool.room([60, 56]))
    assert pool.bytes == 2 * PinnedPool.ALIGN
    h1, h2 = pool.take(a), pool.take(b)
    assert (h1.shape, h1.dtype, h2.shape, h2.dtype) == (a.shape, a.dtype, b.shape, b.dtype)
    assert h2.data_ptr() - h1.data_ptr() == PinnedPool.ALIGN  # (aligned, not overlapping)
    with pytest.raises(SwapOutOfMemory, match="cannot hold"):
        pool.take(a)
    pool.release_all()
    assert pool.take(a).data_ptr() == h1.data_ptr() and pool.bytes == 2 * PinnedPool.ALIGN
    with pytest.raises(RuntimeError, match="sized once"):
        pool.reserve(10)
    capped = PinnedPool(pin=False, limit=100)
    capped.reserve(10_000)
    assert capped.bytes == 100


def test_no_step_allocates_host_memory_for_the_swap_after_the_first(monkeypatch):
    """Every torch entry point that allocates (or may) is counted when the swap path
    (trainer/accel/swap.py) calls it: the first step sizes the pool (one allocation), and
    steps of every plan after it allocate nothing; the pool's size never changes."""
    import sys
    calls = []
    points = [(torch, n) for n in ("empty", "empty_like", "zeros", "zeros_like", "ones", "full", "tensor",
                                   "as_tensor", "from_numpy", "empty_strided")]
    points += [(torch.Tensor, n) for n in ("to", "cpu", "clone", "pin_memory", "new_empty", "new_zeros",
                                           "contiguous", "detach", "numpy")]
    for owner, name in points:
        real = getattr(owner, name)

        def counted(*args, _real=real, _name=name, **kw):
            if sys._getframe(1).f_globals.get("__name__") == "trainer.accel.swap":
                calls.append(_name)
            return _real(*args, **kw)
        monkeypatch.setattr(owner, name, counted)
    model = deep_cnn()
    s = SwapScheduler(model, segments=3, steps_per_round=1)
    calls.clear()  # (from here on: the steps)
    x, y = torch.randn(4, 1, 16, 16), torch.randint(0, 10, (4,))

    def step():
        model.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
    s.run(step)  # the first step: measures, sizes the pool
    assert calls == ["empty"] and s.hooks.pool.bytes > 0
    size = s.hooks.pool.bytes
    s.converged = True
    swapped = []
    for plan in (0b111, 0b101, 0b010, 0b111, 0):
        s.plan = plan
        s.apply_plan()
        s.run(step)
        swapped.append(s.hooks.swapped_bytes)
    assert calls == ["empty"], calls  # nothing after the first step
    assert s.hooks.pool.bytes == size and max(swapped) > 0 and swapped[-1] == 0
    assert swapped[0] <= size and not s.failed


def test_a_plan_past_the_host_limit_is_refused_like_one_past_device_memory():
    s, model, step, ran = _scheduled(2, host_limit=1024)
    s.run(step)
    assert s.hooks.pool.bytes == 1024
    s._prev_plan, s._action, s.plan = 0, 1, 0b10
    s.apply_plan()
    s.run(step)  # must not raise: the plan is penalised, the step runs again without it
    assert ran[-2:] == [0b10, 0] and 0b10 in s.failed and all(p.grad is not None for p in model.parameters())


BENCH_SWAP = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                          "scripts", "bench", "bench_swap.py")


def _bench_swap(out, *extra):
    return subprocess.run([sys.executable, BENCH_SWAP, "--models", "cnn", "--batch", "8", "--rounds", "4",
                           "--rounds-timed", "1", "--steps", "1", "--out", str(out), *extra],
                          capture_output=True, text=True, timeout=300)


def test_bench_swap_writes_each_row_as_a_json_line(tmp_path):
    """scripts/bench/bench_swap.py end to end at a tiny scale (the GPU node runs it with
    ResNet-50): the learned plan and every row go out as JSON lines as they are measured."""
    r = _bench_swap(tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [json.loads(x) for x in open(tmp_path / "bench_swap.jsonl")]
    assert [x.get("row") for x in lines] == [None, "no_swap", "save_on_cpu", "checkpoint", "swap_all", "learned"]
    assert "plan" in lines[0] and set(lines[0]["step_s"]) == {x["row"] for x in lines[1:]}
    assert all(x["step_s"] > 0 and x["commit"] and x["date"] for x in lines[1:])
    assert lines[1]["memory"] > lines[3]["memory"]  # checkpointing keeps less than no swap


def test_bench_swap_stops_with_a_report_past_its_host_memory_limit(tmp_path):
    """On the GPU node the benchmark's memory grew until the kernel killed it, silently;
    past --host-limit it stops itself and says where it was."""
    r = _bench_swap(tmp_path, "--host-limit", "0.0001")
    assert r.returncode == 3
    assert "passed the limit" in r.stderr and "during cnn, budget 60%: learning" in r.stderr
