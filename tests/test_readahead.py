"""The order-driven read-ahead, per-node batching and evict-after-use cache, on the core
(no mount): readers run as trio tasks against Core with its prefetcher running."""
import os
import threading
import time

from functools import partial

import numpy as np
import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from fusefs import order as orderfmt
from fusefs.config import MountConfig
from fusefs.core import Core
from fusefs.index import INDEX_NAME, Index
from fusefs.prefetch import default_readahead
from fusefs.store import ChunkStore
from fusefs.entries import FsError

from conftest import exact_within_budget, make_core, read_whole, run_epoch, serving, settled, whole_set


@given(data=st.data())
@settings(max_examples=25, deadline=None)
def test_budget_never_exceeded_and_bytes_exact(three_nodes, data):
    dst, files = three_nodes
    core_probe = make_core(dst)
    n, sizes = core_probe.index.n_files, core_probe.index.size
    ids = data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=400))
    budget = data.draw(st.integers(int(sizes.max()), int(sizes.sum())))
    core = make_core(dst, cache_bytes=budget, batch=data.draw(st.integers(1, 16)))
    trio.run(run_epoch, core, ids, 3, 8, 0, exact_within_budget(core, files))
    assert core.cache.peak <= budget
    s = core.statistics()
    assert s["eio"] == 0
    # everything read was used for the last time: no order needs any cached entry again
    assert all(core.next_use(i) is None for i in set(ids))
    cache = core.cache
    entries, keys = cache._dump()[:2]
    assert all(k == float("inf") for k in keys.values())
    assert cache.used == sum(cache.cost(len(v)) for v in entries.values())  # the running total
    assert cache.reserved == 0


def test_a_tenth_of_the_data_serves_every_read_of_readers_slower_than_the_backend(three_nodes):
    """With a cache of a tenth of the set and readers that give the read-ahead time to do
    all it would before each read (settled), every read is served from the cache: the
    read-ahead keeps what the order needs next, 16 positions of the readers' interleaving
    included. (How many reads wait when readers are faster is a benchmark's figure.)"""
    dst, files = three_nodes
    probe = make_core(dst)
    ids = np.random.default_rng(0).permutation(probe.index.n_files).tolist()
    core = make_core(dst, cache_bytes=int(probe.index.total_bytes * 0.1), batch=8)
    trio.run(partial(run_epoch, core, ids, 3, 16, settle=True))
    s = core.statistics()
    assert s["hits"] == len(ids) and s["read_waits"] == s["misses"] == 0, s
    assert s["backend_samples"] == len(ids), s        # each sample fetched exactly once
    assert s["cache_peak"] <= s["cache_budget"]


class GateStore(ChunkStore):
    """Reads wait while `gate` is clear (a read-ahead that started but has not finished)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, native=False, **kw)  # (reads in Python, through read_range)
        self.gate = threading.Event()
        self.gate.set()

    def read_range(self, k, offset, length):
        self.gate.wait(60)
        return super().read_range(k, offset, length)


def test_cached_samples_needed_late_do_not_stall_the_read_ahead(three_nodes):
    """An order that reads X twice leaves the cache full of X after X's first pass; the
    next order needs X only at its end. Those entries must give way to the read-ahead, not
    stall it into a miss per read: the moment the new order is set (its read-ahead planned
    and dispatched, no fetch finished yet), the read-ahead has room for the new order's
    head, its whole depth, taken from X's entries."""
    dst, _ = three_nodes
    ix = Index.load(os.path.join(dst, INDEX_NAME))
    n = ix.n_files
    ids = np.random.default_rng(1).permutation(n)
    budget = int(ix.total_bytes * 0.1)
    x_len = int(np.searchsorted(np.cumsum(ix.size[ids]), budget))  # X fills the cache
    x, rest = ids[:x_len].tolist(), ids[x_len:].tolist()
    store = GateStore(dst, ix)
    core = Core(ix, store, MountConfig.of(cache_bytes=budget, batch=8))
    read_ahead_all(core, x + x)  # X read ahead and kept for its second use: no room left
    held_x = sum(sid in core.cache for sid in x)
    assert core.cache.free < int(ix.size.max()) + core.cache.overhead and held_x > 0
    store.gate.clear()
    state = {}

    async def main():
        async with trio.open_nursery() as nursery:
            await nursery.start(core.run)
            core.set_order(0, orderfmt.encode(rest + x))  # plans and dispatches at once
            claimed = [s for s in rest if s in core.fetcher.inflight or s in core.prefetcher.queued]
            state.update(claimed=claimed, x_left=sum(sid in core.cache for sid in x))
            store.gate.set()
            nursery.cancel_scope.cancel()
    trio.run(main)
    head = rest[:len(state["claimed"])]
    assert state["claimed"] == head, "the read-ahead skipped part of the new order's head"
    room = sum(core.cache.cost(int(ix.size[s])) for s in head)  # (what their reservations take)
    # the read-ahead's depth, or the whole budget, to within one sample: not stalled by X
    least = min(core.prefetcher.readahead, budget) - core.cache.cost(int(ix.size.max()))
    assert room >= least, (room, least)
    assert state["x_left"] < held_x  # X's entries, needed late, made the room
    assert core.cache.peak <= budget


