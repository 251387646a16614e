"""The pyfuse3 adapter: inode numbers and attributes in, FUSE errors out.

All filesystem logic lives in core.Core; this class only translates. No exception other
than FUSEError may escape a handler (it would end pyfuse3.main and leave a dead mount):
FsError becomes its errno, anything unexpected is logged with a traceback and is EIO.
"""
from __future__ import annotations

import errno
import functools
import logging

import trio

from . import pyfuse3
from .core import Core
from .entries import BLKSIZE, Attr, FsError

log = logging.getLogger("fusefs")


def _translate(fn):
    """Count the request by type (stats "requests") and turn errors into FUSEError; first
    apply what the fast path answered before the request came (fastpath.py)."""
    name = fn.__name__

    @functools.wraps(fn)
    async def wrapper(self, *args, **kwargs):
        counts = self.requests
        counts[name] = counts.get(name, 0) + 1
        try:
            if self.catch_up is not None:
                self.catch_up()
            return await fn(self, *args, **kwargs)
        except pyfuse3.FUSEError:
            raise
        except FsError as e:
            raise pyfuse3.FUSEError(e.errno) from None
        except Exception:
            log.exception("unexpected error in %s", name)
            raise pyfuse3.FUSEError(errno.EIO) from None
    return wrapper


class KernelCache:
    """The kernel page cache of the mount, for Core's `kernel`: fetched samples are pushed into
    it from the fetch's worker threads (kernel_view.KernelView.push). Pushed pages are clean page
    cache: the kernel reclaims them under memory pressure, they never count in the daemon's
    RSS, and nothing invalidates them (an early version invalidated each sample after its
    last use, which measured slower than leaving that to the kernel)."""

    @staticmethod
    def push(items) -> list[int]:
        """Store each (inode, data) of items as the file's pages, all in one stretch without
        the GIL (the binding's notify_store_many); an errno per item (0: stored)."""
        return pyfuse3.notify_store_many(items)


class Operations(pyfuse3.Operations):
    supports_dot_lookup = False
    enable_writeback_cache = False
    enable_acl = False

    def __init__(self, core: Core, catch_up=None):
        """core: the filesystem; catch_up(): applies the fast path's events waiting now
        (FastPath.catch_up, called before each request answered here), or None."""
        super().__init__()
        self.core = core
        self.catch_up = catch_up
        self.requests: dict[str, int] = {}  # requests answered here, by type
        self._ioctls = pyfuse3.ioctl_requests()  # (answered by the binding in C, from here on)
        self._interrupted = pyfuse3.reads_interrupted()  # (reads answered EINTR by the binding)
        self.initialized = trio.Event()  # (set as the kernel's INIT is answered: init)

    def init(self) -> None:
        """(pyfuse3, as it answers the kernel's INIT: the answer is written once this returns,
        before the next task runs.)"""
        self.initialized.set()

    def counters(self) -> dict:
        """The requests answered, by type (this adapter's, and the binding's ioctls), and
        the tasks pyfuse3's request loop started (for Core.statistics)."""
        return {"requests": {**self.requests, "ioctl": pyfuse3.ioctl_requests() - self._ioctls},
                "loop_tasks": pyfuse3.loop_tasks_started(),
                "reads_interrupted": pyfuse3.reads_interrupted() - self._interrupted}

    def _entry(self, a: Attr) -> pyfuse3.EntryAttributes:
        e = pyfuse3.EntryAttributes()
        e.st_ino = a.ino
        e.generation = 0
        e.entry_timeout = a.timeout
        e.attr_timeout = a.timeout
        e.st_mode = a.mode
        e.st_nlink = a.nlink
        e.st_uid = self.core.uid if a.uid is None else a.uid
        e.st_gid = self.core.gid if a.gid is None else a.gid
        e.st_rdev = 0
        e.st_size = a.size
        e.st_blksize = BLKSIZE
        e.st_blocks = (a.size + 511) // 512
        e.st_atime_ns = e.st_mtime_ns = e.st_ctime_ns = a.mtime_ns
        return e

    @_translate
    async def lookup(self, parent_inode, name, ctx=None):
        return self._entry(self.core.lookup(parent_inode, name))

    @_translate
    async def getattr(self, inode, ctx=None):
        return self._entry(self.core.getattr(inode))

    @_translate
    async def readlink(self, inode, ctx):
        return self.core.readlink(inode)

    @_translate
    async def opendir(self, inode, ctx):
        return self.core.opendir(inode)

    @_translate
    async def readdir(self, fh, start_id, token):
        for name, attr, nxt in self.core.readdir(fh, start_id):
            if not pyfuse3.readdir_reply(token, name, self._entry(attr), nxt):
                break

    @_translate
    async def releasedir(self, fh):
        pass

    @_translate
    async def open(self, inode, flags, ctx):
        r = self.core.open(inode, flags, ctx.uid)
        return pyfuse3.FileInfo(fh=r.fh, direct_io=r.direct_io, keep_cache=r.keep_cache)

    @_translate
    async def read(self, fh, off, size):
        return await self.core.read(fh, off, size)

    # No flush and no fsync: pyfuse3's default answers ENOSYS, and the kernel then sends no
    # more of them at all (one round trip less per sample read). No write: the mount is
    # read-only (orders come over the control socket).

    @_translate
    async def release(self, fh):
        self.core.release(fh)

    @_translate
    async def statfs(self, ctx):
        info = self.core.statfs()
        s = pyfuse3.StatvfsData()
        s.f_bsize = s.f_frsize = info["bsize"]
        s.f_blocks = info["blocks"]
        s.f_bfree = s.f_bavail = 0
        s.f_files = info["files"]
        s.f_ffree = s.f_favail = 0
        s.f_namemax = info["namemax"]
        return s

    @_translate
    async def getxattr(self, inode, name, ctx):
        raise pyfuse3.FUSEError(pyfuse3.ENOATTR)

    @_translate
    async def listxattr(self, inode, ctx):
        return []

    async def forget(self, inode_list):  # (must not raise: it answers no request)
        self.requests["forget"] = self.requests.get("forget", 0) + 1
        try:
            self.core.forget(ino for ino, _ in inode_list)
        except Exception:
            log.exception("unexpected error in forget")

    @_translate
    async def fsyncdir(self, fh, datasync):
        pass


# Every operation that would change the dataset is refused as on a read-only filesystem.
for _name in ("setattr", "create", "mknod", "mkdir", "unlink", "rmdir", "symlink", "rename",
              "link", "setxattr", "removexattr"):
    async def _erofs(self, *args, **kwargs):
        raise pyfuse3.FUSEError(errno.EROFS)
    _erofs.__name__ = _name
    setattr(Operations, _name, _translate(_erofs))
