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


def others_can_change(st, euid: int, acl: bytes | None = None) -> bool:
    """Whether a user other than root and euid could change the file or folder of stat st
    (its owner, a group-writable one's group other than root's, anyone where others may
    write, or a user or group other than root's that its POSIX access ACL lets write; a
    sticky folder keeps others from renaming or removing what they do not own). acl: the
    file's `system.posix_acl_access` (acl_of), or None."""
    if st.st_uid not in (0, euid):
        return True
    if stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_ISVTX:
        return False
    if st.st_mode & 0o002:
        return True
    return bool(st.st_mode & 0o020 and st.st_gid != 0) or _acl_lets_write(acl, euid)


ACL_XATTR = "system.posix_acl_access"
# the kernel's ACL xattr: a u32 version (2), then entries of (u16 tag, u16 perm, u32 id)
ACL_USER, ACL_GROUP, ACL_MASK = 0x02, 0x08, 0x10
ACL_WRITE = 0x02


def acl_of(target, follow_symlinks: bool = True) -> bytes | None:
    """The POSIX access ACL of target (a descriptor or a path), or None where it has none
    (or its filesystem keeps none)."""
    try:
        return os.getxattr(target, ACL_XATTR, follow_symlinks=follow_symlinks)
    except OSError as e:
        if e.errno in (errno.ENODATA, errno.ENOTSUP, errno.EOPNOTSUPP):
            return None
        raise


def _acl_lets_write(acl: bytes | None, euid: int) -> bool:
    """Whether acl gives write to a named user other than root and euid, or a named group
    other than root's, through its mask (an ACL that cannot be read counts as giving it)."""
    if not acl:
        return False
    if len(acl) < 4 or (len(acl) - 4) % 8 or int.from_bytes(acl[:4], "little") != 2:
        return True
    entries = [(int.from_bytes(acl[i:i + 2], "little"), int.from_bytes(acl[i + 2:i + 4], "little"),
                int.from_bytes(acl[i + 4:i + 8], "little")) for i in range(4, len(acl), 8)]
    mask = next((perm for tag, perm, _ in entries if tag == ACL_MASK), 0o7)
    return any(perm & mask & ACL_WRITE and ((tag == ACL_USER and qid not in (0, euid)) or
                                            (tag == ACL_GROUP and qid != 0))
               for tag, perm, qid in entries)


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
