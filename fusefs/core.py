"""The filesystem without any FUSE in it: a façade over the namespace, the open handles, the
control namespace and the data plane.

Names, inodes, attributes and listings are the namespace's (namespace.py: from the
in-memory index, no backend I/O); the orders are the order controller's (orders.py); the
open handles are the core's, and the bytes they keep between reads the holders'
(holders.py). A read of a sample gets its whole verified bytes from reads.Reads (held,
a fetch under way, or the backend, batched with the samples the order needs next on the same
storage node) and serves any offset and size from them. The fetched samples the cache does
not keep for the fast path are pushed into the kernel page cache as they arrive, so a
reader's read() of them never reaches the daemon: a cached sample costs an open and a release
(and the ioctl with which Python's open() asks isatty, answered by the binding in C:
docs/HOTPATH.md). Closing a file is a use of its sample in the order (policy.py); the cache
keeps it until its room is needed (cache.py). The parts of the data plane are made by
dataplane.DataPlane.build (mount.serve calls it and hands the plane in; a core made without
one builds it the same way); the core makes the names (namespace.py, with the control
namespace, control.py); its statistics merge every part's counters().
Errors are FsError(errno); the FUSE adapter (fs.py) turns them into FUSEError.
"""
from __future__ import annotations

import errno
import functools
import logging
import os
import resource
import time

import trio

from . import _eventscore
from .config import DEFAULTS, MountConfig
from .control import FH_BASE, ControlHooks, ControlNamespace
from .dataplane import DataPlane
from .entries import WRITE_FLAGS, Attr, FsError, OpenResult
from .handles import (EVENT_BITS, EVENT_LAYOUT, MISSED, READ, READ_END, READ_LOST, RELEASED, SERIAL_WRAP, SID_BITS,
                      SID_MASK)
from .histogram import Histogram
from .idstable import PathsText, chunks_read
from .memory import resident_bytes
from .index import Index
from .namespace import Namespace, control_dir
from .store import ChunkStore

log = logging.getLogger("fusefs")



class Stats:
    """Counters of the core and its reads (a part of the statistics, as every part's
    `counters()`: merged by Core.statistics into `.fusefs/stats` and the metrics)."""

    FIELDS = ("opens", "opens_pushed", "releases", "reads", "bytes_served", "hits", "pushed",
              "push_skipped", "kernel_dropped", "kernel_forgotten",
              "misses", "read_waits", "eio", "eio_at_once", "orders_accepted", "orders_refused")

    def __init__(self):
        for f in self.FIELDS:
            setattr(self, f, 0)
        self.wait_s = 0.0
        self.wait_hist = Histogram()  # a read's wait for a fetch under way
        self.started = time.time()
        self.cpu_start = cpu_seconds()

    def counters(self) -> dict:
        out = {f: getattr(self, f) for f in self.FIELDS}
        out["read_wait_seconds"] = self.wait_hist.snapshot()
        out["read_wait_s"] = round(self.wait_s, 4)
        out["uptime_s"] = round(time.time() - self.started, 3)
        out["rss_bytes"] = resident_bytes()
        out["cpu_s"] = round(cpu_seconds() - self.cpu_start, 4)
        return out


def merge_counters(out: dict, part: dict) -> dict:
    """Add a part's counters to out, the statistics' one rule: a figure that two parts
    count (a number, or a table of numbers by name, such as `requests` by type) adds up;
    anything else is set."""
    for name, value in part.items():
        old = out.get(name)
        if isinstance(old, dict) and isinstance(value, dict):
            out[name] = {k: old.get(k, 0) + value.get(k, 0) for k in old.keys() | value.keys()}
        elif type(old) in (int, float) and type(value) in (int, float):
            out[name] = old + value
        else:
            out[name] = value
    return out


