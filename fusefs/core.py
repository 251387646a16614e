"""What the packed dataset looks like as a filesystem, without any FUSE in it.

Inode numbers:
    1 .. n_dirs                      directories (1 is the root, directory 0 of the index)
    CTRL_DIR = n_dirs + 1            the hidden control folder `.fusefs`
    CTRL_DIR + 1 .. CTRL_DIR + 15    control files
    FILE_BASE + sid                  the files; sid is the sample id in the index

Lookups, attributes and listings come from the in-memory index (no backend I/O). Reads
fetch a whole sample once (batched with the samples the order needs next on the same
storage node), verify it and serve any offset and size from it. Closing a file is a use
of its sample; after its last use in the current order the sample leaves the cache.
Errors are FsError(errno); the FUSE adapter (fs.py) turns them into FUSEError.
"""
from __future__ import annotations

import collections
import errno
import logging
import os
import stat
import time

import trio

from . import order as orderfmt
from .cache import SampleCache
from .control import CONTROL_NAME, ControlNamespace
from .entries import Attr, FsError, OpenResult
from .index import Index
from .plan import Plan
from .prefetch import Fetcher, Prefetcher
from .store import ChunkStore, CorruptSample

log = logging.getLogger("fusefs")

ROOT = 1
CTRL_SLOTS = 128
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_TRUNC | os.O_APPEND | os.O_CREAT


class Stats:
    """Counters of the daemon; a snapshot goes to `.fusefs/stats`."""

    FIELDS = ("opens", "reads", "bytes_served", "hits", "misses", "read_waits", "eio",
              "evicted_after_use", "orders_accepted", "orders_refused")

    def __init__(self):
        for f in self.FIELDS:
            setattr(self, f, 0)
        self.wait_s = 0.0
        self.started = time.time()

    def snapshot(self) -> dict:
        out = {f: getattr(self, f) for f in self.FIELDS}
        out["read_wait_s"] = round(self.wait_s, 4)
        out["uptime_s"] = round(time.time() - self.started, 3)
        return out


