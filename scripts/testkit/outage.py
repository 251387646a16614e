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
import subprocess
import sys
import time

import trio

from bench.minimal_daemon import RamFS
from fusefs import pyfuse3


class Node(RamFS):
    """The minimal daemon's tree from RAM (bench/minimal_daemon.py), every read reaching it
    (direct I/O), failing with EIO while `failing` (only's reads alone, if given)."""

    def __init__(self, src: str, only: str | None = None):
        super().__init__(src)
        self.failing = False
        self.only = None  # (the inode of the one file whose reads fail, if given)
        if only is not None:
            ino = pyfuse3.ROOT_INODE
            for part in only.split("/"):
                ino = self.children[ino][os.fsencode(part)]
            self.only = ino

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
