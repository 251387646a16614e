"""The hidden control namespace `MNT/.fusefs/`.

Lookups reach it by name; the root's listing never shows it (ImageFolder would make a
class of it). Each control file renders its content when opened for reading. Nothing in
it is written: the mount is read-only for the kernel, and orders come over the control
socket (control_socket.py), which `control` links to; `order.<rank>` shows the order in
force. There is no flush: the daemon answers none, so the kernel stops sending one at every
close of every dataset file (a round trip per sample saved).

For users other than root and the daemon's, the stats and metrics texts are rendered at
most every RENDER_EVERY seconds, however often they are opened. Who may read what: the
stats, metrics and chunk table are public; the ids (every sample's path) and the order
files are readable by the daemon's user and the control group only.

What open control files hold: the ids and chunk tables are rendered per read (idstable.py),
so an open of them holds nothing; an order file's handle holds the order in force (the one
copy the order budget counts); a stats or metrics handle holds the text rendered at its
open. Users other than root and the daemon's may hold at most UNTRUSTED_HANDLES control
files open, whose texts at most UNTRUSTED_BYTES together: an open past either is refused
(ENFILE), so holding opens grows the daemon by a bounded amount.
"""
from __future__ import annotations

import errno
import json
import os
import stat
from dataclasses import dataclass, field
from typing import Callable

from . import protocol
from .protocol import MAX_RANKS
from .entries import WRITE_FLAGS, Attr, FsError, OpenResult
from .throttle import throttled

FH_BASE = 1 << 62  # control handles live far above every inode number
RENDER_EVERY = 0.25  # seconds: the stats and metrics are rendered at most this often
FILES = 5 + MAX_RANKS  # stats, metrics, ids, chunks, control and the order files: the inodes it takes
UNTRUSTED_HANDLES = 1024  # control files that users other than root and the daemon's may hold open
UNTRUSTED_BYTES = 1 << 20  # ... and the rendered texts those may hold, together


@dataclass(frozen=True)
class ControlHooks:
    """What the control files need from the rest of the daemon, and nothing more."""
    statistics: Callable[[], dict]
    ids_read: Callable[[int, int], bytes]     # (offset, size) of the ids table (idstable.py)
    chunks_read: Callable[[int, int], bytes]  # (offset, size) of the chunk table
    trusted: Callable[[int | None], bool]      # is this uid root or the daemon's user
    control_gid: int | None                    # the group that may set orders too, if any
    started: float                             # the daemon's start (the files' mtime)
    socket_path: str | None = None             # the control socket (`control` links to it)
    owner: int = field(default_factory=os.geteuid)  # the daemon's user: the control files' owner


class ControlFile:
    name: bytes = b""
    listed = True   # shown by a listing of `.fusefs`
    present = True  # reached by a lookup
    private = False  # readable by the daemon's user and the control group only
    streamed = False  # rendered per read (read_at), not at each open (render)

    def render(self, fresh: bool = False) -> bytes:
        """The file's content for a reader (fresh: a trusted one, see _Throttled)."""
        return b""

    def read_at(self, off: int, size: int) -> bytes:
        """A streamed file's bytes [off, off + size)."""
        raise NotImplementedError


class _Throttled(ControlFile):
    """A text rendered from the statistics at most every RENDER_EVERY seconds for users
    other than root and the daemon's (render(fresh=True): theirs): another user who opens
    it in a loop gets the same text again instead of the loop's time."""

    def __init__(self, hooks: ControlHooks):
        self.hooks = hooks
        self._get = throttled(lambda: self.text(self.hooks.statistics()), RENDER_EVERY)

    def render(self, fresh: bool = False) -> bytes:
        return self._get(fresh)

    def text(self, stats: dict) -> bytes:
        raise NotImplementedError


class StatsFile(_Throttled):
    """`.fusefs/stats`: the daemon's counters as JSON."""

    name = protocol.STATS.encode()

    def text(self, stats: dict) -> bytes:
        return (json.dumps(stats, indent=1, sort_keys=True) + "\n").encode()


class MetricsFile(_Throttled):
    """`.fusefs/metrics`: the same counters in the Prometheus text exposition format."""

    name = protocol.METRICS.encode()

    def text(self, stats: dict) -> bytes:
        from .metrics import exposition
        return exposition(stats)


class IdsFile(ControlFile):
    """`.fusefs/ids`: every sample's relative path, NUL-terminated; line k is id k."""

    name = protocol.IDS.encode()
    private = True
    streamed = True

    def __init__(self, hooks: ControlHooks):
        self.hooks = hooks

    def read_at(self, off: int, size: int) -> bytes:
        return self.hooks.ids_read(off, size)


class ChunksFile(ControlFile):
    """`.fusefs/chunks`: the chunk that holds each sample, u32 little-endian per id (for
    chunk-block orders, trainer/orders.py)."""

    name = protocol.CHUNKS.encode()
    streamed = True

    def __init__(self, hooks: ControlHooks):
        self.hooks = hooks

    def read_at(self, off: int, size: int) -> bytes:
        return self.hooks.chunks_read(off, size)


class OrderFile(ControlFile):
    """`.fusefs/order.<rank>` (`order` is rank 0): the order in force (order.py's format),
    as the last order accepted for the rank over the control socket."""

    private = True

    def __init__(self, hooks: ControlHooks, rank: int):
        self.hooks = hooks
        self.rank = rank
        self.name = protocol.order_name(rank).encode()
        self.listed = False
        self.current = b""

    def render(self, fresh: bool = False) -> bytes:
        return self.current


