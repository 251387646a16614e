"""The event loop's own CPU per fetched sample: fusefs's core in-process, read as through the
fast path, with no kernel, no /dev/fuse and no pyfuse3 request loop.

Under an order nearly every sample is fetched once per epoch, and what the loop's Python
spends on a fetched sample (the read-ahead's walk, the batch's claim and delivery, the
cache's reservation, keeping and eviction, the readers' uses) is the part of its cost that
the kernel's copies do not set (docs/HOTPATH.md, "Where a fetched sample's time goes"). In
bench_hotpath.py's fetched regimes it drowns in this VM's kernel costs and noise; here it is
measured alone, as handlers_cost.py measures a cached sample's handlers.

A fresh core (a cache of --cache of the set, each share given in turn) reads one epoch along a random order written
as HintedSampler writes it (with --without-order, each share once more with the order kept
from the core: every sample a miss that reaches the loop, each fetched with the misses of its
node that reach the loop with it). --readers threads stand for the readers and the fast path's
thread: each takes every --readers-th position, opens its sample (an open event with the
next handle, as the C thread gives it), reads it from the bytes the cache holds for the fast
path (a read event: READ | READ_END, and a crc32 of the bytes, without the GIL, for the
copy), waiting for them where a fetch thread is to hand them over (as the fast path keeps
such a read: FastPath.expect), or, when none are held or to come, through the core's read
(on the loop, the events before it applied first, as fs.Operations does), and releases it
(a release event). The events reach
the loop in batches, as the fast path hands them over: from fastpath.BATCH of them, and at
the latest every fastpath.DELAY_US (the fast path: that long after the first). The figure is the loop thread's CPU (CLOCK_THREAD_CPUTIME_ID) from the
order's commit to the last release applied, per sample; the fetches' worker threads and the
readers are not in it. Prints one JSON line (and appends it to --results): the median of
--passes passes (each a fresh core and order) and every pass's figure, with the fetched
samples and the reads that reached the loop; and the share of the loop's CPU each of its
tasks took in one more pass (trio's Instrument around every task step, which adds a clock
read each side: shares, not us), the rest being trio's scheduler and its waits for I/O:

  deliveries   the worker threads' groups handed over (fetch.Inbox: Batch.arrived, the
               cache's put_many) and the fetches' ends
  read-ahead   Prefetcher.run: the plan's walk with its reservations (and evictions), the
               batches submitted (their hand-off to a worker thread) and their claims
  fetches      each batch's task, in versions that ran one (its hand-off to a worker thread
               and its results), and the tasks of retries waiting their backoff
  events       the fast path's opens, reads and releases applied (Core.answered: the uses)
  loop reads   reads of samples not yet held, answered on the loop (Core.read)

With --remote, each request's reads come in the fewest groups, as a remote node's round trips
make them (1, 1, 2, 4, ... reads a group: each group one hand-on to the loop's inbox), where
reads from the page cache come in one or two groups a request.

With --opcodes, one more pass runs under sys.settrace and the row gains the Python opcodes
the loop thread ran in fusefs/'s modules per sample, in all and by module: a count that this
VM's noise does not move (docs/HOTPATH.md, "Per sample on the loop").

usage: .venv/bin/python scripts/bench/fetch_cost.py PACKED [--cache 0.1 1.2] [--passes 5] [--readers 4] [--without-order]
                                                     [--remote] [--opcodes]
       (PACKED: e.g. out/bench_hotpath/packed-2000, which bench_hotpath.py --quick makes: 2,000
       files of ~110 KB; its chunk files are read into the page cache first)
"""
from __future__ import annotations

import argparse
import collections
import functools
import inspect
import json
import os
import statistics
import sys
import threading
import time
import zlib

import numpy as np
import trio

from common import JsonLines, warm_chunks

from fusefs import fastpath
from fusefs import order as orderfmt
from fusefs.config import MountConfig
from fusefs.core import Core
from fusefs import handles
from fusefs.handles import READ, READ_END, RELEASED, SID_BITS, SERIAL_WRAP

MISSED = getattr(handles, "MISSED", 0)  # (older versions: misses go to the loop)
from fusefs.index import INDEX_NAME, Index
from fusefs.store import ChunkStore


