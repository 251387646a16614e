"""Activation swapping on a small CNN (issue 7): no swapping, swap-everything
(torch.autograd.graph.save_on_cpu, the zero-effort baseline) and the plan learned by
trainer.SwapScheduler. Prints resident saved-activation bytes and step time for each (and
on a GPU the largest batch that fits); saves JSON.

On this CPU-only machine "swapping" copies a saved tensor to another CPU buffer (the cost
of the transfer, without a transfer) and memory is the hooks' account of the saved bytes
that stay resident. save_on_cpu itself is a no-op on CPU tensors (tensor.cpu() returns
them), so on CPU its row is a stand-in that does what save_on_cpu(pin_memory=True) does to
a CUDA tensor: copy every saved tensor, parameters included, to another buffer. "swap all
types" is SwapHooks with every layer type swapped (parameters stay). On CUDA the row is
save_on_cpu itself and memory is torch.cuda.max_memory_allocated.

Step times are measured side by side: `--rounds-timed` rounds, each running `--steps`
steps of every plan in turn, and the median per plan, so drift on a noisy machine hits all
plans alike.

usage: .venv/bin/python scripts/bench_swap.py [--batch 128] [--steps 4] [--rounds-timed 10]
           [--w 0.5] [--out out/bench_swap]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time

import torch
from torch import nn

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from trainer import SwapScheduler  # noqa: E402
from trainer.swap import largest_batch  # noqa: E402


def cnn():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
        nn.Conv2d(32, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(64 * 8 * 8, 128), nn.ReLU(), nn.Linear(128, 10))


def step(model, x, y):
    model.zero_grad(set_to_none=True)
    nn.functional.cross_entropy(model(x), y).backward()


def save_everything(dev):
    """The zero-effort baseline: every saved tensor moved off the device (see docstring)."""
    if dev.type == "cuda":
        return torch.autograd.graph.save_on_cpu(pin_memory=True)
    return torch.autograd.graph.saved_tensors_hooks(lambda t: t.detach().clone(), lambda t: t)


def side_by_side(rows, run, rounds, steps):
    """Median step time per row, the rows interleaved round by round."""
    times = {name: [] for name in rows}
    for name, enter in rows.items():  # warm-up: allocator, caches
        with enter():
            run()
    for _ in range(rounds):
        for name, enter in rows.items():
            with enter():
                for _ in range(steps):
                    t0 = time.perf_counter()
                    run()
                    times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def largest_batch_cuda(enter, dev, model, start):
    """CUDA only: the largest batch (to within 1/16) whose training step fits in memory."""
    def fits(b):
        try:
            x = torch.randn(b, 3, 32, 32, device=dev)
            y = torch.randint(0, 10, (b,), device=dev)
            with enter():
                step(model, x, y)
            torch.cuda.synchronize(dev)
            return True
        except torch.cuda.OutOfMemoryError:
            return False
        finally:
            model.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
    return largest_batch(fits, start)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--steps", type=int, default=4, help="steps per plan and timing round")
    p.add_argument("--rounds-timed", type=int, default=10, help="interleaved timing rounds")
    p.add_argument("--w", type=float, default=0.5)
    p.add_argument("--rounds", type=int, default=150, help="pre-training rounds of the scheduler")
    p.add_argument("--out", default=os.path.join(REPO, "out", "bench_swap"))
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = cnn().to(dev)
    x = torch.randn(a.batch, 3, 32, 32, device=dev)
    y = torch.randint(0, 10, (a.batch,), device=dev)

    sched = SwapScheduler(model, w=a.w, steps_per_round=2, device=dev, seed=0)
    t0 = time.perf_counter()
    sched.pretrain(lambda b: step(model, *b), [(x, y)], rounds=a.rounds)
    learn_s = time.perf_counter() - t0
    converged = sched.converged  # by itself, within the rounds
    sched.use_best()
    learned_plan = sched.plan
    every_type = 2 ** len(sched.types) - 1

    @contextlib.contextmanager
    def plan(p):
        sched.plan = p
        sched.apply_plan()
        yield

    @contextlib.contextmanager
    def everything():
        # The scheduler's hooks step aside: nested inside them, save_on_cpu would not see
        # the tensors saved by the layers (the innermost saved_tensors_hooks wins).
        sched.hooks.enabled = False
        try:
            with save_everything(dev):
                yield
        finally:
            sched.hooks.enabled = True

    rows = {"no_swap": lambda: plan(0), "save_on_cpu": everything,
            "swap_all_types": lambda: plan(every_type), "learned": lambda: plan(learned_plan)}
    step_s = side_by_side(rows, lambda: step(model, x, y), a.rounds_timed, a.steps)

    res = {"device": str(dev), "batch": a.batch, "w": a.w, "rounds": sched.rounds,
           "learn_s": learn_s, "plan": sched.plan_dict(learned_plan),
           "converged_by_itself": converged, "timing": {"rounds": a.rounds_timed, "steps": a.steps}}
    for name, enter in rows.items():
        sched.hooks.reset_counts()
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        with enter():
            step(model, x, y)
        if dev.type == "cuda":
            resident = torch.cuda.max_memory_allocated(dev)
        elif name == "save_on_cpu":
            resident = 0  # every saved tensor was copied out
        else:
            resident = sched.hooks.resident_bytes
        res[name] = {"resident_bytes": resident, "step_s": step_s[name],
                     "time_ratio": step_s[name] / step_s["no_swap"]}
        if dev.type == "cuda":
            res[name]["largest_batch"] = largest_batch_cuda(enter, dev, model, a.batch)
    for name in rows:
        res[name]["resident_share"] = res[name]["resident_bytes"] / res["no_swap"]["resident_bytes"]

    what = "peak CUDA memory" if dev.type == "cuda" else "resident saved activations"
    print(f"device {dev}, batch {a.batch}, w {a.w}: plan {sched.plan_dict(learned_plan)} after "
          f"{sched.rounds} rounds ({learn_s:.1f} s)")
    for name in rows:
        r = res[name]
        line = (f"  {name:<15} {what} {r['resident_bytes'] / 1e6:8.2f} MB ({100 * r['resident_share']:5.1f}%)"
                f"   step {1e3 * r['step_s']:7.2f} ms ({r['time_ratio']:.2f}x)")
        if "largest_batch" in r:
            line += f"   largest batch {r['largest_batch']}"
        print(line)
    faster = res["learned"]["step_s"] < res["save_on_cpu"]["step_s"]
    print(f"  learned: {100 * res['learned']['resident_share']:.1f}% of the no-swap bytes at "
          f"{res['learned']['time_ratio']:.2f}x its step time; "
          f"{'faster' if faster else 'not faster'} than save_on_cpu "
          f"({res['save_on_cpu']['time_ratio']:.2f}x)")
    sched.save(os.path.join(a.out, "swap_q.npz"))
    with open(os.path.join(a.out, "bench_swap.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(f"saved {a.out}/bench_swap.json and swap_q.npz")
    return 0


if __name__ == "__main__":
    sys.exit(main())
