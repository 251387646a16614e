"""Reading ahead along the plans: the plan (ReadAheadPlan, pure: no I/O, no threads, no trio)
walks the current plans ahead of the readers and queues the samples that are neither held
nor being fetched on the node of their chunk, with their bytes reserved in the cache, and
hands out batches of up to k samples per node; `Wake`, what the read-ahead's task waits on.
The task that runs the plan and submits its batches is prefetcher.Prefetcher.
"""
from __future__ import annotations

import numpy as np
import trio

from ._plancore import Queues
from .plan import AHEAD_BOUND
from .store import MAX_READ

# The read-ahead looks at most this many order positions in one turn of the event loop (a new
# order's plan of tens of thousands of tiny samples would hold the loop for tens of ms):
# it goes on at its task's next turn, and the loop answers requests in between.
ADVANCE_STEP = 512
# ... in rounds that take up to this many samples to queue from each plan, their room
# reserved in one call of the cache (and their keys computed in one numpy pass)
ADVANCE_RUN = 64


def default_readahead(budget: int, samples: int, mean_size: float) -> int:
    """A sixteenth of the cache budget, at least `samples` (a full batch for every request
    slot of every node) and, up to a quarter of the budget, twice that: the heads move on
    once readers have used half the read-ahead (Prefetcher.low_water), and a refill that
    gives every slot a full batch needs that much room. With one batch's worth, refills
    were half batches: twice the requests, and more readers waiting for them. Past a
    quarter of a small budget the read-ahead's bytes crowd out what the orders need
    again, and samples are fetched twice (docs/HOTPATH.md, "The read-ahead's depth").
    Never past the budget itself: a batch per slot can exceed a small cache, and a
    read-ahead that deep reserves every free byte, so a sample a reader missed finds no room
    to be kept for its next use (an echo's, say) and is fetched again."""
    one = samples * mean_size
    return int(min(budget, max(budget / 16, one, min(2 * one, budget / 4))))


