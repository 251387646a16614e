"""Who can read or change what: for the modes of what fusefs writes or shows (never more open
than its sources) and for what a root daemon may trust."""
from __future__ import annotations

import os
import stat

import numpy as np


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
    def of_path(cls, path: bytes) -> int:
        """The reach of the folder at path (every folder from / down to it)."""
        reach, here = cls.EVERYONE, b"/"
        for part in [b""] + [p for p in path.split(b"/") if p]:
            here = os.path.join(here, part)
            reach = cls.reach(reach, os.stat(here))
        return reach

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
