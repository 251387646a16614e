"""Mount lifecycle: check the packed folder, mount, serve, unmount cleanly."""
from __future__ import annotations

import ctypes
import errno
import logging
import os
import signal
import subprocess
import sys
import time

import trio

from . import fastpath, pyfuse3
from .config import DEFAULTS, MountConfig
from .core import Core
from .errors import UserError
from .fs import KernelCache, Operations
from .index import INDEX_NAME, Index, IndexFormatError
from .local import LocalTier, LocalTierError
from .mounts import fusermount
from .store import NATIVE as store_native_built, ChunkStore, StoreError

log = logging.getLogger("fusefs")
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)  # each asks for the unmount


class MountError(UserError):
    """The mount cannot start; the message names the file or the reason."""


# The index is read once, at start, and nothing can be served without it: its read is retried
# at least this often (waits of 0.1 s doubling up to 2 s, about 25 s in all), whatever the
# per-sample `retries`. Seen on GlusterFS with error-gen failing half the brick reads: one
# index read in 20 failed 5 times in a row, and the longest run of failures was 10, in 800.
INDEX_RETRIES = 16


def open_dataset(dst: str, retries: int = DEFAULTS.retries,
                 willneed: bool = DEFAULTS.willneed) -> tuple[Index, ChunkStore]:
    """Load the index and check every chunk file, or raise naming what is wrong."""
    try:
        index = Index.load(os.path.join(dst, INDEX_NAME), retries=max(retries, INDEX_RETRIES))
        store = ChunkStore(dst, index, willneed=willneed)
        store.check()
    except (IndexFormatError, StoreError) as e:
        raise MountError(str(e)) from None
    return index, store


def fuse_options(extra: list[str]) -> set[str]:
    opts = set(pyfuse3.default_options)
    opts.update({"fsname=fusefs", "subtype=fusefs"})
    for item in extra:
        opts.update(o for o in item.split(",") if o)
    return opts


