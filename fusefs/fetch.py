"""Fetching samples from the backend on demand: batched per storage node, deduplicated.

The Fetcher only does I/O. It runs batches of samples on one node as one blocking call in a
worker thread (the store coalesces samples that are adjacent or near each other in a chunk into one
read, and asks the kernel for all of a batch's reads at once: ChunkStore's willneed).
Each node has its own bound on requests in flight, so one slow node cannot take every
thread. A sample being fetched is registered, and a second reader waits for that
fetch instead of fetching again. What a batch brings goes, on the loop, to one sink
(arrivals.Arrivals), never back to whoever started the batch: the reads of missed samples
(reads.py) and the read-ahead (prefetch.py) start batches here, and neither is called back.
"""
from __future__ import annotations

import collections
import errno
import logging
import math
import operator
import os
import threading
import time
from dataclasses import asdict, dataclass
from typing import Protocol

import numpy as np
import trio

from . import _plancore
from .config import DEFAULTS, FetchConfig
from .histogram import Histogram
from .store import MAX_GAP, ChunkStore, CorruptSample, ShortRead

log = logging.getLogger("fusefs")

READ_WELL = frozenset((bytes, memoryview))  # what a sample read well is (NodeReads, LocalTierReads)
ITEM_SID, ITEM_RESULT = operator.itemgetter(0), operator.itemgetter(1)  # (of a (sid, result) item)
MAX_BACKOFF = 2.0  # seconds between tries of a read waiting for a node (io_timeout)
BATCH_BYTES = 1 << 20  # a request holds at least --batch samples, and as many as make this
# a read-ahead request holds more: as many samples as make READAHEAD_BYTES, up to READAHEAD_SAMPLES
READAHEAD_SAMPLES, READAHEAD_BYTES = 64, 4 << 20


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


