"""The control files without a mount (fusefs/control.py, fusefs/idstable.py): the ids and
chunk tables rendered per read, and what open control files may hold (issue 87 items 2 and 5)."""
import errno
import os
import random

import numpy as np
import pytest

from fusefs import control
from fusefs.entries import FsError
from fusefs.idstable import STRIDE, PathsText, chunks_read

from conftest import make_core, write_tree

OTHER = 65534  # (nobody: a user other than root and the daemon's)


@pytest.fixture(scope="module")
def deep(tmp_path_factory):
    """A packed tree of files at the root, in folders of several depths, in runs longer and
    shorter than STRIDE, with names of many lengths."""
    from fusefs.pack import pack
    base = tmp_path_factory.mktemp("ids")
    rng = random.Random(3)
    files = {f"root{i}.bin": b"r" for i in range(5)}
    for c in range(4):
        for i in range(rng.choice([1, STRIDE - 1, STRIDE, 2 * STRIDE + 3])):
            files[f"c{c}/{'x' * rng.randrange(1, 40)}{i}.bin"] = b"f"
    files["a/b/c/d/e/" + "n" * 200 + ".bin"] = b"deep"
    write_tree(base / "src", files)
    pack(str(base / "src"), str(base / "dst"), chunk_count=17, progress=False)
    return str(base / "dst")


def _whole(ix) -> bytes:
    return b"".join(ix.file_path(i) + b"\0" for i in range(ix.n_files))


def test_the_ids_table_read_at_any_offset_is_the_whole_tables_slice(deep):
    core = make_core(deep)
    whole, text = _whole(core.index), PathsText(core.index)
    assert text.size == len(whole)
    rng = random.Random(5)
    cases = [(0, len(whole)), (0, 1), (len(whole) - 1, 10), (len(whole), 10), (len(whole) + 5, 1), (3, 0)]
    cases += [(rng.randrange(len(whole)), rng.choice([1, 7, 100, 4096, 1 << 17])) for _ in range(300)]
    for off, size in cases:
        assert text.read(off, size) == whole[off:off + size], (off, size)
    # read in pieces, as a reader does, it is the table, whatever the piece
    for piece in (1, 3, 64, 4096):
        got = b"".join(text.read(off, piece) for off in range(0, len(whole), piece))
        assert got == whole


def test_the_chunk_table_read_at_any_offset_is_the_arrays_slice(deep):
    core = make_core(deep)
    whole = core.index.chunk.astype("<u4").tobytes()
    for off in range(0, len(whole) + 3):
        for size in (1, 2, 3, 4, 5, 9, 1 << 16):
            assert chunks_read(core.index.chunk, off, size) == whole[off:off + size], (off, size)


def test_open_ids_and_chunks_hold_no_copy_of_their_table(deep):
    """Before, each open of `.fusefs/chunks` kept a copy of the table (4 bytes a sample) and
    `.fusefs/ids` the whole path table, for as long as it was open."""
    core = make_core(deep)
    ns = core.control
    fhs = [ns.open(ns.lookup(name).ino, os.O_RDONLY, 0).fh for name in (b"ids", b"chunks") for _ in range(50)]
    assert all(ns._handles[fh].content is None for fh in fhs)
    assert ns.read(fhs[0], 0, 1 << 20) == _whole(core.index)
    assert ns.read(fhs[-1], 0, 1 << 20) == core.index.chunk.astype("<u4").tobytes()
    for fh in fhs:
        ns.release(fh)
    assert ns.open_handles == 0


def _hooks(**kw):
    args = dict(statistics=lambda: {"text": "s" * 2000}, ids_read=lambda off, size: b"",
                chunks_read=lambda off, size: b"", trusted=lambda uid: uid in (None, 0),
                control_gid=None, started=0.0)
    args.update(kw)
    return control.ControlHooks(**args)


@pytest.mark.parametrize("name", [b"chunks", b"stats"])
def test_another_users_control_opens_are_bounded_and_given_back(name):
    """Issue 87 item 2: another user who holds opens of control files gets at most
    UNTRUSTED_HANDLES of them, whose texts at most UNTRUSTED_BYTES together; an open past
    either is ENFILE; closes give the room back, and root's opens are never refused."""
    ns = control.ControlNamespace(_hooks(), 100)
    ino = ns.lookup(name).ino
    held, refused = [], 0
    for _ in range(control.UNTRUSTED_HANDLES + 50):
        try:
            held.append(ns.open(ino, os.O_RDONLY, OTHER).fh)
        except FsError as e:
            assert e.errno == errno.ENFILE
            refused += 1
    if name == b"chunks":  # (streamed: each holds nothing, the count bounds them)
        assert len(held) == control.UNTRUSTED_HANDLES and ns.untrusted_bytes == 0
    else:  # (each holds its text, about 2 KB)
        assert 0 < len(held) < control.UNTRUSTED_HANDLES
        assert ns.untrusted_bytes <= control.UNTRUSTED_BYTES < ns.untrusted_bytes + 2100
    assert refused == control.UNTRUSTED_HANDLES + 50 - len(held) == ns.counters()["control_opens_refused"]
    mine = [ns.open(ino, os.O_RDONLY, 0).fh for _ in range(10)]  # (root: never refused)
    ns.release(held.pop())
    held.append(ns.open(ino, os.O_RDONLY, OTHER).fh)  # (a close gives room back)
    for fh in held + mine:
        ns.release(fh)
    assert (ns.untrusted_handles, ns.untrusted_bytes, ns.open_handles) == (0, 0, 0)


def test_an_empty_dataset_has_an_empty_ids_table(tmp_path):
    from fusefs.index import Index
    write_tree(tmp_path / "src", {"empty/": None})
    from fusefs.pack import pack
    pack(str(tmp_path / "src"), str(tmp_path / "dst"), progress=False)
    ix = Index.load(str(tmp_path / "dst" / "index.fusefs"))
    assert PathsText(ix).read(0, 100) == b"" and PathsText(ix).size == 0
    assert chunks_read(np.zeros(0, np.uint32), 0, 10) == b""
