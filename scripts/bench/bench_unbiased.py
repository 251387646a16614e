"""Full epochs, importance epochs by rank and unbiased importance epochs, side by side on a
set big enough to tell a point of accuracy (issue 48): final test accuracy (mean and spread
over seeds), total training time and backend bytes, through fusefs on the GlusterFS test
bed. Prints one JSON line per run and per mode (appended to
scripts/bench/results/bench_unbiased.jsonl); saves out/bench_unbiased/bench_unbiased.png
(test accuracy per epoch per mode, mean and range over the seeds).

The set: testkit.synth.make_hardness, --train grey 32x32 PNGs in 10 classes (4% of them
mislabelled) and --test held out (none mislabelled), each image its class's pattern blended
with another class's and with noise by a hardness drawn per image: mostly easy, a long
tail of hard ones. The training set is packed onto the 3-brick volume (--delay-ms per
operation) and mounted with --cache-size (of which --static-cache is the static share) and
--no-kernel-cache, and its files on the volume and the bricks leave the page cache before
each epoch: every epoch fetches what it reads from the backend, as with a set larger than
the node's memory. scripts/workloads/train_importance.py trains the same small CNN (SGD,
cosine schedule over --epochs, batch 64, 2 loader workers) under /usr/bin/python3 through
the mount, in each mode, for each seed; the runs alternate modes seed by seed, so the drift
of a noisy machine hits every mode alike:

  full        every sample every epoch (HintedSampler)
  importance  ImportanceSampler(mode="rank", keep=--keep): the highest-loss share
  unbiased    ImportanceSampler(mode="unbiased", prune=--prune): a random --prune share of the
              samples below the mean loss dropped, the kept ones weighted 1/(1-prune), full
              epochs in the last eighth

usage: .venv/bin/python scripts/bench/bench_unbiased.py [--train 20000] [--test 5000]
           [--epochs 20] [--seeds 3] [--modes full,importance,unbiased] [--keep 0.7]
           [--prune 0.5] [--delay-ms 2] [--cache-size 10%] [--static-cache 30%]
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys

import numpy as np

from common import REPO, JsonLines, run_trainer

from fusefs.pack import pack
from testkit.gluster import BRICKS, GLUSTER_SH, GMNT
from testkit.mounts import running_mount
from testkit.synth import make_hardness



def run(a, mode: str, seed: int, packed: str, test: str) -> list[dict]:
    """One training run through a fresh mount: its rows, one per epoch."""
    mnt = os.path.join(a.out, "mnt")
    name = os.path.relpath(packed, GMNT)
    evict = [f"--evict={p}" for p in [packed, *sorted(glob.glob(os.path.join(BRICKS, "*", name)))]]

    def show(row):
        print(f"  {mode:<10} seed {seed} epoch {row['epoch']:2d}: trained {row['trained']:6d} "
              f"re-evaluated {row['reevaluated']:6d} {row['seconds']:6.2f} s backend "
              f"{row.get('backend_bytes', 0) / 1e6:6.1f} MB test acc {100 * row['test_acc']:.2f}%", flush=True)
    with running_mount(packed, mnt, "--cache-size", a.cache_size, "--static-cache", a.static_cache,
                       "--no-kernel-cache"):
        return run_trainer("train_importance.py", [mnt, test, "--mode", mode, "--epochs", str(a.epochs),
                                                   "--keep", str(a.keep), "--prune", str(a.prune),
                                                   "--seed", str(seed), *evict], show)


def summary(runs: dict[str, list[dict]]) -> dict[str, dict]:
    """Per mode: final accuracy (mean, sample std, min, max over seeds), total seconds and
    backend bytes (mean over seeds), and both against full epochs'."""
    out = {}
    for mode, rs in runs.items():
        acc = np.array([r["final_acc"] for r in rs]) * 100
        out[mode] = {"seeds": len(rs), "acc_mean": round(float(acc.mean()), 2),
                     "acc_std": round(float(acc.std(ddof=1)), 2) if len(acc) > 1 else 0.0,
                     "acc_min": round(float(acc.min()), 2), "acc_max": round(float(acc.max()), 2),
                     "seconds": round(float(np.mean([r["seconds"] for r in rs])), 1),
                     "backend_bytes": int(np.mean([r["backend_bytes"] for r in rs])),
                     "trained": int(np.mean([r["trained"] for r in rs]))}
    if "full" in out:
        for mode, s in out.items():
            s["time_vs_full"] = round(s["seconds"] / out["full"]["seconds"], 3)
            s["bytes_vs_full"] = round(s["backend_bytes"] / max(1, out["full"]["backend_bytes"]), 3)
            s["acc_vs_full"] = round(s["acc_mean"] - out["full"]["acc_mean"], 2)
    return out


