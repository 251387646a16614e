"""A sample's bytes for a reader: from the cache, a fetch under way, or a fetch of its own.

The read path, top to bottom: `Reads.fetch(sid)` answers from the cache, from a fetch
under way (the reader waits for it), or starts a fetch of its own with companions (the
samples queued next on its node, or a scan's next samples of its chunk): a batch on one
node that the fetcher (fetch.Fetcher: worker threads, retries, per-node bounds) runs
without a task of its own. What the batch brings goes to arrivals.Arrivals, which keeps it
where the orders need it before something cached (cache.py, by policy.py's keys) and offers
it to the local tier; the worker thread pushes it into the kernel page cache
(kernel_view.KernelView.push), after the event loop has it, unless the cache keeps it for
the fast path, whose answers to its reads leave its pages there. A sample the kernel holds
is neither pushed again nor read ahead; a read that reaches the daemon for one shows that
the kernel dropped its pages (`lost`).
"""
from __future__ import annotations

import collections
import errno
import time

import trio

from .arrivals import Arrivals
from .entries import FsError
from .fetch import Fetcher
from .holders import Holders
from .index import Index
from .kernel_view import KernelView
from .policy import Policy
from .prefetcher import Prefetcher

# A sample whose fetch gave up (its node did not answer within --io-timeout; not with
# --io-timeout 0, where a read tries once) is answered EIO at once for GAVE_UP_S while its
# node is still down: the kernel tries a read-ahead that failed again at once, as a read of
# its own, which would otherwise wait as long again (arrivals.Arrivals remembers them).
GAVE_UP_S = 5.0


