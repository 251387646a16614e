"""The compiled fetch reads (fusefs/_fetchio.c; ChunkStore(native=True), the default where
it is built) give what the reads in Python give: the same bytes, and the same errors for a
corrupt sample, a short chunk and a failing read. And read_batch hands results on in
groups of at least 1, 1, 2, 4... reads that go on within a time budget; a group of pushes
goes to the kernel in one call."""
import errno
import os
import shutil

import numpy as np
import pytest

from fusefs import store as storemod
from fusefs.index import INDEX_NAME, Index
from fusefs.beneath import NotRegular
from fusefs.store import ChunkStore, CorruptSample, ShortRead, StoreError

from conftest import corrupt_sample


def both(dst, ix, sids, **kw):
    """read_batch of sids by the compiled reads and by Python: (native, python), each
    (results, reads, bytes, [the results of each on_read call])."""
    out = []
    for native in (True, False):
        calls = []
        got, nreads, nbytes = ChunkStore(dst, ix, native=native).read_batch(
            sids, on_read=lambda got, n, b: calls.append((got, n, b)), **kw)
        out.append((got, nreads, nbytes, calls))
    return out


def same(a, b) -> bool:
    if isinstance(a, Exception) or isinstance(b, Exception):
        return type(a) is type(b) and str(a) == str(b) and getattr(a, "errno", None) == getattr(b, "errno", None)
    return type(a) is bytes and type(b) is bytes and a == b


def test_the_c_reads_scratch_holds_the_gaps_the_python_side_reads_through():
    """One number, two languages: _fetchio.c's SCRATCH (where a gap between two samples of
    one read goes) is store.MAX_GAP (the largest gap coalesce reads through)."""
    import re
    from conftest import REPO
    c = open(os.path.join(REPO, "fusefs", "_fetchio.c")).read()
    shift = re.search(r"#define SCRATCH \((\d+) << (\d+)\)", c)
    assert shift and int(shift.group(1)) << int(shift.group(2)) == storemod.MAX_GAP


def test_the_compiled_reads_are_built_and_used(tricky):
    """scripts/setup.sh builds them (setup.py); the figures in docs are measured with them."""
    src, dst, files = tricky
    assert storemod._fetchio is not None
    assert ChunkStore(dst, Index.load(os.path.join(dst, INDEX_NAME))).native is True


@pytest.mark.parametrize("max_gap", [0, 256 << 10])
@pytest.mark.parametrize("group_s", [0, 3600])
def test_native_and_python_reads_agree(tricky, max_gap, group_s):
    """Random batches of the tricky set (empty files, 1 byte to 300 KB, coalesced reads of
    neighbours with max_gap): the same bytes, reads and bytes read, and the same groups
    (the least ones with no time budget, one group with a budget no batch uses up)."""
    src, dst, files = tricky
    ix = Index.load(os.path.join(dst, INDEX_NAME))
    rng = np.random.default_rng(0)
    for _ in range(40):
        sids = rng.choice(ix.n_files, size=int(rng.integers(1, ix.n_files)), replace=False).tolist()
        (a, na, ba, ca), (b, nb, bb, cb) = both(dst, ix, sids, max_gap=max_gap, group_s=group_s)
        for s in sids:
            assert a[s] == b[s] == files[os.fsdecode(ix.file_path(s))]
            assert type(a[s]) is bytes
        assert (na, ba) == (nb, bb) and na <= len(sids)
        # the same groups, each with the same reads and bytes, which add up to the totals
        assert [(sorted(g), n, by) for g, n, by in ca] == [(sorted(g), n, by) for g, n, by in cb]
        assert (sum(n for _, n, _ in ca), sum(by for _, _, by in ca)) == (na, ba)


