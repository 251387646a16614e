"""FUSE over io_uring against /dev/fuse reads and writes: the transport alone, side by side.

scripts/bench/minimal_uring_daemon.c serves the same loose files from RAM with the same
handlers over either transport (`--dev`: a read and a writev per request, as libfuse and
fusefs's fast path; `--uring`: ring entries per CPU queue, a reply committed together with
the next fetch). Per round and transport, a fresh daemon and four epochs of bench_hotpath's
readers (4 processes, Python's open() and read()): `read` (first sight: lookups, reads),
`kernel` (the pages held by the kernel: open, ioctl, release per sample), `paced` (as
`kernel`, the readers opening --pace files a second together: most requests find the
daemon asleep) and `daemon` (the page cache dropped first: every sample's bytes come from
the daemon). Rounds alternate the transports. The daemon is one thread: its CPU is read
from /proc/PID/schedstat (nanoseconds).

The kernel offers FUSE over io_uring only with /sys/module/fuse/parameters/enable_uring set:
the benchmark (root) sets it for the --uring daemons and puts back what it found, also
when it fails. A kernel without the switch (before 6.14) gets the --dev rows only.

usage: .venv/bin/python scripts/bench/bench_uring.py [--files 2000] [--rounds 3]
"""
from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import os
import platform
import statistics
import subprocess
import sys

import numpy as np

from bench_hotpath import make_files, read_epoch
from common import REPO, JsonLines, minimal_daemon
from testkit.gluster import drop_caches

SWITCH = "/sys/module/fuse/parameters/enable_uring"
SOURCE = os.path.join(REPO, "scripts", "bench", "minimal_uring_daemon.c")
EPOCHS = ("read", "kernel", "paced", "daemon")


def build(out_dir: str) -> str:
    """Compile minimal_uring_daemon.c into out_dir unless built from this source already."""
    binary = os.path.join(out_dir, "minimal_uring_daemon")
    if not os.path.exists(binary) or os.path.getmtime(binary) < os.path.getmtime(SOURCE):
        subprocess.run(["gcc", "-O2", "-o", binary, SOURCE], check=True)
    return binary


@contextlib.contextmanager
def uring_switch(on: bool):
    """enable_uring set to on for the duration, then put back as it was."""
    with open(SWITCH) as f:
        was = f.read().strip()
    want = "Y" if on else "N"
    if was != want:
        with open(SWITCH, "w") as f:
            f.write("1" if on else "0")
    try:
        yield
    finally:
        if was != want:
            with open(SWITCH, "w") as f:
                f.write("1" if was == "Y" else "0")


def cpu_ns(pid: int) -> int:
    with open(f"/proc/{pid}/schedstat") as f:
        return int(f.read().split()[0])


def one_round(binary, transport, src, mnt, pool, rels, orders, a) -> dict:
    """Daemon CPU us per sample and samples/s of each epoch through a fresh daemon."""
    out = {}
    with uring_switch(transport == "uring"), \
            minimal_daemon(src, mnt, command=[binary, f"--{transport}"]) as proc:
        for epoch, name in enumerate(EPOCHS):
            if name == "daemon":
                drop_caches(1)
            t0 = cpu_ns(proc.pid)
            dt = read_epoch(pool, [os.path.join(mnt, rels[i]) for i in orders[epoch]], a.readers,
                            pace=a.pace if name == "paced" else 0)
            out[name] = ((cpu_ns(proc.pid) - t0) / 1e3 / len(rels), len(rels) / dt)
        for i in orders[0][:50]:  # (the bytes served are the files' bytes)
            with open(os.path.join(mnt, rels[i]), "rb") as f, open(os.path.join(src, rels[i]), "rb") as g:
                if f.read() != g.read():
                    raise SystemExit(f"bench_uring: {transport}: wrong bytes for {rels[i]}")
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--files", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--readers", type=int, default=4)
    p.add_argument("--pace", type=float, default=1000, help="files a second in `paced` (default 1,000)")
    p.add_argument("--out", default=os.path.join(REPO, "out", "bench_uring"))
    JsonLines.argument(p, "bench_uring")
    a = p.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("bench_uring: run as root (it mounts with mount(2) and sets enable_uring)")
    os.makedirs(a.out, exist_ok=True)
    src, mnt = os.path.join(a.out, f"src-{a.files}"), os.path.join(a.out, "mnt")
    if not os.path.isdir(src):
        make_files(src, a.files)
    binary = build(a.out)
    rels = sorted(os.path.relpath(os.path.join(d, f), src) for d, _, fs in os.walk(src) for f in fs)
    rng = np.random.default_rng(0)
    transports = ["dev", "uring"] if os.path.exists(SWITCH) else ["dev"]
    results = JsonLines(a.results)
    got = {t: {e: [] for e in EPOCHS} for t in transports}
    with mp.get_context("fork").Pool(a.readers) as pool:
        for r in range(a.rounds):
            for t in (transports if r % 2 == 0 else transports[::-1]):
                orders = [rng.permutation(len(rels)) for _ in EPOCHS]
                for e, v in one_round(binary, t, src, mnt, pool, rels, orders, a).items():
                    got[t][e].append(v)
    for t in transports:
        for e in EPOCHS:
            cpu = [round(c, 1) for c, _ in got[t][e]]
            rate = [round(s) for _, s in got[t][e]]
            row = {"bench": "bench_uring", "transport": t, "epoch": e, "samples": len(rels),
                   "daemon_cpu_us_per_sample": statistics.median(cpu), "cpu_us_per_round": cpu,
                   "samples_per_s": statistics.median(rate), "samples_per_s_per_round": rate,
                   "readers": a.readers, "pace": a.pace if e == "paced" else None,
                   "kernel": platform.release()}
            results.write(**row)
            print(f"{t:6} {e:7} {row['daemon_cpu_us_per_sample']:7.1f} us/sample {cpu}  "
                  f"{row['samples_per_s']:>7,} samples/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
