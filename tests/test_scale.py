"""No per-sample cost grows with the data set, the queue or the cache (issue 54, item 0):
each per-sample operation is run at two sizes a hundred times apart and its cost counted in
bytecode instructions (sys.settrace's opcode events: what Python does, never the clock);
the C it calls (dicts, numpy, fusefs's cores) is O(1) or O(log n) by construction. The whole at
ImageNet's count is scripts/bench/bench_scale.py (and bench_hotpath.py's `scale` row)."""
import gc
import sys

import numpy as np

from fusefs import order as orderfmt
from fusefs.cache import SampleCache
from fusefs.policy import Policy



def opcodes(fn, *args) -> int:
    """The bytecode instructions fn(*args) runs, its Python callees' included. (The garbage
    collector is held meanwhile: a collection in the middle runs other tests' finalizers,
    whose bytecode would count too.)"""
    count = [0]

    def trace(frame, event, arg):
        frame.f_trace_opcodes = True
        if event == "opcode":
            count[0] += 1
        return trace
    gc.collect()
    gc.disable()
    sys.settrace(trace)
    try:
        fn(*args)
    finally:
        sys.settrace(None)
        gc.enable()
    return count[0]


class NoScans(np.ndarray):
    """An array whose whole may not be worked on (np.flatnonzero, sum, ...): only single
    elements are read or set."""

    def __array_function__(self, func, types, args, kwargs):
        raise AssertionError(f"np.{func.__name__} over every sample")


