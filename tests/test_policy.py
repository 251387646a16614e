"""The cache policy across epochs: furthest next use first (Belady), compared with Belady's
MIN on the same orders; the cache on its own (eviction order, pins, budget)."""
import math

import numpy as np
import pytest
import trio

from fusefs import order as orderfmt
from fusefs.cache import SampleCache
from fusefs.policy import Policy

from conftest import make_core, whole_set
from conftest import run_epoch


def belady_min(seq, sizes, budget: int, start: int = 0) -> int:
    """Bytes fetched from position start on by Belady's MIN over the access sequence seq
    (demand fetching: a missed sample is fetched; to make room the cached samples needed
    furthest ahead, or never, go first)."""
    seq = list(seq)
    nxt = [math.inf] * len(seq)  # position of the next access of the same sample
    last = {}
    for i in range(len(seq) - 1, -1, -1):
        nxt[i] = last.get(seq[i], math.inf)
        last[seq[i]] = i
    cached: dict[int, float] = {}  # sid -> its next use
    used, fetched = 0, 0
    for i, sid in enumerate(seq):
        if sid in cached:
            cached[sid] = nxt[i]
            continue
        size = int(sizes[sid])
        if i >= start:
            fetched += size
        if nxt[i] == math.inf or size > budget:
            continue  # never needed again: not worth keeping
        while used + size > budget:
            victim = max(cached, key=cached.get)
            if cached[victim] <= nxt[i]:
                break  # everything cached is needed sooner: do not keep this one
            used -= int(sizes[victim])
            del cached[victim]
        if used + size <= budget:
            cached[sid] = nxt[i]
            used += size
    return fetched