def test_the_default_read_ahead_refills_every_slot_with_a_full_batch(three_nodes, monkeypatch):
    """The heads move on once readers have used half the read-ahead; by default that is
    room for a full batch on every request slot of every node, so requests carry full
    batches, not halves (with this budget, a read-ahead of one batch per slot gave 2.0-2.3
    samples per request, batches of 4; two give 3.0-3.3, and fewer readers miss). Checked
    at the two moments that decide it, with the reads held at a gate (no thread timing):
    the batches an order's start dispatches, and those of the first refill once a reader
    has used a refill's worth of the order. (Batches of 4 samples: fetch.BATCH_BYTES and
    READAHEAD_BYTES, which make a request of this set's small samples hold ~50-64, are set
    aside.)"""
    from fusefs import fetch
    monkeypatch.setattr(fetch, "BATCH_BYTES", 0)
    monkeypatch.setattr(fetch, "READAHEAD_BYTES", 0)
    dst, _ = three_nodes
    ix = Index.load(os.path.join(dst, INDEX_NAME))
    for seed in range(3):
        ids = np.random.default_rng(seed).permutation(ix.n_files).tolist()
        store = GateStore(dst, ix)
        # (a budget whose sixteenth is less than a batch per slot, and whose quarter holds
        # two: the floor sets the depth)
        core = Core(ix, store, MountConfig.of(cache_bytes=int(ix.total_bytes * 0.7), batch=4, per_node=2))
        slots = 2 * len(core.fetcher.node_names)
        full = 4 * slots * ix.total_bytes / ix.n_files  # a batch per slot
        assert core.prefetcher.low_water >= full - 1  # (a refill's worth, rounded down)
        sizes = {"start": [], "between": [], "refill": []}
        moment = ["start"]
        claim = core.fetcher.claim

        def counted(batch):  # (a batch is claimed as it is dealt, in one call of dispatch)
            sizes[moment[0]].append(len(batch))
            return claim(batch)
        core.fetcher.claim = counted

        async def main():
            async with trio.open_nursery() as nursery:
                await nursery.start(core.run)
                core.set_order(0, orderfmt.encode(ids))  # the start's batches, dispatched at once
                moment[0] = "between"
                with trio.fail_after(60):
                    # (the gate is open: they finish, and the batches dealt as they do too;
                    # polling the in-flight set alone could find it empty between the two)
                    await settled(core)
                    store.gate.clear()  # the refill's reads wait: its batches stay as dealt
                    moment[0] = "refill"
                    used, k = 0, 0
                    while used < core.prefetcher.low_water:
                        await read_whole(core, ids[k])
                        used, k = used + int(ix.size[ids[k]]), k + 1
                    while not sizes["refill"]:  # (the read-ahead's task deals them all at once)
                        await trio.sleep(0.005)
                store.gate.set()
                nursery.cancel_scope.cancel()
        trio.run(main)
        batch, start, refill = core.fetcher.batch, sizes["start"], sizes["refill"]
        # (a batch takes whole runs of one chunk's samples: some 5 and some 3, a full 4 on average)
        assert batch == 4 and len(start) >= slots and sum(start) >= batch * len(start), start
        # (a node's queue is dealt over its slots: some get a few less)
        assert len(refill) >= slots and sum(refill) >= 0.65 * batch * len(refill), (seed, refill)


