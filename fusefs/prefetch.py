"""Fetching samples from the backend: batched per storage node, deduplicated, read ahead.

The Fetcher runs batches of samples on one node as one blocking call in a worker thread
(the store coalesces samples that are adjacent or near each other in a chunk into one
read, and asks the kernel for all of a batch's reads at once: ChunkStore's willneed).
Each node has its own bound on requests in flight, so one slow node cannot take every
thread. A sample being fetched is registered, and a second reader waits for that
fetch instead of fetching again.

The Prefetcher walks the current plans ahead of the readers: it queues the samples that
are neither cached nor being fetched on the node of their chunk, with their bytes reserved
in the cache, and starts batches of up to k samples per node (see Prefetcher).
"""
from __future__ import annotations

import collections
import errno
import logging
import threading

import numpy as np
import trio

from .config import DEFAULTS
from .store import CorruptSample

log = logging.getLogger("fusefs")


class FetchCancelled(OSError):
    """A fetch stopped before its sample arrived (a shutdown): EIO for its waiters, not a
    backend failure."""

    def __init__(self):
        super().__init__(errno.EIO, "fetch cancelled")


class Pending:
    __slots__ = ("event", "data", "error")

    def __init__(self):
        self.event = trio.Event()
        self.data = None
        self.error = None


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


