"""What another user of a shared node can do to a root daemon, the tests that need no mount
and no second account (the unit tier; test_abuse.py makes the attacks as that user):
folders, files and indexes another user made or changed (owned by `nobody`), who is
trusted, and the bounds on what a reader can make the daemon hold. Each test asserts that
the attack fails and that the daemon serves on."""
import errno
import os
import pwd
import stat
import threading

import numpy as np
import pytest
import trio
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from fusefs import order as orderfmt
from fusefs.index import INDEX_NAME, Index
from fusefs.local import LocalTier, LocalTierError

from conftest import craft_index, make_core
from conftest import exact_within_budget, run_epoch

OTHER = pwd.getpwnam("nobody").pw_uid  # a user other than the daemon's

# (values at the edges of the index's integer types, for the crafted indexes below)
_EXTREMES = [0, 1, 2, 255, 0o7777, 0o10000, 0o170777, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**63 - 1,
             2**63, 2**64 - 1]


# ---- the local tier's folder ------------------------------------------------------------
def _tier(dst, folder, budget=1 << 30):
    return LocalTier(str(folder), budget, Index.load(os.path.join(dst, INDEX_NAME)))


def _epoch(dst, files, tier, seed=0):
    """One epoch through a core with the tier; the core's statistics (every byte checked
    against the source by run_epoch)."""
    core = make_core(dst, cache_bytes=1 << 20, local=tier)
    ids = list(np.random.default_rng(seed).permutation(core.index.n_files))
    trio.run(run_epoch, core, ids, 3, 8, 0, exact_within_budget(core, files), orderfmt.encode(ids))
    assert tier.wait_written()
    return core.statistics()


@pytest.fixture
def private(tmp_path):
    """A folder only the daemon's user may write, as a local tier's parent must be."""
    os.chmod(tmp_path, 0o700)
    return tmp_path


def test_a_folder_another_user_owns_is_refused(three_nodes, private):
    dst, _ = three_nodes
    folder = private / "shm"
    folder.mkdir(mode=0o700)
    os.chown(folder, OTHER, OTHER)
    with pytest.raises(LocalTierError, match=f"{folder}: owned by uid {OTHER}"):
        _tier(dst, folder)
    assert os.listdir(folder) == []  # nothing made in it


def test_a_folder_others_may_write_is_refused(three_nodes, private):
    dst, _ = three_nodes
    folder = private / "open"
    folder.mkdir()
    os.chmod(folder, 0o777)
    with pytest.raises(LocalTierError, match="writable by others"):
        _tier(dst, folder)
    assert os.listdir(folder) == []


def test_a_parent_another_user_may_change_is_refused(three_nodes, tmp_path):
    """/dev/shm/theirs/cache: whoever owns `theirs` can swap `cache` for a symlink later."""
    dst, _ = three_nodes
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, OTHER, OTHER)
    with pytest.raises(LocalTierError, match=f"{theirs}: owned by uid {OTHER}"):
        _tier(dst, theirs / "cache")
    # a symlinked folder is refused too, whoever made it
    os.chown(theirs, 0, 0)
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(real)
    with pytest.raises(LocalTierError, match="symbolic link"):
        _tier(dst, tmp_path / "link")


def test_a_lock_that_is_a_symlink_is_not_followed(three_nodes, private):
    dst, _ = three_nodes
    victim = private / "victim"
    victim.write_text("root's file\n")
    folder = private / "tier"
    folder.mkdir(mode=0o700)
    (folder / "lock").symlink_to(victim)
    with pytest.raises(LocalTierError, match="lock: not a regular file"):
        _tier(dst, folder)
    assert victim.read_text() == "root's file\n"


def test_a_symlinked_sample_folder_gets_no_samples(three_nodes, private):
    dst, files = three_nodes
    victim = private / "victim"
    victim.mkdir(mode=0o700)
    folder = private / "tier"
    (folder / "samples").mkdir(parents=True, mode=0o700)
    os.chmod(folder, 0o700)
    for k in range(256):  # every sample folder points at the victim
        (folder / "samples" / f"{k:02x}").symlink_to(victim)
    tier = _tier(dst, folder)
    try:
        stats = _epoch(dst, files, tier)
    finally:
        tier.close()
    assert os.listdir(victim) == []
    assert stats["local"]["writes"] > 0  # written to folders of its own instead