def test_the_default_read_ahead_stays_within_a_quarter_of_a_small_budget():
    """Two batches per slot, but not past a quarter of the budget (a deeper read-ahead in
    a small cache evicts what the orders need again: 11% more backend bytes in
    bench_importance's synthetic set), and never less than one batch per slot, nor more
    than the budget (test_hints' echo test shows why)."""
    mb = 1 << 20
    assert default_readahead(1600 * mb, 48, mb) == 100 * mb   # a sixteenth of a large budget
    assert default_readahead(400 * mb, 48, mb) == 96 * mb     # two batches per slot
    assert default_readahead(160 * mb, 48, mb) == 48 * mb     # ... if within a quarter
    assert default_readahead(100 * mb, 48, mb) == 48 * mb     # one batch per slot at least
    assert default_readahead(240 * mb, 48, mb) == 60 * mb     # between: the quarter
    assert default_readahead(30 * mb, 48, mb) == 30 * mb      # never past the budget


def test_the_read_ahead_runs_ahead_of_the_furthest_reader(three_nodes):
    """DataLoader's workers read several batches of the order at once (4 workers with 2
    batches each in flight: positions up to 512 apart), so the readers' cursor (the first
    position not yet read) lags the furthest one read. The read-ahead looks `readahead`
    bytes past the furthest, not past the cursor: the leading worker would otherwise outrun
    it and wait for fetches of its own (bench_order's setting c: 3x the waits)."""
    dst, _ = three_nodes
    probe = make_core(dst)
    order = np.random.default_rng(5).permutation(probe.index.n_files).tolist()
    sizes = probe.index.size
    # the head stops at the first position with more than readahead bytes between the
    # furthest reader and it: 30..40 are within
    readahead = int(sizes[order[30:40]].sum())
    core = make_core(dst, cache_bytes=whole_set(probe.index), readahead=readahead)
    core.set_order(0, orderfmt.encode(order))  # (no nursery: nothing is dispatched)
    plan = core.policy.plans[0]
    for pos in [*range(0, 5), *range(25, 30)]:  # one reader at position 5, one at 30
        plan.use(order[pos])
    assert (plan.cursor, plan.frontier) == (5, 30)
    core.prefetcher.advance()
    queued = core.prefetcher.queued
    assert all(order[pos] in queued for pos in [*range(5, 25), *range(30, 41)])
    assert not any(order[pos] in queued for pos in [*range(0, 5), *range(25, 30), *range(41, 60)])


def test_batches_are_per_node_and_coalesced(three_nodes):
    dst, _ = three_nodes
    probe = make_core(dst)
    # chunk order: neighbours in a chunk are read together
    ids = list(range(probe.index.n_files))
    core = make_core(dst, cache_bytes=whole_set(probe.index), batch=10)
    batches = []
    real_read = core.fetcher._read

    def recording(sids, *a):
        batches.append(list(sids))
        return real_read(sids, *a)
    core.fetcher._read = recording
    trio.run(run_epoch, core, ids)
    nodes = core.statistics()["nodes"]
    assert set(nodes) == {"node-0", "node-1", "node-2"}
    node_of = core.fetcher.node_of
    assert batches and all(len({node_of(s) for s in b}) == 1 for b in batches)  # one node a request
    assert max(len(b) for b in batches) > 1
    on_node = np.bincount([node_of(s) for s in ids], minlength=3)
    for n in range(3):  # (each node counted exactly its own samples)
        st_ = nodes[f"node-{n}"]
        assert st_["requests"] > 0 and st_["samples"] == on_node[n] > 0
        assert st_["reads"] < st_["samples"]  # several samples per read


