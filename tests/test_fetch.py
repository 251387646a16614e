"""The fetcher's record of the samples in flight (fetch.InFlight) and a batch's settling of
each of them (fetch.Batch), with a real chunk store and trio's worker threads, no mount."""
import functools
import os
import shutil

import numpy as np
import pytest
import trio

from fusefs.cache import SampleCache
from fusefs.config import MountConfig
from fusefs.fetch import Fetcher, FetchCancelled, InFlight, Placement
from fusefs.index import INDEX_NAME, Index
from fusefs.store import ChunkStore, CorruptSample


def test_in_flight_claims_each_sample_once_and_wakes_only_its_waiters():
    inflight = InFlight(10)
    assert inflight.claim([3, 1, 3, 7]) == [3, 1, 7] and len(inflight) == 3
    assert inflight.claim([1, 2, 7]) == [2] and len(inflight) == 4
    assert 2 in inflight and 5 not in inflight
    assert inflight.waiter(5) is None  # (not in flight: nothing to wait for)
    w3, w7 = inflight.waiter(3), inflight.waiter(7)
    assert inflight.waiter(3) is w3 and not w3.done
    inflight.settle_many([(1, b"one"), (3, b"three")])
    assert w3.done and w3.data == b"three" and w3.error is None
    assert 3 not in inflight and 1 not in inflight and len(inflight) == 2
    error = OSError(5, "backend read failed")
    inflight.settle(7, error)
    assert w7.done and w7.error is error and w7.data is None
    inflight.settle(7, b"late")  # (not in flight any more: nothing changes)
    assert w7.error is error and len(inflight) == 1
    inflight.settle(2, b"two")  # (no waiter: none made)
    assert not inflight and inflight.claim([3, 2]) == [3, 2]
    assert inflight.waiter(3) is not w3  # (a new fetch, a new waiter)
    assert inflight.claim(np.array([9, 4, 9])) == [9, 4] and len(inflight) == 4  # (numpy's ints too)
    with pytest.raises(IndexError):
        inflight.claim([5, 10])  # (one is not a sample: none is claimed)
    assert 5 not in inflight and len(inflight) == 4


def test_a_cache_names_the_samples_of_a_batch_that_hold_a_reservation():
    """SampleCache.reserved_among: the set of a batch's samples with a reservation (the
    read-ahead's, which the fast path is handed in the fetch thread), in one call."""
    cache = SampleCache(1000, entry_overhead=0, samples=10)
    assert cache.reserve_many([2, 5, 7], [100, 100, 100], [1.0, 2.0, 3.0]) == 3
    cache.settle(5)
    assert cache.reserved_among([1, 2, 5, 7, 7]) == {2, 7}
    assert cache.reserved_among([]) == set()
    with pytest.raises(ValueError):
        cache.reserved_among([-1])


def test_a_read_ahead_request_holds_more_samples_than_a_miss_but_tiny_ones_as_before():
    """Requests: --batch samples, or as many as make 1 MiB where samples are smaller; a
    read-ahead request up to 64 samples while they make at most 4 MiB (each request costs
    the loop about as much as ten samples do), never fewer than the others' and never more
    than 64 where 1 MiB already holds more (tiny samples: as many as before)."""
    from fusefs.config import FetchConfig
    from fusefs.fetch import batch_size

    class Sizes:  # (an index's figures that batch_size reads)
        def __init__(self, mean):
            self.n_files, self.total_bytes = 1000, 1000 * mean
    config = FetchConfig()
    for mean, miss, readahead in ((1_750, 599, 599), (20_000, 52, 64), (110_000, 16, 38),
                                  (300_000, 16, 16), (4 << 20, 16, 16)):
        assert batch_size(config, Sizes(mean)) == miss, mean
        assert batch_size(config, Sizes(mean), readahead=True) == readahead, mean
    assert batch_size(FetchConfig(batch=100), Sizes(110_000), readahead=True) == 100


class Sink:
    """What the arrivals would be told: every sample, once each, and the batches' ends."""

    def __init__(self):
        self.items, self.over = [], trio.Event()

    def arrived(self, items, missed, served):
        self.items += items

    def ended(self, node, readahead):
        self.over.set()

    def waits(self):
        return False