def test_a_fifo_in_place_of_a_sample_neither_hangs_nor_is_served(three_nodes, private):
    dst, files = three_nodes
    tier = _tier(dst, private / "tier")
    try:
        _epoch(dst, files, tier)
        sid = int(np.flatnonzero(tier.held)[0])
        path = tier.path(sid)
        os.unlink(path)
        os.mkfifo(path)
        got = {}
        t = threading.Thread(target=lambda: got.update(tier.read_many([sid])))
        t.start()
        t.join(60)  # (a guard: a blocking open of the FIFO would never return)
        assert not t.is_alive() and got == {}
        assert not tier.held[sid] and tier.corrupt == 1
        stats = _epoch(dst, files, tier, seed=1)  # served on, from the backend
        assert stats["eio"] == 0
    finally:
        tier.close()


def test_cached_samples_are_readable_by_the_daemon_only(three_nodes, private):
    dst, files = three_nodes
    tier = _tier(dst, private / "tier")
    try:
        _epoch(dst, files, tier)
    finally:
        tier.close()
    seen = 0
    for dirpath, dirs, names in os.walk(private / "tier"):
        assert stat.S_IMODE(os.stat(dirpath).st_mode) == 0o700, dirpath
        for n in names:
            st = os.stat(os.path.join(dirpath, n))
            assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.geteuid(), n
            seen += 1
    assert seen > 1  # (the lock and the samples)



# ---- opening beneath a folder ------------------------------------------------------------
def test_a_file_opened_beneath_a_folder_is_never_reached_through_a_link(tmp_path):
    """beneath.open_file, with which every chunk, index and tree file is opened: a link as
    the file itself, or as a folder on the way, is refused (ELOOP), not followed, whoever
    made it (no second account needed: the link alone is the attack); a FIFO is refused
    without blocking; the plain file opens."""
    import errno
    from fusefs import beneath
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "real").write_bytes(b"data")
    (tmp_path / "secret").write_bytes(b"root's")
    (tmp_path / "d" / "link").symlink_to(tmp_path / "secret")
    (tmp_path / "linked_dir").symlink_to(tmp_path / "d")
    os.mkfifo(tmp_path / "d" / "fifo")
    top = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fd = beneath.open_file(top, "d/real")
        assert os.read(fd, 10) == b"data"
        os.close(fd)
        for rel in ("d/link", "linked_dir/real", b"d/link"):
            with pytest.raises(OSError) as e:
                os.close(beneath.open_file(top, rel))
            assert e.value.errno == errno.ELOOP, rel
        with pytest.raises(beneath.NotRegular):
            beneath.open_file(top, "d/fifo")
        for rel in ("../secret", "/etc/passwd"):
            with pytest.raises(ValueError):
                beneath.open_file(top, rel)
    finally:
        os.close(top)


# ---- control files ---------------------------------------------------------------------
# Orders come over the control socket (the mount is read-only): an order larger than any valid
# one is refused before a byte of it is read, and at most MAX_CONNECTIONS are served at once
# (tests/test_control_socket.py); here, what that leaves the daemon's memory and who may.
def _hooks(control_gid=None, statistics=dict, socket_path=None):
    from fusefs.control import ControlHooks
    return ControlHooks(statistics=statistics, ids_read=lambda off, size: b"", chunks_read=lambda off, size: b"",
                        trusted=lambda uid: uid in (None, 0), control_gid=control_gid, started=0.0,
                        socket_path=socket_path)


def test_paths_and_orders_are_private_the_stats_public():
    from fusefs.control import ControlNamespace
    ns = ControlNamespace(_hooks(), 100)
    mode = {name: stat.S_IMODE(ns.lookup(name.encode()).mode) for name in ("ids", "order", "stats", "chunks")}
    assert mode == {"ids": 0o400, "order": 0o400, "stats": 0o444, "chunks": 0o444}
    grouped = ControlNamespace(_hooks(control_gid=1234, socket_path="/run/fusefs/x.sock"), 100)
    ids, order = grouped.lookup(b"ids"), grouped.lookup(b"order.3")
    assert (stat.S_IMODE(ids.mode), ids.gid) == (0o440, 1234)
    assert (stat.S_IMODE(order.mode), order.gid) == (0o440, 1234)
    assert stat.S_IMODE(grouped.lookup(b"stats").mode) == 0o444
    link = grouped.lookup(b"control")
    assert stat.S_ISLNK(link.mode) and grouped.readlink(link.ino) == b"/run/fusefs/x.sock"


