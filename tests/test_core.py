"""The filesystem core, called directly (no mount)."""
import errno
import os

import pytest
import trio

from fusefs.config import MountConfig
from fusefs.core import Core
from fusefs.namespace import ROOT
from fusefs.entries import FsError
from fusefs.index import INDEX_NAME, Index
from fusefs.store import ChunkStore
from testkit.mounts import resolve

from conftest import Kernel, corrupt_sample, serving


def _core(dst, *, local=None, kernel=None, hold=None, table=None, **config):
    ix = Index.load(os.path.join(dst, INDEX_NAME))
    return Core(ix, ChunkStore(dst, ix), MountConfig.of(**config), local=local, kernel=kernel, hold=hold,
                table=table)


async def read_sample(core, sid, off=0, size=1 << 20):
    fh = core.open(core.file_base + sid, os.O_RDONLY).fh
    try:
        return await core.read(fh, off, size)
    finally:
        core.release(fh)


def _walk(core, ino=ROOT, prefix=""):
    for name, attr, _ in core.readdir(ino, 0):
        rel = prefix + os.fsdecode(name)
        if attr.mode & 0o040000:
            yield rel + "/", attr
            yield from _walk(core, attr.ino, rel + "/")
        else:
            yield rel, attr


def test_tree_and_reads_match_the_source(tricky):
    src, dst, files = tricky
    core = _core(dst)
    seen = dict(_walk(core))
    expect = {k for k in files} | {os.path.dirname(k.rstrip("/")) + "/" for k in files if "/" in k.rstrip("/")}
    expect |= {"cat/deep/", "cat/deep/er/"}
    assert set(seen) == expect
    assert ".fusefs/" not in seen

    async def check():
        async with serving(core):
            for rel, attr in seen.items():
                if rel.endswith("/"):
                    continue
                assert attr.size == len(files[rel])
                fh = core.open(attr.ino, os.O_RDONLY).fh
                data = files[rel]
                for off, size in [(0, 131072), (1, 7), (len(data) - 3, 100), (len(data) + 5, 10)]:
                    assert await core.read(fh, max(off, 0), size) == data[max(off, 0):max(off, 0) + size]
                core.release(fh)
    trio.run(check)
    s = core.statistics()
    regular = [v for k, v in files.items() if not k.endswith("/")]
    # every non-empty file fetched, none twice (read-ahead may also fetch empty ones)
    assert sum(1 for v in regular if v) <= s["backend_samples"] <= len(regular)
    assert s["backend_reads"] < s["backend_samples"]  # the scan read ahead within chunks
    assert s["hits"] > 0


def test_lookup_errors_and_read_only(tricky):
    core = _core(tricky[1])
    with pytest.raises(FsError) as e:
        core.lookup(ROOT, b"missing")
    assert e.value.errno == errno.ENOENT
    cat = core.lookup(ROOT, b"cat")
    f = core.lookup(cat.ino, b"img 000.jpg")
    with pytest.raises(FsError) as e:
        core.lookup(f.ino, b"x")
    assert e.value.errno == errno.ENOTDIR
    for flags in (os.O_WRONLY, os.O_RDWR, os.O_RDONLY | os.O_TRUNC):
        with pytest.raises(FsError) as e:
            core.open(f.ino, flags)
        assert e.value.errno == errno.EROFS


def test_control_namespace_is_hidden_but_reachable(tricky):
    core = _core(tricky[1])
    names = [n for n, _, _ in core.readdir(ROOT, 0)]
    assert b".fusefs" not in names
    ctrl = core.lookup(ROOT, b".fusefs")
    stats = core.lookup(ctrl.ino, b"stats")
    assert sorted(n for n, _, _ in core.readdir(ctrl.ino, 0)) == [b"chunks", b"ids", b"metrics", b"order", b"stats"]
    fh = core.open(stats.ino, os.O_RDONLY).fh
    text = trio.run(core.read, fh, 0, 1 << 20)
    assert b'"opens"' in text and b'"backend_bytes"' in text
    core.release(fh)
    assert core.control.open_handles == 0
    with pytest.raises(FsError) as e:
        core.open(stats.ino, os.O_WRONLY)
    assert e.value.errno == errno.EROFS  # (orders come over the control socket)


