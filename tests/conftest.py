"""Shared fixtures: small source trees, packed datasets and real FUSE mounts.

Every mount is started as a subprocess (`python -m fusefs mount`, foreground) and torn
down in `finally`: `fusermount3 -u -z` if it is still in /proc/mounts (dead mounts too),
then terminate, then kill. No test leaves a mount or a daemon behind: a test that hangs on
one (a stopped daemon, say) has its daemons killed and its mounts unmounted at nine tenths
of its time limit (testkit.guard), so it fails and cleans up within it.
"""
from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import pwd
import random
import subprocess
import sys
from concurrent.futures import ProcessPoolExecutor

import numpy as np
import pytest
import trio

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "scripts"))  # testkit: the harness the tests share

from testkit.mounts import resolve, running_mount  # noqa: E402
from testkit.guard import pytest_runtest_call  # noqa: E402,F401  (the hook, for every test)
from fusefs import order as orderfmt
from fusefs.pack import pack


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


def page_cache_holds(fd: int, size: int) -> bool:
    """Whether the kernel page cache holds every page of the first size bytes of the file
    open as fd, asking the kernel only (mmap and mincore: nothing is read, no request
    reaches a FUSE daemon). The kernel may drop clean pages whenever memory is short, so a
    test that counts the reads its daemon sees checks what the kernel held first."""
    addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    if addr is None or addr == ctypes.c_void_p(-1).value:
        raise OSError(ctypes.get_errno(), "mmap failed")
    try:
        vec = ctypes.create_string_buffer((size + mmap.PAGESIZE - 1) // mmap.PAGESIZE)
        if _libc.mincore(addr, size, vec) != 0:
            raise OSError(ctypes.get_errno(), "mincore failed")
        return all(b & 1 for b in vec.raw)
    finally:
        _libc.munmap(addr, size)


def whole_set(index) -> int:
    """A cache budget that holds every sample of index (each entry costs its bytes and the
    cache's per-entry overhead)."""
    from fusefs.cache import ENTRY_OVERHEAD
    return index.total_bytes + index.n_files * ENTRY_OVERHEAD


def make_core(dst, *, local=None, kernel=None, **config):
    """A filesystem core (no mount) over the packed folder dst (or an in-place set's index)."""
    from fusefs.config import MountConfig
    from fusefs.core import Core
    from fusefs.index import INDEX_NAME, Index
    from fusefs.store import ChunkStore
    ix = Index.load(os.path.join(dst, INDEX_NAME))
    return Core(ix, ChunkStore(ix.data_root(str(dst)), ix), MountConfig.of(**config), local=local, kernel=kernel)


class Kernel:
    """A kernel page cache (fs.KernelCache's interface) that answers each push with the errno
    given for its inode (0: stored), remembering the inodes pushed."""

    def __init__(self, errs=None):
        self.errs = errs or {}
        self.pushed = []

    def push(self, items):
        self.pushed += [ino for ino, _ in items]
        return [self.errs.get(ino, 0) for ino, _ in items]


@contextlib.asynccontextmanager
async def serving(core):
    """Run the core's tasks (read-ahead, fetches) around the block, as a mount does."""
    async with trio.open_nursery() as nursery:
        await nursery.start(core.run)
        try:
            yield core
        finally:
            nursery.cancel_scope.cancel()


async def read_whole(core, sid):
    """Open, read and close sample sid through the core, as a reader would."""
    fh = core.open(core.file_base + sid, os.O_RDONLY).fh
    try:
        return await core.read(fh, 0, 1 << 20)
    finally:
        core.release(fh)


class Clock:
    """A clock that moves only when a test moves it (`clock.t += seconds`)."""

    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def flip_byte(path, at: int, mask: int = 0x55) -> None:
    """Change the byte at offset `at` of the file at path in place (xor mask)."""
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ mask]))


IMAGEFOLDER_READER = os.path.join(REPO, "scripts", "workloads", "imagefolder_reader.py")


def read_with_imagefolder(root, *args) -> dict:
    """What scripts/workloads/imagefolder_reader.py (torchvision's ImageFolder + DataLoader
    with 2 workers, run by Debian's /usr/bin/python3) prints for the tree at root."""
    import json
    import subprocess
    r = subprocess.run(["/usr/bin/python3", IMAGEFOLDER_READER, str(root), "--workers", "2", *args],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout)


