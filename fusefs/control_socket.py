"""The control socket: how a training process hands the daemon an order.

The mount is read-only for the kernel (findmnt shows `ro`, and every write through it is
EROFS, the order files' included), so orders come over a Unix socket of the daemon's,
in its runtime folder (mount.runtime_path), which the control namespace shows as the
symbolic link `MNT/.fusefs/control`. A client connects to the link's target
(client.write_order), sends one request and reads one answer line:

    order RANK SIZE\\n + SIZE bytes (an order, order.py's format)
      -> ok | refused WHY | denied | too large | busy | bad request

(the words: protocol.py, which the client reads too)

Trust: the kernel tells who connects (SO_PEERCRED, and SO_PEERGROUPS for the supplementary
groups); root, the daemon's user and, with --control-group, that group's members may set
orders, anyone else is `denied` at once, before the connection takes a slot. Limits: SIZE at
most the largest order that could be accepted (Core.order_limit: `too large` before a byte
of it is read), MAX_CONNECTIONS served at once, of which one is kept for root and the
daemon's user (a client past them is answered `busy` and closed; client.send_order asks
again), and a request must arrive whole within REQUEST_S of its accept or the connection is
dropped: together they bound what clients can make the daemon hold, and a client of the
control group that holds connections open, or drips its request, never keeps the owner
from setting an order. The commit itself (Core.commit_order) runs off the event loop.
"""
from __future__ import annotations

import errno
import logging
import mmap
import os
import socket
import stat
import struct
from typing import Awaitable, Callable

import trio

from .protocol import BAD_REQUEST, BUSY, DENIED, MAX_RANKS, OK, ORDER_VERB, REFUSED, TOO_LARGE
from .entries import FsError

log = logging.getLogger("fusefs")

MAX_CONNECTIONS = 4   # served at once (the last one only for root and the daemon's user)
REQUEST_S = 5.0       # a request's header and order arrive within this, from the accept
ANSWER_S = 5.0        # and its answer line is taken within this
HEADER_MAX = 64       # bytes of a request's first line
SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)
_UCRED = struct.Struct("3i")  # pid, uid, gid


class ControlSocketError(OSError):
    """The socket cannot be made (its path is taken by something that is not ours)."""