class ReadAheadPlan:
    """What to read ahead, and when: pure (no I/O, no threads, no trio; tested as such).
    From the plans (policy), what is held already (the cache, or the kernel: kernel_held), reserved
    (cache) or in flight (inflight), and the budget, it queues the samples to fetch per
    node, each with its room reserved in the cache, and hands out the batches to start.

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

    Each node has per_node request slots of its own. A node with queued work may also use
    slots that nodes without queued work leave idle, up to max_per_node (2 x per_node): the
    chunks are rarely spread evenly, and the most loaded node sets an epoch's pace. A node
    that falls behind cannot take the others' own slots: those are theirs whenever they
    have work.
    """

    MAX_BATCH_BYTES = MAX_READ  # a run of one chunk's queued samples is read in one request

    def __init__(self, index, policy, cache, *, nodes: int, chunk_node, inflight, per_node: int,
                 max_per_node: int, batch: int, readahead: int | None = None,
                 kernel_held=None):
        """index: sample sizes and chunks; policy: the plans and next-use keys; cache: where
        room is reserved; nodes, chunk_node: the storage nodes, each chunk's (an int32 array:
        fetch.Placement's); inflight: the
        samples being fetched (fetch.InFlight: its flags); per_node, max_per_node, batch: request slots and
        samples per request (fetch.Fetcher's); readahead: bytes ahead of the readers (None:
        default_readahead); kernel_held: a flag a sample, whether the kernel page cache
        holds it (kernel_view.KernelView.held; None: nothing): a sample the cache or the
        kernel holds is not read ahead."""
        self.index, self.policy, self.cache = index, policy, cache
        self.inflight = inflight
        self.kernel_held = kernel_held
        self.nodes, self.per_node, self.max_per_node, self.batch = nodes, per_node, max_per_node, batch
        chunk_node = np.ascontiguousarray(chunk_node, np.int32)
        self._chunk_node_v = memoryview(chunk_node)
        # per node, the samples waiting for a request slot, in the order they are needed
        # (fusefs._plancore.Queues: taking one out of the middle, for a reader that missed
        # it, is O(1); a batch is dealt in one call), with a flag a sample
        queued_flags = bytearray(index.n_files)
        self.queued = Queues(queued_flags, index.chunk, chunk_node, index.size, nodes)
        # what the walk passes over: the cached samples, and those flagged queued, in flight
        # or held by the kernel
        self._skip = (cache,)
        self._flags = (queued_flags, inflight.flags) + ((kernel_held,) if kernel_held is not None else ())
        self.heads: dict[int, int] = {}   # rank -> next order position to look at
        mean_size = index.total_bytes / max(1, index.n_files)
        # How far ahead of the readers the read-ahead looks, in bytes of the orders: deep
        # enough to keep every request slot busy, shallow enough that the rest of the
        # budget keeps what the orders need again (a read-ahead of W bytes costs about W
        # more backend bytes per epoch than Belady's MIN, which fetches nothing early).
        self.readahead = int(readahead if readahead is not None else default_readahead(
            cache.budget, per_node * nodes * batch, mean_size))
        refill = per_node * nodes * batch * mean_size
        self.low_water = int(max(1, min(cache.budget // 4, self.readahead // 2, refill)))
        self._used = 0          # bytes used by readers since the heads last moved
        self.fresh = False      # a new order since the heads last moved
        self.advancing = False  # the heads stopped after ADVANCE_STEP positions: go on
        # every plan covered to its end by the last advance: the readers' progress gives
        # the read-ahead nothing to fetch until a new order (or a rewind)
        self.idle = False

    def reset(self) -> None:
        """A new order: forget the queued read-ahead of the old one (its reservations too);
        batches already running finish, and what they bring is kept only if still needed."""
        settle, queued = self.cache.settle, self.queued
        for node, n in enumerate(queued.lengths()):
            for sid in queued.take(node, n, False):
                settle(sid)
        self.heads.clear()
        self.fresh, self.idle = True, False

    def rewind(self) -> None:
        """Walk the plans again from the readers' cursors (what was passed over may need
        fetching now: the kernel dropped pages it was thought to hold)."""
        self.heads.clear()
        self.fresh, self.idle = True, False

    def used(self, nbytes: int) -> bool:
        """A reader used a sample of nbytes: whether a refill's worth was used since the
        heads last moved (then the plan should move on)."""
        self._used += nbytes
        return self._used >= self.low_water

    def due(self) -> bool:
        """Whether the heads should move on now: a new order, an advance that stopped at
        its step, a refill's worth used or free."""
        return self.advancing or self.fresh or self._used >= self.low_water or self.cache.free >= self.low_water

    def step(self) -> bool:
        """Move the heads on by at most ADVANCE_STEP positions (see advance); True: more
        is left for the next turn."""
        self.fresh, self._used = False, 0
        self.advancing = self.advance(ADVANCE_STEP)
        return self.advancing

    def advance(self, step: int | None = None) -> bool:
        """Move the plans' heads forward (through each order, then its next one), queueing
        what is neither cached nor in flight, until the budget holds nothing needed later
        than the head's sample or every plan is fully covered (round robin over ranks), or
        `step` positions were looked at: then True (the heads keep where they got to).
        Sets `idle`: whether every plan is covered to its end. Each round takes a run of up
        to ADVANCE_RUN samples from each plan (Plan.ahead: one call of C a run, which passes
        over what is consumed, in flight, queued, cached or the kernel's), interleaved, and
        reserves their room in one call (SampleCache.reserve_many), their keys from one call
        (Policy.keys_of)."""
        heads, readahead, skip, flags = self.heads, self.readahead, self._skip, self._flags
        looked = 0  # positions looked at
        self.idle = bounded = False  # (bounded: a plan stopped short of its end)
        active = [(rank, plan) for rank, plan in self.policy.plans.items()
                  if heads.get(rank, 0) < len(plan.ids) + len(plan.next_ids)]
        while active:
            runs = []  # (rank, sids, positions) of this round
            for item in list(active):
                rank, plan = item
                sids, positions, heads[rank], seen, stop = plan.ahead(
                    max(heads.get(rank, 0), plan.cursor), readahead, ADVANCE_RUN,
                    -1 if step is None else step - looked, skip, flags)
                looked += seen
                if stop:  # covered, or as far ahead as it may look
                    active.remove(item)
                    bounded = bounded or stop == AHEAD_BOUND
                if sids:
                    runs.append((rank, sids, positions))
            if runs and not self._reserve(runs):
                return False  # the budget holds nothing needed later than this
            if step is not None and looked >= step:
                return True
        self.idle = not bounded
        return False

    def _reserve(self, runs) -> bool:
        """Reserve room for the runs' samples, interleaved (each plan's first, then each
        one's second, ...; each sample once) and queue them on their nodes, until one finds
        no room: then False, and each plan's head goes back to its first sample not
        queued."""
        if len(runs) == 1:  # (one plan: its run as it is, unless a sample comes twice)
            rank, sids, positions = runs[0]
            if len(set(sids)) == len(sids):
                done = self._queue(sids)
                if done < len(sids):
                    self.heads[rank] = positions[done]
                return done == len(sids)
        sids, owners, seen = [], [], set()
        for k in range(max(len(run) for _, run, _ in runs)):
            for rank, run, positions in runs:
                if k < len(run):
                    sid = run[k]
                    if sid not in seen:
                        seen.add(sid)
                        sids.append(sid)
                        owners.append((rank, positions[k]))
        done = self._queue(sids)
        back = set()
        for rank, pos in owners[done:]:
            if rank not in back:
                back.add(rank)
                self.heads[rank] = pos
        return done == len(sids)

    def _queue(self, sids: list[int]) -> int:
        """Reserve room for sids in turn (SampleCache.reserve_many, their keys from one call)
        and queue them on their nodes, until one finds no room: how many were queued."""
        sizes, keys = self.index.size_v, self.policy.keys_of(sids)
        done = self.cache.reserve_many(sids, list(map(sizes.__getitem__, sids)), keys)
        self.queued.push_many(sids, done)
        return done

    @property
    def queues(self) -> list[list[int]]:
        """Each node's queue, head first (a copy: for the tests and the statistics)."""
        return [self.queued.of(node) for node in range(self.nodes)]

    def batches(self, running: list[int]) -> list[tuple[int, list[int]]]:
        """The batches to start now, (node, samples), taken out of the queues, for nodes
        with free request slots (running: each node's batches running; the caller starts
        them and counts them in). A node's queue is spread over its slots: a batch takes
        about len(queue) / slots samples (at most k), so a short queue still keeps every
        slot reading; and when several slots are free at once (an order's start), the
        samples at the queue's head are dealt round robin over the new batches, so the i-th
        queued sample waits for about i / free reads, not i (each batch reads its samples
        one after the other). Queued samples of one chunk that follow each other (a
        chunk-block order) stay together as one run of up to 16 MiB: the chunk is then read
        in one request. (Queues.deal: the runs, their dealing and their taking out of the
        queue in one call of C.)"""
        out = []
        running = list(running)
        queued = self.queued
        lengths = queued.lengths()
        for node in range(self.nodes):
            while lengths[node]:
                slots = self.slots(running, lengths)
                free = slots - running[node]
                if free <= 0:
                    break
                size = max(1, min(self.batch, -(-lengths[node] // slots)))
                for b in queued.deal(node, free * size, free, self.MAX_BATCH_BYTES):
                    lengths[node] -= len(b)
                    running[node] += 1
                    out.append((node, b))
        return out

    def slots(self, running: list[int], lengths: list[int]) -> int:
        """Batches a node with queued samples may have running now (running: each node's
        batches running; lengths: each node's queue length): its own per_node, plus the own
        slots left idle by nodes with nothing queued (shared among the nodes with work), at
        most max_per_node."""
        idle = sum(max(0, self.per_node - running[n]) for n, q in enumerate(lengths) if not q)
        busy = sum(1 for q in lengths if q)
        return min(self.max_per_node, self.per_node + idle // max(1, busy))

    def yield_room(self, nbytes: int, key: float) -> int:
        """Take back the reservations of queued samples needed later than key (from each
        node's queue tail, latest first) until nbytes are freed; the heads go back to the
        cursors so those samples are queued again when room allows. Returns bytes freed."""
        key_of, queued = self.policy.key, self.queued
        freed = 0
        while freed < nbytes:
            tails = [(key_of(queued.tail(node)), node) for node, n in enumerate(queued.lengths()) if n]
            if not tails:
                break
            latest, node = max(tails)
            if latest <= key:
                break
            sid, = queued.take(node, 1, True)
            freed += self.cache.settle(sid)
        if freed:
            self.heads.clear()
        return freed

    def take_queued(self, sid: int) -> list[int]:
        """For a reader that missed sid: sid if it is queued, plus samples queued next on
        its node up to a batch, taken out of the queue (their bytes stay reserved). O(batch),
        whatever the queue's length."""
        queued = self.queued
        node = queued.remove(sid)
        if node >= 0:
            return [sid] + queued.take(node, self.batch - 1, False)
        return queued.take(self._chunk_node_v[self.index.chunk_v[sid]], self.batch - 1, False)


class Wake:
    """What the read-ahead's task waits on: set by whatever may let it start more work (a
    new order, a use, a read-ahead batch's end: arrivals.Arrivals.ended)."""

    def __init__(self):
        self._event = trio.Event()

    def set(self) -> None:
        self._event.set()

    async def wait(self) -> None:
        """Until set; then it is clear again."""
        await self._event.wait()
        self._event = trio.Event()