class Reads:
    def __init__(self, index: Index, holders: Holders, policy: Policy, fetcher: Fetcher,
                 prefetcher: Prefetcher, arrivals: Arrivals, stats, kernel_view: KernelView):
        """index: sizes and chunks; holders: where bytes are held (holders.Holders); policy:
        the orders (their plans; a miss's next use);
        fetcher: batches, in-flight fetches; prefetcher: the read-ahead (a miss takes along
        the samples it has queued on the node, and the kernel's drops rewind it); arrivals:
        what fetches bring (its corrupt and given-up samples, and what a batch's thread
        does with them: Arrivals.handling); stats: the daemon's counters; kernel_view: what the kernel page cache
        holds (kernel_view.KernelView)."""
        self.index, self.holders, self.policy = index, holders, policy
        self.fetcher, self.prefetcher, self.arrivals = fetcher, prefetcher, arrivals
        self.stats, self.kernel_view = stats, kernel_view
        self.corrupt, self.gave_up = arrivals.corrupt, arrivals.gave_up
        self._recent = collections.deque(maxlen=32)  # recently read samples (scan detection)
        self._gathered: dict[int, Gathered] = {}  # node -> the misses gathered this turn

    def lost(self, sid: int) -> None:
        """A read of sample sid reached the daemon: if the kernel was taken to hold its
        pages, it dropped some (KernelView.lost); when it has dropped many, the read-ahead
        goes back to the cursors to fetch what it skipped (Prefetcher.rewind)."""
        if self.kernel_view.lost(sid):
            self.prefetcher.rewind()

    def forgot(self, sid: int) -> None:
        """The kernel forgot sample sid's inode, and with it its pages: as lost() if the
        kernel was taken to hold them and the orders still need sid (the read-ahead passed
        over it as held and would not come back for it: its reader would miss)."""
        view = self.kernel_view
        needed = view.holds(sid) and self.policy.next_use(sid) is not None
        if view.forgot(sid, needed):
            self.prefetcher.rewind()

    def answered(self, sid: int, end: int, held: int, counted: int = 0) -> None:
        """A read of sample sid was answered from its cached bytes outside the loop (the
        fast path; end, held, counted: flags, nonzero or 0): as fetch() would count it, and
        as the daemon's read (Core.read) would tell what the kernel holds (end: the read
        reached the sample's end; held: the kernel was taken to hold its pages when the read
        was answered, so it had dropped them. Not held now: a push that ended after the
        read, waiting for the pages it held, may have set it since). counted: the read
        waited in the fast path for its miss, counted then (parked_misses), not as a hit."""
        if held:
            self.lost(sid)
        if not counted:
            self._recent.append(sid)
            self.stats.hits += 1
        if end:
            self.kernel_view.read_through(sid)

    def hits(self, sids: list) -> None:
        """Reads of sids answered from cached bytes outside the loop, none of them of pages
        the kernel had dropped: answered() of each, its flags counted in C (Core.answered)."""
        self._recent.extend(sids)
        self.stats.hits += len(sids)

    def new_order(self) -> None:
        """A new order: the kernel's drops are counted afresh."""
        self.kernel_view.new_order()

    async def fetch(self, sid: int) -> bytes:
        """Sample sid's verified bytes, from the cache, a fetch under way, or the backend."""
        self._recent.append(sid)
        if sid in self.corrupt:  # known bad: do not read it again
            self.stats.eio += 1
            raise FsError(errno.EIO, self.corrupt[sid])
        if self.gave_up and sid in self.gave_up:
            self._gave_up_lately(sid)
        data = self.holders.get(sid)
        if data is not None:
            self.stats.hits += 1
            return data
        pending = self.fetcher.inflight.waiter(sid)
        if pending is not None:
            self.stats.read_waits += 1
            t0 = time.perf_counter()
            await pending.wait()
            waited = time.perf_counter() - t0
            self.stats.wait_s += waited
            self.stats.wait_hist.observe(waited)
            result = pending.error or pending.data
        else:
            self.stats.misses += 1
            result = await self._fetch_missed(sid)
        if isinstance(result, Exception):
            self.stats.eio += 1
            raise FsError(errno.EIO, str(result))
        return result

    def _gave_up_lately(self, sid: int) -> None:
        """FsError(EIO) if sample sid's fetch gave up within GAVE_UP_S and its node is still
        down; else it is forgotten."""
        waited = time.monotonic() - self.gave_up[sid]
        if waited < GAVE_UP_S and self.fetcher.is_down(self.fetcher.node_of(sid)):
            self.stats.eio += 1
            self.stats.eio_at_once += 1
            raise FsError(errno.EIO, f"its fetch gave up {waited:.1f} s ago, and its node is still down")
        del self.gave_up[sid]

    def parked_misses(self, sids: list[int]) -> None:
        """Reads of sids (each the whole sample) wait in the fast path, which holds none of
        them and knew of no fetch of them (handles.MISSED): each is answered from where the
        daemon holds it, or from the fetch under way, or from a fetch of its own (with
        companions, as _fetch_missed's; the misses of a node together in one batch), by the
        worker thread that reads it (holders.Holders.hand_many), or handed back to the loop
        where the sample is known corrupt or its fetch gave up lately (the loop's read
        answers EIO) or the fetch fails. Nothing waits on the loop for them; their fetches
        join the misses gathered this turn (_gather), submitted once all are in."""
        holders, fetcher, stats = self.holders, self.fetcher, self.stats
        first: dict[int, Gathered] = {}  # node -> the batch these misses started
        for sid in sids:
            self._recent.append(sid)
            if sid in self.corrupt or (self.gave_up and sid in self.gave_up):
                holders.let_go(sid)  # (the loop's read answers it: EIO)
                continue
            data = holders.get(sid)
            if data is not None:
                stats.hits += 1
                holders.hand(sid, data)
            elif sid in fetcher.inflight:
                stats.read_waits += 1
                holders.wait_for(sid)  # (handed over as it arrives, if its thread did not)
            else:
                stats.misses += 1
                batch = self._companions(sid)
                claimed = fetcher.claim(batch)
                self.arrivals.fetched_elsewhere(batch, claimed)
                holders.wait_for(sid)  # (let go of if its fetch fails)
                gathered = self._gather(sid, batch, claimed)
                if gathered is not None:
                    first[fetcher.node_of(sid)] = gathered
        for node, gathered in first.items():
            self._submit(node, gathered)

    def _companions(self, sid: int) -> list[int]:
        """sid and the samples fetched along with it: the next samples queued for read-ahead
        on its node up to a batch, or, reading without an order, the next k-1 samples of its
        chunk when the reads look like a scan."""
        fetcher = self.fetcher
        k = fetcher.batch - 1
        batch = [sid] + [s for s in self.prefetcher.take_queued(sid) if s != sid]
        if not self.policy.plans and sid - 1 in self._recent:
            chunk = self.index.chunk
            end = min(sid + 1 + k, self.index.n_files)
            holds = self.holders.holds
            batch += [s for s in range(sid + 1, end) if chunk[s] == chunk[sid]
                      and not holds(s) and s not in fetcher.inflight]
        return batch

    async def _fetch_missed(self, sid: int):
        """Fetch a sample no one is fetching, with companions (_companions). The reader has
        its sample as soon as its read is done; the companions' reads go on in the
        background."""
        fetcher = self.fetcher
        batch = self._companions(sid)
        claimed = fetcher.claim(batch)  # (sid among them: no one fetched it)
        pending = fetcher.inflight.waiter(sid)
        self.arrivals.fetched_elsewhere(batch, claimed)
        gathered = self._gather(sid, batch, claimed)
        if gathered is not None:  # (the node's first miss of this turn: it submits them)
            await trio.lowlevel.cancel_shielded_checkpoint()
            self._submit(self.fetcher.node_of(sid), gathered)
        await pending.wait()
        return pending.error or pending.data

    def _gather(self, sid: int, batch: list[int], claimed: list[int]):
        """Misses that reach the loop together go out together: the missed sid and its
        companions (batch, claimed for this fetch) join the batch gathered for its node in
        this turn of the loop, which the node's first miss of the turn submits after one
        checkpoint (the other tasks that are ready run first: their misses join it), or at
        once once it holds a batch's worth (fetcher.batch samples). With four readers
        missing at once, each miss was a request of its own. Returns the gathered batch to
        the first miss (which submits it), else None."""
        node = self.fetcher.node_of(sid)
        gathered = self._gathered.get(node)
        first = gathered is None
        if first:
            gathered = self._gathered[node] = Gathered()
        gathered.missed.append(sid)
        gathered.companions += [s for s in claimed if s != sid]
        gathered.claimed += claimed
        if len(gathered.missed) + len(gathered.companions) >= self.fetcher.batch:
            self._submit(node, gathered)
        return gathered if first else None

    def _submit(self, node: int, gathered: "Gathered") -> None:
        """Submit the batch gathered for node (once: a later call finds it gone or another)."""
        if self._gathered.get(node) is not gathered:
            return
        del self._gathered[node]
        sids, missed = gathered.missed + gathered.companions, set(gathered.missed)
        try:
            self.fetcher.submit(sids, gathered.claimed, **self.arrivals.handling(sids, missed))
        except Exception as e:  # (not serving any more: its readers get EIO, not a hang)
            self.fetcher.abandon(gathered.claimed, e)
            self.holders.arrived([(sid, e) for sid in gathered.missed])  # (fast path's waits: to the loop)


class Gathered:
    """The misses of one node gathered in one turn of the loop (Reads._gather)."""
    __slots__ = ("missed", "companions", "claimed")

    def __init__(self):
        self.missed: list[int] = []      # the missed samples, in the order they were missed
        self.companions: list[int] = []  # the samples fetched along with them
        self.claimed: list[int] = []     # every one (Fetcher.claim's)
