"""What `fusefs run` costs the training process at ImageNet's count (issue 89): a DataLoader
over --samples files of a fusefs mount (1,281,000 by default: testkit.synth.make_packed),
shuffle=True, batch 256, no workers and a dataset whose items are their indices (the files
are not read: what is measured is the loader's side), three epochs, run as it is and under
`fusefs run --`, alternating, --rounds times each.

Per run: the first epoch's first batch (the launcher works the mount's ids out once, reads
the epoch's indices from the sampler and hands the order over), each later epoch's first
batch, the process's CPU seconds per epoch and its peak RSS; and, under the launcher, that
the mount got each epoch's order (its length). Ratios launcher / plain in the same run.
JSON lines to scripts/bench/results/bench_autohint.jsonl.

usage: .venv/bin/python scripts/bench/bench_autohint.py [--samples N] [--rounds R] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

from common import REPO, JsonLines

from testkit.mounts import running_mount
from testkit.synth import make_packed

FUSEFS = os.path.join(os.path.dirname(sys.executable), "fusefs")

# The training process: its figures as one JSON line.
TRAIN = r'''
import json, os, resource, sys, time
import torch
from torch.utils.data import DataLoader, Dataset
mnt, n, epochs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])

class Files(Dataset):
    """n files of the mount, by their paths, as ImageFolder's .samples names them; an item
    is its index (the loader's side is measured, not the reads)."""
    def __init__(self, paths):
        self.samples = [(p, 0) for p in paths]
    def __len__(self):
        return len(self.samples)
    def __getitem__(self, i):
        return i

with open(os.path.join(mnt, ".fusefs", "ids"), "rb") as f:
    rels = f.read().split(b"\0")[:n]
paths = [os.path.join(mnt, os.fsdecode(r)) for r in rels]
torch.manual_seed(0)
loader = DataLoader(Files(paths), batch_size=256, shuffle=True, collate_fn=lambda b: b)
cpu = lambda: sum(resource.getrusage(resource.RUSAGE_SELF)[:2])
out = {"first_batch_s": [], "epoch_cpu_s": [], "order_length": [], "samples": 0}
for epoch in range(epochs):
    t0, c0 = time.perf_counter(), cpu()
    it = iter(loader)
    first = next(it)
    out["first_batch_s"].append(time.perf_counter() - t0)
    count = len(first) + sum(len(b) for b in it)
    out["epoch_cpu_s"].append(cpu() - c0)
    out["samples"] += count
    with open(os.path.join(mnt, ".fusefs", "order.0"), "rb") as f:
        out["order_length"].append(max(0, (len(f.read()) - 32) // 4))
out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps(out))
'''


def one(mnt: str, n: int, epochs: int, launcher: bool) -> dict:
    cmd = [sys.executable, "-c", TRAIN, mnt, str(n), str(epochs)]
    if launcher:
        cmd = [FUSEFS, "run", "--quiet", "--", *cmd]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[:6])} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=1_281_000)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default=os.path.join(REPO, "out", "bench_autohint"))
    JsonLines.argument(p, "bench_autohint")
    a = p.parse_args()
    lines = JsonLines(a.results)
    dst, mnt = os.path.join(a.out, f"packed-{a.samples}"), os.path.join(a.out, "mnt")
    make_packed(dst, a.samples, reuse=True)
    runs = {"plain": [], "launcher": []}
    with running_mount(dst, mnt, "--cache-size", "64MiB"):
        for _ in range(a.rounds):
            for kind in runs:
                r = one(mnt, a.samples, a.epochs, kind == "launcher")
                runs[kind].append(r)
                print(kind, json.dumps(r), flush=True)
    med = {k: {"first_batch_s": [statistics.median(r["first_batch_s"][e] for r in rs) for e in range(a.epochs)],
               "epoch_cpu_s": [statistics.median(r["epoch_cpu_s"][e] for r in rs) for e in range(a.epochs)],
               "peak_rss_mb": statistics.median(r["peak_rss_mb"] for r in rs),
               "order_length": rs[-1]["order_length"]}
           for k, rs in runs.items()}
    per = {k: [round(1e6 * c / a.samples, 2) for c in v["epoch_cpu_s"]] for k, v in med.items()}
    row = {"bench": "bench_autohint", "samples": a.samples, "epochs": a.epochs, "rounds": a.rounds,
           "median": med, "epoch_cpu_us_per_sample": per,
           "added_cpu_us_per_sample": [round(x - y, 2) for x, y in zip(per["launcher"], per["plain"])],
           "added_rss_mb": round(med["launcher"]["peak_rss_mb"] - med["plain"]["peak_rss_mb"], 1)}
    lines.write(**row)
    print(json.dumps(row))
    ok = med["launcher"]["order_length"] == [a.samples] * a.epochs
    print(f"each epoch's order handed over, {a.samples:,} ids: {'yes' if ok else 'NO'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