def test_a_miss_takes_its_companions_in_the_same_work_whatever_the_queue():
    """ReadAheadPlan.take_queued, for a sample in the middle of its node's queue: the same
    bytecode with 1,000 samples queued as with 100,000 (it copied the queue, before: 41%
    of the daemon's time at 1.28M samples), the queue a linked list in C (Queues: a
    sample's unlink O(1)) over a set of 100,000 samples."""
    from types import SimpleNamespace
    from fusefs._plancore import Queues
    from fusefs.prefetch import ReadAheadPlan
    n, batch = 100_000, 16
    chunk, chunk_node = np.zeros(n, np.uint32), np.zeros(1, np.int32)
    costs = []
    for queued in (1_000, 100_000):
        plan = ReadAheadPlan.__new__(ReadAheadPlan)  # (only what take_queued reads)
        plan.queued = Queues(bytearray(n), chunk, chunk_node, np.ones(n, np.uint64), 1)
        plan.batch, plan.index, plan._chunk_node_v = batch, SimpleNamespace(chunk_v=memoryview(chunk)), chunk_node
        plan.queued.push_many(range(queued), queued)
        taken = []
        costs.append(opcodes(lambda: taken.extend(plan.take_queued(queued // 2))))
        assert taken == [queued // 2, *range(batch - 1)]  # (it and the queue's head)
        assert len(plan.queued) == queued - batch and queued // 2 not in plan.queued
    assert costs[0] == costs[1], costs


def test_an_eviction_costs_the_same_whatever_the_cache_holds():
    """SampleCache.put that makes room by evicting the entry needed furthest ahead: the
    same bytecode with 1,000 entries cached as with 100,000 (a heap: O(log n) in C)."""
    costs = []
    for n in (1_000, 100_000):
        cache = SampleCache(budget=n * (100 + 1024), entry_overhead=1024)
        for sid in range(n):
            assert cache.put(sid, bytes(100), key=float(sid))
        costs.append(opcodes(cache.put, n, bytes(100), -1.0))
        assert n in cache and n - 1 not in cache and cache.evictions == 1
    assert costs[0] == costs[1], costs


def test_a_use_and_a_key_cost_the_same_whatever_the_order_length():
    """Policy.use (a reader closed a sample: its plan counts it, the cursor moves on),
    Plan.use_many (a batch of the fast path's releases: the same, with each one's next use)
    and Policy.key (when a sample is needed next) with orders of 10,000 and of 1,000,000
    entries: the same bytecode."""
    costs = []
    for n in (10_000, 1_000_000):
        policy = Policy(np.full(n, 1000, np.uint64))
        ids = np.random.default_rng(0).permutation(n)
        policy.set_order(0, orderfmt.parse(orderfmt.encode(ids, next_follows=True) + orderfmt.encode(ids[::-1]), n))
        for sid in ids[:100].tolist():
            policy.use(sid)
        at = int(ids[100])
        costs.append((opcodes(policy.use, at), opcodes(policy.single.use_many, ids[101:117].tolist()),
                      opcodes(policy.key, int(ids[n // 2]))))
    assert costs[0] == costs[1], costs


def test_a_local_tier_eviction_costs_the_same_whatever_it_holds(tmp_path):
    """LocalTier._make_room (a write that needs room): the same bytecode holding 1,000
    samples as 100,000, and no numpy work over every sample (it scanned them all, before)."""
    import collections
    from fusefs.local import LocalTier
    costs = []
    for n in (1_000, 100_000):
        index = collections.namedtuple("Index", "n_files size")(n, np.full(n, 100, np.uint64))
        tier = LocalTier(str(tmp_path / f"tier{n}"), budget=n * 100, index=index)
        try:
            tier.held[:] = 100
            tier.used, tier._nheld = n * 100, n
            tier.set_priorities(np.arange(n, dtype=np.float64))
            tier._unlink = lambda sid: None  # (no files: only the bookkeeping is counted)
            with tier._mutex:
                tier._make_room(100, 1e9)  # (the first after new priorities rebuilds the heap)
                tier.held = tier.held.view(NoScans)  # (numpy's work is not bytecode: none at all)
                costs.append(opcodes(tier._make_room, 100, 1e9))
            assert tier.evicted == 2 and tier.held[0] == tier.held[1] == 0 and tier.held[2] == 100
        finally:
            tier.close()
    assert costs[0] == costs[1], costs


def test_the_eviction_heap_holds_one_item_an_entry_through_rekeys_and_puts():
    """Every use re-keys its cached sample: the indexed heap moves its item, so however many
    re-keys and puts come, it holds one item an entry, nothing stale (its memory is what each
    entry's overhead counts, cache.ENTRY_OVERHEAD)."""
    n = 5_000
    cache = SampleCache(budget=1 << 30)
    for sid in range(n):
        cache.put(sid, b"x", key=float(sid))
    for step in range(20 * n):  # re-keys only
        cache.rekey(step % n, float(n + step))
        assert cache.heap_items == n
    for sid in range(n, 3 * n):  # puts, with re-keys between
        cache.put(sid, b"x", key=float(sid))
        cache.rekey(sid - n, float(5 * n + sid))
        assert cache.heap_items == len(cache) == sid + 1
    assert sorted(cache._dump()[0]) == list(range(3 * n))  # (nothing evicted: the budget holds all)


def test_a_scan_of_events_costs_the_events_it_counts_not_the_batch():
    """Core.answered counts a batch of the fast path's events in C (fusefs._eventscore.scan)
    and calls again after each forget: a call from `start` costs the events it counts, not
    the batch before them. (The batch was copied whole into a list of ints at every call, so
    a batch with forgets among its reads cost its length times its forgets: under a loader
    that drops the kernel's caches each epoch, whose forgets come between the reads, the
    loop's CPU a sample doubled.) What one call allocates is counted (tracemalloc, never the
    clock) at two batch sizes a hundred times apart, the batch in the fast path's form
    (native 64-bit values, FastPath.catch_up)."""
    import tracemalloc

    from fusefs import _eventscore
    from fusefs.handles import EVENT_LAYOUT, FORGOTTEN, READ, READ_END

    held = np.zeros(16, np.uint8)

    def scan_near_the_end(n: int):
        events = np.full(n, READ | READ_END | 3, np.uint64)  # (reads of sample 3 to its end)
        events[-2] = FORGOTTEN | 5
        batch = memoryview(events.tobytes()).cast("Q")
        tracemalloc.start()
        try:
            out = _eventscore.scan(batch, n - 3, held, True, EVENT_LAYOUT)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert out[0] == n - 2 and out[2] == 1 and out[8] == [3]  # (stopped at the forget)
        return peak

    small, large = scan_near_the_end(1_000), scan_near_the_end(100_000)
    assert large <= small + 1024, (small, large)