def corrupt_sample(dst, copy, rel: str, at: int = 0):
    """Copy the packed folder dst to copy and flip a byte of sample rel's stored bytes
    (at: offset into the sample, negative from its end); return (index, sid, chunk path)."""
    import shutil
    from fusefs.index import INDEX_NAME, Index
    shutil.copytree(dst, copy)
    ix = Index.load(os.path.join(copy, INDEX_NAME))
    sid = resolve(ix, rel)[1]
    assert int(ix.size[sid]) > 0
    path = os.path.join(copy, ix.chunks[int(ix.chunk[sid])].path)
    raw = bytearray(open(path, "rb").read())
    raw[int(ix.offset[sid]) + at % int(ix.size[sid])] ^= 0xFF
    with open(path, "wb") as f:
        f.write(raw)
    return ix, sid, path


# Modules whose tests mount a real FUSE filesystem, build a wheel or train a model: marked
# `mount`; every other test is marked `unit` (no mount; `pytest -m unit` runs in seconds).
SLOW_MODULES = {"test_abuse", "test_cli", "test_clients", "test_demo", "test_faults", "test_gluster",
                "test_hints", "test_hybrid", "test_imagefolder", "test_importance", "test_local",
                "test_metrics", "test_mount", "test_orders", "test_pack", "test_package",
                "test_pyfuse3_patched", "test_swap", "test_untrusted", "test_fastpath_threads",
                "test_harness", "test_inplace", "test_run", "test_misses"}


def _remove_dead_runs_folders(base: str) -> None:
    """The runtime folders of earlier runs that were killed (their pid, in the name, is
    gone): a killed run cannot remove its own."""
    import re
    import shutil
    for name in os.listdir(base):
        m = re.fullmatch(r"fusefs-tests-(\d+)-\w+", name)
        if m and not os.path.exists(f"/proc/{m.group(1)}"):
            shutil.rmtree(os.path.join(base, name), ignore_errors=True)


def pytest_configure(config):
    """The daemons the tests start keep their logs and control sockets in a runtime folder
    of this run's (FUSEFS_RUNTIME_DIR), removed at its end: nothing is left in /run/fusefs.
    (Under /run for root: a second user the tests make must reach the sockets in it.)"""
    import tempfile
    from fusefs.runtime import RUNTIME_ENV
    if RUNTIME_ENV not in os.environ:
        base = "/run" if os.geteuid() == 0 else tempfile.gettempdir()
        _remove_dead_runs_folders(base)
        folder = tempfile.mkdtemp(prefix=f"fusefs-tests-{os.getpid()}-", dir=base)
        os.environ[RUNTIME_ENV] = folder
        config._fusefs_runtime = folder
    if os.geteuid() == 0:
        _remove_made()  # (the accounts a killed run left, whatever this run tests)


def _testbed_exists() -> bool:
    from testkit.gluster import GLUSTER_SH
    try:
        return subprocess.run([GLUSTER_SH, "exists"], capture_output=True, timeout=120).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


_TESTBED_USED = []  # a test of this run that needs the test bed has run (marked gluster)


def pytest_runtest_setup(item):
    if item.get_closest_marker("gluster") is not None:
        _TESTBED_USED.append(item.nodeid)


@pytest.fixture(scope="session", autouse=True)
def _testbed_as_found():
    """The GlusterFS test bed's volume is taken down at the end of the run if the run
    brought it up (the demo leaves it up for its next run, as the benchmarks do): if it was
    not there at the start, and a test of this run that needs it ran. (A run of other tests
    beside one that uses the test bed, a second user's say, leaves it alone.)"""
    existed = _testbed_exists()
    yield
    if not existed and _TESTBED_USED and _testbed_exists():
        from testkit.gluster import GLUSTER_SH
        subprocess.run([GLUSTER_SH, "down"], capture_output=True, timeout=300)


def pytest_unconfigure(config):
    import shutil
    folder = getattr(config, "_fusefs_runtime", None)
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)