def test_a_batch_asks_for_all_its_reads_before_it_makes_them(three_nodes, monkeypatch):
    """willneed: read_batch hands the kernel every read but the first (posix_fadvise
    WILLNEED, exact ranges) before it reads them one after the other, so the backend's
    client can fetch them concurrently; the bytes are the same either way."""
    dst, files = three_nodes
    ix = Index.load(os.path.join(dst, INDEX_NAME))
    events = []
    real = os.posix_fadvise

    def fadvise(fd, off, length, advice):
        events.append(("advise", off, length, advice))
        real(fd, off, length, advice)
    monkeypatch.setattr(os, "posix_fadvise", fadvise)

    class Recording(ChunkStore):
        def read_range(self, k, offset, length):
            events.append(("read", offset, length, None))
            return super().read_range(k, offset, length)

    sids = [int(np.flatnonzero(ix.chunk == k)[3]) for k in (7, 2, 11, 5, 20)]  # one per chunk
    for willneed in (True, False):
        events.clear()
        got, nreads, _ = Recording(dst, ix, willneed=willneed, native=False).read_batch(sids)
        assert nreads == len(sids)
        assert all(got[s] == files[os.fsdecode(ix.file_path(s))] for s in sids)
        reads = [(off, length) for kind, off, length, _ in events if kind == "read"]
        assert reads == [(int(ix.offset[s]), int(ix.size[s])) for s in sids]  # in the order asked
        if willneed:
            assert events[:len(sids) - 1] == [("advise", off, length, os.POSIX_FADV_WILLNEED)
                                              for off, length in reads[1:]]
            assert len(events) == 2 * len(sids) - 1
        else:
            assert all(kind == "read" for kind, *_ in events)


class SlowStore(ChunkStore):
    """Each read takes `delay` seconds; `done` lists the chunks of the reads finished."""

    def __init__(self, *a, delay=0.05, **kw):
        super().__init__(*a, native=False, **kw)  # (reads in Python, through read_range)
        self.delay, self.done = delay, []

    def read_range(self, k, offset, length):
        time.sleep(self.delay)
        data = super().read_range(k, offset, length)
        self.done.append(k)
        return data


@pytest.mark.parametrize("runs", [1, 2])
def test_each_sample_reaches_its_reader_when_its_own_read_is_done(three_nodes, runs):
    """A batch reads its samples in the order's order and delivers them in groups of 1, 1,
    2, 4, ... reads (ChunkStore.read_batch; reads of 50 ms each use up GROUP_S): the reader of a node's i-th sample has it
    after at most about 2i reads on that node, the first two after one and two reads, not
    after the whole batch of k (one request at a time per node here). Also in a second
    trio run of the same core (the results' inbox belongs to the run: one bound to a
    finished run dropped every early delivery). The node's reads and bytes are counted as
    the samples arrive, not when the batch ends: a sample its reader has is counted."""
    dst, _ = three_nodes
    ix = Index.load(os.path.join(dst, INDEX_NAME))
    store = SlowStore(dst, ix)
    core = Core(ix, store, MountConfig.of(cache_bytes=whole_set(ix), per_node=1, batch=8))
    if runs == 2:  # a first run with another order fetches a few samples
        first = np.random.default_rng(9).permutation(ix.n_files).tolist()[:4]
        read_ahead_all(core, first)
        store.done.clear()
    order = [s for s in np.random.default_rng(3).permutation(ix.n_files).tolist()
             if s not in core.cache]
    node = core.fetcher.node_of(order[0])
    mine = [s for s in order if core.fetcher.node_of(s) == node][:8]  # its first batch
    reads_done = []  # reads finished on the node when each of `mine` reached its reader
    counted = []  # the node's reads and bytes in its statistics then

    async def main():
        async with trio.open_nursery() as n:
            await n.start(core.run)
            core.set_order(0, orderfmt.encode(order))
            while not core.fetcher.inflight:  # the read-ahead has started
                await trio.sleep(0.001)
            for sid in mine:
                await read_whole(core, sid)
                reads_done.append(sum(core.fetcher.chunk_node[k] == node for k in store.done))
                counted.append((core.fetcher.nodes[node].stats.reads, core.fetcher.nodes[node].stats.bytes))
            n.cancel_scope.cancel()
    trio.run(main)
    assert core.statistics()["misses"] == 0
    # (a read may hold two neighbours, and one more may finish before the reader wakes)
    assert all(r <= 2 * i + 2 for i, r in enumerate(reads_done)), reads_done
    assert reads_done[0] <= 2 and reads_done[1] <= 3, reads_done
    assert reads_done[0] >= 1 and reads_done[-1] >= 6  # (8 reads, or fewer coalesced)
    for i, (nreads, nbytes) in enumerate(counted):
        assert 1 <= nreads and nbytes >= sum(int(ix.size[s]) for s in mine[:i + 1]), counted