class InFlight:
    """The samples being fetched: claimed by a batch (Fetcher.claim) and not yet settled. A
    byte a sample says which (`flags`: the read-ahead's walk reads them in C, Plan.ahead),
    and a sample a reader on the loop waits for has a Pending (`waiter`), made only then:
    most fetched samples are never waited for on the loop (the fast path parks their reads),
    so a fetch makes no object a sample."""
    __slots__ = ("flags", "_waiters", "_n")

    def __init__(self, n_files: int):
        self.flags = bytearray(n_files)
        self._waiters: dict[int, Pending] = {}
        self._n = 0

    def __contains__(self, sid: int) -> bool:
        return self.flags[sid] != 0

    def __len__(self) -> int:
        return self._n

    def claim(self, sids) -> list[int]:
        """Those of sids not in flight, now in flight (in sids' order, each once; one call
        of C a batch)."""
        new = _plancore.flag(self.flags, sids, 1)
        self._n += len(new)
        return new

    @property
    def waited(self) -> bool:
        """Whether a reader on the loop waits for a sample in flight (read in any thread)."""
        return bool(self._waiters)

    def waiter(self, sid: int) -> Pending | None:
        """What a reader waits on for sample sid's fetch (its bytes or error once settled),
        or None where sid is not in flight."""
        if not self.flags[sid]:
            return None
        p = self._waiters.get(sid)
        if p is None:
            p = self._waiters[sid] = Pending()
        return p

    def settle(self, sid: int, r) -> None:
        """Sample sid's fetch is over with r (its bytes or an Exception): out of flight, its
        waiter (if any) woken."""
        if not self.flags[sid]:
            return
        self.flags[sid] = 0
        self._n -= 1
        p = self._waiters.pop(sid, None) if self._waiters else None
        if p is not None:
            if isinstance(r, Exception):
                p.error = r
            else:
                p.data = r
            p.set()

    def settle_many(self, items) -> None:
        """settle() of each (sid, bytes) of items, all in flight (a group that arrived; their
        flags in one call of C)."""
        self._n -= len(_plancore.flag(self.flags, items, 0))
        if self._waiters:
            pop = self._waiters.pop
            for sid, r in items:
                p = pop(sid, None)
                if p is not None:
                    p.data = r
                    p.set()


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
    """One fetch of one node's samples, without a task of its own: each try runs as one
    call in a worker thread (Fetcher._launch), whose groups of reads (`on_read`, in the
    thread) and outcome (`tried`) reach the loop through the fetcher's inbox. A group that
    no one on the loop waits for (no reader missed one of the batch's samples, none waits
    there for a sample in flight, none to push: the read-ahead's, whose readers the fast path
    answers from the thread) is held (`held`) and reaches the loop with the groups after it,
    at the latest with the try's end: one arrival a try, not one a group (a remote node's
    reads come in groups of 1, 1, 2, 4, ... reads, store.ChunkStore.read_batch). Each of its
    samples (`left` until then) is settled exactly once (`finish`, InFlight.settle), as it
    arrives (`arrived`: the group's samples handed to the sink together) or when the fetch
    ends (cancelled ones with FetchCancelled). A try with failures that are to be tried
    again waits its backoff in a task of the fetcher's nursery, the one case that costs a
    task."""

    __slots__ = ("fetcher", "n", "node", "left", "push", "unpushed", "missed", "readahead",
                 "serve", "served", "hand", "publish", "whole", "from_local", "tries", "over", "inbox",
                 "held")

    def __init__(self, fetcher: "Fetcher", n: int, sids: list[int], push, unpushed, missed,
                 readahead: bool, serve, served, hand=None, publish=None):
        self.fetcher, self.n, self.node, self.left = fetcher, n, fetcher.nodes[n], set(sids)
        self.push, self.unpushed, self.missed, self.readahead = push, unpushed, missed, readahead
        self.serve, self.served, self.hand = serve, served, hand
        # (the node's reads publish to the fast path in C: the capsule and what it holds)
        self.publish = None if publish is None else \
            (publish, np.array(sorted(set(served).intersection(sids)), np.int64))
        # (a read-ahead try with nothing to push reads in one call of C: the fast path answers
        # each sample's readers as its read is checked, so groups would only cost Python)
        self.whole = readahead and self.publish is not None and \
            (push is None or not set(sids).difference(unpushed))
        self.from_local: set[int] = set()
        self.tries = Tries(fetcher.retries, fetcher.backoff, fetcher.max_backoff, fetcher.io_timeout)
        self.over = False  # ended, or given up at the fetcher's end: late posts are ignored
        self.inbox = fetcher.inbox
        self.held = None  # [{sid: bytes}, reads, bytes] of this try's groups not yet posted

    def finish(self, sid: int, r) -> None:
        self._settle(sid, r)
        if isinstance(r, Exception) and not isinstance(r, (CorruptSample, FetchCancelled)) \
                and not self.node.down:
            self.fetcher.log_failed(sid, r)
        self._hand_over([(sid, r)])

    def _hand_over(self, items) -> None:
        try:  # (an error here would end trio's run; the readers have their bytes)
            self.fetcher.sink.arrived(items, self.missed, self.served)
        except Exception:
            log.exception("delivering %d sample(s) on arrival failed", len(items))

    def _settle(self, sid: int, r) -> None:
        """Sample sid's fetch is over: its readers on the loop have r."""
        self.left.discard(sid)
        if isinstance(r, Exception):
            self.node.stats.failed_samples += 1
        elif sid not in self.from_local:
            self.node.stats.samples += 1
        self.fetcher.inflight.settle(sid, r)

    def arrived(self, item) -> None:
        """(The event loop, while the batch goes on.) Samples read: each delivered."""
        if self.over:
            return
        got, local, nreads, nbytes = item
        stats = self.node.stats
        # (counted as the samples arrive: a sample served is a read counted)
        stats.reads += nreads
        stats.bytes += nbytes
        if local:
            self.from_local.update(got)
        left = self.left
        if left.issuperset(got) and set(map(type, got.values())) <= READ_WELL:  # (no error: C only)
            settled = list(got.items())
        else:
            settled = [item for item in got.items() if item[0] in left and not isinstance(item[1], Exception)]
        if settled:
            if len(settled) == len(left):
                left.clear()
            else:
                left.difference_update(map(ITEM_SID, settled))
            self.fetcher.inflight.settle_many(settled)
            from_local = self.from_local
            if not from_local:
                stats.samples += len(settled)
            elif not local:
                stats.samples += sum(1 for sid, _ in settled if sid not in from_local)
            self._hand_over(settled)

    def on_read(self, got: dict, nreads: int = 0, nbytes: int = 0, local: bool = False,
                published: bool = False) -> None:
        """(The worker thread.) A group of reads is done: its samples to the fast path
        (unless the reads published them there in C: `published`), to the loop, and those
        to push pushed into the kernel (holders.Holders.push, which holds them where the
        loop answers their readers until the push is done)."""
        push, unpushed, served = self.push, self.unpushed, self.served
        if served and not published:  # (the fast path answers them from now on: before the loop has them)
            early = [(sid, r) for sid, r in got.items() if sid in served and not isinstance(r, Exception)]
            if early:
                self.serve(early)
        if self.hand is not None and not published:  # (the reads that wait for any of them: answered now)
            self.hand(got.items())
        todo = [] if push is None else [(sid, r) for sid, r in got.items()
                                        if sid not in unpushed and not isinstance(r, Exception)]
        if not (todo or local or self.missed or self.fetcher.waits()):
            held = self.held
            if held is None:
                self.held = [dict(got), nreads, nbytes]
            else:
                held[0].update(got)
                held[1] += nreads
                held[2] += nbytes
            return
        self.post_held()
        if todo:
            push(todo, lambda: self.inbox.post(self.arrived, (got, local, nreads, nbytes)))
        else:
            self.inbox.post(self.arrived, (got, local, nreads, nbytes))

    def post_held(self) -> None:
        """(The worker thread.) The groups held so far to the loop, as one."""
        held = self.held
        if held is not None:
            self.held = None
            self.inbox.post(self.arrived, (held[0], False, held[1], held[2]))

    def tried(self, item) -> None:
        """(The event loop.) A try's worker thread is done: its results counted, the samples
        not to be tried again finished, and the batch ended or its retry waited for."""
        todo, t0, outcome = item
        fetcher, node = self.fetcher, self.node
        fetcher.thread_done(self.n)
        try:
            results, local = outcome.unwrap()
        except Exception as e:  # a bug, not a backend error (read_batch returns those)
            log.exception("fetch of %d samples from node %s failed", len(todo), node.name,
                          exc_info=e)
            results, local = {s: OSError(errno.EIO, f"internal error: {e}") for s in todo}, ()
        stats = node.stats
        self.from_local.update(local)
        backend = len(todo) - len(local)
        now = trio.current_time()
        if backend:
            stats.requests += 1
            fetcher.request_hist.observe(now - t0)
        # (a wrong or short sample is the file's answer, not the node's silence: an EIO now)
        # (none failed where every one was delivered on arrival, unless the batch ended: its
        # try's failures are still counted)
        failed = [s for s in todo if isinstance(results[s], OSError)
                  and not isinstance(results[s], (CorruptSample, ShortRead))] \
            if self.left or self.over else []
        stats.errors += len(failed)
        tries = self.tries
        if len(failed) < backend:  # the node answered
            node.answered()
        elif tries.gives_up(failed, node.down):
            node.does_not_answer(results[failed[0]])
        if self.over:  # (ended at the fetcher's end: what the try found is counted only)
            return
        retry, delay = tries.next(failed, now, node.down)
        left = self.left
        if left:
            for sid in todo:
                if sid in left and sid not in retry:  # (not delivered on arrival)
                    self.finish(sid, results[sid])
        if not retry:
            self.end()
            return
        stats.retries += len(retry)
        if not node.down:  # (a node marked down is silent until it answers)
            log.warning("node %s: %d sample(s) failed (%s), retry %d of %d",
                        node.name, len(retry), results[retry[0]], tries.attempt, fetcher.retries)
        fetcher.nursery.start_soon(self._retry, retry, delay)

    async def _retry(self, retry: list[int], delay: float) -> None:
        await trio.sleep(delay)
        if not self.over:
            self.fetcher._launch(self, retry)

    def end(self) -> None:
        """The batch is over: what is left unsettled gets FetchCancelled (a shutdown)."""
        if self.over:
            return
        self.over = True
        self.node.busy -= 1
        for sid in list(self.left):
            self.finish(sid, FetchCancelled())
        self.fetcher.ended(self)


