"""Several ranks' orders over one mount with a tight cache: what a sample costs the daemon,
and whether samples the read-ahead fetched are fetched again; prints figures, saves JSON lines.

Set-up: bench_hotpath's set (--files files of ~110 KB, packed locally). Each round, for each
--cache-size, the chunk files' pages are dropped and a fresh daemon gets one epoch's order
per rank (a permutation dealt round robin over --ranks ranks, as DistributedSampler deals
it); two reader processes per rank read their rank's samples in its order, with Python's
open(), the ranks side by side. A sample fetched twice is one the cache let go of before its
reader came and the kernel page cache did not hold either: `backend_samples` above --files.
Reported per cache size (the median round, every round's CPU beside it): the daemon's CPU
per sample, samples/s, samples fetched, misses (a reader found its sample neither cached
nor being fetched) and reads that waited for a fetch under way.

With --against REF, fusefs of REF (a git worktree, built) runs beside the working tree,
alternating each round, as bench_hotpath's --against does.

usage: .venv/bin/python scripts/bench/bench_ranks.py [--files 2000] [--ranks 2]
       [--cache-size 5% --cache-size 10%] [--rounds 4] [--against REF] [--out DIR] [--results PATH]
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os

import numpy as np

from bench_hotpath import list_tree, make_files, read_epoch, row, stats, thread_cpu
from common import REPO, JsonLines, side_by_side

from fusefs import client, order as orderfmt
from fusefs.index import INDEX_NAME, Index
from fusefs.pack import pack
from testkit.gluster import drop_caches
from testkit.mounts import running_mount

READERS_PER_RANK = 2


def epoch(dst: str, mnt: str, pool, rels: list[str], perm: np.ndarray, ranks: int, size: str,
          env: dict) -> dict:
    """One epoch of every rank through a fresh daemon with --cache-size size: its row."""
    n = len(perm)
    shares = [perm[r::ranks] for r in range(ranks)]
    # reader i reads positions i::readers of paths (read_epoch), which are rank r's samples
    # in its order for readers r and r + ranks: the ranks' k-th samples side by side
    paths = [os.path.join(mnt, rels[s[k]]) for k in range(len(shares[0])) for s in shares if k < len(s)]
    drop_caches()
    with running_mount(dst, mnt, "--cache-size", size, env=env) as (proc, _):
        list_tree(mnt)
        before, cpu0 = stats(mnt), thread_cpu(proc.pid)
        for r in range(ranks):
            client.send_order(mnt, orderfmt.encode(shares[r], epoch=0), rank=r)
        seconds = read_epoch(pool, paths, READERS_PER_RANK * ranks)
        after = stats(mnt)
        out = row(f"ranks_{ranks}", n, seconds, before, after, (cpu0, thread_cpu(proc.pid)))
    out.update(cache_size=size, misses=after["misses"] - before.get("misses", 0),
               read_waits=after["read_waits"] - before.get("read_waits", 0))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--files", type=int, default=2_000)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--cache-size", action="append", help="a mount's --cache-size (default 5%% and 10%%)")
    p.add_argument("--rounds", type=int, default=4, help="fresh daemons per cache size (median reported)")
    p.add_argument("--against", metavar="REF", help="also run fusefs of commit REF, alternating each round")
    p.add_argument("--out", default=os.path.join(REPO, "out", "bench_ranks"))
    JsonLines.argument(p, "bench_ranks")
    a = p.parse_args()
    sizes = a.cache_size or ["5%", "10%"]
    os.makedirs(a.out, exist_ok=True)
    src, dst, mnt = (os.path.join(a.out, f"{x}-{a.files}") for x in ("src", "packed", "mnt"))
    if not os.path.isdir(src):
        make_files(src, a.files)
    if not os.path.exists(os.path.join(dst, INDEX_NAME)):
        pack(src, dst, force=True, progress=False)
    ix = Index.load(os.path.join(dst, INDEX_NAME))
    rels = [os.fsdecode(ix.file_path(i)) for i in range(ix.n_files)]
    rng = np.random.default_rng(7)
    results = JsonLines(a.results)
    trials: dict[tuple, list] = {}
    with side_by_side(a.against) as versions, \
            mp.get_context("fork").Pool(READERS_PER_RANK * a.ranks) as pool:
        names = list(versions)
        for i in range(a.rounds):
            perm = rng.permutation(a.files)
            for version in (names if i % 2 == 0 else names[::-1]):
                for size in sizes:
                    r = epoch(dst, mnt, pool, rels, perm, a.ranks, size, versions[version])
                    trials.setdefault((size, version), []).append(r)
                    print(i, version, size, r["daemon_cpu_us_per_sample"], r["backend_samples"],
                          r["misses"], r["read_waits"], flush=True)
    for (size, version), rs in trials.items():
        r = sorted(rs, key=lambda r: r["daemon_cpu_us_per_sample"])[len(rs) // 2]
        r.update(version=version, files=a.files, ranks=a.ranks,
                 cpu_us_per_sample_all_rounds=[x["daemon_cpu_us_per_sample"] for x in rs],
                 backend_samples_all_rounds=[x["backend_samples"] for x in rs],
                 misses_all_rounds=[x["misses"] for x in rs],
                 read_waits_all_rounds=[x["read_waits"] for x in rs],
                 samples_per_s_all_rounds=[x["samples_per_s"] for x in rs])
        print(json.dumps(r), flush=True)
        results.write(bench="bench_ranks", **r)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
