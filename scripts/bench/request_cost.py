"""A fetch thread's CPU per sample of the read-ahead's requests, by how their reads are
grouped: every read in one call of C (how a read-ahead request reads when its samples are
published to the fast path as each read is checked: fetch.Batch.whole), the fewest groups
(1, 1, 2, 4, ... reads: how a remote node's round trips split a request, store.GROUP_S 0),
and the default (groups of at least a millisecond). Each group is a return to Python between
its reads (the chunks' descriptors, the results' dict, on_read); the reads and checksums are
the same.

It reads --requests requests of 20 samples each, drawn at random from a packed set (its
chunk files are read into the page cache first), with ChunkStore.read_batch as a fetch's
worker thread calls it, publishing each sample to the binding's table (not started here:
nothing is held), and reports this thread's CPU (time.thread_time) per sample and its minor
faults per sample (fresh pages for the samples' bytes, where the heap gave any back), each
grouping in turn, --rounds times; the median round with every round's figures. One JSON
line, appended to --results (default scripts/bench/results/request_cost.jsonl).

usage: .venv/bin/python scripts/bench/request_cost.py PACKED [--requests 300] [--rounds 3]
"""
from __future__ import annotations

import argparse
import math
import os
import resource
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import JsonLines, warm_chunks  # noqa: E402

from fusefs import pyfuse3  # noqa: E402
from fusefs.index import INDEX_NAME, Index  # noqa: E402
from fusefs.store import GROUP_S, ChunkStore  # noqa: E402

GROUPINGS = {"one_call": math.inf, "fewest_groups": 0.0, "default_groups": GROUP_S}
PER_REQUEST = 20


def per_sample(store: ChunkStore, requests: list[list[int]], group_s: float, api) -> tuple[float, float]:
    """(this thread's CPU in us, minor faults) per sample of reading every request."""
    n = sum(map(len, requests))
    f0, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.thread_time()
    for sids in requests:
        store.read_batch(sids, 0, lambda *a, **k: None, group_s=group_s,
                         publish=(api, np.array(sids, np.int64)))
    cpu, faults = time.thread_time() - t0, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
    return 1e6 * cpu / n, faults / n


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("packed")
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--rounds", type=int, default=3)
    JsonLines.argument(p, "request_cost")
    a = p.parse_args()
    ix = Index.load(os.path.join(a.packed, INDEX_NAME))
    store, api = ChunkStore(a.packed, ix), pyfuse3.fast_path_publish_api()
    warm_chunks(a.packed)
    rng = np.random.default_rng(0)
    requests = [sorted(rng.choice(ix.n_files, min(PER_REQUEST, ix.n_files), replace=False).tolist())
                for _ in range(a.requests)]
    per_sample(store, requests[: max(1, a.requests // 10)], math.inf, api)  # (warm)
    rounds = {name: [] for name in GROUPINGS}
    faults = {name: [] for name in GROUPINGS}
    for _ in range(a.rounds):
        for name, group_s in GROUPINGS.items():
            cpu, f = per_sample(store, requests, group_s, api)
            rounds[name].append(round(cpu, 2))
            faults[name].append(round(f, 1))
    row = {"bench": "request_cost", "samples": a.requests * PER_REQUEST, "sample_bytes": int(np.mean(ix.size)),
           **{f"{name}_cpu_us_per_sample": statistics.median(r) for name, r in rounds.items()},
           "rounds_cpu_us_per_sample": rounds, "minor_faults_per_sample": faults}
    print(row)
    JsonLines(a.results).write(**row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
