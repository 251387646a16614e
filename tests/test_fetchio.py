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


def test_the_compiled_reads_stop_after_least_once_the_budget_is_spent(tricky):
    from fusefs import _fetchio
    _, dst, files = tricky
    ix = Index.load(os.path.join(dst, INDEX_NAME))
    s = max(range(ix.n_files), key=lambda s: int(ix.size[s]))
    fd = os.open(os.path.join(dst, ix.chunks[int(ix.chunk[s])].path), os.O_RDONLY)
    try:
        one = (fd, int(ix.offset[s]), int(ix.size[s]), [(0, int(ix.size[s]), int(ix.checksum[s]))])
        want = files[os.fsdecode(ix.file_path(s))]
        assert _fetchio.read_verified([one] * 5) == [(len(want), [want])] * 5
        assert len(_fetchio.read_verified([one] * 5, 2)) == 2  # (budget 0)
        assert len(_fetchio.read_verified([one] * 5, 0)) == 1  # at least one read
        assert len(_fetchio.read_verified([one] * 5, 2, 3600 * 10**6)) == 5
        assert len(_fetchio.read_verified([one] * 5, 9, 0)) == 5
    finally:
        os.close(fd)


def test_bad_arguments_are_refused(tricky):
    from fusefs import _fetchio
    src, dst, files = tricky
    ix = Index.load(os.path.join(dst, INDEX_NAME))
    fd = os.open(os.path.join(dst, ix.chunks[0].path), os.O_RDONLY)
    try:
        with pytest.raises(ValueError, match="overlap"):
            _fetchio.read_verified([(fd, 0, 100, [(0, 60, 0), (50, 10, 0)])])
        with pytest.raises(ValueError, match="leave the read"):
            _fetchio.read_verified([(fd, 0, 100, [(90, 20, 0)])])
        with pytest.raises(TypeError):
            _fetchio.read_verified([(fd, 0, 100)])
        assert _fetchio.read_verified([(-1, 0, 10, [(0, 10, 0)])]) == [errno.EBADF]
        assert _fetchio.read_verified([]) == []
    finally:
        os.close(fd)


def test_a_batch_is_advised_in_one_native_call(tricky, monkeypatch):
    """willneed: every read of a batch but the first, advised in one call of the compiled
    module (which releases the GIL once, not once per read); an empty read is not advised
    (length 0 would advise the rest of the chunk); a bad fd is ignored (a hint), a
    malformed read refused."""
    from fusefs import _fetchio
    src, dst, files = tricky
    ix = Index.load(os.path.join(dst, INDEX_NAME))
    calls = []

    class Spy:
        read_verified = staticmethod(_fetchio.read_verified)

        @staticmethod
        def willneed(reads):
            calls.append(list(reads))
            return _fetchio.willneed(reads)
    monkeypatch.setattr(storemod, "_fetchio", Spy)
    store = ChunkStore(dst, ix, willneed=True)
    sids = np.random.default_rng(3).permutation(ix.n_files).tolist()
    reads = store.coalesce(sids, 0)
    assert len(reads) > 2
    got = store.read_batch(sids, max_gap=0)[0]
    assert all(got[s] == files[os.fsdecode(ix.file_path(s))] for s in sids)
    assert len(calls) == 1
    assert [(off, length) for _, off, length in calls[0]] == [(off, length) for _, off, length, _ in reads[1:]
                                                              if length > 0]
    calls.clear()
    store.advise([(0, 0, 0, []), (0, 100, 10, [])])
    assert [[(off, length) for _, off, length in c] for c in calls] == [[(100, 10)]]
    assert _fetchio.willneed([(-1, 0, 10)]) is None and _fetchio.willneed([]) is None
    with pytest.raises(TypeError):
        _fetchio.willneed([("fd", 0, 10)])
    with pytest.raises(TypeError):
        _fetchio.willneed(5)


def test_native_reads_are_refused_where_they_are_not_built(tricky, monkeypatch):
    src, dst, files = tricky
    ix = Index.load(os.path.join(dst, INDEX_NAME))
    monkeypatch.setattr(storemod, "_fetchio", None)
    with pytest.raises(StoreError, match="not built"):
        ChunkStore(dst, ix, native=True)
    assert ChunkStore(dst, ix).native is False

