"""Open dataset files: their handles, and the bytes a handle keeps between its reads. Also
the layout of a handle and of the fast path's events, the one copy of each (the fast path's
C threads get them at their start: fastpath.py).

A dataset file's handle is (serial << SID_BITS) | sample id: no table entry per open, the
handle carries its sample. Serials wrap at SERIAL_WRAP, far below the control namespace's
handles (control.FH_BASE). The fast path answers opens in C and continues the same serials
(its events carry each handle it gave).

A handle whose read did not reach its sample's end keeps the sample's bytes for its next
read (whatever the cache does meanwhile), all handles together at most `cap` bytes,
counted in the cache budget (`room`: cache.SampleCache.hold_for_reader): past the cap a
handle's next read asks the cache (or the backend) again instead of growing the daemon.
"""
from __future__ import annotations

SID_BITS = 32  # a data file's handle is (serial << SID_BITS) | sample id
SID_MASK = (1 << SID_BITS) - 1
SERIAL_WRAP = 1 << 29  # serials wrap far below control handles (control.FH_BASE = 1 << 62)
# the fast path's events (fusefs/_fastpath.h): a handle opened; RELEASED | handle released;
# READ | sample read from the bytes held for it (| READ_END: up to the sample's end;
# | READ_LOST: the kernel view held the sample when the read was answered); FORGOTTEN |
# sample: the kernel forgot the sample's inode; READ | MISSED | sample: a read of a sample
# neither held nor being fetched waits in the fast path for it (Reads.parked_misses)
RELEASED = 1 << 63
READ = 1 << 62
READ_END = 1 << 61
READ_LOST = 1 << 60
FORGOTTEN = RELEASED | READ  # (a released handle never has READ's bit)
MISSED = 1 << 59
EVENT_BITS = (RELEASED, READ, READ_END, READ_LOST)  # handed to the fast path at its start
EVENT_LAYOUT = (*EVENT_BITS, MISSED, SID_MASK)  # what fusefs._eventscore.scan reads events by
assert SERIAL_WRAP << SID_BITS <= min(RELEASED, READ) and 1 << SID_BITS <= min(READ_END, READ_LOST, MISSED)
HELD_MIN = 8 << 20  # bytes open handles may keep between reads, at least (else budget / 8)


def held_cap(cache_bytes: int) -> int:
    """What open handles may keep between reads: an eighth of the cache budget, at least
    HELD_MIN."""
    return max(HELD_MIN, cache_bytes // 8)


class Handles:
    def __init__(self, cap: int, room=None):
        """cap: what all handles may keep; room: what counts the kept bytes against the cache
        budget (cache.SampleCache's hold_for_reader and let_go_for_reader), or None."""
        self.cap = cap
        self.room = room
        self.open = 0      # dataset files open
        self.serial = 0    # the last handle's serial (the fast path's too)
        self.held: dict[int, bytes] = {}  # handle -> its sample's bytes, kept between reads
        self.held_bytes = 0

    def new(self, sid: int) -> int:
        """A handle for an open of sample sid."""
        self.open += 1
        self.serial = serial = (self.serial + 1) % SERIAL_WRAP
        return (serial << SID_BITS) | sid

    def count(self, opened: int, released: int, last: int) -> None:
        """The fast path opened `opened` handles, the last of them `last` (its serials go on
        from there), and released `released` (each let go of: let_go, where handles keep
        anything)."""
        self.open += opened - released
        if opened:
            self.serial = last >> SID_BITS

    def keep(self, fh: int, data: bytes) -> None:
        """Keep data for fh's next read, if it has none kept and the cap allows."""
        if fh not in self.held and self.held_bytes + len(data) <= self.cap:
            self.held[fh] = data
            self.held_bytes += len(data)
            if self.room is not None:
                self.room.hold_for_reader(fh & SID_MASK, data)

    def released(self, fh: int) -> None:
        """fh was closed: what it kept goes."""
        self.open -= 1
        if self.held:
            self.let_go(fh)

    def let_go(self, fh: int) -> None:
        """What fh kept between its reads goes (fh was closed)."""
        data = self.held.pop(fh, None)
        if data is not None:
            self.held_bytes -= len(data)
            if self.room is not None:
                self.room.let_go_for_reader(fh & SID_MASK)
