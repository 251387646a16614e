"""Shared fixtures: small source trees, packed datasets and real FUSE mounts.

Every mount is started as a subprocess (`python -m fusefs mount`, foreground) and torn
down in `finally`: `fusermount3 -u -z` if it is still in /proc/mounts (dead mounts too),
then terminate, then kill. No test leaves a mount or a daemon behind.
"""
from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import sys

import pytest
import trio

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "scripts"))  # testkit: the harness the tests share

from testkit.mounts import resolve, running_mount  # noqa: E402
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
    """A filesystem core (no mount) over the packed folder dst."""
    from fusefs.config import MountConfig
    from fusefs.core import Core
    from fusefs.index import INDEX_NAME, Index
    from fusefs.store import ChunkStore
    ix = Index.load(os.path.join(dst, INDEX_NAME))
    return Core(ix, ChunkStore(dst, ix), MountConfig(**config), local=local, kernel=kernel)


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
                "test_pyfuse3_patched", "test_swap"}


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