def test_stats_opened_in_a_loop_by_another_user_are_rendered_at_most_every_quarter_second(monkeypatch):
    from fusefs import control
    calls = []
    now = [1000.0]
    from fusefs import throttle
    monkeypatch.setattr(throttle.time, "monotonic", lambda: now[0])
    ns = control.ControlNamespace(_hooks(statistics=lambda: calls.append(1) or {"opens": len(calls)}), 100)
    ino = ns.lookup(b"stats").ino
    texts = {ns.read(ns.open(ino, os.O_RDONLY, OTHER).fh, 0, 1 << 16) for _ in range(1000)}
    assert len(calls) == 1 and len(texts) == 1  # (another user: the same text again)
    now[0] += control.RENDER_EVERY
    ns.open(ino, os.O_RDONLY, OTHER)
    assert len(calls) == 2
    ns.open(ino, os.O_RDONLY, 0)  # (root, or the daemon's user: always fresh)
    assert len(calls) == 3


def test_only_root_the_daemons_user_and_the_control_group_may_set_orders(tricky):
    _, dst, _ = tricky
    core = make_core(dst)
    me = os.getuid()
    assert core.may_control(0, {0}) and core.may_control(me, set())
    assert not core.may_control(OTHER, {OTHER, 100})
    grouped = make_core(dst, control_gid=100)
    assert grouped.may_control(OTHER, {OTHER, 100}) and not grouped.may_control(OTHER, {OTHER})



def test_the_files_displayed_owner_is_display_only(tricky):
    """`--uid N` (`-o uid=N`) shows the dataset's files as N's; it does not make N trusted:
    N may not set orders, gets the throttled statistics, and the private control files
    (`ids`, the order files) stay the daemon's user's, whom they show as their owner."""
    from fusefs.fs import Operations
    from fusefs.namespace import ROOT as ROOT_INODE
    _, dst, _ = tricky
    core = make_core(dst, uid=OTHER)
    assert not core.trusted(OTHER) and not core.may_control(OTHER, {OTHER})
    assert core.trusted(os.geteuid()) and core.trusted(0)
    ops = Operations(core)
    ctl = trio.run(ops.lookup, ROOT_INODE, b".fusefs")
    assert ctl.st_uid == os.geteuid()
    names = [name for name, _, _ in core.readdir(ctl.st_ino, 0)]
    assert {b"ids", b"stats", b"order"} <= set(names)
    for name in names:
        assert trio.run(ops.lookup, ctl.st_ino, name).st_uid == os.geteuid(), name
    sample = next(name for name, _, _ in core.readdir(ROOT_INODE, 0) if name != b".fusefs")
    assert trio.run(ops.lookup, ROOT_INODE, sample).st_uid == OTHER  # (what --uid is for)


def test_an_order_past_the_budget_is_refused_on_its_headers_and_let_go_of_at_once(tricky, monkeypatch):
    """What a refused order costs counts against the order memory: one past the budget is
    refused from its headers' counts, before its arrays are parsed, and once refused
    nothing holds its bytes (trio's idle worker thread keeps its last result: a traceback
    there would keep the order alive through prepare's frame)."""
    import errno
    import gc
    import weakref
    from fusefs import orders as orders_mod
    from fusefs.entries import FsError
    core = make_core(tricky[1], cache_bytes=32 << 20, order_bytes=8 << 20)
    parsed = []
    real_parse = orders_mod.orderfmt.parse
    monkeypatch.setattr(orders_mod.orderfmt, "parse", lambda *a: parsed.append(1) or real_parse(*a))

    class Order(bytearray):  # (a bytearray that can be watched with a weak reference)
        pass

    async def main():
        data = Order(orderfmt.encode(np.zeros(1 << 20, dtype=np.int64)))
        gone = weakref.ref(data)
        with pytest.raises(FsError) as e:
            await core.orders.commit(1, data)
        assert e.value.errno == errno.EINVAL and "order budget of 8.0 MiB" in str(e.value)
        del data, e
        gc.disable()  # (freed by its count alone, not by a collection)
        try:
            assert gone() is None
        finally:
            gc.enable()
        core.orders.set(1, orderfmt.encode([0, 1]))  # (one within the budget is parsed)
    trio.run(main)
    assert parsed == [1] and core.statistics()["orders_refused"] == 1

