"""What waking an idle event loop costs: trio's, against a bare epoll loop, side by side.

A paced reader's requests find the daemon idle, and the fast path wakes the trio loop once
per batch of events (fastpath.DELAY_US: 20 ms after the first): docs/HOTPATH.md counts
the loop's share of `kernel_paced`. This measures the floor of such a wake with nothing of
fusefs in it: a thread writes an eventfd every --spacing milliseconds and a loop waits for
it, either a trio task (`trio.lowlevel.wait_readable`, as FastPath.run waits) or a bare
`select.epoll` loop; the loop thread's CPU (CLOCK_THREAD_CPUTIME_ID) per wake. Each
measurement runs in a fresh process; the two loops alternate, --rounds times; the median
round is reported with every round's figure. JSON lines, appended to
scripts/bench/results/wake_cost.jsonl (HOTPATH.md's table "wake").

usage: .venv/bin/python scripts/bench/wake_cost.py [--wakes 200] [--rounds 3] [--spacing 20 5 1]
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

from common import JsonLines

LOOPS = ("trio", "epoll")


def one(loop: str, spacing_ms: float, wakes: int) -> float:
    """(In this process.) The loop thread's CPU us per wake."""
    import os
    import select
    import threading
    import time

    import trio

    # (a semaphore: each write wakes one wait, none is lost to a write that came early)
    efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC | os.EFD_SEMAPHORE)

    def kicker():
        for _ in range(wakes + 1):
            time.sleep(spacing_ms / 1000)
            os.eventfd_write(efd, 1)
    threading.Thread(target=kicker, daemon=True).start()
    if loop == "epoll":
        ep = select.epoll()
        ep.register(efd, select.EPOLLIN)
        ep.poll()
        os.eventfd_read(efd)
        t0 = time.thread_time()
        for _ in range(wakes):
            ep.poll()
            os.eventfd_read(efd)
        return 1e6 * (time.thread_time() - t0) / wakes

    async def run():
        await trio.lowlevel.wait_readable(efd)
        os.eventfd_read(efd)
        t0 = time.thread_time()
        for _ in range(wakes):
            await trio.lowlevel.wait_readable(efd)
            os.eventfd_read(efd)
        return 1e6 * (time.thread_time() - t0) / wakes
    return trio.run(run)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--wakes", type=int, default=200)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--spacing", type=float, nargs="+", default=[20, 5, 1], metavar="MS")
    p.add_argument("--one", nargs=2, metavar=("LOOP", "MS"), help=argparse.SUPPRESS)
    JsonLines.argument(p, "wake_cost")
    a = p.parse_args()
    if a.one:
        print(one(a.one[0], float(a.one[1]), a.wakes))
        return 0
    results = JsonLines(a.results)
    for spacing in a.spacing:
        per = {loop: [] for loop in LOOPS}
        for i in range(a.rounds):
            for loop in (LOOPS if i % 2 == 0 else LOOPS[::-1]):
                out = subprocess.run([sys.executable, __file__, "--one", loop, str(spacing),
                                      "--wakes", str(a.wakes)], capture_output=True, text=True,
                                     check=True, timeout=60 + 2 * a.wakes * spacing / 1000)
                per[loop].append(round(float(out.stdout), 1))
        for loop in LOOPS:
            row = {"bench": "wake_cost", "loop": loop, "spacing_ms": spacing, "wakes": a.wakes,
                   "cpu_us_per_wake": statistics.median(per[loop]), "rounds": per[loop]}
            print(json.dumps(row), flush=True)
            results.write(**row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
