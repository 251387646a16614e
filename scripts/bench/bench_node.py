"""A training node's reads with the whole set cached: loose files in the page cache against
fusefs, raw and decoded, by worker count (issue 17's node comparison). Prints figures,
saves JSON and a PNG.

A synthetic ImageFolder of --files JPEGs (~107 KB each) is generated on local disk and
packed next to it. For each loader (raw: the file's bytes, with a SHA-256 of each in the
collate; decode: torchvision's default PIL loader, RandomResizedCrop(224), a random flip and
ToTensor, the ImageNet training transform) and each worker count of --workers,
torchvision's ImageFolder + DataLoader(batch_size=64) (scripts/workloads/imagefolder_reader.py under --python, a Python
separate from fusefs's own: the unmodified training code) reads --epochs epochs in fresh
shuffled orders, after a plain read of every file by the benchmark itself has warmed every
cache (not counted), from:

  loose    the source folder (the page cache holds every file after the warm-up)
  fusefs   `fusefs mount --cache-size 120%` over the packed copy, read through
           trainer.HintedSampler (after the warm-up the kernel page cache and the daemon's
           cache hold every sample)
  fusefs_n1  the same with `--fast-threads 1`: the fast path on one thread (fusefs's default
           is one per 16 cores; each fusefs row records its fast_threads)
  fusefs_python  the same with `--no-fast-path`: opens and releases answered on the
           daemon's Python loop (fusefs before e755446)
  fusefs_shuffle  fusefs as above, read with torch's shuffle (RandomSampler) instead of
           HintedSampler: no order handed over, so the mount's cost without the order's
           (the sampler's hand-over in each epoch, the daemon's plan and its uses)
  minimal  scripts/bench/minimal_daemon.py over the source folder: every file in RAM,
           keep_cache, no order or cache logic: what a pyfuse3 daemon costs at least
  minimal_c  the same daemon in C on libfuse3 (scripts/bench/minimal_c_daemon.c, compiled
           into --out): what a FUSE daemon costs at least, without Python

each with a fresh daemon per row. A row gives samples/s per counted epoch, the ratio of
its mean to loose's (same loader and workers, same run) and of each epoch to that mean
(ratio_epochs: the spread), and per sample the CPU of the
daemon (its own getrusage) and of the loader's processes, how busy the cores were, the FUSE
requests the daemon answered per sample, by type, and for fusefs the samples it fetched from
the chunks in the counted epochs (none when its cache holds the set). Issue 17's targets, on a
16-core node: fusefs >= 0.9x loose for raw bytes and >= 0.95x decoded.

usage: .venv/bin/python scripts/bench/bench_node.py [--files 20000] [--workers 4,8,16]
           [--loaders raw,decode] [--systems loose,fusefs,fusefs_n1,fusefs_python,fusefs_shuffle,minimal,minimal_c]
           [--epochs 2]
           [--python /usr/bin/python3] [--out out/bench_node]
On the GPU node (docs/TESTING.md, "The GPU node"): python3 scripts/bench/bench_node.py --python python3
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

from common import REPO, JsonLines, build_minimal_c, commit as common_commit, minimal_daemon, run_trainer

from fusefs.config import default_fast_threads
from fusefs.pack import pack
from testkit.synth import make_imagefolder
from testkit.mounts import running_mount

SYSTEMS = ("loose", "fusefs", "fusefs_n1", "fusefs_python", "fusefs_shuffle", "minimal", "minimal_c")


def read(python: str, root: str, loader: str, workers: int, epochs: int, seed: int,
         hinted: bool) -> dict:
    """The reader's result for epochs over root (one process, as a training run)."""
    args = [root, "--workers", str(workers), "--batch", "64", "--epochs", str(epochs), "--seed",
            str(seed), "--no-digests", "--hinted" if hinted else "--shuffle"]
    if loader == "decode":
        args += ["--decode", "--size", "224"]
    return run_trainer("imagefolder_reader.py", args, python=python)[0]


def warm(root: str) -> None:
    """Read every file under root once, in this process (threads): the warm-up that fills
    the page cache and the daemons' caches, without a second loader process's start."""
    from concurrent.futures import ThreadPoolExecutor
    paths = [os.path.join(d, n) for d, _, names in os.walk(root) for n in names
             if not n.startswith(".")]

    def whole(path):
        with open(path, "rb", buffering=0) as f:
            while f.read(1 << 20):
                pass
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(whole, paths))