@pytest.mark.parametrize("corrupt", [False, True])
def test_a_batch_settles_each_of_its_samples_once_and_leaves_none_in_flight(three_nodes, tmp_path, corrupt):
    """A batch of one node's samples, some claimed before it is submitted, one of them already
    in flight elsewhere: the batch fetches the others, each sample reaches the sink once with
    its bytes (a corrupt one with CorruptSample, which its waiter gets too), the waiters on the
    loop are woken, and nothing stays in flight; the sample in flight elsewhere is left alone."""
    dst, files = three_nodes
    if corrupt:  # (a copy: the fixture is shared)
        dst = shutil.copytree(dst, tmp_path / "dst")
    ix = Index.load(os.path.join(dst, INDEX_NAME))
    store, placement = ChunkStore(str(dst), ix), Placement(ix)
    sids = [s for s in range(ix.n_files) if placement.node_of(s) == 0][:12]
    bad = sids[5]
    if corrupt:  # (a byte of the sample's stored bytes flipped)
        path = store.chunk_path(int(ix.chunk[bad]))
        with open(path, "r+b") as f:
            f.seek(int(ix.offset[bad]))
            byte = f.read(1)
            f.seek(int(ix.offset[bad]))
            f.write(bytes([byte[0] ^ 0xFF]))
    sink, inflight = Sink(), InFlight(ix.n_files)
    fetcher = Fetcher(store, MountConfig.of(batch=16).fetch, sink=sink, placement=placement,
                      inflight=inflight)
    elsewhere = sids[7]
    waited = {}

    async def main():
        async with trio.open_nursery() as nursery:
            await nursery.start(fetcher.run, nursery)
            assert inflight.claim([elsewhere]) == [elsewhere]
            claimed = fetcher.claim(sids[:4])
            assert claimed == sids[:4]
            assert inflight.waiter(sids[-1]) is None  # (not claimed yet)
            assert fetcher.submit(sids, claimed)
            assert len(inflight) == len(sids)
            for s in (sids[0], bad, sids[-1]):  # (before any arrival reaches the loop)
                waited[s] = inflight.waiter(s)
            with trio.fail_after(30):
                await sink.over.wait()
                for p in waited.values():
                    await p.wait()
            nursery.cancel_scope.cancel()
    trio.run(main)
    delivered = [sid for sid, _ in sink.items]
    assert sorted(delivered) == sorted(s for s in sids if s != elsewhere)  # (each once)
    for sid, r in sink.items:
        if corrupt and sid == bad:
            assert isinstance(r, CorruptSample)
        else:
            assert bytes(r) == files[os.fsdecode(ix.file_path(sid))]
    assert [s for s, f in enumerate(inflight.flags) if f] == [elsewhere] and len(inflight) == 1
    for s, p in waited.items():
        if corrupt and s == bad:
            assert isinstance(p.error, CorruptSample) and p.data is None
        else:
            assert p.error is None and p.data == files[os.fsdecode(ix.file_path(s))]
    stats = fetcher.nodes[0].stats
    assert stats.samples == len(sids) - 1 - corrupt and stats.failed_samples == corrupt


def test_a_batch_cut_short_wakes_its_waiters_with_an_error(three_nodes):
    """The fetcher's end (a shutdown) ends every batch not yet ended: what was not settled
    goes out of flight with FetchCancelled, to its waiters and the sink."""
    dst, _ = three_nodes
    ix = Index.load(os.path.join(dst, INDEX_NAME))
    placement = Placement(ix)
    sink, inflight = Sink(), InFlight(ix.n_files)
    fetcher = Fetcher(ChunkStore(dst, ix), MountConfig.of().fetch, sink=sink, placement=placement,
                      inflight=inflight)
    sids = [s for s in range(ix.n_files) if placement.node_of(s) == 1][:5]

    async def main():
        async with trio.open_nursery() as nursery:
            await nursery.start(fetcher.run, nursery)
            fetcher.threads[1] = fetcher.max_per_node  # (no thread for the node: it waits)
            assert fetcher.submit(sids)
            waiter = inflight.waiter(sids[2])
            nursery.cancel_scope.cancel()
        return waiter
    waiter = trio.run(main)
    assert waiter.done and isinstance(waiter.error, FetchCancelled)
    assert not inflight and sorted(s for s, _ in sink.items) == sorted(sids)
    assert all(isinstance(r, FetchCancelled) for _, r in sink.items)


