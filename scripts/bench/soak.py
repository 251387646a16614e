"""Endurance (issue 8): many epochs through one mount with 8 reader processes, readers killed
(SIGKILL) and restarted at random; the daemon's RSS is sampled every second. Prints RSS
figures against the budget and the open file handles at the end; saves JSON and a PNG.

Each epoch sets a fresh shuffled order; reader k reads positions k, k+8, ... of it and
compares every sample's xxh3 with the index. A killed reader is restarted on the rest of
its share. usage:
  .venv/bin/python scripts/bench/soak.py [DST] [--epochs 10] [--cache-size 10%] [--out out/soak]
(DST defaults to the benchmark's local packed set, out/bench_order/packed_local-20000.)
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import signal
import sys
import threading
import time

from common import REPO, JsonLines

from fusefs.index import INDEX_NAME, Index
from testkit.mounts import running_mount
from trainer import mount_stats, write_order

READERS = 8


def reader(mnt: str, paths: list[bytes], sums: list[int], done) -> None:
    import xxhash
    for i, (p, s) in enumerate(zip(paths, sums)):
        with open(os.path.join(mnt, os.fsdecode(p)), "rb") as f:
            if xxhash.xxh3_64_intdigest(f.read()) != s:
                print(f"WRONG BYTES: {os.fsdecode(p)}", flush=True)
                os._exit(3)
        done.value = i + 1


def rss_of(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("dst", nargs="?", default=os.path.join(REPO, "out", "bench_order", "packed_local-20000"))
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--cache-size", default="10%")
    p.add_argument("--kill-every", type=float, default=2.0, help="mean seconds between kills")
    p.add_argument("--out", default=os.path.join(REPO, "out", "soak"))
    JsonLines.argument(p, "soak")
    a = p.parse_args()
    lines = JsonLines(a.results)
    os.makedirs(a.out, exist_ok=True)
    ix = Index.load(os.path.join(a.dst, INDEX_NAME))
    paths = [ix.file_path(i) for i in range(ix.n_files)]
    sums = ix.checksum.tolist()
    mnt = os.path.join(a.out, "mnt")
    rng = random.Random(0)
    samples, kills = [], 0
    ctx = mp.get_context("fork")
    with running_mount(a.dst, mnt, "--cache-size", a.cache_size) as (proc, _):
        stop = threading.Event()
        t0 = time.perf_counter()

        def sample_rss():
            while not stop.is_set():
                samples.append((time.perf_counter() - t0, rss_of(proc.pid)))
                stop.wait(1.0)
        threading.Thread(target=sample_rss, daemon=True).start()
        for epoch in range(a.epochs):
            order = list(range(ix.n_files))
            rng.shuffle(order)
            write_order(mnt, order, epoch=epoch)
            shares = [order[k::READERS] for k in range(READERS)]
            state = []
            for share in shares:
                done = ctx.Value("i", 0)
                pr = ctx.Process(target=reader, args=(mnt, [paths[i] for i in share],
                                                      [sums[i] for i in share], done))
                pr.start()
                state.append([pr, done, share, 0])
            next_kill = time.perf_counter() + rng.expovariate(1 / a.kill_every)
            while any(s[0].is_alive() for s in state):
                time.sleep(0.05)
                if time.perf_counter() >= next_kill:
                    alive = [s for s in state if s[0].is_alive()]
                    if alive:
                        s = rng.choice(alive)
                        os.kill(s[0].pid, signal.SIGKILL)
                        s[0].join()
                        kills += 1
                        s[3] += s[1].value  # restart on the rest of its share
                        rest = s[2][s[3]:]
                        s[1] = ctx.Value("i", 0)
                        s[0] = ctx.Process(target=reader, args=(mnt, [paths[i] for i in rest],
                                                                [sums[i] for i in rest], s[1]))
                        s[0].start()
                    next_kill = time.perf_counter() + rng.expovariate(1 / a.kill_every)
            bad = [s[0].exitcode for s in state if s[0].exitcode not in (0, -signal.SIGKILL)]
            if bad:
                raise SystemExit(f"a reader failed in epoch {epoch}: exit codes {bad}")
            print(f"epoch {epoch}: {time.perf_counter() - t0:.0f} s, kills so far {kills}, "
                  f"daemon RSS {rss_of(proc.pid) / 1e6:.0f} MB", flush=True)
        time.sleep(1.0)
        stop.set()
        stats = mount_stats(mnt)
    rss = [r for _, r in samples]
    half = rss[len(rss) // 2:]
    res = {"epochs": a.epochs, "kills": kills, "budget": stats["cache_budget"],
           "index_bytes": os.path.getsize(os.path.join(a.dst, INDEX_NAME)),
           "rss_peak": max(rss), "rss_first_half_max": max(rss[:len(rss) // 2] or [0]),
           "rss_second_half_max": max(half or [0]), "open_handles_at_end": stats["open_handles"],
           "eio": stats["eio"], "samples": samples}
    print(f"{a.epochs} epochs, {kills} readers killed: daemon RSS peak {res['rss_peak'] / 1e6:.0f} MB "
          f"(first half max {res['rss_first_half_max'] / 1e6:.0f}, second half max "
          f"{res['rss_second_half_max'] / 1e6:.0f}; budget {res['budget'] / 1e6:.0f} MB + index "
          f"{res['index_bytes'] / 1e6:.1f} MB); open handles at the end {res['open_handles_at_end']}; "
          f"EIO {res['eio']}")
    with open(os.path.join(a.out, "soak.json"), "w") as f:
        json.dump(res, f)
    lines.write(bench="soak", samples_per_epoch=ix.n_files, cache_size=a.cache_size,
                **{k: v for k, v in res.items() if k != "samples"})
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 3.5))
    ax.plot([t for t, _ in samples], [r / 1e6 for r in rss], label="daemon RSS")
    ax.axhline((res["budget"] + res["index_bytes"]) / 1e6, color="gray", ls="--", label="budget + index")
    ax.set_xlabel("s")
    ax.set_ylabel("MB")
    ax.set_title(f"soak: {a.epochs} epochs, {READERS} readers, {kills} killed")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(a.out, "soak.png"), dpi=100)
    print(f"saved {a.out}/soak.json and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