# ---- a short read is not corruption ------------------------------------------------------
def test_a_chunk_cut_short_is_eio_at_once_not_an_outage_and_serves_again_restored(tricky, tmp_path):
    """A chunk (or a tar) cut short while mounted answers the read of a sample past its new
    end at once, with EIO and the log line: the node answered, so its reads are not
    retried as an outage (issue 87 item 8: before, they waited the whole --io-timeout),
    the node is not marked down, the sample is not remembered as corrupt, and once the
    chunk is restored it serves again."""
    import shutil
    from fusefs.entries import FsError
    from testkit.mounts import resolve
    _, dst0, files = tricky
    dst = tmp_path / "dst"
    shutil.copytree(dst0, dst)
    core = make_core(str(dst), retries=3, io_timeout=30)
    rel = max((r for r in files if files[r]), key=lambda r: len(files[r]))
    _, sid = resolve(core.index, rel)
    chunk = core.store.chunk_path(int(core.index.chunk[sid]))
    whole = open(chunk, "rb").read()
    with open(chunk, "r+b") as f:
        f.truncate(int(core.index.offset[sid]) + 1)

    async def read():
        """The sample's bytes, or the FsError its read got."""
        from conftest import serving, read_whole
        async with serving(core):
            try:
                return await read_whole(core, sid)
            except FsError as e:
                return e

    got = trio.run(read)
    assert isinstance(got, FsError) and got.errno == errno.EIO and "short read" in str(got)
    stats = core.statistics()
    node = stats["nodes"][core.index.nodes[core.index.chunks[int(core.index.chunk[sid])].node]]
    assert node["retries"] == 0 and not node["down"], node
    assert stats["corrupt_samples"] == 0  # (not remembered as corrupt)
    with open(chunk, "r+b") as f:
        f.write(whole)
    assert trio.run(read) == files[rel]


