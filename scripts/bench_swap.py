"""Activation swapping on a small CNN (issue 7): no swapping, swap-everything
(torch.autograd.graph.save_on_cpu, the zero-effort baseline) and the plan learned by
trainer.SwapScheduler. Prints resident saved-activation bytes and step time for each (and
on a GPU the largest batch that fits); saves JSON.

On this CPU-only machine "swapping" copies a saved tensor to another CPU buffer (the cost
of the transfer, without a transfer) and memory is the hooks' account of the saved bytes
that stay resident. save_on_cpu on a CPU tensor is a no-op (tensor.cpu() returns it), so
here its row only times the hooks, keeps every byte resident, and the row "swap all types"
(SwapHooks with every layer type swapped) is the swap-everything stand-in. On CUDA memory is
torch.cuda.max_memory_allocated.

usage: .venv/bin/python scripts/bench_swap.py [--batch 128] [--steps 30] [--w 0.5]
           [--out out/bench_swap]
"""
from __future__ import annotations

import argparse
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


def timed(fn, steps):
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[2:])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--steps", type=int, default=30)
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
    # reference: no swapping (plan 0), measured through the hooks' accounting
    sched.hooks.reset_counts()
    t_none = timed(lambda: step(model, x, y), a.steps)
    sched.hooks.reset_counts()
    step(model, x, y)
    resident_none = sched.hooks.resident_bytes
    with torch.autograd.graph.save_on_cpu(pin_memory=dev.type == "cuda"):
        t_all = timed(lambda: step(model, x, y), a.steps)
    for t in sched.hooks.swap:  # every layer type swapped, through the same hooks
        sched.hooks.swap[t] = True
    t_every = timed(lambda: step(model, x, y), a.steps)
    sched.hooks.reset_counts()
    step(model, x, y)
    resident_every = sched.hooks.resident_bytes
    sched.apply_plan()  # back to the scheduler's plan (no swapping yet)
    t0 = time.perf_counter()
    sched.pretrain(lambda b: step(model, *b), [(x, y)], rounds=a.rounds)
    learn_s = time.perf_counter() - t0
    converged = sched.converged  # by itself, within the rounds
    sched.use_best()
    t_learned = timed(lambda: step(model, x, y), a.steps)
    sched.hooks.reset_counts()
    step(model, x, y)
    resident_learned, swapped_learned = sched.hooks.resident_bytes, sched.hooks.swapped_bytes
    res = {
        "device": str(dev), "batch": a.batch, "w": a.w, "rounds": sched.rounds, "learn_s": learn_s,
        "plan": sched.plan_dict(), "converged_by_itself": converged,
        "no_swap": {"resident_bytes": resident_none, "step_s": t_none},
        "save_on_cpu": {"resident_bytes": 0 if dev.type == "cuda" else resident_none, "step_s": t_all},
        "swap_all_types": {"resident_bytes": resident_every, "step_s": t_every},
        "learned": {"resident_bytes": resident_learned, "swapped_bytes": swapped_learned,
                    "step_s": t_learned},
    }
    res["learned_resident_share"] = resident_learned / resident_none
    res["learned_time_ratio"] = t_learned / t_none
    res["save_on_cpu_time_ratio"] = t_all / t_none
    res["swap_all_types_time_ratio"] = t_every / t_none
    print(f"device {dev}, batch {a.batch}, w {a.w}: plan {sched.plan_dict()} after {sched.rounds} rounds "
          f"({learn_s:.1f} s)")
    for name in ("no_swap", "save_on_cpu", "swap_all_types", "learned"):
        r = res[name]
        print(f"  {name:<12} resident saved activations {r['resident_bytes'] / 1e6:8.2f} MB   "
              f"step {1e3 * r['step_s']:7.2f} ms")
    print(f"  learned: {100 * res['learned_resident_share']:.1f}% of the no-swap resident bytes at "
          f"{res['learned_time_ratio']:.2f}x its step time; save_on_cpu {res['save_on_cpu_time_ratio']:.2f}x, "
          f"swap all types {res['swap_all_types_time_ratio']:.2f}x")
    sched.save(os.path.join(a.out, "swap_q.npz"))
    with open(os.path.join(a.out, "bench_swap.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(f"saved {a.out}/bench_swap.json and swap_q.npz")
    return 0


if __name__ == "__main__":
    sys.exit(main())