def daemon_stats(root: str, name: str | None) -> dict:
    if name is None:
        return {}
    with open(os.path.join(root, name)) as f:
        return json.load(f)


def measure(python: str, root: str, loader: str, workers: int, epochs: int, hinted: bool,
            stats: str | None = None) -> dict:
    """A warm-up read of every file (warm), then `epochs` counted ones: their samples/s, the
    loader's CPU per sample and the cores' busy share (measured by the reader around each epoch), and from
    the daemon's statistics file `stats` (a name under root) its CPU (getrusage), FUSE
    requests per sample by type and the samples it fetched over the counted run (the reader's scan
    of the tree included)."""
    warm(root)
    before = daemon_stats(root, stats)
    eps = read(python, root, loader, workers, epochs, 1, hinted)["epochs"]
    after = daemon_stats(root, stats)
    n = sum(e["samples"] for e in eps)
    seconds = sum(e["seconds"] for e in eps)
    row = {"samples_per_s": [round(e["samples_per_s"], 1) for e in eps],
           "loader_cpu_us_per_sample": round(1e6 * sum(e["cpu_s"] for e in eps) / n, 1),
           "machine_busy": round(sum(e["busy"] * e["seconds"] for e in eps) / seconds, 3)}
    if stats:
        row["daemon_cpu_us_per_sample"] = round(1e6 * (after["cpu_s"] - before["cpu_s"]) / n, 1)
        row["requests_per_sample"] = {k: round((v - before["requests"].get(k, 0)) / n, 3)
                                      for k, v in after["requests"].items()
                                      if v - before["requests"].get(k, 0) >= n / 100}
    if "backend_samples" in after:
        row["fetched_samples"] = after["backend_samples"] - before["backend_samples"]
        row["orders_accepted"] = after["orders_accepted"] - before["orders_accepted"]
    return row


def run_system(system: str, a, src: str, packed: str, loader: str, workers: int) -> dict:
    mnt = os.path.join(a.out, "mnt")
    if system == "loose":
        return measure(a.python, src, loader, workers, a.epochs, False, None)
    if system.startswith("fusefs"):
        extra = {"fusefs": (), "fusefs_n1": ("--fast-threads", "1"), "fusefs_python": ("--no-fast-path",),
                 "fusefs_shuffle": ()}[system]
        hinted = system != "fusefs_shuffle"
        with running_mount(packed, mnt, "--cache-size", "120%", *extra) as (proc, _):
            row = measure(a.python, mnt, loader, workers, a.epochs, hinted, ".fusefs/stats")
        row["hinted"] = hinted
        if system != "fusefs_python":
            row["fast_threads"] = 1 if system == "fusefs_n1" else default_fast_threads()
        return row
    command = [build_minimal_c(a.out)] if system == "minimal_c" else None
    with minimal_daemon(src, mnt, command=command):
        return measure(a.python, mnt, loader, workers, a.epochs, False, ".minimal-stats")