def _two_epochs(dst, share: float, readers: int, jitter: int, lookahead: bool = True):
    probe = make_core(dst)
    n, sizes = probe.index.n_files, probe.index.size
    budget = int(sizes.sum() * share)
    # a read-ahead of W bytes holds W of the budget ahead of use, which MIN never does: it
    # costs about W more per epoch, so the read-ahead is a sixteenth of the budget here
    # (the default for large sets; on this small set the default is a batch per slot)
    core = make_core(dst, cache_bytes=budget, batch=4, per_node=1, readahead=budget // 16)
    core.fetcher.backend.max_gap = 0  # reads only join adjacent samples: bytes read = bytes of samples
    a, b = (np.random.default_rng(seed).permutation(n) for seed in (11, 12))
    first = orderfmt.encode(a, epoch=0) + (orderfmt.encode(b, epoch=1) if lookahead else b"")
    trio.run(run_epoch, core, a.tolist(), readers, jitter, 0, None, first)
    epoch1 = core.statistics()["backend_bytes"]
    trio.run(run_epoch, core, b.tolist(), readers, jitter, 1, None, orderfmt.encode(b, epoch=1))
    s = core.statistics()
    assert s["cache_peak"] <= budget and s["eio"] == 0
    s["largest_sample"] = int(sizes.max())
    return s["backend_bytes"] - epoch1, belady_min(np.concatenate([a, b]), sizes, budget, n), s


@pytest.mark.parametrize("readers, jitter", [(1, 1), (3, 8)])
def test_a_tenth_cached_fetches_within_its_read_ahead_of_belady_min(three_nodes, readers, jitter):
    """The second epoch fetches at most Belady's MIN plus what the read-ahead holds ahead of
    use (W bytes, which MIN never holds: each byte of it is a byte of the budget that keeps
    nothing for later) plus one sample (the read-ahead reserves whole samples)."""
    dst, _ = three_nodes
    ours, best, s = _two_epochs(dst, 0.1, readers, jitter)
    assert ours <= best + s["readahead_bytes"] + s["largest_sample"], (ours, best, s["readahead_bytes"])
    # without the next epoch's order the boundary is blind: more is fetched again
    blind, _, _ = _two_epochs(dst, 0.1, readers, jitter, lookahead=False)
    assert blind > ours, (blind, ours)


def never_evicting(seq, sizes, budget: int) -> int:
    """Bytes fetched over seq by a cache that keeps what comes first until it is full and
    never evicts: the policy a broken eviction falls back to."""
    cached, used, fetched = set(), 0, 0
    for sid in seq:
        if sid in cached:
            continue
        fetched += int(sizes[sid])
        if used + int(sizes[sid]) <= budget:
            cached.add(sid)
            used += int(sizes[sid])
    return fetched


def test_with_samples_used_twice_in_an_epoch_eviction_keeps_what_is_needed_soonest(three_nodes):
    """Each sample twice in one epoch's order (data echoing) through a tenth cached: what is
    fetched stays within a tenth of Belady's MIN, and far below what a cache
    that never evicts fetches (across plain permutations the two differ by a sample or so:
    there, every policy fetches the nine tenths it cannot hold)."""
    dst, _ = three_nodes
    probe = make_core(dst)
    n, sizes = probe.index.n_files, probe.index.size
    budget = int(sizes.sum() * 0.1)
    core = make_core(dst, cache_bytes=budget, batch=4, per_node=1, readahead=budget // 16)
    core.fetcher.backend.max_gap = 0
    rng = np.random.default_rng(5)
    first = rng.permutation(n)  # (each sample's second use follows within about a tenth of the set)
    seq = np.concatenate([first[k:k + n // 10] for k in range(0, n, n // 10) for _ in (0, 1)])
    trio.run(run_epoch, core, seq.tolist(), 1, 1, 0, None, orderfmt.encode(seq, epoch=0))
    s = core.statistics()
    assert s["cache_peak"] <= budget and s["eio"] == 0
    ours, best, worst = s["backend_bytes"], belady_min(seq, sizes, budget), never_evicting(seq, sizes, budget)
    assert ours <= 1.1 * best, (ours, best)  # (6.60 against MIN's 6.36 MB, when written)
    assert ours < 0.75 * worst, (ours, best, worst)  # (against 11.7 MB)

def test_the_whole_set_cached_reads_nothing_after_the_first_epoch(three_nodes):
    dst, _ = three_nodes
    probe = make_core(dst)
    n = probe.index.n_files
    core = make_core(dst, cache_bytes=whole_set(probe.index), batch=8)
    fetched = []
    for epoch in range(3):
        ids = np.random.default_rng(epoch).permutation(n)
        trio.run(run_epoch, core, ids.tolist(), 3, 8, epoch, None, orderfmt.encode(ids, epoch=epoch))
        fetched.append(core.statistics()["backend_samples"])
    assert fetched == [n, n, n]  # every sample once, in the first epoch only


def test_belady_min_reference_on_a_small_case():
    sizes = np.array([10, 10, 10, 10])
    # budget of 2 samples: a b c a b d a b -> MIN keeps a and b, fetches c and d once
    seq = [0, 1, 2, 0, 1, 3, 0, 1]
    assert belady_min(seq, sizes, 20) == 40
    assert belady_min(seq, sizes, 20, start=3) == 10
    assert belady_min(seq, sizes, 40) == 40  # everything fits: each sample once


def test_cache_evicts_furthest_next_use_first_and_never_pins():
    c = SampleCache(30, static=10, entry_overhead=0)  # (sizes as the policy sees them)
    c.set_pins(np.array([9]), np.array([1.0]), np.full(10, 10))
    c.put(9, b"p" * 10, key=math.inf)      # pinned: never evicted, whatever its key
    c.put(1, b"a" * 10, key=5.0)
    c.put(2, b"b" * 10, key=50.0)
    assert c.free == 0
    assert not c.reserve(5, 10, key=60.0)  # everything cached is needed sooner
    assert c.reserve(5, 10, key=20.0)      # evicts sample 2 (needed at 50)
    assert 2 not in c and 1 in c and 9 in c
    assert c.reserve(5, 10, key=20.0) and c.reserved == 10  # (one reservation a sample)
    assert c.settle(5) == 10 and c.settle(5) == 0 and c.reserved == 0  # (settled once)
    assert c.put(2, b"b" * 10, key=40.0)   # full again
    c.rekey(1, math.inf)                   # used for the last time
    assert c.put(3, b"c" * 10, key=math.inf) and 1 not in c and 2 in c  # never-needed go first
    assert c.used + c.reserved <= c.budget and c.pinned_bytes == 10


def test_an_entry_put_again_or_re_keyed_back_under_its_key_is_evicted_once():
    """A put of a cached sample (delivered twice) or a re-key back to its earlier key leaves
    two heap items that look current: the entry is still evicted once, in its key's turn,
    and the budget holds."""
    for again in (lambda c: c.put(2, b"x" * 10, key=12.0), lambda c: (c.rekey(2, 99.0), c.rekey(2, 12.0))):
        c = SampleCache(30, entry_overhead=0)
        for sid, key in ((0, 10.0), (1, 11.0), (2, 12.0)):
            c.put(sid, b"x" * 10, key=key)
        again(c)
        assert c.put(3, b"y" * 20, key=5.0)  # room for two: samples 2 and 1, furthest first
        assert sorted(c._dump()[0]) == [0, 3] and c.evictions == 2 and c.used == c.budget


def test_evictions_take_the_furthest_key_first_through_puts_rekeys_and_drops():
    """Random puts, re-keys and drops on a small cache: after every step the cache holds what
    a reference that evicts the entry of largest key first holds (a put evicts only entries
    needed later than it, or nothing), and its heap holds each entry once (indexed: a re-key
    moves its item, and leaves nothing stale)."""
    rng = np.random.default_rng(7)
    c = SampleCache(50, entry_overhead=0)
    ref: dict[int, float] = {}  # sid -> key, of what the cache should hold
    for _ in range(20_000):
        sid, key, op = int(rng.integers(200)), float(rng.random()), rng.random()
        if op < 0.5:
            kept = c.put(sid, b"x", key=key)
            ref.pop(sid, None)
            victims = sorted((s for s in ref if ref[s] > key), key=ref.get, reverse=True)
            if len(ref) < 50 or victims:
                for s in victims[:max(0, len(ref) + 1 - 50)]:
                    del ref[s]
                ref[sid] = key
            assert kept == (sid in ref)
        elif op < 0.95:
            c.rekey(sid, key)
            if sid in ref:
                ref[sid] = key
        else:
            c.drop(sid)
            ref.pop(sid, None)
        entries, keys, _, heap = c._dump()
        assert entries.keys() == ref.keys() and keys == ref and sorted(heap) == sorted(ref)
    assert c.evictions > 1000


def twin_caches(rng, puts: int):
    """Two caches (4,000 bytes, sample 3 pinned) with the same entries, up to puts random
    ones, each with a mirror (a dict): ([mirror, mirror], [cache, cache])."""
    held = [{}, {}]
    caches = [SampleCache(4_000, static=500, entry_overhead=16,
                          mirror=lambda sid, data, h=h: h.__setitem__(sid, data) if data is not None
                          else h.pop(sid)) for h in held]
    for c in caches:
        c.set_pins(np.array([3]), np.array([1.0]), np.full(40, 400))
    for _ in range(int(rng.integers(0, puts))):
        sid, data, key = int(rng.integers(40)), bytes(int(rng.integers(1, 500))), float(rng.integers(100))
        for c in caches:
            c.put(sid, data, key)
    return held, caches


def test_a_group_put_at_once_keeps_what_puts_one_by_one_keep_up_to_the_first_refused():
    """SampleCache.put_many (a fetched group's samples, in one call) leaves the cache, its
    mirror, its counters (the peak: the most held after any put) and its eviction order as
    put() of each in turn does, and stops at the first sample put() would refuse (room only
    from entries needed sooner): its index, the samples after it untouched, for the caller to
    go on from there."""
    rng = np.random.default_rng(11)
    stops = []
    for trial in range(200):
        held, caches = twin_caches(rng, 12)  # (some cached already, some reserved)
        for sid in rng.choice(40, 3, replace=False).tolist():
            size, key = int(rng.integers(1, 300)), float(rng.integers(100))
            for c in caches:
                c.reserve(100 + sid, size, key)
        items = [(int(s), bytes(int(rng.integers(1, 700)))) for s in rng.choice(40, 8, replace=False)]
        keys = [float(rng.integers(100)) if rng.random() < 0.9 else math.inf for _ in items]
        one, many = caches
        peak, stop = one.peak, len(items)
        for i, (sid, data) in enumerate(items):
            if not one.put(sid, data, keys[i]):
                stop = i
                break
            peak = max(peak, one.used + one.reserved)  # (the most held at once: after a put)
        assert one.peak == peak
        assert many.put_many(items, keys) == stop
        stops.append(stop)
        for c in caches:
            c.put(999, b"z" * 300, 50.0)  # (what goes next: the same eviction order)
        assert one._dump() == many._dump() and held[0] == held[1]
        assert one.counters() == many.counters()
        if stop < len(items) - 1:  # (the rest, from where it stopped)
            assert many.put_many(items, keys, stop + 1) >= stop + 1
    assert 0 < stops.count(8) < len(stops)  # (some groups kept whole, some refused in part)


def test_a_group_put_at_once_tells_the_mirror_only_of_what_it_does_not_hold_already():
    """put_many's told samples (the fast path holds their bytes already: its fetch thread
    handed them over) are not told again, unless the put replaced an entry (whose drop let go
    of them); every other sample is."""
    calls = []
    cache = SampleCache(10_000, entry_overhead=0, mirror=lambda sid, data: calls.append((sid, data)))
    old, a, b, c = b"o" * 10, b"a" * 10, b"b" * 10, b"c" * 10
    cache.put(3, old, 5.0)
    calls.clear()
    assert cache.put_many([(1, a), (2, b), (3, c)], [1.0, 2.0, 3.0], told={1, 3}) == 3
    assert calls == [(2, b), (3, None), (3, c)]
    assert cache.get(1) is a and cache.get(3) is c


def test_a_run_reserved_at_once_reserves_what_reserves_one_by_one_do_up_to_the_first_refused():
    """SampleCache.reserve_many (a run of the read-ahead's samples, in one call) leaves the
    cache, its mirror (told of the evictions once the run is reserved), its reservations and
    counters as reserve() of each in turn does, and stops at the first sample reserve() would
    refuse: its index."""
    rng = np.random.default_rng(12)
    stops = []
    for trial in range(200):
        held, caches = twin_caches(rng, 14)
        sids = [int(s) for s in rng.choice(60, 8, replace=False)]
        sids[-1] = sids[0]  # (a sample reserved already: counts as reserved)
        sizes = [int(rng.integers(1, 700)) for _ in sids]
        keys = [float(rng.integers(100)) if rng.random() < 0.9 else math.inf for _ in sids]
        one, many = caches
        stop = len(sids)
        for i, sid in enumerate(sids):
            if not one.reserve(sid, sizes[i], keys[i]):
                stop = i
                break
        assert many.reserve_many(sids, sizes, keys) == stop
        stops.append(stop)
        assert one._dump() == many._dump() and held[0] == held[1]
        assert one.counters() == many.counters()
        for c in caches:
            c.put(999, b"z" * 300, 50.0)  # (what goes next: the same eviction order)
        assert one._dump() == many._dump() and held[0] == held[1]
    assert 0 < stops.count(8) < len(stops)  # (whole runs, runs cut short)


def test_a_new_orders_rekey_orders_equal_keys_by_when_they_were_put_and_takes_no_python_memory():
    """A new order re-keys every entry (rekey_all): the heap is rebuilt in place (one item an
    entry, no second heap beside it: Python's allocations, traced, peak at the ids and their
    keys, 16 bytes an entry),
    each entry under its new key, and of equal keys the one put first goes first, whatever
    re-keys came between."""
    import tracemalloc
    n = 20_000
    c = SampleCache(1 << 40, entry_overhead=0)
    for sid in range(n):
        c.put(sid, b"x", key=float(sid))
    for sid in range(n):  # (re-keys in reverse: the heap's ties would follow them)
        c.rekey(n - 1 - sid, float(2 * n + sid))
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        c.rekey_all(lambda sids: np.full(len(sids), 7.0))
        assert tracemalloc.get_traced_memory()[1] - base <= 16 * n + 4096  # (ids and keys, no heap)
    finally:
        tracemalloc.stop()
    entries, keys, _, heap = c._dump()
    assert len(entries) == n and set(keys.values()) == {7.0} and c.heap_items == len(heap) == n
    evicted = []
    small = SampleCache(3, entry_overhead=0, mirror=lambda sid, data: data is None and evicted.append(sid))
    for sid in (5, 6, 7):
        small.put(sid, b"x", key=1.0)
    small.rekey(5, 2.0), small.rekey(5, 1.0)  # (its turn among equal keys: the last re-keyed)
    assert small.put(8, b"x", key=0.5) and evicted == [6]
    small.rekey_all(lambda sids: np.ones(len(sids)))  # (equal keys: in the order put)
    assert small.put(9, b"x", key=0.5) and evicted == [6, 5]


def test_policy_keys_span_the_epoch_boundary():
    sizes = np.full(5, 10)
    p = Policy(sizes)
    p.set_order(0, orderfmt.parse(orderfmt.encode([3, 1]) + orderfmt.encode([1, 4, 3]), 5))
    assert p.key(3) == 0 and p.key(1) == 1      # positions in this order
    assert p.key(4) == 2 + 1                      # past this order's end, in the next one
    assert p.key(0) == math.inf                   # in neither
    p.use(3)
    assert p.key(3) == 2 + 2 and p.key_after_use(1) == 2 + 0


@pytest.mark.parametrize("ranks", [1, 2])
def test_scalar_keys_agree_with_the_vector_keys_as_readers_go(ranks):
    """Policy.key (the per-sample path: one plan's position read through memoryviews, or
    the nearest over plans plus the clock) gives what Policy.keys (numpy, over all samples
    at once) gives, at every step of readers using samples, repeats and the next epoch's
    order included; key_after_use is key once the use is counted (where no cursor moves:
    with several plans the clock is their mean cursor)."""
    rng = np.random.default_rng(ranks)
    n = 40
    p = Policy(np.full(n, 10))
    for rank in range(ranks):
        ids = rng.integers(0, n, 60)  # repeats, and samples in neither order
        nxt = rng.permutation(n)[:30]
        p.set_order(rank, orderfmt.parse(orderfmt.encode(ids, next_follows=True)
                                         + orderfmt.encode(nxt, epoch=1), n))
    all_ids = np.arange(n)
    for step in range(120):
        vector = p.keys(all_ids)
        assert [p.key(s) for s in range(n)] == vector.tolist()
        sid = int(rng.integers(0, n))
        after = p.key_after_use(sid)
        cursors = [plan.cursor for plan in p.plans.values()]
        if p.use(sid) is not None and cursors == [plan.cursor for plan in p.plans.values()]:
            assert p.key(sid) == after, step  # (with one plan keys are positions: always)


def test_the_cache_mirror_holds_exactly_the_cached_entries():
    """The cache's mirror tells the fast path of every entry that comes or goes (it answers
    reads from what it was told): under random puts, drops and evictions its table always
    equals the cache's entries, bytes objects included."""
    rng = np.random.default_rng(7)
    held = {}

    def hold(sid, data):
        if data is None:
            assert sid in held
            del held[sid]
        else:
            held[sid] = data
    cache = SampleCache(5_000, mirror=hold)
    for _ in range(2_000):
        sid = int(rng.integers(0, 60))
        if rng.random() < 0.2:
            cache.drop(sid)
        elif rng.random() < 0.3:
            n = int(rng.integers(1, 900))  # (a fetch's room: may evict)
            if cache.reserve(100 + sid, n, float(rng.integers(0, 100))):
                cache.settle(100 + sid)
        else:
            cache.put(sid, bytes(int(rng.integers(1, 900))), float(rng.integers(0, 100)))
        assert held.keys() == cache._dump()[0].keys()
        assert all(held[s] is cache.get(s) for s in held)
    assert cache.evictions > 0 and held


def test_what_open_handles_keep_is_counted_once_and_covered_by_entries_no_order_needs():
    """Issue 87 item 9: a handle that keeps the cache's own entry costs nothing more; once
    the entry leaves while held, or for bytes the cache never held, the budget counts them
    (outside) and entries no order needs make room, oldest first; an entry an order needs
    is never evicted for them, nor is a fetch refused."""
    c = SampleCache(10_000, entry_overhead=0)
    a, b, far = bytes(3000), bytes(3000), bytes(3000)
    c.put(1, a)                       # (no order needs it: key inf)
    c.put(2, b, key=5.0)              # (an order needs it)
    c.hold_for_reader(1, a)
    assert c.outside == 0  # (the entry itself)
    c.put(3, far)                     # (inf, newer)
    c.drop(1)                         # the entry leaves while a handle keeps its bytes
    assert c.outside == 3000 and c.used + c.outside <= c.budget
    c.hold_for_reader(7, bytes(3000))  # bytes the cache never held: room from inf entries
    assert c.outside == 6000 and 3 not in c and 2 in c  # (the needed entry stays)
    c.hold_for_reader(8, bytes(3000))
    assert 2 in c  # (past the budget: never the needed one)
    assert c.put(4, bytes(500), key=1.0)  # (nor is a fetch refused for them)
    c.let_go_for_reader(1), c.let_go_for_reader(7), c.let_go_for_reader(8)
    assert c.outside == 0 and c.counters()["cache_outside"] == 0
    c.hold_for_reader(2, b), c.hold_for_reader(2, b)
    assert c.outside == 0  # (two handles, once)
    c.let_go_for_reader(2)
    c.drop(2)
    assert c.outside == 3000  # (the other handle still keeps them)
    c.let_go_for_reader(2)
    assert c.outside == 0 and 4 in c


def test_the_caches_c_entries_hold_one_reference_an_entry_and_refuse_bad_ids():
    """fusefs._cachecore keeps a reference to each entry's bytes while it is cached and lets
    go of it as the entry leaves (evicted, dropped, or the cache itself let go of); its
    arrays grow past the data set's count given; a negative id is refused with a reason."""
    import gc
    import sys
    kept, evicted, dropped = bytes(100), bytes(100), bytes(100)
    def refs():
        return [sys.getrefcount(b) for b in (kept, evicted, dropped)]
    base = refs()
    c = SampleCache(250, entry_overhead=0, samples=4)
    assert c.put(1, evicted, key=9.0) and c.put(2, dropped, key=1.0)
    assert refs()[1:] == [base[1] + 1, base[2] + 1]
    assert c.put(5_000, kept, key=2.0)  # (past the count given: the arrays grow; sample 1 goes)
    assert 1 not in c and c.get(5_000) is kept and c.evictions == 1
    assert c.drop(2) and not c.drop(2) and c.get(2) is None and 7 not in c and "x" not in c
    assert refs() == [base[0] + 1, base[1], base[2]]
    with pytest.raises(ValueError, match="out of range"):
        c.put(-1, b"x")
    with pytest.raises(ValueError, match="out of range"):
        c.reserve(-3, 10)
    del c
    gc.collect()
    assert refs() == base