def tune_malloc() -> None:
    """Samples are ~100 KB objects allocated in worker threads and freed on the event loop:
    with glibc's defaults they land in per-thread heap arenas whose holes keep RSS far above
    what is live, so one arena is used (two kept about 100 MB more in the soak); samples
    come from the heap, not each from a mapping of its own (page faults and unmaps per
    sample), and the heap keeps its freed pages (the trade-offs, as measured:
    docs/HOTPATH.md, "Allocation"). While the cache grows, the heap grows 64 MiB per brk
    (untouched pages cost no memory): with glibc's 128 KiB, a brk every 5-6 samples, under
    the GIL. A no-op where glibc is not the allocator."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-8, 1)          # M_ARENA_MAX
        libc.mallopt(-3, 4 << 20)    # M_MMAP_THRESHOLD: samples come from the heap ...
        libc.mallopt(-1, 256 << 20)  # M_TRIM_THRESHOLD: ... which keeps its freed pages
        libc.mallopt(-2, 64 << 20)   # M_TOP_PAD: ... and grows 64 MiB a brk, not 128 KiB
    except (OSError, AttributeError):
        pass


def serve(index: Index, store: ChunkStore, mnt: str, config: MountConfig = DEFAULTS, *,
          options: list[str] = ()) -> None:
    """Mount the dataset at mnt and serve until unmounted or SIGINT/SIGTERM (foreground);
    a dead mount left at mnt is cleared first."""
    if clear_dead_mount(mnt):
        log.warning("%s was a dead mount (its daemon had died): cleared it", mnt)
    if not os.path.isdir(mnt):
        raise MountError(f"{mnt}: mount point is not a folder")
    if os.path.ismount(mnt):
        raise MountError(f"{mnt}: something is already mounted there")
    tune_malloc()
    local = None
    if config.local_dir is not None:
        try:
            local = LocalTier(config.local_dir, config.local_bytes, index)
        except LocalTierError as e:
            raise MountError(str(e)) from None
    core = Core(index, store, config, local=local, kernel=KernelCache() if config.kernel_cache else None)
    ops = Operations(core)
    core.count(ops)
    loop = {}  # the event loop's token, for the metrics server's thread
    server = None
    if config.metrics_port is not None:
        from .metrics import serve_http
        try:
            server = serve_http(lambda: trio.from_thread.run_sync(core.statistics, trio_token=loop["token"]),
                                config.metrics_port, config.metrics_address)
        except OSError as e:
            raise MountError(f"metrics on {config.metrics_address}:{config.metrics_port}: {e}") from None
        log.info("metrics at http://%s:%d/metrics", config.metrics_address, server.server_port)
    try:
        pyfuse3.init(ops, mnt, fuse_options(list(options)))
    except BaseException:
        if local is not None:
            local.close()
        if server is not None:
            server.shutdown()
        raise
    log.info("mounted %s at %s: %d samples, %d chunks on %d node(s)", store.root, mnt, index.n_files,
             len(index.chunks), len(index.nodes))
    # From here on SIGINT and SIGTERM ask for the unmount and never end the process half
    # way: trio's receiver answers them while the loop runs, this handler notes them before
    # it starts and during the unmount after it (a second SIGTERM, e.g. a process group's
    # and then the parent-death signal, killed a daemon in its unmount: a dead mount)
    stops: list[int] = []
    for s in STOP_SIGNALS:
        signal.signal(s, lambda sig, _: stops.append(sig))
    clean = False
    try:
        fast = _start_fast_path(core, ops) if config.fast_path else None
        log.info("opens: %s", "answered in C (the fast path)" if fast else "answered by the daemon")
        trio.run(_main, core, loop, fast, stops)
        clean = True
    finally:
        if server is not None:
            server.shutdown()
            server.server_close()
        pyfuse3.close(unmount=clean)
        store.close()
        if local is not None:
            local.close()
        if not clean:  # an unexpected error: do not leave a dead mount behind
            fusermount(mnt, lazy=True)
        log.info("unmounted %s", mnt)
        for s in STOP_SIGNALS:  # (the mount is gone: while the process ends, a stop changes nothing;
            signal.signal(s, signal.SIG_IGN)  # Python's own handlers would go back to SIG_DFL at exit)


def missing_native() -> list[str]:
    """What of fusefs's native parts this install lacks, a line each (`fusefs mount` logs
    them before anything else). The binding and its fast path are always built; the
    checksummed reader (_fetchio) may be left out with FUSEFS_NO_NATIVE=1."""
    if store_native_built:
        return []
    return ["fusefs._fetchio is not built (installed with FUSEFS_NO_NATIVE=1?): fetches "
            "are read and checked in Python, slower"]


def _start_fast_path(core: Core, ops: Operations) -> fastpath.FastPath:
    """The fast path started (fastpath.py)."""
    fast = fastpath.FastPath(core.answered)
    try:
        fast.start(**core.fast_path_args())
    except OSError as e:
        raise MountError(f"the fast path did not start ({e}); --no-fast-path mounts without it") from None
    ops.catch_up = fast.catch_up
    core.count(fast)
    core.cache.mirror_to(fast.hold)  # (the thread answers reads of what the cache holds)
    return fast


async def _main(core: Core, loop: dict, fast: fastpath.FastPath | None, stops: list[int]):
    loop["token"] = trio.lowlevel.current_trio_token()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_watch_signals, stops)
        await nursery.start(core.run)
        if fast is not None:
            nursery.start_soon(fast.run)
        await pyfuse3.main()
        nursery.cancel_scope.cancel()


async def _watch_signals(stops: list[int]):
    """Unmount at the first SIGINT or SIGTERM (`stops`: those that came before the loop
    ran); later ones are noted, as the unmount is under way."""
    with trio.open_signal_receiver(*STOP_SIGNALS) as signals:
        if stops:
            log.info("%s: unmounting", signal.Signals(stops[0]).name)
            pyfuse3.terminate()
        async for sig in signals:
            log.info("%s: %s", signal.Signals(sig).name, "unmounting" if not stops else "unmounting already")
            if not stops:
                pyfuse3.terminate()
            stops.append(sig)


def start_background(argv: list[str], mnt: str, log_path: str, timeout: float = 60.0) -> int:
    """Run `fusefs mount` (foreground) detached; return once mnt is mounted (0) or it failed."""
    with open(log_path, "ab") as logf:
        proc = subprocess.Popen([sys.executable, "-m", "fusefs", *argv], stdin=subprocess.DEVNULL,
                                stdout=logf, stderr=logf, start_new_session=True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if os.path.ismount(mnt):
            print(f"fusefs: mounted at {mnt} (pid {proc.pid}, log {log_path})")
            return 0
        if proc.poll() is not None:
            with open(log_path, "rb") as f:
                tail = f.read()[-4000:].decode(errors="replace")
            print(tail, end="", file=sys.stderr)
            return proc.returncode or 1
        time.sleep(0.05)
    proc.terminate()
    print(f"fusefs: {mnt} did not appear within {timeout:.0f} s; see {log_path}", file=sys.stderr)
    return 1


def is_dead_mount(mnt: str) -> bool:
    """mnt is a FUSE mount whose daemon is gone ("Transport endpoint is not connected")."""
    try:
        os.statvfs(mnt)  # always asks the daemon (a stat may be answered from the kernel's cache)
    except OSError as e:
        return e.errno == errno.ENOTCONN
    return False


def clear_dead_mount(mnt: str) -> bool:
    """Detach a dead mount left at mnt (its daemon was killed); True if there was one."""
    if not is_dead_mount(mnt):
        return False
    r = fusermount(mnt, lazy=True)
    if is_dead_mount(mnt) and os.geteuid() == 0:
        r = subprocess.run(["umount", "-l", mnt], capture_output=True, text=True)
    if is_dead_mount(mnt):
        raise MountError(f"{mnt}: a dead mount (its daemon is gone) is left there and could not "
                         f"be cleared: {r.stderr.strip()}")
    return True


def unmount(mnt: str) -> None:
    """Unmount mnt (the daemon then exits by itself); a dead mount is cleared."""
    if clear_dead_mount(mnt):
        print(f"fusefs: {mnt} was a dead mount (its daemon had died): cleared it", file=sys.stderr)
        return
    if not os.path.ismount(mnt):
        raise MountError(f"{mnt} is not mounted")
    r = fusermount(mnt)
    if r.returncode != 0:
        raise MountError(f"fusermount3 -u {mnt}: {r.stderr.strip()}")


