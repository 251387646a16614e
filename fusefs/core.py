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
import functools
import logging
import os
import stat
import time

import numpy as np
import trio

from . import order as orderfmt
from .cache import SampleCache
from .control import ControlNamespace
from .entries import Attr, FsError, OpenResult
from .index import CONTROL_NAME, Index
from .plan import Plan
from .prefetch import Fetcher, Prefetcher
from .store import ChunkStore, CorruptSample

log = logging.getLogger("fusefs")

ROOT = 1
CTRL_SLOTS = 128
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_TRUNC | os.O_APPEND | os.O_CREAT


class Stats:
    """Counters of the daemon; a snapshot goes to `.fusefs/stats`."""

    FIELDS = ("opens", "reads", "bytes_served", "hits", "pushed", "misses", "read_waits", "eio",
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
                 static_bytes: int = 0, per_node: int = 4, batch: int = 16, retries: int = 4,
                 local=None, uid: int | None = None, gid: int | None = None,
                 control_gid: int | None = None):
        self.index = index
        self.store = store
        self.cache = SampleCache(cache_bytes, static_bytes)
        self.stats = Stats()
        self.local = local  # the local cache tier (local.LocalTier) or None
        self.fetcher = Fetcher(store, per_node=per_node, batch=batch, retries=retries, local=local)
        self.prefetcher = Prefetcher(self)
        self.plans: dict[int, Plan] = {}
        self.uid = os.getuid() if uid is None else uid
        self.gid = os.getgid() if gid is None else gid
        self.control_gid = control_gid  # a group that may write the control files too
        self.ctrl_dir = index.n_dirs + 1
        self.file_base = self.ctrl_dir + CTRL_SLOTS
        self.control = ControlNamespace(self, self.ctrl_dir)
        self._handles: dict[int, int] = {}  # open file handle -> sample id
        self._held: dict[int, bytes] = {}   # open file handle -> its sample's bytes, once read
        self._next_fh = 1
        self._recent = collections.deque(maxlen=32)  # recently read samples (scan detection)
        self._ids_table: bytes | None = None
        self.corrupt: dict[int, str] = {}  # samples whose stored bytes fail their checksum
        # The kernel page cache, when the FUSE adapter offers it (KernelCache.push(ino,
        # data)): a sample cached here at open time is pushed to the kernel with the open,
        # so its reads never reach the daemon (README: "kernel page cache").
        self.kernel = None

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
    def may_control(self, uid: int | None) -> bool:
        """Whether the user uid may write the control files: root or the user who mounted
        (None: a request from within). With a control group the files are group-writable and the
        kernel (default_permissions, always on) has already checked the caller's groups,
        supplementary ones included, before the request got here."""
        return uid is None or uid in (0, self.uid) or self.control_gid is not None

    def open(self, ino: int, flags: int, uid: int | None = None) -> OpenResult:
        sid = self.sid_of(ino)
        if sid is None:
            if self._dir_of(ino) is not None:
                raise FsError(errno.EISDIR)
            return self.control.open(ino, flags, uid)
        if flags & WRITE_FLAGS:
            raise FsError(errno.EROFS)
        self.stats.opens += 1
        fh = self._next_fh
        self._next_fh += 1
        self._handles[fh] = sid
        push = self.cache.get(sid) if self.kernel is not None else None
        return OpenResult(fh=fh, push=push or None)

    async def push(self, ino: int, data: bytes) -> None:
        """Hand a cached sample's bytes to the kernel page cache (the open's `push`, before
        its reply). In a worker thread: the store waits for the locks of the file's pages,
        and a read of the same file by another opener holds one until the daemon answers
        that read; on the event loop, the store and the read waited for each other
        (a test with 3 readers of the same files hung so)."""
        kernel = self.kernel
        if kernel is None:
            return
        try:
            await trio.to_thread.run_sync(kernel.push, ino, data)
        except OSError as e:
            log.warning("the kernel refused a page cache push (%s): serving reads from the daemon", e)
            self.kernel = None
            return
        self.stats.pushed += 1
        self.stats.hits += 1

    async def read(self, fh: int, off: int, size: int) -> bytes:
        sid = self._handles.get(fh)
        if sid is None:
            return self.control.read(fh, off, size)
        self.stats.reads += 1
        if off >= int(self.index.size[sid]):
            return b""
        data = self._held.get(fh)
        if data is None:  # an open file keeps its bytes, whatever the cache does meanwhile
            data = await self.fetch(sid)
            if fh in self._handles:
                self._held[fh] = data
        else:
            self.stats.hits += 1
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
        self._held.pop(fh, None)
        if sid is None:
            self.control.release(fh)
        else:
            self.use(sid)

    def setattr(self, ino: int, size: int | None, other: bool = False,
                uid: int | None = None) -> Attr:
        """Only truncating a writable control file (as `open(..., "w")` does) is allowed;
        `other` is a change of mode, owner or times."""
        if not other and size in (None, 0) and self.control.owns(ino) and self.control.writable(ino):
            if not self.may_control(uid):
                raise FsError(errno.EACCES)
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
        self.prefetcher.reset()
        self.stats.orders_accepted += 1
        if self.cache.static:
            self._pick_pins()
        if self.local is not None:
            self.local.set_priorities(self._tier_priorities())
        self.cache.replan(self._near_set().__contains__)
        log.info("rank %d: order of %d samples for epoch %d", rank, len(order), order.epoch)
        self.prefetcher.wake()

    def _near_set(self) -> set:
        """The samples the orders need before a budget's worth of others (each plan from
        its cursor): what a new order keeps as planned in the cache."""
        room = self.cache.budget - self.cache.static
        near: set = set()
        for plan in self.plans.values():
            near.update(plan.window(room).tolist())
        return near

    def _pick_pins(self) -> None:
        """Pin the samples of highest importance over all ranks' orders (none if no order
        carries importance values: then the cache works exactly as without pins)."""
        plans = self._importance_plans()
        if plans:
            ids = np.concatenate([p.ids for p in plans])
            imp = np.concatenate([p.importance for p in plans])
        else:
            ids, imp = np.zeros(0, np.int64), np.zeros(0, np.float32)
        self.cache.set_pins(ids, imp, self.index.size)

    def _tier_priorities(self) -> np.ndarray:
        """What the local tier keeps when full (higher stays): the orders' importance values
        where some order carries them, else how soon the orders need a sample (minus its
        position); -inf for samples no such order names (and, without importance, once
        used for the last time, see use())."""
        prio = np.full(self.index.n_files, -np.inf)
        plans = self._importance_plans() or list(self.plans.values())
        for plan in plans:
            val = (plan.importance.astype(np.float64) if plan.importance is not None
                   else -np.arange(len(plan.ids), dtype=np.float64))
            cur = np.full(self.index.n_files, -np.inf)
            cur[plan.ids[::-1]] = val[::-1]  # reversed: the first occurrence wins
            np.maximum(prio, cur, out=prio)
        return prio

    def _importance_plans(self) -> list:
        return [p for p in self.plans.values() if p.importance is not None]

    def _tier_priority_after_use(self, sid: int) -> float:
        """The priority sid has once the use it is being fetched for is over."""
        if self._importance_plans() or any(p.remaining(sid) > 1 for p in self.plans.values()):
            return float(self.local.priority[sid])
        return -np.inf

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
                    if self.next_use(done) is None:
                        if self.cache.release(done):
                            self.stats.evicted_after_use += 1
                        if self.local is not None and plan.importance is None:
                            self.local.priority[done] = -np.inf
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
        if sid in self.corrupt:  # known bad: do not read it again
            self.stats.eio += 1
            raise FsError(errno.EIO, self.corrupt[sid])
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
            result = await self._fetch_missed(sid)
        if isinstance(result, Exception):
            self.stats.eio += 1
            raise FsError(errno.EIO, str(result))
        return result

    async def _fetch_missed(self, sid: int):
        """Fetch a sample no one is fetching, with companions: the next samples queued for
        read-ahead on its node up to a batch, or, reading without an order, the next k-1
        samples of its chunk when the reads look like a scan. The reader has its sample as
        soon as its read is done; the companions' reads go on in the background."""
        k = self.fetcher.batch - 1
        reserved = set(self.prefetcher.take_queued(sid))
        if sid not in reserved and self.cache.reserve(int(self.index.size[sid])):
            reserved.add(sid)
        batch = [sid] + [s for s in reserved if s != sid]
        if not self.plans and sid - 1 in self._recent:
            chunk = self.index.chunk
            end = min(sid + 1 + k, self.index.n_files)
            batch += [s for s in range(sid + 1, end) if chunk[s] == chunk[sid]
                      and s not in self.cache and s not in self.fetcher.inflight]
        nursery = self.prefetcher.nursery
        if nursery is None:  # (a core without its read-ahead task: tests)
            return (await self.fetch_batch(batch, reserved, keep=sid))[sid]
        # the batch goes on in the background; the reader has its sample when it arrives
        claimed = self.fetcher.claim(batch)
        nursery.start_soon(functools.partial(self.fetch_batch, batch, reserved, keep=sid,
                                             claimed=claimed))
        pending = claimed[sid]
        await pending.event.wait()
        return pending.error or pending.data

    async def fetch_batch(self, sids: list[int], reserved: set[int], keep: int | None = None,
                          claimed=None) -> dict:
        """Fetch sids (one node) as one batch; return what arrived for each. Reservations
        (of the sids in `reserved`) are released as their samples arrive, or at once for
        one someone else is already fetching. Read-ahead (reserved, other than `keep`, the
        sample a reader is waiting for) is kept only if an order still needs it.
        `claimed`: the fetcher's claim on sids, made by the caller (see Fetcher.fetch)."""
        sizes, inflight = self.index.size, self.fetcher.inflight
        for sid in sids:
            if sid in reserved and sid in inflight and not (claimed and sid in claimed):
                self.cache.unreserve(int(sizes[sid]))
        results = {}

        def deliver(s, r):
            if s in reserved:
                self.cache.unreserve(int(sizes[s]))
            results[s] = r
            self.deliver(s, r, prefetched=s in reserved and s != keep)

        await self.fetcher.fetch(sids, deliver, claimed)
        return results

    def deliver(self, sid: int, result, prefetched: bool = False) -> None:
        """A fetch finished: keep the bytes if some order or the LRU part wants them."""
        if isinstance(result, Exception):
            if isinstance(result, CorruptSample):
                if sid not in self.corrupt:
                    self.corrupt[sid] = str(result)
                    log.error("EIO: %s", result)
            else:
                chunk = int(self.index.chunk[sid])
                log.error("EIO: node %s: %s: sample %s: backend read failed: %s",
                          self.fetcher.node_names[self.fetcher.node_of(sid)],
                          self.store.chunk_path(chunk), os.fsdecode(self.index.file_path(sid)), result)
            return
        if self.local is not None and sid not in self.local:  # (cheap test first)
            self.local.offer(sid, result, self._tier_priority_after_use(sid))
        nxt = self.next_use(sid)
        if nxt is None and prefetched:
            return  # read ahead for an order that has since been replaced
        self.cache.put(sid, result, next_use=nxt)

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
                   backend_errors=sum(n["errors"] for n in self.fetcher.node_stats),
                   backend_retries=sum(n["retries"] for n in self.fetcher.node_stats),
                   corrupt_samples=len(self.corrupt), cache_static=self.cache.static,
                   pinned_samples=self.cache.pinned_samples, pinned_bytes=self.cache.pinned_bytes,
                   pins_picked=len(self.cache.pin_set),
                   local_hits=self.local.hits if self.local is not None else 0,
                   local=self.local.statistics() if self.local is not None else None,
                   nodes=self.fetcher.statistics())
        plans = {}
        for rank, plan in self.plans.items():
            window = plan.window(self.cache.budget)
            cached = [s in self.cache for s in window.tolist()]
            plans[str(rank)] = {"epoch": plan.epoch, "length": len(plan), "cursor": plan.cursor,
                                "skipped": plan.skipped, "ahead_ready": sum(cached),
                                "ahead_planned": len(window),
                                # samples from the cursor on that are all ready, in a row
                                "ready_in_a_row": cached.index(False) if False in cached else len(cached),
                                "importance": plan.importance is not None}
        out["plans"] = plans
        return out
