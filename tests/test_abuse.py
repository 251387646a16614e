"""What another user of a shared node can do to a root daemon (issue 45): each attack is
made as that user would make it (what they own is owned by `nobody`), and each test
asserts that the attack fails and that the daemon serves on."""
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

from conftest import (TRY, as_attacker, as_root, attack, craft_index, make_core, resident_bytes_of,
                      serves_on)
from conftest import exact_within_budget, run_epoch

OTHER = pwd.getpwnam("nobody").pw_uid  # a user other than the daemon's


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


# ---- orders --------------------------------------------------------------------------------
# Orders come over the control socket (the mount is read-only): an order larger than any valid
# one is refused before a byte of it is read, and at most MAX_CONNECTIONS are served at once
# (tests/test_control_socket.py); here, what that leaves the daemon's memory and who may.
HUGE_ORDERS = """
import os, socket, sys
target = os.readlink(os.path.join(sys.argv[1], '.fusefs', 'control'))
answers, held = [], []
for _ in range(3):  # (each declares 256 MiB)
    s = socket.socket(socket.AF_UNIX)
    s.connect(target)
    s.sendall(b'order 0 %d\\n' % ((256 << 20) - 1))
    answers.append(s.recv(100).decode().strip())
    held.append(s)
print(*answers)
"""


def test_a_huge_order_costs_the_daemon_no_memory(tricky_mount):
    """(One write at offset 256 MiB - 1 of an order file cost the daemon 256 MB, before.)"""
    import subprocess
    import sys
    _, mnt, proc, _ = tricky_mount
    before = resident_bytes_of(proc.pid)
    r = subprocess.run([sys.executable, "-c", HUGE_ORDERS, mnt], capture_output=True,
                       text=True, timeout=60)
    assert r.stdout.split() == ["too", "large"] * 3, r.stderr
    assert resident_bytes_of(proc.pid) - before < 16 << 20
    with open(os.path.join(mnt, "root file.txt"), "rb") as f:
        assert f.read() == b"at the root\n"  # serves on


