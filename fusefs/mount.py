"""Mount lifecycle: check the packed folder, mount, serve, unmount cleanly."""
from __future__ import annotations

import ctypes
import errno
import hashlib
import logging
import os
import select
import signal
import stat
import subprocess
import sys

import trio

from . import fastpath, pyfuse3
from .config import DEFAULTS, MountConfig
from .control import RENDER_EVERY
from .control_socket import ControlSocket
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


def fuse_options(extra: list[str], source: str = "fusefs") -> set[str]:
    """The FUSE options: pyfuse3's defaults, read-only (`ro`: orders come over the control
    socket), the source (the packed folder: what findmnt and /proc/mounts show, as sshfs and
    s3fs show what they mount) with the type fuse.fusefs, and the user's."""
    opts = set(pyfuse3.default_options)
    escaped = source.replace("\\", "\\\\").replace(",", "\\,")
    opts.update({"ro", f"fsname={escaped}", "subtype=fusefs"})
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


class MountInfo:
    """What is mounted where, for the statistics (the metrics' fusefs_mount_info)."""

    def __init__(self, mountpoint: str, source: str):
        self.info = {"mount": {"mountpoint": mountpoint, "source": source}}

    def counters(self) -> dict:
        return self.info


def serve(index: Index, store: ChunkStore, mnt: str, config: MountConfig = DEFAULTS, *,
          options: list[str] = (), nonempty: bool = False) -> None:
    """Mount the dataset at mnt and serve until unmounted or SIGINT/SIGTERM (foreground);
    a dead mount left at mnt is cleared first. A mount point that holds files is refused
    unless nonempty."""
    if clear_dead_mount(mnt):
        log.warning("%s was a dead mount (its daemon had died): cleared it", mnt)
    if not os.path.isdir(mnt):
        raise MountError(f"{mnt}: mount point is not a folder")
    if os.path.ismount(mnt):
        raise MountError(f"{mnt}: something is already mounted there")
    if not nonempty and os.listdir(mnt):
        raise MountError(f"{mnt}: the mount point is not empty (its files would be hidden; "
                         "-o nonempty mounts over them)")
    tune_malloc()
    local = None
    if config.local_dir is not None:
        try:
            local = LocalTier(config.local_dir, config.local_bytes, index)
        except LocalTierError as e:
            raise MountError(str(e)) from None
    sock_path = runtime_path(mnt, ".sock")
    try:
        own_folder(os.path.dirname(sock_path))
    except MountError:
        if local is not None:
            local.close()
        raise
    core = Core(index, store, config, local=local, kernel=KernelCache() if config.kernel_cache else None,
                control_socket=sock_path)
    try:
        control = ControlSocket(sock_path, core.control.set_order, core.may_control, core.order_limit)
    except OSError as e:
        if local is not None:
            local.close()
        raise MountError(f"control socket {sock_path}: {e.strerror or e}") from None
    ops = Operations(core)
    core.count(ops)
    core.count(control)
    core.count(MountInfo(os.path.abspath(mnt), os.path.abspath(store.root)))
    loop = {}  # the event loop's token, for the metrics server's thread
    server = None
    if config.metrics_port is not None:
        from .metrics import serve_http
        try:
            server = serve_http(lambda: trio.from_thread.run_sync(core.statistics, trio_token=loop["token"]),
                                config.metrics_port, config.metrics_address, every=RENDER_EVERY)
        except OSError as e:
            raise MountError(f"metrics on {config.metrics_address}:{config.metrics_port}: {e}") from None
        log.info("metrics at http://%s:%d/metrics", config.metrics_address, server.server_port)
    # From the mount on SIGINT and SIGTERM ask for the unmount and never end the process
    # half way: this handler notes them from before the mount appears (a signal sent as
    # soon as it shows in the mount table) until the loop runs, trio's receiver answers
    # them while it runs, and this handler notes them again during the unmount (a second
    # SIGTERM, e.g. a process group's and then the parent-death signal, killed a daemon in
    # its unmount: a dead mount)
    stops: list[int] = []
    for s in STOP_SIGNALS:
        signal.signal(s, lambda sig, _: stops.append(sig))
    try:
        pyfuse3.init(ops, mnt, fuse_options(list(options), os.path.abspath(store.root)))
    except BaseException as e:
        control.close()
        if local is not None:
            local.close()
        if server is not None:
            server.shutdown()
        if isinstance(e, RuntimeError):  # (libfuse refused an option: it names it on stderr)
            raise MountError(f"FUSE refused to mount {mnt} with -o {','.join(options) or '(none)'}: "
                             "an option unknown to fusefs and to FUSE? (fusefs mount --help lists "
                             "fusefs's own)") from None
        raise
    _tell_ready()
    log.info("mounted %s at %s: %d samples, %d chunks on %d node(s)", store.root, mnt, index.n_files,
             len(index.chunks), len(index.nodes))
    clean = False
    try:
        fast = _start_fast_path(core, ops) if config.fast_path else None
        log.info("opens: %s", "answered in C (the fast path)" if fast else "answered by the daemon")
        trio.run(_main, core, loop, fast, stops, control)
        clean = True
    finally:
        control.close()
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


