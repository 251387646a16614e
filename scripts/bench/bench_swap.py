"""Activation swapping within a memory budget against what a user would pick instead:
no swapping, torch.autograd.graph.save_on_cpu (everything off the device), per-block
torch.utils.checkpoint (the anchor), SwapHooks swapping every segment, and the plan
trainer.SwapScheduler learns for a budget (default 60% of the no-swap memory). Prints step
time and memory per row side by side, on CUDA the largest batch that fits in a fixed
memory limit; saves JSON and a PNG (memory against step time, one point per plan the
scheduler measured, the other rows marked).

Models: `cnn` (a small CNN of blocks), `transformer` (a stack of TransformerEncoderLayer),
`resnet50` (torchvision; CUDA node). On CUDA memory is torch.cuda.max_memory_allocated;
on CPU it is the saved-activation bytes that stay resident (SwapHooks' count; a
checkpointed block's input counted too), "swapping" copies to another host buffer (the
cost of the transfer without a transfer), and save_on_cpu, a no-op on CPU tensors, is
stood in for by a copy of every saved tensor (resident 0).

Step times are medians of `--rounds-timed` rounds, each running `--steps` steps of every
row in turn, so drift on a noisy machine hits all rows alike.

--budgets runs the rows once per budget (a scheduler learned for each), --rows picks the
rows (no_swap always runs: the others are measured against it). On CUDA --fit caps the
process's GPU memory at (1 + FIT) times the no-swap step's peak, so that the batch fits
only just without swapping, as on a GPU whose memory the model fills (0: no cap). Each
row also gives the process's host RSS after its step and the peak RSS while it ran.

usage: .venv/bin/python scripts/bench/bench_swap.py [--models cnn,transformer] [--batch 64]
           [--budgets 0.6,0.8] [--rows no_swap,checkpoint,learned] [--fit 0.05] [--rounds 40]
           [--transformer 6,256,128]
           [--steps 3] [--rounds-timed 5] [--out out/bench_swap]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import threading
import time

import psutil
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from common import REPO, JsonLines, commit as common_commit

from trainer import SwapScheduler
from trainer.accel.swap import PinnedPool, is_oom, largest_batch


# ---- models: (model, the blocks to checkpoint, a batch maker) ---------------------------
def cnn():
    def block(i, o, pool):
        return nn.Sequential(nn.Conv2d(i, o, 3, padding=1), nn.BatchNorm2d(o), nn.ReLU(),
                             *([nn.MaxPool2d(2)] if pool else []))
    body = nn.Sequential(block(3, 32, False), block(32, 32, True), block(32, 64, False),
                         block(64, 64, True))
    model = nn.Sequential(body, nn.Flatten(), nn.Linear(64 * 8 * 8, 128), nn.ReLU(), nn.Linear(128, 10))
    return model, list(body), lambda b, dev: (torch.randn(b, 3, 32, 32, device=dev),
                                               torch.randint(0, 10, (b,), device=dev))


class Transformer(nn.Module):
    def __init__(self, layers=6, d=256, heads=8, seq=128, classes=10):
        super().__init__()
        self.blocks = nn.ModuleList(nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0,
                                                               batch_first=True) for _ in range(layers))
        self.head = nn.Linear(d, classes)
        self.d, self.seq = d, seq

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x.mean(1))


TRANSFORMER = {"layers": 6, "d": 256, "seq": 128}  # --transformer LAYERS,D,SEQ


def transformer():
    m = Transformer(layers=TRANSFORMER["layers"], d=TRANSFORMER["d"], heads=max(1, TRANSFORMER["d"] // 32),
                    seq=TRANSFORMER["seq"])
    return m, list(m.blocks), lambda b, dev: (torch.randn(b, m.seq, m.d, device=dev),
                                              torch.randint(0, 10, (b,), device=dev))


def resnet50():
    from torchvision.models import resnet50 as build
    m = build()
    blocks = [blk for layer in (m.layer1, m.layer2, m.layer3, m.layer4) for blk in layer]
    return m, blocks, lambda b, dev: (torch.randn(b, 3, 224, 224, device=dev),
                                      torch.randint(0, 1000, (b,), device=dev))


MODELS = {"cnn": cnn, "transformer": transformer, "resnet50": resnet50}


def step(model, x, y):
    model.zero_grad(set_to_none=True)
    nn.functional.cross_entropy(model(x), y).backward()


# ---- host memory ------------------------------------------------------------------------
class HostWatch:
    """Stops the benchmark with a report when this process's resident memory passes `limit`
    bytes (pinned host buffers count): on the GPU node, a run grew past the host's 125 GiB
    and the kernel killed it with nothing printed. `phase` names what runs now; each new
    phase is printed with the memory so far."""

    def __init__(self, limit: int, pool, phase: str, period: float = 0.25):
        self.limit, self.pool, self.period = limit, pool, period
        self.peak = 0
        self.enter(phase)
        threading.Thread(target=self._watch, daemon=True, name="host-watch").start()

    def rss(self) -> int:
        return psutil.Process().memory_info().rss

    def enter(self, phase: str) -> None:
        self.phase = phase
        print(f"    [{phase}: host RSS {self.rss() / 2**30:.1f} GiB, swap pool "
              f"{self.pool().bytes / 2**30:.1f} GiB]", flush=True)

    def _watch(self) -> None:
        while True:
            rss = self.rss()
            self.peak = max(self.peak, rss)
            if rss > self.limit:
                stats = torch.cuda.host_memory_stats() if torch.cuda.is_available() else {}
                held = {k: v for k, v in stats.items() if "bytes" in k or "segment" in k}
                print(f"bench_swap: host RSS {rss / 2**30:.1f} GiB passed the limit of "
                      f"{self.limit / 2**30:.1f} GiB during {self.phase}; swap pool "
                      f"{self.pool().bytes / 2**30:.1f} GiB; torch's pinned host allocator: {held}",
                      file=sys.stderr, flush=True)
                os._exit(3)
            time.sleep(self.period)


# ---- the rows ---------------------------------------------------------------------------
def save_everything(dev):
    """Every saved tensor moved off the device (see the docstring for CPU)."""
    if dev.type == "cuda":
        return torch.autograd.graph.save_on_cpu(pin_memory=True)
    return torch.autograd.graph.saved_tensors_hooks(lambda t: t.detach().clone(), lambda t: t)


@contextlib.contextmanager
def checkpointed(blocks, hooks):
    """Each block's forward through torch.utils.checkpoint (non-reentrant); the swap hooks of
    the modules inside step aside (the innermost saved_tensors_hooks win), and each block's
    input is counted as resident (CPU accounting)."""
    originals = [b.forward for b in blocks]

    def wrap(b, f):
        def forward(*args):
            hooks.resident_bytes += sum(a.numel() * a.element_size() for a in args if torch.is_tensor(a))
            return checkpoint(f, *args, use_reentrant=False)
        return forward
    for b, f in zip(blocks, originals):
        b.forward = wrap(b, f)
    hooks.skip = {m for b in blocks for m in b.modules()}  # checkpoint's own hooks take these
    try:
        yield
    finally:
        hooks.skip = set()
        for b, f in zip(blocks, originals):
            b.forward = f


def side_by_side(rows, run, rounds, steps, watch):
    """Median step time per row, the rows interleaved round by round."""
    times = {name: [] for name in rows}
    for name, enter in rows.items():  # warm-up: allocator, caches
        watch.enter(f"warm-up step of {name}")
        with enter():
            run()
    for k in range(rounds):
        for name, enter in rows.items():
            watch.phase = f"timing round {k} of {name}"
            with enter():
                for _ in range(steps):
                    t0 = time.perf_counter()
                    run()
                    times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def empty_host_cache() -> None:
    """Give the pinned host memory torch's caching allocator keeps after a free back to the
    system (where this torch can): each try of the largest-batch search has a swap pool of
    its own, and on the GPU node the freed ones, kept, took the host's RSS to 65 GiB."""
    release = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None)
    if release is not None:
        release()


