"""The local cache tier: samples kept in a node-local folder (NVMe, NVRAM, /dev/shm) across
epochs and remounts, between the memory cache and the backend.

Layout of DIR:
    lock                  held (flock) by the one mount using DIR; holds its pid
    samples/XX/<id>       one file per sample: its raw bytes, nothing else (XX: id % 256)
    tmp/                  files being written; renamed into samples/ when complete

A file is trusted only when its size and xxh3-64 match the index, checked at every read:
a torn or partial file (a crash while writing or before the page cache reached the disk)
or a foreign one (another dataset's sample with the same id) fails the check, is removed,
counted in `corrupt`, and the sample comes from the backend and is written again. Because
the check is on the bytes, no per-dataset metadata is needed and a DIR can be reused.

Writes happen in one background thread fed by a bounded queue: `offer` never blocks (a full
queue drops the write, counted in `dropped`). Admission within the size budget: every
sample has a priority (`set_priorities`, higher stays). When DIR is full, a sample is
written only if residents of strictly lower priority can be removed to make room; ties keep
what is there (no churn). The core sets priorities from the order: its importance values
when it carries them, else how soon the order needs the sample (Policy.tier_priorities).

Reads (`read_many`) run in the fetch worker threads, never on the event loop.

Trust: the daemon often runs as root, and DIR may lie where other users create folders
(/dev/shm). DIR must be the daemon's user's own folder that no one else may write, and so
must every folder above it be (root's or the user's, or sticky like /tmp), none of them a
symbolic link: otherwise the mount is refused, naming the folder. DIR is opened once and
everything in it is reached from that descriptor (openat) without following symbolic
links; only regular files are read (a FIFO or device is never opened for reading in a
way that blocks), and what the tier makes is 0700 (folders) and 0600 (files): a cached
sample is readable by the daemon's user only, whatever the dataset file's mode.
"""
from __future__ import annotations

import errno
import fcntl
import heapq
import itertools
import logging
import os
import queue
import stat
import threading
import time

import numpy as np

from . import chunk as chunkfmt
from .errors import UserError

log = logging.getLogger("fusefs.local")

NEVER = -np.inf  # the priority of a sample nothing needs
WARN_EVERY = 60.0  # seconds between two log lines of failed writes


class LocalTierError(UserError):
    """DIR cannot be used (in use by another mount, not writable)."""


NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | NOFOLLOW


def _check_parents(path: str) -> None:
    """Refuse a path through a folder that someone other than root or this user may change
    (owned by another user, or writable by others without the sticky bit), or through a
    symbolic link."""
    me = os.geteuid()
    parts = path.split(os.sep)
    for k in range(2, len(parts)):
        parent = os.sep.join(parts[:k]) or os.sep
        try:
            st = os.lstat(parent)
        except FileNotFoundError:
            return  # (made below, by this user)
        if stat.S_ISLNK(st.st_mode):
            raise LocalTierError(f"local cache {path}: {parent} is a symbolic link; give the "
                                 "folder's real path")
        if st.st_uid not in (0, me):
            raise LocalTierError(f"local cache {path}: {parent}: owned by uid {st.st_uid}, who could "
                                 "swap what lies below it; use a folder of your own (mkdir -m 700)")
        if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            raise LocalTierError(f"local cache {path}: {parent} is writable by others; use a folder "
                                 "that only you can change")


def _own_folder(path: str, name: str, parent_fd: int | None = None, replace: bool = False) -> int:
    """An open descriptor of folder `name` (in parent_fd, or the absolute path), made 0700
    if missing; it must be a real folder of this user that others may not write (replace:
    anything else in its place is removed and the folder made; else refused)."""
    for attempt in (0, 1):
        try:
            fd = os.open(name, DIR_FLAGS, dir_fd=parent_fd)
        except FileNotFoundError:
            try:
                os.mkdir(name, 0o700, dir_fd=parent_fd)
            except FileExistsError:
                pass
            continue
        except OSError as e:
            if e.errno not in (errno.ELOOP, errno.ENOTDIR):
                raise
            if not replace or attempt:
                try:
                    link = stat.S_ISLNK(os.lstat(name, dir_fd=parent_fd).st_mode)
                except OSError:
                    link = False
                what = "a symbolic link" if link else "not a folder"
                raise LocalTierError(f"local cache {path}: {name} is {what}") from None
            os.unlink(name, dir_fd=parent_fd)  # (in the tier's own folder: made by this user)
            continue
        st = os.fstat(fd)
        if st.st_uid != os.geteuid() or st.st_mode & 0o022:
            os.close(fd)
            if st.st_uid != os.geteuid():
                raise LocalTierError(f"local cache {path}: owned by uid {st.st_uid}, not by this "
                                     f"daemon's user ({os.geteuid()}); use a folder of your own "
                                     "(mkdir -m 700)")
            raise LocalTierError(f"local cache {path}: writable by others (mode "
                                 f"{stat.S_IMODE(st.st_mode):o}); chmod 700 it")
        return fd
    raise LocalTierError(f"local cache {path}: {name} changes while it is opened")


