"""The user's runtime folder, where a daemon keeps its log and control socket, and the log
files: opened without following a link, taken only if the user's own, and rotated at a
size (one older file kept) so that a long-running daemon's log stays bounded."""
from __future__ import annotations

import errno
import hashlib
import logging
import os
import stat

from .errors import UserError


class RuntimeFolderError(UserError):
    """A runtime folder or log file that is not the user's own; the message names it."""


RUNTIME_ENV = "FUSEFS_RUNTIME_DIR"  # the runtime folder instead of the user's default


def runtime_path(mnt: str, suffix: str) -> str:
    """A file of the mount at mnt in the user's runtime folder: $FUSEFS_RUNTIME_DIR if set
    (an absolute path), else /run/fusefs for root, $XDG_RUNTIME_DIR/fusefs or
    ~/.cache/fusefs; named by the mount point's base name and a hash of its whole path,
    then suffix: `.log` (a background mount's log unless --log says), `.sock` (the control
    socket). The folder must be the user's own (own_folder checks it)."""
    mnt = os.path.abspath(mnt)
    if os.environ.get(RUNTIME_ENV, "").startswith("/"):
        folder = os.environ[RUNTIME_ENV]
    elif os.geteuid() == 0:
        folder = "/run/fusefs"
    elif os.environ.get("XDG_RUNTIME_DIR", "").startswith("/"):
        folder = os.path.join(os.environ["XDG_RUNTIME_DIR"], "fusefs")
    else:
        folder = os.path.join(os.path.expanduser("~"), ".cache", "fusefs")
    tag = hashlib.sha256(os.fsencode(mnt)).hexdigest()[:10]
    name = os.path.basename(mnt)[:40] or "root"  # (a socket's path has at most 107 bytes)
    return os.path.join(folder, f"{name}-{tag}{suffix}")


def default_log_path(mnt: str) -> str:
    return runtime_path(mnt, ".log")


def own_folder(folder: str) -> None:
    """Make folder if missing (0755: others reach the control sockets in it, each file is
    protected by its own mode) and check that it is this user's, writable by no one else
    and not a link; RuntimeFolderError if not."""
    os.makedirs(folder, mode=0o755, exist_ok=True)
    st = os.lstat(folder)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise RuntimeFolderError(f"{folder}: the runtime folder must be your own, writable by no one else")
    if st.st_mode & 0o055 != 0o055:  # (made 0700 by an older fusefs: others must reach the sockets)
        os.chmod(folder, stat.S_IMODE(st.st_mode) | 0o055)


def open_log(path: str, own: bool = False) -> int:
    """A descriptor of the log file at path, opened for appending without following a
    symbolic link, made 0600; only a regular file of this user's with no other name is
    taken. own: the folder is the user's runtime folder (own_folder)."""
    folder = os.path.dirname(os.path.abspath(path))
    if own:
        own_folder(folder)
    try:  # (non-blocking: a FIFO without a reader fails at once instead of waiting)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC
                     | os.O_NONBLOCK, 0o600)
    except OSError as e:
        why = {errno.ELOOP: "a symbolic link", errno.ENXIO: "not a regular file"}.get(e.errno, e.strerror)
        raise RuntimeFolderError(f"log file {path}: {why}") from None
    st = os.fstat(fd)
    why = ("not a regular file" if not stat.S_ISREG(st.st_mode)
           else f"owned by uid {st.st_uid}, not by this user ({os.geteuid()})" if st.st_uid != os.geteuid()
           else "it has other names (hard links)" if st.st_nlink > 1 else None)
    if why is not None:
        os.close(fd)
        raise RuntimeFolderError(f"log file {path}: {why}; give a log file of your own")
    os.set_blocking(fd, True)
    return fd


LOG_MAX_BYTES = 16 << 20  # a log file is rotated past this (the --log-max-size default)
LOG_FILE_ENV = "FUSEFS_LOG_FILE"  # a background mount's log, for its daemon (which rotates it)


class RotatingLog(logging.Handler):
    """Log records appended to the file at path (open_log), which is renamed to path.1
    (replacing an older one) and opened anew once it holds max_bytes. std: the process's
    stdout and stderr are that file too (a background daemon's): they follow it."""

    def __init__(self, path: str, max_bytes: int = LOG_MAX_BYTES, std: bool = False):
        super().__init__()
        self.path, self.max_bytes, self.std = path, max_bytes, std
        self.fd = open_log(path)
        self.size = os.fstat(self.fd).st_size
        self.rotations = 0

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = (self.format(record) + "\n").encode(errors="replace")
            with self.lock:
                if self.size and self.size + len(line) > self.max_bytes:
                    self._rotate()
                os.write(self.fd, line)
                self.size += len(line)
        except Exception:
            self.handleError(record)

    def _rotate(self) -> None:
        """path -> path.1, a new path; on any failure the current file goes on growing
        (one warning line in it) rather than losing lines."""
        try:
            os.rename(self.path, self.path + ".1")
            fd = open_log(self.path)
        except (OSError, UserError) as e:
            os.write(self.fd, f"log rotation failed ({e}): this file goes on\n".encode())
            self.max_bytes *= 2
            return
        if self.std:
            os.dup2(fd, 1)
            os.dup2(fd, 2)
        os.close(self.fd)
        self.fd, self.size = fd, 0
        self.rotations += 1

    def close(self) -> None:
        with self.lock:
            if self.fd >= 0:
                os.close(self.fd)
                self.fd = -1
        super().close()
