"""What the packed dataset looks like as a filesystem, without any FUSE in it.

Inode numbers:
    1 .. n_dirs                      directories (1 is the root, directory 0 of the index)
    CTRL_DIR = n_dirs + 1            the hidden control folder `.fusefs`
    CTRL_DIR + 1 .. CTRL_DIR + 15    control files
    FILE_BASE + sid                  the files; sid is the sample id in the index

Lookups, attributes and listings come from the in-memory index (no backend I/O). Reads
fetch a whole sample once, verify it and serve any offset and size from it. Errors are
FsError(errno); the FUSE adapter (fs.py) turns them into FUSEError.
"""
from __future__ import annotations

import errno
import logging
import os
import stat
import time

import trio

from .cache import LRUCache
from .control import CONTROL_NAME, ControlNamespace
from .entries import Attr, FsError, OpenResult
from .index import Index
from .store import ChunkStore, CorruptSample

log = logging.getLogger("fusefs")

ROOT = 1
CTRL_SLOTS = 16
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_TRUNC | os.O_APPEND | os.O_CREAT


class Stats:
    """Counters of the daemon; a snapshot goes to `.fusefs/stats`."""

    FIELDS = ("opens", "reads", "bytes_served", "backend_reads", "backend_bytes",
              "cache_hits", "cache_misses", "read_waits", "eio")

    def __init__(self):
        for f in self.FIELDS:
            setattr(self, f, 0)
        self.started = time.time()

    def snapshot(self) -> dict:
        out = {f: getattr(self, f) for f in self.FIELDS}
        out["uptime_s"] = round(time.time() - self.started, 3)
        return out


class _Pending:
    __slots__ = ("event", "data", "error")

    def __init__(self):
        self.event = trio.Event()
        self.data = None
        self.error = None


class Core:
    def __init__(self, index: Index, store: ChunkStore, *, cache_bytes: int = 256 << 20,
                 backend_threads: int = 16, uid: int | None = None, gid: int | None = None):
        self.index = index
        self.store = store
        self.cache = LRUCache(cache_bytes)
        self.stats = Stats()
        self.limiter = trio.CapacityLimiter(backend_threads)
        self.uid = os.getuid() if uid is None else uid
        self.gid = os.getgid() if gid is None else gid
        self.ctrl_dir = index.n_dirs + 1
        self.file_base = self.ctrl_dir + CTRL_SLOTS
        self.control = ControlNamespace(self, self.ctrl_dir)
        self._inflight: dict[int, _Pending] = {}

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
        return OpenResult(fh=ino)

    async def read(self, fh: int, off: int, size: int) -> bytes:
        sid = self.sid_of(fh)
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
        if self.sid_of(fh) is not None:
            raise FsError(errno.EROFS)
        return self.control.write(fh, off, data)

    def flush(self, fh: int) -> None:
        if self.sid_of(fh) is None:
            self.control.flush(fh)

    def release(self, fh: int) -> None:
        if self.sid_of(fh) is None:
            self.control.release(fh)

    async def fetch(self, sid: int) -> bytes:
        """Sample sid's verified bytes, from the cache, a fetch under way, or the backend."""
        data = self.cache.get(sid)
        if data is not None:
            self.stats.cache_hits += 1
            return data
        pending = self._inflight.get(sid)
        if pending is not None:
            self.stats.read_waits += 1
            await pending.event.wait()
        else:
            self.stats.cache_misses += 1
            pending = self._inflight[sid] = _Pending()
            try:
                pending.data = await trio.to_thread.run_sync(self.store.read_sample, sid,
                                                             limiter=self.limiter)
                self.stats.backend_reads += 1
                self.stats.backend_bytes += len(pending.data)
                self.cache.put(sid, pending.data)
            except CorruptSample as e:
                log.error("EIO: %s", e)
                pending.error = FsError(errno.EIO, str(e))
            except OSError as e:
                log.error("EIO: %s: backend read failed: %s",
                          self.store.chunk_path(int(self.index.chunk[sid])), e)
                pending.error = FsError(errno.EIO, str(e))
            finally:
                del self._inflight[sid]
                pending.event.set()
        if pending.error is not None:
            self.stats.eio += 1
            raise pending.error
        return pending.data

    def statistics(self) -> dict:
        out = self.stats.snapshot()
        out.update(cache_bytes=self.cache.used, cache_budget=self.cache.budget,
                   cache_samples=len(self.cache), evictions=self.cache.evictions,
                   samples=self.index.n_files, dataset_bytes=self.index.total_bytes)
        return out
