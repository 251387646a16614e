"""Mount lifecycle: check the packed folder, mount, serve, unmount cleanly."""
from __future__ import annotations

import contextlib
import errno
import logging
import os
import pwd
import re
import select
import signal
import subprocess
import sys
import threading

import trio

from . import fastpath, pyfuse3
from .config import DEFAULTS, STOP_SIGNALS, FetchConfig, MountConfig, default_fast_threads
from .control import RENDER_EVERY
from .control_socket import ControlSocket
from .core import Core, Stats
from .dataplane import DataPlane
from .errors import UserError
from .fs import KernelCache, Operations
from .index import INDEX_NAME, Index, IndexFormatError
from .local import LocalTier, LocalTierError
from .memory import Governor, tune_malloc
from .misses import MissEngine
from .mounts import device_of, fusermount, why_fuse_refused
from .runtime import LOG_FILE_ENV, default_log_path, open_log, own_folder, runtime_path
from .store import NATIVE as store_native_built, ChunkStore, StoreError

log = logging.getLogger("fusefs")


class MountError(UserError):
    """The mount cannot start; the message names the file or the reason."""


# The index (and the chunks' headers, checked against it) is read once, at start, and nothing
# can be served without it: its read is retried
# at least this often (waits of 0.1 s doubling up to 2 s, about 25 s in all), whatever the
# per-sample `retries`. Seen on GlusterFS with error-gen failing half the brick reads: one
# index read in 20 failed 5 times in a row, and the longest run of failures was 10, in 800.
INDEX_RETRIES = 16


def open_dataset(dst: str, fetch: FetchConfig = DEFAULTS.fetch,
                 shown_gid: int | None = None) -> tuple[Index, ChunkStore]:
    """Load the index and check every chunk file, or an in-place set's every tar (with
    fetch's retries, at least INDEX_RETRIES), or raise naming what is wrong. An in-place
    set's members are shown no more open than their tars (shown_gid: the files' group,
    default this process's)."""
    retries = max(fetch.retries, INDEX_RETRIES)
    try:
        index = Index.load(os.path.join(dst, INDEX_NAME), retries=retries)
        store = ChunkStore(index.data_root(dst), index, willneed=fetch.willneed)
        store.check(retries=retries)
    except (IndexFormatError, StoreError) as e:
        raise MountError(str(e)) from None
    if index.in_place:
        index.narrow_modes(store.caps, os.getgid() if shown_gid is None else shown_gid)
    return index, store


# what -o may not turn on: a packed folder is data, whoever wrote it (a crafted index's modes
# are masked to permission bits too: index.py)
FORCED = {"suid": "nosuid", "dev": "nodev"}
# what -o may not set: the mount table shows the packed folder as the source and fuse.fusefs
# as the type, whatever the user says (the client finds mounts by that type: client.find_mount)
KEPT = ("fsname", "subtype")


def fuse_options(extra: list[str], source: str = "fusefs") -> set[str]:
    """The FUSE options: pyfuse3's defaults, read-only (`ro`: orders come over the control
    socket), nosuid and nodev whatever the user's say (a `suid` or `dev` among them is
    dropped, with a warning), the source (the packed folder: what findmnt and /proc/mounts
    show, as sshfs and s3fs show what they mount) with the type fuse.fusefs (a `fsname=` or
    `subtype=` of the user's is dropped, with a warning), and the user's."""
    opts = set(pyfuse3.default_options)
    escaped = source.replace("\\", "\\\\").replace(",", "\\,")
    opts.update({"ro", f"fsname={escaped}", "subtype=fusefs", *FORCED.values()})
    for item in extra:
        for o in filter(None, item.split(",")):
            if o in FORCED:
                log.warning("-o %s ignored: a fusefs mount is always %s", o, FORCED[o])
                continue
            if o.partition("=")[0] in KEPT:
                log.warning("-o %s ignored: the mount table shows a fusefs mount as its packed "
                            "folder, of type fuse.fusefs", o)
                continue
            opts.add(o)
    return opts