# ---- crafted indexes with valid checksums ------------------------------------------------
@given(st.data())
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_a_crafted_index_with_valid_checksums_is_refused_or_served_right(tricky, data):
    """Arrays and metadata changed at random, checksums made valid: the index is refused
    with IndexFormatError, or every listing, lookup and getattr of the core over it answers
    (and every listing ends), the fast path takes its tree, and every read gives the right
    bytes or EIO."""
    from fusefs.namespace import ROOT
    from fusefs.index import ARRAY_DTYPES, FILE_ARRAYS, IndexFormatError
    from fusefs.store import ChunkStore
    from fusefs import pyfuse3
    src, dst, files = tricky
    raw = open(os.path.join(dst, INDEX_NAME), "rb").read()
    edits = data.draw(st.lists(st.tuples(st.sampled_from(sorted(ARRAY_DTYPES)), st.integers(0, 1 << 20),
                                         st.sampled_from(_EXTREMES) | st.integers(-2**31, 2**32)),
                               max_size=3))
    meta_edit = data.draw(st.sampled_from(["none", "dtype", "arrays", "chunk_size", "chunk_node",
                                           "chunk_path", "classes", "drop_array"]))

    def edit_arrays(key, arr):
        for k, at, value in edits:
            if k == key and len(arr):
                info = np.iinfo(arr.dtype)
                arr[at % len(arr)] = min(max(value, info.min), info.max)

    def edit_meta(meta):
        if meta_edit == "dtype":
            meta["arrays"]["mode"][0] = data.draw(st.sampled_from(["<u8", "<i4", "<f8", "|u1", "O"]))
        elif meta_edit == "arrays":
            meta["arrays"] = data.draw(st.sampled_from([[], "x", 3, None]))
        elif meta_edit == "chunk_size":
            meta["chunks"][0][2] = data.draw(st.sampled_from(_EXTREMES + [-1, "9", 1.5]))
        elif meta_edit == "chunk_node":
            meta["chunks"][0][1] = data.draw(st.sampled_from([-1, 7, 2**70, "0", None]))
        elif meta_edit == "chunk_path":
            meta["chunks"][0][0] = data.draw(st.sampled_from(["../x", "/etc/passwd", 5, "chunks/../../x"]))
        elif meta_edit == "classes":
            meta["classes"] = data.draw(st.sampled_from([None, {}, 3]))
        elif meta_edit == "drop_array":
            del meta["arrays"][data.draw(st.sampled_from(sorted(FILE_ARRAYS)))]

    crafted = craft_index(raw, edit_arrays, edit_meta)
    if crafted is None:
        event("metadata too long")
        return
    try:
        index = Index.from_bytes(crafted)
    except IndexFormatError as e:
        event(f"refused: {str(e).split('(')[0][:40]}")
        return
    event("loaded")
    from fusefs.core import Core
    core = Core(index, ChunkStore(dst, index))
    pyfuse3.fast_path_tree(core.fast_path_args()["tree"])  # (takes it, or raises OSError: below)
    pyfuse3.fast_path_tree(None)
    core.statfs()
    src_files = {os.fsencode(r): b for r, b in files.items() if b is not None}
    todo = [ROOT]
    while todo:
        ino = todo.pop()
        for name, attr, _ in core.readdir(ino, 0):
            assert core.lookup(ino, name).ino == attr.ino
            core.getattr(attr.ino)
            if stat.S_ISDIR(attr.mode):
                todo.append(attr.ino)
    for sid in range(index.n_files):
        try:
            got = core.store.read_sample(sid)
        except OSError:
            continue  # (EIO for the reader: CorruptSample and ShortRead are OSErrors)
        want = src_files.get(index.file_path(sid))
        assert want is None or got == want or got in src_files.values()


@pytest.mark.parametrize("case", ["mode_u8", "offset_wraps", "size_2_63", "arrays_list"])
def test_the_crafted_indexes_found_by_hand_are_refused(tricky, case):
    from fusefs.index import IndexFormatError
    raw = open(os.path.join(tricky[1], INDEX_NAME), "rb").read()

    def edit_arrays(key, arr):
        if case == "offset_wraps" and key == "offset":
            arr[1] = 2**64 - 1  # (offset + size wraps around to a small number)
        if case == "size_2_63" and key == "size":
            arr[1] = 2**63

    def edit_meta(meta):
        if case == "mode_u8":
            meta["arrays"]["mode"][0] = "<u8"
        if case == "arrays_list":
            meta["arrays"] = list(meta["arrays"])

    with pytest.raises(IndexFormatError):
        Index.from_bytes(craft_index(raw, edit_arrays, edit_meta))



def test_a_sample_one_byte_past_its_chunks_data_is_refused_and_one_at_its_edges_is_not(tricky):
    """The index's bounds at the byte: a chunk's last sample ending exactly at the chunk's
    end and its first starting exactly at the data's start load; one byte further either way
    (the last sample a byte longer or later, the first a byte earlier) is refused."""
    from fusefs import chunk as chunkfmt
    from fusefs.index import IndexFormatError
    raw = open(os.path.join(tricky[1], INDEX_NAME), "rb").read()
    ix = Index.from_bytes(raw)
    ends = np.array([c.size for c in ix.chunks])[ix.chunk]
    starts = np.array([chunkfmt.data_start(c.count) for c in ix.chunks])[ix.chunk]
    last = int(np.flatnonzero(ix.offset + ix.size == ends)[0])   # (at its chunk's very end)
    first = int(np.flatnonzero(ix.offset == starts)[0])          # (at its data's very start)

    def crafted(key, sid, delta):
        def edit(k, arr):
            if k == key:
                arr[sid] = int(arr[sid]) + delta
        return craft_index(raw, edit)

    Index.from_bytes(crafted("offset", last, 0))  # (as packed: the edges are inside)
    for key, sid, delta in (("size", last, 1), ("offset", last, 1), ("offset", first, -1)):
        with pytest.raises(IndexFormatError, match="outside its chunk"):
            Index.from_bytes(crafted(key, sid, delta))