def plot(runs: dict[str, list[dict]], path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for mode, rs in runs.items():
        accs = np.array([r["acc_per_epoch"] for r in rs]) * 100
        epochs = np.arange(accs.shape[1])
        ax.plot(epochs, accs.mean(0), "-o", ms=3, label=f"{mode} (mean of {len(rs)} seeds)")
        ax.fill_between(epochs, accs.min(0), accs.max(0), alpha=0.2)
    ax.set(title=title, xlabel="epoch", ylabel="test accuracy, %")
    ax.set_ylim(bottom=max(0, float(np.min([np.array(r["acc_per_epoch"]) for rs in runs.values() for r in rs])) * 100 - 2))
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--train", type=int, default=20_000)
    p.add_argument("--test", type=int, default=5_000)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--modes", default="full,importance,unbiased")
    p.add_argument("--keep", type=float, default=0.7, help="importance (rank) mode's share kept")
    p.add_argument("--prune", type=float, default=0.5, help="unbiased mode's share dropped below the mean loss")
    p.add_argument("--delay-ms", type=int, default=2)
    p.add_argument("--cache-size", default="10%")
    p.add_argument("--static-cache", default="30%")
    p.add_argument("--out", default=os.path.join(REPO, "out", "bench_unbiased"))
    JsonLines.argument(p, "bench_unbiased")
    a = p.parse_args()
    lines = JsonLines(a.results)
    os.makedirs(a.out, exist_ok=True)
    subprocess.run(["bash", GLUSTER_SH, "up", "--delay-ms", str(a.delay_ms)], check=True)
    root = os.path.join(a.out, f"hardness-{a.train}-{a.test}")
    make_hardness(root, a.train, a.test)
    packed = os.path.join(GMNT, f"unbiased-{a.train}")
    if not os.path.exists(os.path.join(packed, "index.fusefs")):
        pack(os.path.join(root, "train"), packed, chunk_bytes=4 << 20, force=True, progress=False,
             mix_classes=True)
    modes = a.modes.split(",")
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    setting = {"train": a.train, "test": a.test, "epochs": a.epochs, "keep": a.keep, "prune": a.prune,
               "delay_ms": a.delay_ms, "cache_size": a.cache_size, "static_cache": a.static_cache}
    for seed in range(a.seeds):
        for mode in modes:
            rows = run(a, mode, seed, packed, os.path.join(root, "test"))
            r = {"part": "run", "mode": mode, "seed": seed, "final_acc": rows[-1]["test_acc"],
                 "acc_per_epoch": [x["test_acc"] for x in rows],
                 "seconds": round(sum(x["seconds"] for x in rows), 2),
                 "backend_bytes": sum(x.get("backend_bytes", 0) for x in rows),
                 "trained": sum(x["trained"] for x in rows), "reevaluated": sum(x["reevaluated"] for x in rows),
                 **setting}
            runs[mode].append(r)
            print(json.dumps({k: v for k, v in r.items() if k != "acc_per_epoch"}), flush=True)
            lines.write(bench="bench_unbiased", **r)
    for mode, s in summary(runs).items():
        print(json.dumps({"mode": mode, **s}), flush=True)
        lines.write(bench="bench_unbiased", part="summary", mode=mode, **s, **setting)
    png = os.path.join(a.out, "bench_unbiased.png")
    plot(runs, png, f"{a.train:,} training images, {a.test:,} test, {a.seeds} seeds")
    print(f"saved {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
