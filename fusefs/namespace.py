"""The packed dataset's tree as a filesystem's names: inode numbers, attributes, lookups
and listings, all from the in-memory index (no backend I/O, no state that changes).

Inode numbers:
    1 .. n_dirs                      directories (1 is the root, directory 0 of the index)
    ctrl_dir = n_dirs + 1            the hidden control folder `.fusefs` (control.py)
    ctrl_dir + 1 ..                  its files (control.FILES of them, CTRL_SLOTS reserved)
    file_base + sid                  the files; sid is the sample id in the index

The files show the owner and permission bits of the mount's files section
(config.FilesConfig: --uid, --gid, --file-mode, --dir-mode, --umask over the packed modes).
"""
from __future__ import annotations

import errno
import os
import stat

import numpy as np

from .config import FilesConfig, presented_modes
from .control import FILES
from .entries import BLKSIZE, DATA_TIMEOUT, Attr, FsError
from .index import CONTROL_NAME, Index

ROOT = 1
CTRL_SLOTS = 128  # inodes reserved for the control namespace: room for control.FILES to grow
assert FILES < CTRL_SLOTS


def control_dir(index: Index) -> int:
    """The inode of the control folder `.fusefs` of index's tree."""
    return index.n_dirs + 1


def file_base(index: Index) -> int:
    """The inode of index's first file (sample 0): past the control namespace's slots."""
    return control_dir(index) + CTRL_SLOTS


class Namespace:
    def __init__(self, index: Index, files: FilesConfig, control):
        """index's tree, its files owned and moded as files says, with the control
        namespace (control.ControlNamespace, at control_dir(index)) under `.fusefs`."""
        self.index = index
        self.control = control
        self.uid = os.getuid() if files.uid is None else files.uid
        self.gid = os.getgid() if files.gid is None else files.gid
        # the permission bits shown (--file-mode, --dir-mode, --umask over the packed ones)
        self.file_mode = presented_modes(index.mode, files.file_mode, files.umask)
        self.dir_mode = presented_modes(index.dir_mode, files.dir_mode, files.umask)
        self.ctrl_dir = control_dir(index)
        self.file_base = file_base(index)

    def sid_of(self, ino: int) -> int | None:
        sid = ino - self.file_base
        return sid if 0 <= sid < self.index.n_files else None

    def dir_of(self, ino: int) -> int | None:
        return ino - 1 if 1 <= ino <= self.index.n_dirs else None

    def file_attr(self, sid: int) -> Attr:
        ix = self.index
        return Attr(self.file_base + sid, stat.S_IFREG | int(self.file_mode[sid]), int(ix.size[sid]),
                    int(ix.mtime_ns[sid]))

    def dir_attr(self, d: int) -> Attr:
        ix = self.index
        return Attr(d + 1, stat.S_IFDIR | int(self.dir_mode[d]), 0, int(ix.dir_mtime_ns[d]),
                    nlink=2 + int(ix.dir_nsubs[d]))

    def lookup(self, parent: int, name: bytes) -> Attr:
        if parent == ROOT and name == CONTROL_NAME:
            return self.control.dir_attr()
        if parent == self.ctrl_dir:
            return self.control.lookup(name)
        d = self.dir_of(parent)
        if d is None:
            raise FsError(errno.ENOTDIR)
        sid = self.index.lookup_file(d, name)
        if sid is not None:
            return self.file_attr(sid)
        sub = self.index.lookup_dir(d, name)
        if sub is not None:
            return self.dir_attr(sub)
        raise FsError(errno.ENOENT)

    def getattr(self, ino: int) -> Attr:
        sid = self.sid_of(ino)
        if sid is not None:
            return self.file_attr(sid)
        d = self.dir_of(ino)
        if d is not None:
            return self.dir_attr(d)
        return self.control.getattr(ino)

    def readdir(self, ino: int, start: int):
        """Yield (name, Attr, next_offset) from position start; `.fusefs` is never listed."""
        if ino == self.ctrl_dir:
            yield from self.control.readdir(start)
            return
        d = self.dir_of(ino)
        if d is None:
            raise FsError(errno.ENOTDIR)
        ix = self.index
        first_sub, nsubs = int(ix.dir_first_sub[d]), int(ix.dir_nsubs[d])
        first_file, nfiles = int(ix.dir_first_file[d]), int(ix.dir_nfiles[d])
        for pos in range(start, nsubs + nfiles):
            if pos < nsubs:
                sub = first_sub + pos
                yield ix.dir_name(sub), self.dir_attr(sub), pos + 1
            else:
                sid = first_file + pos - nsubs
                yield ix.file_name(sid), self.file_attr(sid), pos + 1

    def opendir(self, ino: int) -> int:
        if self.dir_of(ino) is None and ino != self.ctrl_dir:
            raise FsError(errno.ENOTDIR)
        return ino

    def statfs(self) -> dict:
        ix = self.index
        return {"bsize": BLKSIZE, "blocks": (ix.total_bytes + BLKSIZE - 1) // BLKSIZE,
                "files": ix.n_files + ix.n_dirs, "namemax": 255}

    def tree(self) -> dict:
        """What the fast path answers the lookups of files' names from, as lookup() does
        (pyfuse3.fast_path_tree): the index's arrays and the attributes' parts."""
        ix = self.index
        return {"dir_first_file": ix.dir_first_file, "dir_nfiles": ix.dir_nfiles,
                "name_off": ix.file_name_off, "name_len": ix.file_name_len,
                "names": np.frombuffer(ix.names, dtype=np.uint8), "size": ix.size, "mode": self.file_mode,
                "mtime_ns": ix.mtime_ns, "uid": self.uid, "gid": self.gid, "timeout": DATA_TIMEOUT,
                "blksize": BLKSIZE}
