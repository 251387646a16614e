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

--local packs the set into a local folder instead (no GlusterFS: the GPU node); its chunk
files then leave the page cache before each epoch. --model resnet18 --device auto trains
ResNet-18 (CIFAR stem) on the GPU where there is one, with --workers loader workers and
--batch; --parallel-seeds trains the seeds of a mode at once, each through its own mount
(the modes still run one after another, so each mode's time is measured under the same
load).

usage: .venv/bin/python scripts/bench/bench_unbiased.py [--train 20000] [--test 5000]
           [--epochs 20] [--seeds 3] [--modes full,importance,unbiased] [--keep 0.7]
           [--prune 0.5] [--warmup 3] [--delay-ms 2] [--cache-size 10%] [--static-cache 30%]
           [--local] [--model small|resnet18] [--device cpu|auto|cuda] [--workers 2]
           [--batch 64] [--parallel-seeds] [--python /usr/bin/python3]
On the GPU node: python3 scripts/bench/bench_unbiased.py --local --model resnet18 --device auto
           --python python3 --parallel-seeds --warmup 2 --results $OUT/figures.jsonl
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from common import REPO, JsonLines, run_trainer

from fusefs.pack import pack
from testkit.gluster import BRICKS, GLUSTER_SH, GMNT
from testkit.mounts import running_mount
from testkit.synth import make_hardness



def run(a, mode: str, seed: int, packed: str, test: str) -> list[dict]:
    """One training run through a fresh mount of its own: its rows, one per epoch."""
    mnt = os.path.join(a.out, f"mnt-{seed}")
    if a.local:
        evict = [f"--evict={packed}"]
    else:
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
                                                   "--seed", str(seed), "--warmup", str(a.warmup),
                                                   "--model", a.model,
                                                   "--device", a.device, "--workers", str(a.workers),
                                                   "--batch", str(a.batch), *evict],
                           show, python=a.python)


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
    p.add_argument("--warmup", type=int, default=3,
                   help="full epochs before the first importance epoch (the loss window)")
    p.add_argument("--delay-ms", type=int, default=2)
    p.add_argument("--cache-size", default="10%")
    p.add_argument("--static-cache", default="30%")
    p.add_argument("--local", action="store_true",
                   help="pack into a local folder under --out, no GlusterFS (the GPU node)")
    p.add_argument("--model", choices=("small", "resnet18"), default="small")
    p.add_argument("--device", choices=("cpu", "auto", "cuda"), default="cpu")
    p.add_argument("--workers", type=int, default=2, help="loader workers per training run")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--parallel-seeds", action="store_true", help="train a mode's seeds at once")
    p.add_argument("--python", default="/usr/bin/python3",
                   help="the trainers' Python (needs torch and torchvision; python3 on the GPU node)")
    p.add_argument("--out", default=os.path.join(REPO, "out", "bench_unbiased"))
    JsonLines.argument(p, "bench_unbiased")
    a = p.parse_args()
    lines = JsonLines(a.results)
    os.makedirs(a.out, exist_ok=True)
    if not a.local:
        subprocess.run(["bash", GLUSTER_SH, "up", "--delay-ms", str(a.delay_ms)], check=True)
    root = os.path.join(a.out, f"hardness-{a.train}-{a.test}")
    make_hardness(root, a.train, a.test)
    packed = os.path.join(a.out if a.local else GMNT, f"unbiased-{a.train}")
    if not os.path.exists(os.path.join(packed, "index.fusefs")):
        pack(os.path.join(root, "train"), packed, chunk_bytes=4 << 20, force=True, progress=False,
             mix_classes=True)
    modes = a.modes.split(",")
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    setting = {"train": a.train, "test": a.test, "epochs": a.epochs, "warmup": a.warmup, "keep": a.keep,
               "prune": a.prune,
               "delay_ms": None if a.local else a.delay_ms, "cache_size": a.cache_size,
               "static_cache": a.static_cache, "model": a.model, "backend": "local" if a.local else "gluster",
               "workers": a.workers, "batch": a.batch, "parallel_seeds": a.parallel_seeds}

    def one(mode: str, seed: int) -> dict:
        rows = run(a, mode, seed, packed, os.path.join(root, "test"))
        r = {"part": "run", "mode": mode, "seed": seed, "final_acc": rows[-1]["test_acc"],
             "acc_per_epoch": [x["test_acc"] for x in rows],
             "seconds": round(sum(x["seconds"] for x in rows), 2),
             "backend_bytes": sum(x.get("backend_bytes", 0) for x in rows),
             "trained": sum(x["trained"] for x in rows), "reevaluated": sum(x["reevaluated"] for x in rows),
             **setting}
        print(json.dumps({k: v for k, v in r.items() if k != "acc_per_epoch"}), flush=True)
        lines.write(bench="bench_unbiased", **r)
        return r
    if a.parallel_seeds:  # mode after mode, each mode's seeds at once
        with ThreadPoolExecutor(a.seeds) as pool:
            for mode in modes:
                runs[mode] = list(pool.map(lambda seed: one(mode, seed), range(a.seeds)))
    else:  # seed after seed, the modes in turn: a noisy machine's drift hits every mode alike
        for seed in range(a.seeds):
            for mode in modes:
                runs[mode].append(one(mode, seed))
    for mode, s in summary(runs).items():
        print(json.dumps({"mode": mode, **s}), flush=True)
        lines.write(bench="bench_unbiased", part="summary", mode=mode, **s, **setting)
    png = os.path.join(a.out, "bench_unbiased.png")
    plot(runs, png, f"{a.train:,} training images, {a.test:,} test, {a.seeds} seeds")
    print(f"saved {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
