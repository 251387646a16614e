"""fusefs's binding (fusefs.pyfuse3) and scripts/pyfuse3_patched.py, which writes its
sources: each patch changes what it is meant to change in a stand-in for the part of
pyfuse3 3.5.0 it touches and refuses text that changed (a new pyfuse3 must be looked at,
not patched blindly); the sources in fusefs/pyfuse3 are what the script writes from the
pinned sdist; and the built binding carries every patch."""
import contextlib
import importlib.util
import json
import multiprocessing
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from conftest import REPO
from fusefs import handles, pyfuse3
from fusefs.index import INDEX_NAME, Index

BENCH = os.path.join(REPO, "scripts", "bench")
sys.path.insert(0, BENCH)
import common  # noqa: E402  (scripts/bench/common.py)

spec = importlib.util.spec_from_file_location(
    "pyfuse3_patched", os.path.join(REPO, "scripts", "pyfuse3_patched.py"))
patched = importlib.util.module_from_spec(spec)
spec.loader.exec_module(patched)

def test_the_venv_has_every_patch():
    """scripts/setup.sh builds them; the hot-path figures in docs are measured with them."""
    assert set(patched.marks()) == {"loop", "store", "ioctl", "spawn", "fast", "interrupt", "threads",
                                    "version", "lazy", "idle", "answer_nogil", "parked", "misses", "engine",
                                    "publish"}
    assert all(getattr(pyfuse3, mark) is True for mark in patched.marks().values())
    assert not hasattr(pyfuse3, "INODE_WITHOUT_OPEN")


def test_the_venv_has_notify_store_many_and_counts_ioctls_and_tasks():
    assert callable(pyfuse3.notify_store_many) and pyfuse3.notify_store_many([]) == []
    assert isinstance(pyfuse3.ioctl_requests(), int) and isinstance(pyfuse3.loop_tasks_started(), int)


def test_each_patch_says_what_it_changes_and_changes_only_vendored_files():
    for path in patched.series():
        text = path.read_text()
        head, _, diff = text.partition("\n--- a/")
        assert head.count("\n\n") >= 1 and len(head.split("\n\n", 1)[1].strip()) > 80, path.name
        files = {line[6:] for line in ("--- a/" + diff).splitlines() if line.startswith("--- a/")}
        assert files and files <= set(patched.VENDORED), (path.name, files)


# A daemon of scripts/bench/minimal_daemon.py whose reads of files named held* wait until a
# file named go is opened: handlers that suspend.
HELD_DAEMON = """\
import json
import sys
import trio
sys.path.insert(0, sys.argv[3])
import minimal_daemon


class Held(minimal_daemon.RamFS):
    def __init__(self, src):
        super().__init__(src)
        root = self.children[1]
        self.held = {ino for name, ino in root.items() if name.startswith(b"held")}
        self.go_ino = root[b"go"]
        self.go = trio.Event()
        self.waiting = 0

    async def open(self, inode, flags, ctx):
        if inode == self.go_ino:
            self.go.set()
        return await super().open(inode, flags, ctx)

    async def read(self, fh, off, size):
        if fh in self.held:
            self.waiting += 1
            await self.go.wait()
            self.waiting -= 1
        return await super().read(fh, off, size)

    def _stats(self):
        out = json.loads(super()._stats())
        return json.dumps({**out, "waiting": self.waiting}).encode()


minimal_daemon.RamFS = Held
sys.exit(minimal_daemon.main())
"""


@contextlib.contextmanager
def ram_daemon(tmp_path, files: dict, script: str | None = None):
    """scripts/bench/minimal_daemon.py (or script, run the same way) serving files at a
    mount point; yields (mount point, a function returning its stats); always unmounted."""
    src, mnt = tmp_path / "src", tmp_path / "mnt"
    src.mkdir()
    for name, data in files.items():
        (src / name).write_bytes(data)
    path = None
    if script is not None:
        path = tmp_path / "daemon.py"
        path.write_text(script)
    with common.minimal_daemon(str(src), str(mnt), timeout=30, script=path and str(path),
                               args=(BENCH,) if path else ()) as proc:
        def stats():
            with open(mnt / ".minimal-stats", "rb") as f:
                return json.loads(f.read())
        try:
            yield mnt, stats
        finally:
            # the daemon first: if no task of it answers (a broken loop), the kernel's
            # requests for files still open here, such as the flush of their close in the
            # child that fusermount3 forks from this process, fail only once it is gone
            proc.terminate()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=60)


