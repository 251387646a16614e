"""The fast path: a thread of pyfuse3, in C, answers the dataset files' lookup, open, ioctl,
release and forget, so that a sample the kernel holds costs the Python loop nothing, and
the reads of samples the daemon's cache holds, so that one the kernel does not hold costs
it little.

fusefs's binding, fusefs.pyfuse3 (its patch "fast", fusefs/_fastpath.h)
reads /dev/fuse on a thread of its own. It answers an open of a dataset file (no write
flag) as Core.open would (handle (serial << SID_BITS) | sample, keep_cache), a release of a
dataset handle, every ioctl (ENOTTY, as the ioctl patch does), the lookup of a dataset
file's name (as Core.lookup would, from the index's arrays: the tree in
Core.fast_path_args) and every forget (it has no answer; fusefs keeps no lookup counts); it
hands every other request (folders' and control files' names among them) to pyfuse3's
request loop unchanged. It answers a read of a dataset handle when the
sample's bytes are held for it: the cache tells it of every entry that comes or goes
(the cache's mirror, cache.SampleCache: `publish_api`'s capsule, in C; `hold` from Python), and the thread keeps a reference to each held bytes
object. A fetch's worker thread hands it the read-ahead's samples as they are read
(`hold_many`, holders.Holders.serve_early), and a read of one that comes while it is being
fetched waits in the thread (`expect`, as the batch starts) and is answered by that hand-over,
without the loop (or handed to the loop where the fetch fails). The opens, reads, releases and dataset files' forgets it answered reach the
core as events, in order and in batches (`Core.answered`): from 256 of them (128 samples)
or 20 ms after the first; the opens and releases of samples the kernel holds, while no
fetched sample came into the cache for 100 ms, wait 100 ms (the read-ahead has nothing to
do for them, and an idle loop's wake costs it several times a busy one's), and while the
read-ahead has covered its orders too (`idle`), 1 s or 2,048 samples. Before each request
the loop handles, and before an order is put in force, the events before it are applied
(fs.Operations, Core.commit_order), so the accounting sees opens, releases and order
changes in the order they came. A request the loop answers costs one thread hand-off more
than without the fast path (docs/HOTPATH.md, "The fast path"); `--no-fast-path` turns it
off.
"""
from __future__ import annotations

import logging

import trio

from . import pyfuse3
from .control import FH_BASE

log = logging.getLogger("fusefs")

BATCH = 256         # events that wake the loop ...
DELAY_US = 20_000   # ... or this long after the first of them (each wake-up of the loop
                    # costs it tens of us: readers at 1,000 files/s would wake it for
                    # every other sample at 2 ms)


class FastPath:
    """The thread's events, handed to `answered` (Core.answered: a sequence of handles).
    Made before the core (whose cache tells it what it holds: `hold`) and the adapter (which
    applies its events before each request: `catch_up`); started after pyfuse3.init."""

    def __init__(self):
        self.answered = None
        self.fd = -1

    def start(self, answered, file_base: int, n_files: int, sid_bits: int, serial: int, serial_wrap: int,
              write_flags: int, events: tuple[int, int, int, int], kernel_flags=None,
              tree=None, threads: int = 1, missed: int = 0) -> None:
        """Start the thread (after pyfuse3.init, before pyfuse3.main), its events handed to
        answered(events) from then on; handles continue the
        core's serials; events: the bits the core reads its events by (released, read,
        read_end, read_lost: handles.EVENT_BITS), the only copy of them. kernel_flags: one byte per sample, nonzero while the core takes the
        kernel to hold its pages (read by the thread as it answers a read: READ_LOST).
        tree: the index's arrays the thread answers the lookups of files' names from
        (pyfuse3.fast_path_tree), or None: the loop answers every lookup. threads: how many
        threads read /dev/fuse (the first the session's fd, each other a clone of it).
        missed: the bit of a miss's event (handles.MISSED): a read of the whole of a sample
        neither held nor being fetched waits in the thread and reaches the core as an event
        (Core.answered), which fetches the sample and hands it over (hand_many); 0: such
        reads go to the loop."""
        self.answered = answered
        pyfuse3.fast_path_misses(missed)
        pyfuse3.fast_path_kernel_flags(kernel_flags)
        pyfuse3.fast_path_tree(tree)
        self.fd = pyfuse3.fast_path_start(file_base, n_files, FH_BASE, sid_bits, serial, serial_wrap,
                                          write_flags, BATCH, DELAY_US, events, threads)

    def catch_up(self) -> None:
        """Apply the events waiting now."""
        ev = pyfuse3.fast_path_events()
        if ev and self.answered is not None:
            self.answered(memoryview(ev).cast("Q"))

    async def run(self) -> None:
        """Apply the events as they come, until cancelled (in the mount's nursery). An error
        in applying them is logged and the loop goes on (as the read-ahead's does): it must
        never end the daemon's event loop, which would leave a dead mount."""
        while True:
            await trio.lowlevel.wait_readable(self.fd)
            try:
                self.catch_up()
            except Exception:
                log.exception("applying the fast path's events failed")

    @staticmethod
    def counters() -> dict:
        """The requests the thread answered, by type, and the bytes its answers to reads
        carried (for Core.statistics)."""
        counts = pyfuse3.fast_path_counts()
        return {"requests": counts, "fast_path_requests": counts,
                "bytes_served": pyfuse3.fast_path_read_bytes(),
                "interrupts_to_loop": pyfuse3.fast_path_interrupts_forwarded(),
                **dict(zip(("reads_parked", "parked_to_loop", "misses_parked"), pyfuse3.fast_path_parked())),
                "fast_path_threads": pyfuse3.fast_path_thread_counts()}

    @staticmethod
    def idle(idle: bool) -> None:
        """The read-ahead has covered its orders (True), or no longer: while it has, the
        lazy events wait longer still (pyfuse3.FAST_PATH_IDLE times the delay, in batches
        pyfuse3.FAST_PATH_IDLE_BATCH times as large)."""
        pyfuse3.fast_path_idle(idle)

    @staticmethod
    def hold(sid: int, data) -> None:
        """Answer the reads of sample sid from data from now on (None: no longer). Only a
        bytes object is held (the thread reads it without the GIL); other data is not. The
        reads that waited for sid (expect) are answered from data, or handed to the loop."""
        pyfuse3.fast_path_hold(sid, data if type(data) is bytes else None)

    @staticmethod
    def hold_many(items) -> None:
        """(A fetch's worker thread.) hold() of each (sid, data) of items, in one call: the
        reads that waited for them are answered in this thread, before the loop hears of
        them."""
        pyfuse3.fast_path_hold_many(items)

    @staticmethod
    def hand_many(items) -> None:
        """(Any thread.) Of each (sid, bytes) of items, the reads that wait for sid (a miss,
        or an expected sample) are answered from its bytes, which are not held: a fetched
        sample that readers missed, whether the cache keeps it or not."""
        pyfuse3.fast_path_hand_many(items)

    @staticmethod
    def publish_api():
        """The capsule (fusefs/_publishapi.h) through which a fetch's worker thread's compiled
        reads (read_group in fusefs/_fetchio.c) hold each sample (hold_many's work) or hand
        it over (hand_many's) in C as its read is checked, and the cache's mirror holds and
        lets go of its entries (hold's)."""
        return pyfuse3.fast_path_publish_api()

    @staticmethod
    def expect(sids) -> None:
        """(The loop, as a batch starts.) A fetch thread will hold sids (hold_many) or the
        loop let them go (hold(sid, None)): until then the thread keeps a read of one waiting
        (parked) instead of handing it to the loop."""
        pyfuse3.fast_path_expect(sids)
