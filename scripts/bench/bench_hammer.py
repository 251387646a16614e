"""Ordinary reads while another user hammers the control files (issue 45, item 5): each
read's latency (open, read whole, close) quiet and while a process opens `.fusefs/stats` in
a loop, side by side in one run. Prints JSON lines (appended to
scripts/bench/results/bench_hammer.jsonl).

The set: --files samples of 2-20 KB packed locally, mounted by root with -o allow_other
and --no-kernel-cache, with eight ranks' orders written (the stats then carry eight plans,
which made a render cost 19-20 ms before it was throttled). A reader reads --reads samples
of the order, each fetched by the daemon's loop; three settings, each from a fresh mount:

  quiet        no one else
  other_user   `nobody` (uid 65534) opens the stats in a loop: rendered at most every
               0.25 s for them (control.RENDER_EVERY)
  root         root opens the stats in a loop: rendered afresh at every open, as every
               user's were before the throttle (what it saves)

Also the other user's opens per second and how many different texts they got.
usage: .venv/bin/python scripts/bench/bench_hammer.py [--files 20000] [--reads 2000]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import tempfile
import time

import numpy as np

from common import REPO, JsonLines

from fusefs.index import INDEX_NAME, Index
from fusefs.pack import pack
from testkit.mounts import running_mount
from trainer import write_order

NOBODY = 65534

HAMMER = """
import os, sys
path = os.path.join(sys.argv[1], '.fusefs', 'stats')
texts, opens = set(), 0
print('started', flush=True)
while True:
    with open(path, 'rb') as f:
        texts.add(hash(f.read()))
    opens += 1
    if opens % 100 == 0 and os.path.exists(sys.argv[2]):
        break
print(opens, len(texts), flush=True)
"""


def make_set(root: str, n: int) -> None:
    if os.path.isdir(root) and sum(len(f) for _, _, f in os.walk(root)) == n:
        return
    rng = random.Random(0)
    blob = os.urandom(1 << 15)
    for i in range(n):
        folder = os.path.join(root, f"c{i % 50:02d}")
        os.makedirs(folder, exist_ok=True)
        size = rng.randint(2048, 20480)
        with open(os.path.join(folder, f"{i:06d}.bin"), "wb") as f:
            f.write(i.to_bytes(8, "little") + blob[:size - 8])


def timed_reads(paths: list[str]) -> list[float]:
    out = []
    for p in paths:
        t = time.perf_counter()
        with open(p, "rb") as f:
            f.read()
        out.append(time.perf_counter() - t)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--files", type=int, default=20_000)
    p.add_argument("--reads", type=int, default=2_000)
    p.add_argument("--out", default=os.path.join(REPO, "out", "bench_hammer"))
    JsonLines.argument(p, "bench_hammer")
    a = p.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("bench_hammer: run as root (it mounts with allow_other and reads as nobody)")
    lines = JsonLines(a.results)
    src, dst = os.path.join(a.out, f"src-{a.files}"), os.path.join(a.out, f"packed-{a.files}")
    make_set(src, a.files)
    if not os.path.exists(os.path.join(dst, INDEX_NAME)):
        pack(src, dst, force=True, progress=False)
    index = Index.load(os.path.join(dst, INDEX_NAME))
    rels = [os.fsdecode(index.file_path(i)) for i in range(index.n_files)]
    base = tempfile.mkdtemp(prefix="fusefs-hammer-")
    os.chmod(base, 0o755)  # (nobody reaches the mount point)
    mnt, stop = os.path.join(base, "mnt"), os.path.join(base, "stop")
    quiet_p90 = None
    for setting in ("quiet", "other_user", "root"):
        with running_mount(dst, mnt, "--cache-size", "256MiB", "--no-kernel-cache", "-o", "allow_other"):
            rng = random.Random(1)
            orders = [rng.sample(range(index.n_files), index.n_files) for _ in range(8)]
            for rank, ids in enumerate(orders):
                write_order(mnt, ids, rank=rank)
            reads = [os.path.join(mnt, rels[i]) for i in orders[0][:a.reads]]
            hammer = None
            if setting != "quiet":
                if os.path.exists(stop):
                    os.unlink(stop)
                who = {"user": NOBODY, "group": NOBODY} if setting == "other_user" else {}
                hammer = subprocess.Popen(["/usr/bin/python3", "-c", HAMMER, mnt, stop], stdout=subprocess.PIPE,
                                          text=True, **who)
                assert hammer.stdout.readline() == "started\n"
            t = time.perf_counter()
            lat = np.array(timed_reads(reads)) * 1e3
            seconds = time.perf_counter() - t
            row = {"setting": setting, "reads": len(reads), "p50_ms": round(float(np.percentile(lat, 50)), 3),
                   "p90_ms": round(float(np.percentile(lat, 90)), 3), "p99_ms": round(float(np.percentile(lat, 99)), 3),
                   "seconds": round(seconds, 2)}
            if hammer is not None:
                open(stop, "w").close()
                opens, texts = map(int, hammer.communicate(timeout=120)[0].split())
                row.update(hammer_opens_per_s=round(opens / seconds), hammer_texts=texts)
            if setting == "quiet":
                quiet_p90 = row["p90_ms"]
            row["p90_vs_quiet"] = round(row["p90_ms"] / quiet_p90, 2)
            print(json.dumps(row), flush=True)
            lines.write(bench="bench_hammer", files=a.files, **row)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
