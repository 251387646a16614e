"""What another user of a shared node can make a root daemon or a root `fusefs pack`
disclose, hang or bloat (issue 53): a packed folder they wrote, a tree root packs for them,
the control socket, the metrics server, an outage, a signal storm. Each attack is made as
that user (fusefs-attacker, made per module: tests run as root in CI) against a real root
mount with -o allow_other, or a real `fusefs pack`, and each test asserts the attack fails."""
import contextlib
import os
import shutil
import stat
import subprocess
import sys
import threading

import numpy as np
import pytest

from fusefs import chunk as chunkfmt
from fusefs.index import INDEX_NAME, Index

from conftest import (REPO, TRY, as_attacker, as_root, attack, craft_index, fusefs_cmd,
                      refused_mount, serves_on, write_tree)


def _chown_tree(root, uid, gid):
    for dirpath, dirs, files in os.walk(root):
        for name in [dirpath] + [os.path.join(dirpath, x) for x in dirs + files]:
            os.lchown(name, uid, gid)


@pytest.fixture
def victim(shared_folder):
    """A file of root's that no one else may read, beside the other user's folders."""
    secret = b"root's secret " + os.urandom(16).hex().encode()
    path = os.path.join(shared_folder, "victim")
    with open(path, "wb") as f:
        f.write(secret)
    os.chmod(path, 0o600)
    return path, secret


@pytest.fixture
def theirs(shared_folder, attacker):
    """A folder of the other user's, where they lay out what root will mount or pack."""
    path = os.path.join(shared_folder, "theirs")
    os.mkdir(path)
    os.chown(path, attacker[0], attacker[1])
    return path


def _their_packed_copy(tricky, theirs, attacker) -> str:
    """The tricky set's packed folder, copied into the other user's folder as theirs."""
    dst = os.path.join(theirs, "packed")
    shutil.copytree(tricky[1], dst)
    _chown_tree(dst, attacker[0], attacker[1])
    return dst


def _refused(dst, shared_folder, *why):
    """`fusefs mount DST` by root with allow_other: refused in one line naming why, with
    exit 2 and no traceback, and nothing left mounted."""
    mnt = os.path.join(shared_folder, "mnt")
    os.makedirs(mnt, exist_ok=True)
    r = refused_mount(dst, mnt, "-o", "allow_other", mnt=mnt)
    lines = [x for x in r.stderr.splitlines() if x.startswith("fusefs mount:")]
    assert r.returncode == 2 and "Traceback" not in r.stderr and len(lines) == 1, r.stderr
    for w in why:
        assert w in lines[0], lines[0]
    assert not os.path.ismount(mnt)
    return lines[0]


def _wait_for(mnt, what, deadline=120):
    """The daemon's stats once what(stats) holds (AssertionError past deadline seconds)."""
    from fusefs.client import mount_stats
    for _ in range(deadline * 20):
        stats = mount_stats(mnt)
        if what(stats):
            return stats
        threading.Event().wait(0.05)
    raise AssertionError(f"the daemon's stats never showed it: {stats}")


def _chunk0(dst):
    ix = Index.load(os.path.join(dst, INDEX_NAME))
    return ix, os.path.join(dst, ix.chunks[0].path)


# ---- item 1: a packed folder is read beneath itself, and only as its index and headers say ---
@as_root
def test_a_chunk_that_is_a_symbolic_link_is_not_followed(tricky, theirs, attacker, shared_folder):
    """The chunk is a link to a copy of itself outside the packed folder (the same bytes:
    only the link is wrong); before, root followed it, and with a link to root's files and a
    crafted index the mount read them for its author."""
    dst = _their_packed_copy(tricky, theirs, attacker)
    _, path = _chunk0(dst)
    code = ("import os, shutil, sys\nshutil.copy(sys.argv[1], sys.argv[2])\nos.unlink(sys.argv[1])\n"
            "os.symlink(sys.argv[2], sys.argv[1])\nprint('linked')")
    assert attack(attacker, code, path, os.path.join(theirs, "elsewhere.fck")) == "linked"
    _refused(dst, shared_folder, path, "symbolic link")


@as_root
def test_a_chunk_folder_that_is_a_symbolic_link_is_not_followed(tricky, theirs, attacker, shared_folder):
    dst = _their_packed_copy(tricky, theirs, attacker)
    code = ("import os, sys\nos.rename(os.path.join(sys.argv[1], 'chunks'), sys.argv[2])\n"
            "os.symlink(sys.argv[2], os.path.join(sys.argv[1], 'chunks'))\nprint('linked')")
    assert attack(attacker, code, dst, os.path.join(theirs, "real-chunks")) == "linked"
    _refused(dst, shared_folder, "chunks/", "symbolic link")


@as_root
def test_an_index_that_is_a_symbolic_link_is_not_followed(tricky, theirs, attacker, shared_folder, victim):
    dst = _their_packed_copy(tricky, theirs, attacker)
    code = "import os, sys\nos.unlink(sys.argv[1])\nos.symlink(sys.argv[2], sys.argv[1])\nprint('linked')"
    assert attack(attacker, code, os.path.join(dst, INDEX_NAME), victim[0]) == "linked"
    _refused(dst, shared_folder, INDEX_NAME, "symbolic link")


def _crafted(dst, edit):
    """The index of dst rewritten by edit(key, array) with valid checksums."""
    path = os.path.join(dst, INDEX_NAME)
    with open(path, "rb") as f:
        raw = craft_index(f.read(), edit)
    with open(path, "wb") as f:
        f.write(raw)