class FastPathStandIn:
    """The fast path's table and events, kept in Python: the cache's mirror (hold), what the
    fetch threads hand it (hold_many, hand_many) and the samples they will (expect: a reader of
    one waits for it, as the fast path keeps such a read), and the events the reader threads make,
    handed to Core.answered on the loop."""

    def __init__(self):
        self.held: dict[int, bytes] = {}
        self.expected: set[int] = set()
        self.handed: dict[int, bytes] = {}
        self.arrived = threading.Condition()
        self.lock = threading.Lock()
        self.events: list[int] = []
        self.serial = 0
        self.token = None
        self.wake = None      # trio.Event the loop waits on (set from a reader thread)
        self.waking = False

    def hold(self, sid: int, data) -> None:
        with self.arrived:
            if data is None:
                self.held.pop(sid, None)
            else:
                self.held[sid] = data
            if sid in self.expected:
                self.expected.discard(sid)
                self.arrived.notify_all()

    def hold_many(self, items) -> None:  # (a fetch thread)
        with self.arrived:
            for sid, data in items:
                self.held[sid] = data if type(data) is bytes else None
                self.expected.discard(sid)
            self.arrived.notify_all()

    def hand_many(self, items) -> None:  # (a fetch thread) bytes for readers that wait, not held
        with self.arrived:
            for sid, data in items:
                if sid in self.expected and type(data) is bytes:
                    self.handed[sid] = data
                    self.expected.discard(sid)
            self.arrived.notify_all()

    def expect(self, sids) -> None:  # (the loop)
        with self.arrived:
            self.expected.update(s for s in sids if s not in self.held)

    def miss(self, sid: int):  # (a reader thread) as the fast path keeps a miss: told at once
        with self.arrived:
            if sid in self.held:
                return self.held[sid]
            told = sid not in self.expected
            self.expected.add(sid)
        if told:
            self.event(READ | MISSED | sid, now=True)
        return self.wait(sid)

    def wait(self, sid: int):  # (a reader thread) its bytes once held, None if not to come
        with self.arrived:
            while sid in self.expected:
                self.arrived.wait()
            return self.handed.pop(sid, None) or self.held.get(sid)

    def event(self, e: int, now: bool = False) -> None:  # (a reader thread)
        with self.lock:
            self.events.append(e)
            due = (now or len(self.events) >= fastpath.BATCH) and not self.waking
            if due:
                self.waking = True
        if due:
            self.token.run_sync_soon(self.wake.set)

    def open(self, sid: int) -> int:  # (a reader thread)
        with self.lock:
            self.serial = (self.serial + 1) % SERIAL_WRAP
            fh = (self.serial << SID_BITS) | sid
        self.event(fh)
        return fh

    def take(self) -> list[int]:
        with self.lock:
            ev, self.events, self.waking = self.events, [], False
        return ev


# the loop's tasks by what they do (a task's name: its function's qualified name)
TASKS = (("deliveries", "run_sync_soon"), ("read-ahead", "Prefetcher.run"),
         ("fetches", "_run_batch"), ("fetches", "fetch_batch"), ("fetches", "Batch._retry"), ("events", "events"),
         ("loop reads", "loop_read"))


class TaskCpu(trio.abc.Instrument):
    """The loop thread's CPU seconds by kind of task (TASKS; "other" for the rest)."""

    def __init__(self):
        self.seconds = collections.Counter()
        self._t = 0.0

    def before_task_step(self, task) -> None:
        self._t = time.thread_time()

    def after_task_step(self, task) -> None:
        kind = next((k for k, part in TASKS if part in task.name), "other")
        self.seconds[kind] += time.thread_time() - self._t


async def one_pass(index: Index, store: ChunkStore, cache_bytes: int, order: np.ndarray,
                   readers: int, hinted: bool = True) -> dict:
    fp = FastPathStandIn()
    table = {"table": fp} if "table" in inspect.signature(Core).parameters else {}  # (older versions: none)
    core = Core(index, store, MountConfig(cache_bytes=cache_bytes), hold=fp.hold, **table)
    fp.serial = core.handles.serial
    fp.token, fp.wake = trio.lowlevel.current_trio_token(), trio.Event()
    done = trio.Event()
    sizes = index.size
    loop_reads = 0

    def catch_up():
        ev = fp.take()
        if ev:
            core.answered(ev)

    async def loop_read(fh: int, size: int) -> bytes:
        nonlocal loop_reads
        loop_reads += 1
        catch_up()
        return await core.read(fh, 0, size)

    def reader(k: int) -> None:
        for sid in order[k::readers].tolist():
            fh = fp.open(sid)
            data, missed = fp.held.get(sid), 0
            if data is None and table:
                data = fp.wait(sid)
            if data is None and table and MISSED:
                data, missed = fp.miss(sid), MISSED
            if data is not None:
                zlib.crc32(data)
                fp.event(READ | READ_END | missed | sid)
            else:
                data = trio.from_thread.run(loop_read, fh, int(sizes[sid]), trio_token=fp.token)
                zlib.crc32(data)
            fp.event(RELEASED | fh)

    async def events():
        while True:
            with trio.move_on_after(fastpath.DELAY_US / 1e6):
                await fp.wake.wait()
            fp.wake = trio.Event()
            catch_up()
            if done.is_set() and not fp.events:
                return

    async with trio.open_nursery() as outer:
        await outer.start(core.run)
        t0 = time.thread_time()
        if hinted:
            await core.commit_order(0, orderfmt.encode(order, epoch=0))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(events)

            async def readers_done():
                async with trio.open_nursery() as threads:
                    for k in range(readers):
                        threads.start_soon(trio.to_thread.run_sync, reader, k)
                done.set()
                fp.wake.set()
            nursery.start_soon(readers_done)
        cpu = time.thread_time() - t0
        outer.cancel_scope.cancel()
    s = core.statistics()
    return {"cpu_s": cpu, "fetched": s["backend_samples"], "loop_reads": loop_reads,
            "releases": s["releases"], "requests": s["backend_requests"]}