class Fetcher:
    """Batched, deduplicated backend reads with per-node bounds and retries.

    A backend read that fails with an OSError is retried after a backoff (`retries` times,
    doubling from `backoff` seconds, so a sample gives up after about backoff * 2**retries
    seconds); a corrupt sample is not retried (the bytes will not change). Samples that
    arrive are delivered at once, also while others in the batch are still being retried.

    A node whose reads still fail after all retries is marked down: from then on each
    request to it is tried once, without backoff, so readers of a dead node fail fast
    instead of each waiting out the retry budget. The first read that succeeds marks it
    up again, so a node that comes back is used again without a remount.
    """

    def __init__(self, store, *, per_node: int = DEFAULTS.per_node, batch: int = DEFAULTS.batch,
                 max_gap: int = 256 << 10, retries: int = DEFAULTS.retries, backoff: float = 0.1,
                 local=None, push=None):
        self.store = store
        self.local = local  # a LocalTier looked in before the backend, or None
        # push([(sid, bytes)]), called in the worker thread with the samples of each group
        # of reads, after the event loop has been handed them (the kernel page cache push,
        # Reads.push; None without the kernel page cache)
        self.push = push
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
        self.batch = batch
        self.max_gap = max_gap
        self.retries = retries
        self.backoff = backoff
        # a node's own slots are per_node; the read-ahead may lend it idle ones of other
        # nodes up to max_per_node (Prefetcher.dispatch)
        self.max_per_node = 2 * per_node
        self.limiters = [trio.CapacityLimiter(self.max_per_node) for _ in self.node_names]
        self.inflight: dict[int, Pending] = {}
        self.busy = [0] * len(self.node_names)  # batches started and not finished, per node
        self.node_stats = [dict(requests=0, reads=0, samples=0, bytes=0, errors=0, retries=0,
                                failed_samples=0, down=False) for _ in self.node_names]

    def node_of(self, sid: int) -> int:
        return self._chunk_node_v[self._chunk_v[sid]]

    def claim(self, sids: list[int]) -> dict[int, Pending]:
        """Register those of sids no one is fetching as in flight (readers of them then wait
        for this fetch instead of fetching again); their Pendings, for fetch()."""
        new = {s: Pending() for s in sids if s not in self.inflight}
        self.inflight.update(new)
        return new

    async def fetch(self, sids: list[int], deliver, claimed: dict[int, Pending] | None = None,
                    unpushed: int | None = None) -> None:
        """Fetch sids (one node) in one batch; deliver(sid, bytes | Exception) for each,
        each sample as soon as its read is done (the read of a sample asked for earlier in
        sids is made earlier). `claimed`: sids already claimed (the others are claimed now;
        any someone else fetches are left out). `unpushed`: a sample not to push to the
        kernel (one a reader missed: its own reads are under way and bring its pages)."""
        pendings = dict(claimed or {})
        pendings.update(self.claim(sids))  # (those in claimed are in flight already)
        if not pendings:
            return
        sids = [s for s in sids if s in pendings]
        node = self.node_of(sids[0])
        self.busy[node] += 1
        stats = self.node_stats[node]

        from_local = set()

        def finish(sid, r):
            p = pendings.pop(sid)
            if isinstance(r, Exception):
                p.error = r
                stats["failed_samples"] += 1
            else:
                p.data = r
                if sid not in from_local:
                    stats["samples"] += 1
            del self.inflight[sid]
            p.event.set()
            deliver(sid, r)

        token = trio.lowlevel.current_trio_token()
        if self._inbox is None or self._inbox.token is not token:  # (one per trio run)
            self._inbox = Inbox(token)
        inbox, push = self._inbox, self.push

        def arrived(item) -> None:  # in the trio thread, while the batch goes on
            got, local, nreads, nbytes = item
            # (counted as the samples arrive: a sample served is a read counted)
            stats["reads"] += nreads
            stats["bytes"] += nbytes
            if local:
                from_local.update(got)
            for sid, r in got.items():
                if sid in pendings and not isinstance(r, Exception):
                    try:  # (an error here would end trio's run: leave it to the batch's end)
                        finish(sid, r)
                    except Exception:
                        log.exception("delivering sample %d on arrival failed", sid)

        pushing = self.pushing

        def on_read(got: dict, nreads: int = 0, nbytes: int = 0, local: bool = False) -> None:
            # (in the worker thread)
            todo = [] if push is None else [(sid, r) for sid, r in got.items()
                                            if sid != unpushed and not isinstance(r, Exception)]
            pushing.update(todo)  # (before the loop can learn that they arrived)
            inbox.post(arrived, (got, local, nreads, nbytes))
            if todo:
                try:
                    push(todo)
                finally:
                    for sid, _ in todo:
                        pushing.pop(sid, None)

        try:
            todo, attempt = sids, 0
            while todo:
                try:
                    results, local = await trio.to_thread.run_sync(
                        self._read, todo, on_read, unpushed is not None,
                        limiter=self.limiters[node])
                except Exception as e:  # a bug, not a backend error (read_batch returns those)
                    log.exception("fetch of %d samples from node %s failed", len(todo),
                                  self.node_names[node])
                    results, local = {s: OSError(errno.EIO, f"internal error: {e}")
                                      for s in todo}, ()
                from_local.update(local)
                backend = len(todo) - len(local)
                if backend:
                    stats["requests"] += 1
                failed = [s for s in todo if isinstance(results[s], OSError)
                          and not isinstance(results[s], CorruptSample)]
                stats["errors"] += len(failed)
                if len(failed) < backend:  # the node answered
                    self._set_down(node, False)
                elif failed and (attempt >= self.retries or stats["down"]):
                    self._set_down(node, True, results[failed[0]])
                retry = failed if attempt < self.retries and not stats["down"] else []
                for sid in todo:
                    if sid not in retry and sid in pendings:  # (not delivered on arrival)
                        finish(sid, results[sid])
                if retry:
                    stats["retries"] += len(retry)
                    log.warning("node %s: %d sample(s) failed (%s), retry %d of %d",
                                self.node_names[node], len(retry), results[retry[0]],
                                attempt + 1, self.retries)
                    await trio.sleep(self.backoff * 2 ** attempt)
                todo, attempt = retry, attempt + 1
        finally:  # also when cancelled: waiters must never hang
            self.busy[node] -= 1
            for sid in list(pendings):
                finish(sid, FetchCancelled())

    def _read(self, sids: list[int], on_read, waited: bool):
        """(results, sids served by the local tier); blocking. on_read(results, reads, bytes)
        after each group of backend reads (ChunkStore.read_batch), and once with what the
        local tier held (local=True). waited: a reader waits for the first sample (its
        read is handed on alone)."""
        got = self.local.read_many(sids) if self.local is not None else {}
        if got:
            on_read(got, local=True)
        rest = [s for s in sids if s not in got]
        results = (self.store.read_batch(rest, self.max_gap, on_read, first_alone=waited)[0]
                   if rest else {})
        results.update(got)
        return results, got.keys()

    def _set_down(self, node: int, down: bool, error=None) -> None:
        stats = self.node_stats[node]
        if stats["down"] == down:
            return
        stats["down"] = down
        if down:
            log.error("node %s marked down after %d retries (%s): its reads fail at once "
                      "until one succeeds", self.node_names[node], self.retries, error)
        else:
            log.warning("node %s answers again", self.node_names[node])

    def statistics(self) -> dict:
        return {name: dict(s, inflight=self.busy[i]) for i, (name, s)
                in enumerate(zip(self.node_names, self.node_stats))}


