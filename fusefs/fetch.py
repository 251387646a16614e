"""Fetching samples from the backend on demand: batched per storage node, deduplicated.

The Fetcher runs batches of samples on one node as one blocking call in a worker thread
(the store coalesces samples that are adjacent or near each other in a chunk into one
read, and asks the kernel for all of a batch's reads at once: ChunkStore's willneed).
Each node has its own bound on requests in flight, so one slow node cannot take every
thread. A sample being fetched is registered, and a second reader waits for that
fetch instead of fetching again. The read-ahead (prefetch.py) starts its batches here too.
"""
from __future__ import annotations

import collections
import errno
import logging
import threading
import time
from dataclasses import asdict, dataclass

import numpy as np
import trio

from .config import DEFAULTS, FetchConfig
from .histogram import Histogram
from .store import MAX_GAP, CorruptSample

log = logging.getLogger("fusefs")

MAX_BACKOFF = 2.0  # seconds between tries of a read waiting for a node (io_timeout)
BATCH_BYTES = 1 << 20  # a request holds at least --batch samples, and as many as make this


class FetchCancelled(OSError):
    """A fetch stopped before its sample arrived (a shutdown): EIO for its waiters, not a
    backend failure."""

    def __init__(self):
        super().__init__(errno.EIO, "fetch cancelled")


class Pending:
    """A sample being fetched: its bytes or error once done, and an event for readers
    that wait for it (made only when one does: most read-ahead samples are never waited
    for)."""
    __slots__ = ("_event", "done", "data", "error")

    def __init__(self):
        self._event = None
        self.done = False
        self.data = None
        self.error = None

    async def wait(self) -> None:
        """Until the fetch is done (a checkpoint, as trio.Event.wait)."""
        if self.done:
            await trio.lowlevel.checkpoint()
            return
        if self._event is None:
            self._event = trio.Event()
        await self._event.wait()

    def set(self) -> None:
        self.done = True
        if self._event is not None:
            self._event.set()


class Inbox:
    """Results from worker threads to the event loop, many per wakeup: a thread posts
    (fn, arg) and wakes the loop only if no wakeup is pending; the loop then runs every
    posted call in one go. Under load a wakeup carries many reads' results."""

    def __init__(self, token):
        self.token = token
        self._items = collections.deque()
        self._lock = threading.Lock()
        self._scheduled = False
        self.wakeups = 0

    def post(self, fn, arg) -> None:  # any thread
        self._items.append((fn, arg))
        with self._lock:
            if self._scheduled:
                return
            self._scheduled = True
        try:
            self.token.run_sync_soon(self._drain)
        except trio.RunFinishedError:
            pass

    def _drain(self) -> None:  # the event loop
        with self._lock:
            self._scheduled = False
        self.wakeups += 1
        items = self._items
        while items:
            fn, arg = items.popleft()
            try:  # (an error here would end trio's run)
                fn(arg)
            except Exception:
                log.exception("delivering results from a worker thread failed")


async def in_thread(inbox: Inbox, limiter: trio.CapacityLimiter, fn, *args):
    """fn(*args) in a worker thread of trio's thread cache, within limiter; its outcome comes
    back through inbox, after what the thread posted there before it (a batch's groups),
    so the last group and the end of the call wake the loop once. As
    trio.to_thread.run_sync, not abandoned when cancelled (the caller's cleanup runs once
    the thread is done), without its report on a wakeup of its own, its context copy and
    its renaming of the thread: in-process, a call cost the loop 59-76 us of CPU against
    107-156 (docs/HOTPATH.md, "Fetching")."""
    async with limiter:
        task = trio.lowlevel.current_task()
        trio.lowlevel.start_thread_soon(lambda: fn(*args),
                                        lambda result: inbox.post(_resume, (task, result)))
        return await trio.lowlevel.wait_task_rescheduled(lambda _: trio.lowlevel.Abort.FAILED)


def _resume(item) -> None:  # (the event loop, from an Inbox)
    task, result = item
    trio.lowlevel.reschedule(task, result)


@dataclass
class NodeStats:
    """One storage node's counters (the statistics' `nodes`)."""
    requests: int = 0        # backend requests (a batch's reads, a try each)
    reads: int = 0           # reads they made (adjacent samples coalesced)
    samples: int = 0         # samples they brought (not the local tier's)
    bytes: int = 0
    errors: int = 0          # sample reads that failed
    retries: int = 0         # sample reads tried again
    failed_samples: int = 0  # samples given up on (EIO to their readers)