class Calls(Sink):
    """Sink, and each arrived call's samples."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def arrived(self, items, missed, served):
        super().arrived(items, missed, served)
        self.calls.append([sid for sid, _ in items])


@pytest.mark.parametrize("kind", ["readahead", "waited", "missed", "parked"])
def test_a_read_ahead_try_reaches_the_loop_once_unless_a_reader_waits_there(three_nodes, monkeypatch, kind):
    """A try's groups of reads (here one read each, in the fewest groups: 1, 1, 2, 4, 4) reach
    the loop as one arrival at the try's end where nothing on the loop waits for them (the
    read-ahead's: the fast path's readers have their bytes from the thread), and group by
    group where a reader on the loop waits for a sample in flight, a read waits in the fast
    path for an arrival (the sink's waits: parked), or a reader missed one."""
    from fusefs.store import ChunkStore as Store
    monkeypatch.setattr(Store, "read_batch", functools.partialmethod(Store.read_batch, group_s=0.0))
    dst, files = three_nodes
    ix = Index.load(os.path.join(dst, INDEX_NAME))
    placement = Placement(ix)
    sids = [s for s in range(ix.n_files) if placement.node_of(s) == 0][:24:2]  # (none adjacent)
    sink, inflight = Calls(), InFlight(ix.n_files)
    if kind == "parked":
        sink.waits = lambda: True
    fetcher = Fetcher(ChunkStore(str(dst), ix), MountConfig.of().fetch, sink=sink, placement=placement,
                      inflight=inflight, max_gap=0)

    async def main():
        async with trio.open_nursery() as nursery:
            await nursery.start(fetcher.run, nursery)
            claimed = fetcher.claim(sids)
            waiter = inflight.waiter(sids[-1]) if kind == "waited" else None  # (before any read)
            assert fetcher.submit(sids, claimed, readahead=kind != "missed",
                                  missed={sids[0]} if kind == "missed" else ())
            with trio.fail_after(30):
                await sink.over.wait()
                if waiter is not None:
                    await waiter.wait()
            nursery.cancel_scope.cancel()
    trio.run(main)
    assert sorted(sum(sink.calls, [])) == sorted(sids)
    assert all(bytes(r) == files[os.fsdecode(ix.file_path(s))] for s, r in sink.items)
    assert fetcher.nodes[0].stats.reads == len(sids) and fetcher.nodes[0].stats.samples == len(sids)
    if kind == "readahead":
        assert len(sink.calls) == 1, sink.calls
    else:
        assert len(sink.calls) >= 4, sink.calls  # (a call a group)


@pytest.mark.parametrize("published", [True, False])
def test_a_read_ahead_try_published_to_the_fast_path_is_read_in_one_group(three_nodes, monkeypatch,
                                                                          published):
    """A read-ahead try whose samples the compiled reads publish to the fast path as each read
    is checked (Batch.whole: their readers need no group's end) makes every read in one call
    of C, one group, where reads otherwise come in groups (here forced to the fewest: 1, 1, 2,
    4, 4); without publishing it keeps its groups. Either way each sample arrives once."""
    from fusefs import pyfuse3
    from fusefs.fetch import Batch
    from fusefs.store import ChunkStore as Store
    monkeypatch.setattr(Store, "read_batch", functools.partialmethod(Store.read_batch, group_s=0.0))
    groups = []
    on_read = Batch.on_read
    monkeypatch.setattr(Batch, "on_read", lambda b, got, *a, **kw: (groups.append(sorted(got)),
                                                                     on_read(b, got, *a, **kw)))
    dst, files = three_nodes
    ix = Index.load(os.path.join(dst, INDEX_NAME))
    placement = Placement(ix)
    sids = [s for s in range(ix.n_files) if placement.node_of(s) == 0][:24:2]  # (none adjacent)
    sink = Calls()
    fetcher = Fetcher(ChunkStore(str(dst), ix), MountConfig.of().fetch, sink=sink, placement=placement,
                      inflight=InFlight(ix.n_files), max_gap=0)
    publish = pyfuse3.fast_path_publish_api() if published else None

    async def main():
        async with trio.open_nursery() as nursery:
            await nursery.start(fetcher.run, nursery)
            assert fetcher.submit(sids, fetcher.claim(sids), serve=lambda items: None, served=set(sids),
                                  hand=lambda items: None, publish=publish, readahead=True)
            with trio.fail_after(30):
                await sink.over.wait()
            nursery.cancel_scope.cancel()
    trio.run(main)
    assert sorted(sum(sink.calls, [])) == sorted(sids) and sorted(sum(groups, [])) == sorted(sids)
    assert all(bytes(r) == files[os.fsdecode(ix.file_path(s))] for s, r in sink.items)
    assert len(groups) == 1 if published else len(groups) >= 4, groups
