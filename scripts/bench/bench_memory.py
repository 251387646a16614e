"""The daemon's memory against its budget (issue 45): RSS after an epoch of many small
samples, and with handles held open by another user. Prints JSON lines (appended to
scripts/bench/results/bench_memory.jsonl).

  small   --files small files of 0.5-3 KB (random bytes, 100 class folders) packed locally
          and mounted with --cache-size; 4 reader processes read every file once in a
          shuffled order that the mount is told; the daemon's RSS (VmRSS) and the cache's
          entries and bytes at the end: what each entry costs beyond its bytes.
  handles --handles files of the same set opened by `nobody` (uid 65534, through
          -o allow_other) and each read a byte at a time with O_DIRECT (each read reaches the daemon), all
          held open at once; the daemon's RSS then, and after they are closed.

The base (RSS of a fresh mount before any read), the RSS once the order is written (its
plan and the ids table, before any read) and the index's size are printed beside; the cost
per cache entry is counted from the latter.
usage: .venv/bin/python scripts/bench/bench_memory.py [--files 1000000] [--cache-size 64MiB]
       [--handles 800] [--out out/bench_memory]
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import subprocess
import sys
import tempfile
import time

from common import REPO, JsonLines

from fusefs.index import INDEX_NAME, Index
from fusefs.pack import pack
from testkit.mounts import running_mount
from trainer import mount_stats, write_order

NOBODY = 65534


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmRSS:"))


def make_small(root: str, n: int, seed: int = 0) -> None:
    """n files of 0.5-3 KB of random bytes in 100 class folders (written once, kept)."""
    if os.path.isdir(root) and sum(len(f) for _, _, f in os.walk(root)) == n:
        return
    rng = random.Random(seed)
    blob = os.urandom(4096)
    for c in range(100):
        os.makedirs(os.path.join(root, f"c{c:03d}"), exist_ok=True)
    for i in range(n):
        size = rng.randint(512, 3072)
        off = rng.randint(0, len(blob) - size)
        with open(os.path.join(root, f"c{i % 100:03d}", f"{i:07d}.bin"), "wb") as f:
            f.write(i.to_bytes(8, "little") + blob[off:off + size - 8])


def read_share(mnt: str, paths: list[str]) -> None:
    for p in paths:
        with open(os.path.join(mnt, p), "rb") as f:
            f.read()


HOLD = """
import os, sys, json
mnt, n = sys.argv[1], int(sys.argv[2])
paths = json.loads(sys.stdin.readline())[:n]
fds = [os.open(os.path.join(mnt, p), os.O_RDONLY | os.O_DIRECT) for p in paths]  # (reads reach the daemon as asked)
for off in (0, 1):
    for fd in fds:
        os.pread(fd, 1, off)
print("held", len(fds), flush=True)
sys.stdin.readline()
"""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--files", type=int, default=1_000_000)
    p.add_argument("--cache-size", default="64MiB")
    p.add_argument("--handles", type=int, default=800)
    p.add_argument("--out", default=os.path.join(REPO, "out", "bench_memory"))
    JsonLines.argument(p, "bench_memory")
    a = p.parse_args()
    lines = JsonLines(a.results)
    src = os.path.join(a.out, f"src-{a.files}")
    dst = os.path.join(a.out, f"packed-{a.files}")
    mnt = os.path.join(tempfile.mkdtemp(prefix="fusefs-mem-"), "mnt")  # (a path nobody can reach)
    os.chmod(os.path.dirname(mnt), 0o755)
    t = time.perf_counter()
    make_small(src, a.files)
    if not os.path.exists(os.path.join(dst, INDEX_NAME)):
        pack(src, dst, force=True, progress=False)
    print(f"{a.files:,} small files ready in {time.perf_counter() - t:.0f} s", flush=True)
    index = Index.load(os.path.join(dst, INDEX_NAME))
    paths = [os.fsdecode(index.file_path(i)) for i in range(index.n_files)]
    index_bytes = os.path.getsize(os.path.join(dst, INDEX_NAME))
    random.Random(1).shuffle(paths)
    os.makedirs(mnt, exist_ok=True)

    with running_mount(dst, mnt, "--cache-size", a.cache_size, "-o", "allow_other") as (proc, _):
        base = rss(proc.pid)
        write_order(mnt, [os.path.join(mnt, x) for x in paths])
        ordered = rss(proc.pid)  # (the order's plan and the ids table, before any read)
        t = time.perf_counter()
        ctx = mp.get_context("fork")
        readers = [ctx.Process(target=read_share, args=(mnt, paths[k::4])) for k in range(4)]
        for r in readers:
            r.start()
        for r in readers:
            r.join()
        s = mount_stats(mnt)
        row = {"part": "small", "files": a.files, "cache_size": a.cache_size, "seconds": round(time.perf_counter() - t, 1),
               "rss_base": base, "rss_after_order": ordered, "rss_end": rss(proc.pid), "index_bytes": index_bytes,
               "cache_budget": s["cache_budget"], "cache_bytes": s["cache_bytes"],
               "cache_samples": s["cache_samples"], "eio": s["eio"]}
        row["over_budget"] = row["rss_end"] - row["rss_base"] - row["cache_budget"]
        row["per_entry_beyond_bytes"] = round((row["rss_end"] - row["rss_after_order"] - row["cache_bytes"])
                                              / max(1, row["cache_samples"]))
        print(json.dumps(row), flush=True)
        lines.write(bench="bench_memory", **row)

        before = rss(proc.pid)
        hold = subprocess.Popen(["/usr/bin/python3", "-c", HOLD, mnt, str(a.handles)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True, user=NOBODY, group=NOBODY)
        hold.stdin.write(json.dumps(paths[:a.handles]) + "\n")
        hold.stdin.flush()
        said = hold.stdout.readline().strip()
        held = rss(proc.pid)
        s = mount_stats(mnt)
        hold.stdin.write("\n")
        hold.stdin.close()
        hold.wait(timeout=60)
        row = {"part": "handles", "handles": a.handles, "cache_size": a.cache_size, "held_by": "nobody",
               "reader_said": said, "rss_before": before, "rss_held": held, "rss_after": rss(proc.pid),
               "held_bytes": s["held_bytes"], "open_handles": s["open_handles"],
               "cache_budget": s["cache_budget"], "index_bytes": index_bytes, "rss_base": base}
        print(json.dumps(row), flush=True)
        lines.write(bench="bench_memory", **row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