def pytest_ignore_collect(collection_path, config):
    """`-m unit` does not import the modules whose tests are all `mount` (torch, the
    GlusterFS kit, ...): their every test would be deselected after the import."""
    if config.getoption("markexpr", "").strip() == "unit" and collection_path.suffix == ".py":
        return collection_path.stem in SLOW_MODULES or None
    return None


def pytest_collection_modifyitems(config, items):
    for item in items:
        slow = item.module.__name__.rsplit(".", 1)[-1] in SLOW_MODULES
        item.add_marker(pytest.mark.mount if slow else pytest.mark.unit)


def fusefs_cmd(*args) -> list[str]:
    return [sys.executable, "-m", "fusefs", *map(str, args)]


def refused_mount(*args, mnt, timeout: float = 60):
    """Run `fusefs mount ARGS`, which the test expects to be refused: bounded by timeout, and
    whatever happens (a regression that lets it mount), nothing is left mounted at mnt."""
    import subprocess
    from fusefs.mounts import is_mounted
    from testkit.mounts import stop_mount
    try:
        return subprocess.run(fusefs_cmd("mount", *args), capture_output=True, text=True,
                              timeout=timeout, cwd=REPO)
    finally:
        if is_mounted(mnt):
            stop_mount(mnt)



def write_tree(root, files: dict):
    """files: relative path -> bytes (a path ending in '/' makes an empty folder)."""
    for rel, data in files.items():
        path = os.path.join(root, rel)
        if rel.endswith("/"):
            os.makedirs(path, exist_ok=True)
            continue
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)


