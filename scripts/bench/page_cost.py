"""What a fetched sample's read costs the kernel, with nothing of fusefs in it: the floor
under `bench_hotpath.py`'s fetched regimes.

The daemon reads a fetched sample from its chunk file (in the page cache) with `preadv`
straight into the cache's memory for it: memory the process never touched when the cache
fills (every page a minor fault: allocated, zeroed and mapped), memory already present
once evicted samples' memory is reused. This reads --samples samples of --size bytes from a
file in the page cache (in a private temporary folder) both ways, each in a fresh process,
alternating, --rounds times: the reading thread's CPU (CLOCK_THREAD_CPUTIME_ID) and minor
faults per sample. The median round is reported with every round's figure. JSON lines,
appended to scripts/bench/results/page_cost.jsonl (HOTPATH.md's table "pages"). Run it on
every machine whose fetched-sample figures are compared: how much a fresh page costs
differs most between machines (a virtual machine's nested paging, a node's bare metal).

usage: .venv/bin/python scripts/bench/page_cost.py [--samples 2000] [--size 112640] [--rounds 3]
"""
from __future__ import annotations

import argparse
import json
import mmap
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from common import JsonLines

MEMORY = ("fresh", "present")


def one(memory: str, path: str, size: int, samples: int) -> tuple[float, float]:
    """(In this process.) The thread's CPU us and minor faults per sample reading the file's
    samples into anonymous memory that is fresh or already present (read into once)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        buf = mmap.mmap(-1, size * samples)
        view = memoryview(buf)
        passes = 2 if memory == "present" else 1
        for _ in range(passes):  # (the last pass is measured)
            faults = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
            t0 = time.thread_time()
            for i in range(samples):
                if os.preadv(fd, [view[i * size:(i + 1) * size]], i * size) != size:
                    raise OSError(f"{path}: short read at sample {i}")
            cpu = time.thread_time() - t0
            faults = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - faults
        view.release()
        buf.close()
    finally:
        os.close(fd)
    return 1e6 * cpu / samples, faults / samples


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=2000)
    p.add_argument("--size", type=int, default=110 << 10, help="bytes a sample (default 110 KB)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--one", nargs=2, metavar=("MEMORY", "PATH"), help=argparse.SUPPRESS)
    JsonLines.argument(p, "page_cost")
    a = p.parse_args()
    if a.one:
        print(json.dumps(one(a.one[0], a.one[1], a.size, a.samples)))
        return 0
    results = JsonLines(a.results)
    folder = tempfile.mkdtemp(prefix="fusefs-page-cost-")  # (private: 0700, a random name)
    try:
        path = os.path.join(folder, "chunk")
        block = bytes(range(256)) * (a.size // 256 + 1)
        with open(path, "wb") as f:
            for _ in range(a.samples):
                f.write(block[:a.size])
        with open(path, "rb") as f:  # (into the page cache)
            while f.read(1 << 20):
                pass
        per = {m: [] for m in MEMORY}
        for i in range(a.rounds):
            for memory in (MEMORY if i % 2 == 0 else MEMORY[::-1]):
                out = subprocess.run([sys.executable, __file__, "--one", memory, path, "--size", str(a.size),
                                      "--samples", str(a.samples)], capture_output=True, text=True,
                                     check=True, timeout=600)
                per[memory].append(json.loads(out.stdout))
    finally:
        shutil.rmtree(folder)
    for memory in MEMORY:
        cpu = [round(c, 1) for c, _ in per[memory]]
        row = {"bench": "page_cost", "memory": memory, "sample_bytes": a.size, "samples": a.samples,
               "cpu_us_per_sample": round(statistics.median(cpu), 1), "rounds": cpu,
               "minor_faults_per_sample": round(statistics.median(f for _, f in per[memory]), 1)}
        print(json.dumps(row), flush=True)
        results.write(**row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
