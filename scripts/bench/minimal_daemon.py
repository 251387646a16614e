"""A minimal pyfuse3 + trio daemon serving a folder tree from RAM: the peer that shows what
the binding itself costs per request (no order, no cache logic, no checksums).

Every file is read into a dict at start; entries and attributes carry a day's timeout;
open answers keep_cache, so a file's pages stay in the kernel across opens; no flush
handler (the kernel then stops sending flush). It counts requests by type and reports them
with its CPU time (getrusage) in the file STATS_NAME at the root, read by name only.

usage: python scripts/bench/minimal_daemon.py SRC MNT   (foreground; SIGTERM or fusermount3 -u to stop)
"""
from __future__ import annotations

import errno
import json
import os
import resource
import signal
import stat
import sys

import trio

from fusefs import pyfuse3  # (the binding fusefs builds: pyfuse3 with its patches)

STATS_NAME = b".minimal-stats"
DAY = 24 * 3600.0


class RamFS(pyfuse3.Operations):
    def __init__(self, src: str):
        super().__init__()
        self.entries: dict[int, tuple[bytes, int]] = {}  # ino -> (name, parent)
        self.children: dict[int, dict[bytes, int]] = {pyfuse3.ROOT_INODE: {}}
        self.data: dict[int, bytes] = {}
        self.requests: dict[str, int] = {}
        self.ioctl0 = pyfuse3.ioctl_requests() if hasattr(pyfuse3, "ioctl_requests") else 0
        self.cpu0 = self._cpu()
        next_ino = pyfuse3.ROOT_INODE + 1
        inos = {os.path.abspath(src): pyfuse3.ROOT_INODE}
        for d, subs, files in os.walk(src):
            parent = inos[os.path.abspath(d)]
            for name in sorted(subs):
                inos[os.path.abspath(os.path.join(d, name))] = next_ino
                self.children[parent][os.fsencode(name)] = next_ino
                self.children[next_ino] = {}
                next_ino += 1
            for name in sorted(files):
                with open(os.path.join(d, name), "rb") as f:
                    self.data[next_ino] = f.read()
                self.children[parent][os.fsencode(name)] = next_ino
                next_ino += 1
        self.stats_ino = next_ino
        self.snapshots: dict[int, bytes] = {}
        self.next_snapshot = 1 << 62

    @staticmethod
    def _cpu() -> float:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime

    def _count(self, name: str) -> None:
        self.requests[name] = self.requests.get(name, 0) + 1

    def _stats(self) -> bytes:
        requests = dict(self.requests)
        if hasattr(pyfuse3, "ioctl_requests"):  # (answered in C: fusefs's binding)
            requests["ioctl"] = pyfuse3.ioctl_requests() - self.ioctl0
        out = {"cpu_s": self._cpu() - self.cpu0, "requests": requests}
        if hasattr(pyfuse3, "loop_tasks_started"):  # (fusefs's binding)
            out["loop_tasks"] = pyfuse3.loop_tasks_started()
        return json.dumps(out).encode()

    def _attr(self, ino: int) -> pyfuse3.EntryAttributes:
        e = pyfuse3.EntryAttributes()
        e.st_ino = ino
        e.entry_timeout = e.attr_timeout = DAY
        if ino in self.children:
            e.st_mode, e.st_size = stat.S_IFDIR | 0o755, 0
        else:
            size = len(self._stats()) if ino == self.stats_ino else len(self.data[ino])
            e.st_mode, e.st_size = stat.S_IFREG | 0o444, size
            if ino == self.stats_ino:
                e.entry_timeout = e.attr_timeout = 0
        e.st_uid, e.st_gid = os.getuid(), os.getgid()
        return e

    async def lookup(self, parent, name, ctx=None):
        self._count("lookup")
        if parent == pyfuse3.ROOT_INODE and name == STATS_NAME:
            return self._attr(self.stats_ino)
        ino = self.children.get(parent, {}).get(name)
        if ino is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return self._attr(ino)

    async def getattr(self, inode, ctx=None):
        self._count("getattr")
        return self._attr(inode)

    async def opendir(self, inode, ctx):
        self._count("opendir")
        return inode

    async def readdir(self, fh, start_id, token):
        self._count("readdir")
        items = list(self.children[fh].items())
        for i in range(start_id, len(items)):
            name, ino = items[i]
            if not pyfuse3.readdir_reply(token, name, self._attr(ino), i + 1):
                break

    async def releasedir(self, fh):
        self._count("releasedir")

    async def open(self, inode, flags, ctx):
        self._count("open")
        if inode == self.stats_ino:  # a snapshot per open, under a handle of its own
            self.snapshots[self.next_snapshot] = self._stats()
            self.next_snapshot += 1
            return pyfuse3.FileInfo(fh=self.next_snapshot - 1, direct_io=True)
        return pyfuse3.FileInfo(fh=inode, keep_cache=True)

    async def read(self, fh, off, size):
        self._count("read")
        data = self.snapshots[fh] if fh in self.snapshots else self.data[fh]
        return data[off:off + size]

    async def release(self, fh):
        self._count("release")
        self.snapshots.pop(fh, None)


async def _main():
    async with trio.open_nursery() as n:
        async def signals():
            with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as it:
                async for _ in it:
                    pyfuse3.terminate()
                    return
        n.start_soon(signals)
        await pyfuse3.main()
        n.cancel_scope.cancel()


def main() -> int:
    src, mnt = sys.argv[1], sys.argv[2]
    fs = RamFS(src)
    opts = set(pyfuse3.default_options) | {"fsname=minimal"}
    pyfuse3.init(fs, mnt, opts)
    try:
        trio.run(_main)
    finally:
        pyfuse3.close(unmount=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
