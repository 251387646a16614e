"""kernel_view.KernelView without a mount: what the daemon takes the kernel page cache to
hold, from pushes, reads through, forgets and the drops reads show."""
import errno
import threading
import time

from fusefs.core import Stats
from fusefs.kernel_view import DROP_SHARE, DROP_WINDOW, MIN_DROPS, KernelView

from conftest import Kernel


def held_view(n: int, opened: int = 0):
    """(stats, view) of n samples, every one pushed and held, a new order, and the first
    `opened` of them opened."""
    stats = Stats()
    view = KernelView(n, stats, Kernel())
    view.push([(s, b"x") for s in range(n)])
    view.new_order()
    for s in range(opened):
        view.opened(s)
    return stats, view


def test_a_push_holds_what_the_kernel_stored_and_never_pushes_it_again():
    stats, kernel = Stats(), Kernel({10 + 2: errno.ENOENT})
    view = KernelView(4, stats, kernel, ino_base=10)
    view.push([(0, b"a"), (1, b"b"), (2, b"c")])
    assert kernel.pushed == [10, 11, 12]
    assert [view.holds(s) for s in range(4)] == [True, True, False, False]  # (ENOENT: not held)
    view.push([(0, b"a"), (2, b"c")])
    assert kernel.pushed[3:] == [12] and stats.push_skipped == 1 and stats.pushed == 2
    assert view.counters() == {"in_kernel": 2, "kernel_drops": False}
    assert bytes(view.flags()) == b"\x01\x01\x00\x00"  # (the bytes the fast path reads)


def test_a_refused_push_stops_the_pushes_and_without_a_kernel_nothing_is_held():
    stats = Stats()
    view = KernelView(3, stats, Kernel({0: errno.EPERM}))
    view.push([(0, b"a")])
    assert not view.pushes and not view.holds(0)
    view.read_through(1)  # (no kernel cache: the reader's pages are not kept either)
    assert not view.holds(1)
    view.push([(2, b"c")])
    assert stats.pushed == 0


def test_a_forget_or_a_drop_clears_a_sample_and_counts_it():
    stats = Stats()
    view = KernelView(3, stats, Kernel())
    view.push([(0, b"a"), (1, b"b")])
    view.read_through(2)
    assert all(view.holds(s) for s in range(3))
    view.forgot(0)
    view.forgot(0)  # (once)
    assert stats.kernel_forgotten == 1 and not view.holds(0)
    assert view.lost(1) is False and stats.kernel_dropped == 1 and not view.holds(1)
    assert view.lost(1) is False and stats.kernel_dropped == 1  # (not held: no drop)
    view.opened(2)
    view.opened(0)
    assert stats.opens_pushed == 1


def test_many_drops_under_an_order_clear_every_flag_once_until_the_next_order():
    n = 10 * MIN_DROPS
    stats, view = held_view(n, opened=n)
    # at most DROP_SHARE of the opened samples (and fewer than MIN_DROPS) dropped: trusted
    few = min(MIN_DROPS - 1, int(DROP_SHARE * n))
    assert not any(view.lost(s) for s in range(few))
    assert not view.drops and view.holds(n - 1)
    told = [view.lost(s) for s in range(few, n)]
    assert told.count(True) == 1  # (the drop that crossed the line: every flag goes)
    assert view.drops and not view.held.any()
    view.push([(0, b"x")])  # (what is pushed from then on is held again)
    assert view.holds(0)
    view.new_order()
    assert not view.drops


def test_forgets_of_samples_still_needed_count_as_drops_and_others_do_not():
    """A forget takes the pages with the inode: for a sample the orders still need it is a
    drop as a lost read's (the read-ahead passed over it as held), for one they no longer
    need it is not."""
    n = 10 * MIN_DROPS
    stats, view = held_view(n)
    assert not any(view.forgot(s, needed=False) for s in range(n // 2))
    assert not view.drops and stats.kernel_forgotten == n // 2 and view.holds(n - 1)
    told = [view.forgot(s, needed=True) for s in range(n // 2, n)]
    assert told.count(True) == 1 and told.index(True) == MIN_DROPS - 1  # (none opened)
    assert view.drops and not view.held.any() and stats.kernel_dropped == 0


def test_the_kernel_dropping_everything_late_in_an_order_is_found_after_as_many_misses():
    """Pushed samples opened and found held (1,000 of them, or 100,000: a long epoch), then
    the kernel drops every page (as `drop_caches`, or reclaim, mid-epoch): the flags are
    cleared after at most about DROP_SHARE of DROP_WINDOW drops, however far into the order
    (it took a tenth of every sample opened under the order, before: 10,000 misses at
    100,000, and the read-ahead passed over all of them meanwhile)."""
    found = []
    for before in (1_000, 100_000):
        n = before + DROP_WINDOW
        stats, view = held_view(n, opened=before)
        misses = 0
        for s in range(before, n):
            view.opened(s)
            misses += 1
            if view.lost(s):
                break
        assert view.drops and not view.held.any()
        found.append(misses)
    assert max(found) <= 1.2 * DROP_SHARE * DROP_WINDOW, found


def test_pushes_from_several_fetch_threads_at_once_lose_no_count():
    """Fetch threads push at once (KernelView.push): every push and every skip is counted,
    even when a thread is switched out between reading a count and writing it back (the
    counts below give up the GIL as they are read: the worst interleaving)."""
    threads, batches, size = 8, 50, 5
    n = threads * batches * size

    class Yielding(Stats):
        def __getattribute__(self, name):
            value = super().__getattribute__(name)
            if name in ("pushed", "push_skipped"):
                time.sleep(0)  # (between this read and its write back)
            return value

    stats = Yielding()
    view = KernelView(2 * n, stats, Kernel())
    view.held[n:] = True  # (the second half is held already: every push of it is skipped)
    start = threading.Barrier(threads)

    def pusher(t):
        start.wait(timeout=60)
        for b in range(batches):
            first = (t * batches + b) * size
            fresh = [(sid, b"x") for sid in range(first, first + size)]
            view.push(fresh + [(n + sid, b"x") for sid, _ in fresh])

    workers = [threading.Thread(target=pusher, args=(t,)) for t in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert (stats.pushed, stats.push_skipped) == (n, n)
    assert view.held.all()
