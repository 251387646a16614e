"""Opening a file beneath a folder without following a symbolic link on the way.

A packed folder (its index and chunk files) and a tree being packed may be another user's,
and the daemon and `fusefs pack` often run as root: a path read from an index, or a file of
a tree, must not lead outside the folder it names, to a file root may read and its author
may not. Every component of a relative path is opened from the descriptor of the folder
above it with O_NOFOLLOW (a walk from a folder descriptor the caller opened and trusts: the
one named on the command line), so a link anywhere on the way is refused (ELOOP), whoever
made it and whenever it was swapped in; `.`, `..` and empty components are refused. The
file itself is opened O_NONBLOCK (a FIFO or a device never blocks the open) and only a
regular file is accepted.
"""
from __future__ import annotations

import errno
import os
import stat

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class NotRegular(OSError):
    """What the path names is not a regular file (a FIFO, a device, a folder, a socket)."""

    def __init__(self, path: str, what: str):
        super().__init__(errno.EINVAL, f"not a regular file ({what})", path)


def components(rel: str | bytes) -> list:
    """The components of a relative path, or ValueError for one that could leave its folder
    or is not a plain path (absolute, `.`, `..`, empty components, a NUL byte)."""
    sep, nul = (b"/", b"\0") if isinstance(rel, bytes) else ("/", "\0")
    parts = rel.split(sep)
    if not rel or nul in rel or any(p in ("", ".", "..", b"", b".", b"..") for p in parts):
        raise ValueError(f"{rel!r} is not a plain relative path")
    return parts


def kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISLNK, "a symbolic link")):
        if test(mode):
            return name
    return "not a regular file"


def open_dir(dir_fd: int, rel: str | bytes) -> int:
    """A descriptor of the folder rel beneath dir_fd, no link followed on the way."""
    fd = os.dup(dir_fd)
    try:
        for part in components(rel):
            try:
                nxt = os.open(part, DIR_FLAGS, dir_fd=fd)
            except OSError as e:
                if e.errno in (errno.ENOTDIR, errno.ELOOP) and _is_link(part, fd):
                    raise OSError(errno.ELOOP, "a symbolic link", os.fsdecode(part)) from None
                raise
            os.close(fd)
            fd = nxt
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_absolute(path: str) -> int:
    """A descriptor of the folder at the absolute path, opened from / without following a
    link anywhere on the way (ELOOP)."""
    if not path.startswith("/"):
        raise ValueError(f"{path!r} is not an absolute path")
    root = os.open("/", DIR_FLAGS)
    try:
        return os.dup(root) if path.strip("/") == "" else open_dir(root, path.strip("/"))
    finally:
        os.close(root)


def _is_link(name, dir_fd: int) -> bool:
    try:
        return stat.S_ISLNK(os.lstat(name, dir_fd=dir_fd).st_mode)
    except OSError:
        return False


def open_file(dir_fd: int, rel: str | bytes, flags: int = os.O_RDONLY) -> int:
    """A descriptor of the regular file rel beneath dir_fd (opened with flags, and
    O_NONBLOCK, O_NOFOLLOW, O_CLOEXEC): no link followed on the way (ELOOP), anything but a
    regular file refused (NotRegular), `..` and absolute paths refused (ValueError)."""
    parts = components(rel)
    parent = open_dir(dir_fd, (b"/" if isinstance(rel, bytes) else "/").join(parts[:-1])) \
        if len(parts) > 1 else dir_fd
    try:
        fd = os.open(parts[-1], flags | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent)
    finally:
        if parent != dir_fd:
            os.close(parent)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise NotRegular(os.fsdecode(rel), kind(mode))
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def why(e: OSError) -> str:
    """A refusal's reason, in words (ELOOP: a link on the way)."""
    if e.errno == errno.ELOOP:
        return "a symbolic link (not followed)"
    if e.errno == errno.ENOTDIR:
        return "a folder on the way is not a folder (or is a symbolic link)"
    return e.strerror or str(e)