# ---- memory ----------------------------------------------------------------------------------
def test_bytes_kept_for_open_handles_stay_within_their_cap(tricky):
    """Another user holding 800 handles open, each read a byte at a time (as O_DIRECT reads
    do), makes the daemon keep at most Handles.cap bytes for them; the reads stay right."""
    from conftest import serving
    from fusefs.handles import HELD_MIN
    _, dst, files = tricky
    core = make_core(dst, cache_bytes=1 << 20)
    assert core.handles.cap == HELD_MIN
    big = [sid for sid in range(core.index.n_files) if core.index.size[sid] >= 70_000]
    want = {sid: files[os.fsdecode(core.index.file_path(sid))] for sid in big}

    async def go():
        async with serving(core):
            fhs = [(core.open(core.file_base + big[k % len(big)], os.O_RDONLY, OTHER).fh, big[k % len(big)])
                   for k in range(800)]
            for off in (0, 1):
                for fh, sid in fhs:
                    assert await core.read(fh, off, 1) == want[sid][off:off + 1]
                    assert core.handles.held_bytes <= core.handles.cap
            assert core.statistics()["held_bytes"] == core.handles.held_bytes > 0
            for fh, _ in fhs:
                core.release(fh)
            assert core.handles.held_bytes == 0 and core.handles.held == {}
    trio.run(go)




# ---- the mount point and the mount table -------------------------------------------------
def test_a_mount_point_that_is_a_link_or_another_users_folder_in_a_shared_folder_is_refused(tmp_path):
    """Root mounts on the very folder it checked (mount.open_mount_point): a mount point
    swapped for a link (to root's own 0700 folder, say) is refused, not followed, and so is
    a folder another user owns in a folder that others than root may change (that user
    could swap it at any moment); root's folder there, or any folder in root's own folder,
    is taken."""
    from fusefs.mount import MountError, open_mount_point
    victim = tmp_path / "emptyroot"
    victim.mkdir(mode=0o700)
    shared = tmp_path / "upar"
    shared.mkdir()
    os.chown(shared, OTHER, OTHER)  # (a user's folder, as `chown someuser upar`)
    (shared / "mp").symlink_to(victim)
    with pytest.raises(MountError, match="symbolic link"):
        os.close(open_mount_point(str(shared / "mp")))
    os.remove(shared / "mp")
    (shared / "mp").mkdir()
    os.chown(shared / "mp", OTHER, OTHER)
    with pytest.raises(MountError, match="belongs to user .* may be changed by users other than"):
        os.close(open_mount_point(str(shared / "mp")))
    os.chown(shared / "mp", os.geteuid(), os.getegid())
    fd = open_mount_point(str(shared / "mp"))
    try:
        assert os.path.samestat(os.fstat(fd), os.stat(shared / "mp"))
    finally:
        os.close(fd)
    mine = tmp_path / "mine"
    mine.mkdir()
    os.chown(mine, OTHER, OTHER)  # (another user's folder in a folder only root changes)
    os.close(open_mount_point(str(mine)))
    (tmp_path / "file").write_text("x")
    for path, why in ((tmp_path / "file", "not a folder"), (tmp_path / "none", "nothing there")):
        with pytest.raises(MountError, match=why):
            open_mount_point(str(path))
    (mine / "kept").write_text("x")
    with pytest.raises(MountError, match="not empty"):
        open_mount_point(str(mine))
    os.close(open_mount_point(str(mine), nonempty=True))


def test_the_mount_table_shows_the_packed_folder_and_fusefs_whatever_o_says(caplog):
    """`-o fsname=/etc/passwd,subtype=ext4` do not change what findmnt shows: the source is
    the packed folder and the type fuse.fusefs (client.find_mount finds mounts by it)."""
    from fusefs.mount import fuse_options
    opts = fuse_options(["fsname=/etc/passwd,subtype=ext4", "allow_other"], "/data/packed")
    assert {o for o in opts if o.startswith(("fsname=", "subtype="))} == {"fsname=/data/packed",
                                                                          "subtype=fusefs"}
    assert "allow_other" in opts and {"ro", "nosuid", "nodev"} <= opts
    assert sum("ignored" in r.message for r in caplog.records) == 2