async def _main(core: Core, loop: dict, fast: fastpath.FastPath | None, stops: list[int],
                control: ControlSocket):
    loop["token"] = trio.lowlevel.current_trio_token()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_watch_signals, stops)
        await nursery.start(core.run)
        await nursery.start(control.serve)
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


def runtime_path(mnt: str, suffix: str) -> str:
    """A file of the mount at mnt in the user's runtime folder: /run/fusefs for root, else
    $XDG_RUNTIME_DIR/fusefs or ~/.cache/fusefs; named by the mount point's base name and a
    hash of its whole path, then suffix: `.log` (a background mount's log unless --log
    says), `.sock` (the control socket)."""
    mnt = os.path.abspath(mnt)
    if os.geteuid() == 0:
        folder = "/run/fusefs"
    elif os.environ.get("XDG_RUNTIME_DIR", "").startswith("/"):
        folder = os.path.join(os.environ["XDG_RUNTIME_DIR"], "fusefs")
    else:
        folder = os.path.join(os.path.expanduser("~"), ".cache", "fusefs")
    tag = hashlib.sha256(os.fsencode(mnt)).hexdigest()[:10]
    name = os.path.basename(mnt)[:40] or "root"  # (a socket's path has at most 107 bytes)
    return os.path.join(folder, f"{name}-{tag}{suffix}")


def default_log_path(mnt: str) -> str:
    return runtime_path(mnt, ".log")


def own_folder(folder: str) -> None:
    """Make folder if missing (0755: others reach the control sockets in it, each file is
    protected by its own mode) and check that it is this user's, writable by no one else
    and not a link; MountError if not."""
    os.makedirs(folder, mode=0o755, exist_ok=True)
    st = os.lstat(folder)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise MountError(f"{folder}: the runtime folder must be your own, writable by no one else")
    if st.st_mode & 0o055 != 0o055:  # (made 0700 by an older fusefs: others must reach the sockets)
        os.chmod(folder, stat.S_IMODE(st.st_mode) | 0o055)


def open_log(path: str, own: bool = False) -> int:
    """A descriptor of the log file at path, opened for appending without following a
    symbolic link, made 0600; only a regular file is taken. own: the folder is the user's
    runtime folder (own_folder)."""
    folder = os.path.dirname(os.path.abspath(path))
    if own:
        own_folder(folder)
    try:  # (non-blocking: a FIFO without a reader fails at once instead of waiting)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC
                     | os.O_NONBLOCK, 0o600)
    except OSError as e:
        why = {errno.ELOOP: "a symbolic link", errno.ENXIO: "not a regular file"}.get(e.errno, e.strerror)
        raise MountError(f"log file {path}: {why}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise MountError(f"log file {path}: not a regular file")
    os.set_blocking(fd, True)
    return fd


READY_FD = "FUSEFS_READY_FD"  # the pipe a background mount's daemon says "ready" on


def _tell_ready() -> None:
    """Tell the `fusefs mount --background` that started this daemon that it is mounted."""
    fd = os.environ.pop(READY_FD, None)
    if fd is not None:
        try:
            os.write(int(fd), b"ready\n")
            os.close(int(fd))
        except (OSError, ValueError):
            pass


def start_background(argv: list[str], mnt: str, log_path: str | None, timeout: float = 60.0) -> int:
    """Run `fusefs mount` (foreground) detached, logging to log_path (None: its default);
    return 0 once its daemon says it is mounted, or its exit status once it failed (after
    printing what this run logged, and nothing older); the child is always reaped or left
    running, never defunct."""
    if os.path.ismount(mnt):
        raise MountError(f"{mnt}: something is already mounted there")
    own = log_path is None
    log_path = log_path or default_log_path(mnt)
    fd = open_log(log_path, own=own)
    start = os.lseek(fd, 0, os.SEEK_END)  # (what this run logs lies past here)
    ready_r, ready_w = os.pipe()
    try:
        proc = subprocess.Popen([sys.executable, "-m", "fusefs", *argv], stdin=subprocess.DEVNULL,
                                stdout=fd, stderr=fd, start_new_session=True, pass_fds=(ready_w,),
                                env=dict(os.environ, **{READY_FD: str(ready_w)}))
    finally:
        os.close(fd)
        os.close(ready_w)
    try:
        ready, _, _ = select.select([ready_r], [], [], timeout)
        said = os.read(ready_r, 16) if ready else b""
    finally:
        os.close(ready_r)
    if said.startswith(b"ready"):
        print(f"fusefs: mounted at {mnt} (pid {proc.pid}, log {log_path})")
        return 0
    if not ready:  # (still starting after the timeout: stop it)
        proc.terminate()
    try:
        rc = proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        rc = proc.wait()
    rfd = os.open(log_path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        size = os.fstat(rfd).st_size
        tail = os.pread(rfd, min(4000, max(0, size - start)), max(start, size - 4000))
    finally:
        os.close(rfd)
    print(tail.decode(errors="replace"), end="", file=sys.stderr)
    if not ready:
        print(f"fusefs: {mnt} was not mounted within {timeout:.0f} s; see {log_path}", file=sys.stderr)
    return rc or 1


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


