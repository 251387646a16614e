"""Faults and bad input (issue 8): backend errors retried then EIO for the affected reads
only, corrupt samples remembered, damaged or unsafe indexes refused, dead mounts cleared,
control files writable only by the user who mounted (or a control group)."""
import errno
import os
import signal
import subprocess
import time

import numpy as np
import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fusefs.config import MountConfig
from fusefs.core import Core
from fusefs.entries import FsError
from fusefs.index import INDEX_NAME, Index, IndexFormatError
from fusefs.mount import is_dead_mount
from testkit.mounts import is_mounted, running_mount, stop_mount
from fusefs.store import ChunkStore

from conftest import corrupt_sample, fusefs_cmd, make_core, read_tree, read_whole, serving


class FlakyStore(ChunkStore):
    """Reads of the chunks in `down` fail with EIO; the first `flaky` reads of the others too
    (reads in Python, through read_range; the compiled reads' errors: test_fetchio.py)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, native=False, **kw)
        self.down, self.flaky, self.calls = set(), 0, 0

    def read_range(self, k, offset, length):
        self.calls += 1
        if k in self.down or self.flaky > 0:
            self.flaky = max(0, self.flaky - 1)
            raise OSError(errno.EIO, "injected backend error")
        return super().read_range(k, offset, length)


def _flaky_core(dst, io_timeout=0.0):
    """A core over FlakyStore; io_timeout 0: a read gives up after its retries (soft)."""
    ix = Index.load(os.path.join(dst, INDEX_NAME))
    core = Core(ix, FlakyStore(dst, ix), MountConfig.of(retries=3, io_timeout=io_timeout))
    core.fetcher.backoff = 0.01
    return core


class ComesBack(FlakyStore):
    """Reads of the chunks in `down` fail until `back_after` of them have failed: a node that
    restarts while its readers wait."""

    back_after = 25

    def read_range(self, k, offset, length):
        if k in self.down:
            self.failed = getattr(self, "failed", 0) + 1
            if self.failed > self.back_after:
                self.down.discard(k)
        return super().read_range(k, offset, length)


def test_a_read_waits_for_a_node_that_comes_back_while_the_others_are_served(tricky, caplog):
    """The default (io_timeout): a read of a sample on a node that does not answer waits for
    it, reads from the other nodes are served meanwhile, and when the node answers again the
    waiting read gets its bytes: no EIO, one log line for down and one for up."""
    src, dst, files = tricky
    ix = Index.load(os.path.join(dst, INDEX_NAME))
    core = Core(ix, ComesBack(dst, ix), MountConfig.of(retries=3, io_timeout=600))
    core.fetcher.backoff, core.fetcher.max_backoff = 0.01, 0.05
    store = core.store
    nonempty = [i for i in range(ix.n_files) if ix.size[i] > 0]
    dead_chunk = int(ix.chunk[nonempty[0]])
    waiting = nonempty[0]
    alive = [i for i in nonempty if ix.chunk[i] != dead_chunk][:10]
    served_while_down = []

    async def go():
        async with serving(core):
            store.down.add(dead_chunk)
            async with trio.open_nursery() as nursery:
                got = {}

                async def wait_for_it():
                    got["bytes"] = await read_whole(core, waiting)
                nursery.start_soon(wait_for_it)
                for sid in alive:
                    assert await read_whole(core, sid) == files[os.fsdecode(ix.file_path(sid))]
                    served_while_down.append(dead_chunk in store.down)
            assert got["bytes"] == files[os.fsdecode(ix.file_path(waiting))]
    with caplog.at_level("WARNING", logger="fusefs"):
        trio.run(go)
    s = core.statistics()
    assert s["eio"] == 0 and served_while_down[0]  # (served while the node was still down)
    assert store.failed > ComesBack.back_after  # (it did wait: every failed try counted)
    lines = [r.getMessage() for r in caplog.records]
    assert sum("does not answer" in m for m in lines) == 1
    assert sum("answers again" in m for m in lines) == 1
    assert sum("retry" in m for m in lines) <= 3  # (retries logged until it is marked down)


def test_failed_backend_reads_are_retried_then_eio_for_those_samples_only(tricky):
    src, dst, files = tricky
    core = _flaky_core(dst)
    ix, store = core.index, core.store
    nonempty = [i for i in range(ix.n_files) if ix.size[i] > 0]
    dead_chunk = int(ix.chunk[nonempty[0]])
    on_dead = [i for i in nonempty if ix.chunk[i] == dead_chunk]
    alive = [i for i in nonempty if ix.chunk[i] != dead_chunk][:10]

    async def go():
        async with serving(core):
            store.flaky = 2  # transient: the first two reads fail, the retry succeeds
            assert await read_whole(core, alive[0]) == files[os.fsdecode(ix.file_path(alive[0]))]
            store.down.add(dead_chunk)  # a node goes away
            calls = []
            for sid in on_dead[:2]:
                before = store.calls
                with pytest.raises(FsError) as e:
                    await read_whole(core, sid)
                assert e.value.errno == errno.EIO
                calls.append(store.calls - before)
            # the first read waits out the retries and marks the node down; the next fails fast
            assert calls == [1 + 3, 1]
            assert core.statistics()["nodes"][ix.nodes[0]]["down"]
            for sid in alive:  # everything else is served
                assert await read_whole(core, sid) == files[os.fsdecode(ix.file_path(sid))]
            store.down.clear()  # the node comes back: served again, no remount
            assert await read_whole(core, on_dead[0]) == files[os.fsdecode(ix.file_path(on_dead[0]))]
    trio.run(go)
    s = core.statistics()
    node = s["nodes"][ix.nodes[0]]
    assert s["eio"] == 2 and s["backend_retries"] == 2 + 3
    assert node["errors"] >= 2 + 4 + 1 and node["failed_samples"] >= 2
    assert not node["down"]  # a read succeeded: the node is up again


def test_corrupt_sample_is_remembered_not_reread(tricky, tmp_path, caplog):
    src, dst, files = tricky
    ix, victim, path = corrupt_sample(dst, tmp_path / "dst", "cat/img 005.jpg", at=-1)
    core = make_core(str(tmp_path / "dst"))

    async def go():
        async with serving(core):
            for _ in range(3):
                with pytest.raises(FsError):
                    await read_whole(core, victim)
    trio.run(go)
    s = core.statistics()
    assert s["eio"] == 3 and s["corrupt_samples"] == 1
    assert s["backend_samples"] + s["nodes"][ix.nodes[0]]["failed_samples"] == 1  # read once
    assert s["backend_retries"] == 0  # bad bytes are not retried
    assert sum("EIO" in r.getMessage() for r in caplog.records) == 1


# ---- the index loader -------------------------------------------------------------------
def _with_names(ix: Index, names: dict) -> Index:
    """A copy of ix where the file (int keys) or folder ('d', int) names are replaced."""
    blob = bytearray(ix.names)
    foff, flen = ix.file_name_off.copy(), ix.file_name_len.copy()
    doff, dlen = ix.dir_name_off.copy(), ix.dir_name_len.copy()
    for key, name in names.items():
        off, ln = (doff, dlen) if isinstance(key, tuple) else (foff, flen)
        i = key[1] if isinstance(key, tuple) else key
        off[i], ln[i] = len(blob), len(name)
        blob += name
    arrays = {k: getattr(ix, k) for k in ix.__dict__ if isinstance(getattr(ix, k), np.ndarray)}
    arrays.update(file_name_off=foff, file_name_len=flen, dir_name_off=doff, dir_name_len=dlen)
    return Index(arrays, bytes(blob), ix.classes, ix.chunks, ix.nodes)


@pytest.mark.parametrize("names, why", [
    ({0: b"/etc/passwd"}, "'/'"),
    ({0: b"a\0b"}, "NUL"),
    ({0: b".."}, "'..'"),
    ({("d", 1): b".."}, "'..'"),
    ({0: b"."}, "'.'"),
    ({0: b""}, "empty"),
    ({1: b"same", 2: b"same"}, "duplicate"),
    ({("d", 0): b"root"}, "root directory has a name"),
    ({("d", 1): b".fusefs"}, "reserved"),
])
def test_index_with_unsafe_paths_is_refused(tricky, names, why):
    ix = Index.load(os.path.join(tricky[1], INDEX_NAME))
    first = int(ix.dir_first_file[ix.file_dir[1]])
    names = {(k if isinstance(k, tuple) else first + k): v for k, v in names.items()}
    with pytest.raises(IndexFormatError, match=why):
        _with_names(ix, names)


def test_index_with_a_file_and_folder_of_one_name_is_refused(tricky):
    ix = Index.load(os.path.join(tricky[1], INDEX_NAME))
    sub = int(ix.dir_first_sub[0])  # a folder in the root, and a file in the root
    root_file = int(ix.dir_first_file[0])
    with pytest.raises(IndexFormatError, match="same name"):
        _with_names(ix, {root_file: ix.dir_name(sub)})


def _set(key, at, value):
    """An edit_arrays for craft_index: array key's entry at (an int, or a function of the
    array) set to value (or a function of the array)."""
    def edit(k, arr):
        if k == key:
            i = at(arr) if callable(at) else at
            arr[i] = value(arr) if callable(value) else value
    return edit


# One crafted index per structural check of index.py (each re-checksummed, so the parser
# reaches the check): (what is edited, the error it must give). Deleting any one check
# from Index._check, _check_samples, _check_names or from_bytes fails its case here (each
# case was tried against its check removed: docs/TESTING.md).
STRUCTURAL = [
    ("mode", _set("mode", 0, 0o104755), dict(), "more than permission bits"),
    ("file name offset", _set("file_name_off", 0, 1 << 40), dict(), "file name lies outside"),
    ("dir name offset", _set("dir_name_off", 1, 1 << 40), dict(), "directory name lies outside"),
    ("dir parent", _set("dir_parent", 1, 7), dict(), "breadth-first tree"),
    ("dir first file", _set("dir_first_file", 0, 1 << 40), dict(), "entries lie outside"),
    ("file dir", _set("file_dir", 0, 1 << 20), dict(), "file parents are inconsistent"),
    ("sub runs", _set("dir_nsubs", 0, 0), dict(), "runs of subfolders"),
    ("file runs", _set("dir_nfiles", 0, lambda a: a[0] + 1), dict(), "runs of files|entries lie outside"),
    ("chunk id", _set("chunk", 0, 1 << 20), dict(), "names a chunk that does not exist"),
    ("offset", _set("offset", 0, 1 << 40), dict(), "outside its chunk's data"),
    ("overlap", lambda k, a: a.__setitem__(1, a[0]) if k == "offset" else None, dict(same_chunk=True),
     "overlap|outside its chunk"),
    ("chunk path", lambda k, a: None, dict(chunk_path="../elsewhere"), "not a plain path"),
    ("chunk node", lambda k, a: None, dict(chunk_node=99), "names node 99"),
    ("chunk size", lambda k, a: None, dict(chunk_size=-1), "size or count out of range"),
    ("chunk twice", lambda k, a: None, dict(chunk_twice=True), "same path"),
    ("array type", lambda k, a: None, dict(dtype=("size", "<u4")), "has type"),
    ("array length", lambda k, a: None, dict(length=("mode", -1)), "negative length"),
    ("array set", lambda k, a: None, dict(drop="label"), "arrays are not the index's"),
    ("name with a slash", None, dict(name=b"a/b"), "'/' or a NUL"),
    ("file array short", None, dict(shorten={"mode": 1}), "array mode has .* entries, expected"),
    ("dir array short", None, dict(shorten={"dir_mode": 1}), "array dir_mode has .* entries, expected"),
    ("no root", None, dict(shorten={k: None for k in ("dir_name_off", "dir_name_len", "dir_parent",
                                                      "dir_mtime_ns", "dir_mode", "dir_first_file",
                                                      "dir_nfiles", "dir_first_sub", "dir_nsubs")}),
     "no root directory"),
]


def _shorten(raw: bytes, cut: dict) -> bytes:
    """raw with arrays cut short (key -> entries fewer; None: to none), their checksums and
    the metadata's made valid again."""
    import json
    import struct
    import xxhash
    head = struct.Struct("<8sIIQQ")
    magic, version, flags, meta_len, _ = head.unpack_from(raw, 0)
    meta = json.loads(raw[head.size:head.size + meta_len])
    for key, fewer in cut.items():
        dtype, length, rel, _ = meta["arrays"][key]
        length = 0 if fewer is None else length - fewer
        arr = np.frombuffer(raw, dtype=dtype, count=length, offset=meta["base"] + rel)
        meta["arrays"][key][1], meta["arrays"][key][3] = length, xxhash.xxh3_64_intdigest(arr)
    blob = json.dumps(meta, sort_keys=True).encode().ljust(meta["base"] - head.size)
    return head.pack(magic, version, flags, len(blob), xxhash.xxh3_64_intdigest(blob)) + blob + raw[meta["base"]:]