class MountInfo:
    """What is mounted where, for the statistics (the metrics' fusefs_mount_info)."""

    def __init__(self, mountpoint: str, source: str):
        self.info = {"mount": {"mountpoint": mountpoint, "source": source}}

    def counters(self) -> dict:
        return self.info


def serve(index: Index, store: ChunkStore, mnt: str, config: MountConfig = DEFAULTS, *,
          options: list[str] = (), nonempty: bool = False, source: str | None = None) -> None:
    """Mount the dataset at mnt and serve until unmounted or a stop signal (foreground);
    a dead mount left at mnt is cleared first. A mount point that holds files is refused
    unless nonempty. Call it before starting any thread: it blocks the stop signals for the
    daemon's every thread (Stops). Closes store when it returns. source: the folder the
    mount table shows (the packed folder DST, an in-place set's too; default: store's)."""
    tune_malloc()  # (first: a thread that allocated before it would get an arena of its own)
    stops = Stops()
    with contextlib.ExitStack() as stack:
        stack.callback(store.close)
        if clear_dead_mount(mnt):
            log.warning("%s was a dead mount (its daemon had died): cleared it", mnt)
        point = open_mount_point(mnt, nonempty)
        stack.callback(os.close, point)  # (after the unmount, which may name it)
        # root mounts on the very folder checked (the kernel resolves the descriptor's link);
        # a user's mount goes through fusermount3, which checks the folder itself
        target = f"/proc/self/fd/{point}" if os.geteuid() == 0 else mnt
        where = os.readlink(f"/proc/self/fd/{point}")  # (as the mount table will name it)
        local = None
        if config.local.dir is not None:
            try:
                local = LocalTier(config.local.dir, config.local.bytes, index)
            except LocalTierError as e:
                raise MountError(str(e)) from None
            stack.callback(local.close)
        sock_path = runtime_path(mnt, ".sock")
        own_folder(os.path.dirname(sock_path))
        fast = fastpath.FastPath() if config.fast_path.enabled else None
        # every part, each made once with what it needs: the data plane, then the core over it
        stats = Stats()
        plane = DataPlane.build(index, store, config, stats, local=local,
                                kernel=KernelCache() if config.kernel_cache else None,
                                hold=fast.hold if fast else None, table=fast,
                                idle=fast.idle if fast else None)
        engine = (MissEngine(index, store, config.fetch.per_node, config.fetch.willneed)
                  if MissEngine.wanted(config, store, local) else None)
        core = Core(index, store, config, local=local, plane=plane, stats=stats,
                    catch_up=fast.catch_up if fast else None, control_socket=sock_path, misses=engine)
        try:
            control = ControlSocket(sock_path, core.commit_order, core.may_control, core.order_limit,
                                    core.trusted, room=core.orders.room)
        except OSError as e:
            raise MountError(f"control socket {sock_path}: {e.strerror or e}") from None
        stack.callback(control.close)
        ops = Operations(core, catch_up=fast.catch_up if fast else None)
        core.count(ops)
        core.count(control)
        shown = os.path.abspath(source if source is not None else store.root)
        core.count(MountInfo(os.path.abspath(mnt), shown))
        loop = {}  # the event loop's token, for the metrics server's thread
        if config.metrics.port is not None:
            from .metrics import serve_http
            try:
                server = serve_http(lambda: trio.from_thread.run_sync(core.statistics, trio_token=loop["token"]),
                                    config.metrics.port, config.metrics.address, every=RENDER_EVERY)
            except OSError as e:
                raise MountError(f"metrics on {config.metrics.address}:{config.metrics.port}: {e}") from None
            stack.callback(server.server_close)
            stack.callback(server.shutdown)
            log.info("metrics at http://%s:%d/metrics", config.metrics.address, server.server_port)
        try:
            pyfuse3.init(ops, target, fuse_options(list(options), shown))
        except RuntimeError:  # (libfuse says why on stderr; this says what to do)
            raise MountError(f"FUSE refused to mount {mnt}: {why_fuse_refused(options)}") from None
        clean = []

        def unmount() -> None:
            pyfuse3.close(unmount=bool(clean))
            if not clean:  # an unexpected error: do not leave a dead mount behind
                fusermount(mnt, lazy=True)
            log.info("unmounted %s%s", mnt, f" ({stops.later} more stop signals meanwhile)"
                     if stops.later else "")
        stack.callback(unmount)
        _tell_ready()
        log.info("mounted %s at %s: %d samples, %d chunks on %d node(s)", shown, mnt,
                 index.n_files, len(index.chunks), len(index.nodes))
        threads = config.fast_path.threads or default_fast_threads()
        if fast is not None:
            _start_fast_path(core, fast, threads)
        log.info("opens: %s", f"answered in C (the fast path, {threads} thread{'s' * (threads > 1)})"
                 if fast else "answered by the daemon")
        if engine is not None:
            _start_miss_engine(core, engine)
            stack.callback(engine.close)  # (before the unmount: the misses queued go to the loop)
        # (fresh: what the mounted daemon holds before its first read; the budgets on top)
        governor = Governor(config.cache_bytes + core.orders.budget
                            + (engine.buffer_bytes if engine is not None else 0))
        core.count(governor)
        trio.run(_main, core, loop, fast, stops, control, governor, (ops.initialized, where))
        clean.append(True)


