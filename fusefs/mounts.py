"""The system's mount table and unmounting: the one place that reads /proc/mounts and runs
fusermount3; and why the system's FUSE refused a mount (what to do about it). Standard
library only: a user's Python without fusefs's packages can ask it."""
from __future__ import annotations

import os
import re
import shutil
import stat
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


def device_of(point: str) -> str | None:
    """MAJOR:MINOR of the last FUSE mount on point (a resolved path, as the mount table
    shows it), or None: read from /proc/self/mountinfo, so nothing of the mount is touched
    (a daemon asks it of its own mount before it serves)."""
    dev = None
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                fields = left.split()
                if len(fields) >= 5 and right.startswith("fuse") and _unescape(fields[4]) == point:
                    dev = fields[2]
    except OSError:
        return None
    return dev


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


def fusermount(mnt: str, lazy: bool = False, timeout: float = 60) -> subprocess.CompletedProcess:
    """`fusermount3 -u [-z] MNT`; the result says how it went (never raises for a failure:
    one that has not ended after `timeout` seconds is killed and reported as failed)."""
    cmd = ["fusermount3", "-u", *(["-z"] if lazy else []), str(mnt)]
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return subprocess.CompletedProcess(cmd, 1, "", f"fusermount3 did not end within {timeout:g} s")
    except OSError as e:
        return subprocess.CompletedProcess(cmd, 1, "", f"fusermount3: {e.strerror}")


def why_fuse_refused(options, dev: str = "/dev/fuse", conf: str = "/etc/fuse.conf",
                     euid: int | None = None) -> str:
    """What to do about a mount that libfuse refused, as far as can be told from here: a
    /dev/fuse this user may not open, allow_other without `user_allow_other` in
    /etc/fuse.conf (non-root), a fusermount3 that is missing or not setuid (non-root), or
    else an option neither fusefs nor FUSE knows."""
    euid = os.geteuid() if euid is None else euid
    given = {o.split("=", 1)[0] for item in options for o in item.split(",") if o}
    if not os.access(dev, os.R_OK | os.W_OK):
        try:
            st = os.stat(dev)
            import grp
            try:
                group = grp.getgrgid(st.st_gid).gr_name
            except KeyError:
                group = str(st.st_gid)
            how = f"it is mode {stat.S_IMODE(st.st_mode):04o}, group {group}: " + _dev_fix(st, group)
        except OSError:
            how = "it is missing: load the fuse module (modprobe fuse) or, in a container, pass the device in"
        return f"this user may not open {dev}; {how}"
    if euid != 0:
        if "allow_other" in given and not _user_allow_other(conf):
            return (f"allow_other needs a line 'user_allow_other' in {conf} (root adds it), or "
                    "mount without allow_other")
        helper = shutil.which("fusermount3")
        if helper is None or not os.stat(helper).st_mode & stat.S_ISUID:
            return ("fusermount3 is " + ("missing" if helper is None else f"not setuid root ({helper})") +
                    ": install the fuse3 package (Debian), which mounts FUSE filesystems for users")
    return (f"with -o {','.join(options) or '(none)'}: an option unknown to fusefs and to FUSE? "
            "(fusefs mount --help lists fusefs's own)")


def _dev_fix(st, group: str) -> str:
    """What an admin does so that users may open /dev/fuse, given its stat: what works
    (joining a group gives nothing where the group may not read and write it, and joining
    root's is no fix at all)."""
    rule = ('or makes a group "fuse" that may (a udev rule: KERNEL=="fuse", GROUP="fuse", '
            'MODE="0660") and adds you to it')
    if st.st_mode & 0o060 == 0o060 and st.st_gid != 0:
        return f"an admin adds you to group {group}, or makes it 0666 (Debian's default)"
    return f"an admin makes it 0666 (Debian's default) {rule}"


def _user_allow_other(conf: str) -> bool:
    try:
        with open(conf) as f:
            return any(line.split("#", 1)[0].strip() == "user_allow_other" for line in f)
    except OSError:
        return False