def _edit_meta(opts):
    def edit(meta):
        if "chunk_path" in opts:
            meta["chunks"][0][0] = opts["chunk_path"]
        if "chunk_node" in opts:
            meta["chunks"][0][1] = opts["chunk_node"]
        if "chunk_size" in opts:
            meta["chunks"][0][2] = opts["chunk_size"]
        if opts.get("chunk_twice"):
            meta["chunks"][1][0] = meta["chunks"][0][0]
        if "dtype" in opts:
            key, dtype = opts["dtype"]
            meta["arrays"][key][0] = dtype
        if "length" in opts:
            key, length = opts["length"]
            meta["arrays"][key][1] = length
        if "drop" in opts:
            del meta["arrays"][opts["drop"]]
    return edit


@pytest.mark.parametrize("what, edit, opts, why", STRUCTURAL, ids=[c[0] for c in STRUCTURAL])
def test_each_structural_check_refuses_its_crafted_index(tricky, what, edit, opts, why):
    """A valid index with one field broken and every checksum made valid again is refused
    with that field's own one-line reason (never another exception, never loaded)."""
    from conftest import craft_index
    raw = open(os.path.join(tricky[1], INDEX_NAME), "rb").read()
    ix = Index.from_bytes(raw)
    assert len(ix.chunks) >= 2
    if "name" in opts:  # (the name table is an array of bytes: put the bad name at file 0's place)
        off, ln = int(ix.file_name_off[0]), int(ix.file_name_len[0])
        bad = opts["name"][:ln].ljust(ln, b"x") if ln >= len(opts["name"]) else None
        assert bad is not None
        edit = _set("names", slice(off, off + ln), np.frombuffer(bad, np.uint8))
    elif opts.get("same_chunk"):  # samples 0 and 1 must share a chunk for an overlap
        assert ix.chunk[0] == ix.chunk[1]
    if "shorten" in opts:
        crafted = _shorten(raw, opts["shorten"])
    else:
        crafted = craft_index(raw, edit, _edit_meta(opts))
    assert crafted is not None
    with pytest.raises(IndexFormatError) as e:
        Index.from_bytes(crafted)
    assert __import__("re").search(why, str(e.value)) and "\n" not in str(e.value), str(e.value)