class Node:
    """A storage node: its counters, its batches under way, and whether it is down (its
    reads failed after every retry), with one log line when it goes down and one, with
    what waited and what failed meanwhile, when it answers again."""

    def __init__(self, name: str, retries: int, io_timeout: float):
        self.name = name
        self.stats = NodeStats()
        self.busy = 0            # batches started and not finished
        self.down = False
        self._retries, self._io_timeout = retries, io_timeout
        self._down_since: tuple[float, int, int] | None = None  # (when, retries, failed) then

    def counters(self) -> dict:
        return {**asdict(self.stats), "down": self.down, "inflight": self.busy}

    def answered(self) -> None:
        """A read of the node succeeded: it is up."""
        if not self.down:
            return
        self.down = False
        since, retries, failed = self._down_since or (time.monotonic(), 0, 0)
        self._down_since = None
        log.warning("node %s answers again after %.1f s down: %d retries while it was down, "
                    "%d sample(s) failed", self.name, time.monotonic() - since,
                    self.stats.retries - retries, self.stats.failed_samples - failed)

    def does_not_answer(self, error) -> None:
        """Its reads still fail after every retry: it is down."""
        if self.down:
            return
        self.down = True
        self._down_since = (time.monotonic(), self.stats.retries, self.stats.failed_samples)
        if self._io_timeout > 0:
            log.error("node %s does not answer (%s): marked down; reads of its samples wait "
                      "for it up to %g s", self.name, error, self._io_timeout)
        else:
            log.error("node %s marked down after %d retries (%s): its reads fail at once "
                      "until one succeeds", self.name, self._retries, error)


class Tries:
    """A batch's tries on its node: after each, which failed samples are tried again and
    after how long (doubling backoff; while io_timeout has not passed since the first
    failure, the batch waits for the node, down or not; past it, or with io_timeout 0, a
    down node's samples are not tried again)."""

    def __init__(self, retries: int, backoff: float, max_backoff: float, io_timeout: float):
        self.retries, self.backoff, self.max_backoff, self.io_timeout = retries, backoff, max_backoff, io_timeout
        self.attempt = 0
        self.first_failure: float | None = None

    def gives_up(self, failed: list, node_down: bool) -> bool:
        """Whether this try's failures mean the node does not answer (all its reads failed)."""
        return bool(failed) and (self.attempt >= self.retries or node_down)

    def next(self, failed: list, now: float, node_down: bool) -> tuple[list, float]:
        """(the samples to try again, the wait before), and count this try."""
        if failed and self.first_failure is None:
            self.first_failure = now
        patient = bool(failed) and now - self.first_failure < self.io_timeout
        retry = failed if patient or (self.attempt < self.retries and not node_down) else []
        delay = min(self.backoff * 2 ** self.attempt, self.max_backoff)
        if patient:
            delay = max(0.0, min(delay, self.first_failure + self.io_timeout - now))
        self.attempt += 1
        return retry, delay


class Batch:
    """One fetch of one node's samples: each Pending settled exactly once (`finish`), as
    its sample arrives from the worker thread (`on_read`, then `arrived` on the loop: the
    group's samples are handed to `deliver` together) or when the fetch ends (cancelled
    ones with FetchCancelled)."""

    def __init__(self, fetcher: "Fetcher", node: Node, pendings: dict, deliver, push, unpushed):
        self.fetcher, self.node, self.pendings = fetcher, node, pendings
        self.deliver, self.push, self.unpushed = deliver, push, unpushed
        self.from_local: set[int] = set()
        token = trio.lowlevel.current_trio_token()
        if fetcher._inbox is None or fetcher._inbox.token is not token:  # (one per trio run)
            fetcher._inbox = Inbox(token)
        self.inbox = fetcher._inbox

    def finish(self, sid: int, r) -> None:
        self._settle(sid, r)
        self.deliver([(sid, r)])

    def _settle(self, sid: int, r) -> None:
        """Sample sid's fetch is over: its Pending holds r, its readers are woken."""
        p = self.pendings.pop(sid)
        if isinstance(r, Exception):
            p.error = r
            self.node.stats.failed_samples += 1
        else:
            p.data = r
            if sid not in self.from_local:
                self.node.stats.samples += 1
        del self.fetcher.inflight[sid]
        p.set()

    def arrived(self, item) -> None:
        """(The event loop, while the batch goes on.) Samples read: each delivered."""
        got, local, nreads, nbytes = item
        stats = self.node.stats
        # (counted as the samples arrive: a sample served is a read counted)
        stats.reads += nreads
        stats.bytes += nbytes
        if local:
            self.from_local.update(got)
        pendings, settled = self.pendings, []
        for sid, r in got.items():
            if sid in pendings and not isinstance(r, Exception):
                self._settle(sid, r)
                settled.append((sid, r))
        if settled:
            try:  # (an error here would end trio's run; the readers have their bytes)
                self.deliver(settled)
            except Exception:
                log.exception("delivering %d sample(s) on arrival failed", len(settled))

    def on_read(self, got: dict, nreads: int = 0, nbytes: int = 0, local: bool = False) -> None:
        """(The worker thread.) A group of reads is done: its samples to the loop, then
        pushed into the kernel (the loop answers their readers meanwhile from `pushing`)."""
        push, unpushed = self.push, self.unpushed
        todo = [] if push is None else [(sid, r) for sid, r in got.items()
                                        if sid not in unpushed and not isinstance(r, Exception)]
        pushing = self.fetcher.pushing
        pushing.update(todo)  # (before the loop can learn that they arrived)
        self.inbox.post(self.arrived, (got, local, nreads, nbytes))
        if todo:
            try:
                push(todo)
            finally:
                for sid, _ in todo:
                    pushing.pop(sid, None)

    def cancel_rest(self) -> None:
        for sid in list(self.pendings):
            self.finish(sid, FetchCancelled())


