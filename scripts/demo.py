"""The case fusefs is built for, at small scale: small files on a slow shared filesystem.

1. starts the GlusterFS test bed (scripts/testbed/gluster.sh: a 3-brick volume on this
   machine) with every lookup, stat, open and read delayed --delay-ms (2 ms: a loaded
   parallel filesystem's metadata and IOPS cost);
2. generates a synthetic ImageFolder of real JPEG files (default 3,000 files, 10 classes,
   ~100 KB each) and puts it on the volume twice: as loose files, and packed by `fusefs pack`;
3. reads the loose files with torchvision's ImageFolder + DataLoader (shuffled, 4 worker
   processes), run by Debian's /usr/bin/python3 as unmodified training code would;
4. mounts the packed copy with `fusefs mount` (a cache of 10% of the set, a fresh daemon for
   each row) and reads it with the same script: as it is; as it is under `fusefs run --`,
   which hands the mount each epoch's order from the loader's own sampler (two epochs); and
   changed to trainer.HintedSampler, the way to choose the order's mode;
5. checks every file's bytes through the mount against the source, prints the figures and
   the daemon's statistics, unmounts. The page cache is dropped before every epoch.

usage: .venv/bin/python scripts/demo.py [--files N] [--delay-ms MS] [--out DIR]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time

from fusefs.client import mount_stats
from fusefs.pack import pack
from testkit.synth import make_imagefolder
from testkit.gluster import GLUSTER_SH, GMNT, copy_tree
from testkit.mounts import running_mount

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
READER = os.path.join(REPO, "scripts", "workloads", "imagefolder_reader.py")


FUSEFS_RUN = [os.path.join(os.path.dirname(sys.executable), "fusefs"), "run", "--quiet", "--"]


def read_with_imagefolder(root: str, epochs: int, workers: int, hinted: bool, digests: bool,
                          launcher: bool = False) -> dict:
    cmd = [*(FUSEFS_RUN if launcher else []), "/usr/bin/python3", READER, root, "--workers", str(workers),
           "--batch", "32", "--epochs", str(epochs), "--drop-caches", "--hinted" if hinted else "--shuffle"]
    if not digests:
        cmd.append("--no-digests")
    r = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=REPO))
    if r.returncode != 0:
        raise SystemExit(f"ImageFolder reader failed on {root}:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout)


def sha256_tree(root: str) -> dict:
    out = {}
    for d, _, files in os.walk(root):
        for f in files:
            with open(os.path.join(d, f), "rb") as fh:
                out[os.path.relpath(os.path.join(d, f), root)] = hashlib.sha256(fh.read()).hexdigest()
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--files", type=int, default=3000, help="JPEG files to generate (default 3000)")
    p.add_argument("--classes", type=int, default=10, help="classes (default 10)")
    p.add_argument("--mean-kb", type=int, default=100, help="mean file size in KB (default 100)")
    p.add_argument("--delay-ms", type=float, default=2.0, help="GlusterFS delay per operation (default 2)")
    p.add_argument("--workers", type=int, default=4, help="DataLoader worker processes (default 4)")
    p.add_argument("--out", default=os.path.join(REPO, "out", "demo"), help="local working folder")
    a = p.parse_args()
    t_start = time.perf_counter()
    up = subprocess.run(["bash", GLUSTER_SH, "up", "--delay-ms", str(a.delay_ms)], capture_output=True, text=True)
    if up.returncode != 0:
        raise SystemExit(f"the GlusterFS test bed did not start:\n{up.stdout}{up.stderr}")
    print(up.stdout.strip().splitlines()[-1])

    src, mnt = os.path.join(a.out, "src"), os.path.join(a.out, "mnt")
    remote = os.path.join(GMNT, f"demo-{a.files}")
    loose, packed = os.path.join(remote, "loose"), os.path.join(remote, "packed")
    shutil.rmtree(a.out, ignore_errors=True)
    shutil.rmtree(remote, ignore_errors=True)
    os.makedirs(a.out)
    gen = make_imagefolder(src, a.files, a.classes, mean_bytes=a.mean_kb * 1000, progress=False)
    print(f"generated {gen['files']} JPEGs in {gen['classes']} classes, {gen['bytes'] / 1e6:.1f} MB "
          f"(mean {gen['mean_bytes'] / 1e3:.1f} KB)")
    t = time.perf_counter()
    copy_tree(src, loose)
    print(f"copied them to GlusterFS as loose files in {time.perf_counter() - t:.1f} s")
    r = pack(src, packed, chunk_bytes=8 << 20, progress=False)
    print(f"packed them onto GlusterFS: {r.chunks} chunks in {r.seconds:.1f} s")

    direct = read_with_imagefolder(loose, epochs=1, workers=a.workers, hinted=False, digests=False)
    with running_mount(packed, mnt, "--cache-size", "10%"):
        unhinted = read_with_imagefolder(mnt, epochs=1, workers=a.workers, hinted=False, digests=False)
    with running_mount(packed, mnt, "--cache-size", "10%"):
        through = read_with_imagefolder(mnt, epochs=2, workers=a.workers, hinted=False, digests=True,
                                        launcher=True)
        stats = mount_stats(mnt)
    with running_mount(packed, mnt, "--cache-size", "10%"):
        changed = read_with_imagefolder(mnt, epochs=1, workers=a.workers, hinted=True, digests=False)
    want = sha256_tree(src)
    same = {k: v[0] for k, v in through["files"].items()} == want and sorted(through["delivered"]) == \
        sorted(want.values())

    print()
    print(f"{'ImageFolder + DataLoader(shuffle=True), page cache dropped':<60}{'epoch':>6}{'samples/s':>11}")
    rows = [("loose files on GlusterFS", direct["epochs"][:1]),
            ("fusefs (10% cache), the script as it is", unhinted["epochs"][:1]),
            ("fusefs run -- the script as it is", through["epochs"]),
            ("fusefs, the script changed to HintedSampler", changed["epochs"][:1])]
    for name, epochs in rows:
        for k, ep in enumerate(epochs, 1):
            print(f"{name:<60}{k:>6}{ep['samples_per_s']:>11.0f}")
    gain = through["epochs"][0]["samples_per_s"] / direct["epochs"][0]["samples_per_s"]
    print(f"\nUnder fusefs run the unmodified script read {gain:.1f}x as many samples per second as from "
          f"the loose files in its first epoch ({a.delay_ms:g} ms per storage operation, {a.files} files "
          f"of {gen['mean_bytes'] / 1e3:.0f} KB), without a line of it changed.")
    print("Where fusefs does not help: on a local disk or a set already in the page cache, reading "
          "the files directly is faster (README, \"When it helps\").")
    print(f"files through the mount: {through['n']}; bytes identical to the source: {'yes' if same else 'NO'}")
    print("daemon statistics: " + ", ".join(f"{k}={stats[k]}" for k in
          ("opens", "hits", "misses", "read_waits", "backend_requests", "backend_bytes", "eio",
           "cpu_us_per_sample")))
    print(f"demo took {time.perf_counter() - t_start:.0f} s")
    shutil.rmtree(remote, ignore_errors=True)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