def plot(rows: list[dict], path: str, title: str) -> None:
    """Samples/s of each system by loader and workers, and each mount's ratio to loose."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    groups = sorted({(r["loader"], r["workers"]) for r in rows}, key=lambda g: (g[0] != "raw", g[1]))
    colors = {"loose": "#808080", "fusefs": "#4878a8", "fusefs_n1": "#2c4c70", "fusefs_python": "#98b8d8",
              "fusefs_shuffle": "#a06090", "minimal": "#e0a040",
              "minimal_c": "#60a060"}
    width = 0.8 / len(SYSTEMS)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    for k, group in enumerate(groups):
        for j, system in enumerate(SYSTEMS):
            r = next((r for r in rows if (r["loader"], r["workers"], r["system"]) == (*group, system)), None)
            if r is None:
                continue
            x = k + (j - (len(SYSTEMS) - 1) / 2) * width
            top.bar(x, sum(r["samples_per_s"]) / len(r["samples_per_s"]), width, color=colors[system],
                    label=system if k == 0 else None)
            if "ratio_to_loose" in r:
                bottom.bar(x, r["ratio_to_loose"], width, color=colors[system])
    top.set_yscale("log")
    top.set_ylabel("samples/s (counted epochs)")
    top.set_title(title, fontsize=9)
    top.legend(fontsize=8)
    bottom.axhline(1.0, color="#808080", lw=0.8)
    bottom.set_ylabel("ratio to loose files")
    bottom.set_xticks(range(len(groups)), [f"{loader}, {w} workers" for loader, w in groups], fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--files", type=int, default=20_000)
    p.add_argument("--workers", default="4,8,16", help="DataLoader worker counts, comma-separated")
    p.add_argument("--loaders", default="raw,decode", help="raw and/or decode, comma-separated")
    p.add_argument("--systems", default=",".join(SYSTEMS), help="which of " + ",".join(SYSTEMS) + " to run")
    p.add_argument("--epochs", type=int, default=2, help="counted epochs after the warm-up read")
    p.add_argument("--python", default="/usr/bin/python3",
                   help="the readers' Python (needs torch and torchvision)")
    p.add_argument("--out", default=os.path.join(REPO, "out", "bench_node"))
    p.add_argument("--jsonl", help="append each row as a JSON line here as it is measured "
                                   "(default OUT/bench_node.jsonl)")
    a = p.parse_args()
    workers = [int(w) for w in a.workers.split(",")]
    loaders = a.loaders.split(",")
    systems = a.systems.split(",")
    for name, given, known in (("loader", loaders, ("raw", "decode")), ("system", systems, SYSTEMS)):
        if not set(given) <= set(known):
            p.error(f"unknown {name}: {', '.join(sorted(set(given) - set(known)))}")
    if shutil.which(a.python) is None:
        p.error(f"--python {a.python}: not found")
    os.makedirs(a.out, exist_ok=True)
    src = os.path.join(a.out, f"src-{a.files}")
    packed = os.path.join(a.out, f"packed-{a.files}")
    if not os.path.isdir(src):
        g = make_imagefolder(src + ".part", a.files, n_classes=100, mean_bytes=110_000, progress=True,
                             workers=os.cpu_count() or 4)
        os.replace(src + ".part", src)
        print(f"generated {g['files']} JPEGs, {g['bytes'] / 1e9:.2f} GB, mean {g['mean_bytes'] / 1e3:.0f} KB")
    if not os.path.exists(os.path.join(packed, "index.fusefs")):
        pack(src, packed, force=True)
    results = {"files": a.files, "epochs": a.epochs, "cores": os.cpu_count(), "python": a.python,
               "commit": common_commit(), "rows": []}
    lines = JsonLines(a.jsonl or os.path.join(a.out, "bench_node.jsonl"))
    print(f"commit {results['commit']}, {os.cpu_count()} cores, {a.files} files, readers: {a.python}")
    for loader in loaders:
        for w in workers:
            base = None
            for system in systems:
                row = {"loader": loader, "workers": w, "system": system,
                       **run_system(system, a, src, packed, loader, w)}
                mean = sum(row["samples_per_s"]) / len(row["samples_per_s"])
                if system == "loose":
                    base = mean
                elif base:
                    row["ratio_to_loose"] = round(mean / base, 3)
                    row["ratio_epochs"] = [round(x / base, 3) for x in row["samples_per_s"]]
                results["rows"].append(row)
                lines.write(bench="bench_node", files=a.files, epochs=a.epochs, **row)
                rates = " / ".join(f"{x:,.0f}" for x in row["samples_per_s"])
                extra = f"; {row['ratio_to_loose']:.2f}x loose" if "ratio_to_loose" in row else ""
                if "daemon_cpu_us_per_sample" in row:
                    extra += f"; daemon CPU {row['daemon_cpu_us_per_sample']:.0f} us/sample"
                if "requests_per_sample" in row:
                    extra += f" ({sum(row['requests_per_sample'].values()):.2f} requests"
                    extra += f", {row['fetched_samples']} fetched)" if "fetched_samples" in row else ")"
                print(f"{loader:<6} {w:>2} workers  {system:<14} samples/s {rates}{extra}; loader CPU "
                      f"{row['loader_cpu_us_per_sample']:.0f} us/sample; cores "
                      f"{100 * row['machine_busy']:.0f}% busy", flush=True)
    with open(os.path.join(a.out, "bench_node.json"), "w") as f:
        json.dump(results, f, indent=1)
    plot(results["rows"], os.path.join(a.out, "bench_node.png"),
         f"ImageFolder+DataLoader(batch 64), {a.files} files cached, {os.cpu_count()} cores, "
         f"commit {results['commit']}")
    print(f"saved {a.out}/bench_node.json and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
