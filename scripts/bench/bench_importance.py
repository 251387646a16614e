"""Importance-aware epochs against full-data epochs (issue 4), through fusefs on the slowed
3-brick GlusterFS volume. Prints per-epoch figures and a summary; saves JSON and a PNG.

Two datasets, each packed onto the volume and mounted with a 10% cache of which 30% is the
static (pinned) share:
  digits  scikit-learn's bundled load_digits images (real data, no download), upscaled to
          32x32 PNGs in an ImageFolder, 80% train / 20% test; the accuracy comparison.
  synth   synthetic JPEGs (--synth files of ~85 KB, learnable: testkit.synth, learnable=True);
          the I/O comparison: backend bytes and epoch time per epoch.
For each, the same small CNN, seeds and epochs are trained twice by scripts/workloads/train_importance.py
under /usr/bin/python3 (torchvision ImageFolder + DataLoader through the mount): with every
sample each epoch (HintedSampler), and with ImportanceSampler at --keep. Before each epoch
the whole page cache is dropped (--page-cache all, the default: the training's program code
too, which every DataLoader start then reads back from disk), as a data set larger than the
node's memory would be gone from it; or only the packed data set's files on the volume and
on the bricks leave it (--page-cache dataset). The mount keeps its files' pages in the
kernel page cache, so with --page-cache dataset these small sets are read from memory after
the first epoch and the backend is hardly touched: what it still fetches are samples whose
pushed pages the kernel dropped meanwhile (kernel_dropped, per epoch and in the summary).

Epoch times are averaged over --repeats runs of each mode, alternated (full, importance,
full, ...) so that the drift of a noisy machine hits both alike.

The summary also gives the CPU time left idle per second of epoch (all cores together):
near 0, the epoch is bound by decoding and training; large, by the volume (e.g. at
--delay-ms 40); and per storage node, the samples an importance epoch fetched from it
against a full epoch (the busiest node sets a storage-bound epoch's pace). --layout mixed
(the default) packs with `fusefs pack --mix-classes`, so that every chunk, and so every
node, holds each class in its share; sorted packs class by class. --profile also counts
the READ operations of the bricks per epoch (gluster volume profile; each is one delay),
against the reads fusefs made (about: an epoch's count is taken when its row arrives).

usage: .venv/bin/python scripts/bench/bench_importance.py [--epochs 15] [--synth 3000]
           [--synth-epochs 9] [--keep 0.7] [--delay-ms 2] [--repeats 3]
           [--cache-size 10%] [--static-cache 30%] [--layout mixed|sorted]
           [--datasets digits,synth] [--page-cache all|dataset] [--profile]
           [--mount-option ARG ...]
           [--out out/bench_importance]
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys

import numpy as np


from common import REPO, run_trainer

from fusefs.pack import pack
from testkit.synth import make_digits, make_imagefolder
from testkit.gluster import BRICKS, GLUSTER_SH, GMNT, VOL
from testkit.mounts import running_mount



def brick_reads() -> int:
    """READ operations the volume's bricks served since the last call (gluster volume
    profile, which --profile starts)."""
    out = subprocess.run(["gluster", "volume", "profile", VOL, "info", "incremental"],
                         capture_output=True, text=True, check=True).stdout
    return sum(int(line.split()[-2]) for line in out.splitlines() if line.split()[-1:] == ["READ"])


def train(mnt: str, test: str, mode: str, a, epochs: int, packed: str) -> list[dict]:
    def show(row):
        if a.profile:  # (when the row arrives: the next epoch may have begun its first reads)
            row["brick_reads"] = brick_reads()
        print(f"  {mode:<10} epoch {row['epoch']:2d}: trained {row['trained']:5d} "
              f"re-evaluated {row['reevaluated']:5d}  {row['seconds']:6.2f} s "
              f"(split {row['split_s']:.2f}, re-eval {row['reeval_s']:.2f})  "
              f"backend {row.get('backend_bytes', 0) / 1e6:7.1f} MB (dropped by the kernel "
              f"{row.get('kernel_dropped', 0)})  test acc {row['test_acc']:.4f}",
              flush=True)
    if a.page_cache == "all":
        flush = ["--drop-caches"]
    else:  # the packed folder through the volume's mount and on each brick
        name = os.path.relpath(packed, GMNT)
        flush = [f"--evict={p}" for p in [packed, *sorted(glob.glob(os.path.join(BRICKS, "*", name)))]]
    if a.profile:
        brick_reads()  # from here on
    return run_trainer("train_importance.py", [mnt, test, "--mode", mode, "--epochs", str(epochs),
                                               "--keep", str(a.keep), "--seed", str(a.seed),
                                               *flush], show)


def run_dataset(root: str, a, epochs: int) -> dict:
    """Full and importance runs on ROOT/train (packed onto the volume), tested on ROOT/test."""
    name = os.path.basename(root)
    src, test = os.path.join(root, "train"), os.path.join(root, "test")
    packed = os.path.join(GMNT, f"importance-{name}-{a.layout}")
    if not os.path.exists(os.path.join(packed, "index.fusefs")):
        pack(src, packed, chunk_bytes=(1 << 20) if name == "digits" else (16 << 20), force=True,
             progress=False, mix_classes=a.layout == "mixed")
    out = {"repeats": {"full": [], "importance": []}}
    for rep in range(a.repeats):  # alternated, so drift of the machine hits both modes
        for mode in ("full", "importance"):
            mnt = os.path.join(a.out, f"mnt-{name}")
            with running_mount(packed, mnt, "--cache-size", a.cache_size, "--static-cache", a.static_cache,
                               *a.mount_option):
                print(f"{name}: {mode} (run {rep + 1} of {a.repeats})", flush=True)
                out["repeats"][mode].append(train(mnt, test, mode, a, epochs, packed))
    for mode in ("full", "importance"):
        out[mode] = out["repeats"][mode][0]
    return out


def summarize(res: dict, warmup: int) -> dict:
    s = {}
    for name, modes in res.items():
        f, i = modes["full"], modes["importance"]
        after = lambda rows, k: [r[k] for r in rows[warmup:]]
        s[name] = {
            "final_acc_full": f[-1]["test_acc"], "final_acc_importance": i[-1]["test_acc"],
            "best_acc_full": max(r["test_acc"] for r in f),
            "best_acc_importance": max(r["test_acc"] for r in i),
            "backend_mb_per_epoch_full": float(np.mean(after(f, "backend_bytes"))) / 1e6,
            "backend_mb_per_epoch_importance": float(np.mean(after(i, "backend_bytes"))) / 1e6,
            # fetched again because the kernel had dropped the pages pushed earlier
            "kernel_dropped_per_epoch_full": float(np.mean(after(f, "kernel_dropped"))),
            "kernel_dropped_per_epoch_importance": float(np.mean(after(i, "kernel_dropped"))),
            # every run's epochs after the warm-up
            "epoch_s_full": float(np.mean([after(r, "seconds") for r in modes["repeats"]["full"]])),
            "epoch_s_importance": float(np.mean([after(r, "seconds")
                                                 for r in modes["repeats"]["importance"]])),
            "epoch_time_ratio_per_run": [float(np.mean(after(ri, "seconds")) / np.mean(after(rf, "seconds")))
                                         for rf, ri in zip(modes["repeats"]["full"],
                                                           modes["repeats"]["importance"])],
            # CPU time left idle per second of epoch, of this machine's cores together
            # (near 0: bound by decoding and training; large: waiting for the volume)
            **{f"cpu_idle_per_s_{mode}": float(np.mean([
                r["cpu_idle_s"] / r["seconds"] for rows in modes["repeats"][mode]
                for r in rows[warmup:]])) for mode in ("full", "importance")},
            **({f"brick_reads_per_read_{mode}": float(np.mean([
                r["brick_reads"] / r["backend_reads"] for rows in modes["repeats"][mode]
                for r in rows[warmup:]])) for mode in ("full", "importance")} if "brick_reads" in f[-1] else {}),
            "trained_per_epoch_importance": float(np.mean(after(i, "trained"))),
            "reevaluated_per_epoch": float(np.mean(after(i, "reevaluated"))),
            # per storage node: samples fetched in an importance epoch / in a full one (the
            # busiest node sets the pace of a storage-bound epoch)
            "node_fetched_ratio": (np.mean(after(i, "node_samples"), axis=0)
                                   / np.maximum(1, np.mean(after(f, "node_samples"), axis=0))).round(3).tolist(),
        }
        s[name]["backend_ratio"] = (s[name]["backend_mb_per_epoch_importance"]
                                    / max(1e-9, s[name]["backend_mb_per_epoch_full"]))
        s[name]["epoch_time_ratio"] = s[name]["epoch_s_importance"] / s[name]["epoch_s_full"]
    return s


def plot(res: dict, path: str, warmup: int) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(1, 3, figsize=(14, 3.8))
    for mode, style in (("full", "-o"), ("importance", "-s")):
        d = res["digits"][mode]
        ax[0].plot([r["epoch"] for r in d], [100 * r["test_acc"] for r in d], style, label=mode, ms=3)
        for name, axis, key, scale in (("synth", ax[1], "backend_bytes", 1e-6),
                                       ("synth", ax[2], "seconds", 1)):
            rows = res[name][mode]
            axis.plot([r["epoch"] for r in rows], [r[key] * scale for r in rows], style, label=mode, ms=3)
    ax[0].set(title="digits: test accuracy", xlabel="epoch", ylabel="%")
    ax[1].set(title="synth: backend MB per epoch", xlabel="epoch", ylabel="MB")
    ax[2].set(title="synth: epoch time through the mount", xlabel="epoch", ylabel="s")
    for axis in ax:
        axis.axvline(warmup - 0.5, color="gray", ls=":", lw=1)
        axis.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=15)
    p.add_argument("--synth", type=int, default=3000)
    p.add_argument("--synth-epochs", type=int, default=9)
    p.add_argument("--keep", type=float, default=0.7)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--delay-ms", type=int, default=2)
    p.add_argument("--cache-size", default="10%", help="the mounts' --cache-size")
    p.add_argument("--static-cache", default="30%", help="the mounts' --static-cache")
    p.add_argument("--layout", choices=("mixed", "sorted"), default="mixed",
                   help="pack with --mix-classes (every chunk holds every class) or class by class")
    p.add_argument("--mount-option", action="append", default=[], metavar="ARG",
                   help="one more argument for fusefs mount, e.g. --mount-option=--no-willneed")
    p.add_argument("--profile", action="store_true",
                   help="count the bricks' READ operations per epoch (gluster volume profile)")
    p.add_argument("--datasets", default="digits,synth", help="comma-separated subset to run")
    p.add_argument("--repeats", type=int, default=3,
                   help="runs per mode, alternated (full, importance, full, ...); epoch times "
                        "are averaged over all, accuracy and bytes are those of the first")
    p.add_argument("--page-cache", choices=("dataset", "all"), default="all",
                   help="what leaves the page cache before each epoch (see above)")
    p.add_argument("--out", default=os.path.join(REPO, "out", "bench_importance"))
    a = p.parse_args()
    warmup = 3
    os.makedirs(a.out, exist_ok=True)
    subprocess.run(["bash", GLUSTER_SH, "up", "--delay-ms",
                    str(a.delay_ms)], check=True)
    if a.profile:  # (an error if it is on already: fine)
        subprocess.run(["gluster", "volume", "profile", VOL, "start"], capture_output=True)
    digits = os.path.join(a.out, "digits")
    make_digits(digits, a.seed)
    synth = os.path.join(a.out, f"synth-{a.synth}-learnable")
    if not os.path.isdir(os.path.join(synth, "test")):
        make_imagefolder(os.path.join(synth, "train"), a.synth, n_classes=10, mean_bytes=100_000,
                         learnable=True)
        make_imagefolder(os.path.join(synth, "test"), 300, n_classes=10, mean_bytes=100_000, seed=1,
                         learnable=True)
    sets = {"digits": (digits, a.epochs), "synth": (synth, a.synth_epochs)}
    try:
        res = {name: run_dataset(root, a, epochs)
               for name, (root, epochs) in sets.items() if name in a.datasets.split(",")}
    finally:
        if a.profile:
            subprocess.run(["gluster", "volume", "profile", VOL, "stop"], capture_output=True)
    summary = summarize(res, warmup)
    for name, s in summary.items():
        print(f"{name}: final test acc full {100 * s['final_acc_full']:.2f}% / importance "
              f"{100 * s['final_acc_importance']:.2f}%; after the warm-up, per epoch: trained "
              f"{s['trained_per_epoch_importance']:.0f} (+{s['reevaluated_per_epoch']:.0f} re-evaluated), "
              f"backend {s['backend_mb_per_epoch_full']:.1f} -> {s['backend_mb_per_epoch_importance']:.1f} MB "
              f"({s['backend_ratio']:.2f}x; the kernel had dropped {s['kernel_dropped_per_epoch_full']:.0f} -> "
              f"{s['kernel_dropped_per_epoch_importance']:.0f} of the samples fetched), epoch {s['epoch_s_full']:.2f} -> "
              f"{s['epoch_s_importance']:.2f} s ({s['epoch_time_ratio']:.2f}x; per run "
              f"{', '.join(f'{x:.2f}x' for x in s['epoch_time_ratio_per_run'])}); idle CPU "
              f"{s['cpu_idle_per_s_full']:.2f} / {s['cpu_idle_per_s_importance']:.2f} s per s; "
              f"fetched per storage node {', '.join(f'{x:.2f}x' for x in s['node_fetched_ratio'])}"
              + (f"; brick READs per backend read {s['brick_reads_per_read_full']:.2f} / "
                 f"{s['brick_reads_per_read_importance']:.2f}" if a.profile else ""))
    with open(os.path.join(a.out, "bench_importance.json"), "w") as f:
        json.dump({"settings": vars(a), "epochs": res, "summary": summary}, f, indent=1)
    if {"digits", "synth"} <= res.keys():
        plot(res, os.path.join(a.out, "bench_importance.png"), warmup)
    print(f"saved {a.out}/bench_importance.json (and .png with both datasets)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