def read_ahead_all(core, order):
    """Run the daemon core with this order until its read-ahead has fetched everything."""
    async def main():
        async with trio.open_nursery() as n:
            await n.start(core.run)
            core.set_order(0, orderfmt.encode(order))
            with trio.fail_after(20):
                await trio.sleep(0.01)
                while core.fetcher.inflight or any(core.prefetcher.queues):
                    await trio.sleep(0.01)
            n.cancel_scope.cancel()
    trio.run(main)


class PeakStore(SlowStore):
    """SlowStore that records the most reads in flight at once per node."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.lock, self.now, self.peak, self.node_of_chunk = threading.Lock(), {}, {}, None

    def read_range(self, k, offset, length):
        node = int(self.node_of_chunk[k])
        with self.lock:
            self.now[node] = self.now.get(node, 0) + 1
            self.peak[node] = max(self.peak.get(node, 0), self.now[node])
        try:
            return super().read_range(k, offset, length)
        finally:
            with self.lock:
                self.now[node] -= 1


def test_a_node_with_all_the_work_borrows_the_idle_nodes_slots(three_nodes):
    """An order whose samples all lie on one node: that node runs up to 2 x per_node
    requests at once (its own slots and the idle ones of the others), never more; an
    order over every node keeps each within that bound too."""
    dst, _ = three_nodes
    ix = Index.load(os.path.join(dst, INDEX_NAME))
    for order_nodes, want in (({0}, 4), ({0, 1, 2}, None)):
        store = PeakStore(dst, ix, delay=0.02)
        core = Core(ix, store, MountConfig.of(cache_bytes=whole_set(ix), per_node=2, batch=2,
                    readahead=ix.total_bytes))
        store.node_of_chunk = core.fetcher.chunk_node
        order = [s for s in np.random.default_rng(5).permutation(ix.n_files).tolist()
                 if core.fetcher.node_of(s) in order_nodes][:60]
        read_ahead_all(core, order)
        assert core.statistics()["backend_samples"] == len(order)
        assert max(store.peak.values()) <= 4
        if want is not None:
            assert store.peak == {0: want}


class PositionStore(ChunkStore):
    """Records when each sample reached the event loop within its request: 0 with the
    request's first read, 1 with its second, 2 with its third and fourth... (a request
    reads one after the other and delivers groups of 1, 1, 2, 4... reads: without a time
    budget, as when every read takes longer than ChunkStore's GROUP_S)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.position = {}

    def read_batch(self, sids, max_gap=256 << 10, on_read=None, **kw):
        count = [0]

        def seen(got, nreads, nbytes):
            for sid in got:
                self.position[sid] = count[0]
            count[0] += 1
            if on_read is not None:
                on_read(got, nreads, nbytes)
        return super().read_batch(sids, max_gap, seen, **dict(kw, group_s=0))


