"""The local cache tier and the order modes on the slowed GlusterFS volume (issue 5).
Prints figures, saves JSON and a PNG.

Set-up: the 3-brick GlusterFS volume with delay-gen (--delay-ms per brick operation), a
synthetic ImageFolder of --files JPEGs (~100 KB) packed onto it in 16 MiB chunks, read by
Debian's torchvision ImageFolder + DataLoader (batch 64, 4 workers, raw bytes) through
trainer.HintedSampler under /usr/bin/python3, the page cache dropped before every epoch,
a memory cache of 10% of the dataset, a fresh daemon per setting.

  tier     no local tier vs --local-cache on local disk with --local-cache-size 50%:
           two epochs, then a remount (the tier stays warm) and a third epoch.
  orders   random, chunk-block G = 1, 4, 16, and echo orders, two epochs each, no tier:
           samples/s (trained samples) and backend bytes per epoch.
  digits   test accuracy of the small CNN (scripts/workloads/train_importance.py) on load_digits
           trained through the mount under each order mode, same seeds; packed 32 samples
           per chunk so the chunk orders have chunks to shuffle.

usage: .venv/bin/python scripts/bench/bench_local.py [--files 6000] [--delay-ms 2]
           [--digits-epochs 15] [--out out/bench_local]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys


from common import REPO, run_trainer

from fusefs.pack import pack
from testkit.synth import (
    make_digits,
    make_imagefolder,
)
from testkit.gluster import GLUSTER_SH, GMNT
from testkit.mounts import running_mount
from trainer import mount_stats

READER = os.path.join(REPO, "scripts", "workloads", "imagefolder_reader.py")
ORDERS = [("random", "random", 1), ("chunks G=1", "chunks", 1), ("chunks G=4", "chunks", 4),
          ("chunks G=16", "chunks", 16), ("echo", "echo", 1)]
ENV = dict(os.environ, PYTHONPATH=REPO)


def read_epochs(mnt: str, epochs: int, mode: str = "random", group: int = 1, first: int = 0) -> list[dict]:
    """Run the reader for `epochs` epochs; per epoch samples/s, backend bytes and samples,
    local hits (from the daemon's statistics)."""
    cmd = ["/usr/bin/python3", READER, mnt, "--workers", "4", "--batch", "64", "--epochs",
           str(epochs), "--drop-caches", "--no-digests", "--hinted", "--mode", mode,
           "--group", str(group), "--seed", str(first)]
    r = subprocess.run(cmd, capture_output=True, text=True, env=ENV)
    if r.returncode:
        raise SystemExit(f"reader failed on {mnt}:\n{r.stderr[-3000:]}")
    rows, prev = [], None
    for ep in json.loads(r.stdout)["epochs"]:
        end = ep["stats_end"]
        start = prev or ep["stats_first_batch"]  # (the first batch's fetches are in epoch 1)
        if prev is None:
            start = {k: 0 for k in ("backend_bytes", "backend_samples", "local_hits", "hits",
                                    "backend_requests")}
        rows.append({"samples": ep["samples"], "samples_per_s": round(ep["samples_per_s"], 1),
                     "seconds": round(ep["seconds"], 2),
                     "backend_mb": round((end["backend_bytes"] - start["backend_bytes"]) / 1e6, 1),
                     "backend_samples": end["backend_samples"] - start["backend_samples"],
                     "backend_requests": end["backend_requests"] - start["backend_requests"],
                     "local_hits": end["local_hits"] - start["local_hits"]})
        prev = end
    return rows


def show(label: str, rows: list[dict]) -> None:
    for i, r in enumerate(rows):
        print(f"  {label:<22} epoch {i + 1}: {r['samples']:6d} samples {r['samples_per_s']:8.1f}/s  "
              f"backend {r['backend_mb']:7.1f} MB ({r['backend_samples']} samples, "
              f"{r['backend_requests']} requests)  local hits {r['local_hits']}", flush=True)


def bench_tier(packed: str, a) -> dict:
    out = {}
    mnt = os.path.join(a.out, "mnt")
    local = os.path.join(a.local_root, "fusefs-bench-local")
    shutil.rmtree(local, ignore_errors=True)
    with running_mount(packed, mnt, "--cache-size", "10%"):
        out["no tier"] = read_epochs(mnt, 2)
    show("no tier", out["no tier"])
    tier = ("--cache-size", "10%", "--local-cache", local, "--local-cache-size", "50%")
    with running_mount(packed, mnt, *tier):
        out["local 50%"] = read_epochs(mnt, 2)
        out["local 50% stats"] = mount_stats(mnt)["local"]
    with running_mount(packed, mnt, *tier):  # a remount: the tier is still there
        out["local 50%"] += read_epochs(mnt, 1, first=2)
        out["local 50% stats after remount"] = mount_stats(mnt)["local"]
    show("local 50% (+ remount)", out["local 50%"])
    shutil.rmtree(local, ignore_errors=True)
    return out


def bench_orders(packed: str, a) -> dict:
    out = {}
    mnt = os.path.join(a.out, "mnt")
    for label, mode, group in ORDERS:
        with running_mount(packed, mnt, "--cache-size", "10%"):
            out[label] = read_epochs(mnt, 2, mode, group)
        show(label, out[label])
    return out


def bench_digits(a) -> dict:
    digits = os.path.join(a.out, "digits")
    make_digits(digits)
    packed = os.path.join(GMNT, "local-digits-c32")
    if not os.path.exists(os.path.join(packed, "index.fusefs")):
        pack(os.path.join(digits, "train"), packed, chunk_count=32, force=True, progress=False)
    out = {}
    mnt = os.path.join(a.out, "mnt-digits")
    for label, mode, group in ORDERS:
        with running_mount(packed, mnt, "--cache-size", "10%"):
            rows = run_trainer("train_importance.py", [
                mnt, os.path.join(digits, "test"), "--mode", "full", "--order", mode,
                "--group", str(group), "--epochs", str(a.digits_epochs)])
        out[label] = rows
        print(f"  digits {label:<12} test acc per epoch: "
              + " ".join(f"{100 * x['test_acc']:.1f}" for x in rows), flush=True)
    return out


def plot(res: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(1, 3, figsize=(15, 4))
    for label in ("no tier", "local 50%"):
        rows = res["tier"][label]
        ax[0].plot(range(1, len(rows) + 1), [r["samples_per_s"] for r in rows], "-o", label=label)
    ax[0].set(title="local tier: samples/s per epoch (3rd: after a remount)", xlabel="epoch",
              ylabel="samples/s")
    names = [o[0] for o in ORDERS]
    x = range(len(names))
    ax[1].bar([i - 0.2 for i in x], [res["orders"][n][1]["samples_per_s"] for n in names], 0.4,
              label="samples/s (epoch 2)")
    ax[1].bar([i + 0.2 for i in x], [res["orders"][n][1]["backend_mb"] for n in names], 0.4,
              label="backend MB (epoch 2)")
    ax[1].set_xticks(list(x), names, rotation=20)
    ax[1].set(title="order modes (no local tier)")
    for n in names:
        rows = res["digits"][n]
        ax[2].plot([r["epoch"] for r in rows], [100 * r["test_acc"] for r in rows], "-o", ms=3, label=n)
    ax[2].set(title="load_digits test accuracy by order mode", xlabel="epoch", ylabel="%")
    for axis in ax:
        axis.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--files", type=int, default=6000)
    p.add_argument("--delay-ms", type=int, default=2)
    p.add_argument("--digits-epochs", type=int, default=15)
    p.add_argument("--local-root", default="/var/tmp", help="where the local tier's folder goes")
    p.add_argument("--out", default=os.path.join(REPO, "out", "bench_local"))
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    subprocess.run(["bash", GLUSTER_SH, "up", "--delay-ms",
                    str(a.delay_ms)], check=True)
    src = os.path.join(a.out, f"synth-{a.files}")
    if not os.path.isdir(src):
        make_imagefolder(src, a.files, n_classes=10, mean_bytes=100_000)
    packed = os.path.join(GMNT, f"local-synth-{a.files}")
    if not os.path.exists(os.path.join(packed, "index.fusefs")):
        pack(src, packed, chunk_bytes=16 << 20, force=True, progress=False)
    print("local tier:", flush=True)
    res = {"settings": vars(a), "tier": bench_tier(packed, a)}
    print("order modes:", flush=True)
    res["orders"] = bench_orders(packed, a)
    print("load_digits accuracy by order mode:", flush=True)
    res["digits"] = bench_digits(a)
    t = res["tier"]
    summary = {
        "tier_samples_per_s": {k: [r["samples_per_s"] for r in t[k]] for k in ("no tier", "local 50%")},
        "tier_backend_mb": {k: [r["backend_mb"] for r in t[k]] for k in ("no tier", "local 50%")},
        "tier_local_share": [round(r["local_hits"] / max(1, r["samples"]), 3) for r in t["local 50%"]],
        "orders_samples_per_s": {k: [r["samples_per_s"] for r in v] for k, v in res["orders"].items()},
        "orders_backend_mb": {k: [r["backend_mb"] for r in v] for k, v in res["orders"].items()},
        "orders_backend_mb_per_1k_samples": {k: round(1000 * v[1]["backend_mb"] / v[1]["samples"], 1)
                                             for k, v in res["orders"].items()},
        "digits_final_acc": {k: v[-1]["test_acc"] for k, v in res["digits"].items()},
    }
    res["summary"] = summary
    print("summary:")
    print(json.dumps(summary, indent=1))
    with open(os.path.join(a.out, "bench_local.json"), "w") as f:
        json.dump(res, f, indent=1)
    plot(res, os.path.join(a.out, "bench_local.png"))
    print(f"saved {a.out}/bench_local.json and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