def test_corrupt_sample_is_eio_and_the_rest_is_served(tricky, tmp_path, caplog):
    src, dst, files = tricky
    copy = tmp_path / "dst"
    ix, victim, chunk_path = corrupt_sample(dst, copy, "dog/img 004.jpg")
    core = _core(str(copy))

    async def go():
        async with serving(core):
            with pytest.raises(FsError) as e:
                await read_sample(core, victim, 0, 4096)
            assert e.value.errno == errno.EIO
            other = resolve(ix, "dog/img 005.jpg")[1]
            assert await read_sample(core, other) == files["dog/img 005.jpg"]
    trio.run(go)
    assert core.statistics()["eio"] == 1
    line = [r.getMessage() for r in caplog.records if "EIO" in r.getMessage()]
    assert line and str(chunk_path) in line[0] and "dog/img 004.jpg" in line[0]


def test_a_fetch_whose_worker_thread_fails_is_logged_and_tried_again(tricky, caplog):
    """A bug in a batch's blocking call (not a backend error: those come back as results)
    comes back from its worker thread to the loop (fetch.in_thread): one log line with its
    traceback, and the batch is tried again as after a failed read, so its reader gets the
    sample."""
    src, dst, files = tricky
    core = _core(dst)
    store, calls = core.store, []
    read_batch = store.read_batch

    def failing_once(*args, **kw):
        calls.append(args[0])
        if len(calls) == 1:
            raise RuntimeError("a bug in the reads")
        return read_batch(*args, **kw)

    store.read_batch = failing_once
    sid = resolve(core.index, "dog/img 005.jpg")[1]

    async def go():
        async with serving(core):
            assert await read_sample(core, sid) == files["dog/img 005.jpg"]
    trio.run(go)
    assert calls == [[sid], [sid]]
    bug = [r for r in caplog.records if "fetch of 1 samples from node" in r.getMessage()]
    assert len(bug) == 1 and "a bug in the reads" in str(bug[0].exc_info[1])
    assert core.statistics()["backend_retries"] == 1


def test_concurrent_readers_of_one_sample_share_one_fetch(tricky):
    core = _core(tricky[1])
    sid = resolve(core.index, "cat/img 004.jpg")[1]

    async def go():
        async with serving(core):
            async with trio.open_nursery() as n:
                for _ in range(8):
                    n.start_soon(read_sample, core, sid, 0, 10)
    trio.run(go)
    s = core.statistics()
    assert s["backend_samples"] == 1 and s["read_waits"] == 7


def test_misses_that_reach_the_loop_together_go_out_in_one_request_per_node(three_nodes):
    """Readers without an order that miss samples of one node in the same turn of the loop
    (no two of one chunk, so no scan's companions): one backend request for the node brings
    them all, each reader gets its own bytes. A miss that comes later goes out in a request
    of its own."""
    dst, files = three_nodes
    core = _core(dst, cache_bytes=1 << 30, batch=16)
    ix, node_of = core.index, core.fetcher.node_of
    node = node_of(0)
    picks, chunks = [], set()
    for sid in range(ix.n_files):
        if node_of(sid) == node and int(ix.chunk[sid]) not in chunks:
            picks.append(sid)
            chunks.add(int(ix.chunk[sid]))
    picks, late = picks[:6], picks[6]
    assert len(picks) == 6
    got = {}

    async def read(sid):
        got[sid] = await read_sample(core, sid)

    async def go():
        async with serving(core):
            async with trio.open_nursery() as n:
                for sid in picks:
                    n.start_soon(read, sid)
            await read(late)
    trio.run(go)
    for sid in picks + [late]:
        assert got[sid] == files[os.fsdecode(ix.file_path(sid))]
    stats = core.statistics()
    assert stats["misses"] == 7 and stats["read_waits"] == 0
    assert stats["nodes"][core.fetcher.node_names[node]]["requests"] == 2


