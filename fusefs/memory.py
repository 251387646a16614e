"""The daemon's memory: how glibc's malloc is set up for it, what it holds, and the
governor that keeps what it holds within its budgets.

glibc keeps the heap's freed pages (tune_malloc: reusing them saves a page fault a page of
every sample that comes after), so resident memory is the heap's high-water mark, not
what is live: with large samples (1 MiB, a 16 MiB budget) holes and freed tops kept the
daemon about 15 MB over fresh + cache budget + order memory after an epoch that never held
more than the budget. The Governor checks the daemon's resident memory every CHECK_EVERY
seconds in a worker thread (/proc/self/statm, answered from memory) and, past fresh + the
budgets, gives the free pages back (malloc_trim): within the bound, nothing is trimmed and
freed pages are reused as before.
"""
from __future__ import annotations

import ctypes
import os

import trio

PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")
CHECK_EVERY = 1.0  # seconds between two checks of the resident memory


def _libc():
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def tune_malloc() -> None:
    """Samples are ~100 KB objects allocated in worker threads and freed on the event loop:
    with glibc's defaults they land in per-thread heap arenas whose holes keep RSS far above
    what is live, so one arena is used (two kept about 100 MB more in the soak); samples
    come from the heap, not each from a mapping of its own (page faults and unmaps per
    sample), and the heap keeps its freed pages (the trade-offs, as measured:
    docs/HOTPATH.md, "Allocation"; the Governor gives them back past the budgets). While the
    cache grows, the heap grows 64 MiB per brk (untouched pages cost no memory): with
    glibc's 128 KiB, a brk every 5-6 samples, under the GIL. A no-op where glibc is not the
    allocator."""
    libc = _libc()
    try:
        libc.mallopt(-8, 1)          # M_ARENA_MAX
        libc.mallopt(-3, 4 << 20)    # M_MMAP_THRESHOLD: samples come from the heap ...
        libc.mallopt(-1, 256 << 20)  # M_TRIM_THRESHOLD: ... which keeps its freed pages
        libc.mallopt(-2, 64 << 20)   # M_TOP_PAD: ... and grows 64 MiB a brk, not 128 KiB
    except AttributeError:
        pass


def resident_bytes() -> int:
    """The daemon's resident memory (/proc/self/statm: the kernel answers from memory, no
    storage behind it, like getrusage), 0 where it cannot be read."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * PAGE_SIZE
    except (OSError, ValueError, IndexError):
        return 0


class Governor:
    """Keeps resident memory within fresh (what the mounted daemon held before its first
    read) + budget (the cache's and the orders'): past it, the heap's free pages go back."""

    def __init__(self, budget: int):
        self.budget = budget
        self.fresh = resident_bytes()
        self.trims = 0
        self.trimmed = 0  # bytes the trims gave back
        trim = getattr(_libc(), "malloc_trim", None)
        self._trim = trim

    @property
    def bound(self) -> int:
        return self.fresh + self.budget

    def counters(self) -> dict:
        return {"memory_bound": self.bound, "malloc_trims": self.trims, "malloc_trimmed": self.trimmed}

    def check(self) -> bool:
        """Trim if resident memory is past the bound; whether it trimmed. (A worker thread's:
        malloc_trim walks the heap.)"""
        before = resident_bytes()
        if self._trim is None or before <= self.bound:
            return False
        self._trim(0)
        self.trims += 1
        self.trimmed += max(0, before - resident_bytes())
        return True

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            await trio.sleep(CHECK_EVERY)
            await trio.to_thread.run_sync(self.check)