class LocalTierReads:
    """The local tier (local.LocalTier) as a place to read from: the samples it holds,
    verified (blocking: worker threads only), handed to on_read at once."""
    local = True  # (its samples are the local tier's: not counted as a node's)

    def __init__(self, tier):
        self.tier = tier

    def read(self, sids: list[int], on_read, waited: bool, publish=None, whole: bool = False) -> dict:
        got = self.tier.read_many(sids)
        if got:
            on_read(got, local=True)
        return got


class NodeReads:
    """The storage nodes' chunk files (store.ChunkStore) as a place to read from: every
    sample asked for, its bytes or its error, each group of reads handed to on_read as it
    is done (ChunkStore.read_batch: reads at most max_gap apart joined; waited: a reader
    waits for the first sample, whose read is handed on alone; publish: Batch.publish, the
    fast path the compiled reads publish each sample to; whole: Batch.whole, every read in
    one group)."""
    local = False

    def __init__(self, store, max_gap: int = MAX_GAP):
        self.store, self.max_gap = store, max_gap

    def read(self, sids: list[int], on_read, waited: bool, publish=None, whole: bool = False) -> dict:
        kw = {"group_s": math.inf} if whole else {}
        return self.store.read_batch(sids, self.max_gap, on_read, first_alone=waited, publish=publish,
                                     **kw)[0]


