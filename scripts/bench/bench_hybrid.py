"""Hybrid CPU+accelerator training against each replica alone, side by side; prints
figures, saves JSON and a PNG (samples/s and test accuracy per epoch).

load_digits (testkit.synth.make_digits: 1437 train / 360 test PNGs) is packed
and mounted with fusefs; scripts/workloads/train_hybrid.py trains through the mount under
/usr/bin/python3 (torchvision ImageFolder + DataLoader), same seeds, in three modes: the
accelerator alone (a CPU replica stands in where torch sees no GPU), the CPU alone, and
trainer.HybridTrainer (both). Models: the small CNN and ResNet-18 (CIFAR stem) at 32 px.
--modes picks among the three; --seeds runs the modes in turn (A B C A B C), seed 0, 1, ...,
so each mode's final accuracy has a mean and a spread, and a noisy machine's drift hits every
mode alike. Each model's summary gives, per mode, the median samples/s, the final accuracy
and the mean of the last three epochs (mean, sample std, min, max over the seeds), and the
probe's verdict with its samples/s with the CPU replica on and off in each hybrid run.

usage: .venv/bin/python scripts/bench/bench_hybrid.py [--models small,resnet18] [--epochs 15]
                                                [--modes accel,cpu,hybrid] [--seeds 1]
                                                [--out out/bench_hybrid]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys


from common import REPO, JsonLines, run_trainer, commit as common_commit

from fusefs.pack import pack
from testkit.synth import make_digits
from testkit.mounts import running_mount

MODES = ("accel", "cpu", "hybrid")


def train(mnt, test, model, mode, seed, a, lines) -> list[dict]:
    args = [mnt, test, "--mode", mode, "--model", model, "--epochs", str(a.epochs),
            "--workers", str(a.workers), "--batch", str(a.batch), "--seed", str(seed)]
    if mode == "hybrid":
        snaps = os.path.join(a.out, "snapshots")
        shutil.rmtree(snaps, ignore_errors=True)
        args += ["--snapshots", snaps]

    def show(row):
        extra = (f"  accel {row['samples_accel']:5d} cpu {row['samples_cpu']:4d} samples"
                 f"  gain {row['gain']:.3f} (TC {row['tc'] * 1e3:.1f} ms, TG {row['tg'] * 1e3:.1f} ms)"
                 f" cpu {'on' if row['cpu_active'] else 'off'} merges {row['merges']}"
                 ) if mode == "hybrid" else ""
        print(f"  {model:<8} {mode:<6} epoch {row['epoch']:2d}: test acc {100 * row['test_acc']:.2f}%  "
              f"{row['samples_per_s']:8.1f} samples/s{extra}", flush=True)
        lines.write(bench="bench_hybrid", seed=seed, **row)
    return run_trainer("train_hybrid.py", args, show, python=a.python)


def spread(xs: list[float]) -> dict:
    """Mean, sample std, min and max of accuracies, in points."""
    pts = [100 * x for x in xs]
    return {"mean": round(statistics.mean(pts), 2),
            "std": round(statistics.stdev(pts), 2) if len(pts) > 1 else 0.0,
            "min": round(min(pts), 2), "max": round(max(pts), 2)}


def summarise(runs: dict) -> dict:
    """Per mode (one run per seed): median over seeds of the mean samples/s of epochs 2..,
    the final accuracy and the mean accuracy of the last three epochs; the ratios between
    modes; the probe's verdicts and on/off figures of the hybrid runs."""
    out = {}
    for mode, rounds in runs.items():
        rates = [statistics.mean(r["samples_per_s"] for r in rows[1:] or rows) for rows in rounds]
        final = [rows[-1]["test_acc"] for rows in rounds]
        out[mode] = {"samples_per_s": round(statistics.median(rates), 1),
                     "samples_per_s_rounds": [round(x, 1) for x in rates],
                     "final_acc": final, "final": spread(final),
                     "last3": spread([statistics.mean(r["test_acc"] for r in rows[-3:]) for rows in rounds])}
    if "accel" in out and "hybrid" in out:
        acc, hyb = out["accel"], out["hybrid"]
        faster = max(out[m]["samples_per_s"] for m in out if m != "hybrid")
        out["hybrid_over_accel"] = round(hyb["samples_per_s"] / acc["samples_per_s"], 3)
        out["hybrid_over_faster_alone"] = round(hyb["samples_per_s"] / faster, 3)
        out["acc_gap_points"] = round(acc["final"]["mean"] - hyb["final"]["mean"], 2)
    if "hybrid" in out:
        lasts = [rows[-1] for rows in runs["hybrid"]]
        out["hybrid_cpu_active"] = lasts[-1]["cpu_active"]
        out["hybrid_gain"] = lasts[-1]["gain"]
        out["probes"] = [{"cpu_active": r["cpu_active"], "gain": round(r["gain"], 4),
                          "samples_cpu": sum(x["samples_cpu"] for x in rows), **r.get("probe", {})}
                         for r, rows in zip(lasts, runs["hybrid"])]
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="small", help="comma-separated: small, resnet18 (default small)")
    p.add_argument("--epochs", type=int, default=15, help="epochs per run (default 15)")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated: accel, cpu, hybrid (default all)")
    p.add_argument("--seeds", type=int, default=1, help="runs of each mode, in turn, seed 0, 1, ... (default 1)")
    p.add_argument("--batch", type=int, default=64, help="batch size (default 64)")
    p.add_argument("--workers", type=int, default=1, help="DataLoader worker processes (default 1)")
    p.add_argument("--python", default="/usr/bin/python3",
                   help="the trainers' Python (needs torch and torchvision; python3 on the GPU node)")
    p.add_argument("--out", default=os.path.join(REPO, "out", "bench_hybrid"))
    p.add_argument("--jsonl", help="append each epoch and each model's summary as a JSON line here "
                                   "as it is measured (default OUT/bench_hybrid.jsonl)")
    a = p.parse_args()
    modes = a.modes.split(",")
    if not set(modes) <= set(MODES):
        p.error(f"unknown mode: {', '.join(sorted(set(modes) - set(MODES)))}")
    os.makedirs(a.out, exist_ok=True)
    digits = os.path.join(a.out, "digits")
    make_digits(digits)
    packed = os.path.join(a.out, "packed")
    if not os.path.exists(os.path.join(packed, "index.fusefs")):
        pack(os.path.join(digits, "train"), packed, chunk_bytes=1 << 20, force=True, progress=False)
    probe = subprocess.run([a.python, "-c", "import torch, os; print(torch.cuda.is_available(), "
                            "torch.cuda.get_device_name() if torch.cuda.is_available() else '', os.cpu_count())"],
                           capture_output=True, text=True).stdout.split(maxsplit=1)
    gpu = probe[0] == "True"
    machine = probe[1].strip() if len(probe) > 1 else ""
    commit = common_commit()
    lines = JsonLines(a.jsonl or os.path.join(a.out, "bench_hybrid.jsonl"))
    mnt = os.path.join(a.out, "mnt")
    runs: dict = {}
    summary: dict = {}
    for model in a.models.split(","):
        runs[model] = {m: [] for m in modes}
        with running_mount(packed, mnt, "--cache-size", "100%"):
            for seed in range(a.seeds):
                for mode in modes:
                    runs[model][mode].append(train(mnt, os.path.join(digits, "test"), model, mode,
                                                   seed, a, lines))
        summary[model] = summarise(runs[model])
        lines.write(bench="bench_hybrid", model=model, summary=summary[model], gpu=gpu, epochs=a.epochs,
                    batch=a.batch, workers=a.workers)
        print(json.dumps({model: summary[model]}, indent=1), flush=True)
    with open(os.path.join(a.out, "bench_hybrid.json"), "w") as f:
        json.dump({"summary": summary, "runs": runs, "gpu": gpu, "machine": machine, "commit": commit,
                   "epochs": a.epochs, "seeds": a.seeds, "workers": a.workers, "batch": a.batch}, f,
                  indent=1)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(len(runs), 2, figsize=(10, 3.5 * len(runs)), squeeze=False)
    for (model, by_mode), (ax_rate, ax_acc) in zip(runs.items(), axes):
        for mode, rounds in by_mode.items():
            for i, rows in enumerate(rounds):
                style = dict(color=f"C{MODES.index(mode)}", label=mode if i == 0 else None, ms=3)
                ax_rate.plot([r["epoch"] for r in rows], [r["samples_per_s"] for r in rows], "-o", **style)
                ax_acc.plot([r["epoch"] for r in rows], [100 * r["test_acc"] for r in rows], "-o", **style)
        where = "GPU" if gpu else "CPU stand-in"
        ax_rate.set(title=f"{model}: samples/s ({where})", xlabel="epoch", ylabel="samples/s")
        ax_acc.set(title=f"{model}: test accuracy", xlabel="epoch", ylabel="%")
        ax_rate.legend()
        ax_acc.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(a.out, "bench_hybrid.png"), dpi=100)
    print(f"saved {a.out}/bench_hybrid.json and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