READAHEAD_KB = 1024  # the most one FUSE read request carries (256 pages)
BACKGROUND = 64  # read-ahead requests in flight to the daemon (a node's loader: 16-64 workers)


def widen_kernel_reads(point: str) -> None:
    """Let the kernel read the mount's files ahead by READAHEAD_KB KiB and keep BACKGROUND
    read-ahead requests in flight to the daemon, where it does less, so that a sample up to
    1 MiB is one read request even with many readers: at its defaults (128 KiB; 12 in
    flight, and past 9 it skips the rest of a read-ahead, which its reader then reads in
    requests of its own) a sample of 300 KB took three requests, and no read of it took it
    whole, so its miss went to the loop; 16 readers of 110 KB samples made 1.4-1.8 requests
    a sample. The mount's /sys/class/bdi/MAJOR:MINOR/read_ahead_kb and
    /sys/fs/fuse/connections/MINOR/{max_background,congestion_threshold} (the kernel's 3/4
    of it), which only root may raise: otherwise, or where sysfs is read-only, a log line
    says so and the mount serves as it would. point: where the mount is, as the mount table
    names it."""
    dev = device_of(point)
    if dev is None:
        log.info("the kernel's read-ahead of the mount's files stays as it is (the mount is not "
                 "in /proc/self/mountinfo)")
        return
    conn = f"/sys/fs/fuse/connections/{dev.split(':')[1]}"
    for path, value in ((f"/sys/class/bdi/{dev}/read_ahead_kb", READAHEAD_KB),
                        (f"{conn}/max_background", BACKGROUND),
                        (f"{conn}/congestion_threshold", BACKGROUND * 3 // 4)):
        try:
            if int(_read_setting(path) or b"0") < value:
                fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
                try:
                    os.write(fd, b"%d" % value)
                finally:
                    os.close(fd)
        except (OSError, ValueError) as e:
            log.info("%s stays as it is (%s): a sample over 128 KiB, or read by many readers at "
                     "once, may take several read requests", path, getattr(e, "strerror", None) or e)


def _read_setting(path: str) -> bytes:
    """A kernel setting's file read whole (sysfs, fusectl: they seek no other way)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        return os.read(fd, 64)
    finally:
        os.close(fd)


def open_mount_point(mnt: str, nonempty: bool = False) -> int:
    """A descriptor of the folder mnt names, to mount on (the mount is made on that very
    folder: a name resolved again could have been swapped for a link meanwhile). Its last
    component is opened without following a link; it must be a folder, empty unless
    nonempty, with nothing mounted on it, and where a user other than the mounting one (or
    root) may change the folder that holds it, it must be the mounting user's or root's:
    otherwise MountError says why."""
    path = os.path.abspath(mnt)
    parent, name = os.path.dirname(path), os.path.basename(path) or "."
    try:
        pfd = os.open(parent, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        raise MountError(f"{mnt}: its folder {parent}: {e.strerror}") from None
    try:
        try:
            fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=pfd)
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.ENOTDIR) and os.path.islink(path):
                raise MountError(f"{mnt}: the mount point is a symbolic link (to "
                                 f"{os.readlink(path)}); mount on the folder itself") from None
            if e.errno in (errno.ENOTDIR, errno.ENOENT):
                raise MountError(f"{mnt}: mount point is not a folder"
                                 f"{' (there is nothing there)' if e.errno == errno.ENOENT else ''}") from None
            raise MountError(f"{mnt}: {e.strerror}") from None
        try:
            st, pst = os.fstat(fd), os.fstat(pfd)
            me = os.geteuid()
            others_change_parent = pst.st_uid not in (0, me) or pst.st_mode & 0o022
            if others_change_parent and st.st_uid not in (0, me):
                raise MountError(
                    f"{mnt}: the mount point belongs to user {_user_name(st.st_uid)} and its folder "
                    f"{parent} may be changed by users other than {_user_name(me)}: mount on a "
                    "folder of your own, or one in a folder only you can change")
            if st.st_dev != pst.st_dev or st.st_ino == pst.st_ino:
                raise MountError(f"{mnt}: something is already mounted there")
            if not nonempty and os.listdir(fd):
                raise MountError(f"{mnt}: the mount point is not empty (its files would be hidden; "
                                 "-o nonempty mounts over them)")
        except BaseException:
            os.close(fd)
            raise
        return fd
    finally:
        os.close(pfd)


def _user_name(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name} ({uid})"
    except KeyError:
        return str(uid)


class Stops:
    """The stop signals (config.STOP_SIGNALS: SIGINT, SIGTERM, SIGHUP): blocked in every
    thread of the daemon from its start (`fusefs mount` blocks them before any thread is
    made, so every thread inherits the mask; Stops blocks them in the thread that makes it,
    for the threads made after) and taken by a thread of their own with sigwait, so no
    handler ever runs: a storm of them at any moment, in the unmount too, can neither kill
    the daemon nor re-enter Python. The first asks for the unmount (`arm`: on the event
    loop; one that came before the loop runs is acted on when it arms), the rest are
    counted (`later`)."""

    SIGNALS = STOP_SIGNALS

    def __init__(self):
        signal.pthread_sigmask(signal.SIG_BLOCK, self.SIGNALS)
        self.first: int | None = None
        self.later = 0
        self._lock = threading.Lock()
        self._target = None  # (trio token, what stops the mount) once the loop runs
        threading.Thread(target=self._take, name="fusefs-signals", daemon=True).start()

    def _take(self) -> None:
        while True:
            sig = signal.sigwait(self.SIGNALS)
            with self._lock:
                if self.first is not None:
                    self.later += 1
                    continue
                self.first, target = sig, self._target
            log.info("%s: unmounting", signal.Signals(sig).name)
            if target is not None:
                token, stop = target
                try:
                    token.run_sync_soon(stop)
                except trio.RunFinishedError:
                    pass

    def arm(self, stop) -> None:
        """From the event loop: stop() once a stop signal comes (at once, if one came)."""
        with self._lock:
            self._target = (trio.lowlevel.current_trio_token(), stop)
            came = self.first is not None
        if came:
            stop()


def missing_native() -> list[str]:
    """What of fusefs's native parts this install lacks, a line each (`fusefs mount` logs
    them before anything else). The binding and its fast path are always built; the
    checksummed reader (_fetchio) may be left out with FUSEFS_NO_NATIVE=1."""
    if store_native_built:
        return []
    return ["fusefs._fetchio is not built (installed with FUSEFS_NO_NATIVE=1?): fetches "
            "are read and checked in Python, slower"]


def _start_fast_path(core: Core, fast: fastpath.FastPath, threads: int) -> None:
    """The fast path started (fastpath.py), on `threads` threads, its events to the core."""
    try:
        fast.start(core.answered, **core.fast_path_args(), threads=threads)
    except OSError as e:
        raise MountError(f"the fast path did not start ({e}); --no-fast-path mounts without it") from None
    core.count(fast)


def _start_miss_engine(core: Core, engine: MissEngine) -> None:
    """The miss engine started (misses.py), its counters in the statistics; where it cannot
    start, the loop takes every miss (one line says why)."""
    try:
        engine.start()
    except (OSError, RuntimeError, ValueError) as e:
        log.warning("misses: read by the daemon's loop (the miss engine did not start: %s)", e)
        return
    core.count(engine)
    log.info("misses: read in C once the cache is full, while no order has positions left (the miss engine, "
             "%d lane%s, %d reader%s each)",
             engine.lanes, "s" * (engine.lanes > 1), engine.per_lane, "s" * (engine.per_lane > 1))


async def _widen_kernel_reads(initialized: trio.Event, point: str) -> None:
    """widen_kernel_reads once the kernel has the answer to its INIT (which sets the mount's
    read-ahead to at most what the INIT offered, the kernel's default, and its limits), on
    the loop: a few reads and writes of kernel settings (procfs, sysfs, fusectl), which
    never wait for storage, done before the requests after the INIT are answered."""
    await initialized.wait()
    widen_kernel_reads(point)


async def _main(core: Core, loop: dict, fast: fastpath.FastPath | None, stops: Stops,
                control: ControlSocket, governor: Governor, init: tuple[trio.Event, str]):
    loop["token"] = trio.lowlevel.current_trio_token()
    async with trio.open_nursery() as nursery:
        await nursery.start(core.run)
        await nursery.start(control.serve)
        await nursery.start(governor.run)
        if fast is not None:
            nursery.start_soon(fast.run)
        nursery.start_soon(_widen_kernel_reads, *init)

        def stop() -> None:  # (the unmount: no new requests, and what waits ends: fetches)
            pyfuse3.terminate()
            core.stop()
        stops.arm(stop)
        await pyfuse3.main()
        nursery.cancel_scope.cancel()


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


LOG_TAIL = 16000  # bytes of a failed background mount's log read back for its lines
_LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\d [\d:,]+ \[(\d+)\] ")


def own_lines(text: str, pid: int) -> str:
    """The lines of a log that the process pid wrote (cli.LOG_FORMAT carries the pid; a
    line without it, a traceback's, goes with the line before it, and the command's own
    error line, `fusefs mount: ...`, is kept): another daemon may log into the same file
    meanwhile."""
    out, mine = [], True
    for line in text.splitlines(keepends=True):
        m = _LOG_LINE.match(line)
        if m is not None:
            mine = int(m.group(1)) == pid
        if mine or line.startswith("fusefs "):
            out.append(line)
    return "".join(out)


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
                                env=dict(os.environ, **{READY_FD: str(ready_w), LOG_FILE_ENV: log_path}))
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
        tail = os.pread(rfd, min(LOG_TAIL, max(0, size - start)), max(start, size - LOG_TAIL))
    finally:
        os.close(rfd)
    print(own_lines(tail.decode(errors="replace"), proc.pid), end="", file=sys.stderr)
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
        r = subprocess.run(["umount", "-l", mnt], capture_output=True, text=True, timeout=60)
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


