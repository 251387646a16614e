"""A storage node that stops answering, for tests: a pyfuse3 daemon serving a folder tree
from RAM (read whole at its start), every read reaching it (direct I/O, no page cache),
until SIGUSR1: from then on each read (of one file, if it was given one) fails with EIO,
as a node's client fails while the node is away, until SIGUSR2. A packed folder put behind it is one whose chunks' node goes
away and comes back on a signal, with the fusefs mount over it as it would be over a
network filesystem.

    with outage_backend(src, mnt, only="chunks/chunk-000003.fck") as node:  # mnt serves src
        node.fail(); ...; node.answer()

usage: python -m testkit.outage SRC MNT [ONLY]   (foreground; SIGTERM or fusermount3 -u to stop)
"""
from __future__ import annotations

import contextlib
import errno
import os
import signal
import stat
import subprocess
import sys
import time

import trio

from fusefs import pyfuse3


class Node(pyfuse3.Operations):
    def __init__(self, src: str, only: str | None = None):
        super().__init__()
        self.failing = False
        self.only = None  # (the inode of the one file whose reads fail, if given)
        self.children: dict[int, dict[bytes, int]] = {pyfuse3.ROOT_INODE: {}}
        self.data: dict[int, bytes] = {}
        inos, nxt = {os.path.abspath(src): pyfuse3.ROOT_INODE}, pyfuse3.ROOT_INODE + 1
        for d, subs, files in os.walk(src):
            parent = inos[os.path.abspath(d)]
            for name in sorted(subs):
                inos[os.path.abspath(os.path.join(d, name))] = nxt
                self.children[parent][os.fsencode(name)] = nxt
                self.children[nxt] = {}
                nxt += 1
            for name in sorted(files):
                with open(os.path.join(d, name), "rb") as f:
                    self.data[nxt] = f.read()
                if only is not None and os.path.join(d, name) == os.path.join(src, only):
                    self.only = nxt
                self.children[parent][os.fsencode(name)] = nxt
                nxt += 1

    def _attr(self, ino: int) -> pyfuse3.EntryAttributes:
        e = pyfuse3.EntryAttributes()
        e.st_ino = ino
        e.entry_timeout = e.attr_timeout = 3600.0
        if ino in self.children:
            e.st_mode, e.st_size = stat.S_IFDIR | 0o755, 0
        else:
            e.st_mode, e.st_size = stat.S_IFREG | 0o644, len(self.data[ino])
        e.st_uid, e.st_gid = os.getuid(), os.getgid()
        return e

    async def lookup(self, parent, name, ctx=None):
        ino = self.children.get(parent, {}).get(name)
        if ino is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return self._attr(ino)

    async def getattr(self, inode, ctx=None):
        return self._attr(inode)

    async def opendir(self, inode, ctx):
        return inode

    async def readdir(self, fh, start_id, token):
        items = list(self.children[fh].items())
        for i in range(start_id, len(items)):
            if not pyfuse3.readdir_reply(token, items[i][0], self._attr(items[i][1]), i + 1):
                break

    async def open(self, inode, flags, ctx):
        return pyfuse3.FileInfo(fh=inode, direct_io=True)

    async def read(self, fh, off, size):
        if self.failing and self.only in (None, fh):
            raise pyfuse3.FUSEError(errno.EIO)
        return self.data[fh][off:off + size]


async def _serve(node: Node) -> None:
    async with trio.open_nursery() as n:
        async def signals():
            with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM, signal.SIGUSR1,
                                           signal.SIGUSR2) as it:
                async for sig in it:
                    if sig in (signal.SIGUSR1, signal.SIGUSR2):
                        node.failing = sig == signal.SIGUSR1
                        continue
                    pyfuse3.terminate()
                    return
        n.start_soon(signals)
        await pyfuse3.main()
        n.cancel_scope.cancel()


class Backend:
    """The running node's daemon: fail() and answer() switch its reads."""

    def __init__(self, proc: subprocess.Popen):
        self.proc = proc

    def fail(self) -> None:
        self.proc.send_signal(signal.SIGUSR1)

    def answer(self) -> None:
        self.proc.send_signal(signal.SIGUSR2)


@contextlib.contextmanager
def outage_backend(src, mnt, only: str | None = None, timeout: float = 60.0):
    """The daemon serving src at mnt (only: the one file, relative to src, whose reads it
    fails; None: all), in a child process, unmounted at the end whatever happens: yields
    its Backend."""
    from fusefs.mounts import is_mounted
    from testkit.mounts import _die_with, stop_mount
    os.makedirs(mnt, exist_ok=True)
    proc = subprocess.Popen([sys.executable, "-m", "testkit.outage", str(src), str(mnt),
                             *([only] if only is not None else [])],
                            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            preexec_fn=_die_with(os.getpid()))
    try:
        deadline = time.monotonic() + timeout
        while not is_mounted(str(mnt)):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the outage backend did not mount: {proc.stderr.read().decode()}")
            time.sleep(0.02)
        yield Backend(proc)
    finally:
        stop_mount(str(mnt), proc)


def main() -> int:
    src, mnt = sys.argv[1], sys.argv[2]
    node = Node(src, sys.argv[3] if len(sys.argv) > 3 else None)
    pyfuse3.init(node, mnt, set(pyfuse3.default_options) | {"fsname=outage"})
    try:
        trio.run(_serve, node)
    finally:
        pyfuse3.close(unmount=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