class Sink(Protocol):
    """What a fetch's results go to, on the loop (arrivals.Arrivals)."""

    def arrived(self, items: list, missed, served) -> None:
        """A group of a batch's samples, [(sid, bytes | Exception)]; missed: those of them
        readers missed and wait for (a set); served: those the fast path was handed early."""

    def ended(self, node: int, readahead: bool) -> None:
        """A batch on node ended (readahead: one of the read-ahead's)."""

    def waits(self) -> bool:
        """(Any thread.) Whether a reader waits for a sample's arrival here (then the fetch
        threads hand each group on as it is read, not with the groups after it)."""


class Placement:
    """Which storage node holds each sample: its chunk's (the index's chunks' nodes)."""

    def __init__(self, index):
        self.chunk_node = np.array([c.node for c in index.chunks], dtype=np.int32)
        self._chunk_node_v, self._chunk_v = memoryview(self.chunk_node), index.chunk_v
        self.names = list(index.nodes)

    def node_of(self, sid: int) -> int:
        return self._chunk_node_v[self._chunk_v[sid]]


def batch_size(config: FetchConfig, index, readahead: bool = False) -> int:
    """Samples per request: config's `batch`, or as many as make BATCH_BYTES where samples
    are smaller (tiny samples in batches of 16 paid a thread hand-off and a request's
    overhead per 16: most of their cost at ImageNet's count, docs/HOTPATH.md). A read-ahead
    request (readahead) holds up to READAHEAD_SAMPLES while they make at most
    READAHEAD_BYTES: each request costs the loop about 160 us (docs/HOTPATH.md,
    "Fetching"), so 16 samples of 110 KB paid 10 us a sample for it. The misses' requests
    (the fetcher's own batch) keep the smaller size: a scan's companions are fetched on a
    guess (reading at random, a miss next to one read lately looks like a scan)."""
    mean = max(1.0, index.total_bytes / max(1, index.n_files))
    n = max(config.batch, int(BATCH_BYTES // mean))
    return max(n, min(READAHEAD_SAMPLES, int(READAHEAD_BYTES // mean))) if readahead else n


def max_per_node(config: FetchConfig) -> int:
    """Requests a node may have in flight: its own per_node, and as many again lent by
    nodes that leave theirs idle (prefetch.ReadAheadPlan.slots)."""
    return 2 * config.per_node


class Fetcher:
    """Batched, deduplicated backend reads with per-node bounds and retries: it does the
    I/O and nothing else. A batch (`submit`, on the loop, no task: a task and its thread
    hand-off cost the loop about 70 us a batch, a thread call alone 14) runs in worker
    threads; its samples' results are handed to `sink` (arrivals.Arrivals) on the loop as
    they arrive (or, where no reader waits on the loop for them, with the try's end:
    Batch.post_held), and its end too. The samples being fetched (`inflight`, an InFlight) are
    the fetcher's: a second reader waits for that fetch instead of fetching again.

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

    def __init__(self, store: ChunkStore, config: FetchConfig = DEFAULTS.fetch, *, sink: Sink,
                 placement: Placement,
                 inflight: InFlight | None = None, max_gap: int = MAX_GAP, backoff: float = 0.1, local=None):
        """store: the chunk files; config: requests per node, samples per request,
        retries and io_timeout (config.FetchConfig); sink: told on the loop of the samples
        that arrive, arrived([(sid, bytes | Exception)], missed, served), and of each batch's end,
        ended(node, readahead) (arrivals.Arrivals); placement: each sample's node;
        inflight: the samples being fetched (InFlight; shared with the read-ahead's plan,
        which reads its flags); local: a LocalTier looked in before the backend, or None."""
        per_node = config.per_node
        self.store, self.sink, self.placement = store, sink, placement
        # where a batch's samples are read, in turn (as mountpoint-s3 chains its data
        # caches): the local tier if there is one, then the storage nodes
        self.backend = NodeReads(store, max_gap)
        self.tiers = [*([LocalTierReads(local)] if local is not None else []), self.backend]
        self.inbox: Inbox | None = None  # (run's: one per trio run)
        self.nursery = None              # (run's: where retries wait)
        self.chunk_node = placement.chunk_node
        self.node_of = placement.node_of
        self.node_names = placement.names
        self.per_node = per_node
        self.batch = batch_size(config, store.index)  # (the misses' batches)
        self.retries = config.retries
        self.backoff = backoff
        self.io_timeout = config.io_timeout
        self.max_backoff = MAX_BACKOFF
        # a node's own slots are per_node; the read-ahead may lend it idle ones of other
        # nodes up to max_per_node (Prefetcher.dispatch)
        self.max_per_node = max_per_node(config)
        nodes = len(self.node_names)
        self.threads = [0] * nodes        # worker threads reading for the node now
        self.waiting = [collections.deque() for _ in range(nodes)]  # tries waiting for one
        self.readahead_running = [0] * nodes  # the read-ahead's batches not yet ended
        self._threads = 0                 # all nodes' together
        self._batches: set[Batch] = set()  # not yet ended
        self._no_threads: trio.Event | None = None
        self.inflight = InFlight(store.index.n_files) if inflight is None else inflight
        self.nodes = [Node(name, self.retries, self.io_timeout) for name in self.node_names]
        self.request_hist = Histogram()  # a backend request's time (a batch's reads, with its
        # wait for a thread slot)

    async def run(self, nursery, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Fetch until cancelled (a task of the core's nursery; retries wait in nursery).
        When cancelled, every batch not yet ended ends (its readers get EIO), and run returns
        once every worker thread is done (none pushes into a closed session)."""
        self.inbox, self.nursery = Inbox(trio.lowlevel.current_trio_token()), nursery
        task_status.started()
        try:
            await trio.sleep_forever()
        finally:
            for q in self.waiting:
                q.clear()
            for b in list(self._batches):
                b.end()
            with trio.CancelScope(shield=True):
                while self._threads:
                    self._no_threads = trio.Event()
                    await self._no_threads.wait()
            self.inbox = self.nursery = None  # (a submit from now on is refused)

    def claim(self, sids: list[int]) -> list[int]:
        """Register those of sids no one is fetching as in flight (readers of them then wait
        for this fetch instead of fetching again): those, for submit()."""
        return self.inflight.claim(sids)

    def submit(self, sids: list[int], claimed: list[int] | None = None, *, push=None,
               unpushed=(), missed=(), serve=None, served=(), expect=None, hand=None,
               publish=None, readahead: bool = False) -> bool:
        """Fetch sids (one node) in one batch, on the loop, without waiting: each sample is
        handed to the sink as soon as its read is done (where a reader waits on the loop;
        else with the try's end: Batch.post_held), those of a group of reads together
        (the read of a sample asked for earlier in sids is made earlier). `claimed`: those of
        sids already claimed for this batch (claim; the others are claimed now; any someone
        else fetches are left out). `push([(sid, bytes)], announce)`: called in the worker thread with the samples
        of each group of reads, to hand them to the loop (announce) and push them (the kernel page cache
        push, holders.Holders.push), or None. `unpushed`: samples not to push. `missed`: the
        samples readers missed and wait for (a set, first in sids: the first is read in a
        group of its own).
        `serve([(sid, bytes)])`: called in the worker thread with the samples of `served`
        of each group (holders.Holders.serve_early: the fast path answers them before the
        loop has them), or None. `expect(sids)`: told, before the thread starts, of the
        samples of `served` this batch fetches (holders.Holders.expect: the fast path keeps
        their reads waiting for serve), or None. `hand([(sid, bytes | Exception)])`: called in
        the worker thread with each group's results (holders.Holders.hand_many: the reads of
        missed samples that wait in the fast path are answered), or None. `publish`: the fast
        path's capsule (pyfuse3.fast_path_publish_api), or None: where given, the node's
        compiled reads do serve's and hand's work in C as each read is checked (those of
        `served` held, the others handed over; a read-ahead batch with nothing to push then
        reads in one group, Batch.whole), and serve and hand are left to the groups read
        otherwise (the local tier's, the Python reads). `readahead`: a batch of the read-ahead
        (counted in readahead_running until it ends). Whether a batch was started (not if
        every sample is fetched already)."""
        if self.inbox is None:
            raise RuntimeError("a fetch before Fetcher.run: start the core's tasks first")
        if not claimed:
            sids = self.claim(sids)
        elif len(claimed) != len(sids):  # (else claimed are sids)
            mine = set(claimed).union(self.claim(sids))  # (claimed are in flight already)
            sids = [s for s in sids if s in mine]
        if not sids:
            return False
        if expect is not None and served:
            expected = set(served).intersection(sids)
            if expected:
                expect(list(expected))
        n = self.node_of(sids[0])
        b = Batch(self, n, sids, push, unpushed, missed, readahead, serve, served, hand, publish)
        b.node.busy += 1
        if readahead:
            self.readahead_running[n] += 1
        self._batches.add(b)
        self._launch(b, sids)
        return True

    def abandon(self, claimed: list[int], error: Exception) -> None:
        """Claims that no batch will fetch (submit refused them): out of flight, and their
        readers woken with an EIO that says why."""
        error = OSError(errno.EIO, f"not fetched: {error}")
        for sid in claimed:
            self.inflight.settle(sid, error)

    def _launch(self, b: Batch, todo: list[int]) -> None:
        """A try of batch b's samples todo in a worker thread, or queued until the node has
        one of its max_per_node free."""
        t0 = trio.current_time()
        if self.threads[b.n] >= self.max_per_node:
            self.waiting[b.n].append((b, todo, t0))
            return
        self._start(b, todo, t0)

    def _start(self, b: Batch, todo: list[int], t0: float) -> None:
        self.threads[b.n] += 1
        self._threads += 1
        waited, post, tried = bool(b.missed), self.inbox.post, b.tried

        def done(outcome):  # (the worker thread: its groups held, then its end)
            b.post_held()
            post(tried, (todo, t0, outcome))
        trio.lowlevel.start_thread_soon(lambda: self._read(todo, b.on_read, waited, b.publish, b.whole),
                                        done)

    def thread_done(self, n: int) -> None:
        """(The loop.) A worker thread of node n is done: a try waiting for one starts."""
        self.threads[n] -= 1
        self._threads -= 1
        q = self.waiting[n]
        while q:
            b, todo, t0 = q.popleft()
            if not b.over:
                self._start(b, todo, t0)
                break
        if not self._threads and self._no_threads is not None:
            self._no_threads.set()

    def ended(self, b: Batch) -> None:
        self._batches.discard(b)
        if b.readahead:
            self.readahead_running[b.n] -= 1
        try:
            self.sink.ended(b.n, b.readahead)
        except Exception:
            log.exception("ending a batch failed")

    def log_failed(self, sid: int, error) -> None:
        """One line for a sample whose read failed on a node that is up (a node that is
        down: its failed samples are counted, and told in one line when it answers again:
        Node.answered)."""
        index = self.store.index
        log.error("EIO: node %s: %s: sample %s: backend read failed: %s",
                  self.node_names[self.node_of(sid)], self.store.chunk_path(int(index.chunk[sid])),
                  os.fsdecode(index.file_path(sid)), error)

    def _read(self, sids: list[int], on_read, waited: bool, publish=None, whole: bool = False):
        """(results, sids served by the local tier); blocking. Each tier in turn reads what
        the ones before it did not hold (the last, the nodes, reads all that is left),
        handing each group of reads to on_read as it is done. waited: a reader waits for
        the first sample (its read is handed on alone); publish, whole: Batch's."""
        results, local, rest = {}, set(), sids
        for tier in self.tiers:
            if not rest:
                break
            got = tier.read(rest, on_read, waited, publish, whole)
            if not tier.local:  # (the nodes, the last: they read every one)
                if not results:
                    return got, local
                results.update(got)
                break
            results.update(got)
            local.update(got)
            rest = [s for s in rest if s not in got]
        return results, local

    def waits(self) -> bool:
        """(Any thread.) Whether a reader waits on the loop for a sample being fetched (its
        Pending) or for its arrival (the sink's)."""
        return self.inflight.waited or self.sink.waits()

    def is_down(self, node: int) -> bool:
        return self.nodes[node].down

    def counters(self) -> dict:
        total = {f"backend_{k}": sum(getattr(n.stats, k) for n in self.nodes)
                 for k in ("requests", "reads", "bytes", "samples", "errors", "retries")}
        return {**total, "backend_request_seconds": self.request_hist.snapshot(),
                "nodes": {node.name: node.counters() for node in self.nodes}}