class ControlLink(ControlFile):
    """`.fusefs/control`: a symbolic link to the control socket (control_socket.py)."""

    name = protocol.CONTROL_SOCKET.encode()

    def __init__(self, hooks: ControlHooks):
        self.hooks = hooks
        self.listed = self.present = hooks.socket_path is not None  # (none: a core without a mount)


class _Handle:
    __slots__ = ("file", "content", "counted")

    def __init__(self, file: ControlFile, content: bytes | None, counted: int | None):
        self.file = file
        self.content = content  # None: a streamed file's
        self.counted = counted  # the bytes an untrusted user's handle counts, or None: trusted


class ControlNamespace:
    def __init__(self, hooks: ControlHooks, base_ino: int):
        self.hooks = hooks
        self.base = base_ino
        self.files: list[ControlFile] = [StatsFile(hooks), MetricsFile(hooks), IdsFile(hooks),
                                         ChunksFile(hooks), ControlLink(hooks)]
        self.files += [OrderFile(hooks, rank) for rank in range(MAX_RANKS)]
        assert len(self.files) == FILES
        self._slots = {f.name: slot for slot, f in enumerate(self.files) if f.present}
        self._slots[protocol.ORDER.encode()] = self._slots[protocol.order_name(0).encode()]
        self._handles: dict[int, _Handle] = {}
        self._next_fh = FH_BASE
        self.untrusted_handles = 0  # control files open by users other than root and the daemon's
        self.untrusted_bytes = 0    # the texts those hold
        self.refused = 0            # opens refused past those bounds

    def owns(self, ino: int) -> bool:
        return self.base <= ino <= self.base + len(self.files)

    # ---- metadata ----------------------------------------------------------------------
    def dir_attr(self):
        return Attr(self.base, stat.S_IFDIR | 0o755, 0, int(self.hooks.started * 1e9),
                    nlink=2, timeout=0.0, uid=self.hooks.owner)

    def _attr(self, slot: int):
        f = self.files[slot]
        if isinstance(f, ControlLink):
            return Attr(self.base + 1 + slot, stat.S_IFLNK | 0o777, len(os.fsencode(self.hooks.socket_path)),
                        int(self.hooks.started * 1e9), timeout=0.0, uid=self.hooks.owner)
        group = self.hooks.control_gid
        mode = 0o400  # (the daemon's user, whom they show as their owner, whatever --uid says)
        if group is not None and f.private:
            mode |= 0o040  # (and the control group)
        if not f.private:
            mode |= 0o044
        return Attr(self.base + 1 + slot, stat.S_IFREG | mode, 0, int(self.hooks.started * 1e9),
                    timeout=0.0, gid=group if f.private else None, uid=self.hooks.owner)

    def _slot(self, ino: int) -> int:
        slot = ino - self.base - 1
        if not 0 <= slot < len(self.files) or not self.files[slot].present:
            raise FsError(errno.ENOENT)
        return slot

    def lookup(self, name: bytes):
        slot = self._slots.get(name)
        if slot is None:
            raise FsError(errno.ENOENT)
        return self._attr(slot)

    def getattr(self, ino: int):
        return self.dir_attr() if ino == self.base else self._attr(self._slot(ino))

    def readdir(self, start: int):
        order = protocol.ORDER.encode()
        entries = [(order, self._slots[order])] + [
            (f.name, slot) for slot, f in enumerate(self.files) if f.listed]
        for pos in range(start, len(entries)):
            name, slot = entries[pos]
            yield name, self._attr(slot), pos + 1

    def readlink(self, ino: int) -> bytes:
        if not isinstance(self.files[self._slot(ino)], ControlLink):  # (_slot: present ones)
            raise FsError(errno.EINVAL)
        return os.fsencode(self.hooks.socket_path)

    # ---- data --------------------------------------------------------------------------
    def open(self, ino: int, flags: int, uid: int | None = None):
        if ino == self.base:
            raise FsError(errno.EISDIR)
        f = self.files[self._slot(ino)]
        if flags & WRITE_FLAGS:
            raise FsError(errno.EROFS)  # (orders come over the control socket)
        if isinstance(f, ControlLink):
            raise FsError(errno.ELOOP)
        trusted = self.hooks.trusted(uid)
        content = None if f.streamed else f.render(fresh=trusted)
        counted = None
        if not trusted:
            counted = 0 if content is None or isinstance(f, OrderFile) else len(content)
            if self.untrusted_handles >= UNTRUSTED_HANDLES or \
                    self.untrusted_bytes + counted > UNTRUSTED_BYTES:
                self.refused += 1
                raise FsError(errno.ENFILE)
            self.untrusted_handles += 1
            self.untrusted_bytes += counted
        fh = self._next_fh
        self._next_fh += 1
        self._handles[fh] = _Handle(f, content, counted)
        return OpenResult(fh=fh, direct_io=True, keep_cache=False)

    def _handle(self, fh: int) -> _Handle:
        h = self._handles.get(fh)
        if h is None:
            raise FsError(errno.EBADF)
        return h

    def read(self, fh: int, off: int, size: int) -> bytes:
        h = self._handle(fh)
        if h.content is None:
            return h.file.read_at(off, size)
        return h.content[off:off + size]

    def release(self, fh: int) -> None:
        h = self._handles.pop(fh, None)
        if h is not None and h.counted is not None:
            self.untrusted_handles -= 1
            self.untrusted_bytes -= h.counted

    def show_order(self, rank: int, data: bytes) -> None:
        """rank's order in force is now data: `order.<rank>` shows it."""
        self.files[self._slots[protocol.order_name(rank).encode()]].current = data

    @property
    def open_handles(self) -> int:
        return len(self._handles)

    def counters(self) -> dict:
        return {"control_untrusted_handles": self.untrusted_handles,
                "control_untrusted_bytes": self.untrusted_bytes, "control_opens_refused": self.refused}