def test_a_read_during_a_push_is_answered_from_the_pushed_bytes(tricky):
    """A push into the kernel page cache waits for a reader's read of that file, which the
    loop answers: from the bytes being pushed (a fetch could wait for the thread slot the
    push holds), not with a fetch, even when the cache did not keep the sample."""
    core = _core(tricky[1])
    sid = resolve(core.index, "cat/img 004.jpg")[1]
    data = core.store.read_sample(sid)
    assert sid not in core.cache and sid not in core.fetcher.inflight
    core.holders.pushing[sid] = data  # a worker thread is pushing it now

    async def go():
        async with serving(core):
            return await core.reads.fetch(sid)
    assert trio.run(go) == data
    s = core.statistics()
    assert s["misses"] == 0 and s["backend_samples"] == 0


@pytest.mark.parametrize("answered", [True, False], ids=["fast-path", "no-fast-path"])
def test_what_the_read_ahead_keeps_for_the_fast_path_is_read_through_not_pushed(three_nodes, answered):
    """Where the cache's samples are answered outside the loop (the fast path: `hold`), a
    sample the read-ahead fetches (its room reserved, so the cache keeps it) is not pushed
    into the kernel page cache: the fast path's answers to its reads leave its pages there.
    Any other fetched sample is pushed (a scan's companions), as every one is without the
    fast path; a sample a reader missed is not (its own reads bring its pages)."""
    from fusefs import order as orderfmt
    from conftest import settled
    dst, files = three_nodes
    kernel = Kernel()
    core = _core(dst, kernel=kernel, hold=(lambda sid, data: None) if answered else None,
                 cache_bytes=64 << 20)
    ix = core.index
    first, second = 0, 1
    assert ix.chunk[first] == ix.chunk[second]
    companions = [s for s in range(second + 1, min(second + core.fetcher.batch, ix.n_files))
                  if ix.chunk[s] == ix.chunk[second]]
    assert companions
    planned = [s for s in range(ix.n_files) if s not in (first, second, *companions)]

    async def go():
        async with serving(core):
            await read_sample(core, first)   # a miss, then a scan's next sample: a miss that
            await read_sample(core, second)  # takes the rest of the chunk along
            await settled(core)
            core.set_order(0, orderfmt.encode(planned, epoch=0))
            await settled(core)
    trio.run(go)
    assert all(s in core.cache for s in planned + companions)  # (all kept)
    pushed = [ino - core.file_base for ino in kernel.pushed]
    assert first not in pushed and second not in pushed  # (missed)
    assert sorted(pushed) == sorted(companions if answered else companions + planned)
    assert core.statistics()["pushed"] == len(pushed)


