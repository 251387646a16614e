import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fusefs import order
from fusefs.plan import AHEAD_BOUND, AHEAD_COVERED, MAX_SKIP_WINDOW, Plan


def test_round_trip_with_and_without_importance():
    o = order.parse(order.encode([3, 1, 2, 1], epoch=7), n_samples=4)
    assert o.ids.tolist() == [3, 1, 2, 1] and o.epoch == 7 and o.importance is None
    o = order.parse(order.encode([0, 2], epoch=1, importance=[0.5, 2.0]), n_samples=3)
    assert o.importance.tolist() == [0.5, 2.0]


@pytest.mark.parametrize("data, why", [
    (order.encode([0, 5]), "unknown sample id 5"),
    (b"FUSEFSCK" + order.encode([0])[8:], "bad magic"),
    (order.encode([0, 1])[:-2], "truncated"),
    (order.encode([0, 1]) + b"x", "trailing"),
    (order.encode([0] * 100), "too large"),
    (order.encode([0])[:10], "truncated"),
    (order.encode([0], importance=[1.0])[:-4] + np.float32("nan").tobytes(), "finite"),
    (order.encode([0, 1], importance=[1.0, 1.0])[:-4] + np.float32(-0.5).tobytes(),
     "must not be negative .entry 1 is -0.5"),
])
def test_bad_orders_are_refused_with_a_reason(data, why):
    with pytest.raises(order.OrderError, match=why):
        order.parse(data, n_samples=5, max_entries=50)


@pytest.mark.parametrize("field, value, why", [(8, 2, "version 2"), (12, 4, "unknown flags")])
def test_a_header_field_out_of_range_is_refused(field, value, why):
    raw = bytearray(order.encode([0, 1]))
    raw[field:field + 4] = value.to_bytes(4, "little")
    with pytest.raises(order.OrderError, match=why):
        order.parse(bytes(raw), n_samples=5)


@pytest.mark.parametrize("ids, importance, why", [
    ([[0, 1]], None, "one-dimensional"), ([-1], None, r"0 \.\. 2\*\*32-1"), ([2 ** 32], None, "2\\*\\*32"),
    ([0, 1], [1.0], "1 importance values for 2 ids"), ([0], [float("inf")], "finite"),
    ([0, 1], [1.0, -2.0], "must not be negative"),
    ([0, 1.5], None, "whole numbers: entry 1 is 1.5"), ([0.0, float("nan")], None, "whole numbers"),
    (["0", "1"], None, "integers, not"), ([True, False], None, "integers, not bool"),
])
def test_what_cannot_be_encoded_is_refused(ids, importance, why):
    with pytest.raises(order.OrderError, match=why):
        order.encode(ids, importance=importance)


def test_the_entry_counts_come_from_the_headers_alone():
    one, two = order.encode([0, 1, 2]), order.encode([0], next_follows=True) + order.encode([1, 2], importance=[1, 1])
    assert order.entries(one) == (3, 0) and order.entries(two) == (1, 2)
    for bad in (one[:-1], one + b"x", two[:-3], b"FUSEFSCK" + one[8:], b""):
        assert order.entries(bad) is None  # (parse says why)


def test_whole_float_ids_are_taken_as_the_ids_they_are():
    """(a float array of whole numbers, as some loaders keep indices, is taken exactly)"""
    assert order.parse(order.encode(np.array([3.0, 0.0, 2.0])), 5).ids.tolist() == [3, 0, 2]
    assert order.integer_ids([]).tolist() == []


@given(st.binary(max_size=200))
@settings(max_examples=300, deadline=None)
def test_random_bytes_never_crash_the_parser(data):
    try:
        order.parse(data, n_samples=10)
    except order.OrderError:
        pass


def test_plan_counts_uses_and_duplicates():
    sizes = np.full(5, 10)
    p = Plan(order.Order(np.array([4, 2, 4, 0])), sizes)
    assert p.remaining(4) == 2 and p.remaining(1) == 0
    assert p.use(4) == [] and p.cursor == 1          # first of two occurrences
    assert p.use(0) == [0] and p.cursor == 1          # out of order: cursor waits for 2
    assert p.use(2) == [2] and p.cursor == 2
    assert p.use(4) == [4] and p.done
    assert p.use(4) is None and p.use(1) is None      # not (or no longer) in the order
    assert p.cursor == 4 and p.remaining(4) == 0