@given(st.data())
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_mutated_index_arrays_are_refused_or_load_whole(tricky, data):
    """Random entries of random arrays changed, checksums made valid again (so the
    structural checks are what decides): the index is refused with IndexFormatError, or it
    loads and every sample lies inside its chunk's data, with a path of its own."""
    from conftest import craft_index
    raw = open(os.path.join(tricky[1], INDEX_NAME), "rb").read()
    keys = sorted(Index.from_bytes(raw).__dict__)
    edits = {}
    for _ in range(data.draw(st.integers(1, 3))):
        key = data.draw(st.sampled_from([k for k in keys if k in ("file_name_off", "file_name_len", "file_dir",
                                                                  "chunk", "offset", "size", "mode",
                                                                  "dir_parent", "dir_first_file", "dir_nfiles",
                                                                  "dir_first_sub", "dir_nsubs", "dir_mode")]))
        edits[key] = (data.draw(st.integers(0, 10 ** 6)), data.draw(st.integers(0, 2 ** 31)))

    def edit(key, arr):
        if key in edits and len(arr):
            at, value = edits[key]
            arr[at % len(arr)] = np.asarray(value, dtype=np.int64).astype(arr.dtype)  # (wraps to its type)
    crafted = craft_index(raw, edit)
    try:
        ix = Index.from_bytes(crafted)
    except IndexFormatError as e:
        assert "\n" not in str(e)
        return
    paths = {ix.file_path(i) for i in range(ix.n_files)}
    assert len(paths) == ix.n_files
    sizes = np.array([c.size for c in ix.chunks], dtype=np.uint64)[ix.chunk]
    assert np.all(ix.offset + ix.size <= sizes)