@as_root
def test_the_checksum_oracle_of_overlapping_one_byte_samples_is_refused(tricky, theirs, attacker,
                                                                        shared_folder, victim):
    """The attack as found: chunk 0 a link to root's file, its samples one byte long at one
    offset, each with the checksum of another byte value (the one that reads tells the
    byte): refused at load, whatever the link."""
    dst = _their_packed_copy(tricky, theirs, attacker)
    ix, path = _chunk0(dst)
    mine = np.flatnonzero(ix.chunk == 0)
    start = chunkfmt.data_start(ix.chunks[0].count)

    def edit(key, arr):
        if key == "offset":
            arr[mine] = start
        elif key == "size":
            arr[mine] = 1
        elif key == "checksum":
            arr[mine] = [chunkfmt.checksum(bytes([v % 256])) for v in range(len(mine))]
    _crafted(dst, edit)
    _refused(dst, shared_folder, "overlap")
    os.unlink(path)
    os.symlink(victim[0], path)
    _refused(dst, shared_folder, "overlap")


@as_root
def test_an_index_that_does_not_match_its_chunks_headers_is_refused(tricky, theirs, attacker, shared_folder):
    """Samples cut short (within their chunk, no overlap, checksums made to match): before,
    mounted and served as the index said; now the chunk's header must list exactly the
    index's samples."""
    dst = _their_packed_copy(tricky, theirs, attacker)
    ix, path = _chunk0(dst)
    sid = int(max(np.flatnonzero(ix.chunk == 0), key=lambda s: int(ix.size[s])))
    with open(path, "rb") as f:
        raw = f.read()
    cut = raw[int(ix.offset[sid]):int(ix.offset[sid]) + int(ix.size[sid]) // 2]

    def edit(key, arr):
        if key == "size":
            arr[sid] = len(cut)
        elif key == "checksum":
            arr[sid] = chunkfmt.checksum(cut)
    _crafted(dst, edit)
    _refused(dst, shared_folder, path, "header does not list")


SETUID = """
import os, shutil, sys
os.makedirs(os.path.join(sys.argv[1], 'bin'))
shutil.copy('/usr/bin/id', os.path.join(sys.argv[1], 'bin', 'id'))
os.chmod(os.path.join(sys.argv[1], 'bin', 'id'), 0o4755)
os.makedirs(os.path.join(sys.argv[1], 'data'))
open(os.path.join(sys.argv[1], 'data', 'x'), 'w').write('x')
print('made')
"""


@as_root
def test_a_setuid_file_of_another_user_runs_as_that_user(theirs, attacker, shared_folder):
    """Their tree holds a setuid copy of `id`; root packs and mounts it with -o suid,dev
    (the mount shows every file as the daemon's): before, it ran as euid 0."""
    from testkit.mounts import running_mount
    src, dst, mnt = (os.path.join(theirs, "tree"), os.path.join(shared_folder, "packed"),
                     os.path.join(shared_folder, "mnt"))
    assert attack(attacker, SETUID, src) == "made"
    subprocess.run(fusefs_cmd("pack", "-q", src, dst), check=True, capture_output=True, timeout=120, cwd=REPO)
    with running_mount(dst, mnt, "-o", "allow_other,suid,dev") as (_, log):
        opts = next(line.split()[3].split(",") for line in open("/proc/mounts") if line.split()[1] == mnt)
        assert "nosuid" in opts and "nodev" in opts
        shown = os.stat(os.path.join(mnt, "bin", "id"))
        assert stat.S_IMODE(shown.st_mode) == 0o755 and shown.st_uid == 0
        code = "import subprocess, sys\nprint(subprocess.run([sys.argv[1], '-u'], capture_output=True, text=True).stdout.strip())"
        assert attack(attacker, code, os.path.join(mnt, "bin", "id")) == str(attacker[0])
    assert "-o suid ignored" in open(log).read()


# ---- item 2: pack publishes nothing its runner would not mean to -----------------------------
def _holds(root, secret: bytes) -> list[str]:
    """The files under root whose bytes hold secret."""
    found = []
    for dirpath, _, files in os.walk(root):
        for name in files:
            with open(os.path.join(dirpath, name), "rb") as f:
                if secret in f.read():
                    found.append(os.path.join(dirpath, name))
    return found


LINK_TREE = """
import os, sys
os.makedirs(os.path.join(sys.argv[1], 'cls'))
open(os.path.join(sys.argv[1], 'cls', 'a.jpg'), 'wb').write(b'their own bytes')
os.symlink(sys.argv[2], os.path.join(sys.argv[1], 'cls', 'b.jpg'))
os.symlink('/root', os.path.join(sys.argv[1], 'roots'))
print('made')
"""


@as_root
def test_pack_by_root_does_not_follow_the_links_in_another_users_tree(theirs, attacker, shared_folder, victim):
    src, dst = os.path.join(theirs, "tree"), os.path.join(shared_folder, "packed")
    assert attack(attacker, LINK_TREE, src, victim[0]) == "made"
    r = subprocess.run(fusefs_cmd("pack", "-q", src, dst), capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 0, r.stderr
    assert "skipped: cls/b.jpg: symbolic link" in r.stderr and "skipped: roots: symbolic link" in r.stderr
    assert _holds(dst, victim[1]) == [] and _holds(dst, b"their own bytes") != []


def test_pack_follows_links_to_files_when_asked(tmp_path):
    src = tmp_path / "src"
    write_tree(src, {"c/a.bin": b"a", "elsewhere/target.bin": b"the target"})
    os.symlink(tmp_path / "src" / "elsewhere" / "target.bin", src / "c" / "link.bin")
    r = subprocess.run(fusefs_cmd("pack", "-q", "--follow-symlinks", src, tmp_path / "dst"),
                       capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 0 and "skipped" not in r.stderr, r.stderr
    from testkit.mounts import resolve
    ix = Index.load(str(tmp_path / "dst" / INDEX_NAME))
    assert resolve(ix, "c/link.bin")[0] == "file" and int(ix.size[resolve(ix, "c/link.bin")[1]]) == 10


LINK_TO = """
import os, sys
os.symlink(sys.argv[2], sys.argv[1])
print('made')
"""


def _private_tree(shared_folder) -> tuple[str, str]:
    """(a dataset folder inside a folder only root may enter, its secret): the dataset
    itself public (0755 folders, 0644 files), the folder above it 0700."""
    closed = os.path.join(shared_folder, "roots-only")
    ds = os.path.join(closed, "ds")
    secret = "root only " + os.urandom(8).hex()
    write_tree(ds, {"cls/a.bin": secret.encode(), "cls/b.bin": b"b"})
    for dirpath, _, files in os.walk(ds):
        os.chmod(dirpath, 0o755)
        for name in files:
            os.chmod(os.path.join(dirpath, name), 0o644)
    os.chmod(closed, 0o700)
    return ds, secret


@as_root
@pytest.mark.parametrize("in_place", [False, True])
def test_pack_refuses_a_source_reached_through_another_users_link(theirs, attacker, shared_folder, in_place):
    """Issue 87 item 1: another user's `~/ds` links to a folder inside root's 0700 folder;
    root's `pack ~/ds DST` (before: packed it, chunks and index 0644, the bytes readable
    by that user) is refused in one line naming the link and the path it leads to, and
    writes nothing. The same source named by its real path, or through root's own link,
    is packed as private as that path is (before, through root's link: 0644)."""
    ds, secret = _private_tree(shared_folder)
    if in_place:
        import tarfile
        with tarfile.open(os.path.join(ds, "shard.tar"), "w") as tf:
            tf.add(os.path.join(ds, "cls"), arcname="cls")
        os.chmod(os.path.join(ds, "shard.tar"), 0o644)
    link, dst = os.path.join(theirs, "ds"), os.path.join(shared_folder, "packed")
    assert attack(attacker, LINK_TO, link, ds) == "made"
    extra = ["--in-place"] if in_place else []
    r = subprocess.run(fusefs_cmd("pack", "-q", *extra, link, dst), capture_output=True, text=True,
                       timeout=120, cwd=REPO)
    lines = [x for x in r.stderr.splitlines() if x.startswith("fusefs pack:")]
    assert r.returncode == 2 and "Traceback" not in r.stderr and len(lines) == 1, r.stderr
    assert "symbolic link of user fusefs-attacker" in lines[0] and ds in lines[0], lines[0]
    assert not os.path.exists(os.path.join(dst, INDEX_NAME))
    mine = os.path.join(shared_folder, "roots-link")
    os.symlink(ds, mine)
    for src in (ds, mine):
        r = subprocess.run(fusefs_cmd("pack", "-q", "--force", *extra, src, dst), capture_output=True,
                           text=True, timeout=120, cwd=REPO)
        assert r.returncode == 0, r.stderr
        written = [os.path.join(d, f) for d, _, fs in os.walk(dst) for f in fs]
        assert written and {stat.S_IMODE(os.stat(p).st_mode) for p in written} == {0o600}, src
        found, denied = attack(attacker, READ_ALL, dst, secret).split()
        assert (found, denied) == ("0", str(len(written)))


READ_ALL = TRY + """
found, denied = [], []
for dirpath, _, files in os.walk(sys.argv[1]):
    for name in files:
        path = os.path.join(dirpath, name)
        try:
            data = open(path, 'rb').read()
        except PermissionError:
            denied.append(os.path.relpath(path, sys.argv[1]))
            continue
        if sys.argv[2].encode() in data:
            found.append(os.path.relpath(path, sys.argv[1]))
print(len(found), len(denied))
"""


@as_root
def test_chunks_of_private_files_are_as_private_as_their_sources(attacker, shared_folder):
    """Root packs a tree whose files are public (0644 in 0755 folders) but for a 0600 file
    and a 0644 file in a 0700 folder, one file a chunk: another user reads the public
    chunks and none of the private bytes (before, every chunk was 0644)."""
    src, dst = os.path.join(shared_folder, "src"), os.path.join(shared_folder, "packed")
    marker = "private " + os.urandom(8).hex()
    write_tree(src, {"pub/a.bin": b"public a", "pub/b.bin": b"public b", "pub/c.bin": marker.encode(),
                     "hidden/d.bin": marker.encode() + b" too", "hidden2/e.bin": b"public e"})
    for dirpath, dirs, files in os.walk(src):
        os.chmod(dirpath, 0o755)
        for name in files:
            os.chmod(os.path.join(dirpath, name), 0o644)
    os.chmod(os.path.join(src, "pub", "c.bin"), 0o600)
    os.chmod(os.path.join(src, "hidden"), 0o700)
    r = subprocess.run(fusefs_cmd("pack", "-q", "--chunk-count", "1", src, dst), capture_output=True,
                       text=True, timeout=120, cwd=REPO)
    assert r.returncode == 0, r.stderr
    modes = {}
    ix = Index.load(os.path.join(dst, INDEX_NAME))
    for sid in range(ix.n_files):
        chunk = os.path.join(dst, ix.chunks[int(ix.chunk[sid])].path)
        modes[os.fsdecode(ix.file_path(sid))] = stat.S_IMODE(os.stat(chunk).st_mode)
    assert modes == {"pub/a.bin": 0o644, "pub/b.bin": 0o644, "pub/c.bin": 0o600, "hidden/d.bin": 0o600,
                     "hidden2/e.bin": 0o644}
    assert stat.S_IMODE(os.stat(os.path.join(dst, INDEX_NAME)).st_mode) == 0o600  # (it names them)
    found, denied = attack(attacker, READ_ALL, dst, marker).split()
    assert (found, denied) == ("0", "3")  # (the index and the two private chunks)
    # public through and through: the index too; and --mode says it outright
    os.chmod(os.path.join(src, "pub", "c.bin"), 0o644)
    os.chmod(os.path.join(src, "hidden"), 0o755)
    r = subprocess.run(fusefs_cmd("pack", "-q", "--force", src, dst), capture_output=True, text=True,
                       timeout=120, cwd=REPO)
    assert r.returncode == 0, r.stderr
    assert stat.S_IMODE(os.stat(os.path.join(dst, INDEX_NAME)).st_mode) == 0o644
    r = subprocess.run(fusefs_cmd("pack", "-q", "--force", "--mode", "0640", src, dst),
                       capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 0, r.stderr
    assert {stat.S_IMODE(os.stat(os.path.join(d, f)).st_mode) for d, _, fs in os.walk(dst) for f in fs} == {0o640}


def test_a_group_keeps_read_access_only_where_every_file_gave_it():
    from fusefs.pack import Access
    every, nobody = Access.EVERYONE, Access.NOBODY
    assert Access.mode([0o644, 0o644], [5, 5], [every, every]) == (0o644, 5)
    assert Access.mode([0o640, 0o640], [5, 5], [every, 5]) == (0o640, 5)
    assert Access.mode([0o640, 0o640], [5, 6], [every, every]) == (0o600, None)  # (two groups)
    assert Access.mode([0o644, 0o600], [5, 5], [every, every]) == (0o600, None)
    assert Access.mode([0o644], [5], [nobody]) == (0o600, None)
    assert Access.mode([0o604], [5], [every]) == (0o604, None)  # (others, not the group)
    folder = os.stat_result((stat.S_IFDIR | 0o750, 0, 0, 1, 0, 7, 0, 0, 0, 0))
    assert Access.reach(every, folder) == 7 and Access.reach(7, folder) == 7
    assert Access.reach(8, folder) == nobody


def test_a_fifo_swapped_in_after_the_scan_neither_hangs_pack_nor_is_packed(tmp_path, monkeypatch):
    from fusefs import pack as packmod
    src = tmp_path / "src"
    write_tree(src, {"c/a.bin": b"a", "c/b.bin": b"b"})
    real = packmod.scan

    def swapped(source, skipped):
        tree = real(source, skipped)
        os.unlink(src / "c" / "b.bin")
        os.mkfifo(src / "c" / "b.bin")
        return tree
    monkeypatch.setattr(packmod, "scan", swapped)
    out = {}
    t = threading.Thread(target=lambda: out.update(r=packmod.pack(str(src), str(tmp_path / "dst"), progress=False)),
                         daemon=True)
    t.start()
    t.join(60)  # (a guard: a blocking open of the FIFO would never return)
    assert not t.is_alive()
    assert out["r"].files == 1 and out["r"].skipped == [("c/b.bin", "cannot read: not a regular file (a FIFO)")]


@pytest.mark.parametrize("per_chunk", [None, 1])
def test_a_large_file_whose_copy_fails_is_skipped_and_its_chunk_written_without_it(tmp_path, monkeypatch,
                                                                                 per_chunk):
    """A file copied in blocks fails half way: it is reported and skipped, and its chunk is
    written again without it (alone in its chunk: no chunk, and no gap in their numbers)."""
    from fusefs import pack as packmod
    from fusefs.mount import open_dataset
    src = tmp_path / "src"
    files = {"c/a.bin": b"a" * 100, "c/big.bin": os.urandom(packmod.STREAM_BYTES + 1), "c/z.bin": b"z" * 50}
    write_tree(src, files)
    real, failed = packmod._write_chunk, []

    def failing(fd, members, labels, progress):
        streamed = [p for p, (_, d) in enumerate(members) if isinstance(d, packmod._Streamed)]
        if streamed and not failed:
            failed.append(1)
            raise packmod._MemberFailed(streamed[0], OSError(5, "Input/output error"))
        return real(fd, members, labels, progress)
    monkeypatch.setattr(packmod, "_write_chunk", failing)
    r = packmod.pack(str(src), str(tmp_path / "dst"), progress=False, chunk_count=per_chunk)
    assert r.files == 2 and r.skipped == [("c/big.bin", "cannot read: Input/output error")]
    index, store = open_dataset(str(tmp_path / "dst"))
    from testkit.mounts import resolve
    assert {rel: store.read_sample(resolve(index, rel)[1]) for rel in ("c/a.bin", "c/z.bin")} == \
        {"c/a.bin": files["c/a.bin"], "c/z.bin": files["c/z.bin"]}
    assert [c.path for c in index.chunks] == [f"chunks/chunk-{k:06d}.fck" for k in range(len(index.chunks))]


def test_pack_holds_no_more_than_a_few_chunks_whatever_the_largest_file(tmp_path):
    """A 192 MiB file (sparse: nothing to read from disk) and small ones: the pack's peak RSS
    stays far below the file's size (before, it held the file, then its chunk)."""
    src = tmp_path / "src"
    write_tree(src, {f"c/{i}.bin": os.urandom(1000) for i in range(50)})
    with open(src / "c" / "big.bin", "wb") as f:
        f.truncate(192 << 20)
        f.seek(1 << 20)
        f.write(b"in the middle")
    # (VmHWM: the peak of this process's memory since its exec; ru_maxrss would count the
    # pytest process it was forked from)
    code = ("import sys\nfrom fusefs.pack import pack\n"
            "pack(sys.argv[1], sys.argv[2], progress=False, chunk_bytes=4 << 20)\n"
            "print(next(line.split()[1] for line in open('/proc/self/status') if line.startswith('VmHWM')))")
    r = subprocess.run([sys.executable, "-c", code, src, tmp_path / "dst"], capture_output=True,
                       text=True, timeout=300, cwd=REPO)
    assert r.returncode == 0, r.stderr
    assert int(r.stdout) << 10 < 128 << 20, int(r.stdout) >> 10  # (KiB: the interpreter, numpy, ~40 MiB)
    from testkit.mounts import resolve
    ix = Index.load(str(tmp_path / "dst" / INDEX_NAME))
    sid = resolve(ix, "c/big.bin")[1]
    assert int(ix.size[sid]) == 192 << 20
    with open(src / "c" / "big.bin", "rb") as f:
        assert int(ix.checksum[sid]) == chunkfmt.checksum(f.read())


# ---- item 3: what open handles hold is counted per handle --------------------------------------
def test_two_reads_of_one_handle_that_miss_together_are_kept_once(tricky):
    """Both reads wait for one fetch; the handle keeps the bytes once, and nothing stays
    counted once it is closed (before: counted twice, released once)."""
    import trio
    from conftest import make_core, serving
    _, dst, files = tricky
    core = make_core(dst)
    sid = max(range(core.index.n_files), key=lambda s: int(core.index.size[s]))
    want = files[os.fsdecode(core.index.file_path(sid))]

    async def go():
        async with serving(core):
            fh = core.open(core.file_base + sid, os.O_RDONLY).fh
            got = {}
            async with trio.open_nursery() as n:
                for off in (0, 1, 2):
                    n.start_soon(lambda off=off: _read_into(core, fh, off, got))
            assert got == {off: want[off:off + 1] for off in (0, 1, 2)}
            assert core.statistics()["read_waits"] == 2  # (three reads, one fetch)
            assert core.handles.held_bytes == len(want) and list(core.handles.held) == [fh]
            core.release(fh)
            assert core.handles.held_bytes == 0 and core.statistics()["held_bytes"] == 0
    trio.run(go)


async def _read_into(core, fh, off, got):
    got[off] = await core.read(fh, off, 1)


SAME_HANDLE = """
import os, sys, threading
paths = sorted(os.path.join(d, f) for d, _, fs in os.walk(sys.argv[1]) for f in fs
               if os.path.getsize(os.path.join(d, f)) >= 70000)
bad = 0
for rnd in range(int(sys.argv[2])):
    for path in paths:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        want = open(path, 'rb').read(8)
        got = {}
        ts = [threading.Thread(target=lambda k=k: got.update({k: os.pread(fd, 1, k)})) for k in range(8)]
        for t in ts: t.start()
        for t in ts: t.join()
        bad += b''.join(got[k] for k in range(8)) != want
        os.close(fd)
print(bad)
"""


@as_root
def test_concurrent_reads_of_one_handle_by_another_user_leave_nothing_held(attacker, shared_mount):
    """Eight threads read one O_DIRECT handle at once, over and over, with a 1 MiB cache
    (each miss waits for a fetch): once every handle is closed, the daemon holds 0 bytes for
    them (before: the leak grew to the cap, and then partial readers refetched whole samples)."""
    mnt, _, files = shared_mount
    assert attack(attacker, SAME_HANDLE, mnt, 5) == "0"
    stats = _wait_for(mnt, lambda s: s["open_handles"] == 0)  # (the kernel's releases come after the closes)
    assert stats["held_bytes"] == 0 and stats["read_waits"] > 0  # (reads did meet under way)
    serves_on(mnt, files)


# ---- item 4: the owner is never starved of the control socket or the metrics -----------------
DRIP_ORDERS = """
import os, socket, sys, threading, time
target = os.readlink(os.path.join(sys.argv[1], '.fusefs', 'control'))
dropped = [0]
def drip():
    while True:  # (reconnecting as soon as the daemon drops it)
        s = socket.socket(socket.AF_UNIX)
        try:
            s.connect(target)
            s.sendall(b'order 0 1000\\n')
            while True:
                s.sendall(b'x')
                time.sleep(0.5)
        except OSError:
            dropped[0] += 1
        finally:
            s.close()
for _ in range(8):
    threading.Thread(target=drip, daemon=True).start()
print('dripping', flush=True)
sys.stdin.readline()
print(dropped[0])
"""


@as_root
def test_a_control_group_member_dripping_orders_never_keeps_the_owner_from_setting_one(
        attacker, shared_mount):
    """Eight connections of a control-group member drip their orders a byte at a time and
    reconnect when dropped: root's orders are answered at once (the last slot is kept for
    root and the daemon's user), and the drippers are dropped (before: every slot held
    forever, and the owner's orders answered busy)."""
    import subprocess
    from fusefs import order as orderfmt
    from fusefs.client import mount_stats, send_order
    mnt, _, files = shared_mount
    p = as_attacker(attacker, DRIP_ORDERS, mnt, stdin=subprocess.PIPE, controls=True)
    try:
        assert p.stdout.readline() == "dripping\n", p.stderr.read() if p.poll() is not None else ""
        for epoch in range(3):
            send_order(mnt, orderfmt.encode([2, 0, 1], epoch=epoch), rank=5, patience=0)
        assert mount_stats(mnt)["plans"]["5"]["epoch"] == 2
        _wait_for(mnt, lambda s: s["control_socket"]["timed_out"] >= 8)  # (each dropped within REQUEST_S)
    finally:
        out, _ = p.communicate("\n", timeout=60)
    assert int(out.split()[-1]) >= 8
    serves_on(mnt, files)


DRIP_SCRAPES = """
import socket, sys, threading, time
def drip():
    while True:  # (reconnecting as soon as the daemon drops it)
        try:
            s = socket.create_connection(('127.0.0.1', int(sys.argv[1])))
            s.sendall(b'GET /metrics HTTP/1.1\\r\\n')
            while True:
                s.sendall(b'X-Drip: 1\\r\\n')
                time.sleep(0.5)
        except OSError:
            pass
idle = [socket.create_connection(('127.0.0.1', int(sys.argv[1]))) for _ in range(200)]
for _ in range(16):
    threading.Thread(target=drip, daemon=True).start()
print('connected', flush=True)
sys.stdin.readline()
"""


@as_root
def test_metrics_connections_of_another_user_neither_take_threads_nor_starve_scrapes(
        attacker, tricky, shared_folder):
    """Another user holds 200 idle connections and 16 that drip a header line and reconnect
    when dropped: the daemon runs at most MAX_CONNECTIONS threads for them (300 threads
    before), and every scrape is answered, first try (before: drips held every slot)."""
    import urllib.request
    from fusefs import metrics
    from testkit.mounts import running_mount
    from conftest import free_port, threads_of
    port = free_port()
    mnt = os.path.join(shared_folder, "mnt")
    with running_mount(tricky[1], mnt, "-o", "allow_other", "--metrics-port", port) as (proc, _):
        url = f"http://127.0.0.1:{port}/metrics"
        urllib.request.urlopen(url, timeout=30).read()
        threads = threads_of(proc.pid)
        p = as_attacker(attacker, DRIP_SCRAPES, port, stdin=subprocess.PIPE)
        try:
            assert p.stdout.readline() == "connected\n", p.stderr.read() if p.poll() is not None else ""
            for _ in range(5):
                assert b"fusefs_opens_total" in urllib.request.urlopen(url, timeout=30).read()
                assert threads_of(proc.pid) - threads <= metrics.MAX_CONNECTIONS
        finally:
            p.communicate("\n", timeout=60)
        serves_on(mnt, tricky[2])


# ---- item 5: a reader waiting for a node that does not answer can be killed -------------------
@contextlib.contextmanager
def _outage(tricky, folder, *args):
    """A copy of the tricky set behind a storage node that can stop answering
    (testkit.outage), mounted as root with allow_other and `args`: yields (the path of a
    sample of its largest chunk, the node, the mount's daemon and its log). Once node.fail(), every read of that chunk's
    samples waits for a node that does not answer."""
    from testkit.mounts import running_mount
    from testkit.outage import outage_backend
    ix = Index.load(os.path.join(tricky[1], INDEX_NAME))
    k = int(np.argmax([c.size for c in ix.chunks]))
    sid = int(max(np.flatnonzero(ix.chunk == k), key=lambda s: int(ix.size[s])))
    mnt, backend = os.path.join(folder, "mnt"), os.path.join(folder, "node")
    with outage_backend(tricky[1], backend, only=ix.chunks[k].path) as node, \
            running_mount(backend, mnt, "-o", "allow_other", "--retries", "0", *args) as (proc, log):
        yield os.path.join(mnt, os.fsdecode(ix.file_path(sid))), node, proc, log


READ_ONE = """
import os, sys
fd = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECT)
print('reading', flush=True)
os.pread(fd, 4096, 0)
print('read')
"""


@as_root
def test_a_reader_killed_while_its_read_waits_for_a_node_ends_at_once(tricky, attacker, shared_folder):
    """Another user's O_DIRECT read of a sample whose node does not answer (io-timeout 600 s)
    waits in the daemon; SIGKILL ends the reader at once: the fast path hands the kernel's
    interrupt to the loop, which answers the read EINTR (before, the fast path swallowed
    it, and the killed reader waited out the io-timeout)."""
    import signal
    with _outage(tricky, shared_folder, "--io-timeout", "600") as (sample, node, _, _):
        mnt = os.path.join(shared_folder, "mnt")
        node.fail()
        p = as_attacker(attacker, READ_ONE, sample)
        try:
            assert p.stdout.readline() == "reading\n"
            _wait_for(mnt, lambda s: s["misses"] >= 1)  # (its read waits in the daemon)
            p.send_signal(signal.SIGKILL)
            assert p.wait(timeout=60) == -signal.SIGKILL  # (600 s before)
        finally:
            if p.poll() is None:
                p.kill()
        stats = _wait_for(mnt, lambda s: s["reads_interrupted"] >= 1)
        assert stats["interrupts_to_loop"] >= 1
        assert open(os.path.join(mnt, "root file.txt"), "rb").read() == b"at the root\n"  # (serves on)


def test_a_failed_read_ahead_retried_by_the_kernel_does_not_wait_again(tricky, tmp_path):
    """A buffered read of a sample whose node does not answer: the kernel's read-ahead waits
    for the io-timeout and fails, and the kernel then reads the page again at once; that
    read is answered EIO at once (before, it waited the io-timeout again)."""
    from fusefs.client import mount_stats
    with _outage(tricky, str(tmp_path), "--io-timeout", "1") as (sample, node, _, _):
        node.fail()
        with pytest.raises(OSError) as e:
            with open(sample, "rb") as f:
                f.read()
        assert e.value.errno == 5  # (EIO)
        stats = mount_stats(str(tmp_path / "mnt"))
    assert stats["misses"] == 1 and stats["eio_at_once"] >= 1, {k: stats[k] for k in ("misses", "eio", "eio_at_once")}


# ---- item 6: orders are bounded by the dataset and a budget, and committed off the loop -------
def test_the_orders_of_all_ranks_together_stay_within_the_order_budget(tricky):
    """Each rank's plan and order bytes count (Plan.cost is what a built plan holds); an
    order that would take all ranks past the budget is refused with the figures and the
    previous one stays; a rank's new order counts in place of its old one."""
    from fusefs import order as orderfmt
    from fusefs.entries import FsError
    from fusefs.plan import Plan
    from conftest import make_core
    _, dst, _ = tricky
    n = make_core(dst).index.n_files
    one = orderfmt.encode(np.arange(n) % n, epoch=1)
    cost = Plan.cost(n, n, 0) + len(one)
    core = make_core(dst, order_bytes=2 * cost + cost // 2)
    core.set_order(0, one)
    plan = core.plans[0]
    assert plan.nbytes + len(one) == cost == core.statistics()["order_bytes"]
    core.set_order(1, one)
    with pytest.raises(FsError, match=r"the orders of all ranks would hold .* more than the order budget"):
        core.set_order(2, one)
    stats = core.statistics()
    assert set(stats["plans"]) == {"0", "1"} and stats["order_bytes"] == 2 * cost
    assert "order budget" in stats["order_refusals"]["2"] and stats["orders_refused"] == 1
    core.set_order(1, orderfmt.encode(np.arange(n), epoch=2))  # (in place of rank 1's)
    assert core.plans[1].epoch == 2 and core.statistics()["order_bytes"] == 2 * cost
    # the control socket reads no order larger than the budget lets be
    assert core.order_limit == 2 * cost + cost // 2 < orderfmt.size_limit(n)


def test_an_order_is_prepared_off_the_event_loop(tricky, monkeypatch):
    """While an order's plan is being built (held here in its worker thread), the event loop
    answers everything else; then the order is in force. (Before, a commit of a million
    entries held the loop about 2 s: another user's stat waited as long.)"""
    import trio
    from fusefs import order as orderfmt
    from fusefs import orders as ordersmod
    from fusefs.plan import Plan
    from conftest import make_core, serving
    _, dst, _ = tricky
    core = make_core(dst)
    started, go = threading.Event(), threading.Event()

    class HeldPlan(Plan):
        def __init__(self, *a, **kw):
            started.set()
            assert go.wait(60)
            super().__init__(*a, **kw)
    monkeypatch.setattr(ordersmod, "Plan", HeldPlan)

    async def main():
        async with serving(core), trio.open_nursery() as n:
            n.start_soon(core.commit_order, 3, orderfmt.encode([2, 0, 1], epoch=9))
            with trio.fail_after(60):
                await trio.to_thread.run_sync(started.wait)
            # the loop is free while the plan is built: these run, and the order is not in force yet
            assert core.getattr(core.file_base).ino == core.file_base and 3 not in core.plans
            await trio.sleep(0)
            go.set()
        assert core.plans[3].epoch == 9
    trio.run(main)


BIG_ORDERS = """
import os, socket, sys
import numpy as np
target = os.readlink(os.path.join(sys.argv[1], '.fusefs', 'control'))
def send(rank, data):
    s = socket.socket(socket.AF_UNIX)
    s.connect(target)
    try:
        s.sendall(b'order %d %d\\n' % (rank, len(data)) + data)
    except OSError:
        pass
    return s.recv(200).decode().strip()
def order(n, epoch):  # (the format of fusefs/order.py, with importance values)
    head = b'FUSEFSOR' + (1).to_bytes(4, 'little') + (1).to_bytes(4, 'little')
    ids = (np.arange(n) % int(sys.argv[2])).astype('<u4').tobytes()
    return head + epoch.to_bytes(8, 'little') + n.to_bytes(8, 'little') + ids + np.ones(n, '<f4').tobytes()
answers = [send(rank, order(1 << 20, rank)) for rank in range(16)]
answers += [send(rank, order(2000, rank)) for rank in range(64)]
print('|'.join(sorted(set(a.split(':')[0] for a in answers))))
"""


@as_root
def test_a_control_group_member_cannot_make_orders_hold_more_than_the_order_budget(attacker, shared_mount):
    """A control-group member sends the largest orders the format allows for 16 ranks, then
    smaller ones for all 64: the daemon holds at most its order budget for them (before,
    16 of them took the daemon to 2.98 GB)."""
    from fusefs.client import mount_stats
    from conftest import resident_bytes_of
    mnt, proc, files = shared_mount
    before = resident_bytes_of(proc.pid)
    n = len([f for f in files.values() if f is not None])
    answers = attack(attacker, BIG_ORDERS, mnt, n, controls=True).split("|")
    stats = mount_stats(mnt)
    assert "too large" in answers and "ok" in answers and any("order budget" in a for a in answers), answers
    assert 0 < stats["order_bytes"] <= stats["order_budget"]
    assert resident_bytes_of(proc.pid) - before < stats["order_budget"] + (32 << 20)
    serves_on(mnt, files)


# ---- item 7: a stop signal ends the mount at once, in an outage too ------------------------------
def test_a_stop_signal_while_a_read_waits_for_a_node_unmounts_at_once(tricky, tmp_path):
    """A read waits for a node that does not answer (io-timeout 600 s); SIGTERM: the waiting
    fetch ends (the read gets EIO), the daemon unmounts and exits 0 (before, it waited for
    the fetch to give up)."""
    import signal
    with _outage(tricky, str(tmp_path), "--io-timeout", "600") as (sample, node, proc, log):
        node.fail()
        reader = subprocess.Popen([sys.executable, "-c", READ_ONE, sample], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
        try:
            assert reader.stdout.readline() == "reading\n"
            _wait_for(str(tmp_path / "mnt"), lambda s: s["misses"] >= 1)
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=60) == 0, open(log).read()[-2000:]
            _, err = reader.communicate(timeout=60)
            assert reader.returncode != 0 and ("Input/output error" in err or "not connected" in err), err
        finally:
            if reader.poll() is None:
                reader.kill()


# ---- item 8: the lower defects -----------------------------------------------------------------
@pytest.mark.parametrize("case", ["deep_json", "nul_in_chunk_path", "chunk_path_dot"])
def test_odd_index_metadata_is_refused_in_one_line_by_mount_and_info(tricky, tmp_path, case):
    """Metadata nested deeper than Python parses (checksum valid), a NUL or a `.` in a chunk
    path: `fusefs info` and `fusefs mount` refuse in one line, exit 2, no traceback (before:
    a RecursionError, a ValueError)."""
    import struct
    import xxhash
    dst = tmp_path / "dst"
    shutil.copytree(tricky[1], dst)
    raw = (dst / INDEX_NAME).read_bytes()
    if case == "deep_json":
        head = struct.Struct("<8sIIQQ")
        magic, version, flags, _, _ = head.unpack_from(raw, 0)
        blob = b"[" * 100_000 + b"]" * 100_000
        raw = head.pack(magic, version, flags, len(blob), xxhash.xxh3_64_intdigest(blob)) + blob
    else:
        bad = "chunks/a\0b.fck" if case == "nul_in_chunk_path" else "chunks/./chunk-000000.fck"

        def edit_meta(meta):
            meta["chunks"][0][0] = bad
        raw = craft_index(raw, lambda key, arr: None, edit_meta)
    (dst / INDEX_NAME).write_bytes(raw)
    r = subprocess.run(fusefs_cmd("info", dst), capture_output=True, text=True, timeout=60, cwd=REPO)
    assert r.returncode == 2 and "Traceback" not in r.stderr and len(r.stderr.splitlines()) == 1, r.stderr
    _refused(str(dst), str(tmp_path))


@as_root
def test_a_full_local_tier_logs_a_line_a_minute_not_one_a_sample(tricky, tmp_path, caplog):
    """A local tier on a 64 KiB tmpfs: every write of an epoch fails (ENOSPC) and one line
    says so, where each failed write logged its own before."""
    import trio
    from fusefs import order as orderfmt
    from fusefs.local import LocalTier
    from conftest import make_core, serving
    small = tmp_path / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k,mode=0700", "tmpfs", str(small)], check=True,
                   timeout=60)
    try:
        _, dst, files = tricky
        index = Index.load(os.path.join(dst, INDEX_NAME))
        tier = LocalTier(str(small / "tier"), 1 << 30, index)
        try:
            core = make_core(dst, local=tier)

            async def epoch():
                async with serving(core):
                    ids = list(range(core.index.n_files))
                    core.set_order(0, orderfmt.encode(ids))
                    from conftest import read_whole
                    for sid in ids:
                        await read_whole(core, sid)
            with caplog.at_level("WARNING", logger="fusefs.local"):
                trio.run(epoch)
                assert tier.wait_written()
            assert tier.write_errors > 10
            lines = [r for r in caplog.records if "cannot write" in r.getMessage()]
            assert len(lines) == 1 and "No space left on device" in lines[0].getMessage()
        finally:
            tier.close()
    finally:
        subprocess.run(["umount", str(small)], check=True, timeout=60)


@as_root
def test_a_log_file_another_user_owns_is_refused(tricky, theirs, attacker, shared_folder):
    """`--log` names a file another user made (or a hard link of theirs): root's daemon
    does not append to it (before: it did, so their file got root's log lines)."""
    log = os.path.join(theirs, "their.log")
    assert attack(attacker, "import sys\nopen(sys.argv[1], 'w').write('theirs\\n')\nprint('made')", log) == "made"
    from testkit.mounts import stop_mount
    mnt = os.path.join(shared_folder, "mnt")
    os.mkdir(mnt)
    try:
        r = subprocess.run(fusefs_cmd("mount", "--background", "--log", log, tricky[1], mnt),
                           capture_output=True, text=True, timeout=60, cwd=REPO)
        assert r.returncode == 2 and f"owned by uid {attacker[0]}" in r.stderr, r.stderr
        assert not os.path.ismount(mnt) and open(log).read() == "theirs\n"
    finally:
        stop_mount(mnt)  # (a regression would have mounted)


def test_a_dataset_folder_called_fusefs_is_not_taken_for_the_control_folder(tmp_path):
    """A class folder `.fusefs` (allowed below the root) holding an `ids` file: the client
    helpers find the mount by the mount table, and map paths with the mount's ids (before:
    the nearest `.fusefs` upwards, so that folder's file named the ids)."""
    from fusefs import client
    from testkit.mounts import running_mount
    src = tmp_path / "src"
    write_tree(src, {"cls/a.bin": b"a", "cls/b.bin": b"b", "cls/.fusefs/ids": b"cls/b.bin\0cls/a.bin\0"})
    from fusefs.pack import pack
    pack(str(src), str(tmp_path / "dst"), progress=False)
    mnt = tmp_path / "mnt"
    with running_mount(tmp_path / "dst", mnt):
        assert client.find_mount(str(mnt / "cls" / "a.bin")) == str(mnt)
        ids = client.paths_to_ids([str(mnt / "cls" / "a.bin"), str(mnt / "cls" / "b.bin")])
        table = (mnt / ".fusefs" / "ids").read_bytes().split(b"\0")
        assert [table[i] for i in ids] == [b"cls/a.bin", b"cls/b.bin"]
    with pytest.raises(FileNotFoundError, match="not inside a fusefs mount"):
        client.find_mount(str(src / "cls"))


def test_a_failed_background_mount_prints_its_own_log_lines_only():
    """Another daemon may log into the same file while a background mount fails: the lines
    printed are the failed one's (its pid on each; a traceback's lines and the command's
    own error line go with them)."""
    from fusefs.cli import LOG_FORMAT
    from fusefs.mount import own_lines
    import logging
    line = logging.Formatter(LOG_FORMAT).format(logging.makeLogRecord({"msg": "x", "name": "fusefs",
                                                                        "levelname": "INFO"}))
    assert own_lines(line + "\n", os.getpid()) == line + "\n"  # (the format the pattern reads)
    log = ("2026-11-27 10:00:00,000 [100] fusefs INFO mounted a at m1\n"
           "2026-11-27 10:00:01,000 [200] fusefs INFO starting\n"
           "2026-11-27 10:00:01,500 [100] fusefs INFO rank 0: order of 3 samples\n"
           "2026-11-27 10:00:02,000 [200] fusefs ERROR bad\n"
           "Traceback (most recent call last):\n"
           "2026-11-27 10:00:02,100 [100] fusefs INFO rank 1: order of 3 samples\n"
           "fusefs mount: FUSE refused to mount m2\n")
    assert own_lines(log, 200) == ("2026-11-27 10:00:01,000 [200] fusefs INFO starting\n"
                                   "2026-11-27 10:00:02,000 [200] fusefs ERROR bad\n"
                                   "Traceback (most recent call last):\n"
                                   "fusefs mount: FUSE refused to mount m2\n")
