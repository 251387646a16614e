"""Mounting for tests, demos and benchmarks (not used by the daemon): `running_mount` runs
`fusefs mount` in a child process that dies with its owner, and always cleans up."""
from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time

from fusefs.mount import MountError
from fusefs.mounts import fusermount, is_mounted


@contextlib.contextmanager
def running_mount(dst, mnt, *args, timeout: float = 60.0, python: str = sys.executable,
                  env: dict | None = None):
    """`fusefs mount DST MNT ARGS` in a child process (environment `env`, default this
    process's); yield (process, log path).

    Always cleaned up: `fusermount3 -u -z` while MNT is in /proc/mounts, then wait,
    terminate, kill. And if the owner dies without cleaning up (SIGKILL, or a SIGTERM that
    skips `finally`), the daemon gets SIGTERM from the kernel and unmounts itself, so a
    killed test or benchmark leaves no mount behind. For tests, demos and benchmarks.
    """
    os.makedirs(mnt, exist_ok=True)
    log_path = f"{mnt}.log"
    with open(log_path, "wb") as logf:
        proc = subprocess.Popen([python, "-m", "fusefs", "mount", str(dst), str(mnt), *map(str, args)],
                                stdout=logf, stderr=subprocess.STDOUT, env=env,
                                preexec_fn=_die_with(os.getpid()))
    LIVE[str(mnt)] = proc
    try:
        deadline = time.monotonic() + timeout
        while not is_mounted(mnt):
            if proc.poll() is not None:
                raise MountError(f"fusefs mount exited {proc.returncode}: {open(log_path).read()}")
            if time.monotonic() > deadline:
                raise MountError(f"{mnt} did not appear within {timeout:.0f} s: {open(log_path).read()}")
            time.sleep(0.02)
        yield proc, log_path
    finally:
        LIVE.pop(str(mnt), None)
        stop_mount(mnt, proc)


# The daemons running_mount has started and not yet stopped, by mount point: what
# abort_all ends when a test runs out of time (testkit.guard).
LIVE: dict[str, subprocess.Popen] = {}


def abort_all() -> list[str]:
    """Kill every daemon running_mount holds (SIGKILL: it ends a stopped process too), so
    that a read blocked on one fails with an error, then unmount what they served, lazily;
    returns those mount points. The running_mount calls still clean up as they end."""
    aborted = list(LIVE)
    for mnt, proc in list(LIVE.items()):
        if proc.poll() is None:
            proc.kill()
    for mnt in aborted:
        if is_mounted(mnt):
            fusermount(mnt, lazy=True)
    return aborted


def _die_with(owner: int):
    """preexec_fn: SIGTERM this child when the process that started it dies."""
    def arm():
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        if os.getppid() != owner:  # the owner died before prctl took effect
            os.kill(os.getpid(), signal.SIGTERM)
    return arm


def stop_mount(mnt, proc=None) -> None:
    """Unmount (lazily, also a dead mount) and reap the daemon, escalating as needed."""
    if is_mounted(mnt):
        fusermount(mnt, lazy=True)
    if proc is not None:
        for step in (None, proc.terminate, proc.kill):
            if step is not None:
                step()
            try:
                proc.wait(timeout=15 if step is None else 5)
                return
            except subprocess.TimeoutExpired:
                continue


def resolve(index, path: bytes | str) -> tuple[str, int] | None:
    """('dir', d) or ('file', i) for a relative path in an index, or None."""
    if isinstance(path, str):
        path = os.fsencode(path)
    d = 0
    parts = [p for p in path.split(b"/") if p]
    for k, part in enumerate(parts):
        if k == len(parts) - 1:
            i = index.lookup_file(d, part)
            if i is not None:
                return ("file", i)
        sub = index.lookup_dir(d, part)
        if sub is None:
            return None
        d = sub
    return ("dir", d)