class ControlSocket:
    """Serves orders on a Unix socket at `path` (made here; the folder is the caller's,
    checked: its own, writable by no one else). `await commit(rank, data)` sets an order or
    raises FsError(EINVAL, why); may_control(uid, gids) says who may, trusted(uid) who is
    root or the daemon's user (the last slot is theirs); limit: the largest order."""

    def __init__(self, path: str, commit: Callable[[int, bytes], Awaitable[None]],
                 may_control: Callable[[int, set[int]], bool], limit: int,
                 trusted: Callable[[int], bool] = lambda uid: uid in (0, os.geteuid()),
                 room: Callable[[int], int] | None = None):
        self.path = path
        self.commit = commit
        self.may_control = may_control
        self.trusted = trusted
        self.limit = limit
        self.room = room  # (None: the requests are bounded by their number and limit only)
        self.receiving = 0  # bytes of the requests being read or committed (within room)
        self.receiving_trusted = 0  # of them, root's and the daemon's user's (within room too)
        self.active = 0
        self.counts = {"accepted": 0, "denied": 0, "busy": 0, "refused": 0, "too_large": 0,
                       "bad": 0, "timed_out": 0}
        self.sock = self._bind()

    def _bind(self) -> socket.socket:
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            pass
        else:  # (a socket a daemon of ours left behind when it was killed: replaced)
            if not stat.S_ISSOCK(st.st_mode) or st.st_uid != os.geteuid():
                raise ControlSocketError(errno.EEXIST, f"control socket {self.path}: something "
                                         "else is there (not a socket of this user's)")
            os.unlink(self.path)
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            s.bind(self.path)
            os.chmod(self.path, 0o666)  # (who may is decided by the peer's credentials)
            s.listen(16)
        except OSError:
            s.close()
            raise
        return s

    def counters(self) -> dict:
        return {"control_socket": dict(self.counts)}

    def close(self) -> None:
        self.sock.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    async def serve(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Accept and serve connections until cancelled."""
        listener = trio.socket.from_stdlib_socket(self.sock)
        task_status.started()
        async with trio.open_nursery() as nursery:
            while True:
                conn, _ = await listener.accept()
                refusal = None
                try:
                    uid, groups = _peer(conn)
                    if not self.may_control(uid, groups):  # (before it takes a slot)
                        refusal, counted = DENIED, "denied"
                    elif self.active >= MAX_CONNECTIONS - (0 if self.trusted(uid) else 1):
                        refusal, counted = BUSY, "busy"
                except OSError:
                    refusal, counted = BAD_REQUEST, "bad"
                if refusal is None:
                    self.active += 1
                    nursery.start_soon(self._serve_one, conn, self.trusted(uid))
                    continue
                self.counts[counted] += 1
                with conn, trio.move_on_after(1):  # (a line fits the empty buffer at once)
                    try:
                        await _send(conn, refusal.encode() + b"\n")
                    except OSError:
                        pass

    async def _serve_one(self, conn, trusted: bool = False) -> None:
        held = [0]  # (what this request holds of `receiving`, given back at its end)
        try:
            with conn:
                with trio.move_on_after(REQUEST_S) as scope:
                    request = await self._request(conn, trusted, held)
                if scope.cancelled_caught:  # (dropped: no answer)
                    self.counts["timed_out"] += 1
                    return
                answer = request if isinstance(request, bytes) else await self._commit(*request)
                del request  # (an order refused is let go of before its answer is sent)
                with trio.move_on_after(ANSWER_S):
                    await _send(conn, answer + b"\n")
        except OSError:
            pass  # (the client went away)
        except Exception:  # (never let a client end the daemon's loop)
            log.exception("control socket: unexpected error")
        finally:
            self.active -= 1
            self.receiving -= held[0]
            if trusted:
                self.receiving_trusted -= held[0]

    async def _request(self, conn, trusted: bool, held: list) -> tuple[int, bytes] | bytes:
        """(rank, order) of the request, or the answer that refuses it. What the requests
        being read and committed hold together stays within the room the order budget
        leaves (room(rank)): a request past it is answered `busy` (its client asks again)
        before a byte of it is read. Root's and the daemon's user's requests are held to the
        room among themselves only, so another's requests never keep them waiting; held[0]
        is what this one holds."""
        header, rest = await _line(conn)
        try:
            verb, rank, size = header.split(b" ")
            rank, size = int(rank), int(size)
            if verb != ORDER_VERB or not 0 <= rank < MAX_RANKS or size < 0:
                raise ValueError
        except ValueError:
            self.counts["bad"] += 1
            return BAD_REQUEST.encode()
        if size > self.limit:
            self.counts["too_large"] += 1
            return TOO_LARGE.encode()
        if self.room is not None and \
                (self.receiving_trusted if trusted else self.receiving) + size > self.room(rank):
            self.counts["busy"] += 1
            return BUSY.encode()
        self.receiving += size
        if trusted:
            self.receiving_trusted += size
        held[0] = size
        data = await _exactly(conn, rest, size)
        if data is None:
            self.counts["bad"] += 1
            return BAD_REQUEST.encode()
        return rank, data

    async def _commit(self, rank: int, data: bytes) -> bytes:
        try:
            await self.commit(rank, data)
        except FsError as e:
            self.counts["refused"] += 1
            return f"{REFUSED} {' '.join(str(e).split())}".encode()
        self.counts["accepted"] += 1
        return OK.encode()


def _peer(conn) -> tuple[int, set[int]]:
    """The connecting process's uid and groups (its gid and supplementary ones, as the
    kernel had them when it connected)."""
    pid, uid, gid = _UCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
    try:  # (Python takes at most 1024 bytes: 256 groups)
        raw = conn.getsockopt(socket.SOL_SOCKET, SO_PEERGROUPS, 1024)
        groups = set(struct.unpack(f"{len(raw) // 4}I", raw[:len(raw) // 4 * 4]))
    except OSError:  # (more groups, or a kernel before 4.13: the process's, from procfs,
        # which the kernel answers from memory, like the daemon's own statm)
        groups = _proc_groups(pid)
    return uid, groups | {gid}


def _proc_groups(pid: int) -> set[int]:
    try:
        with open(f"/proc/{pid}/status") as f:
            line = next((x for x in f if x.startswith("Groups:")), "Groups:")
        return {int(g) for g in line.split()[1:]}
    except (OSError, ValueError):
        return set()


async def _line(conn) -> tuple[bytes, bytes]:
    """The request's first line, without its newline (b"" if none within HEADER_MAX), and
    what was read past it (the order's first bytes)."""
    buf = b""
    while b"\n" not in buf and len(buf) < HEADER_MAX:
        got = await conn.recv(HEADER_MAX - len(buf))
        if not got:
            break
        buf += got
    line, sep, rest = buf.partition(b"\n")
    return (line if sep else b""), rest


# an order at least this large is read into memory of its own (an anonymous mapping), which
# goes back to the system as soon as the order is let go of, whatever the heap keeps
# (mount.tune_malloc has it keep freed pages)
MAPPED_FROM = 1 << 20


async def _exactly(conn, start: bytes, size: int):
    """size bytes of the request, the first of them `start`, read into one buffer of size
    bytes (a bytes-like object; None: the client stopped short)."""
    buf = mmap.mmap(-1, size) if size >= MAPPED_FROM else bytearray(size)
    view = memoryview(buf)
    try:
        at = min(len(start), size)
        view[:at] = start[:at]
        while at < size:
            got = await conn.recv_into(view[at:], min(1 << 20, size - at))
            if not got:
                return None
            at += got
    finally:
        view.release()
    return buf


async def _send(conn, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[await conn.send(view):]