def test_the_read_aheads_samples_reach_the_fast_path_from_the_fetch_thread_and_only_what_is_kept_stays(three_nodes):
    """With the fast path, a read-ahead sample is handed to its table by the worker thread
    that fetched it, before the loop has it (Holders.serve_early); the loop's cache keeps it
    (its mirror holds it again), and what the cache does not keep, or evicts, leaves the
    table: through two epochs in a cache of a third of the set, the table holds exactly the
    cache's entries, each the sample's bytes."""
    import threading
    from fusefs import order as orderfmt
    from conftest import settled
    dst, files = three_nodes
    table, from_threads, lock = {}, set(), threading.Lock()
    loop_thread = []

    def hold(sid, data):
        with lock:
            if data is None:
                table.pop(sid, None)
            else:
                table[sid] = data
                if threading.get_ident() != loop_thread[0]:
                    from_threads.add(sid)

    core = _core(dst, hold=hold, cache_bytes=sum(len(v) for v in files.values()) // 3)
    ix = core.index
    order = list(range(ix.n_files))[::-1]

    async def go():
        loop_thread.append(threading.get_ident())
        async with serving(core):
            core.set_order(0, orderfmt.encode(order, epoch=0))
            for sid in order:  # (reads as the fast path's would: the uses move the plan on)
                await settled(core)
                assert await read_sample(core, sid) == files[os.fsdecode(ix.file_path(sid))]
            await settled(core)
    trio.run(go)
    assert len(from_threads) > len(order) // 2  # (most came from the fetch threads)
    assert table.keys() == core.cache._dump()[0].keys() and 0 < len(table) < ix.n_files
    assert all(table[s] is core.cache.get(s) or table[s] == core.cache.get(s) for s in table)


@pytest.mark.parametrize("room", [True, False], ids=["kept", "refused"])
def test_a_sample_served_early_that_the_cache_does_not_keep_leaves_the_fast_path(three_nodes, room):
    """A sample a fetch thread handed to the fast path (Holders.serve_early) stays there when
    the cache keeps it on arrival, and leaves when the cache refuses it (no room): the table
    never holds bytes the budget does not count."""
    dst, files = three_nodes
    table = {}
    core = _core(dst, hold=lambda sid, data: table.pop(sid, None) if data is None else table.update({sid: data}),
                 cache_bytes=(64 << 20) if room else 2048)
    ix = core.index
    sid = next(s for s in range(ix.n_files) if ix.size[s] > 4096)
    data = files[os.fsdecode(ix.file_path(sid))]
    core.holders.serve_early([(sid, data)])
    assert table == {sid: data}
    core.arrivals.arrived([(sid, data)], (), {sid})
    assert (sid in core.cache) == room and (sid in table) == room


class ExpectingTable:
    """The fast path's table as the fetch threads see it (FastPath: hold, hold_many, expect,
    hand_many): what is expected, held from a worker thread, or let go of."""

    def __init__(self, loop_thread: list):
        import threading
        self.lock, self.loop_thread = threading.Lock(), loop_thread
        self.held, self.waiting = {}, set()
        self.expected, self.from_threads, self.let_go = set(), set(), set()

    def hold(self, sid, data):  # (the cache's mirror, and unserve)
        with self.lock:
            if data is None:
                self.held.pop(sid, None)
                if sid in self.waiting:
                    self.let_go.add(sid)
            else:
                self.held[sid] = data
            self.waiting.discard(sid)

    def hold_many(self, items):
        import threading
        assert threading.get_ident() != self.loop_thread[0]
        with self.lock:
            for sid, data in items:
                self.held[sid] = data
                if sid in self.waiting:
                    self.from_threads.add(sid)
                self.waiting.discard(sid)

    def hand_many(self, items):  # (the reads of misses: none wait in this test)
        pass

    def expect(self, sids):
        import threading
        assert threading.get_ident() == self.loop_thread[0]
        with self.lock:
            assert not (set(sids) & self.held.keys())
            self.waiting.update(sids)
            self.expected.update(sids)


def test_every_sample_the_fast_path_is_told_to_expect_is_handed_to_it_or_let_go(three_nodes, tmp_path):
    """With the fast path, the read-ahead's samples that its fetch threads will hand over are
    expected as their batch starts (the fast path keeps their reads waiting: Holders.expect),
    and every one of them is then handed over by its worker thread or, where its fetch fails
    (a corrupt sample: EIO), let go of on the loop: through an epoch in a cache of a third of
    the set, none is left expected, and the corrupt one's reader gets EIO."""
    import threading
    from fusefs import order as orderfmt
    from conftest import settled
    dst, files = three_nodes
    ix, bad, _ = corrupt_sample(dst, tmp_path / "copy", next(iter(sorted(files))), at=5)
    loop_thread = []
    table = ExpectingTable(loop_thread)
    core = _core(tmp_path / "copy", hold=table.hold, table=table,
                 cache_bytes=sum(len(v) for v in files.values()) // 3)
    order = [bad] + [s for s in range(ix.n_files) if s != bad]

    async def go():
        loop_thread.append(threading.get_ident())
        async with serving(core):
            core.set_order(0, orderfmt.encode(order, epoch=0))
            for sid in order:
                await settled(core)
                if sid == bad:
                    with pytest.raises(FsError) as e:
                        await read_sample(core, sid)
                    assert e.value.errno == errno.EIO
                else:
                    assert await read_sample(core, sid) == files[os.fsdecode(ix.file_path(sid))]
            await settled(core)
    trio.run(go)
    assert not table.waiting
    assert bad in table.expected and bad in table.let_go
    assert table.expected == table.from_threads | table.let_go
    assert len(table.from_threads) > len(order) // 2


def test_misses_that_wait_in_the_fast_path_are_fetched_and_handed_over_by_the_fetch_thread(three_nodes, tmp_path):
    """Reads that wait in the fast path for samples it neither holds nor expects reach the
    core as events (READ | MISSED | sample, Core.answered): a sample no one fetches is
    fetched, and its worker thread hands its bytes over (Holders.hand_many: the reads are
    answered there, not on the loop); one the cache holds is handed over from the loop; a
    known corrupt one is let go of (its reads go to the loop: EIO). Each is counted once:
    a miss, a hit; the answer of a missed read (READ | MISSED | READ_END) is no hit."""
    import threading
    from fusefs.handles import MISSED, READ, READ_END
    from conftest import settled
    dst, files = three_nodes
    rels = sorted(files)
    ix, bad, _ = corrupt_sample(dst, tmp_path / "copy", rels[0], at=5)
    loop_thread, handed, lock = [], [], threading.Lock()
    table = ExpectingTable(loop_thread)

    def hand_many(items):
        with lock:
            handed.extend((sid, data, threading.get_ident() != loop_thread[0])
                          for sid, data in items if isinstance(data, bytes))
    table.hand_many = hand_many
    core = _core(tmp_path / "copy", hold=table.hold, table=table)
    assert core.fast_path_args()["missed"] == MISSED
    name = lambda sid: os.fsdecode(ix.file_path(sid))  # noqa: E731
    missed, cached = [s for s in range(ix.n_files) if s != bad][:2]

    async def go():
        loop_thread.append(threading.get_ident())
        async with serving(core):
            assert await read_sample(core, cached) == files[name(cached)]  # (now cached)
            with pytest.raises(FsError):  # (now known corrupt)
                await read_sample(core, bad)
            before = core.statistics()
            table.waiting.update((missed, cached, bad))  # (as the fast path marks what a miss waits for)
            core.answered([READ | MISSED | missed, READ | MISSED | cached, READ | MISSED | bad])
            await settled(core)
            s = core.statistics()
            assert (s["misses"] - before["misses"], s["hits"] - before["hits"]) == (1, 1)
            core.answered([READ | MISSED | READ_END | missed])  # (the missed read's answer)
            assert core.statistics()["hits"] == s["hits"]
    trio.run(go)
    assert (missed, files[name(missed)], True) in handed  # (by its worker thread)
    assert (cached, files[name(cached)], False) in handed  # (from the loop)
    assert bad in table.let_go and bad not in [sid for sid, _, _ in handed]
    assert not core.holders.waiting


def test_misses_whose_handling_fails_go_to_the_loop_not_left_waiting(three_nodes, caplog):
    """Should the core fail to handle the fast path's misses (a bug), their reads are let go
    of (they go to the loop, which answers them) and the failure is logged: none is left
    waiting in the fast path for a fetch that will not come."""
    import threading
    from fusefs.handles import MISSED, READ
    dst, files = three_nodes
    table = ExpectingTable([threading.get_ident()])
    core = _core(dst, hold=table.hold, table=table)

    def broken(sids):
        raise RuntimeError("a bug")
    core.reads.parked_misses = broken
    table.waiting.update((1, 2))  # (as the fast path marks what a miss waits for)
    core.answered([READ | MISSED | 1, READ | MISSED | 2])
    assert table.let_go == {1, 2} and not table.waiting
    assert "their reads go to the loop" in caplog.text


def test_misses_whose_fetch_cannot_start_go_to_the_loop(three_nodes):
    """A miss waiting in the fast path whose batch the fetcher refuses (it no longer serves)
    is let go of, as a failed fetch is (Holders.arrived): its read goes to the loop."""
    import threading
    from fusefs.handles import MISSED, READ
    dst, files = three_nodes
    table = ExpectingTable([threading.get_ident()])
    core = _core(dst, hold=table.hold, table=table)  # (not running: submit refuses)
    table.waiting.add(3)
    core.answered([READ | MISSED | 3])
    assert table.let_go == {3} and not core.holders.waiting and 3 not in core.fetcher.inflight


def test_opens_and_releases_answered_on_the_fast_path_count_as_the_loops_do(tricky):
    """The fast path's thread answers opens and releases in C and hands them over as events
    (handles, a release's with RELEASED set, fastpath.py): applied in order, they leave the
    statistics and the order's cursor as opening and releasing through the core does, and
    the thread's handles continue the core's serials."""
    from fusefs import order as orderfmt
    from fusefs.handles import RELEASED, SID_BITS
    src, dst, files = tricky
    looped, fast = _core(dst), _core(dst)
    order = [3, 1, 4, 1, 5]
    for core in (looped, fast):
        core.set_order(0, orderfmt.encode(order, epoch=1))
    args = fast.fast_path_args()
    assert (args["file_base"], args["n_files"], args["sid_bits"]) == (fast.file_base, fast.index.n_files, SID_BITS)
    events, serial = [], args["serial"]
    for sid in order[:4]:  # (the last still open)
        serial = (serial + 1) % args["serial_wrap"]
        events += [(serial << SID_BITS) | sid, ((serial << SID_BITS) | sid) | RELEASED]
        looped.release(looped.open(looped.file_base + sid, os.O_RDONLY).fh)
    looped.open(looped.file_base + order[4], os.O_RDONLY)
    serial = (serial + 1) % args["serial_wrap"]
    fast.answered(events + [(serial << SID_BITS) | order[4]])
    for name in ("opens", "releases", "opens_pushed", "open_handles"):
        assert fast.statistics()[name] == looped.statistics()[name], name
    assert fast.plans[0].cursor == looped.plans[0].cursor == 4
    assert fast.open(fast.file_base + 2, os.O_RDONLY).fh >> SID_BITS == serial + 1  # serials go on


@pytest.mark.parametrize("ranks", [1, 2])
def test_a_batch_of_releases_on_the_fast_path_counts_its_uses_as_releasing_one_by_one(three_nodes, ranks):
    """The fast path's releases under one order are counted a batch at a time (Plan.use_many,
    SampleCache.rekey_many): after every batch the plan's cursor, uses and skipped
    occurrences, the cache's keys and what it would evict first, the read-ahead's count of
    bytes used and what the kernel view makes of forgets are as releasing each sample
    through the core makes them, with repeats in the order, occurrences the readers skip
    (the cursor passes them), uses past the order's end into the next one, a pinned entry,
    and forgets of samples just released among the releases. With two ranks' orders (the
    second a few samples of the set, read by no one) each release takes the per-sample path,
    to the same end."""
    import numpy as np
    from fusefs import order as orderfmt
    from fusefs.handles import FORGOTTEN, RELEASED, SID_BITS
    dst, _ = three_nodes
    looped, fast = _core(dst, cache_bytes=64 << 20), _core(dst, cache_bytes=64 << 20)
    rng = np.random.default_rng(3)
    n = looped.index.n_files
    order = rng.permutation(np.concatenate([np.arange(n), rng.choice(n, 60)])).tolist()
    nxt = rng.permutation(n).tolist()
    skipped = set(rng.choice(len(order), 25, replace=False).tolist())
    reads = [s for i, s in enumerate(order) if i not in skipped]
    reads = [reads[i + d] for i in range(0, len(reads) // 4 * 4, 4) for d in (1, 0, 3, 2)] \
        + reads[len(reads) // 4 * 4:]  # (workers interleave)
    reads += order[:30]  # (past the order's end: the next epoch's first uses, and some not needed)
    for core in (looped, fast):
        core.set_order(0, orderfmt.encode(order, epoch=1, next_follows=True) + orderfmt.encode(nxt, epoch=2))
        if ranks == 2:
            core.set_order(1, orderfmt.encode(order[::-1][:40], epoch=1))
        core.plans[0].skip_window = 16
        core.cache.pin_set = {order[0]}
        core.kernel_view.held[:] = True  # (a forget of a sample still needed is a drop)
        for s in range(n):
            core.cache.put(s, b"x" * 100, key=core.policy.key(s))

    def state(core):
        plan, cache = core.plans[0], core.cache
        return (plan.cursor, plan.frontier, plan.skipped, plan.uses.tobytes(), plan.consumed.tobytes(),
                [p.uses.tobytes() for p in core.plans.values()],
                cache._dump()[:3], sorted(cache._dump()[3]),
                core.prefetcher.plan._used, core.kernel_view._recent, core.stats.releases,
                core.stats.kernel_forgotten)

    batch, serial = [], 0
    for i, sid in enumerate(reads):
        looped.release(looped.open(looped.file_base + sid, os.O_RDONLY).fh)
        serial += 1
        batch += [(serial << SID_BITS) | sid, (serial << SID_BITS) | sid | RELEASED]
        if i % 7 == 3:  # (its last use, for a sample the order has once: no drop)
            looped.forget([looped.file_base + sid])
            batch.append(FORGOTTEN | sid)
        if len(batch) >= 100 or i == len(reads) - 1:
            fast.answered(batch)
            batch = []
            assert state(fast) == state(looped), i
    a = looped.plans[0]
    assert a.skipped > 0 and a.cursor == len(order) and looped.stats.kernel_forgotten > 0
    assert 0 < looped.kernel_view._recent < looped.stats.kernel_forgotten  # (some forgets were drops)


def test_a_batch_of_events_counted_in_c_leaves_the_core_as_one_by_one(three_nodes):
    """Core.answered counts a batch's events in C (fusefs._eventscore.scan) up to each forget
    and each read of pages the kernel had dropped, which the loop applies in their turn:
    random batches of opens, reads (to the end or not, of dropped pages, misses and their
    answers), releases and forgets, under an order, leave the statistics, the kernel view's
    flags and counts, the recent reads, the plan and the cache's keys as the one-by-one
    path (_answered_one_by_one) leaves them, the batch a list or the fast path's buffer."""
    import numpy as np
    from fusefs import order as orderfmt
    from fusefs.fs import KernelCache
    from fusefs.handles import FORGOTTEN, MISSED, READ, READ_END, READ_LOST, RELEASED, SID_BITS
    dst, _ = three_nodes
    cores = [_core(dst, cache_bytes=64 << 20, kernel=KernelCache()) for _ in range(2)]
    n = cores[0].index.n_files
    rng = np.random.default_rng(4)
    order = rng.permutation(n).tolist()
    for core in cores:
        core.set_order(0, orderfmt.encode(order, epoch=1))
        core.plans[0].skip_window = 8
        for s in range(0, n, 2):
            core.cache.put(s, b"x" * 100, key=core.policy.key(s))
    missed = [[], []]  # (no fetch here: the misses are only listed)
    for k, core in enumerate(cores):
        core.reads.parked_misses = missed[k].extend
    serial, kinds = 0, set()
    for batch_no in range(60):
        batch = []
        for sid in rng.choice(order, 12).tolist():
            serial += 1
            fh = (serial << SID_BITS) | sid
            kind = int(rng.integers(8))
            kinds.add(kind)
            read = [READ | READ_END | sid, READ | sid, READ | READ_END | READ_LOST | sid,
                    READ | MISSED | sid, READ | MISSED | READ_END | sid, READ | READ_END | sid,
                    READ | READ_END | sid, READ | READ_LOST | sid][kind]
            batch += [fh, read, RELEASED | fh]
            if kind == 3:
                batch.append(READ | MISSED | READ_END | sid)
            if rng.random() < 0.1:
                batch.append(FORGOTTEN | sid)
        # (every other batch in the fast path's form: native 64-bit values, FastPath.catch_up)
        cores[0].answered(batch if batch_no % 2 else memoryview(np.array(batch, np.uint64).tobytes()).cast("Q"))
        cores[1]._answered_one_by_one(batch)

        def state(core):
            s = core.statistics()
            return ({k: s[k] for k in ("opens", "reads", "releases", "hits", "misses", "opens_pushed",
                                       "kernel_forgotten", "in_kernel", "kernel_drops")},
                    core.kernel_view.held.tobytes(), list(core.reads._recent), core.plans[0].cursor,
                    core.plans[0].uses.tobytes(), core.cache._dump()[1], core.handles.open, core.handles.serial)
        assert state(cores[0]) == state(cores[1]), batch_no
        assert missed[0] == missed[1]
    assert kinds == set(range(8)) and cores[0].stats.hits > 0 and cores[0].kernel_view.held.any()
    assert cores[0].statistics()["opens_pushed"] > 0 and cores[0].stats.kernel_forgotten > 0


def test_reads_answered_on_the_fast_path_count_as_the_loops_do(tricky):
    """The fast path's thread answers reads of cached samples from the bytes the cache holds
    for it (Core's hold: the cache's mirror) and hands them over as events (the sample with READ set,
    READ_END where the read reached its end): applied, they leave the statistics and what
    the daemon takes the kernel to hold as the loop's reads of the same samples do."""
    from fusefs.handles import READ, READ_END, READ_LOST
    from fusefs.fs import KernelCache
    _, dst, files = tricky
    # (the kernel page cache: what reads tell of the kernel, read_through)
    held = {}
    looped = _core(dst, kernel=KernelCache())
    fast = _core(dst, kernel=KernelCache(), hold=lambda sid, data: held.__setitem__(sid, data)
                 if data is not None else held.pop(sid))
    sids = [resolve(looped.index, r)[1] for r in sorted(files) if files[r] and len(files[r]) > 10][:2]
    for core in (looped, fast):
        for sid in sids:
            core.cache.put(sid, core.store.read_sample(sid))
    assert held == {s: fast.cache.get(s) for s in sids}  # (the thread's table, as it sees it)
    first, second = sids

    async def go():
        async with serving(looped):
            await read_sample(looped, first, 0, 10)  # (not to its end)
            await read_sample(looped, second)
    trio.run(go)
    fast.answered([READ | first, READ | READ_END | second])
    for name in ("reads", "hits", "misses", "in_kernel", "backend_samples"):
        assert fast.statistics()[name] == looped.statistics()[name], name
    assert fast.statistics()["in_kernel"] == 1 and fast.kernel_view.holds(second)
    assert fast.reads._recent[-1] == second  # (scan detection sees them too)
    # a push of `first` that ended after a read answered in C (the push waits for the pages
    # that read holds) set in_kernel before the event came: not a drop. A read made while
    # in_kernel was set (READ_LOST, the flag as the thread read it) is one.
    fast.kernel_view.held[first] = True
    fast.answered([READ | first])
    assert fast.statistics()["kernel_dropped"] == 0 and fast.kernel_view.holds(first)
    fast.answered([READ | READ_LOST | second])
    assert fast.statistics()["kernel_dropped"] == 1 and not fast.kernel_view.holds(second)


def test_forgets_answered_on_the_fast_path_count_as_the_loops_do(tricky):
    """The fast path's thread drops every forget (it needs no answer) and hands a dataset
    file's over as an event (FORGOTTEN | sample): applied, it leaves what the daemon takes
    the kernel to hold as the loop's forget() does, in order with the other events."""
    from fusefs.handles import FORGOTTEN, READ, READ_END, RELEASED, SID_BITS
    _, dst, _ = tricky
    looped, fast = _core(dst), _core(dst)
    sids = [0, 3, 7]
    for core in (looped, fast):
        core.kernel_view.held[sids] = True
    looped.forget([looped.file_base + 3, ROOT, looped.ctrl_dir])
    fast.answered([FORGOTTEN | 3])
    assert list(fast.kernel_view.held) == list(looped.kernel_view.held) and fast.kernel_view.held[[0, 7]].all()
    assert fast.statistics()["kernel_forgotten"] == looped.statistics()["kernel_forgotten"] == 1
    # a forgotten sample's read after it is not a drop; a release's handle is no forget
    fast.answered([FORGOTTEN | 0, READ | READ_END | 0, (1 << SID_BITS | 7) | RELEASED])
    assert fast.statistics()["kernel_dropped"] == 0 and fast.kernel_view.held[7]

