"""The system's mount table and unmounting: the one place that reads /proc/mounts and runs
fusermount3."""
from __future__ import annotations

import os
import re
import subprocess

_ESCAPE = re.compile(r"\\([0-7]{3})")


def _unescape(field: str) -> str:
    """/proc/mounts writes space, tab, newline and backslash as octal escapes (\\040 ...)."""
    return _ESCAPE.sub(lambda m: chr(int(m.group(1), 8)), field)


def table() -> list[tuple[str, str]]:
    """(mount point, filesystem type) of every mount, in /proc/mounts' order."""
    out = []
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 3:
                    out.append((_unescape(parts[1]), parts[2]))
    except OSError:
        pass
    return out


def is_mounted(mnt: str) -> bool:
    """mnt is in the mount table (true for a dead FUSE mount too, unlike os.path.ismount)."""
    mnt = os.path.realpath(mnt)
    return any(point == mnt for point, _ in table())


def mount_of(path: str) -> tuple[str, str]:
    """(mount point, filesystem type) of the mount holding path (("", "unknown") if none is
    found); the last of those mounted on one point, as the kernel shows it."""
    path = os.path.realpath(path)
    best, best_type = "", "unknown"
    for point, kind in table():
        if (path == point or path.startswith(point.rstrip("/") + "/")) and len(point) >= len(best):
            best, best_type = point, kind
    return best, best_type


def fs_type(path: str) -> str:
    """The filesystem type of the mount holding path ("unknown" if none is found)."""
    return mount_of(path)[1]


def fusermount(mnt: str, lazy: bool = False) -> subprocess.CompletedProcess:
    """`fusermount3 -u [-z] MNT`; the result says how it went (never raises for a failure)."""
    return subprocess.run(["fusermount3", "-u", *(["-z"] if lazy else []), str(mnt)],
                          capture_output=True, text=True)
