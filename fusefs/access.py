"""Who can read or change what: for the modes of what fusefs writes or shows (never more open
than its sources) and for what a root daemon may trust."""
from __future__ import annotations

import errno
import os
import pwd
import stat

import numpy as np

from . import beneath


class Access:
    """Who could read what in the source tree, for the modes of what pack writes (never more
    open than the sources). A folder's `reach` says which users, beside its owner, can get
    into it, folders above it included: EVERYONE (every folder up to / searchable by
    others), NOBODY, or a group id (every folder searchable by others or by that group)."""

    EVERYONE, NOBODY = -1, -2

    @classmethod
    def reach(cls, above: int, st) -> int:
        """The reach of a folder with stat st, under a folder whose reach is `above`."""
        if above == cls.NOBODY:
            return cls.NOBODY
        if st.st_mode & 0o001:
            return above
        if st.st_mode & 0o010 and above in (cls.EVERYONE, st.st_gid):
            return st.st_gid
        return cls.NOBODY

    @classmethod
    def open_real(cls, path: str | bytes) -> tuple[bytes, int, int]:
        """(real path, descriptor, reach) of the folder at path (a command line's source).
        It may be reached through links, but not through one that a user other than root and
        this process's owns (another user's `~/ds` linking into a folder only root may enter:
        AnotherUsersLink). Its real path is opened from / without following a link (one
        swapped in on the way since is refused: ELOOP), and its reach is judged by the folders
        of that real path, from the descriptors the walk opened."""
        real = resolve(path)
        fd = os.open(b"/", beneath.DIR_FLAGS)
        try:
            reach = cls.reach(cls.EVERYONE, os.fstat(fd))
            for part in [p for p in real.split(b"/") if p]:
                nxt = os.open(part, beneath.DIR_FLAGS, dir_fd=fd)
                os.close(fd)
                fd = nxt
                reach = cls.reach(reach, os.fstat(fd))
        except BaseException:
            os.close(fd)
            raise
        return real, fd, reach

    @classmethod
    def mode(cls, modes, gids, reaches) -> tuple[int, int | None]:
        """(mode, group) for a file holding entries of these modes, groups and reaches (their
        folder's): owner read-write; others read if every entry was readable by others;
        group read (and that group) if every entry was readable by one group."""
        modes, gids, reaches = (np.asarray(x, dtype=np.int64) for x in (modes, gids, reaches))
        mode = 0o600
        if len(modes) and np.all((modes & 0o004) > 0) and np.all(reaches == cls.EVERYONE):
            mode |= 0o004
        group = int(gids[0]) if len(gids) else None
        if group is not None and np.all(gids == group) and np.all((modes & 0o040) > 0) and \
                np.all((reaches == cls.EVERYONE) | (reaches == group)):
            mode |= 0o040
        return mode, (group if mode & 0o040 else None)


def others_can_change(st, euid: int) -> bool:
    """Whether a user other than root and euid could change the file or folder of stat st
    (its owner, a group-writable one's group other than root's, or anyone where others may
    write; a sticky folder keeps others from renaming or removing what they do not own)."""
    if st.st_uid not in (0, euid):
        return True
    sticky = stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_ISVTX
    if st.st_mode & 0o002 and not sticky:
        return True
    return bool(st.st_mode & 0o020 and st.st_gid != 0 and not sticky)


class AnotherUsersLink(OSError):
    """A path given on the command line passes through a symbolic link that another user
    owns: they could point it anywhere root may read."""

    def __init__(self, path: bytes, link: bytes, owner: int, real: bytes):
        super().__init__(errno.EPERM, f"{os.fsdecode(link)} is a symbolic link of user {_user(owner)}, "
                         "not followed (they could point it at what only you may read); give the "
                         f"path it leads to, {os.fsdecode(real)}, if that is what you mean",
                         os.fsdecode(path))


MAX_LINKS = 40  # as the kernel's bound on links in one path (ELOOP past it)


def resolve(path: str | bytes) -> bytes:
    """The real path of path (as os.path.realpath), or AnotherUsersLink where a link on the
    way is owned by a user other than root and this process's, or OSError (ENOENT, ELOOP)."""
    path = os.fsencode(path)
    if not path.startswith(b"/"):
        path = os.path.join(os.getcwdb(), path)
    parts = [p for p in path.split(b"/") if p]
    parts.reverse()  # (a stack: the next component last)
    here, links = b"/", 0
    while parts:
        part = parts.pop()
        if part == b".":
            continue
        if part == b"..":
            here = os.path.dirname(here)
            continue
        nxt = os.path.join(here, part)
        st = os.lstat(nxt)
        if not stat.S_ISLNK(st.st_mode):
            here = nxt
            continue
        links += 1
        if links > MAX_LINKS:
            raise OSError(errno.ELOOP, "too many levels of symbolic links", os.fsdecode(path))
        if st.st_uid not in (0, os.geteuid()):
            raise AnotherUsersLink(path, nxt, st.st_uid, os.fsencode(os.path.realpath(path)))
        target = os.readlink(nxt)
        if target.startswith(b"/"):
            here = b"/"
        parts.extend(reversed([p for p in target.split(b"/") if p]))
    return here


def _user(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)
