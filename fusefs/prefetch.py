"""Reading ahead along the plans: the Prefetcher walks the current plans ahead of the
readers, queues the samples that are neither cached nor being fetched on the node of their
chunk, with their bytes reserved in the cache, and starts batches of up to k samples per
node through the Fetcher (fetch.py).
"""
from __future__ import annotations

import logging
from collections import OrderedDict

import trio

from .store import MAX_READ

log = logging.getLogger("fusefs")

# The read-ahead looks at most this many order positions in one turn of the event loop (a new
# order's plan of tens of thousands of tiny samples would hold the loop for tens of ms):
# it goes on at its task's next turn, and the loop answers requests in between.
ADVANCE_STEP = 512


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

    MAX_BATCH_BYTES = MAX_READ  # a run of one chunk's queued samples is read in one request

    def __init__(self, index, policy, cache, fetcher, fetch_batch, readahead: int | None = None,
                 kernel_holds=lambda sid: False):
        """index: sample sizes and chunks; policy: the plans and next-use keys; cache: where
        room is reserved; fetcher: node queues' requests; fetch_batch(sids,
        claimed=...): runs a batch and delivers its samples (Reads.fetch_batch);
        kernel_holds(sid): whether the kernel page cache holds the sample (not read ahead)."""
        self.index, self.policy, self.cache, self.fetcher = index, policy, cache, fetcher
        self.fetch_batch = fetch_batch
        self.kernel_holds = kernel_holds
        self._wake = trio.Event()
        self.nursery = None
        self.batches = 0
        nodes = len(fetcher.node_names)
        # per node, the samples waiting for a request slot, in the order they are needed
        # (ordered: taking one out of the middle, for a reader that missed it, is O(1))
        self.queues: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(nodes)]
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
        self._advancing = False  # the heads stopped after ADVANCE_STEP positions: go on

    def counters(self) -> dict:
        return {"prefetch_batches": self.batches, "readahead_bytes": self.readahead}

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
        settle = self.cache.settle
        for q in self.queues:
            for sid in q:
                settle(sid)
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
        if self._advancing or self._fresh or self._used >= self.low_water or self.cache.free >= self.low_water:
            self._fresh, self._used = False, 0
            self._advancing = self.advance(ADVANCE_STEP)
            if self._advancing:  # (the rest at the task's next turn: the loop serves meanwhile)
                self._wake.set()
        self.dispatch()

    def advance(self, step: int | None = None) -> bool:
        """Move the plans' heads forward (through each order, then its next one), queueing
        what is neither cached nor in flight, until the budget holds nothing needed later
        than the head's sample or every plan is fully covered (round robin over ranks), or
        `step` positions were looked at: then True (the heads keep where they got to)."""
        cache, inflight, queued = self.cache, self.fetcher.inflight, self.queued
        sizes, node_of, key = self.index.size_v, self.fetcher.node_of, self.policy.key
        kernel_holds = self.kernel_holds
        looked = 0  # positions looked at
        active = [(rank, plan) for rank, plan in self.policy.plans.items()
                  if self.heads.get(rank, 0) < len(plan.ids) + len(plan.next_ids)]
        while active:
            for item in list(active):
                rank, plan = item
                ids, consumed, n = plan.ids_v, plan.consumed_v, len(plan.ids)
                nxt, end = plan.next_ids_v, n + len(plan.next_ids)
                pos = max(self.heads.get(rank, 0), plan.cursor)
                start = pos
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
                if not cache.reserve(sid, sizes[sid], key(sid)):
                    return False  # the budget holds nothing needed later than this
                node = node_of(sid)
                self.queues[node][sid] = None
                queued[sid] = node
                self.heads[rank] = pos + 1
                looked += pos + 1 - start
                if step is not None and looked >= step:
                    return True
        return False

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
                for b in batches:
                    for sid in b:
                        del q[sid]
                        del self.queued[sid]
                    self.running[node] += 1
                    self.batches += 1
                    # claimed now, not when the task first runs: a reader of one of these
                    # meanwhile waits for this fetch instead of missing
                    claimed = self.fetcher.claim(b)
                    self.nursery.start_soon(self._run_batch, node, b, claimed)

    def _runs(self, q: OrderedDict, want: int) -> list[list[int]]:
        """The head of a queue as runs holding at least want samples in all (at least one
        run): a run is one sample, or queued samples of one chunk that follow each other,
        up to MAX_BATCH_BYTES. Looks at the runs' samples and one more."""
        chunk, sizes = self.index.chunk_v, self.index.size_v
        runs, run, taken, nbytes = [], [], 0, 0
        for sid in q:
            if run and (chunk[sid] != chunk[run[-1]] or nbytes + sizes[sid] > self.MAX_BATCH_BYTES):
                runs.append(run)
                taken += len(run)
                run, nbytes = [], 0
                if taken >= want:
                    return runs
            run.append(sid)
            nbytes += sizes[sid]
        if run:
            runs.append(run)
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
        key_of = self.policy.key
        freed = 0
        while freed < nbytes:
            tails = [(key_of(next(reversed(q))), node) for node, q in enumerate(self.queues) if q]
            if not tails:
                break
            latest, node = max(tails)
            if latest <= key:
                break
            sid = self.queues[node].popitem()[0]
            del self.queued[sid]
            freed += self.cache.settle(sid)
        if freed:
            self.heads.clear()
        return freed

    def take_queued(self, sid: int) -> list[int]:
        """For a reader that missed sid: sid if it is queued, plus samples queued next on
        its node up to a batch, taken out of the queue (their bytes stay reserved). O(batch),
        whatever the queue's length."""
        node = self.queued.pop(sid, None)
        taken = []
        if node is not None:
            del self.queues[node][sid]
            taken.append(sid)
        else:
            node = self.fetcher.node_of(sid)
        q, queued = self.queues[node], self.queued
        for _ in range(min(self.fetcher.batch - 1, len(q))):
            s = q.popitem(last=False)[0]
            del queued[s]
            taken.append(s)
        return taken

    async def _run_batch(self, node: int, batch: list[int], claimed: dict) -> None:
        try:
            await self.fetch_batch(batch, claimed=claimed)
        finally:
            self.running[node] -= 1
            self.wake()