def test_plan_window_respects_budget_and_skips_used():
    sizes = np.array([10, 20, 30, 40, 50])
    p = Plan(order.Order(np.array([1, 3, 1, 0, 4])), sizes)
    assert p.window(1000).tolist() == [1, 3, 0, 4]    # each sample once
    assert p.window(60).tolist() == [1, 3]            # 20 + 40 fill the budget
    p.use(3)
    assert p.window(60).tolist() == [1, 0]


def test_readers_that_skip_do_not_hold_the_cursor_back():
    n = 100
    p = Plan(order.Order(np.arange(n)), np.ones(n), skip_window=10)
    done = []
    for sid in range(30, n):  # samples 0..29 are never read
        done += p.use(sid)
    assert p.done and p.skipped == 30
    assert sorted(done) == list(range(n))


@pytest.mark.parametrize("batched", [False, True])
def test_readers_that_lag_each_other_widen_the_skip_window_until_nothing_is_passed(batched):
    """Two readers of one order, each taking every other position, one 30 positions behind
    the other, with a skip window of 10: the leader's uses pass the laggard's occurrences
    as skipped, and a late use of one widens the window to twice the lag it shows, after
    which nothing more is passed. A sample passed and never read does not widen it, nor
    does a second read of one read before; and the window stops at its cap."""
    n, lag = 400, 30
    p = Plan(order.Order(np.arange(n)), np.ones(n), skip_window=10)
    use = (lambda s: p.use_many([s])) if batched else p.use
    for i in range(0, n + lag, 2):
        if i < n:
            use(i)            # the leader: even positions
        if i >= lag:
            use(i - lag + 1)  # the laggard: odd ones, 30 behind
    assert p.done and 2 * lag <= p.skip_window <= 2 * (lag + 2)
    assert 0 < p.late == p.skipped <= lag // 2  # (each occurrence passed was read, late)
    late = p.late
    use(1)                       # a second read: not late
    assert p.late == late

    q = Plan(order.Order(np.arange(n)), np.ones(n), skip_window=10)
    use = (lambda s: q.use_many([s])) if batched else q.use
    for sid in range(20, n):     # samples 0..19 are never read: passed, window kept
        use(sid)
    assert q.skipped == 20 and q.late == 0 and q.skip_window == 10

    r = Plan(order.Order(np.arange(n)), np.ones(n), skip_window=4)
    r.frontier = MAX_SKIP_WINDOW  # (as if the leader were that far on: a lag past the cap)
    r.was_passed[1] = True
    r.uses[1] = 1
    r.use(1)
    assert r.late == 1 and r.skip_window == MAX_SKIP_WINDOW


def test_a_batch_of_uses_counted_in_c_leaves_the_plan_as_uses_one_by_one_do():
    """Plan.use_many and positions_of (fusefs._plancore, C) against Plan.use and position_of,
    the Python references: random
    orders with repeated samples and a next order, readers that interleave, skip, lag and
    read past the order's end, in batches of random size: after every batch both plans hold
    the same uses, consumed positions, cursor, frontier, window, passed samples and counts,
    and each used sample's next position is position_of's after the use; and every sample's
    next position, taken for all at once, is position_of's."""
    rng = np.random.default_rng(5)
    late = skipped = 0
    for trial in range(60):
        n_files = int(rng.integers(5, 60))
        ids = rng.integers(0, n_files, int(rng.integers(1, 3 * n_files)))
        nxt = order.Order(rng.permutation(n_files)[:int(rng.integers(0, n_files))]) if trial % 2 else None
        window = int(rng.integers(1, 8))
        one, many = (Plan(order.Order(ids, next=nxt), np.ones(n_files), skip_window=window) for _ in range(2))
        reads = [int(s) for s in ids if rng.random() < 0.85]
        for k in range(0, len(reads) - 3, 4):  # (readers interleave, and lag)
            if rng.random() < 0.5:
                reads[k], reads[k + 3] = reads[k + 3], reads[k]
        reads += [int(s) for s in rng.integers(0, n_files, 5)]  # (past the end, and some not needed)
        at = 0
        while at < len(reads):
            batch = reads[at:at + int(rng.integers(1, 9))]
            at += len(batch)
            want = []
            for sid in batch:
                if one.use(sid) is not None:
                    want += (sid, one.position_of(sid))
            assert many.use_many(batch) == want
            for a in ("cursor", "frontier", "skip_window", "skipped", "late", "passed"):
                assert getattr(one, a) == getattr(many, a), a
            for a in ("uses", "consumed", "was_passed"):
                assert np.array_equal(getattr(one, a), getattr(many, a)), a
            assert many.positions_of(range(n_files)) == [one.position_of(s) for s in range(n_files)]
        late, skipped = late + many.late, skipped + many.skipped
    assert late > 0 and skipped > late  # (the paths of a skip and of a late use were taken)
    with pytest.raises(IndexError):
        many.use_many([n_files])
    with pytest.raises(IndexError):
        many.positions_of([0, -1])