def default_readahead(budget: int, samples: int, mean_size: float) -> int:
    """A sixteenth of the cache budget, at least `samples` (a full batch for every request
    slot of every node) and, up to a quarter of the budget, twice that: the heads move on
    once readers have used half the read-ahead (Prefetcher.low_water), and a refill that
    gives every slot a full batch needs that much room. With one batch's worth, refills
    were half batches: twice the requests, and more readers waiting for them. Past a
    quarter of a small budget the read-ahead's bytes crowd out what the orders need
    again, and samples are fetched twice (docs/HOTPATH.md, "The read-ahead's depth")."""
    one = samples * mean_size
    return int(max(budget / 16, one, min(2 * one, budget / 4)))


class Prefetcher:
    """Keeps the cache filled along the plans. `wake()` after anything that may let it
    start more work (a new order, a use, a finished fetch).

    Work is incremental: each plan has a head, the next order position to look at (past
    the order's end it walks the next epoch's order, if the plan has one), and samples
    between the readers' cursor and the head are cached, in flight or queued. Queued
    samples have their bytes reserved in the cache (evicting only entries needed later)
    and wait in a per-node queue until the node has a free request slot. The head stays
    within `readahead` bytes of the orders past the furthest position a reader has used
    (the plan's frontier), not past the cursor: DataLoader's workers read several batches
    at once (up to 512 positions apart with 4 workers and 2 batches each), and the leading
    one must find its samples read ahead too. The head moves
    on only after a new order, or once readers have used `low_water` bytes since it last
    moved or that much of the budget is free (hysteresis), so each refill is large enough
    to give every node full batches instead of a trickle of one-sample requests.

    A batch reads its samples in the order's order and delivers each as its read is done
    (Fetcher.fetch), so the reader of an order's first sample waits for one read, not k.

    Each node has per_node request slots of its own. A node with queued work may also use
    slots that nodes without queued work leave idle, up to max_per_node (2 x per_node): the
    chunks are rarely spread evenly, and the most loaded node sets an epoch's pace. A node
    that falls behind cannot take the others' own slots: those are theirs whenever they
    have work.
    """

    MAX_BATCH_BYTES = 16 << 20

    def __init__(self, index, policy, cache, fetcher, fetch_batch, readahead: int | None = None,
                 kernel_holds=lambda sid: False):
        """index: sample sizes and chunks; policy: the plans and next-use keys; cache: where
        room is reserved; fetcher: node queues' requests; fetch_batch(sids, reserved,
        claimed=...): runs a batch and delivers its samples (Core.fetch_batch);
        kernel_holds(sid): whether the kernel page cache holds the sample (not read ahead)."""
        self.index, self.policy, self.cache, self.fetcher = index, policy, cache, fetcher
        self.fetch_batch = fetch_batch
        self.kernel_holds = kernel_holds
        self._wake = trio.Event()
        self.nursery = None
        self.batches = 0
        nodes = len(fetcher.node_names)
        self.queues: list[list[int]] = [[] for _ in range(nodes)]
        self.queued: dict[int, int] = {}  # sid -> node, for samples waiting in a queue
        self.running = [0] * nodes        # prefetch batches started and not finished
        self.heads: dict[int, int] = {}   # rank -> next order position to look at
        mean_size = index.total_bytes / max(1, index.n_files)
        # How far ahead of the readers the read-ahead looks, in bytes of the orders: deep
        # enough to keep every request slot busy, shallow enough that the rest of the
        # budget keeps what the orders need again (a read-ahead of W bytes costs about W
        # more backend bytes per epoch than Belady's MIN, which fetches nothing early).
        self.readahead = int(readahead if readahead is not None else default_readahead(
            cache.budget, fetcher.per_node * nodes * fetcher.batch, mean_size))
        refill = fetcher.per_node * nodes * fetcher.batch * mean_size
        self.low_water = int(max(1, min(cache.budget // 4, self.readahead // 2, refill)))
        self._used = 0        # bytes used by readers since the heads last moved
        self._fresh = False   # a new order since the heads last moved

    def wake(self) -> None:
        self._wake.set()

    def used(self, nbytes: int) -> None:
        """A reader used a sample of nbytes: wake once a refill's worth was used."""
        self._used += nbytes
        if self._used >= self.low_water:
            self._wake.set()

    async def run(self, nursery: trio.Nursery, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Plan and dispatch whenever woken; batches run as tasks of `nursery`."""
        self.nursery = nursery
        task_status.started()
        try:
            while True:
                await self._wake.wait()
                self._wake = trio.Event()
                try:
                    self.schedule()
                except Exception:  # never let the read-ahead take the daemon down
                    log.exception("prefetch scheduling failed")
                await trio.sleep(0)  # let wakes pile up: plan once per burst, not per read
        finally:
            self.nursery = None

    def reset(self) -> None:
        """A new order: forget the queued read-ahead of the old one (its reservations too);
        batches already running finish, and what they bring is kept only if still needed."""
        sizes = self.index.size
        for q in self.queues:
            if q:
                self.cache.unreserve(int(sizes[q].sum()))
                q.clear()
        self.queued.clear()
        self.heads.clear()
        self._fresh = True

    def rewind(self) -> None:
        """Walk the plans again from the readers' cursors (what was passed over may need
        fetching now: the kernel dropped pages it was thought to hold)."""
        self.heads.clear()
        self._fresh = True
        self.wake()

    def schedule_now(self) -> None:
        """Plan and dispatch at once (a new order), not at the read-ahead task's next turn."""
        try:
            self.schedule()
        except Exception:  # never let the read-ahead take the daemon down
            log.exception("prefetch scheduling failed")
        self.wake()

    def schedule(self) -> None:
        if self.nursery is None:
            return
        if self._fresh or self._used >= self.low_water or self.cache.free >= self.low_water:
            self._fresh, self._used = False, 0
            self.advance()
        self.dispatch()

    def advance(self) -> None:
        """Move the plans' heads forward (through each order, then its next one), queueing
        what is neither cached nor in flight, until the budget holds nothing needed later
        than the head's sample or every plan is fully covered (round robin over ranks)."""
        cache, inflight, queued = self.cache, self.fetcher.inflight, self.queued
        sizes, node_of, key = self.index.size_v, self.fetcher.node_of, self.policy.key
        kernel_holds = self.kernel_holds
        active = [(rank, plan) for rank, plan in self.policy.plans.items()
                  if self.heads.get(rank, 0) < len(plan.ids) + len(plan.next_ids)]
        while active:
            for item in list(active):
                rank, plan = item
                ids, consumed, n = plan.ids_v, plan.consumed_v, len(plan.ids)
                nxt, end = plan.next_ids_v, n + len(plan.next_ids)
                pos = max(self.heads.get(rank, 0), plan.cursor)
                while pos < end:
                    if pos < n:
                        sid = ids[pos]
                        if consumed[pos]:
                            pos += 1
                            continue
                    else:
                        sid = nxt[pos - n]
                    if sid in cache or sid in inflight or sid in queued or kernel_holds(sid):
                        pos += 1
                        continue
                    break
                self.heads[rank] = pos
                if pos >= end or plan.bytes_between(plan.frontier, pos) > self.readahead:
                    active.remove(item)  # covered, or as far ahead as it may look
                    continue
                if not cache.reserve(sizes[sid], key(sid)):
                    return  # the budget holds nothing needed later than this
                node = node_of(sid)
                self.queues[node].append(sid)
                queued[sid] = node
                self.heads[rank] = pos + 1

    def dispatch(self) -> None:
        """Start queued batches on every node with free slots. A node's queue is spread over
        its slots: a batch takes about len(queue) / slots samples (at most k), so a short
        queue still keeps every slot reading; and when several slots are free at once (an
        order's start), the samples at the queue's head are dealt round robin over the new
        batches, so the i-th queued sample waits for about i / free reads, not i (each
        batch reads its samples one after the other). Queued samples of one chunk that
        follow each other (a chunk-block order) stay together as one run of up to 16 MiB:
        the chunk is then read in one request."""
        batch = self.fetcher.batch
        for node, q in enumerate(self.queues):
            while q:
                slots = self.slots(node)
                free = slots - self.running[node]
                if free <= 0:
                    break
                size = max(1, min(batch, -(-len(q) // slots)))
                runs = self._runs(q, free * size)
                batches = [[] for _ in range(min(free, len(runs)))]
                for i, run in enumerate(runs):
                    batches[i % len(batches)] += run
                del q[:sum(map(len, runs))]
                for b in batches:
                    for sid in b:
                        del self.queued[sid]
                    self.running[node] += 1
                    self.batches += 1
                    # claimed now, not when the task first runs: a reader of one of these
                    # meanwhile waits for this fetch instead of missing
                    claimed = self.fetcher.claim(b)
                    self.nursery.start_soon(self._run_batch, node, b, claimed)

    def _runs(self, q: list[int], want: int) -> list[list[int]]:
        """The head of a queue as runs holding at least want samples in all (at least one
        run): a run is one sample, or queued samples of one chunk that follow each other,
        up to MAX_BATCH_BYTES."""
        chunk, sizes = self.index.chunk_v, self.index.size_v
        runs, i = [], 0
        while i < len(q) and i < want:
            end, nbytes = i + 1, sizes[q[i]]
            while (end < len(q) and chunk[q[end]] == chunk[q[end - 1]]
                   and nbytes + sizes[q[end]] <= self.MAX_BATCH_BYTES):
                nbytes += sizes[q[end]]
                end += 1
            runs.append(q[i:end])
            i = end
        return runs

    def slots(self, node: int) -> int:
        """Batches the node may have running now: its own per_node, plus the own slots
        left idle by nodes with nothing queued (shared among the nodes with work), at
        most max_per_node."""
        fetcher = self.fetcher
        idle = sum(max(0, fetcher.per_node - self.running[n])
                   for n, q in enumerate(self.queues) if not q)
        busy = sum(1 for q in self.queues if q)
        return min(fetcher.max_per_node, fetcher.per_node + idle // max(1, busy))

    def yield_room(self, nbytes: int, key: float) -> int:
        """Take back the reservations of queued samples needed later than key (from each
        node's queue tail, latest first) until nbytes are freed; the heads go back to the
        cursors so those samples are queued again when room allows. Returns bytes freed."""
        sizes, key_of = self.index.size, self.policy.key
        freed = 0
        while freed < nbytes:
            tails = [(key_of(q[-1]), node) for node, q in enumerate(self.queues) if q]
            if not tails:
                break
            latest, node = max(tails)
            if latest <= key:
                break
            sid = self.queues[node].pop()
            del self.queued[sid]
            size = int(sizes[sid])
            self.cache.unreserve(size)
            freed += size
        if freed:
            self.heads.clear()
        return freed

    def take_queued(self, sid: int) -> list[int]:
        """For a reader that missed sid: sid if it is queued, plus samples queued next on
        its node up to a batch, taken out of the queue (their bytes stay reserved)."""
        node = self.queued.get(sid)
        if node is None:
            node = self.fetcher.node_of(sid)
        q = self.queues[node]
        taken = [sid] if sid in self.queued else []
        rest = [s for s in q if s != sid]
        k = self.fetcher.batch - 1
        taken += rest[:k]
        q[:] = rest[k:]
        for s in taken:
            del self.queued[s]
        return taken

    async def _run_batch(self, node: int, batch: list[int], claimed: dict) -> None:
        try:
            await self.fetch_batch(batch, set(batch), claimed=claimed)
        finally:
            self.running[node] -= 1
            self.wake()
