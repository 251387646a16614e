"""The main job on a built-in default: generate, pack, mount, read with ImageFolder, report.

1. generates a small synthetic ImageFolder of real JPEG files (default 2,000 files, 10
   classes, ~50 KB each) under out/demo/src;
2. packs it with `fusefs pack` into out/demo/packed;
3. mounts it with `fusefs mount` at out/demo/mnt;
4. reads the mount with torchvision's ImageFolder + DataLoader(shuffle, num_workers=2),
   run by Debian's /usr/bin/python3 (unmodified training-style code), two epochs, and
   the source folder the same way, and checks every file's bytes are identical;
5. prints what it measured and the daemon's statistics, then unmounts.

usage: .venv/bin/python scripts/demo.py [--files N] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from fusefs.pack import pack
from fusefs.synth import make_imagefolder
from fusefs.testing import running_mount
from trainer.hints import mount_stats

READER = os.path.join(REPO, "scripts", "workloads", "imagefolder_reader.py")


def read_with_imagefolder(root: str, epochs: int, workers: int) -> dict:
    r = subprocess.run(["/usr/bin/python3", READER, root, "--workers", str(workers), "--batch", "32",
                        "--epochs", str(epochs), "--shuffle"], capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"ImageFolder reader failed on {root}:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--files", type=int, default=2000)
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--mean-kb", type=int, default=50)
    p.add_argument("--out", default=os.path.join(REPO, "out", "demo"))
    p.add_argument("--workers", type=int, default=2)
    a = p.parse_args()

    src, dst, mnt = (os.path.join(a.out, x) for x in ("src", "packed", "mnt"))
    shutil.rmtree(a.out, ignore_errors=True)
    os.makedirs(a.out)
    t = time.perf_counter()
    gen = make_imagefolder(src, a.files, a.classes, mean_bytes=a.mean_kb * 1000, progress=True)
    print(f"generated {gen['files']} JPEGs in {gen['classes']} classes, "
          f"{gen['bytes'] / 1e6:.1f} MB (mean {gen['mean_bytes'] / 1e3:.1f} KB) in {time.perf_counter() - t:.1f} s")

    r = pack(src, dst, chunk_bytes=16 << 20)
    print(f"packed into {r.chunks} chunks: {r.mb_per_s:.1f} MB/s ({r.seconds:.2f} s)")

    with running_mount(dst, mnt):
        through = read_with_imagefolder(mnt, epochs=2, workers=a.workers)
        stats = mount_stats(mnt)
    direct = read_with_imagefolder(src, epochs=2, workers=a.workers)

    same = through["files"] == direct["files"] and through["classes"] == direct["classes"]
    print()
    print(f"{'reader':<34}{'epoch':>6}{'samples':>9}{'samples/s':>11}")
    for name, res in (("ImageFolder over the fusefs mount", through), ("ImageFolder over the source", direct)):
        for k, ep in enumerate(res["epochs"], 1):
            print(f"{name:<34}{k:>6}{ep['samples']:>9}{ep['samples_per_s']:>11.0f}")
    print()
    print(f"classes through the mount: {len(through['classes'])}; files: {through['n']}; "
          f"bytes identical to the source: {'yes' if same else 'NO'}")
    print("daemon statistics: " + ", ".join(f"{k}={stats[k]}" for k in
          ("opens", "reads", "bytes_served", "backend_reads", "backend_bytes", "hits", "eio")))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
