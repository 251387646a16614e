"""Figures for the pack/mount foundation (issue 2); prints them, saves JSON and a PNG.

1. pack throughput (MB/s) of a synthetic ImageFolder (default 20,000 JPEGs, ~110 KB);
2. index load time and RSS at 1,280,000 samples (a synthetic index, loaded in a fresh
   process, RSS measured before and after);
3. random-order read throughput (files/s) with 1 and 4 reader processes through the
   mount, next to the same readers on the source folder, in one run, with the page cache
   dropped and a fresh daemon before each setting.

usage: .venv/bin/python scripts/bench/bench_mount.py [--files N] [--src DIR] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import shutil
import subprocess
import sys
import time

import numpy as np

from common import REPO, JsonLines

from testkit import gluster as testbed
from fusefs.index import INDEX_NAME, ChunkInfo, Index
from fusefs.pack import pack
from testkit.synth import imagenet_tree, make_imagefolder
from testkit.mounts import running_mount


def drop_caches() -> None:
    try:
        testbed.drop_caches()
    except OSError:
        print("  (cannot drop the page cache: not root?)")


def synthetic_index(n: int, classes: int = 1000, per_chunk: int = 600) -> Index:
    """An index shaped like ImageNet's: n samples in `classes` folders, ~110 KB each."""
    rng = np.random.default_rng(0)
    names, class_names, arrays, _ = imagenet_tree(n, classes, ".JPEG")
    sizes = rng.integers(60_000, 160_000, n).astype(np.uint64)
    chunk = (np.arange(n) // per_chunk).astype(np.uint32)
    nchunks = int(chunk[-1]) + 1
    offsets = np.zeros(n, np.uint64)
    chunk_sizes = np.zeros(nchunks, np.int64)
    for k in range(nchunks):
        s = sizes[k * per_chunk:(k + 1) * per_chunk]
        start = 32 + 32 * len(s)
        offsets[k * per_chunk:(k + 1) * per_chunk] = start + np.concatenate([[0], np.cumsum(s)[:-1]])
        chunk_sizes[k] = start + int(s.sum())
    arrays.update(chunk=chunk, offset=offsets, size=sizes, checksum=rng.integers(0, 2**63, n).astype(np.uint64))
    chunks = [ChunkInfo(f"chunks/chunk-{k:06d}.fck", k % 3, int(chunk_sizes[k]), min(per_chunk, n - k * per_chunk))
              for k in range(nchunks)]
    return Index(arrays, names, class_names, chunks, ["a", "b", "c"])


_LOAD = """
import resource, sys, time, os
import numpy, xxhash
from fusefs.index import Index
def rss():
    return int(open('/proc/self/statm').read().split()[1]) * os.sysconf('SC_PAGE_SIZE')
before = rss()
t = time.perf_counter()
ix = Index.load(sys.argv[1])
dt = time.perf_counter() - t
assert ix.lookup_file(ix.lookup_dir(0, b'n00000999'), b'n00000999_000005.JPEG') is not None
print(dt, before, rss())
"""


def bench_index(n: int, workdir: str) -> dict:
    path = os.path.join(workdir, INDEX_NAME)
    t = time.perf_counter()
    synthetic_index(n).save(path)
    build = time.perf_counter() - t
    runs = []
    for _ in range(3):
        out = subprocess.run([sys.executable, "-c", _LOAD, path], capture_output=True, text=True, check=True)
        dt, before, after = out.stdout.split()
        runs.append((float(dt), int(before), int(after)))
    dt, before, after = min(runs)
    return {"samples": n, "index_bytes": os.path.getsize(path), "build_s": build, "load_s": dt,
            "rss_before_mb": before / 1e6, "rss_after_mb": after / 1e6, "rss_added_mb": (after - before) / 1e6}


def _reader(args):
    paths, = args
    n = 0
    for p in paths:
        with open(p, "rb") as f:
            while f.read(1 << 20):
                pass
        n += 1
    return n


def read_rate(root: str, rels: list[str], procs: int, seed: int = 1) -> float:
    order = rels[:]
    random.Random(seed).shuffle(order)
    paths = [os.path.join(root, r) for r in order]
    shares = [(paths[i::procs],) for i in range(procs)]
    with mp.get_context("fork").Pool(procs) as pool:
        t = time.perf_counter()
        n = sum(pool.map(_reader, shares))
        dt = time.perf_counter() - t
    assert n == len(paths)
    return n / dt


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--files", type=int, default=20_000)
    p.add_argument("--index-samples", type=int, default=1_280_000)
    p.add_argument("--src", help="use this ImageFolder instead of generating one")
    p.add_argument("--out", default=os.path.join(REPO, "out", "bench_mount"))
    p.add_argument("--keep", action="store_true", help="keep the generated data")
    JsonLines.argument(p, "bench_mount")
    a = p.parse_args()
    lines = JsonLines(a.results)
    os.makedirs(a.out, exist_ok=True)
    results: dict = {}

    print(f"== index of {a.index_samples:,} samples")
    results["index"] = ix = bench_index(a.index_samples, a.out)
    print(f"  file {ix['index_bytes'] / 1e6:.0f} MB; load {ix['load_s']:.2f} s; RSS {ix['rss_before_mb']:.0f} MB "
          f"before, {ix['rss_after_mb']:.0f} MB after (+{ix['rss_added_mb']:.0f} MB)")
    lines.write(bench="bench_mount", part="index", **ix)
    os.unlink(os.path.join(a.out, INDEX_NAME))

    src = a.src or os.path.join(a.out, "src")
    if not a.src:
        print(f"== generating {a.files:,} JPEGs")
        shutil.rmtree(src, ignore_errors=True)
        g = make_imagefolder(src, a.files, n_classes=100, mean_bytes=110_000, progress=True)
        print(f"  {g['bytes'] / 1e9:.2f} GB, mean {g['mean_bytes'] / 1e3:.0f} KB")
    dst = os.path.join(a.out, "packed")
    shutil.rmtree(dst, ignore_errors=True)
    drop_caches()
    print("== pack")
    r = pack(src, dst)
    results["pack"] = {"files": r.files, "bytes": r.bytes, "chunks": r.chunks, "seconds": r.seconds,
                       "mb_per_s": r.mb_per_s}
    lines.write(bench="bench_mount", part="pack", **results["pack"])
    print(f"  {r.files:,} files, {r.bytes / 1e9:.2f} GB, {r.chunks} chunks in {r.seconds:.1f} s: {r.mb_per_s:.0f} MB/s")

    index = Index.load(os.path.join(dst, INDEX_NAME))
    rels = [os.fsdecode(index.file_path(i)) for i in range(index.n_files)]
    mnt = os.path.join(a.out, "mnt")
    results["read"] = []
    print("== random-order reads (files/s), cold page cache, fresh daemon per setting")
    for procs in (1, 4):
        drop_caches()
        direct = read_rate(src, rels, procs)
        drop_caches()
        with running_mount(dst, mnt):
            through = read_rate(mnt, rels, procs)
        results["read"].append({"readers": procs, "source_files_s": direct, "mount_files_s": through,
                                "ratio": through / direct})
        lines.write(bench="bench_mount", part="read", files=index.n_files, **results["read"][-1])
        print(f"  {procs} reader(s): source {direct:8.0f}   mount {through:8.0f}   mount/source {through / direct:.2f}")

    with open(os.path.join(a.out, "bench_mount.json"), "w") as f:
        json.dump(results, f, indent=1)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(6, 3.5))
        xs = np.arange(len(results["read"]))
        ax.bar(xs - 0.2, [x["source_files_s"] for x in results["read"]], 0.4, label="source folder")
        ax.bar(xs + 0.2, [x["mount_files_s"] for x in results["read"]], 0.4, label="fusefs mount")
        ax.set_xticks(xs, [f"{x['readers']} reader(s)" for x in results["read"]])
        ax.set_ylabel("files/s (random order, cold)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(os.path.join(a.out, "bench_mount.png"), dpi=100)
    except ImportError:
        pass
    print(f"saved {a.out}/bench_mount.json and .png")
    if not a.keep and not a.src:
        shutil.rmtree(src, ignore_errors=True)
        shutil.rmtree(dst, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