def cpu_seconds() -> float:
    """CPU time of the whole daemon (every thread), user and system."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


class Core:
    def __init__(self, index: Index, store: ChunkStore, config: MountConfig = DEFAULTS, *,
                 local=None, kernel=None, hold=None, table=None, idle=None, catch_up=None,
                 control_socket: str | None = None, plane: DataPlane | None = None,
                 stats: "Stats | None" = None, misses=None):
        """The dataset of index, its chunks read through store, with the mount's settings
        (config); local: the local cache tier (local.LocalTier) or None; kernel: the kernel
        page cache (fs.KernelCache, which fetched samples are pushed into as they arrive:
        docs/ARCHITECTURE.md, "Kernel page cache"), or None: every read is served by the
        daemon; hold(sid, bytes or None): told of every sample the cache keeps or lets go
        (the fast path's FastPath.hold, which answers reads from them), or None; table: the
        fast path the fetch threads hand samples to (FastPath: hold_many, expect), or None;
        idle(bool):
        told when the read-ahead has covered its orders, or no longer (FastPath.idle: the
        readers' uses of samples the kernel holds may then reach the core later), or None;
        catch_up(): applies the uses that wait to reach the core (FastPath.catch_up), before
        an order from the control socket is put in force, or None; control_socket: the
        control socket's path, which `.fusefs/control` links to (None: no link). The files'
        owner is config's uid and gid (None: the daemon's). plane: the data plane
        (dataplane.DataPlane, built by mount.serve with stats, the counters it was given),
        or None: built here the same way from local, kernel, hold, table and idle. misses:
        the miss engine (misses.MissEngine), told when an order is put in force, or None."""
        self.index = index
        self.store = store
        self.local = local
        self.control_gid = config.control_gid  # a group that may set orders too
        self.owner = os.geteuid()  # the daemon's user: trusted, as root is
        self.stats = Stats() if stats is None else stats
        self.misses = misses
        self.control = ControlNamespace(ControlHooks(
            statistics=self.statistics, ids_read=PathsText(index).read,
            chunks_read=functools.partial(chunks_read, index.chunk),
            trusted=self.trusted, control_gid=config.control_gid, started=self.stats.started,
            socket_path=control_socket, owner=self.owner), control_dir(index))
        self.namespace = Namespace(index, config.files, self.control)
        # (the namespace's, which the adapter and the hot path read)
        self.uid, self.gid = self.namespace.uid, self.namespace.gid
        self.ctrl_dir, self.file_base = self.namespace.ctrl_dir, self.namespace.file_base
        if plane is None:
            plane = DataPlane.build(index, store, config, self.stats, local=local, kernel=kernel,
                                    hold=hold, table=table, idle=idle)
        self.plane = plane
        # (the data plane's parts, which the façade's methods and the statistics reach)
        self.policy, self.cache, self.kernel_view = plane.policy, plane.cache, plane.kernel_view
        self.handles, self.holders, self.arrivals = plane.handles, plane.holders, plane.arrivals
        self.fetcher, self.prefetcher, self.reads = plane.fetcher, plane.prefetcher, plane.reads
        self.orders = plane.orders
        self._catch_up = catch_up
        # the parts whose counters() make the statistics (count() adds the FUSE adapter's)
        self.counted = [self.stats, self.cache, self.fetcher, self.prefetcher, self.arrivals,
                        self.kernel_view, self.orders, self.control,
                        *([local] if local is not None else [])]
        self.n_files = index.n_files
        # (a miss's room in the cache: without an order the loop keeps misses while it has it)
        self._miss_room = self.cache.cost(index.total_bytes // max(1, index.n_files))
        self._scope = trio.CancelScope()  # run()'s

    @property
    def plans(self):
        return self.policy.plans

    @property
    def corrupt(self) -> dict:
        return self.arrivals.corrupt

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Serve: the fetcher (its batches' worker threads, and the retries waiting in its
        nursery) and the read-ahead run as tasks of a nursery opened here, until cancelled.
        Start it in the mount's nursery (`await nursery.start(core.run)`) before the first
        read; tests do the same (conftest.serving)."""
        self._scope = trio.CancelScope()
        with self._scope:
            async with trio.open_nursery() as nursery:
                await nursery.start(self.fetcher.run, nursery)
                await nursery.start(self.prefetcher.run)
                task_status.started()

    def stop(self) -> None:
        """End run(): the read-ahead and every fetch (their readers get EIO), as the mount
        goes (from the event loop)."""
        self._scope.cancel()

    # ---- names (the namespace's) -----------------------------------------------------
    def sid_of(self, ino: int) -> int | None:
        return self.namespace.sid_of(ino)

    def lookup(self, parent: int, name: bytes) -> Attr:
        return self.namespace.lookup(parent, name)

    def getattr(self, ino: int) -> Attr:
        return self.namespace.getattr(ino)

    def readdir(self, ino: int, start: int):
        """Yield (name, Attr, next_offset) from position start; `.fusefs` is never listed."""
        return self.namespace.readdir(ino, start)

    def opendir(self, ino: int) -> int:
        return self.namespace.opendir(ino)

    def statfs(self) -> dict:
        return self.namespace.statfs()

    def forget(self, inodes) -> None:
        """The kernel dropped these inodes, and with them their pages."""
        sid_of = self.namespace.sid_of
        for ino in inodes:
            sid = sid_of(ino)
            if sid is not None:
                self._forgot(sid)

    def _forgot(self, sid: int) -> None:
        self.reads.forgot(sid)  # (its pages are gone with the inode)

    # ---- data ------------------------------------------------------------------------
    def trusted(self, uid: int | None) -> bool:
        """Whether uid is root or the daemon's user, the user who mounted (None: a request
        from within). The files' displayed owner (--uid, -o uid=) is display only."""
        return uid is None or uid in (0, self.owner)

    def may_control(self, uid: int, gids: set[int]) -> bool:
        """Whether a process of user uid, in groups gids, may set orders: root, the user who
        mounted, and members of the control group."""
        return self.trusted(uid) or (self.control_gid is not None and self.control_gid in gids)

    def open(self, ino: int, flags: int, uid: int | None = None) -> OpenResult:
        """The hot path: no I/O, no thread, no table entry; the handle carries the sample."""
        sid = ino - self.file_base
        if not 0 <= sid < self.n_files:
            if self.namespace.dir_of(ino) is not None:
                raise FsError(errno.EISDIR)
            return self.control.open(ino, flags, uid)
        if flags & WRITE_FLAGS:
            raise FsError(errno.EROFS)
        self.stats.opens += 1
        self.kernel_view.opened(sid)
        return OpenResult(fh=self.handles.new(sid))

    def fast_path_args(self) -> dict:
        """What the fast path needs to answer opens as open() does (fastpath.FastPath.start);
        it continues the handles' serials from here, reads the kernel view's flags as it
        answers reads (READ_LOST), and answers the lookups of files' names as lookup() does from
        the index's tree (Namespace.tree)."""
        return {"file_base": self.file_base, "n_files": self.index.n_files, "sid_bits": SID_BITS,
                "serial": self.handles.serial, "serial_wrap": SERIAL_WRAP, "write_flags": WRITE_FLAGS,
                "events": EVENT_BITS, "kernel_flags": self.kernel_view.flags(),
                "tree": self.namespace.tree(), "missed": MISSED if self.holders.expects else 0}

    def answered(self, events) -> None:
        """Opens, reads, releases and forgets of dataset files answered outside the loop
        (fastpath), in the order they came: an open's handle, a release's with RELEASED
        set, a read's sample with READ set (and READ_END where it reached the sample's end),
        a forgotten sample with FORGOTTEN set, a missed sample whose read waits in the fast
        path with READ and MISSED set (fetched together once the others are applied:
        reads.Reads.parked_misses), and that read's answer with READ, MISSED and READ_END
        (counted as a miss already). Counted in C (fusefs._eventscore.scan) up to each event
        that needs this loop's Python in its turn: a forget (the uses before it are counted
        first: whether the orders still need its sample depends on them), a read of pages
        the kernel had dropped; where handles keep bytes between reads (rarely), one by one
        (_answered_one_by_one)."""
        if self.handles.held:
            self._answered_one_by_one(events)
            return
        view, reads = self.kernel_view, self.reads
        held, through = view.held, view.pushes
        used, missed = [], []
        n, at = len(events), 0
        opens = nreads = releases = 0
        last = 0
        while True:
            at, o, r, rel, opens_held, lst, u, m, hits = _eventscore.scan(events, at, held, through, EVENT_LAYOUT)
            opens, nreads, releases, last = opens + o, nreads + r, releases + rel, lst or last
            used += u
            missed += m
            if hits:
                reads.hits(hits)
            if opens_held:
                view.opened_held(opens_held)
            if at >= n:
                break
            e = events[at]
            at += 1
            if e >= RELEASED:  # (a forget)
                if used:
                    self._use_many(used)
                    used = []
                self._forgot(e & SID_MASK)
            else:  # (a read of pages the kernel had dropped)
                nreads += 1
                reads.answered(e & SID_MASK, e & READ_END, e & READ_LOST, e & MISSED)
        self._count_answered(opens, nreads, releases, last, used, missed)

    def _answered_one_by_one(self, events) -> None:
        """answered() in Python, an event at a time, letting go of what handles keep."""
        handles, opened, answered = self.handles, self.kernel_view.opened, self.reads.answered
        kept = handles.held
        used = []  # released samples whose uses are yet to be counted (_use_many)
        missed = []
        opens = reads = releases = 0  # (counted once the batch is applied: nothing reads them here)
        last = 0  # the last handle opened (one sequence of handles)
        for e in events:
            if e >= RELEASED:
                if e & READ:
                    if used:  # (whether the orders still need it depends on the uses before)
                        self._use_many(used)
                        used = []
                    self._forgot(e & SID_MASK)
                else:
                    releases += 1
                    if kept:
                        handles.let_go(e - RELEASED)
                    used.append(e & SID_MASK)
            elif e >= READ:
                if e & MISSED and not e & READ_END:  # (its answer has READ_END: below)
                    missed.append(e & SID_MASK)
                    continue
                reads += 1
                answered(e & SID_MASK, e & READ_END, e & READ_LOST, e & MISSED)
            else:
                opens += 1
                opened(e & SID_MASK)
                last = e
        self._count_answered(opens, reads, releases, last, used, missed)

    def _count_answered(self, opens: int, reads: int, releases: int, last: int, used: list, missed: list) -> None:
        """A batch of events applied: its counts, the uses of its releases and the fetch of
        its misses."""
        stats = self.stats
        stats.opens += opens
        stats.reads += reads
        stats.releases += releases
        self.handles.count(opens, releases, last)
        if used:
            self._use_many(used)
        if missed:
            self._misses_to_engine()  # (before their fetch: once it answers, the next misses come)
            try:
                self.reads.parked_misses(missed)
            except Exception:  # (a bug: their reads must not wait for ever)
                log.exception("fetching %d missed sample(s) for the fast path failed: their reads "
                              "go to the loop", len(missed))
                for sid in missed:
                    self.holders.let_go(sid)
            self._misses_to_engine()

    def _misses_to_engine(self) -> None:
        """Misses reached the loop: without an order (or once the orders were read to their
        ends) it keeps them in the cache while the cache has room for one (a set the cache
        holds is then read from memory from the next epoch on); once it has none, the miss
        engine reads them (misses.py), keeping nothing, as the loop would keep nothing
        more. A new order turns it off again (_order_in_force)."""
        if (self.misses is not None and not self.misses.on and not self.policy.ahead
                and self.cache.free < self._miss_room):
            self.misses.enable(True)

    def _sid_of_fh(self, fh: int) -> int | None:
        return fh & SID_MASK if fh < FH_BASE else None

    async def read(self, fh: int, off: int, size: int) -> bytes:
        sid = self._sid_of_fh(fh)
        if sid is None:
            return self.control.read(fh, off, size)
        self.stats.reads += 1
        self.reads.lost(sid)
        end = self.index.size_v[sid]
        if off >= end:
            return b""
        data = self.holders.kept_for(fh)
        if data is None:  # an open file keeps its bytes, whatever the cache does meanwhile
            data = await self.reads.fetch(sid)
            if off + size < end:  # (another read of this handle may have kept them meanwhile)
                self.holders.keep_for(fh, data)
        else:
            self.stats.hits += 1
        out = data[off:off + size]
        self.stats.bytes_served += len(out)
        if off + size >= end:
            self.kernel_view.read_through(sid)
        return out

    def release(self, fh: int) -> None:
        if fh >= FH_BASE:
            self.control.release(fh)
            return
        self.stats.releases += 1
        self.handles.released(fh)
        self.use(fh & SID_MASK)

    def readlink(self, ino: int) -> bytes:
        if not self.control.owns(ino):
            raise FsError(errno.EINVAL)
        return self.control.readlink(ino)

    @property
    def open_handles(self) -> int:
        return self.handles.open + self.control.open_handles

    # ---- the order -------------------------------------------------------------------
    def set_order(self, rank: int, data: bytes) -> None:
        """Replace rank's order with the one encoded in data, or refuse it (FsError EINVAL,
        why): at once, on the caller's thread (a core without a mount; tests)."""
        self.orders.set(rank, data)
        self._order_in_force()
        self.control.show_order(rank, data)

    async def commit_order(self, rank: int, data: bytes) -> None:
        """set_order from the control socket: the order is prepared in a worker thread
        (orders.Orders.commit), so the loop serves everything else meanwhile; the readers'
        uses that came before it are applied first (catch_up)."""
        await self.orders.commit(rank, data, before=self._catch_up)
        self._order_in_force()
        self.control.show_order(rank, data)

    def _order_in_force(self) -> None:
        """An order is in force: the read-ahead fetches a miss with the samples queued
        after it, so misses go to the loop, not to the miss engine (misses.py)."""
        if self.misses is not None:
            self.misses.orders_in_force()

    @property
    def order_limit(self) -> int:
        """The largest order the control socket reads (orders.Orders.limit)."""
        return self.orders.limit()

    def next_use(self, sid: int) -> int | None:
        """How many positions ahead of its plan's cursor sid is needed next (None: never)."""
        return self.policy.next_use(sid)

    def use(self, sid: int) -> None:
        """A reader closed sample sid: count the use in the plan that needs it."""
        used = self.policy.use(sid)
        if used is None:
            return
        plan, done = used
        if sid in self.cache:  # its next use moved on (to a later occurrence, or never)
            self.cache.rekey(sid, self.policy.key(sid))
        if plan.passed:  # (occurrences the cursor passed unused: their next uses moved on too)
            self._passed(plan.passed)
        self.prefetcher.used(self.index.size_v[sid])
        if done and self.local is not None and plan.importance is None:
            for s in done:
                if self.policy.next_use(s) is None:
                    self.local.lower(s)

    def _use_many(self, sids: list[int]) -> None:
        """use() of each of sids in turn. Under one order and without a local tier, in one
        pass (Plan.use_many, SampleCache.rekey_many): one call chain a batch of the fast
        path's releases, not one a sample."""
        plan = self.policy.single
        if plan is None or self.local is not None:
            for sid in sids:
                self.use(sid)
            return
        pairs = plan.use_many(sids)
        if not pairs:
            return
        self.cache.rekey_many(pairs)
        if plan.passed:
            self._passed(plan.passed)
        size = self.index.size_v
        self.prefetcher.used(sum(map(size.__getitem__, pairs[::2])))

    def _passed(self, passed: list[int]) -> None:
        """Samples whose occurrence a plan's cursor passed without their readers' uses
        (Plan.passed, emptied here): the cache keys them by their next use now. (Left at the
        passed position, an entry would look needed sooner than anything ahead and never
        be evicted: with readers far apart, such entries filled the cache in an epoch.)"""
        cache, key = self.cache, self.policy.key
        for s in passed:
            if s in cache:
                cache.rekey(s, key(s))
        passed.clear()

    def count(self, part) -> None:
        """Add part's counters() (a dict of figures) to the statistics: the FUSE adapter's
        requests, the fast path's."""
        self.counted.append(part)

    def statistics(self) -> dict:
        """Every part's counters, merged (merge_counters), with what they make together."""
        out = {"samples": self.index.n_files, "dataset_bytes": self.index.total_bytes,
               "open_handles": self.open_handles, "held_bytes": self.handles.held_bytes,
               "requests": {}, "fast_path_requests": None,
               "local_hits": 0, "local": None}
        for part in self.counted:
            merge_counters(out, part.counters())
        out["requests"] = dict(sorted((k, v) for k, v in out["requests"].items() if v))
        opens = out["opens"]  # (None per sample until a file is opened)
        out["cpu_us_per_sample"] = round(1e6 * out["cpu_s"] / opens, 1) if opens else None
        out["requests_per_sample"] = round(sum(out["requests"].values()) / opens, 3) if opens else None
        plans = {}
        for rank, plan in self.plans.items():
            window = plan.window(self.cache.budget)
            cached = [s in self.cache for s in window.tolist()]
            plans[str(rank)] = {"epoch": plan.epoch, "length": len(plan), "cursor": plan.cursor,
                                "next_length": len(plan.next_ids),
                                "skipped": plan.skipped, "late_uses": plan.late,
                                "skip_window": plan.skip_window, "ahead_ready": sum(cached),
                                "ahead_planned": len(window),
                                # samples from the cursor on that are all ready, in a row
                                "ready_in_a_row": cached.index(False) if False in cached else len(cached),
                                "importance": plan.importance is not None}
        out["plans"] = plans
        return out
