"""A node's worth of samples at ImageNet's count (issue 54): one epoch of tiny samples read
along an order, as a DataLoader's workers read an ImageFolder, and what it costs the daemon.
Prints JSON lines (appended to scripts/bench/results/bench_scale.jsonl).

The set: --samples samples of 0.5-3 KB in 1,000 folders (1,281,000 by default, --quick
200,000: testkit.synth.make_packed writes the packed folder straight, about 15 s for the
full count), mounted with --cache-size (1 GiB by default). The tree is listed first, as
ImageFolder does; then the order of a random epoch and the next is handed over (as
HintedSampler does) and --readers processes read the files, reader i taking positions
i::readers, in four quarters one after the other (the cost per quarter shows a cost that
grows through the epoch). Per version: samples/s, the daemon's CPU per sample (whole epoch
and per quarter), its peak RSS against fresh + orders + budget, and the backend samples
(each sample once). With --against REF the same for REF's fusefs, alternating by round.

--drop-pages reads a whole epoch first (every sample fetched and pushed into the kernel
page cache), then the measured epoch along a new order, in which the kernel holds every
sample, and drops the page cache (pages only: `drop_caches` 1, as root) halfway, before its
third quarter, as reclaim that takes every pushed sample at once would; it reports the
misses per quarter (rows `bench_scale_drop`): how many reads wait for a fetch before the
daemon stops trusting what it pushed (kernel_view.KernelView) should not grow with how far
into the epoch the drop comes.

--epochs N reads N epochs in a row on one mount, each order handed over with the next (rows
`bench_scale_epochs`): per epoch samples/s, CPU per sample, misses, samples fetched, and the
daemon's resident memory at the epoch's end and at its peak so far: what a new order costs
the memory, and whether any of it stays.

usage: .venv/bin/python scripts/bench/bench_scale.py [--quick] [--samples N] [--against REF]
       [--drop-pages | --epochs N]
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import time

import numpy as np

from common import REPO, JsonLines, read_files, side_by_side

from fusefs import client
from fusefs import order as orderfmt
from testkit.gluster import drop_caches
from testkit.mounts import running_mount
from testkit.synth import make_packed


def status(pid: int, key: str) -> int:
    """A figure of /proc/PID/status in bytes (VmRSS, VmHWM)."""
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith(key + ":"))


def quarters_of(mnt: str, pool, packed, order, readers: int, drop_pages: bool) -> list[dict]:
    """Read one epoch along order, in four quarters one after the other (drop_pages: the
    page cache dropped before the third); each quarter's CPU per sample, samples/s, misses."""
    n, quarters = packed.n, []
    paths = [os.path.join(mnt, packed.path(i)) for i in order.tolist()]
    for q in range(4):
        part = paths[q * n // 4:(q + 1) * n // 4]
        if drop_pages and q == 2:
            drop_caches(1)
        before, tq = client.mount_stats(mnt), time.perf_counter()
        got = sum(pool.map(read_files, [part[i::readers] for i in range(readers)], chunksize=1))
        after = client.mount_stats(mnt)
        assert got == int(packed.sizes[order[q * n // 4:(q + 1) * n // 4]].sum()), "bytes lost"
        quarters.append({"cpu_us_per_sample": round(1e6 * (after["cpu_s"] - before["cpu_s"]) / len(part), 1),
                         "samples_per_s": round(len(part) / (time.perf_counter() - tq)),
                         "misses": after["misses"] - before["misses"]})
    return quarters


def epoch(dst: str, mnt: str, packed, readers: int, cache: str, env: dict, label: str,
          options: list[str] = (), drop_pages: bool = False, epochs: int = 1) -> dict:
    """One mount (with extra `fusefs mount` options), one epoch: the row (drop_pages: a
    whole epoch read first, then the measured one, the page cache dropped before its third
    quarter; epochs: that many read in a row, each order handed over with the next, the
    row's figures over all of them and its quarters the last one's)."""
    n = packed.n
    rng = np.random.default_rng(1)
    order, nxt = rng.permutation(n), rng.permutation(n)
    first = 1 if drop_pages else 0  # (the measured epoch's number)
    with running_mount(dst, mnt, "--cache-size", cache, *options, env=env, timeout=300) as (proc, _), \
            mp.get_context("fork").Pool(readers) as pool:
        t = time.perf_counter()
        listed = sum(len(files) for _, _, files in os.walk(mnt))
        list_s = time.perf_counter() - t
        fresh = status(proc.pid, "VmRSS")
        if drop_pages:  # (an epoch before: the kernel then holds every sample)
            warm = rng.permutation(n)
            client.send_order(mnt, orderfmt.encode(warm, epoch=0, next_follows=True) + orderfmt.encode(order, epoch=1))
            warm_paths = [os.path.join(mnt, packed.path(i)) for i in warm.tolist()]
            pool.map(read_files, [warm_paths[i::readers] for i in range(readers)], chunksize=1)
        s0 = client.mount_stats(mnt)  # (the read-ahead starts with the order)
        each, seen = [], 0  # (seen: the largest VmHWM read: the kernel's own is not monotone
        # across reads, its RSS counters being summed lazily)
        for e in range(first, first + epochs):
            if e > first:
                order, nxt = nxt, rng.permutation(n)
            before = client.mount_stats(mnt)
            client.send_order(mnt, orderfmt.encode(order, epoch=e, next_follows=True) + orderfmt.encode(nxt, epoch=e + 1))
            te = time.perf_counter()
            t0 = te if e == first else t0
            quarters = quarters_of(mnt, pool, packed, order, readers, drop_pages)
            after = client.mount_stats(mnt)
            each.append({"samples_per_s": round(n / (time.perf_counter() - te)),
                         "daemon_cpu_us_per_sample": round(1e6 * (after["cpu_s"] - before["cpu_s"]) / n, 1),
                         "misses": after["misses"] - before["misses"],
                         "backend_samples": after["backend_samples"] - before["backend_samples"],
                         "rss_mb": round(status(proc.pid, "VmRSS") / 1e6, 1)})
            seen = max(seen, status(proc.pid, "VmHWM"), int(each[-1]["rss_mb"] * 1e6))
            each[-1]["rss_peak_mb"] = round(seen / 1e6, 1)
        seconds = time.perf_counter() - t0
        s1 = client.mount_stats(mnt)
        peak = max(seen, status(proc.pid, "VmHWM"))
    bench, regime = (("bench_scale_drop", "scale_drop") if drop_pages else
                     ("bench_scale_epochs", "scale_epochs") if epochs > 1 else ("bench_scale", "scale"))
    row = {"bench": bench, "regime": regime, "version": label, "samples": n, "listed": listed, "list_s": round(list_s, 1),
           "readers": readers, "cache_budget": s1["cache_budget"], "samples_per_s": round(epochs * n / seconds),
           "daemon_cpu_us_per_sample": round(1e6 * (s1["cpu_s"] - s0["cpu_s"]) / (epochs * n), 1),
           "quarters": quarters, "backend_samples": s1["backend_samples"] - s0["backend_samples"],
           "misses": s1["misses"] - s0["misses"], "kernel_drops": s1["kernel_drops"],
           "rss_fresh_mb": round(fresh / 1e6, 1),
           "rss_peak_mb": round(peak / 1e6, 1), "order_mb": round((s1.get("order_bytes") or 0) / 1e6, 1),
           "budget_mb": round(s1["cache_budget"] / 1e6, 1)}
    if epochs > 1:
        row["epochs"] = each
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="200,000 samples")
    p.add_argument("--samples", type=int, help="samples (default 1,281,000; 200,000 with --quick)")
    p.add_argument("--cache-size", default="1GiB")
    p.add_argument("--readers", type=int, default=4)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--out", default=os.path.join(REPO, "out", "packed"))
    p.add_argument("--against", metavar="REF", help="also run REF's fusefs, alternating by round")
    p.add_argument("--drop-pages", action="store_true",
                   help="drop the page cache halfway (root): the misses until the daemon notices")
    p.add_argument("--epochs", type=int, default=1, help="epochs read in a row on one mount (default 1)")
    JsonLines.argument(p, "bench_scale")
    a = p.parse_args()
    if a.epochs < 1 or (a.epochs > 1 and a.drop_pages):
        raise SystemExit("bench_scale.py: --epochs takes a count of at least 1, and not with --drop-pages")
    if a.drop_pages and os.geteuid() != 0:
        raise SystemExit("bench_scale.py: --drop-pages writes /proc/sys/vm/drop_caches: run it as root")
    n = a.samples or (200_000 if a.quick else 1_281_000)
    results = JsonLines(a.results)
    dst, mnt = os.path.join(a.out, f"packed-{n}"), os.path.join(a.out, f"mnt-{n}")
    packed = make_packed(dst, n, progress=True, reuse=True)
    with side_by_side(a.against) as versions:
        for i in range(a.rounds):  # (REF first in even rounds, last in odd ones)
            for label, env in (list(versions.items()) if i % 2 == 0 else list(versions.items())[::-1]):
                row = epoch(dst, mnt, packed, a.readers, a.cache_size, env, label, drop_pages=a.drop_pages,
                            epochs=a.epochs)
                print(json.dumps(row), flush=True)
                results.write(**row)


if __name__ == "__main__":
    main()
