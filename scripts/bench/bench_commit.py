"""Orders at ImageNet's count (issue 53, item 6): what a commit costs and whether the daemon
answers others meanwhile. Prints JSON lines (appended to scripts/bench/results/bench_commit.jsonl).

The set: --samples tiny samples (1,281,000 by default: testkit.synth.make_packed, about a
minute), mounted with the default cache. --ranks ranks each hand the mount their share of a
random epoch and of the next (what HintedSampler writes for DistributedSampler's shares),
one after the other, while a thread asks the daemon for the control folder's attributes in
a loop (a getattr the kernel never caches: timeout 0), as another user's `stat` would. Per
version: each commit's time as the client sees it, the getattrs' latency while commits are
under way (median, p99, max), the daemon's RSS after, and the orders' bytes against the
order budget. With --against REF the same runs against REF's fusefs, alternating.

usage: .venv/bin/python scripts/bench/bench_commit.py [--samples 1281000] [--ranks 8] [--against REF]
"""
from __future__ import annotations

import argparse
import json
import os
import threading
import time

import numpy as np

from common import REPO, JsonLines, side_by_side

from fusefs import client, protocol
from fusefs import order as orderfmt
from testkit.mounts import running_mount
from testkit.synth import make_packed


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmRSS:"))


def run(dst: str, mnt: str, n: int, ranks: int, env: dict, label: str) -> dict:
    """One mount: every rank's commit, timed, with getattrs timed meanwhile."""
    rng = np.random.default_rng(0)
    epoch, nxt = rng.permutation(n), rng.permutation(n)
    orders = [orderfmt.encode(epoch[r::ranks], epoch=0, next_follows=True)
              + orderfmt.encode(nxt[r::ranks], epoch=1) for r in range(ranks)]
    with running_mount(dst, mnt, env=env, timeout=300) as (proc, _):
        lat, stop, busy = [], threading.Event(), threading.Event()

        def ask():
            ctl = os.path.join(mnt, protocol.CONTROL)
            while not stop.is_set():
                t = time.perf_counter()
                os.stat(ctl)
                if busy.is_set():
                    lat.append(time.perf_counter() - t)
        t = threading.Thread(target=ask, daemon=True)
        t.start()
        commits = []
        for r, data in enumerate(orders):
            busy.set()
            t0 = time.perf_counter()
            client.send_order(mnt, data, rank=r)
            commits.append(time.perf_counter() - t0)
            busy.clear()
        stop.set()
        t.join()
        stats = client.mount_stats(mnt)
        lat_ms = np.array(lat) * 1e3
        return {"bench": "bench_commit", "version": label, "samples": n, "ranks": ranks, "order_entries": 2 * n,
                "commit_s": [round(c, 3) for c in commits], "commit_s_max": round(max(commits), 3),
                "getattrs_during_commits": len(lat), "getattr_ms_median": round(float(np.median(lat_ms)), 3),
                "getattr_ms_p99": round(float(np.percentile(lat_ms, 99)), 3),
                "getattr_ms_max": round(float(lat_ms.max()), 3), "rss_mb": round(rss(proc.pid) / 1e6, 1),
                "order_bytes": stats.get("order_bytes"), "order_budget": stats.get("order_budget")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=1_281_000)
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default=os.path.join(REPO, "out", "packed"))
    p.add_argument("--against", metavar="REF", help="also run REF's fusefs, alternating")
    JsonLines.argument(p, "bench_commit")
    a = p.parse_args()
    results = JsonLines(a.results)
    dst, mnt = os.path.join(a.out, f"packed-{a.samples}"), os.path.join(a.out, f"mnt-{a.samples}")
    make_packed(dst, a.samples, progress=True, reuse=True)
    with side_by_side(a.against) as versions:
        for _ in range(a.rounds):
            for label, env in versions.items():
                row = run(dst, mnt, a.samples, a.ranks, env, label)
                print(json.dumps(row), flush=True)
                results.write(**row)

if __name__ == "__main__":
    main()
