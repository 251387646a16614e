"""The miss engine: a sample a reader misses, read and answered in C, without the loop.

Without an order the read-ahead has nothing to fetch, and every read of a sample the daemon
does not hold is a miss: the fast path parks it (fastpath.py). Without the engine the loop
hears of it, plans its fetch, hands it to a fetch thread and settles its arrival (about 150
us of the loop's Python a miss on this VM: docs/HOTPATH.md). With it the fast path queues
the miss on its node's lane, and that lane's reader threads (fusefs._fetchio.Misses; as
many as the fetches a node has in flight) read its queue (a share each while the node is
slow), check the checksums and answer the reads from their own buffers;
the loop hears only of the answers (the fast path's read events, as for a read of a held
sample). Nothing of a missed sample is kept: without an order nothing says it is read again
before the rest, and the engine is on only once the cache has no room for a miss (until
then the loop fetches the misses and the cache keeps them: core.Core._misses_to_engine).

Whatever is not a clean read goes to the loop as without the engine (fusefs/_fetchio.c,
Misses): a checksum mismatch, a short read, a failed read (and that chunk's later misses),
a sample over 2 MiB. The loop hears of the misses itself while an order has positions left (its
read-ahead fetches a miss with the samples queued after it), of a miss whose sample follows
one missed lately (a scan: the loop fetches the samples after it along with it), and of
those of a node whose readers are all reading and none finished for a second (the loop
waits for the node within --io-timeout). docs/ARCHITECTURE.md, "The miss engine".
"""
from __future__ import annotations

import logging

import numpy as np

from . import pyfuse3
from .store import MAX_GAP, MAX_READ

log = logging.getLogger("fusefs")

try:
    from ._fetchio import MISS_BUFFERS, Misses
except ImportError:  # (FUSEFS_NO_NATIVE=1: no native reads, no engine)
    MISS_BUFFERS, Misses = 0, None

JOIN_S = 5.0  # how long the unmount waits for a reader inside a read (then it is left to end)
LANES = 64    # the binding's lanes at most (fusefs/_missapi.h: FUSEFS_MISS_LANES)


class MissEngine:
    """The engine over store's chunks (index's), a lane a storage node, with per_lane reader
    threads a lane (as many as the fetches a node has in flight: --per-node); willneed: the
    backend is told of a batch's later reads at once (--willneed)."""

    def __init__(self, index, store, per_lane: int = 1, willneed: bool = False):
        self.index, self.store = index, store
        self.per_lane, self.willneed = per_lane, willneed
        lane_of_chunk = (np.array([c.node for c in index.chunks], np.int64) % LANES).astype(np.uint8)
        self.lanes = int(lane_of_chunk.max()) + 1 if len(lane_of_chunk) else 1
        self.lane_of = np.ascontiguousarray(lane_of_chunk[index.chunk])
        self.readers = None
        self.on = False
        self.counts_at_close: dict = {}

    @property
    def buffer_bytes(self) -> int:
        """What the readers' buffers take at most (each its batch's bytes, read in rounds of
        at most 2 MiB, and a scratch buffer for gaps): held outside the cache's budget, and
        counted in the daemon's memory bound (memory.Governor)."""
        return self.lanes * self.per_lane * MISS_BUFFERS

    @classmethod
    def wanted(cls, config, store, local) -> bool:
        """Whether a mount with config over store (and a local tier or None) runs the engine:
        it needs the fast path, the native reads and the binding's lanes; with a local tier
        the loop offers each fetched sample to it."""
        return (config.fast_path.enabled and config.fast_path.miss_engine and Misses is not None
                and store.native and local is None and getattr(pyfuse3, "MISS_ENGINE", False))

    def start(self) -> None:
        """Set the lanes and start the readers (after the fast path started); off until
        enable(True) (the core turns it on once the cache has no room for a miss)."""
        ix = self.index
        pyfuse3.fast_path_miss_lanes(self.lane_of)
        try:
            self.readers = Misses(pyfuse3.fast_path_miss_api(), ix.chunk, ix.offset, ix.size, ix.checksum,
                                  self.store.chunk_fds(), self.lanes, MAX_GAP, MAX_READ,
                                  per_lane=self.per_lane, willneed=self.willneed)
            self.readers.start()
        except BaseException:
            pyfuse3.fast_path_miss_stop()
            if self.readers is None or self.readers.join(JOIN_S):
                pyfuse3.fast_path_miss_lanes(None)
            self.readers = None
            raise

    def enable(self, on: bool) -> None:
        """New misses to the engine (True) or to the loop (False)."""
        if self.readers is not None and on != self.on:
            pyfuse3.fast_path_miss_engine(on)
            self.on = on

    def orders_in_force(self) -> None:
        """An order was put in force: the loop's read-ahead takes the misses from now on."""
        self.enable(False)

    def close(self) -> None:
        """Stop: the misses still queued go to the loop, the readers end (one inside a read
        of a node that does not answer is left to end by itself after JOIN_S)."""
        if self.readers is None:
            return
        self.on = False
        pyfuse3.fast_path_miss_stop()
        if self.readers.join(JOIN_S):
            pyfuse3.fast_path_miss_lanes(None)
        else:
            log.warning("the miss engine: a reader is still inside a read after %g s; left to end", JOIN_S)
        self.counts_at_close = self.counters()
        self.readers = None

    def counters(self) -> dict:
        """The engine's misses (counted among the daemon's misses too): answered in C, their
        bytes, the reads made, handed to the loop; and the fast path's: queued for the
        engine, told to the loop instead."""
        if self.readers is None:
            return self.counts_at_close
        queued, told, _, _ = pyfuse3.fast_path_miss_counts()
        c = self.readers.counts()
        return {"misses": c["fetched"], "engine_misses": c["fetched"], "engine_bytes": c["bytes"],
                "engine_reads": c["reads"], "engine_to_loop": c["to_loop"], "engine_queued": queued,
                "misses_to_loop": told}