def largest_batch_cuda(enter, dev, model, make, start, hooks, host_limit):
    """CUDA only: the largest batch (to within 1/16) whose step fits in the memory limit.
    Each try has a swap pool of its own, the one at `start` scaled to its batch (within
    host_limit): the scheduler's pool is sized once, for the batch it trains with."""
    trained = hooks.pool

    def fits(b):
        try:
            x, y = make(b, dev)
            hooks.pool = PinnedPool(pin=trained.pin, limit=host_limit)
            hooks.pool.reserve(trained.bytes * b // max(1, start) + PinnedPool.ALIGN * 64)
            hooks.reset_counts()
            with enter():
                step(model, x, y)
            torch.cuda.synchronize(dev)
            return True
        except Exception as e:  # a failed pinned allocation counts as out of memory too
            if not is_oom(e):
                raise
            return False
        finally:
            model.zero_grad(set_to_none=True)
            hooks.pool = trained
            torch.cuda.empty_cache()
            empty_host_cache()
    return largest_batch(fits, start)


def fit_memory(model, x, y, dev, fit: float) -> int | None:
    """CUDA with fit > 0: cap this process's GPU memory at (1 + fit) times a no-swap step's
    peak (one step measured uncapped); returns the cap in bytes (None: no cap)."""
    if dev.type != "cuda" or fit <= 0:
        return None
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    torch.cuda.set_per_process_memory_fraction(1.0, index)
    torch.cuda.synchronize(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    step(model, x, y)
    torch.cuda.synchronize(dev)
    model.zero_grad(set_to_none=True)
    total = torch.cuda.get_device_properties(dev).total_memory
    cap = int((1 + fit) * torch.cuda.max_memory_allocated(dev))
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), index)
    return cap


