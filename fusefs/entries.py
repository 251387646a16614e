"""The plain values the filesystem core hands to the FUSE adapter."""
from __future__ import annotations

import os
from dataclasses import dataclass

DATA_TIMEOUT = 24 * 3600.0  # the dataset is immutable: let the kernel keep entries a day
# With kernel opens (core.Core.kernel_opens) a file's name gets entry timeout 0 (every open
# looks it up again, which tells the read-ahead where the readers are), except in answer to
# a lookup while no order is set: nothing needs the signal then, and a reader that makes
# several path calls per file (stat, then open: fio, tar) has them answered by the kernel
# for this long. (Listings always give 0, so a tree listed before the first order, as
# ImageFolder does, is looked up at its opens under it; and an order makes the kernel
# forget the names it keeps from lookups made without one: core.Core.set_order.)
UNORDERED_ENTRY_TIMEOUT = 1.0
BLKSIZE = 131072  # every file's st_blksize, and the mount's statfs block size


class FsError(Exception):
    def __init__(self, code: int, why: str = ""):
        super().__init__(why or os.strerror(code))
        self.errno = code


@dataclass(frozen=True)
class Attr:
    ino: int
    mode: int
    size: int
    mtime_ns: int
    nlink: int = 1
    timeout: float = DATA_TIMEOUT
    gid: int | None = None  # None: the mount's group
    entry_timeout: float | None = None  # of the name (None: timeout)


@dataclass(frozen=True)
class OpenResult:
    fh: int
    direct_io: bool = False
    keep_cache: bool = True