# ---- control files ---------------------------------------------------------------------
def _hooks(control_gid=None, statistics=dict, socket_path=None):
    from fusefs.control import ControlHooks
    return ControlHooks(statistics=statistics, ids_table=bytes, chunk_table=bytes,
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


# ---- a short read is not corruption ------------------------------------------------------
def test_a_truncated_then_restored_chunk_serves_again(tricky, tmp_path):
    import shutil
    from fusefs.entries import FsError
    from testkit.mounts import resolve
    _, dst0, files = tricky
    dst = tmp_path / "dst"
    shutil.copytree(dst0, dst)
    core = make_core(str(dst), retries=0, io_timeout=0)  # (a read gives up after its try)
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

    assert "short read" in str(trio.run(read))
    assert core.statistics()["corrupt_samples"] == 0  # (not remembered as corrupt)
    with open(chunk, "r+b") as f:
        f.write(whole)
    assert trio.run(read) == files[rel]


# ---- logs --------------------------------------------------------------------------------
def test_a_background_log_is_neither_in_tmp_nor_reached_through_a_symlink(tmp_path, monkeypatch):
    from fusefs import runtime
    assert not runtime.default_log_path("/mnt/data").startswith("/tmp")
    assert runtime.default_log_path("/a/data") != runtime.default_log_path("/b/data")
    victim = tmp_path / "victim"
    victim.write_text("root's file\n")
    link = tmp_path / "log"
    link.symlink_to(victim)
    with pytest.raises(runtime.RuntimeFolderError, match="symbolic link"):
        runtime.open_log(str(link))
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(runtime.RuntimeFolderError, match="not a regular file"):
        runtime.open_log(str(tmp_path / "fifo"))
    assert victim.read_text() == "root's file\n"
    fd = runtime.open_log(str(tmp_path / "new.log"))
    os.close(fd)
    assert stat.S_IMODE(os.stat(tmp_path / "new.log").st_mode) == 0o600


# ---- the metrics server ----------------------------------------------------------------------
def test_idle_connections_get_no_more_threads_than_the_bound_and_scrapes_go_on(tricky, monkeypatch):
    """50 connections that send nothing: past MAX_CONNECTIONS each new one makes the oldest
    go, so at most MAX_CONNECTIONS threads serve them; a scrape is answered at once (it makes
    the oldest idle one go); the watchdog closes the rest REQUEST_S after their accept."""
    import socket
    import urllib.request
    from fusefs import metrics
    monkeypatch.setattr(metrics, "REQUEST_S", 1.0)
    stats = make_core(tricky[1]).statistics()
    calls = []
    server = metrics.serve_http(lambda: calls.append(1) or stats, 0, every=3600)
    url = f"http://127.0.0.1:{server.server_port}/metrics"
    try:
        urllib.request.urlopen(url, timeout=30).read()
        threads = threading.active_count()
        idle = []
        for _ in range(50):
            idle.append(socket.create_connection(("127.0.0.1", server.server_port)))
            idle[-1].settimeout(30)
            assert threading.active_count() - threads <= metrics.MAX_CONNECTIONS
        for s in idle[:-metrics.MAX_CONNECTIONS]:  # (made to go by those after them)
            assert s.recv(1) == b""
        assert b"fusefs_opens_total" in urllib.request.urlopen(url, timeout=30).read()
        for s in idle[-metrics.MAX_CONNECTIONS:]:  # (closed by the watchdog)
            assert s.recv(1) == b""
        for s in idle:
            s.close()
        assert len(calls) == 1  # (rendered once: every=3600)
    finally:
        server.shutdown()
        server.server_close()


# ---- crafted indexes with valid checksums --------------------------------------------------
_EXTREMES = [0, 1, 2, 255, 0o7777, 0o10000, 0o170777, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**63 - 1,
             2**63, 2**64 - 1]


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


SET_ORDER = """
def set_order(ctl, data):
    import socket
    s = socket.socket(socket.AF_UNIX)
    s.connect(os.readlink(os.path.join(ctl, 'control')))
    try:
        s.sendall(b'order 1 %d\\n' % len(data) + data)
    except OSError:
        pass
    return s.recv(100).decode().strip()
"""


@as_root
def test_another_user_reads_samples_and_stats_but_not_paths_orders_or_sets_orders(attacker, shared_mount):
    mnt, _, files = shared_mount
    ctl = os.path.join(mnt, ".fusefs")
    code = TRY + SET_ORDER + """
ctl = sys.argv[1]
read = lambda name: open(os.path.join(ctl, name), 'rb').read()
write = lambda name: open(os.path.join(ctl, name), 'wb').close()
sample = os.path.join(sys.argv[2], 'cat', 'img 004.jpg')
print(attempt(read, 'stats'), attempt(read, 'ids'), attempt(read, 'order'), attempt(write, 'order.1'),
      attempt(lambda: open(sample, 'rb').read()), attempt(lambda: open(sample, 'r+b')),
      set_order(ctl, bytes.fromhex(sys.argv[3])))
"""
    order = orderfmt.encode([2, 0, 1], epoch=7).hex()
    # (before: ids 0444)
    assert attack(attacker, code, ctl, mnt, order) == "ok EACCES EACCES EROFS ok EROFS denied"
    # a member of the control group may read the paths and set orders
    assert attack(attacker, code, ctl, mnt, order, controls=True) == "ok ok ok EROFS ok EROFS ok"
    from fusefs.client import mount_stats
    assert mount_stats(mnt)["plans"]["1"]["epoch"] == 7
    serves_on(mnt, files)


@as_root
def test_a_control_group_member_cannot_make_orders_cost_memory(attacker, shared_mount):
    mnt, proc, files = shared_mount
    before = resident_bytes_of(proc.pid)
    assert attack(attacker, HUGE_ORDERS, mnt, controls=True).split() == ["too", "large"] * 3
    assert resident_bytes_of(proc.pid) - before < 16 << 20  # (3 x 256 MiB before)
    serves_on(mnt, files)


HOLD = """
import os, sys
mnt = sys.argv[1]
paths = sorted(os.path.join(d, f) for d, _, fs in os.walk(mnt) for f in fs if os.path.getsize(os.path.join(d, f)) >= 70000)
fds = [os.open(paths[k % len(paths)], os.O_RDONLY | os.O_DIRECT) for k in range(800)]
for off in (0, 1):
    for fd in fds:
        os.pread(fd, 1, off)
print('held', flush=True)
sys.stdin.readline()
"""


@as_root
def test_handles_another_user_holds_open_keep_the_daemon_within_its_cap(attacker, shared_mount):
    """800 handles held open by another user, each read a byte at a time (O_DIRECT: each read
    reaches the daemon): 240 MB of samples, before, kept for them beside a 1 MiB budget."""
    import subprocess
    from fusefs.client import mount_stats
    from fusefs.handles import HELD_MIN
    mnt, proc, files = shared_mount
    before = resident_bytes_of(proc.pid)
    p = as_attacker(attacker, HOLD, mnt, stdin=subprocess.PIPE)
    try:
        assert p.stdout.readline() == "held\n", p.stderr.read() if p.poll() is not None else ""
        stats = mount_stats(mnt)
        assert stats["open_handles"] >= 800 and 0 < stats["held_bytes"] <= HELD_MIN
        assert resident_bytes_of(proc.pid) - before < HELD_MIN + (24 << 20)
    finally:
        p.communicate("\n", timeout=60)
    for _ in range(600):  # (the kernel sends the releases after the closes, in the background)
        if mount_stats(mnt)["open_handles"] == 0:
            break
        threading.Event().wait(0.05)
    assert mount_stats(mnt)["held_bytes"] == 0
    serves_on(mnt, files)


HAMMER = """
import os, sys, time
path = os.path.join(sys.argv[1], '.fusefs', 'stats')
texts = set()
t = time.monotonic()
for _ in range(3000):
    with open(path, 'rb') as f:
        texts.add(f.read())
print(len(texts), time.monotonic() - t)
"""


@as_root
def test_another_user_opening_the_stats_in_a_loop_gets_them_rendered_at_most_every_quarter_second(
        attacker, shared_mount):
    from fusefs.control import RENDER_EVERY
    mnt, _, files = shared_mount
    texts, seconds = attack(attacker, HAMMER, mnt).split()
    assert int(texts) <= float(seconds) / RENDER_EVERY + 2  # (3,000 renders on the loop before)
    serves_on(mnt, files)


SIGNALLED_READS = """
import os, signal, sys
signal.signal(signal.SIGALRM, lambda *a: None)
signal.setitimer(signal.ITIMER_REAL, 0.00005, 0.00005)
paths = [os.path.join(d, f) for d, _, fs in os.walk(sys.argv[1]) for f in fs]
bad = 0
for path in paths * int(sys.argv[2]):
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        want = os.path.getsize(path)
        got = bytearray()
        while len(got) < want:
            part = os.pread(fd, 1 << 16, len(got))
            if not part:
                break
            got += part
        bad += len(got) != want
    finally:
        os.close(fd)
signal.setitimer(signal.ITIMER_REAL, 0)
print(bad)
"""


@as_root
def test_a_reader_that_signals_itself_gets_right_bytes_and_its_interrupts_go_where_they_belong(
        attacker, shared_mount):
    """A reader that signals itself every 50 us: interrupts of requests the fast path
    answered are taken there (libfuse would keep them on a list until the loop's next
    request: issue 45, item 10), the others go to the loop, which answers an interrupted
    read EINTR (the reader's read is made again); every read comes out right and the daemon
    serves on."""
    from fusefs.client import mount_stats

    def interrupts():
        stats = mount_stats(mnt)
        return stats["fast_path_requests"]["interrupt"] + stats["interrupts_to_loop"]
    mnt, proc, files = shared_mount
    for _ in range(100):  # (an interrupt needs a signal while a request waits: a race)
        assert attack(attacker, SIGNALLED_READS, mnt, 10) == "0"
        if interrupts():
            break
    assert interrupts() > 0
    serves_on(mnt, files)


# -- the local tier, where the other user may have made the folder (/dev/shm, /tmp)
@as_root
def test_a_local_cache_folder_another_user_made_is_refused_with_one_line(attacker, tricky, shared_folder):
    from conftest import refused_mount
    shared = os.path.join(shared_folder, "shm")
    os.mkdir(shared)
    os.chmod(shared, 0o1777)  # (as /dev/shm)
    victim = os.path.join(shared_folder, "victim")
    with open(victim, "w") as f:
        f.write("root's file\n")
    os.chmod(victim, 0o600)
    theirs = os.path.join(shared, "cache")
    code = "import os, sys\nos.mkdir(sys.argv[1])\nos.symlink(sys.argv[2], os.path.join(sys.argv[1], 'lock'))\nprint('made')"
    assert attack(attacker, code, theirs, victim) == "made"
    mnt = os.path.join(shared_folder, "mnt")
    os.mkdir(mnt)
    r = refused_mount(tricky[1], mnt, "--local-cache", theirs, "-o", "allow_other", mnt=mnt)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert theirs in r.stderr and "owned by uid" in r.stderr, r.stderr
    assert open(victim).read() == "root's file\n"  # (truncated to the daemon's pid before)


@as_root
def test_another_user_cannot_read_the_local_cache(attacker, tricky, shared_folder):
    from testkit.mounts import running_mount
    mnt, cache = os.path.join(shared_folder, "mnt"), os.path.join(shared_folder, "cache")
    with running_mount(tricky[1], mnt, "--local-cache", cache, "-o", "allow_other"):
        serves_on(mnt, tricky[2])  # (fills the tier)
    files = [os.path.join(d, f) for d, _, fs in os.walk(cache) for f in fs]
    assert len(files) > 1
    code = TRY + "print(*sorted({attempt(lambda p=p: open(p, 'rb').read()) for p in sys.argv[1:]}))"
    assert attack(attacker, code, cache, *files) == "EACCES"  # (0644 in 0755 folders before)


@as_root
def test_a_symlink_another_user_plants_at_the_old_log_path_is_not_followed(attacker, tricky, shared_folder):
    """The background log was /tmp/fusefs-<uid>-<name>.log, opened following symlinks."""
    import subprocess
    from conftest import fusefs_cmd
    from testkit.mounts import stop_mount
    victim = os.path.join(shared_folder, "victim")
    with open(victim, "w") as f:
        f.write("root's file\n")
    os.chmod(victim, 0o600)
    mnt = os.path.join(shared_folder, os.path.basename(shared_folder))  # (a name no run had)
    os.mkdir(mnt)
    planted = f"/tmp/fusefs-0-{os.path.basename(mnt)}.log"
    code = "import os, sys\nos.symlink(sys.argv[2], sys.argv[1])\nprint('planted')"
    assert attack(attacker, code, planted, victim) == "planted"
    try:
        r = subprocess.run(fusefs_cmd("mount", "--background", tricky[1], mnt, "-o", "bogus_option"),
                           capture_output=True, text=True, timeout=60)
        assert r.returncode != 0
        r = subprocess.run(fusefs_cmd("mount", "--background", tricky[1], mnt), capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        serves_on(mnt, tricky[2])
    finally:
        stop_mount(mnt)
        os.unlink(planted)
    assert open(victim).read() == "root's file\n"