def test_an_order_with_the_next_epochs_parses_whole_and_not_cut_after_its_first():
    two = order.encode([3, 1], epoch=4, next_follows=True) + order.encode([2, 0], epoch=5)
    first = len(order.encode([3, 1]))
    assert order.parse(two, n_samples=4).next.ids.tolist() == [2, 0]
    with pytest.raises(order.OrderError, match="next epoch's order follows"):
        order.parse(two[:first], n_samples=4)
    # written without the flag, a second record still parses (files of older writers)
    old = order.encode([3, 1]) + order.encode([2, 0], epoch=1)
    assert order.parse(old, n_samples=4).next.epoch == 1


def _walk(plan, pos, depth, most, step, skip, flags):
    """The read-ahead's walk of one plan in Python (the reference Plan.ahead is held to)."""
    ids, consumed, n = plan.ids, plan.consumed, len(plan.ids)
    nxt, end = plan.next_ids, n + len(plan.next_ids)
    sids, positions, looked = [], [], 0
    while len(sids) < most and (step < 0 or looked < step):
        start = pos
        while pos < end:
            if pos < n:
                sid = int(ids[pos])
                if consumed[pos]:
                    pos += 1
                    continue
            else:
                sid = int(nxt[pos - n])
            if any(sid in c for c in skip) or any(f[sid] for f in flags):
                pos += 1
                continue
            break
        if pos >= end or plan.bytes_between(plan.frontier, pos) > depth:
            return sids, positions, pos, looked, AHEAD_COVERED if pos >= end else AHEAD_BOUND
        sids.append(sid)
        positions.append(pos)
        pos += 1
        looked += pos - start
    return sids, positions, pos, looked, 0


def test_the_walk_ahead_in_c_takes_what_the_python_walk_takes():
    """Plan.ahead (fusefs._plancore, C) against the walk in Python: random orders with a
    next order, some positions used, samples queued or cached (containers), in flight or the
    kernel's (none, one or two arrays of flags), random depths, run lengths and step bounds: the same samples at the
    same positions, the same stop and the same count of positions looked at."""
    rng = np.random.default_rng(9)
    stops = set()
    for trial in range(300):
        n_files = int(rng.integers(3, 50))
        ids = rng.integers(0, n_files, int(rng.integers(1, 3 * n_files)))
        nxt = order.Order(rng.permutation(n_files)[:int(rng.integers(0, n_files))]) if trial % 3 else None
        p = Plan(order.Order(ids, next=nxt), rng.integers(1, 100, n_files))
        for sid in rng.choice(ids, int(rng.integers(0, len(ids) + 1))).tolist():
            p.use(int(sid))
        skip = tuple({int(s): None for s in rng.integers(0, n_files, int(rng.integers(0, 6)))}
                     for _ in range(int(rng.integers(0, 4))))
        flags = tuple((rng.random(n_files) < 0.2).view(np.uint8) if k else bytearray(rng.random(n_files) < 0.2)
                      for k in range(trial % 3))
        args = (int(rng.integers(0, len(ids) + 3)), int(rng.integers(0, 3000)), int(rng.integers(1, 20)),
                int(rng.integers(-1, 30)), skip, flags)
        got = p.ahead(*args)
        assert got == _walk(p, *args), (trial, got)
        stops.add(got[4])
    assert stops == {0, AHEAD_COVERED, AHEAD_BOUND}