class LocalTier:
    def __init__(self, root: str, budget: int, index, *, queue_bytes: int = 64 << 20):
        self.root = os.path.abspath(root)
        self.budget = int(budget)
        self.index = index
        n = index.n_files
        self._fds: dict[str, int] = {}  # open folders: the root, samples, tmp and samples/XX
        try:
            _check_parents(self.root)
            os.makedirs(os.path.dirname(self.root), mode=0o700, exist_ok=True)
            self._root_fd = _own_folder(self.root, self.root)
            self._samples_fd = _own_folder(self.root, "samples", self._root_fd, replace=True)
            self._tmp_fd = _own_folder(self.root, "tmp", self._root_fd, replace=True)
            try:
                fd = os.open("lock", os.O_RDWR | os.O_CREAT | NOFOLLOW | os.O_NONBLOCK, 0o600,
                             dir_fd=self._root_fd)
            except OSError as e:
                if e.errno in (errno.ELOOP, errno.ENXIO):
                    raise LocalTierError(f"local cache {self.root}: lock: not a regular file") from None
                raise
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                os.close(fd)
                raise LocalTierError(f"local cache {self.root}: lock: not a regular file")
            self._lock = os.fdopen(fd, "r+")
        except LocalTierError:
            self._close_fds()
            raise
        except OSError as e:
            self._close_fds()
            raise LocalTierError(f"local cache {self.root}: {e.strerror}") from None
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock.seek(0)
            holder = self._lock.read(32).strip() or "unknown"
            self._lock.close()
            self._close_fds()
            raise LocalTierError(f"local cache {self.root} is in use by another fusefs mount "
                                 f"(pid {holder}); give each mount its own --local-cache "
                                 "folder") from None
        self._lock.seek(0)
        self._lock.truncate()
        self._lock.write(f"{os.getpid()}\n")
        self._lock.flush()
        self.held = np.zeros(n, dtype=np.int64)  # bytes of each sample held in DIR (0: none)
        self.priority = np.full(n, NEVER)
        # the held samples by priority, lowest first, for eviction in O(log n): (priority
        # when pushed, seq, sid), stale items skipped (a sample gone, or its priority
        # changed: pushed again with it); rebuilt when the priorities are all set anew
        self._heap: list = []
        self._seq = itertools.count()
        self._reheap = True  # (the samples an earlier mount left: _scan)
        self._nheld = 0      # samples held (the heap is compacted past 4 times as many items)
        self.used = 0
        self.hits = self.hit_bytes = self.writes = self.write_bytes = 0
        self.dropped = self.rejected = self.evicted = self.corrupt = self.write_errors = 0
        self._logged_at, self._unlogged = -WARN_EVERY, 0  # (failed writes: _write_failed)
        self._mutex = threading.Lock()
        self._writing: set[int] = set()
        self._queue: queue.Queue = queue.Queue()
        self._qlock = threading.Lock()
        self._queued_bytes, self._queue_bytes = 0, queue_bytes
        self._sub_fds: dict[int, int] = {}  # samples/XX, by XX, opened when first needed
        self._sub_lock = threading.Lock()
        self.warm_samples = self._scan()
        self._thread = threading.Thread(target=self._writer, name="fusefs-local", daemon=True)
        self._thread.start()

    def _close_fds(self) -> None:
        for name in ("_root_fd", "_samples_fd", "_tmp_fd"):
            fd = self.__dict__.pop(name, None)
            if fd is not None:
                os.close(fd)
        for fd in getattr(self, "_sub_fds", {}).values():
            os.close(fd)
        self._sub_fds = {}

    # ---- files -------------------------------------------------------------------------
    def path(self, sid: int) -> str:
        """Where sample sid's file lies (for log lines and tests; the tier itself reaches it
        through its folders' descriptors)."""
        return os.path.join(self.root, "samples", f"{sid % 256:02x}", str(sid))

    def _sub(self, sid: int) -> int:
        """samples/XX of sample sid, opened (made 0700 if missing, a symbolic link or other
        non-folder in its place removed)."""
        k = sid % 256
        fd = self._sub_fds.get(k)
        if fd is None:
            with self._sub_lock:
                fd = self._sub_fds.get(k)
                if fd is None:
                    fd = self._sub_fds[k] = _own_folder(self.root, f"{k:02x}", self._samples_fd, replace=True)
        return fd

    def _read(self, sid: int, size: int) -> bytes:
        """The file's first size + 1 bytes; OSError if it is not a regular file (never blocks
        on a FIFO or a device: opened non-blocking, checked before it is read)."""
        fd = os.open(str(sid), os.O_RDONLY | NOFOLLOW | os.O_NONBLOCK, dir_fd=self._sub(sid))
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise OSError(errno.EINVAL, "not a regular file")
            with os.fdopen(fd, "rb", closefd=False) as f:
                return f.read(size + 1)
        finally:
            os.close(fd)

    def _unlink(self, sid: int) -> None:
        try:
            os.unlink(str(sid), dir_fd=self._sub(sid))
        except (FileNotFoundError, LocalTierError):
            pass

    def _scan(self) -> int:
        """Take stock of what an earlier mount left: regular files of the right size count as
        held (their bytes are checked when read); leftovers of interrupted writes go."""
        for name in os.listdir(self._tmp_fd):
            try:
                os.unlink(name, dir_fd=self._tmp_fd)
            except (FileNotFoundError, IsADirectoryError, PermissionError):
                pass
        sizes = self.index.size
        found = 0
        for sub in os.scandir(self._samples_fd):
            if not sub.is_dir(follow_symlinks=False) or len(sub.name) != 2:
                continue
            try:
                k = int(sub.name, 16)
                fd = self._sub(k)
            except (ValueError, LocalTierError):
                continue
            for e in os.scandir(fd):
                if not e.name.isdigit() or not e.is_file(follow_symlinks=False):
                    continue  # not ours: left alone, not counted
                sid = int(e.name)
                size = e.stat(follow_symlinks=False).st_size
                if sid >= len(sizes) or size != int(sizes[sid]) or sid % 256 != k or e.name != str(sid):
                    try:
                        os.unlink(e.name, dir_fd=fd)  # torn, partial, or of another dataset
                    except FileNotFoundError:
                        pass
                    self.corrupt += 1
                    continue
                self.held[sid] = size
                self.used += size
                self._nheld += 1
                found += 1
        if self.used > self.budget:  # a smaller budget than last time: trim
            with self._mutex:
                self._make_room(self.used - self.budget, np.inf)
        if found:
            log.info("local cache %s: %d samples (%d bytes) from an earlier mount", self.root,
                     found, self.used)
        return found

    def __contains__(self, sid: int) -> bool:
        return bool(self.held[sid])

    def read_many(self, sids) -> dict:
        """{sid: verified bytes} for the sids held in DIR (blocking: worker threads only).
        A file that fails its check is removed and left out (the backend serves it)."""
        out = {}
        sizes, sums = self.index.size, self.index.checksum
        for sid in sids:
            if not self.held[sid]:
                continue
            path = self.path(sid)
            try:
                data = self._read(sid, int(sizes[sid]))
            except LocalTierError as e:
                data, why = None, str(e)
            except OSError as e:
                data, why = None, e.strerror
            else:
                why = None
                if len(data) != int(sizes[sid]):
                    why = f"{len(data)} bytes, the index says {int(sizes[sid])}"
                elif chunkfmt.checksum(data) != int(sums[sid]):
                    why = "checksum mismatch"
            if why is None:
                out[sid] = data
                continue
            log.warning("local cache: %s: %s; ignored, the backend serves it", path, why)
            with self._mutex:
                self.corrupt += 1
                self._drop(sid)
        if out:  # (worker threads call this concurrently)
            with self._mutex:
                self.hits += len(out)
                self.hit_bytes += sum(len(d) for d in out.values())
        return out

    # ---- writing -----------------------------------------------------------------------
    def set_priorities(self, priority: np.ndarray) -> None:
        """Every sample's priority anew (a new order): the eviction heap is rebuilt at the
        next eviction, in the writer thread."""
        self.priority = np.asarray(priority, dtype=np.float64)
        self._reheap = True

    def lower(self, sid: int) -> None:
        """No order needs sample sid any more: it goes first when room is needed."""
        with self._mutex:
            self.priority[sid] = NEVER
            if self.held[sid]:
                heapq.heappush(self._heap, (NEVER, next(self._seq), sid))

    def offer(self, sid: int, data, priority: float) -> None:
        """Write sample sid in the background if it earns a place (never blocks)."""
        if self.held[sid] or len(data) > self.budget:
            return
        with self._qlock:
            if self._queued_bytes + len(data) > self._queue_bytes:
                self.dropped += 1
                return
            self._queued_bytes += len(data)
        self._queue.put((sid, data, priority))

    def _writer(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                self._queue.task_done()
                return
            sid, data, priority = item
            try:
                self._admit(sid, data, priority)
            except Exception:  # never let the writer die: the tier just stops growing
                log.exception("local cache: writing sample %d failed", sid)
                self.write_errors += 1
            finally:
                with self._qlock:
                    self._queued_bytes -= len(data)
                self._queue.task_done()

    def _admit(self, sid: int, data, priority: float) -> None:
        size = len(data)
        with self._mutex:
            if self.held[sid] or sid in self._writing:
                return
            over = self.used + size - self.budget
            if over > 0 and not self._make_room(over, priority):
                self.rejected += 1
                return
            self.used += size  # claimed before the write, released if it fails
            self._writing.add(sid)  # held (readable) only once the file is complete
        path = self.path(sid)
        tmp = f"{sid}.{threading.get_ident()}"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | NOFOLLOW, 0o600, dir_fd=self._tmp_fd)
            try:
                with os.fdopen(fd, "wb", closefd=False) as f:
                    f.write(data)
            finally:
                os.close(fd)
            # atomic: a reader sees no file or the whole file
            os.rename(tmp, str(sid), src_dir_fd=self._tmp_fd, dst_dir_fd=self._sub(sid))
        except (OSError, LocalTierError) as e:
            try:
                os.unlink(tmp, dir_fd=self._tmp_fd)
            except OSError:
                pass
            with self._mutex:
                self._writing.discard(sid)
                self.used -= size
            self.write_errors += 1
            self._write_failed(path, e)
            return
        with self._mutex:
            self._writing.discard(sid)
            self.held[sid] = size
            self._nheld += 1
            heapq.heappush(self._heap, (float(self.priority[sid]), next(self._seq), sid))
        self.writes += 1
        self.write_bytes += size

    def _write_failed(self, path: str, e: Exception) -> None:
        """Log a failed write, at most one line every WARN_EVERY seconds (a full disk fails
        every write): the lines in between are counted in the next one."""
        now = time.monotonic()
        self._unlogged += 1
        if now - self._logged_at < WARN_EVERY:
            return
        more = self._unlogged - 1
        log.warning("local cache: cannot write %s: %s%s", path, getattr(e, "strerror", None) or e,
                    f" ({more} more writes failed since the last such line)" if more else "")
        self._logged_at, self._unlogged = now, 0

    def _make_room(self, need: int, priority: float) -> bool:
        """Remove held samples of priority strictly below `priority`, lowest first, until
        `need` bytes are free; remove nothing if that cannot free enough. Under _mutex;
        O(log n) a sample looked at (the heap), whatever the dataset's size."""
        if priority == NEVER:
            return False
        if self._reheap or len(self._heap) > 4 * self._nheld + 1024:
            self._rebuild_heap()
        heap, held, prio = self._heap, self.held, self.priority
        taken, freed = [], 0
        while heap and freed < need:
            p, seq, sid = heap[0]
            if not held[sid] or p != prio[sid]:  # (stale: gone, or its priority changed)
                heapq.heappop(heap)
                if held[sid]:
                    heapq.heappush(heap, (float(prio[sid]), next(self._seq), sid))
                continue
            if not p < priority:
                break
            taken.append(heapq.heappop(heap))
            freed += int(held[sid])
        if freed < need:
            for item in taken:
                heapq.heappush(heap, item)
            return False
        for _, _, sid in taken:
            self._drop(sid)
            self.evicted += 1
        return True

    def _rebuild_heap(self) -> None:
        """The eviction heap from the held samples and their priorities now (O(n): once per
        order, in the writer thread). Under _mutex."""
        held = np.flatnonzero(self.held)
        self._heap = []  # the stale items go before the new ones are made
        self._heap = list(zip(self.priority[held].tolist(), range(len(held)), held.tolist()))
        heapq.heapify(self._heap)
        self._seq = itertools.count(len(held))
        self._reheap = False
        self._nheld = len(held)

    def _drop(self, sid: int) -> None:
        if self.held[sid]:
            self.used -= int(self.held[sid])
            self.held[sid] = 0
            self._nheld -= 1
            self._unlink(sid)

    def wait_written(self, timeout: float = 30.0) -> bool:
        """Wait until the queued writes are done (tests, benchmarks); False on timeout."""
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=30)
        self._lock.close()  # releases the flock
        self._close_fds()

    def counters(self) -> dict:
        return {"local_hits": self.hits, "local": self.statistics()}

    def statistics(self) -> dict:
        return {"dir": self.root, "budget": self.budget, "used": self.used,
                "samples": int(np.count_nonzero(self.held)), "hits": self.hits,
                "hit_bytes": self.hit_bytes, "writes": self.writes,
                "write_bytes": self.write_bytes, "dropped": self.dropped,
                "rejected": self.rejected, "evicted": self.evicted, "corrupt": self.corrupt,
                "write_errors": self.write_errors, "warm_samples": self.warm_samples}