def test_a_corrupt_sample_fails_alone_in_both(tricky, tmp_path):
    src, dst, files = tricky
    ix, bad, _ = corrupt_sample(dst, tmp_path / "copy", "cat/img 004.jpg", at=-1)
    copy = str(tmp_path / "copy")
    same_chunk = [s for s in range(ix.n_files) if ix.chunk[s] == ix.chunk[bad]]
    (a, *_), (b, *_) = both(copy, ix, same_chunk)
    assert isinstance(a[bad], CorruptSample) and "checksum mismatch" in str(a[bad])
    assert all(same(a[s], b[s]) for s in same_chunk)
    assert all(type(a[s]) is bytes for s in same_chunk if s != bad)


def test_a_short_chunk_and_a_failing_read_give_the_same_errors(tricky, tmp_path):
    src, dst, files = tricky
    copy = tmp_path / "copy"
    shutil.copytree(dst, copy)
    ix = Index.load(os.path.join(copy, INDEX_NAME))
    sizes = ix.size
    big = max(range(ix.n_files), key=lambda s: int(sizes[s]))
    k = int(ix.chunk[big])
    path = os.path.join(copy, ix.chunks[k].path)
    with open(path, "r+b") as f:  # the chunk ends in the middle of its largest sample
        f.truncate(int(ix.offset[big]) + int(sizes[big]) // 2)
    on_k = [s for s in range(ix.n_files) if ix.chunk[s] == k]
    (a, *_), (b, *_) = both(str(copy), ix, on_k)
    # (a short read is not corruption: retried like a failed read, never remembered)
    assert isinstance(a[big], ShortRead) and not isinstance(a[big], CorruptSample)
    assert "short read" in str(a[big]) and a[big].errno == errno.EIO
    assert all(same(a[s], b[s]) for s in on_k)

    os.unlink(path)
    os.mkdir(path)  # a folder is not opened as a chunk: every sample of the chunk fails, both ways
    (a, na, _, _), (b, nb, _, _) = both(str(copy), ix, on_k)
    assert all(isinstance(a[s], NotRegular) and "a folder" in str(a[s]) and same(a[s], b[s])
               for s in on_k if sizes[s] > 0)
    assert na == nb == 0


@pytest.mark.parametrize("native", [True, False])
def test_groups_make_their_least_reads_and_go_on_within_their_budget(tricky, native):
    """A batch of 16 reads: with a budget no read uses up, in one group, or two when a
    reader waits for the first; with reads slower than the budget (of the 16 largest
    samples, 1 us), in groups of the least 1, 1, 2, 4, 8 reads."""
    _, dst, files = tricky
    ix = Index.load(os.path.join(dst, INDEX_NAME))
    store = ChunkStore(dst, ix, native=native, willneed=False)
    sids = []
    for s in sorted(range(ix.n_files), key=lambda s: -int(ix.size[s])):
        if len(sids) < 16 and len(store.coalesce(sids + [s], 0)) == len(sids) + 1:
            sids.append(s)  # (not read along with one taken before)
    assert len(sids) == 16 and int(ix.size[sids[-1]]) >= 10_000

    def groups(**kw):
        calls = []
        got = store.read_batch(sids, 0, lambda got, n, b: calls.append(n), **kw)[0]
        assert all(got[s] == files[os.fsdecode(ix.file_path(s))] for s in sids)
        return calls
    assert groups(group_s=3600) == [16]
    assert groups(group_s=3600, first_alone=True) == [1, 15]
    assert groups(group_s=1e-6) == groups(group_s=0) == [1, 1, 2, 4, 8]
    assert groups(group_s=0, first_alone=True) == [1, 1, 2, 4, 8]


def one_read_group(ix, fd, sids, lengths=None, **kw):
    """_fetchio.read_group over reads of chunk 0 (fd), one per sample of sids, each the
    sample's own bytes (or lengths[i] bytes from its start)."""
    from fusefs import _fetchio
    reads = np.array([(0, int(ix.offset[s]), int(ix.size[s]) if lengths is None else lengths[i], 1)
                      for i, s in enumerate(sids)], np.int64).reshape(-1, 4)
    fds = np.array([fd], np.int64)
    return _fetchio.read_group(reads.tobytes(), np.array(sids, np.int64).tobytes(), 0, 0,
                               np.array([0], np.int64), fds,
                               ix.offset, ix.size, ix.checksum, *kw.pop("args", ()), **kw)


def test_the_compiled_reads_stop_after_least_once_the_budget_is_spent(tricky):
    _, dst, files = tricky
    ix = Index.load(os.path.join(dst, INDEX_NAME))
    s = max((s for s in range(ix.n_files) if ix.chunk[s] == 0), key=lambda s: int(ix.size[s]))
    fd = os.open(os.path.join(dst, ix.chunks[0].path), os.O_RDONLY)
    try:
        want = files[os.fsdecode(ix.file_path(s))]
        assert one_read_group(ix, fd, [s] * 5) == (5, 5, 5 * len(want), [want] * 5, [], 0)
        assert one_read_group(ix, fd, [s] * 5, args=(2,))[0] == 2  # (budget 0)
        assert one_read_group(ix, fd, [s] * 5, args=(0,))[0] == 1  # at least one read
        assert one_read_group(ix, fd, [s] * 5, args=(2, 3600 * 10**6))[0] == 5
        assert one_read_group(ix, fd, [s] * 5, args=(9, 0))[0] == 5
    finally:
        os.close(fd)


def test_bad_arguments_are_refused(tricky):
    from fusefs import _fetchio
    src, dst, files = tricky
    ix = Index.load(os.path.join(dst, INDEX_NAME))
    s = max((s for s in range(ix.n_files) if ix.chunk[s] == 0), key=lambda s: int(ix.size[s]))
    fd = os.open(os.path.join(dst, ix.chunks[0].path), os.O_RDONLY)
    off, size = int(ix.offset[s]), int(ix.size[s])
    fds = np.array([fd], np.int64)
    zero = np.array([0], np.int64)
    group = lambda reads, members, fds=fds: _fetchio.read_group(  # noqa: E731
        np.array(reads, np.int64).tobytes(), np.array(members, np.int64).tobytes(), 0, 0, zero, fds,
        ix.offset, ix.size, ix.checksum)
    try:
        with pytest.raises(ValueError, match="overlap"):  # (one sample twice in a read)
            group([0, off, size, 2], [s, s])
        with pytest.raises(ValueError, match="leave the read"):
            group([0, off, size - 1, 1], [s])
        with pytest.raises(ValueError, match="more members"):
            group([0, off, size, 2], [s])
        with pytest.raises(ValueError, match="not among chunks"):
            group([1, off, size, 1], [s])
        with pytest.raises(IndexError, match="not in the index"):
            group([0, off, size, 1], [ix.n_files])
        with pytest.raises(ValueError, match="8-byte items"):
            _fetchio.read_group(b"123", b"", 0, 0, zero, fds, ix.offset, ix.size, ix.checksum)
        with pytest.raises(TypeError):
            _fetchio.read_group([0, off, size, 1], b"", 0, 0, zero, fds, ix.offset, ix.size, ix.checksum)
        with pytest.raises(ValueError, match="malformed"):  # (a chunk without its fd)
            _fetchio.read_group(b"", b"", 0, 0, np.array([0, 1], np.int64), fds, ix.offset, ix.size, ix.checksum)
        assert group([0, off, size, 1], [s], np.array([-1], np.int64)) == (1, 0, 0, [None], [(0, 0)], 1)
        assert group([0, off, size, 1], [s], np.array([1 << 20], np.int64))[3:] == ([None], [(0, errno.EBADF)], 1)
        assert group([], []) == (0, 0, 0, [], [], 0)
        with pytest.raises(IndexError, match="not in the index"):
            _fetchio.plan([ix.n_files], ix.chunk, ix.offset, ix.size, 0, storemod.MAX_READ)
        with pytest.raises(ValueError, match="differ in length"):
            _fetchio.plan([0], ix.chunk, ix.offset[:-1], ix.size, 0, storemod.MAX_READ)
    finally:
        os.close(fd)


@pytest.mark.parametrize("max_gap", [0, 1000, 256 << 10])
def test_the_compiled_plan_gives_coalesces_reads(tricky, max_gap):
    """_fetchio.plan gives store.ChunkStore.coalesce's reads, in its order, for random
    batches with repeats (each sample read once, where it first comes), empty samples and
    reads capped by max_read."""
    from fusefs import _fetchio
    src, dst, files = tricky
    ix = Index.load(os.path.join(dst, INDEX_NAME))
    store = ChunkStore(dst, ix, native=False)
    rng = np.random.default_rng(max_gap)
    for _ in range(60):
        sids = rng.integers(0, ix.n_files, int(rng.integers(0, 2 * ix.n_files))).tolist()
        max_read = int(rng.choice([1, 50_000, storemod.MAX_READ]))
        want = store.coalesce(sids, max_gap, max_read)
        reads_b, members_b = _fetchio.plan(sids, ix.chunk, ix.offset, ix.size, max_gap, max_read)
        reads = np.frombuffer(reads_b, np.int64).reshape(-1, 4).tolist()
        members = np.frombuffer(members_b, np.int64).tolist()
        got, at = [], 0
        for k, off, length, n in reads:
            got.append((k, off, length, members[at:at + n]))
            at += n
        assert got == [(int(k), int(off), int(length), [int(s) for s in m]) for k, off, length, m in want]
        assert at == len(members) == len(set(sids))


def test_a_batch_is_advised_in_its_first_compiled_group(tricky, monkeypatch):
    """willneed: the compiled reads' first group advises the kernel of every read but the
    first (read_group's advise_from 1, in the same release of the GIL), the later groups of
    none; without willneed, none is."""
    from fusefs import _fetchio
    src, dst, files = tricky
    ix = Index.load(os.path.join(dst, INDEX_NAME))
    calls = []

    class Spy:
        plan = staticmethod(_fetchio.plan)

        @staticmethod
        def read_group(*args):
            calls.append(args[2:4] + args[11:12])  # (start, first member, advise_from)
            return _fetchio.read_group(*args)
    monkeypatch.setattr(storemod, "_fetchio", Spy)
    sids = np.random.default_rng(3).permutation(ix.n_files).tolist()
    assert len(ChunkStore(dst, ix).coalesce(sids, 0)) > 8
    for willneed in (True, False):
        calls.clear()
        got = ChunkStore(dst, ix, willneed=willneed).read_batch(sids, max_gap=0, group_s=0)[0]
        assert all(got[s] == files[os.fsdecode(ix.file_path(s))] for s in sids)
        assert len(calls) > 2 and calls[0] == (0, 0, 1 if willneed else -1)
        assert all(advise == -1 for _, _, advise in calls[1:])
        assert [start for start, _, _ in calls] == sorted(start for start, _, _ in calls)


def test_the_python_reads_advise_every_read_but_an_empty_one(tricky, monkeypatch):
    src, dst, files = tricky
    ix = Index.load(os.path.join(dst, INDEX_NAME))
    advised = []
    monkeypatch.setattr(storemod.os, "posix_fadvise", lambda fd, off, length, how: advised.append((off, length)))
    ChunkStore(dst, ix, native=False).advise([(0, 0, 0, []), (0, 100, 10, [])])
    assert advised == [(100, 10)]


def test_native_reads_are_refused_where_they_are_not_built(tricky, monkeypatch):
    src, dst, files = tricky
    ix = Index.load(os.path.join(dst, INDEX_NAME))
    monkeypatch.setattr(storemod, "_fetchio", None)
    with pytest.raises(StoreError, match="not built"):
        ChunkStore(dst, ix, native=True)
    assert ChunkStore(dst, ix).native is False