def read_tree(root) -> dict:
    """relative path -> bytes for every file, '' -> None for every folder (with '/')."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d != ".fusefs")
        rel = os.path.relpath(dirpath, root)
        out[("" if rel == "." else rel + "/")] = None
        for name in filenames:
            with open(os.path.join(dirpath, name), "rb") as f:
                out[os.path.normpath(os.path.join(rel, name))] = f.read()
    return out


def tricky_tree() -> dict:
    """Names with spaces and non-ASCII, nesting, empty files and folders, sizes 0..300 KB."""
    import random
    rng = random.Random(7)
    files = {}
    for c in ["cat", "dog", "with space", "ünïcødé", "zz"]:
        for i in range(12):
            files[f"{c}/img {i:03d}.jpg"] = rng.randbytes(rng.choice([0, 1, 100, 4096, 70_000, 131_073, 300_000]))
    files["cat/deep/er/still deeper/x.bin"] = rng.randbytes(5000)
    files["dog/empty.bin"] = b""
    files["root file.txt"] = b"at the root\n"
    files["empty class/"] = None
    files["zz/empty sub/"] = None
    return files


@pytest.fixture(scope="session")
def tricky(tmp_path_factory):
    """(src, dst, files) for the tricky tree, packed with small chunks."""
    base = tmp_path_factory.mktemp("tricky")
    src, dst = base / "src", base / "dst"
    files = tricky_tree()
    write_tree(src, files)
    pack(str(src), str(dst), chunk_bytes=256 << 10, progress=False)
    return str(src), str(dst), files


@pytest.fixture
def tricky_mount(tricky, tmp_path):
    src, dst, files = tricky
    mnt = tmp_path / "mnt"
    with running_mount(dst, mnt) as (proc, log):
        yield src, str(mnt), proc, log


@pytest.fixture(scope="session")
def three_nodes(tmp_path_factory):
    """300 files of 1..40 KB packed 10 per chunk over 3 node folders."""
    import random
    base = tmp_path_factory.mktemp("nodes")
    rng = random.Random(1)
    files = {f"c{i % 5}/f{i:04d}.bin": rng.randbytes(rng.randrange(1000, 40_000)) for i in range(300)}
    write_tree(base / "src", files)
    pack(str(base / "src"), str(base / "dst"), chunk_count=10, nodes=3, progress=False)
    return str(base / "dst"), files


def craft_index(raw: bytes, edit_arrays, edit_meta=lambda meta: None) -> bytes | None:
    """The index file raw with its arrays and metadata changed and every checksum made
    valid again: what someone who writes an index by hand could hand the daemon. None if the
    new metadata does not fit where the old lay (the arrays keep their places)."""
    import json
    import struct
    import xxhash
    head = struct.Struct("<8sIIQQ")
    magic, version, flags, meta_len, _ = head.unpack_from(raw, 0)
    meta = json.loads(raw[head.size:head.size + meta_len])
    data = bytearray(raw)
    base = meta["base"]
    for key, (dtype, length, rel, _) in meta["arrays"].items():
        arr = np.frombuffer(data, dtype=dtype, count=length, offset=base + rel)
        arr = np.array(arr)
        edit_arrays(key, arr)
        data[base + rel:base + rel + arr.nbytes] = arr.tobytes()
        meta["arrays"][key][3] = xxhash.xxh3_64_intdigest(arr)
    edit_meta(meta)
    blob = json.dumps(meta, sort_keys=True).encode()
    if len(blob) > base - head.size:
        return None
    blob = blob.ljust(base - head.size)
    return bytes(head.pack(magic, version, flags, len(blob), xxhash.xxh3_64_intdigest(blob))) + blob + bytes(data[base:])


# ---- attacks as a second user of the node, through a root mount with allow_other -----------
# A user the test creates when it runs as root (as CI does), removed again afterwards: each
# attack runs as that user in a process of theirs (/usr/bin/python3, which any user can run),
# against a root daemon mounted with -o allow_other, as on a shared GPU node.
ATTACKER, CONTROLLERS = "fusefs-attacker", "fusefs-control"
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="a second user needs root (CI runs as root)")


def _run(*cmd):
    subprocess.run(cmd, check=True, capture_output=True, timeout=60)


# The accounts the attacker fixture made and has not removed yet, a line each ("userdel
# NAME PID", PID the run's that made it): a run killed before its teardown leaves them here,
# and the next run removes them when it starts. Root's own folder in /run, never a guessable
# name in /tmp.
MADE_ACCOUNTS = "/run/fusefs-tests/accounts"


def _record_made(cmds: list) -> None:
    """Record what this run made (cmds: (command, name) pairs, their undoing), beside what
    other runs still alive made."""
    os.makedirs(os.path.dirname(MADE_ACCOUNTS), mode=0o700, exist_ok=True)
    others = [c for c in _made_lines() if c[2] != str(os.getpid())]
    with open(MADE_ACCOUNTS, "w") as f:
        f.write("".join(" ".join(c) + "\n" for c in others + [(*c, str(os.getpid())) for c in cmds]))


def _made_lines() -> list:
    try:
        with open(MADE_ACCOUNTS) as f:
            lines = [line.split() for line in f]
    except FileNotFoundError:
        return []
    return [c for c in lines if len(c) == 3 and c[0] in ("userdel", "groupdel") and c[2].isdigit()]


def _kill_processes_of(name: str) -> None:
    """Kill what still runs as the account `name` (this test suite's own, about to go: a
    process left running would keep userdel from removing it)."""
    import psutil
    try:
        uid = pwd.getpwnam(name).pw_uid
    except KeyError:
        return
    for p in psutil.process_iter(["uids"]):
        try:
            if uid in p.info["uids"]:
                p.kill()
        except (psutil.Error, TypeError):
            pass


def _remove_made() -> None:
    """Undo what MADE_ACCOUNTS lists of this run and of runs no longer alive (a killed
    run's): their processes killed, then the accounts removed; a line whose command failed
    stays for the next run, and the list goes when it is empty."""
    keep = []
    for cmd, name, pid in _made_lines():
        if pid != str(os.getpid()) and os.path.exists(f"/proc/{pid}"):
            keep.append((cmd, name, pid))  # (another run's, still going)
            continue
        if cmd == "userdel":
            _kill_processes_of(name)
        rc = subprocess.run([cmd, name], capture_output=True, timeout=60).returncode
        if rc not in (0, 6):  # (6: no such user or group)
            keep.append((cmd, name, pid))
    if keep:
        with open(MADE_ACCOUNTS, "w") as f:
            f.write("".join(" ".join(c) + "\n" for c in keep))
        return
    with contextlib.suppress(FileNotFoundError):
        os.unlink(MADE_ACCOUNTS)
    with contextlib.suppress(OSError):
        os.rmdir(os.path.dirname(MADE_ACCOUNTS))


@pytest.fixture(scope="module")
def attacker():
    """(uid, gid, control_gid): a user with no rights on this node but their own, and a
    group (CONTROLLERS) they are put in when a test says so; both made for this module and
    removed after it, failed or not (and by the next run, if this one is killed first)."""
    import grp
    _remove_made()
    made = []
    try:
        try:
            grp.getgrnam(CONTROLLERS)
        except KeyError:
            made.append(("groupdel", CONTROLLERS))
            _record_made(made)
            _run("groupadd", "--system", CONTROLLERS)
        try:
            pwd.getpwnam(ATTACKER)
        except KeyError:
            made.insert(0, ("userdel", ATTACKER))
            _record_made(made)
            _run("useradd", "--system", "--user-group", "--no-create-home", "--shell", "/usr/sbin/nologin",
                 "--comment", "fusefs tests (removed after the run)", ATTACKER)
        user = pwd.getpwnam(ATTACKER)
        yield user.pw_uid, user.pw_gid, grp.getgrnam(CONTROLLERS).gr_gid
    finally:
        _remove_made()  # (what `made` lists, as recorded)


def as_attacker(attacker, code: str, *args, controls=False, stdin=None, env=None):
    """Run code (Python) as the attacker, in the control group if `controls` (in environment
    env, default this process's): the process."""
    import subprocess
    uid, gid, cgid = attacker
    groups = [f"--groups={cgid}"] if controls else ["--clear-groups"]
    return subprocess.Popen(["setpriv", f"--reuid={uid}", f"--regid={gid}", *groups,
                             "/usr/bin/python3", "-c", code, *map(str, args)],
                            stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def attack(attacker, code, *args, controls=False) -> str:
    """What code, run as the attacker, printed (it must exit 0)."""
    p = as_attacker(attacker, code, *args, controls=controls)
    out, err = p.communicate(timeout=300)
    assert p.returncode == 0, err
    return out.strip()


@pytest.fixture
def shared_folder():
    """A folder every user may reach (as /mnt or /data are), made under an unguessable name."""
    import shutil
    import tempfile
    base = tempfile.mkdtemp(prefix="fusefs-shared-")
    os.chmod(base, 0o755)
    yield base
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def shared_mount(tricky, shared_folder, attacker):
    """The tricky set mounted by root for every user (allow_other), CONTROLLERS may control:
    (mount point, daemon process, files)."""
    from testkit.mounts import running_mount
    mnt = os.path.join(shared_folder, "mnt")
    with running_mount(tricky[1], mnt, "--cache-size", "1MiB", "-o", "allow_other",
                       "--control-group", CONTROLLERS) as (proc, _):
        yield mnt, proc, tricky[2]


def serves_on(mnt, files):
    """The daemon still serves every file right (as root)."""
    from conftest import read_tree
    assert {k: v for k, v in read_tree(mnt).items() if v is not None} == {k: v for k, v in files.items() if v is not None}


TRY = """
import errno, os, sys
def attempt(f, *a):
    try:
        f(*a)
        return 'ok'
    except OSError as e:
        return errno.errorcode[e.errno]
"""


# a reader process of the stress tests: passes over its plan's (rel, digest) files, O_DIRECT
STRESS_READER = """
import errno, json, os, sys, xxhash
mnt, plan = sys.argv[1], json.load(open(sys.argv[2]))
while True:
    for rel, digest in plan:  # (digest None: a corrupt sample, EIO)
        try:
            fd = os.open(os.path.join(mnt, rel), os.O_RDONLY | os.O_DIRECT)  # (to the daemon)
            try:
                got = bytearray()
                while part := os.pread(fd, 1 << 17, len(got)):
                    got += part
            finally:
                os.close(fd)
        except OSError as e:
            if digest is None and e.errno == errno.EIO:
                continue
            sys.exit(f'{rel}: {e}')
        if digest is None or xxhash.xxh3_64_hexdigest(got) != digest:
            sys.exit(f'{rel}: wrong bytes')
    print('pass', flush=True)
"""


def corrupt_three(dst, copy, files: dict, rng):
    """Copy the packed folder dst to copy with three samples of it corrupt, drawn by rng;
    return (index, the three names, name -> xxh3 hex digest of its bytes, None where corrupt)."""
    import xxhash
    rels = sorted(files)
    bad = rng.sample(rels, 3)
    ix, _, _ = corrupt_sample(dst, copy, bad[0])
    for rel in bad[1:]:
        sid = resolve(ix, rel)[1]
        flip_byte(os.path.join(copy, ix.chunks[int(ix.chunk[sid])].path), int(ix.offset[sid]) + 1)
    return ix, bad, {r: None if r in bad else xxhash.xxh3_64_hexdigest(files[r]) for r in rels}


def stress_readers(mnt: str, plans: list[str], rng, last_passes: int) -> None:
    """A reader process (STRESS_READER) a plan, each pass of them all waited for, two of them
    killed mid-pass and replaced, three times; then last_passes more; every reader killed
    at the end; then wait until the mount has let go of their handles."""
    import signal
    import subprocess
    import time
    from trainer.hints import mount_stats

    def reader(k):
        return subprocess.Popen([sys.executable, "-c", STRESS_READER, mnt, plans[k]], stdout=subprocess.PIPE)
    readers = [reader(k) for k in range(len(plans))]
    try:
        for _ in range(3):
            passes(readers, 1)
            for k in rng.sample(range(len(plans)), 2):  # (killed mid-pass: reading)
                readers[k].send_signal(signal.SIGKILL)
                readers[k].wait(timeout=60)
                readers[k].stdout.close()
                readers[k] = reader(k)
        passes(readers, last_passes)
    finally:
        for r in readers:
            r.kill()
            r.wait(timeout=60)
            r.stdout.close()
    deadline = time.monotonic() + 30
    while mount_stats(mnt)["open_handles"] > 1:  # (the control file's own)
        assert time.monotonic() < deadline, "handles of killed readers were not released"
        time.sleep(0.1)


def passes(readers, n: int, bound: float = 120.0) -> None:
    """Wait until each reader (a process that prints a line a pass over its files, its stdout
    a pipe) finished n passes; fail if one ends (a read failed) or they take longer than
    `bound` seconds (a read hangs)."""
    import selectors
    import time
    sel = selectors.DefaultSelector()
    left = {}
    for r in readers:
        sel.register(r.stdout.fileno(), selectors.EVENT_READ, r)
        left[r] = n
    deadline = time.monotonic() + bound
    try:
        while any(left.values()):
            ready = sel.select(timeout=max(0.0, deadline - time.monotonic()))
            assert ready, f"readers still reading after {bound:.0f} s: a read hangs"
            for key, _ in ready:
                got = os.read(key.fd, 1 << 16)  # (one line per pass)
                assert got, f"a reader ended: exit {key.data.wait()}"
                left[key.data] = max(0, left[key.data] - got.count(b"\n"))
    finally:
        sel.close()


def resident_bytes_of(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmRSS:"))


def rss_within(pid: int, bound: int, rounds: int = 200) -> int:
    """Process pid's resident memory once it is within bound (the daemon's governor checks
    every second), or what it is after rounds of 50 ms."""
    import threading
    for _ in range(rounds):
        rss = resident_bytes_of(pid)
        if rss <= bound:
            return rss
        threading.Event().wait(0.05)
    return resident_bytes_of(pid)


def threads_of(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Threads:"))


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- shared by several test modules ------------------------------------------------------
EPOCH_DEADLINE_S = 300.0  # (pytest's own limit is 600 s)


async def settled(core) -> None:
    """Until the read-ahead has nothing under way: every fetch it started is done and
    delivered, every batch task has ended (and so woken the read-ahead to deal what it
    queued), nothing waits in its queues, and every task waits."""
    import trio.testing
    prefetcher = core.prefetcher
    while True:
        await trio.testing.wait_all_tasks_blocked()
        inflight = core.fetcher.inflight
        pending = inflight.waiter(inflight.flags.index(1)) if inflight else None
        if pending is not None:  # (wait for one of them)
            await pending.wait()
        elif not any(prefetcher.running) and not prefetcher.queued:
            return
        else:
            # A batch whose samples are all delivered, its thread returning: its task ends
            # (and the queued samples are dealt) once the loop hears of that. (Blocked
            # tasks alone, with nothing in flight, let the refill test close its gate
            # before those were dealt, 1 run in 5 of the suite beside stress-ng.)
            await trio.sleep(0.001)


async def run_epoch(core, ids, readers=3, jitter=8, seed=0, check=None, order_bytes=None,
                    deadline: float = EPOCH_DEADLINE_S, settle: bool = False):
    """Readers take the order's positions roughly in sequence (a shared queue, shuffled in
    small windows the way DataLoader workers interleave), read each whole, close it; the
    epoch fails (trio.TooSlowError) if it takes longer than `deadline` seconds (a hang is a
    failure, well within pytest's own limit). With settle, each read waits until the
    read-ahead has done all it would (settled): readers slower than the backend."""
    rng = random.Random(seed)
    queue = list(ids)
    for i in range(0, len(queue), jitter):
        part = queue[i:i + jitter]
        rng.shuffle(part)
        queue[i:i + jitter] = part
    got = []

    async def reader():
        while queue:
            sid = queue.pop(0)
            if settle:
                await settled(core)
            data = await read_whole(core, sid)
            got.append(sid)
            if check is not None:
                check(sid, data)
            await trio.sleep(0)

    with trio.fail_after(deadline):
        async with trio.open_nursery() as n:
            await n.start(core.run)
            core.set_order(0, order_bytes or orderfmt.encode(ids))
            async with trio.open_nursery() as readers_n:
                for _ in range(readers):
                    readers_n.start_soon(reader)
            n.cancel_scope.cancel()
    return got


def exact_within_budget(core, files):
    """A run_epoch check: every read has the source's bytes and the cache (with what it
    has reserved) stays within its budget."""
    paths = {i: os.fsdecode(core.index.file_path(i)) for i in range(core.index.n_files)}

    def check(sid, blob):
        assert blob == files[paths[sid]]
        assert core.cache.used + core.cache.reserved <= core.cache.budget
    return check


def _rank_reads(args):
    import xxhash
    from trainer import HintedSampler
    mnt, rels, rank = args
    paths = [os.path.join(mnt, r) for r in rels]
    sampler = HintedSampler(paths, num_replicas=2, rank=rank, seed=5, local_rank=0)
    sampler.set_epoch(1)
    got = []
    for i in sampler:
        with open(paths[i], "rb") as f:
            got.append((rels[i], xxhash.xxh3_64_intdigest(f.read())))
    return got, [rels[i] for i in sampler.indices(2)]  # (and this rank's next share)


def check_two_nodes(dst, rels, digests, tmp_path):
    """Two mounts of the packed set dst stand in for two training nodes, one process of a
    world of 2 on each: together they read every sample of rels (an even count) exactly
    once, with the bytes of `digests` (xxh3), each mount fetching only its own share."""
    from fusefs.client import mount_stats
    rels = sorted(rels)
    mnts = [str(tmp_path / f"node{k}") for k in range(2)]
    with running_mount(dst, mnts[0], "--cache-size", "200%"), \
            running_mount(dst, mnts[1], "--cache-size", "200%"):
        with ProcessPoolExecutor(2) as pool:
            results = list(pool.map(_rank_reads, [(mnts[r], rels, r) for r in range(2)]))
        shares = [share for share, _ in results]
        assert sorted(r for share in shares for r, _ in share) == rels  # all, exactly once
        assert all(h == digests[r] for share in shares for r, h in share)
        for mnt, (share, nxt) in zip(mnts, results):
            s = mount_stats(mnt)
            assert s["plans"]["0"]["length"] == len(share) == len(rels) // 2
            assert s["plans"]["0"]["next_length"] == len(nxt)
            # its own shares (this epoch's, and the next one's read ahead), nothing else
            mine = {r for r, _ in share} | set(nxt)
            assert len(share) <= s["backend_samples"] <= len(mine), s
            assert len(mine) < len(rels)


def tar_bytes(members, fmt=None) -> bytes:
    """A tar (bytes) of [(name, bytes)], PAX format unless fmt says otherwise."""
    import io
    import tarfile
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT if fmt is None else fmt) as t:
        for name, data in members:
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            t.addfile(ti, io.BytesIO(data))
    return buf.getvalue()