# ---- mounts ------------------------------------------------------------------------------
def test_dead_mount_is_cleared_by_mount_and_by_umount(tricky, tmp_path):
    src, dst, files = tricky
    mnt = str(tmp_path / "mnt")
    try:
        for clear_with in ("mount", "umount"):
            with running_mount(dst, mnt) as (proc, _):
                proc.send_signal(signal.SIGKILL)
                proc.wait(timeout=60)
                with pytest.raises(OSError) as e:
                    os.listdir(mnt)
                assert e.value.errno == errno.ENOTCONN and is_dead_mount(mnt)
                if clear_with == "mount":
                    r = subprocess.run(fusefs_cmd("mount", dst, mnt, "--background"),
                                       capture_output=True, text=True, timeout=60)
                    assert r.returncode == 0 and "dead mount" in r.stderr, r.stderr
                    assert read_tree(mnt) == read_tree(src)
                    r = subprocess.run(fusefs_cmd("umount", mnt), capture_output=True, text=True, timeout=300)
                    assert r.returncode == 0
                else:
                    r = subprocess.run(fusefs_cmd("umount", mnt), capture_output=True, text=True, timeout=300)
                    assert r.returncode == 0 and "dead mount" in r.stderr, r.stderr
                deadline = time.monotonic() + 10
                while is_mounted(mnt) and time.monotonic() < deadline:
                    time.sleep(0.05)
                assert not is_mounted(mnt) and os.listdir(mnt) == []
    finally:
        stop_mount(mnt)


def test_a_failed_read_retires_the_chunk_fd_once_no_read_uses_it(tricky):
    store = make_core(tricky[1]).store
    first = store._acquire(0)
    other = store._acquire(0)  # a second read of the same chunk, still in progress
    assert other is first and first.users == 2
    store._release(0, first, failed=True)
    os.fstat(first.fd)  # not closed under the read still using it
    assert 0 not in store._fds  # but the next read opens the chunk again
    store._release(0, other, failed=False)
    with pytest.raises(OSError) as e:
        os.fstat(first.fd)
    assert e.value.errno == errno.EBADF
    assert store.read_range(0, 0, 8) == b"FUSEFSCK" and store._fds[0] is not first