def opcodes(fn, *args):
    """(fn(*args), {module: opcodes}): the Python opcodes this thread ran in fusefs/'s
    modules while fn ran, counted under sys.settrace."""
    import fusefs
    here, counts = os.path.dirname(os.path.abspath(fusefs.__file__)) + os.sep, collections.Counter()

    def tracer(frame, event, arg):
        frame.f_trace_opcodes = True
        if event == "opcode" and frame.f_code.co_filename.startswith(here):
            counts[os.path.basename(frame.f_code.co_filename)] += 1
        return tracer

    sys.settrace(tracer)
    try:
        return fn(*args), counts
    finally:
        sys.settrace(None)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("packed")
    p.add_argument("--cache", type=float, nargs="+", default=[0.1, 1.2],
                   help="the cache's budget, a share of the set, one run each (0.1 1.2: as small_fill's and chunks')")
    p.add_argument("--passes", type=int, default=5)
    p.add_argument("--readers", type=int, default=4)
    p.add_argument("--without-order", action="store_true",
                   help="each cache share once more without an order: the readers read in a random "
                        "order the core is not told (every sample a miss on the loop, as with a "
                        "loader that hands over no order)")
    p.add_argument("--remote", action="store_true",
                   help="each request's reads in the fewest groups (1, 1, 2, 4, ... reads: "
                        "store.GROUP_S 0), as a remote node's round trips make them; the reads "
                        "are still the page cache's")
    p.add_argument("--opcodes", action="store_true",
                   help="one more pass under sys.settrace: the Python opcodes the loop ran in fusefs/ "
                        "per sample, in all and by module")
    JsonLines.argument(p, "fetch_cost")  # (--results -: print only, as bench_hotpath.py's guard does)
    a = p.parse_args()
    if a.remote:
        ChunkStore.read_batch = functools.partialmethod(ChunkStore.read_batch, group_s=0.0)
    index = Index.load(os.path.join(a.packed, INDEX_NAME))
    store = ChunkStore(a.packed, index)
    warm_chunks(a.packed)  # (the chunks' reads are the page cache's: the loop's cost alone)
    results = JsonLines(a.results) if a.results != "-" else None
    rng = np.random.default_rng(0)
    n = index.n_files
    settings = [(share, True) for share in a.cache]
    settings += [(share, False) for share in a.cache] if a.without_order else []
    for share, hinted in settings:
        budget = int(index.total_bytes * share)
        runs = [trio.run(one_pass, index, store, budget, rng.permutation(n), a.readers, hinted)
                for _ in range(a.passes)]
        tasks = TaskCpu()
        traced = trio.run(one_pass, index, store, budget, rng.permutation(n), a.readers, hinted,
                          instruments=[tasks])
        for r in runs + [traced]:
            assert r["releases"] == n, r
        us = [round(1e6 * r["cpu_s"] / n, 1) for r in runs]
        shares = {k: round(tasks.seconds[k] / traced["cpu_s"], 3)
                  for k in ("deliveries", "read-ahead", "fetches", "events", "loop reads", "other")}
        shares["scheduler"] = round(1 - sum(shares.values()), 3)
        row = {"bench": "fetch_cost", "cache_share": share, "samples": n, "order": hinted,
               **({"remote": True} if a.remote else {}),
               "sample_bytes": int(index.total_bytes // max(1, n)),
               "loop_cpu_us_per_sample": statistics.median(us), "passes_us_per_sample": us,
               "fetched": [r["fetched"] for r in runs], "loop_reads": [r["loop_reads"] for r in runs],
               "requests": [r["requests"] for r in runs],
               "task_shares": shares}
        if a.opcodes:
            traced, counts = opcodes(trio.run, one_pass, index, store, budget, rng.permutation(n), a.readers, hinted)
            assert traced["releases"] == n, traced
            row["loop_opcodes_per_sample"] = round(sum(counts.values()) / n)
            row["loop_opcodes_by_module"] = {k: round(v / n) for k, v in counts.most_common()}
        print(json.dumps(row), flush=True)
        if results is not None:
            results.write(**row)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
