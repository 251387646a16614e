"""What the kernel page cache holds of the samples, as far as the daemon can tell: the one
owner of that fact.

A fetched sample's bytes are pushed into the kernel page cache (`push`, from the fetch's
worker threads), unless the daemon's cache keeps them for the fast path to answer its reads
from; a read the daemon answers to a sample's end leaves its pages there
(`read_through`: keep_cache). The kernel tells the daemon only when it forgets an inode
(`forgot`); it drops pages without telling, under memory pressure or reclaiming cold pages
proactively, and a read that reaches the daemon for a sample taken as held shows that it
did (`lost`). When that happens to many of the held samples opened lately (a forget of a
sample the orders still need counts too: the kernel reclaims inodes with their pages),
every flag is cleared and only what is pushed or read through from then on is taken as held
(`drops`, until the next order). Lately, not since the order: a kernel that drops
everything late in a long epoch is found out after about as many misses as early in a short
one. The flags are one byte per sample (`flags`), which the fast path's threads read as they
answer reads (READ_LOST: fastpath.py).
"""
from __future__ import annotations

import errno
import logging
import math
import os
import threading

import numpy as np

log = logging.getLogger("fusefs")

# Distrust what was pushed to the kernel once more than this share of the pushed samples
# opened lately (about the last DROP_WINDOW of them, under the current order) were found
# dropped, and at least MIN_DROPS of them: see KernelView.lost.
DROP_SHARE = 0.1
MIN_DROPS = 16
DROP_WINDOW = 1024


class KernelView:
    def __init__(self, n_files: int, stats, kernel=None, ino_base: int = 0):
        """n_files samples, sample sid at inode ino_base + sid; kernel: the kernel page
        cache (push([(ino, bytes)]) -> errnos: fs.KernelCache) or None (nothing is pushed,
        nothing taken as held); stats: the daemon's counters (pushed, push_skipped,
        kernel_dropped, kernel_forgotten, opens_pushed)."""
        self.kernel = kernel
        self.stats = stats
        self._lock = threading.Lock()  # push() runs in several fetch threads at once
        self.ino_base = ino_base
        self.held = np.zeros(n_files, dtype=bool)  # pushed or read through, not forgotten since
        self._held_v = memoryview(self.held)  # (the same flags, read as Python bools: holds)
        self.drops = False           # the kernel dropped many pushed pages under this order
        self._recent = 0.0           # drops found lately, each by exp(-opens since / DROP_WINDOW)
        self._opens_at_drop = 0      # stats.opens_pushed at the last drop
        self._opens_at_order = 0     # stats.opens_pushed when the last order came

    def counters(self) -> dict:
        return {"in_kernel": int(np.count_nonzero(self.held)), "kernel_drops": self.drops}

    @property
    def pushes(self) -> bool:
        """Whether fetched samples are pushed into the kernel."""
        return self.kernel is not None

    def flags(self) -> np.ndarray:
        """The held flags as bytes, which the fast path reads (the same memory)."""
        return self.held.view(np.uint8)

    def holds(self, sid: int) -> bool:
        """Whether the kernel page cache holds sample sid's pages: pushed (or read through
        the daemon) and not forgotten, found dropped or cleared since. Such a sample is
        neither pushed again nor read ahead."""
        return self._held_v[sid]

    def opened(self, sid: int) -> None:
        """Sample sid was opened: counted as opened pushed if its reads are the kernel's."""
        if self._held_v[sid]:
            self.stats.opens_pushed += 1

    def opened_held(self, n: int) -> None:
        """n samples whose pages it holds were opened: opened() of each, counted in C
        (Core.answered)."""
        self.stats.opens_pushed += n

    def push(self, items) -> None:
        """Hand fetched samples' bytes, [(sid, bytes)], to the kernel page cache (in the
        fetch's worker thread, after the event loop has them: a push waits for the locks of
        the file's pages, and a reader's read of that file holds one until the loop answers
        it). Several fetch threads push at once: what a push counts and sets is done under
        one lock, once a batch (the kernel's copies are not)."""
        kernel = self.kernel
        if kernel is None:
            return
        held = self.held
        todo = [(sid, data) for sid, data in items if not held[sid]]
        skipped = len(items) - len(todo)
        errs = kernel.push([(self.ino_base + sid, data) for sid, data in todo]) if todo else ()
        refused = 0
        with self._lock:
            self.stats.push_skipped += skipped
            for (sid, _), err in zip(todo, errs):
                if err == 0:
                    held[sid] = True
                    self.stats.pushed += 1
                elif err != errno.ENOENT:
                    # (ENOENT: the kernel does not know the inode yet; that sample is not held)
                    refused = err
            if refused and self.kernel is not None:
                self.kernel = None
            else:
                refused = 0
        if refused:
            log.warning("the kernel refused a page cache push (%s): serving reads from "
                        "the daemon", os.strerror(refused))

    def read_through(self, sid: int) -> None:
        """The daemon answered the read that reached the end of sample sid: the kernel keeps
        the pages of what it read (keep_cache), as it keeps pushed ones."""
        if self.kernel is not None:
            self.held[sid] = True

    def forgot(self, sid: int, needed: bool = False) -> bool:
        """The kernel forgot sample sid's inode, and with it its pages. If they were held
        and the current orders still need sid (needed), that is a drop as lost()'s: True
        when it made the drops cross the line (every flag cleared). (A forget says nothing
        of the pages the kernel still holds when it comes for samples already used.)"""
        if not self.held[sid]:
            return False
        self.stats.kernel_forgotten += 1
        self.held[sid] = False
        return needed and self._dropped()

    def lost(self, sid: int) -> bool:
        """A read of sample sid reached the daemon: the kernel does not hold all its pages.
        If they had been pushed, the kernel dropped some. One such sample costs its reader a
        fetch (a miss); once more than DROP_SHARE of the pushed samples opened lately (about
        the last DROP_WINDOW under this order; and at least MIN_DROPS) were dropped, the
        kernel has likely dropped most of them: every flag is cleared, so every sample is
        pushed again as it is fetched, and True says so (the read-ahead then goes back for
        what it skipped). What is pushed from then on is held again."""
        if not self.held[sid]:
            return False
        self.held[sid] = False
        self.stats.kernel_dropped += 1
        return self._dropped()

    def _dropped(self) -> bool:
        """One more pushed sample still needed was dropped under this order: lost(). The
        drops weigh less as pushed samples are opened after them (exp(-opens since /
        DROP_WINDOW)), and so do the opens: both count about the last DROP_WINDOW opens (all
        of them, early in an order), in O(1) a drop and nothing an open."""
        opens = self.stats.opens_pushed
        self._recent = self._recent * math.exp((self._opens_at_drop - opens) / DROP_WINDOW) + 1
        self._opens_at_drop = opens
        window = -DROP_WINDOW * math.expm1((self._opens_at_order - opens) / DROP_WINDOW)
        if self.drops or self._recent < MIN_DROPS or self._recent <= DROP_SHARE * window:
            return False
        self.drops = True
        self.held[:] = False
        log.info("the kernel dropped the pages (or forgot the inodes) of %.0f of about the "
                 "last %.0f pushed samples opened (%d under the current order(s)), still "
                 "needed: what it was thought to hold is fetched and pushed again",
                 self._recent, window, opens - self._opens_at_order)
        return True

    def new_order(self) -> None:
        """A new order: count drops afresh."""
        self.drops = False
        self._recent = 0.0
        self._opens_at_order = self._opens_at_drop = self.stats.opens_pushed