class FirstAloneStore(ChunkStore):
    """Records, for each batch, its first sample and whether its first read came alone."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.batches = []

    def read_batch(self, sids, max_gap=256 << 10, on_read=None, **kw):
        self.batches.append((sids[0], kw.get("first_alone", False)))
        return super().read_batch(sids, max_gap, on_read, **kw)


def test_a_miss_has_its_first_read_alone_and_the_read_ahead_does_not(three_nodes):
    """A reader that missed waits for its sample, the first of its batch: that read is a
    group of its own (ChunkStore.read_batch's first_alone); batches of the read-ahead,
    which no reader waits for as they start, come in as few groups as the time allows."""
    dst, _ = three_nodes
    ix = Index.load(os.path.join(dst, INDEX_NAME))
    store = FirstAloneStore(dst, ix)
    core = Core(ix, store, MountConfig.of(cache_bytes=whole_set(ix), batch=8, readahead=ix.total_bytes))
    order = np.random.default_rng(6).permutation(ix.n_files).tolist()

    async def main():
        async with trio.open_nursery() as n:
            await n.start(core.run)
            assert await read_whole(core, 5) == store.read_sample(5)  # no order: a miss
            core.set_order(0, orderfmt.encode(order))
            with trio.fail_after(20):
                while core.statistics()["backend_samples"] < ix.n_files:
                    await trio.sleep(0.01)
            n.cancel_scope.cancel()
    trio.run(main)
    assert store.batches[0] == (5, True)
    assert len(store.batches) > 3 and not any(alone for _, alone in store.batches[1:])


def test_an_order_start_is_dealt_over_the_free_slots(three_nodes):
    """At an order's start every slot is free: the head of each node's queue is dealt
    round robin over them, so its i-th sample is about the (i / per_node)-th read of its
    request, not the i-th; and a queue shorter than the slots' batches is spread thin, so
    every slot reads (here 8 samples on one node: a request each, with 8 slots as
    the other nodes lend theirs)."""
    dst, _ = three_nodes
    ix = Index.load(os.path.join(dst, INDEX_NAME))
    store = PositionStore(dst, ix)
    core = Core(ix, store, MountConfig.of(cache_bytes=whole_set(ix), per_node=4, batch=16))
    order = np.random.default_rng(7).permutation(ix.n_files).tolist()
    read_ahead_all(core, order)
    for node in range(3):
        head = [s for s in order if core.fetcher.node_of(s) == node][:16]
        assert all(store.position[s] <= i // 4 for i, s in enumerate(head)), [store.position[s] for s in head]
    store = PositionStore(dst, ix)
    core = Core(ix, store, MountConfig.of(cache_bytes=whole_set(ix), per_node=4, batch=16))
    order = [s for s in order if core.fetcher.node_of(s) == 0][:8]
    read_ahead_all(core, order)
    assert core.statistics()["backend_samples"] == 8
    assert [store.position[s] for s in order] == [0] * 8
    # a request per run: samples of one chunk next to each other in the queue are one run
    runs = 1 + sum(ix.chunk[a] != ix.chunk[b] for a, b in zip(order, order[1:]))
    assert core.fetcher.nodes[0].stats.requests == runs >= 6


def test_a_dispatched_sample_is_in_flight_before_its_batch_task_runs(three_nodes):
    """Samples leave the queue and are claimed in one step, so a reader that comes before
    the batch's task has run waits for that fetch instead of missing (and fetching the
    sample again in a request of its own)."""
    dst, _ = three_nodes
    probe = make_core(dst)
    total = probe.index.total_bytes
    core = make_core(dst, cache_bytes=whole_set(probe.index), batch=8, readahead=total)
    order = np.random.default_rng(4).permutation(core.index.n_files).tolist()

    async def main():
        async with trio.open_nursery() as n:
            await n.start(core.run)
            core.set_order(0, orderfmt.encode(order))
            core.prefetcher.schedule()  # queue and dispatch, with no checkpoint after it
            started = sum(core.prefetcher.running)
            assert started >= 3 and all(s in core.prefetcher.queued or s in core.fetcher.inflight
                                        for s in order)
            n.cancel_scope.cancel()
    trio.run(main)


def test_duplicates_survive_until_their_last_use(three_nodes):
    dst, files = three_nodes
    probe = make_core(dst)
    ids = [5, 6, 5, 7, 8, 9, 6]
    core = make_core(dst, cache_bytes=whole_set(probe.index))
    trio.run(run_epoch, core, ids, 1, 1)
    s = core.statistics()
    assert s["misses"] + s["read_waits"] + s["hits"] == 7
    # each distinct sample fetched once: the second reads of 5 and 6 came from the cache
    assert s["backend_samples"] == len(set(ids)) and s["hits"] >= 2


def test_bad_order_is_refused_and_the_old_one_stays(three_nodes):
    dst, _ = three_nodes
    core = make_core(dst)
    core.set_order(0, orderfmt.encode([1, 2, 3], epoch=4))
    with pytest.raises(FsError) as e:
        core.set_order(0, orderfmt.encode([1, 10_000]))
    assert e.value.errno == 22 and "unknown sample id" in str(e.value)
    assert core.plans[0].epoch == 4 and core.plans[0].ids.tolist() == [1, 2, 3]
    assert core.statistics()["orders_refused"] == 1


def test_new_order_mid_epoch_replaces_the_old(three_nodes):
    dst, files = three_nodes
    probe = make_core(dst)
    n = probe.index.n_files
    core = make_core(dst, cache_bytes=probe.index.total_bytes // 5)

    async def go():
        async with trio.open_nursery() as nursery:
            await nursery.start(core.run)
            core.set_order(0, orderfmt.encode(list(range(n)), epoch=0))
            for sid in range(20):
                await read_whole(core, sid)
            core.set_order(0, orderfmt.encode(list(range(n - 1, -1, -1)), epoch=1))
            # the new plan's first samples are read ahead; the old plan's are not kept
            window = core.plans[0].window(core.cache.budget).tolist()
            assert window[0] == n - 1
            with trio.fail_after(20):
                while (n - 1) not in core.cache and (n - 1) not in core.fetcher.inflight:
                    await trio.sleep(0.001)
            nursery.cancel_scope.cancel()
    trio.run(go)
    assert core.cache.peak <= core.cache.budget



def test_every_backend_request_holds_one_storage_nodes_samples(three_nodes):
    """A fetch batch (a miss with its companions, or a read-ahead batch) is one node's
    samples: each backend request goes to one node, and the per-node statistics charge each
    sample to its own node (a batch of mixed nodes was charged to its first sample's)."""
    dst, files = three_nodes
    probe = make_core(dst)
    ids = np.random.default_rng(3).permutation(probe.index.n_files).tolist()
    core = make_core(dst, cache_bytes=int(probe.index.total_bytes * 0.2), batch=8)
    node_of = core.fetcher.node_of
    batches = []
    real = core.store.read_batch

    def recording(sids, *args, **kw):
        batches.append(list(sids))
        return real(sids, *args, **kw)
    core.store.read_batch = recording
    trio.run(run_epoch, core, ids, 3, 16, 0, exact_within_budget(core, files))
    assert batches and all(len({node_of(s) for s in b}) == 1 for b in batches), \
        [sorted({node_of(s) for s in b}) for b in batches if len({node_of(s) for s in b}) > 1][:3]
    fetched = {}
    for b in batches:
        for s in b:
            fetched[node_of(s)] = fetched.get(node_of(s), 0) + 1
    stats = core.statistics()["nodes"]
    assert {core.fetcher.node_names.index(name): s["samples"] for name, s in stats.items()} == fetched


def test_the_core_tells_when_the_read_ahead_is_idle_and_applies_uses_before_an_order(three_nodes):
    """Core's idle callback (the fast path's FastPath.idle) hears True once the read-ahead
    has covered its order (here at once: its depth holds the whole set), False as a new
    order comes and True again once that is covered, and nothing while that stays so;
    catch_up (FastPath.catch_up: the readers' uses that wait) runs before an order from
    the control socket is in force."""
    dst, files = three_nodes
    ix = Index.load(os.path.join(dst, INDEX_NAME))
    told, caught = [], []
    core = Core(ix, ChunkStore(dst, ix), MountConfig.of(cache_bytes=2 * ix.total_bytes),
                idle=told.append, catch_up=lambda: caught.append(dict(core.plans)))
    n = ix.n_files

    async def go():
        async with serving(core):
            await core.commit_order(0, orderfmt.encode(list(range(n)), epoch=0))
            assert caught == [{}] and told == [True]  # (caught up before the order)
            await settled(core)
            for sid in range(n):
                assert await read_whole(core, sid) == files[os.fsdecode(ix.file_path(sid))]
            core.prefetcher.wake()
            await settled(core)
            assert told == [True] and core.statistics()["backend_samples"] == n
            first = core.plans[0]
            await core.commit_order(0, orderfmt.encode(list(range(n - 1, -1, -1)), epoch=1))
            assert len(caught) == 2 and caught[1][0] is first  # (before the new one)
            assert told == [True, False, True]
    trio.run(go)


def test_a_large_group_of_fetched_samples_is_kept_as_each_alone_would_be(three_nodes):
    """Arrivals.deliver_many keys a group of at least KEYS_AT_ONCE samples in one call
    (Policy.keys_of): what the cache keeps, and at which keys, is what delivering each alone
    gives (the missed sample's key counts its reader's use; an error is not kept)."""
    from fusefs.policy import KEYS_AT_ONCE
    from fusefs.store import CorruptSample
    dst, files = three_nodes
    cores = [make_core(dst, cache_bytes=make_core(dst).index.total_bytes // 3) for _ in range(2)]
    ix = cores[0].index
    order = np.random.default_rng(5).permutation(ix.n_files)
    group = order[::-3][:KEYS_AT_ONCE + 8].tolist()
    items = [(s, files[os.fsdecode(ix.file_path(s))]) for s in group]
    items[7] = (items[7][0], CorruptSample("chunk", "sample", "bad bytes"))
    missed = group[3]
    for core in cores:
        core.set_order(0, orderfmt.encode(order.tolist() + order[:40].tolist(), epoch=0))
        for s in order[:25].tolist():
            core.use(s)
    unkept = cores[0].arrivals.deliver_many(items, {missed})
    for s, r in items:
        cores[1].arrivals.deliver(s, r, missed=s == missed)
    a, b = cores[0].cache, cores[1].cache
    (a_entries, a_keys), (b_entries, b_keys) = a._dump()[:2], b._dump()[:2]
    assert a_keys == b_keys and a_entries.keys() == b_entries.keys() and len(a) > KEYS_AT_ONCE
    assert a.used == b.used and items[7][0] not in a and missed in a
    assert a_keys[missed] == cores[0].policy.key_after_use(missed) != cores[0].policy.key(missed)
    # (what it says it may not have kept: the failed one, the missed one, any refused)
    assert {items[7][0], missed} <= set(unkept)
    assert all(s in a for s, _ in items if s not in unkept)


def test_readers_that_lag_each_other_past_the_skip_window_widen_it_and_stop_missing(three_nodes):
    """Two readers of one order (with the next epoch's), one on the even positions, the
    other on the odd ones 40 positions behind, with a skip window of 8 and a cache of a
    quarter of the set: the leader's uses pass the laggard's occurrences as skipped, which
    keys them as needed next epoch. The laggard's first late use widens the window past
    the lag, so the samples passed before are the only ones the cache may let go of before
    their read (here 15 misses, 16 late uses); with the window fixed at 8, 145
    occurrences were passed, the full cache let go of their samples, and 96 reads missed."""
    dst, _ = three_nodes
    probe = make_core(dst)
    n, lag = probe.index.n_files, 40
    ids = np.random.default_rng(3).permutation(n).tolist()
    core = make_core(dst, cache_bytes=int(probe.index.total_bytes * 0.25), batch=8)

    async def go():
        async with serving(core):
            core.set_order(0, orderfmt.encode(ids, epoch=0, next_follows=True) + orderfmt.encode(ids[::-1], epoch=1))
            plan = core.plans[0]
            plan.skip_window = 8
            for i in range(0, n + lag, 2):
                for pos in (i, i - lag + 1):  # (the leader, then the laggard)
                    if 0 <= pos < n:
                        await settled(core)
                        await read_whole(core, ids[pos])
            return plan

    plan = trio.run(go)
    s = core.statistics()
    assert s["evictions"] > 0 and s["cache_peak"] <= s["cache_budget"]
    assert plan.skip_window >= 2 * lag and 0 < plan.late <= lag // 2, (plan.skip_window, plan.late)
    # (a read that found its sample gone: one of those passed before the window widened)
    assert s["misses"] <= plan.late and s["read_waits"] == 0, s


def test_samples_the_cursor_passes_unused_are_keyed_by_their_next_use(three_nodes):
    """Readers far apart (further than the plan's skip window): the cursor passes the
    occurrences the slow reader has not used yet and counts them as skipped. Their cached
    entries are keyed by their next use from then on, so they can be evicted as any other
    entry; they kept the passed position before, looked needed sooner than anything ahead,
    and with independent readers a whole epoch apart filled the cache (every read then
    missed: ImageNet's count, the page cache dropped mid-epoch)."""
    dst, _ = three_nodes
    core = make_core(dst)
    n = core.index.n_files
    order = list(range(n))
    core.set_order(0, orderfmt.encode(order, epoch=0, next_follows=True) + orderfmt.encode(order[::-1], epoch=1))
    plan = core.plans[0]
    plan.skip_window = 4
    for s in order[:8]:
        assert core.cache.put(s, b"x", key=core.policy.key(s))
    core.use(order[10])  # (the fast reader, 10 positions ahead: the cursor passes 0-6)
    passed = order[:10 - plan.skip_window + 1]
    assert plan.cursor == len(passed) and plan.skipped == len(passed) and plan.passed == []
    keys = core.cache._dump()[1]
    for s in order[:8]:
        assert keys[s] == core.policy.key(s), s
    assert all(keys[s] >= n for s in passed)  # (next needed in the next epoch)
    core.use(order[0])  # (the slow reader's late use counts for nothing, and keys nothing)
    assert core.cache._dump()[1][order[0]] == core.policy.key(order[0]) >= n