def bench_model(name, a, dev, lines) -> tuple[dict, dict]:
    """Every budget's rows for one model: {budget: result}, {budget: the plans measured}."""
    model, blocks, make = MODELS[name]()
    model = model.to(dev)
    x, y = make(a.batch, dev)
    results, points = {}, {}
    for budget in a.budgets:
        cap = fit_memory(model, x, y, dev, a.fit)
        results[budget], points[budget] = bench_budget(name, model, blocks, make, x, y, budget, cap, a, dev,
                                                       lines)
    return results, points


def bench_budget(name, model, blocks, make, x, y, budget, cap, a, dev, lines) -> tuple[dict, list]:
    host_limit = int(a.host_limit * psutil.virtual_memory().total)
    sched = SwapScheduler(model, budget=budget, segments=a.segments, steps_per_round=2, device=dev,
                          seed=0, host_limit=host_limit)
    watch = HostWatch(host_limit, lambda: sched.hooks.pool,
                      f"{name}, budget {budget:.0%}: learning, {a.rounds} rounds")
    t0 = time.perf_counter()
    sched.pretrain(lambda b: step(model, *b), [(x, y)], rounds=a.rounds)
    learn_s = time.perf_counter() - t0
    converged = sched.converged
    sched.use_best()
    learned = sched.plan
    points = [{"plan": sched.plan_dict(p), "step_s": t, "memory": m} for p, (t, m) in sched.measured.items()]

    @contextlib.contextmanager
    def plan(p):
        sched.plan = p
        sched.apply_plan()
        yield

    @contextlib.contextmanager
    def everything():
        sched.hooks.enabled = False  # nested inside them, save_on_cpu would not see the layers' tensors
        try:
            with save_everything(dev):
                yield
        finally:
            sched.hooks.enabled = True

    @contextlib.contextmanager
    def anchor():
        with plan(0), checkpointed(blocks, sched.hooks):
            yield

    rows = {"no_swap": lambda: plan(0), "save_on_cpu": everything, "checkpoint": anchor,
            "swap_all": lambda: plan(2 ** len(sched.units) - 1), "learned": lambda: plan(learned)}
    rows = {row: enter for row, enter in rows.items() if row == "no_swap" or row in a.rows}
    def one_step():  # (the swap pool handed out afresh: the last step's transfers are done)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        sched.hooks.reset_counts()
        step(model, x, y)
    step_s = side_by_side(rows, one_step, a.rounds_timed, a.steps, watch)
    res = {"batch": a.batch, "budget": budget, "memory_cap_bytes": cap, "rounds": sched.rounds,
           **({"shape": dict(TRANSFORMER)} if name == "transformer" else {}), "learn_s": learn_s,
           "plan": sched.plan_dict(learned), "converged_by_itself": converged,
           "failed_plans": len(sched.failed)}
    lines.write(bench="bench_swap", model=name, **res, step_s=step_s)
    if dev.type == "cuda" and a.memory_limit:
        torch.cuda.set_per_process_memory_fraction(a.memory_limit, torch.cuda.current_device())
        res["memory_limit_bytes"] = int(a.memory_limit * torch.cuda.get_device_properties(dev).total_memory)
    for row, enter in rows.items():
        watch.enter(f"memory of {row}")
        watch.peak = 0
        sched.hooks.reset_counts()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
            torch.cuda.reset_peak_memory_stats(dev)
        with enter():
            step(model, x, y)
        if dev.type == "cuda":
            memory = torch.cuda.max_memory_allocated(dev)
        elif row == "save_on_cpu":
            memory = 0  # every saved tensor was copied out
        else:
            memory = sched.hooks.resident_bytes
        res[row] = {"memory": memory, "step_s": step_s[row], "time_ratio": step_s[row] / step_s["no_swap"],
                    "host_rss": watch.rss(), "host_rss_peak": max(watch.peak, watch.rss())}
        if dev.type == "cuda" and a.memory_limit and row in a.largest_rows.split(","):
            res[row]["largest_batch"] = largest_batch_cuda(enter, dev, model, make, a.batch, sched.hooks,
                                                           host_limit)
        lines.write(bench="bench_swap", model=name, row=row, batch=a.batch, budget=budget, memory_cap_bytes=cap,
                    memory_limit_bytes=res.get("memory_limit_bytes"), **res[row])
    for row in rows:
        res[row]["memory_share"] = res[row]["memory"] / res["no_swap"]["memory"]
    res["host_rss_peak"] = watch.peak
    if "learned" in res:
        res["learned_within_budget"] = res["learned"]["memory_share"] <= budget
        if "checkpoint" in res:
            res["learned_vs_checkpoint_time"] = res["learned"]["step_s"] / res["checkpoint"]["step_s"]
    sched.save(os.path.join(a.out, f"swap_q_{name}_{budget:g}.npz"))
    sched.hooks.remove()
    return res, points


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=None,
                   help="comma-separated: cnn, transformer, resnet50 (default: resnet50,transformer on "
                        "CUDA, cnn,transformer on CPU)")
    p.add_argument("--batch", type=int, default=None, help="batch size (default 128 on CUDA, 32 on CPU)")
    p.add_argument("--budgets", default="0.6",
                   help="memory budgets, shares of no-swap, comma-separated (default 0.6)")
    p.add_argument("--rows", default="no_swap,save_on_cpu,checkpoint,swap_all,learned",
                   help="the rows, comma-separated (default all; no_swap always runs)")
    p.add_argument("--fit", type=float, default=0.0,
                   help="CUDA: cap GPU memory at (1 + FIT) x the no-swap peak (default 0: no cap)")
    p.add_argument("--transformer", default="6,256,128",
                   help="the transformer stack's layers, width and sequence length (default 6,256,128)")
    p.add_argument("--segments", type=int, default=6, help="units of a plan (default 6)")
    p.add_argument("--rounds", type=int, default=40, help="learning rounds of the scheduler (default 40)")
    p.add_argument("--steps", type=int, default=3, help="steps per row and timing round (default 3)")
    p.add_argument("--rounds-timed", type=int, default=5, help="interleaved timing rounds (default 5)")
    p.add_argument("--memory-limit", type=float, default=0.5,
                   help="CUDA: share of the GPU's memory for the largest-batch search (default 0.5; "
                        "0: no search)")
    p.add_argument("--largest-rows", default="no_swap,save_on_cpu,checkpoint,swap_all,learned",
                   help="CUDA: the rows whose largest batch is searched (comma-separated; default all)")
    p.add_argument("--host-limit", type=float, default=0.6,
                   help="stop with a report when this process's resident memory passes this share "
                        "of the host's (default 0.6)")
    p.add_argument("--out", default=os.path.join(REPO, "out", "bench_swap"))
    p.add_argument("--jsonl", help="append each model's rows as JSON lines here as they are measured "
                                   "(default OUT/bench_swap.jsonl)")
    a = p.parse_args()
    a.budgets = [float(b) for b in a.budgets.split(",")]
    a.rows = a.rows.split(",")
    TRANSFORMER.update(zip(("layers", "d", "seq"), (int(v) for v in a.transformer.split(","))))
    known = ("no_swap", "save_on_cpu", "checkpoint", "swap_all", "learned")
    if not set(a.rows) <= set(known):
        p.error(f"unknown row: {', '.join(sorted(set(a.rows) - set(known)))}")
    os.makedirs(a.out, exist_ok=True)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    a.batch = a.batch or (128 if dev.type == "cuda" else 32)
    models = (a.models or ("resnet50,transformer" if dev.type == "cuda" else "cnn,transformer")).split(",")
    commit = common_commit()
    lines = JsonLines(a.jsonl or os.path.join(a.out, "bench_swap.jsonl"))
    out = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "commit": commit,
           "timing": {"rounds": a.rounds_timed, "steps": a.steps}, "models": {}}
    points = {}
    what = "peak CUDA memory" if dev.type == "cuda" else "resident saved activations"
    for name in models:
        out["models"][name], points[name] = bench_model(name, a, dev, lines)
        for budget, res in out["models"][name].items():
            print(f"{name}: batch {a.batch}, budget {budget:.0%}: learned {res['plan']} after "
                  f"{res['rounds']} rounds ({res['learn_s']:.1f} s)"
                  + (f"; GPU memory capped at {res['memory_cap_bytes'] / 2**30:.2f} GiB"
                     if res["memory_cap_bytes"] else ""))
            for row in known:
                if row not in res:
                    continue
                r = res[row]
                line = (f"  {row:<12} {what} {r['memory'] / 1e6:9.2f} MB ({100 * r['memory_share']:5.1f}%)"
                        f"   step {1e3 * r['step_s']:8.2f} ms ({r['time_ratio']:.2f}x)"
                        f"   host RSS {r['host_rss'] / 2**30:5.2f} GiB")
                if "largest_batch" in r:
                    line += f"   largest batch {r['largest_batch']}"
                print(line, flush=True)
            if "learned_within_budget" in res:
                print(f"  learned plan within the budget: {res['learned_within_budget']}"
                      + (f"; step time {res['learned_vs_checkpoint_time']:.2f}x checkpointing's"
                         if "learned_vs_checkpoint_time" in res else ""))
    with open(os.path.join(a.out, "bench_swap.json"), "w") as f:
        json.dump(out, f, indent=1)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    panels = [(name, budget) for name in models for budget in a.budgets]
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), squeeze=False)
    for ax, (name, budget) in zip(axes[0], panels):
        res = out["models"][name][budget]
        base = res["no_swap"]
        ax.scatter([q["step_s"] / base["step_s"] for q in points[name][budget]],
                   [100 * q["memory"] / base["memory"] for q in points[name][budget]], s=12, c="grey",
                   label="plans measured while learning")
        for i, row in enumerate(known):
            if row in res:
                ax.scatter([res[row]["time_ratio"]], [100 * res[row]["memory_share"]], s=50, c=f"C{i}",
                           label=row)
        ax.axhline(100 * budget, ls="--", c="k", lw=0.8, label="budget")
        ax.set(title=f"{name}, budget {budget:.0%} ({out['device']})", xlabel="step time / no swap",
               ylabel=f"{what}, % of no swap")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(a.out, "bench_swap.png"), dpi=100)
    print(f"saved {a.out}/bench_swap.json and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