class LocalTierReads:
    """The local tier (local.LocalTier) as a place to read from: the samples it holds,
    verified (blocking: worker threads only), handed to on_read at once."""
    local = True  # (its samples are the local tier's: not counted as a node's)

    def __init__(self, tier):
        self.tier = tier

    def read(self, sids: list[int], on_read, waited: bool) -> dict:
        got = self.tier.read_many(sids)
        if got:
            on_read(got, local=True)
        return got


class NodeReads:
    """The storage nodes' chunk files (store.ChunkStore) as a place to read from: every
    sample asked for, its bytes or its error, each group of reads handed to on_read as it
    is done (ChunkStore.read_batch: reads at most max_gap apart joined; waited: a reader
    waits for the first sample, whose read is handed on alone)."""
    local = False

    def __init__(self, store, max_gap: int = MAX_GAP):
        self.store, self.max_gap = store, max_gap

    def read(self, sids: list[int], on_read, waited: bool) -> dict:
        return self.store.read_batch(sids, self.max_gap, on_read, first_alone=waited)[0]


class Fetcher:
    """Batched, deduplicated backend reads with per-node bounds and retries.

    A backend read that fails with an OSError is retried after a backoff (`retries` times,
    doubling from `backoff` seconds, so a sample gives up after about backoff * 2**retries
    seconds); a corrupt sample is not retried (the bytes will not change). Samples that
    arrive are delivered at once, also while others in the batch are still being retried.

    A node whose reads still fail after all retries is marked down (one log line). With
    `io_timeout` (seconds, the default), a read of a sample on a node that does not answer
    waits for it: it is tried again every few seconds (the backoff capped at MAX_BACKOFF)
    until it succeeds or io_timeout has passed since its first failure, and only then gets
    EIO, while the other nodes' reads go on. With io_timeout 0, a down node's requests are
    tried once, without backoff, so its readers fail fast (as an NFS soft mount). The first
    read that succeeds marks the node up again (one log line, with what waited and what
    failed meanwhile), so a node that comes back is used again without a remount.
    """

    def __init__(self, store, config: FetchConfig = DEFAULTS.fetch, *, max_gap: int = MAX_GAP,
                 backoff: float = 0.1, local=None):
        """store: the chunk files; config: requests per node, samples per request,
        retries and io_timeout (config.FetchConfig); local: a LocalTier looked in before
        the backend, or None."""
        per_node = config.per_node
        self.store = store
        # where a batch's samples are read, in turn (as mountpoint-s3 chains its data
        # caches): the local tier if there is one, then the storage nodes
        self.backend = NodeReads(store, max_gap)
        self.tiers = [*([LocalTierReads(local)] if local is not None else []), self.backend]
        # sid -> bytes while a worker thread pushes them. A push waits for the locks of the
        # file's pages, and a reader's read of that file holds one until the loop answers
        # it: the loop answers such a read from here (Reads.fetch), never with a new fetch,
        # which could wait for a thread slot that pushes hold (every slot so held: a stall).
        self.pushing: dict[int, bytes] = {}
        self._inbox: Inbox | None = None
        index = store.index
        self.chunk_node = np.array([c.node for c in index.chunks], dtype=np.int32)
        self._chunk_node_v, self._chunk_v = memoryview(self.chunk_node), index.chunk_v
        self.node_names = list(index.nodes)
        self.per_node = per_node
        # samples per request: `batch`, or as many as make BATCH_BYTES where samples are
        # smaller (tiny samples in batches of 16 paid a thread hand-off and a request's
        # overhead per 16: most of their cost at ImageNet's count, docs/HOTPATH.md)
        mean = index.total_bytes / max(1, index.n_files)
        self.batch = max(config.batch, int(BATCH_BYTES // max(1.0, mean)))
        self.retries = config.retries
        self.backoff = backoff
        self.io_timeout = config.io_timeout
        self.max_backoff = MAX_BACKOFF
        # a node's own slots are per_node; the read-ahead may lend it idle ones of other
        # nodes up to max_per_node (Prefetcher.dispatch)
        self.max_per_node = 2 * per_node
        self.limiters = [trio.CapacityLimiter(self.max_per_node) for _ in self.node_names]
        self.inflight: dict[int, Pending] = {}
        self.nodes = [Node(name, self.retries, self.io_timeout) for name in self.node_names]
        self.request_hist = Histogram()  # a backend request's time (a batch's reads, with its
        # wait for a thread slot)

    def node_of(self, sid: int) -> int:
        return self._chunk_node_v[self._chunk_v[sid]]

    def claim(self, sids: list[int]) -> dict[int, Pending]:
        """Register those of sids no one is fetching as in flight (readers of them then wait
        for this fetch instead of fetching again); their Pendings, for fetch()."""
        new = {s: Pending() for s in sids if s not in self.inflight}
        self.inflight.update(new)
        return new

    async def fetch(self, sids: list[int], deliver, claimed: dict[int, Pending] | None = None,
                    push=None, unpushed=(), waited: bool = False) -> None:
        """Fetch sids (one node) in one batch; deliver([(sid, bytes | Exception)]) for each,
        each sample as soon as its read is done, those of a group of reads together (the
        read of a sample asked for earlier in sids is made earlier). `claimed`: sids already
        claimed (the others are claimed now; any someone else fetches are left out).
        `push([(sid, bytes)])`: called in the worker thread with the samples of each group of
        reads, after the event loop has been handed them (the kernel page cache push,
        KernelView.push), or None. `unpushed`: samples not to push (a set: one a reader
        missed, whose own reads are under way and bring its pages; those the caller keeps
        where its readers' reads are answered). `waited`: a reader waits for the first
        sample of sids (its read is a group of its own)."""
        pendings = dict(claimed or {})
        pendings.update(self.claim(sids))  # (those in claimed are in flight already)
        if not pendings:
            return
        sids = [s for s in sids if s in pendings]
        n = self.node_of(sids[0])
        node, limiter = self.nodes[n], self.limiters[n]
        stats = node.stats
        batch = Batch(self, node, pendings, deliver, push, unpushed)
        tries = Tries(self.retries, self.backoff, self.max_backoff, self.io_timeout)
        node.busy += 1
        try:
            todo = sids
            while todo:
                t0 = trio.current_time()
                try:
                    results, local = await in_thread(batch.inbox, limiter, self._read, todo,
                                                     batch.on_read, waited)
                except Exception as e:  # a bug, not a backend error (read_batch returns those)
                    log.exception("fetch of %d samples from node %s failed", len(todo), node.name)
                    results, local = {s: OSError(errno.EIO, f"internal error: {e}")
                                      for s in todo}, ()
                batch.from_local.update(local)
                backend = len(todo) - len(local)
                if backend:
                    stats.requests += 1
                    self.request_hist.observe(trio.current_time() - t0)
                failed = [s for s in todo if isinstance(results[s], OSError)
                          and not isinstance(results[s], CorruptSample)]
                stats.errors += len(failed)
                if len(failed) < backend:  # the node answered
                    node.answered()
                elif tries.gives_up(failed, node.down):
                    node.does_not_answer(results[failed[0]])
                retry, delay = tries.next(failed, trio.current_time(), node.down)
                for sid in todo:
                    if sid not in retry and sid in pendings:  # (not delivered on arrival)
                        batch.finish(sid, results[sid])
                if retry:
                    stats.retries += len(retry)
                    if not node.down:  # (a node marked down is silent until it answers)
                        log.warning("node %s: %d sample(s) failed (%s), retry %d of %d",
                                    node.name, len(retry), results[retry[0]], tries.attempt,
                                    self.retries)
                    await trio.sleep(delay)
                todo = retry
        finally:  # also when cancelled: waiters must never hang
            node.busy -= 1
            batch.cancel_rest()

    def _read(self, sids: list[int], on_read, waited: bool):
        """(results, sids served by the local tier); blocking. Each tier in turn reads what
        the ones before it did not hold (the last, the nodes, reads all that is left),
        handing each group of reads to on_read as it is done. waited: a reader waits for
        the first sample (its read is handed on alone)."""
        results, local, rest = {}, set(), sids
        for tier in self.tiers:
            if not rest:
                break
            got = tier.read(rest, on_read, waited)
            results.update(got)
            if tier.local:
                local.update(got)
            rest = [s for s in rest if s not in got]
        return results, local

    def is_down(self, node: int) -> bool:
        return self.nodes[node].down

    def counters(self) -> dict:
        total = {f"backend_{k}": sum(getattr(n.stats, k) for n in self.nodes)
                 for k in ("requests", "reads", "bytes", "samples", "errors", "retries")}
        return {**total, "backend_request_seconds": self.request_hist.snapshot(),
                "nodes": {node.name: node.counters() for node in self.nodes}}