def _read_all(paths):
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.read(fd, 1 << 20)
        finally:
            os.close(fd)


def test_a_request_loop_under_load_starts_no_tasks_for_handlers_that_never_wait(tmp_path):
    """4 processes opening files the kernel holds, as fast as they can: many requests queue,
    no handler suspends, so no task beyond the second is needed. (pyfuse3's own rule, with
    the loop patch, started one for about every sample.)"""
    files = {f"f{i:03d}": os.urandom(2000) for i in range(250)}
    with ram_daemon(tmp_path, files) as (mnt, stats):
        paths = [str(mnt / name) for name in files]
        _read_all(paths)  # (the kernel keeps the pages: keep_cache)
        before = stats()
        with multiprocessing.get_context("fork").Pool(4) as pool:
            pool.map(_read_all, [paths[k::4] * 8 for k in range(4)])
        after = stats()
    opened = after["requests"]["open"] - before["requests"]["open"]
    assert opened >= 2000
    assert after["loop_tasks"] - before["loop_tasks"] <= 2, (before, after)


def test_a_handler_that_waits_does_not_stop_the_loop(tmp_path):
    """Reads of two files wait (their handlers suspend) until a third file is opened: that
    open, and the stats file's, must be answered meanwhile by tasks started for them."""
    files = {"held1": b"a" * 5000, "held2": b"b" * 7000, "go": b"go"}
    with ram_daemon(tmp_path, files, HELD_DAEMON) as (mnt, stats):
        got = {}
        readers = [threading.Thread(target=lambda n=n: got.update({n: (mnt / n).read_bytes()}))
                   for n in ("held1", "held2")]
        for t in readers:
            t.start()
        deadline = time.monotonic() + 10
        while within(10, stats)["waiting"] < 2:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert not got  # both wait
        assert within(10, (mnt / "go").read_bytes) == b"go"
        for t in readers:
            t.join(timeout=10)
        assert got == {"held1": files["held1"], "held2": files["held2"]}
        assert within(10, stats)["loop_tasks"] >= 3  # (two in handlers, one to answer the rest)


def within(seconds: float, fn):
    """fn()'s result, or AssertionError if it takes longer than seconds (a request that no
    task of the daemon answers blocks its caller until the mount goes away)."""
    out = []
    t = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    t.start()
    t.join(seconds)
    assert out, f"{fn} got no answer within {seconds} s"
    return out[0]


FRESH_FAST_PATH = """
import os
from fusefs import fastpath, handles, pyfuse3
assert pyfuse3.FAST_PATH is True
try:  # (no session in this process)
    pyfuse3.fast_path_start(2, 10, 1 << 62, 32, 0, 1 << 29, os.O_WRONLY, fastpath.BATCH,
                            fastpath.DELAY_US, handles.EVENT_BITS)
except RuntimeError as e:
    assert "init" in str(e), e
else:
    raise SystemExit("started without a session")
assert pyfuse3.fast_path_events() == b""
counts = pyfuse3.fast_path_counts()
assert set(counts) == {"open", "release", "ioctl", "read", "lookup", "forget", "interrupt"}, counts
assert not any(counts.values()), counts
assert pyfuse3.fast_path_interrupts_forwarded() == 0 and pyfuse3.reads_interrupted() == 0
assert pyfuse3.fast_path_read_bytes() == 0
print("fresh")
"""