class Core:
    def __init__(self, index: Index, store: ChunkStore, *, cache_bytes: int = 256 << 20,
                 per_node: int = 4, batch: int = 16, uid: int | None = None,
                 gid: int | None = None):
        self.index = index
        self.store = store
        self.cache = SampleCache(cache_bytes)
        self.stats = Stats()
        self.fetcher = Fetcher(store, per_node=per_node, batch=batch)
        self.prefetcher = Prefetcher(self)
        self.plans: dict[int, Plan] = {}
        self.uid = os.getuid() if uid is None else uid
        self.gid = os.getgid() if gid is None else gid
        self.ctrl_dir = index.n_dirs + 1
        self.file_base = self.ctrl_dir + CTRL_SLOTS
        self.control = ControlNamespace(self, self.ctrl_dir)
        self._handles: dict[int, int] = {}  # open file handle -> sample id
        self._next_fh = 1
        self._recent = collections.deque(maxlen=32)  # recently read samples (scan detection)
        self._ids_table: bytes | None = None
        self.mean_size = index.total_bytes / max(1, index.n_files)

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Background work (the read-ahead); start it in the mount's nursery."""
        await self.prefetcher.run(task_status=task_status)

    # ---- inodes ----------------------------------------------------------------------
    def sid_of(self, ino: int) -> int | None:
        sid = ino - self.file_base
        return sid if 0 <= sid < self.index.n_files else None

    def _dir_of(self, ino: int) -> int | None:
        return ino - 1 if 1 <= ino <= self.index.n_dirs else None

    def file_attr(self, sid: int) -> Attr:
        ix = self.index
        return Attr(self.file_base + sid, stat.S_IFREG | int(ix.mode[sid]), int(ix.size[sid]),
                    int(ix.mtime_ns[sid]))

    def dir_attr(self, d: int) -> Attr:
        ix = self.index
        return Attr(d + 1, stat.S_IFDIR | int(ix.dir_mode[d]), 0, int(ix.dir_mtime_ns[d]),
                    nlink=2 + int(ix.dir_nsubs[d]))

    # ---- metadata --------------------------------------------------------------------
    def lookup(self, parent: int, name: bytes) -> Attr:
        if parent == ROOT and name == CONTROL_NAME:
            return self.control.dir_attr()
        if parent == self.ctrl_dir:
            return self.control.lookup(name)
        d = self._dir_of(parent)
        if d is None:
            raise FsError(errno.ENOTDIR)
        sid = self.index.lookup_file(d, name)
        if sid is not None:
            return self.file_attr(sid)
        sub = self.index.lookup_dir(d, name)
        if sub is not None:
            return self.dir_attr(sub)
        raise FsError(errno.ENOENT)

    def getattr(self, ino: int) -> Attr:
        sid = self.sid_of(ino)
        if sid is not None:
            return self.file_attr(sid)
        d = self._dir_of(ino)
        if d is not None:
            return self.dir_attr(d)
        return self.control.getattr(ino)

    def readdir(self, ino: int, start: int):
        """Yield (name, Attr, next_offset) from position start; `.fusefs` is never listed."""
        if ino == self.ctrl_dir:
            yield from self.control.readdir(start)
            return
        d = self._dir_of(ino)
        if d is None:
            raise FsError(errno.ENOTDIR)
        ix = self.index
        first_sub, nsubs = int(ix.dir_first_sub[d]), int(ix.dir_nsubs[d])
        first_file, nfiles = int(ix.dir_first_file[d]), int(ix.dir_nfiles[d])
        for pos in range(start, nsubs + nfiles):
            if pos < nsubs:
                sub = first_sub + pos
                yield ix.dir_name(sub), self.dir_attr(sub), pos + 1
            else:
                sid = first_file + pos - nsubs
                yield ix.file_name(sid), self.file_attr(sid), pos + 1

    def opendir(self, ino: int) -> int:
        if self._dir_of(ino) is None and ino != self.ctrl_dir:
            raise FsError(errno.ENOTDIR)
        return ino

    def statfs(self) -> dict:
        ix = self.index
        return {"bsize": 131072, "blocks": (ix.total_bytes + 131071) // 131072,
                "files": ix.n_files + ix.n_dirs, "namemax": 255}

    # ---- data ------------------------------------------------------------------------
    def open(self, ino: int, flags: int) -> OpenResult:
        sid = self.sid_of(ino)
        if sid is None:
            if self._dir_of(ino) is not None:
                raise FsError(errno.EISDIR)
            return self.control.open(ino, flags)
        if flags & WRITE_FLAGS:
            raise FsError(errno.EROFS)
        self.stats.opens += 1
        fh = self._next_fh
        self._next_fh += 1
        self._handles[fh] = sid
        return OpenResult(fh=fh)

    async def read(self, fh: int, off: int, size: int) -> bytes:
        sid = self._handles.get(fh)
        if sid is None:
            return self.control.read(fh, off, size)
        self.stats.reads += 1
        if off >= int(self.index.size[sid]):
            return b""
        data = await self.fetch(sid)
        out = data[off:off + size]
        self.stats.bytes_served += len(out)
        return out

    def write(self, fh: int, off: int, data: bytes) -> int:
        if fh in self._handles:
            raise FsError(errno.EROFS)
        return self.control.write(fh, off, data)

    def flush(self, fh: int) -> None:
        if fh not in self._handles:
            self.control.flush(fh)

    def release(self, fh: int) -> None:
        sid = self._handles.pop(fh, None)
        if sid is None:
            self.control.release(fh)
        else:
            self.use(sid)

    def setattr(self, ino: int, size: int | None, other: bool = False) -> Attr:
        """Only truncating a writable control file (as `open(..., "w")` does) is allowed;
        `other` is a change of mode, owner or times."""
        if not other and size in (None, 0) and self.control.owns(ino) and self.control.writable(ino):
            return self.getattr(ino)
        raise FsError(errno.EROFS)

    @property
    def open_handles(self) -> int:
        return len(self._handles) + self.control.open_handles

    # ---- the order -------------------------------------------------------------------
    def set_order(self, rank: int, data: bytes) -> None:
        """Replace rank's order with the one encoded in data, or refuse it (EINVAL)."""
        try:
            order = orderfmt.parse(data, self.index.n_files)
        except orderfmt.OrderError as e:
            self.stats.orders_refused += 1
            log.warning("order for rank %d refused, the previous one stays: %s", rank, e)
            raise FsError(errno.EINVAL, str(e)) from None
        self.plans[rank] = Plan(order, self.index.size)
        self.stats.orders_accepted += 1
        self.cache.replan(self.next_use)
        log.info("rank %d: order of %d samples for epoch %d", rank, len(order), order.epoch)
        self.prefetcher.wake()

    def next_use(self, sid: int) -> int | None:
        """How many positions ahead of its plan's cursor sid is needed next (None: never)."""
        best = None
        for plan in self.plans.values():
            pos = plan.next_position(sid)
            if pos is not None and (best is None or pos - plan.cursor < best):
                best = pos - plan.cursor
        return best

    def use(self, sid: int) -> None:
        """A reader closed sample sid: count the use; drop what was used for the last time."""
        for plan in self.plans.values():
            if plan.remaining(sid) > 0:
                for done in plan.use(sid):
                    if self.next_use(done) is None and self.cache.drop(done):
                        self.stats.evicted_after_use += 1
                self.prefetcher.wake()
                return

    def ids_table(self) -> bytes:
        """Every sample's relative path, NUL-terminated, in id order (`.fusefs/ids`)."""
        if self._ids_table is None:
            self._ids_table = b"".join(self.index.file_path(i) + b"\0" for i in range(self.index.n_files))
        return self._ids_table

    async def fetch(self, sid: int) -> bytes:
        """Sample sid's verified bytes, from the cache, a fetch under way, or the backend."""
        self._recent.append(sid)
        data = self.cache.get(sid)
        if data is not None:
            self.stats.hits += 1
            return data
        pending = self.fetcher.inflight.get(sid)
        if pending is not None:
            self.stats.read_waits += 1
            t0 = time.perf_counter()
            await pending.event.wait()
            self.stats.wait_s += time.perf_counter() - t0
            result = pending.error or pending.data
        else:
            self.stats.misses += 1
            results = {}

            def deliver(s, r):
                results[s] = r
                self.deliver(s, r)

            await self.fetcher.fetch([sid] + self._companions(sid), deliver)
            result = results[sid]
        if isinstance(result, Exception):
            self.stats.eio += 1
            raise FsError(errno.EIO, str(result))
        return result

    def _companions(self, sid: int) -> list[int]:
        """What to fetch together with a missed sample: the next planned samples on the
        same node, or, reading without an order, the next samples of the same chunk when
        the reads look like a scan."""
        k = self.fetcher.batch - 1
        node = self.fetcher.node_of(sid)
        if self.next_use(sid) is not None:
            out = []
            for plan in self.plans.values():
                scan = int(4 * self.cache.budget / max(1.0, self.mean_size)) + 256
                for s in plan.window(self.cache.budget, max_scan=scan).tolist():
                    if len(out) >= k:
                        return out
                    if (s != sid and s not in self.cache and s not in self.fetcher.inflight
                            and self.fetcher.node_of(s) == node):
                        out.append(s)
            return out
        if sid - 1 not in self._recent:
            return []
        chunk = self.index.chunk
        end = min(sid + 1 + k, self.index.n_files)
        return [s for s in range(sid + 1, end) if chunk[s] == chunk[sid]
                and s not in self.cache and s not in self.fetcher.inflight]

    def deliver(self, sid: int, result, prefetched: bool = False) -> None:
        """A fetch finished: keep the bytes if some order or the LRU part wants them."""
        if isinstance(result, Exception):
            path = self.store.chunk_path(int(self.index.chunk[sid]))
            if isinstance(result, CorruptSample):
                log.error("EIO: %s", result)
            else:
                log.error("EIO: %s: sample %s: backend read failed: %s", path,
                          os.fsdecode(self.index.file_path(sid)), result)
            return
        nxt = self.next_use(sid)
        if nxt is None and prefetched:
            return  # read ahead for an order that has since been replaced
        self.cache.put(sid, result, next_use=nxt, next_use_of=self.next_use)

    def statistics(self) -> dict:
        out = self.stats.snapshot()
        out.update(cache_bytes=self.cache.used, cache_reserved=self.cache.reserved,
                   cache_peak=self.cache.peak, cache_budget=self.cache.budget,
                   cache_samples=len(self.cache), evictions=self.cache.evictions,
                   samples=self.index.n_files, dataset_bytes=self.index.total_bytes,
                   open_handles=self.open_handles, prefetch_batches=self.prefetcher.batches,
                   backend_requests=sum(n["requests"] for n in self.fetcher.node_stats),
                   backend_reads=sum(n["reads"] for n in self.fetcher.node_stats),
                   backend_bytes=sum(n["bytes"] for n in self.fetcher.node_stats),
                   backend_samples=sum(n["samples"] for n in self.fetcher.node_stats),
                   nodes=self.fetcher.statistics())
        plans = {}
        for rank, plan in self.plans.items():
            window = plan.window(self.cache.budget)
            ready = sum(1 for s in window.tolist() if s in self.cache)
            plans[str(rank)] = {"epoch": plan.epoch, "length": len(plan), "cursor": plan.cursor,
                                "skipped": plan.skipped, "ahead_ready": ready,
                                "ahead_planned": len(window)}
        out["plans"] = plans
        return out
