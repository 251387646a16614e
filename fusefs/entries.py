"""The plain values the filesystem core hands to the FUSE adapter."""
from __future__ import annotations

import os
from dataclasses import dataclass

DATA_TIMEOUT = 24 * 3600.0  # the dataset is immutable: let the kernel keep entries a day
BLKSIZE = 131072  # every file's st_blksize, and the mount's statfs block size
# open flags that would change a file: refused (EROFS) for the dataset's files and the control files
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_TRUNC | os.O_APPEND | os.O_CREAT


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
    uid: int | None = None  # None: the mount's owner (--uid)


@dataclass(frozen=True)
class OpenResult:
    fh: int
    direct_io: bool = False
    keep_cache: bool = True