def test_the_binding_has_the_fast_path():
    """In a fresh process (its counters are the process's: the other tests of this one
    move them): the fast path is built in, does not start without a session, and has
    answered nothing."""
    r = subprocess.run([sys.executable, "-c", FRESH_FAST_PATH], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "fresh", r.stderr[-2000:]


REFUSE_BITS = """
import errno, os, sys
from fusefs import pyfuse3
pyfuse3.init(pyfuse3.Operations(), sys.argv[1], ["fsname=fusefs-test"])
try:
    for bits in [(1 << 63, 1 << 62, 1 << 61, (1 << 60) | 1), (1 << 63, 1 << 63, 1 << 61, 1 << 60),
                 (1 << 63, 1 << 62, 1 << 61, 1 << 20), (1 << 63, 1 << 40, 1 << 61, 1 << 60),
                 (1 << 63, 1 << 62, 1 << 61, 0)]:
        try:
            pyfuse3.fast_path_start(2, 10, 1 << 62, 32, 0, 1 << 29, os.O_WRONLY, 256, 20000, bits)
        except OSError as e:
            assert e.errno == errno.EINVAL, e
        else:
            raise SystemExit(f"accepted {bits}")
    print("refused all")
finally:
    pyfuse3.close(unmount=True)
"""


def test_the_fast_path_takes_its_event_bits_from_fusefs_and_refuses_bits_a_handle_can_have(tmp_path):
    """The events' bits have one source, fusefs's handles.py (EVENT_BITS, handed over at the
    start); the thread refuses bits that are not single and distinct, or that a handle
    (released, read) or a sample id (read_end, read_lost) can have, after init() on a real
    mount point and before it starts."""
    assert handles.EVENT_BITS == (handles.RELEASED, handles.READ, handles.READ_END, handles.READ_LOST)
    assert handles.FORGOTTEN == handles.RELEASED | handles.READ
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    r = subprocess.run([sys.executable, "-c", REFUSE_BITS, str(mnt)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0 and "refused all" in r.stdout, r.stderr[-2000:]
    assert not os.path.ismount(mnt)


def test_fast_path_hold_takes_bytes_only_and_keeps_no_reference_without_a_thread():
    """fast_path_hold keeps a reference to what it holds while the thread runs (tests
    with a mount: test_mount.py); before the thread started there is no table, and the
    bytes are neither kept nor leaked."""
    data = bytes(1000)
    before = sys.getrefcount(data)
    pyfuse3.fast_path_hold(3, data)
    pyfuse3.fast_path_hold(3, None)
    assert sys.getrefcount(data) == before
    with pytest.raises(TypeError, match="bytes or None"):
        pyfuse3.fast_path_hold(3, bytearray(10))
    flags = np.zeros(4, dtype=bool).view(np.uint8)  # (KernelView.flags(): its held flags' bytes)
    pyfuse3.fast_path_kernel_flags(flags)
    pyfuse3.fast_path_kernel_flags(None)
    with pytest.raises(TypeError, match="array of bytes"):
        pyfuse3.fast_path_kernel_flags(np.zeros(4, dtype=np.int64))


def test_fast_path_tree_takes_only_arrays_it_can_read_within(tricky):
    """fast_path_tree takes the index's arrays as the core hands them over
    (Core.fast_path_args) and refuses arrays of another type or length, and a tree whose
    folders or names point outside its arrays (the thread reads them without checks)."""
    from fusefs.core import Core
    from fusefs.store import ChunkStore
    _, dst, _ = tricky
    index = Index.load(os.path.join(dst, INDEX_NAME))
    tree = Core(index, ChunkStore(dst, index)).fast_path_args()["tree"]
    pyfuse3.fast_path_tree(tree)
    assert pyfuse3._fusefs_tree is tree  # (kept alive while the thread may read it) ...
    pyfuse3._fusefs_free()  # ... until close() frees it after the thread's join
    assert pyfuse3._fusefs_tree is None and pyfuse3._fusefs_kernel_flags is None
    with pytest.raises(TypeError, match="name_len"):
        pyfuse3.fast_path_tree(dict(tree, name_len=tree["name_len"].astype(np.uint64)))
    with pytest.raises(TypeError, match="mtime_ns must be"):
        pyfuse3.fast_path_tree(dict(tree, mtime_ns=tree["mtime_ns"][:-1]))
    bad = tree["dir_nfiles"].copy()
    bad[0] = index.n_files + 1
    with pytest.raises(OSError, match="Invalid argument"):
        pyfuse3.fast_path_tree(dict(tree, dir_nfiles=bad))
    bad = tree["name_off"].copy()
    bad[-1] = len(tree["names"])
    with pytest.raises(OSError, match="Invalid argument"):
        pyfuse3.fast_path_tree(dict(tree, name_off=bad))
    pyfuse3.fast_path_tree(None)


def test_the_vendored_sources_are_what_the_script_writes_from_the_pinned_sdist(tmp_path):
    """fusefs/pyfuse3 is pyfuse3 3.5.0's sdist (SHA-256 checked) with the patches applied:
    writing it anew changes nothing (an edit made there by hand, not in the script, fails).
    From set-up's copy of the sdist: no package index once set-up is done."""
    r = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "pyfuse3_patched.py"), "--offline",
                        "--into", str(tmp_path / "pyfuse3")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    vendored = os.path.join(REPO, "fusefs", "pyfuse3")
    written = sorted(str(f.relative_to(tmp_path / "pyfuse3")) for f in (tmp_path / "pyfuse3").rglob("*") if f.is_file())
    assert written == sorted(list(patched.VENDORED) + ["LICENSE"] + [
        f"include/{n}" for n in os.listdir(os.path.join(vendored, "include"))])
    for rel in written:
        with open(os.path.join(vendored, rel), "rb") as f:
            assert f.read() == (tmp_path / "pyfuse3" / rel).read_bytes(), rel
    assert all(f"\n{mark} = True\n" in open(os.path.join(vendored, "__init__.pyx")).read()
               for mark in patched.marks().values())


def test_a_patch_that_does_not_apply_is_refused_by_name(tmp_path):
    """A pyfuse3 whose text changed where a patch applies stops the script, naming the patch
    (a new release must be looked at, not patched blindly)."""
    import shutil
    work = tmp_path / "src"
    work.mkdir()
    for name in patched.VENDORED:  # (the series applied: the first patch no longer applies)
        shutil.copy(os.path.join(REPO, "fusefs", "pyfuse3", name), work / name)
    first = patched.series()[0]
    with pytest.raises(SystemExit, match=first.name):
        patched.apply(first, work)


def test_an_edit_of_the_vendored_sources_is_recorded_as_the_next_patch(tmp_path, monkeypatch):
    """--record turns fusefs/pyfuse3's edits beyond the series into the next patch (with its
    mark), and writing the sources anew with it gives the edited sources back."""
    import shutil
    vendored, series = tmp_path / "pyfuse3", tmp_path / "patches"
    shutil.copytree(os.path.join(REPO, "fusefs", "pyfuse3"), vendored,
                    ignore=shutil.ignore_patterns("*.so", "__init__.c"))
    shutil.copytree(patched.PATCH_DIR, series)
    monkeypatch.setattr(patched, "VENDOR_DIR", vendored)
    monkeypatch.setattr(patched, "PATCH_DIR", series)
    handlers = vendored / "handlers.pxi"
    handlers.write_text(handlers.read_text().replace("cdef void fuse_read (", "# an edit\ncdef void fuse_read (", 1))
    path = patched.record("edit", "An edit, to test --record: one comment line.", "EDITED")
    assert path.name == f"{len(patched.series()):04d}-edit.patch" and patched.marks()["edit"] == "EDITED"
    patched.write(tmp_path / "again")
    for name in patched.VENDORED:
        assert (tmp_path / "again" / name).read_bytes() == (vendored / name).read_bytes(), name
    assert "\nEDITED = True\n" in (vendored / "__init__.pyx").read_text()
    with pytest.raises(SystemExit, match="nothing to record"):
        patched.record("again", "", "AGAIN")


def test_the_sdist_copy_is_checked_by_its_hash_and_offline_never_downloads(tmp_path, monkeypatch):
    """A copy that is not the pinned sdist is refused; with no copy, --offline refuses
    instead of asking the package index."""
    bad = tmp_path / "pyfuse3-3.5.0.tar.gz"
    bad.write_bytes(b"not pyfuse3")
    monkeypatch.setattr(patched, "SDIST_COPY", bad)
    with pytest.raises(SystemExit, match="SHA-256"):
        patched.sdist_sources(tmp_path / "x", offline=True)
    monkeypatch.setattr(patched, "SDIST_COPY", tmp_path / "none.tar.gz")
    monkeypatch.setattr(patched, "fetch", lambda into: pytest.fail("asked the package index"))
    with pytest.raises(SystemExit, match="setup.sh"):
        patched.sdist_sources(tmp_path / "x", offline=True)
