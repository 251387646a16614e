"""Hybrid CPU+accelerator training against plain training (issue 6); prints figures, saves
JSON and a PNG.

load_digits (scripts/bench_importance.make_digits: 1437 train / 360 test PNGs) is packed
and mounted with fusefs; scripts/train_hybrid.py trains the small CNN through the mount under
/usr/bin/python3 (torchvision ImageFolder + DataLoader), same seeds, once plain (one CPU
replica) and once with trainer.HybridTrainer (two CPU replicas here, CPU + GPU where torch
sees one), snapshots to a local folder after every merge. Where torch sees a GPU it also
trains GPU-only, for samples/s of GPU-only against hybrid.

usage: .venv/bin/python scripts/bench_hybrid.py [--epochs 15] [--out out/bench_hybrid]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "scripts"))

from bench_importance import make_digits, run_trainer  # noqa: E402
from fusefs.mount import running_mount  # noqa: E402
from fusefs.pack import pack  # noqa: E402


def train(mnt, test, mode, a) -> list[dict]:
    args = [mnt, test, "--mode", mode, "--epochs", str(a.epochs)]
    if mode == "hybrid":
        snaps = os.path.join(a.out, "snapshots")
        shutil.rmtree(snaps, ignore_errors=True)
        args += ["--snapshots", snaps]

    def show(row):
        extra = (f"  R {row['r']:.3f} (TC {row['tc'] * 1e3:.1f} ms, TG {row['tg'] * 1e3:.1f} ms) "
                 f"merges {row['merges']} snapshots {row['snapshots_written']}") if mode == "hybrid" else ""
        print(f"  {mode:<7} epoch {row['epoch']:2d}: test acc {100 * row['test_acc']:.2f}%  "
              f"{row['samples_per_s']:7.1f} samples/s{extra}", flush=True)
    return run_trainer("train_hybrid.py", args, show)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=15)
    p.add_argument("--out", default=os.path.join(REPO, "out", "bench_hybrid"))
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    digits = os.path.join(a.out, "digits")
    make_digits(digits)
    packed = os.path.join(a.out, "packed")
    if not os.path.exists(os.path.join(packed, "index.fusefs")):
        pack(os.path.join(digits, "train"), packed, chunk_bytes=1 << 20, force=True, progress=False)
    gpu = subprocess.run(["/usr/bin/python3", "-c", "import torch; print(torch.cuda.is_available())"],
                         capture_output=True, text=True).stdout.strip() == "True"
    res = {}
    mnt = os.path.join(a.out, "mnt")
    for mode in ("plain", "hybrid") + (("accel",) if gpu else ()):
        with running_mount(packed, mnt, "--cache-size", "100%"):
            res[mode] = train(mnt, os.path.join(digits, "test"), mode, a)
    summary = {m: {"final_acc": rows[-1]["test_acc"], "best_acc": max(r["test_acc"] for r in rows),
                   "samples_per_s": sum(r["samples_per_s"] for r in rows[1:]) / max(1, len(rows) - 1)}
               for m, rows in res.items()}
    summary["acc_gap_points"] = round(100 * (summary["plain"]["final_acc"] - summary["hybrid"]["final_acc"]), 2)
    print(json.dumps(summary, indent=1))
    with open(os.path.join(a.out, "bench_hybrid.json"), "w") as f:
        json.dump({"epochs": res, "summary": summary, "gpu": gpu}, f, indent=1)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    for mode, rows in res.items():
        ax.plot([r["epoch"] for r in rows], [100 * r["test_acc"] for r in rows], "-o", ms=3, label=mode)
    ax.set(title="load_digits: test accuracy, plain vs hybrid", xlabel="epoch", ylabel="%")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(a.out, "bench_hybrid.png"), dpi=100)
    print(f"saved {a.out}/bench_hybrid.json and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
