"""What a fetch brings, on the event loop: kept where the orders need it, failures remembered.

The fetcher (fetch.py) hands every group of samples that arrive here (`arrived`), whoever
started the batch: a reader that missed (reads.py) or the read-ahead (prefetch.py). Each
sample's reservation in the cache is settled; its bytes are offered to the local tier and
kept in the cache if the orders need them before something cached (cache.py, by policy.py's
keys: a group's keys in one call, its entries in one call); a sample the cache refuses
takes back room the read-ahead reserved for samples needed later (ReadAheadPlan.yield_room).
A corrupt sample is remembered (EIO at once from then on), and so is one whose node did not
answer within --io-timeout (for GAVE_UP_S). A batch's end wakes the read-ahead, which may
start another on the slot it leaves.
"""
from __future__ import annotations

import collections
import logging
import time

import numpy as np

from .cache import SampleCache
from .fetch import ITEM_RESULT, ITEM_SID, READ_WELL, FetchCancelled
from .holders import Holders
from .policy import Policy
from .prefetch import ReadAheadPlan, Wake
from .store import CorruptSample

log = logging.getLogger("fusefs")

GAVE_UP_MAX = 4096  # samples whose fetch gave up that are remembered (the oldest go first)


class Arrivals:
    def __init__(self, policy: Policy, cache: SampleCache, holders: Holders, plan: ReadAheadPlan,
                 wake: Wake, *, local=None, io_timeout: float = 0.0):
        """policy: by what rule bytes are kept; cache: the budget (reservations settled,
        what an entry costs); holders: where bytes are kept and pushed from
        (holders.Holders); plan: the read-ahead's (prefetch.ReadAheadPlan: its reservations
        yield room to a refused sample); wake: the read-ahead's (prefetch.Wake), set as a batch of
        its ends; local: the local tier or None; io_timeout: the fetcher's (a sample whose
        fetch gave up waiting for its node is remembered only if it waited). Where the fast
        path answers the cache's samples (holders.serves_early), a fetched sample the cache
        keeps is not pushed into the kernel page cache: its readers' reads leave its pages
        there (KernelView.read_through), one copy fewer than a push."""
        self.policy, self.cache, self.holders, self.plan = policy, cache, holders, plan
        self.wake, self.local = wake, local
        self.io_timeout = io_timeout
        self.corrupt: dict[int, str] = {}  # samples whose stored bytes fail their checksum
        self.gave_up: collections.OrderedDict[int, float] = collections.OrderedDict()  # sid -> when

    def counters(self) -> dict:
        return {"corrupt_samples": len(self.corrupt)}

    def handling(self, sids: list[int], missed=()) -> dict:
        """For a batch of sids about to start (missed: the samples readers missed, a set),
        what its worker thread does with them (Fetcher.submit's push, unpushed, serve,
        served, expect). With the fast path, those the cache has room reserved for (the
        read-ahead's) are handed to the fast path in the thread (Holders.serve_early: their
        readers are answered before the loop has them, and wait there meanwhile:
        Holders.expect) and not pushed: the cache keeps them
        as they arrive, and their reads leave their pages in the kernel. Nor are the missed
        samples pushed (their readers' own reads bring their pages)."""
        holders, out = self.holders, {"missed": missed}
        reserved = set()
        if holders.serves_early:
            reserved = self.cache.reserved_among(sids)
            if missed:
                reserved.difference_update(missed)
            if reserved:
                out.update(serve=holders.serve_early, served=reserved)
                if holders.expects:
                    out.update(expect=holders.expect)
            if holders.expects:  # (any of them may be a miss whose read waits there)
                out.update(hand=holders.hand_many, publish=holders.publish_api)
        if holders.pushes:
            out.update(push=holders.push, unpushed=reserved | set(missed))
        return out

    def fetched_elsewhere(self, sids: list[int], claimed: list[int]) -> None:
        """A batch of sids is about to start with those of them claimed (Fetcher.claim): the
        others are fetched by a batch under way already, and their reservations (the
        read-ahead's) go."""
        if len(claimed) == len(sids):
            return
        settle, mine = self.cache.settle, set(claimed)
        for s in sids:
            if s not in mine:
                settle(s)

    def arrived(self, items, missed=(), served=()) -> None:
        """A group of a batch's samples is done, [(sid, bytes | Exception)] (missed: the
        samples of the batch that readers missed; served: those handed to the fast path in
        the thread; sets): reservations settled, each delivered, and a served one the cache
        did not keep let go of."""
        self.cache.settle_many(items)
        unkept = self.deliver_many(items, missed, served)
        if served and unkept:
            self.holders.unserve([s for s in unkept if s in served])
        if self.holders.waiting:
            self.holders.arrived(items)

    def waits(self) -> bool:
        """(Any thread.) Whether a read waits in the fast path for a fetched sample that
        its thread may have handed over before the read came (Holders.wait_for: answered
        here, on arrival)."""
        return bool(self.holders.waiting)

    def ended(self, node: int, readahead: bool) -> None:
        """A batch on node ended: a read-ahead batch leaves a request slot free."""
        if readahead:
            self.wake.set()

    def deliver_many(self, items, missed=(), served=()) -> list[int]:
        """deliver() of each (sid, result) of a group of reads (the fetched ones kept in the
        group's order); `missed`: the samples readers missed (a set); `served`: those the
        fast path holds already (Holders.serve_early). The group's keys come from one call
        (Policy.keys_of: C under one order, else numpy for a large group), not a Python call each,
        and the cache keeps the group's samples in one call (SampleCache.put_many). Returns
        the samples the cache may not have kept (the others it did keep): those refused,
        failed or missed, or all where a local tier is offered them first."""
        if not missed and set(map(type, map(ITEM_RESULT, items))) <= READ_WELL:  # (a clean group: no loop)
            ok, unkept = items if type(items) is list else list(items), []
        else:
            ok, unkept = [], []
            for item in items:
                sid, r = item
                if sid in missed or isinstance(r, Exception):
                    self.deliver(sid, r, missed=sid in missed)
                    unkept.append(sid)
                else:
                    ok.append(item)
        if not ok:
            return unkept
        keys = self.policy.keys_of(list(map(ITEM_SID, ok)))
        if self.local is not None:  # (each offered to the local tier first)
            for (sid, r), key in zip(ok, keys):
                self._keep(sid, r, key)
                unkept.append(sid)
            return unkept
        keep_many, at = self.holders.keep_many, 0
        while at < len(ok):
            at = keep_many(ok, keys, at, served)
            if at < len(ok):
                self._keep_refused(*ok[at], keys[at])
                unkept.append(ok[at][0])
                at += 1
        return unkept

    def deliver(self, sid: int, result, missed: bool = False) -> None:
        """A fetch finished: keep the bytes if the orders need them before something cached
        (a missed sample: its next use after its reader's; that reader holds its bytes)."""
        if isinstance(result, Exception):
            if isinstance(result, FetchCancelled):
                return
            if isinstance(result, CorruptSample):
                if sid not in self.corrupt:
                    self.corrupt[sid] = str(result)
                    log.error("EIO: %s", result)
            elif self.io_timeout > 0:  # (it waited for the node: not again at once)
                self.gave_up[sid] = time.monotonic()
                self.gave_up.move_to_end(sid)
                if len(self.gave_up) > GAVE_UP_MAX:
                    self.gave_up.popitem(last=False)
            return
        self._keep(sid, result, self.policy.key_after_use(sid) if missed else self.policy.key(sid))

    def _keep(self, sid: int, result: bytes, key: float) -> None:
        """A fetched sample's bytes, needed next at key: offered to the local tier, kept in
        the cache if the orders need them before something cached."""
        if self.local is not None and sid not in self.local:  # (cheap test first)
            self.local.offer(sid, result, float(self.local.priority[sid])
                             if self.policy.keeps_after_use(sid) else -np.inf)
        if not self.holders.keep(sid, result, key):
            self._keep_refused(sid, result, key)

    def _keep_refused(self, sid: int, result: bytes, key: float) -> None:
        """A fetched sample the cache refused (room only from entries needed sooner): the
        budget is reserved for read-ahead needed later than key, so some is taken back for
        it."""
        if key != float("inf") and self.plan.yield_room(self.cache.cost(len(result)), key):
            self.holders.keep(sid, result, key)
