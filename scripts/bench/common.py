"""Helpers the benchmarks share (each benchmark runs from this folder, so `import common`
finds it without any sys.path edit; importing it puts scripts/ on sys.path, for testkit,
the harness the tests share)."""
from __future__ import annotations

import contextlib
import datetime
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import psutil

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if os.path.join(REPO, "scripts") not in sys.path:
    sys.path.insert(1, os.path.join(REPO, "scripts"))
WORKLOADS = os.path.join(REPO, "scripts", "workloads")
# the benchmarks' figures, JSON lines (docs/BENCHMARKS.md's tables are generated from them:
# tables.py)
RESULTS = os.path.join(REPO, "scripts", "bench", "results")


def git(*args: str) -> str:
    """git's output in the repository, stripped ('' when git fails)."""
    return subprocess.run(["git", "-C", REPO, *args], capture_output=True, text=True).stdout.strip()


def commit() -> str:
    """The commit the figures come from: HEAD, short, with "+dirty" when fusefs/ or
    trainer/ differ from it; $FUSEFS_COMMIT where set (a copy of the tree on the GPU node,
    whose .git, if any, is not this checkout's)."""
    if os.environ.get("FUSEFS_COMMIT"):
        return os.environ["FUSEFS_COMMIT"]
    head = git("rev-parse", "--short", "HEAD") or "unknown"
    return head + ("+dirty" if git("status", "--porcelain", "fusefs", "trainer") else "")


def machine() -> str:
    """This machine in a few words: its host name, its cores, its kernel's version and the
    GPUs nvidia-smi lists."""
    gpus = ""
    if shutil.which("nvidia-smi"):
        names = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                               capture_output=True, text=True, timeout=60).stdout.split("\n")
        gpus = ", ".join(n.strip() for n in names if n.strip())
    return (f"{socket.gethostname()}, {os.cpu_count()} cores, kernel {platform.release()}"
            + (f", {gpus}" if gpus else ""))


class JsonLines:
    """A benchmark's figures as JSON lines appended to `path` as each is measured, so that a
    run cut short keeps what it measured; every line carries the commit, the date (UTC), the
    machine and the command that printed it."""

    def __init__(self, path: str):
        self.path = path
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.context = {"commit": commit(), "machine": machine(),
                        "command": " ".join([os.path.relpath(sys.argv[0], REPO), *sys.argv[1:]]),
                        "started": utc_now()}  # (the rows of one run share it)

    @staticmethod
    def argument(parser, name: str) -> None:
        """The benchmark's --results option: where its JSON lines go (default
        scripts/bench/results/NAME.jsonl, which docs/BENCHMARKS.md's tables come from)."""
        parser.add_argument("--results", default=os.path.join(RESULTS, f"{name}.jsonl"),
                            help="append the figures to this file as JSON lines (default %(default)s)")

    def write(self, **row) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps({**row, **self.context, "date": utc_now()}) + "\n")


@contextlib.contextmanager
def against(ref: str):
    """(short commit, PYTHONPATH) of fusefs at commit REF: a git worktree of it with its
    compiled parts built (as its own setup.py builds them), removed afterwards; a daemon
    started with that PYTHONPATH and PYTHONSAFEPATH=1 runs REF's fusefs."""
    short = git("rev-parse", "--short", ref)
    worktree = tempfile.mkdtemp(prefix="fusefs-against-")
    subprocess.run(["git", "-C", REPO, "worktree", "add", "-f", "--detach", worktree, short],
                   check=True, capture_output=True)
    try:
        if os.path.exists(os.path.join(worktree, "setup.py")):
            subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"],
                           cwd=worktree, check=True, capture_output=True)
        yield short, worktree
    finally:
        subprocess.run(["git", "-C", REPO, "worktree", "remove", "--force", worktree], capture_output=True)


@contextlib.contextmanager
def side_by_side(ref: str | None):
    """{version: daemon environment} for the working tree's fusefs and, with ref, REF's
    (its worktree built: against): what a benchmark runs side by side, REF first."""
    here = {commit(): dict(os.environ, PYTHONPATH=REPO, PYTHONSAFEPATH="1")}
    if ref is None:
        yield here
        return
    with against(ref) as (short, worktree):
        yield {short: dict(os.environ, PYTHONPATH=worktree, PYTHONSAFEPATH="1"), **here}


def warm_chunks(packed: str) -> None:
    """Read a packed set's chunk files (wherever its index puts them) into the page cache."""
    from fusefs.index import INDEX_NAME, Index
    for chunk in Index.load(os.path.join(packed, INDEX_NAME)).chunks:
        with open(os.path.join(packed, chunk.path), "rb") as f:
            while f.read(16 << 20):
                pass


def read_files(paths: list[str]) -> int:
    """Read each file whole with Python's open(), as a DataLoader worker's loader does; the
    bytes read."""
    n = 0
    for p in paths:
        with open(p, "rb") as f:
            n += len(f.read())
    return n


def utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def run_trainer(script: str, args: list[str], show=None, python: str = "/usr/bin/python3") -> list[dict]:
    """Run scripts/workloads/<script> under `python` (Debian's, with torchvision) with the
    repository on PYTHONPATH (before what it held); it prints one JSON row per epoch (or one
    in all), each handed to show(row) as it comes. Returns the rows; stops the benchmark if
    the script fails."""
    cmd = [python, os.path.join(WORKLOADS, script), *args]
    path = os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))
    rows = []
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True,
                          env=dict(os.environ, PYTHONPATH=path)) as p:
        for line in p.stdout:
            rows.append(json.loads(line))
            if show is not None:
                show(rows[-1])
    if p.returncode:
        raise SystemExit(f"{script} {' '.join(args)} failed: exit {p.returncode}")
    return rows


@contextlib.contextmanager
def minimal_daemon(src: str, mnt: str, timeout: float = 300.0, script: str | None = None,
                   args: tuple = (), command: list[str] | None = None):
    """scripts/bench/minimal_daemon.py serving src at mnt (it reads every file into RAM
    before it mounts), or `script SRC MNT ARGS` (a variant of it: tests), or `COMMAND SRC
    MNT ARGS` (the C one, built by build_minimal_c); yields its process; always
    unmounted and reaped."""
    from testkit.mounts import stop_mount
    os.makedirs(mnt, exist_ok=True)
    script = script or os.path.join(REPO, "scripts", "bench", "minimal_daemon.py")
    proc = subprocess.Popen([*(command or [sys.executable, script]), src, mnt, *args])
    try:
        deadline = time.monotonic() + timeout
        while not os.path.ismount(mnt):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the minimal daemon did not mount {src} at {mnt}")
            time.sleep(0.05)
        yield proc
    finally:
        stop_mount(mnt, proc)


def build_minimal_c(out_dir: str) -> str:
    """Compile scripts/bench/minimal_c_daemon.c into out_dir, unless built from this source
    already; its path. gcc with libfuse3's flags from pkg-config (scripts/setup.sh installs
    both), or from FUSE3_CFLAGS and FUSE3_LIBS where libfuse3 lies elsewhere (the GPU node:
    docs/TESTING.md)."""
    source = os.path.join(REPO, "scripts", "bench", "minimal_c_daemon.c")
    binary = os.path.join(out_dir, "minimal_c_daemon")
    if not os.path.exists(binary) or os.path.getmtime(binary) < os.path.getmtime(source):
        if "FUSE3_CFLAGS" in os.environ or "FUSE3_LIBS" in os.environ:
            flags = [*os.environ.get("FUSE3_CFLAGS", "").split(), *os.environ.get("FUSE3_LIBS", "").split()]
        else:
            flags = subprocess.run(["pkg-config", "--cflags", "--libs", "fuse3"], capture_output=True,
                                   text=True, check=True).stdout.split()
        subprocess.run(["gcc", "-O2", "-o", binary, source, *flags], check=True)
    return binary


def cpu_seconds(pid: int) -> float:
    """A process's user + system CPU seconds so far (0 once it is gone)."""
    try:
        t = psutil.Process(pid).cpu_times()
    except psutil.Error:
        return 0.0
    return t.user + t.system


def pids_named(name: str) -> list[int]:
    """The pids of the processes whose command is exactly name."""
    return [p.pid for p in psutil.process_iter(["name"]) if p.info["name"] == name]


class CpuMeter:
    """Who spent the machine's CPU over a stretch of a benchmark: groups of processes given
    by pid (the storage's client and servers, a daemon), this process's children that ended
    and were waited for within the stretch (the readers it ran), and how busy the machine's
    cores were (`busy`: the share of all cores' time not idle or waiting for I/O). Use as a
    context manager; `seconds` then holds each group's CPU seconds and `children`'s, and
    `machine_seconds` all cores' busy seconds (every process's and the kernel's). A group's
    process that ends within the stretch counts nothing (its figures are gone)."""

    def __init__(self, **groups: list[int]):
        self.groups = groups
        self.seconds: dict[str, float] = {}
        self.busy = 0.0
        self.machine_seconds = 0.0

    def _now(self) -> dict[tuple[str, int], float]:
        me = psutil.Process().cpu_times()
        now = {(name, p): cpu_seconds(p) for name, pids in self.groups.items() for p in pids}
        now["children", 0] = me.children_user + me.children_system
        return now

    @staticmethod
    def _idle() -> tuple[float, float]:
        t = psutil.cpu_times()
        return t.idle + t.iowait, sum(t)

    def __enter__(self) -> "CpuMeter":
        self._start, self._ticks = self._now(), self._idle()
        return self

    def __exit__(self, *exc) -> None:
        end, (idle, total) = self._now(), self._idle()
        self.seconds = dict.fromkeys([*self.groups, "children"], 0.0)
        for (name, pid), t in end.items():
            self.seconds[name] += max(0.0, t - self._start[name, pid])
        self.busy = 1 - (idle - self._ticks[0]) / max(1e-9, total - self._ticks[1])
        self.machine_seconds = max(0.0, (total - self._ticks[1]) - (idle - self._ticks[0]))
