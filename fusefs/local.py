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
when it carries them, else how soon the order needs the sample (see Core._tier_priorities).

Reads (`read_many`) run in the fetch worker threads, never on the event loop.
"""
from __future__ import annotations

import fcntl
import logging
import os
import queue
import threading
import time

import numpy as np

from . import chunk as chunkfmt
from .errors import UserError

log = logging.getLogger("fusefs.local")

NEVER = -np.inf  # the priority of a sample nothing needs


class LocalTierError(UserError):
    """DIR cannot be used (in use by another mount, not writable)."""


class LocalTier:
    def __init__(self, root: str, budget: int, index, *, queue_bytes: int = 64 << 20):
        self.root = os.path.abspath(root)
        self.budget = int(budget)
        self.index = index
        n = index.n_files
        try:
            os.makedirs(os.path.join(self.root, "samples"), exist_ok=True)
            os.makedirs(os.path.join(self.root, "tmp"), exist_ok=True)
            self._lock = open(os.path.join(self.root, "lock"), "a+")
        except OSError as e:
            raise LocalTierError(f"local cache {self.root}: {e.strerror}") from None
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock.seek(0)
            holder = self._lock.read().strip() or "unknown"
            self._lock.close()
            raise LocalTierError(f"local cache {self.root} is in use by another fusefs mount "
                                 f"(pid {holder}); give each mount its own --local-cache "
                                 "folder") from None
        self._lock.seek(0)
        self._lock.truncate()
        self._lock.write(f"{os.getpid()}\n")
        self._lock.flush()
        self.held = np.zeros(n, dtype=np.int64)  # bytes of each sample held in DIR (0: none)
        self.priority = np.full(n, NEVER)
        self.used = 0
        self.hits = self.hit_bytes = self.writes = self.write_bytes = 0
        self.dropped = self.rejected = self.evicted = self.corrupt = self.write_errors = 0
        self._mutex = threading.Lock()
        self._writing: set[int] = set()
        self._queue: queue.Queue = queue.Queue()
        self._qlock = threading.Lock()
        self._queued_bytes, self._queue_bytes = 0, queue_bytes
        self.warm_samples = self._scan()
        self._thread = threading.Thread(target=self._writer, name="fusefs-local", daemon=True)
        self._thread.start()

    # ---- files -------------------------------------------------------------------------
    def path(self, sid: int) -> str:
        return os.path.join(self.root, "samples", f"{sid % 256:02x}", str(sid))

    def _scan(self) -> int:
        """Take stock of what an earlier mount left: files of the right size count as held
        (their bytes are checked when read); leftovers of interrupted writes go."""
        for name in os.listdir(os.path.join(self.root, "tmp")):
            _unlink(os.path.join(self.root, "tmp", name))
        sizes = self.index.size
        found = 0
        samples = os.path.join(self.root, "samples")
        for sub in os.scandir(samples):
            if not sub.is_dir(follow_symlinks=False):
                continue
            for e in os.scandir(sub.path):
                if not e.name.isdigit() or not e.is_file(follow_symlinks=False):
                    continue  # not ours: left alone, not counted
                sid = int(e.name)
                size = e.stat(follow_symlinks=False).st_size
                if sid >= len(sizes) or size != int(sizes[sid]) or e.path != self.path(sid):
                    _unlink(e.path)  # torn, partial, or of another dataset
                    self.corrupt += 1
                    continue
                self.held[sid] = size
                self.used += size
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
                with open(path, "rb") as f:
                    data = f.read(int(sizes[sid]) + 1)
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
        self.priority = np.asarray(priority, dtype=np.float64)

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
        tmp = os.path.join(self.root, "tmp", f"{sid}.{threading.get_ident()}")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            os.replace(tmp, path)  # atomic: a reader sees no file or the whole file
        except OSError as e:
            _unlink(tmp)
            with self._mutex:
                self._writing.discard(sid)
                self.used -= size
            self.write_errors += 1
            log.warning("local cache: cannot write %s: %s", path, e.strerror)
            return
        with self._mutex:
            self._writing.discard(sid)
            self.held[sid] = size
        self.writes += 1
        self.write_bytes += size

    def _make_room(self, need: int, priority: float) -> bool:
        """Remove held samples of priority strictly below `priority`, lowest first, until
        `need` bytes are free; remove nothing if that cannot free enough. Under _mutex."""
        if priority == NEVER:
            return False
        held = np.flatnonzero(self.held)
        prio = self.priority[held]
        lower = held[prio < priority]
        if self.held[lower].sum() < need:
            return False
        lower = lower[np.argsort(self.priority[lower], kind="stable")]
        freed = np.cumsum(self.held[lower])
        for sid in lower[:int(np.searchsorted(freed, need)) + 1].tolist():
            self._drop(sid)
            self.evicted += 1
        return True

    def _drop(self, sid: int) -> None:
        if self.held[sid]:
            self.used -= int(self.held[sid])
            self.held[sid] = 0
            _unlink(self.path(sid))

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

    def counters(self) -> dict:
        return {"local_hits": self.hits, "local": self.statistics()}

    def statistics(self) -> dict:
        return {"dir": self.root, "budget": self.budget, "used": self.used,
                "samples": int(np.count_nonzero(self.held)), "hits": self.hits,
                "hit_bytes": self.hit_bytes, "writes": self.writes,
                "write_bytes": self.write_bytes, "dropped": self.dropped,
                "rejected": self.rejected, "evicted": self.evicted, "corrupt": self.corrupt,
                "write_errors": self.write_errors, "warm_samples": self.warm_samples}


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
