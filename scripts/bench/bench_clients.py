"""Readers no one here wrote, on the slowed GlusterFS test bed: fio's random-read job and
`tar -cf - . | sha256sum`, over loose files on the volume against a fusefs mount of the
packed copy on the same volume, side by side; prints figures, saves JSON.

Set-up: --files synthetic JPEGs (~100 KB) generated locally, copied to the volume as loose
files and packed there (scripts/testbed/gluster.sh up --delay-ms 2: every lookup, stat,
open and read delayed 2 ms). For each reader the page cache is dropped, then the wall time
of the whole command is taken (fio opens every file before its job starts: that is part of
what a reader pays). fio: `--opendir` over the tree, `--rw=randread --bs=128k` with files
chosen at random (`--file_service_type=random`), every whole block of every file read
once. tar: `tar --sort=name -cf - . | sha256sum`, whose digests must agree. fusefs runs
without an order (these readers write none): a cache of 10% of the set, a fresh daemon per
reader.

`--also-options ARGS` also runs each reader over a mount with those arguments, in the
same rounds (e.g. `--also-options=--no-fast-path`: opens answered on the Python loop).

usage: .venv/bin/python scripts/bench/bench_clients.py [--files 2000] [--rounds 2] [--out DIR]
       [--also-options ARGS]
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import time

from common import REPO, JsonLines, commit as common_commit

from fusefs.pack import pack
from testkit.gluster import GLUSTER_SH, GMNT, copy_tree, drop_caches
from testkit.mounts import running_mount
from testkit.synth import make_imagefolder


def fio(root: str) -> dict:
    drop_caches()
    t = time.perf_counter()
    r = subprocess.run(["fio", "--name=randread", f"--opendir={root}", "--rw=randread", "--bs=128k",
                        "--file_service_type=random", "--readonly", "--ioengine=psync",
                        "--output-format=json"], capture_output=True, text=True, check=True)
    wall = time.perf_counter() - t
    job = json.loads(r.stdout[r.stdout.index("{"):])["jobs"][0]
    return {"wall_s": wall, "io_bytes": job["read"]["io_bytes"], "error": job["error"]}


def tar_sha256(root: str) -> dict:
    drop_caches()
    t = time.perf_counter()
    r = subprocess.run("tar --sort=name -cf - . | sha256sum", shell=True, cwd=root, capture_output=True,
                       text=True, check=True)
    return {"wall_s": time.perf_counter() - t, "sha256": r.stdout.split()[0]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--files", type=int, default=2000, help="JPEG files (default 2000)")
    p.add_argument("--delay-ms", type=float, default=2.0, help="GlusterFS delay per operation (default 2)")
    p.add_argument("--rounds", type=int, default=2, help="runs of each reader, in turn (default 2)")
    p.add_argument("--out", default=os.path.join(REPO, "out", "bench_clients"))
    p.add_argument("--also-options", metavar="ARGS", help="mount arguments of a second fusefs, side by side")
    JsonLines.argument(p, "bench_clients")
    a = p.parse_args()
    lines = JsonLines(a.results)
    subprocess.run(["bash", GLUSTER_SH, "up", "--delay-ms", str(a.delay_ms)], check=True, capture_output=True)
    os.makedirs(a.out, exist_ok=True)
    src = os.path.join(a.out, f"src-{a.files}")
    if not os.path.isdir(src):
        make_imagefolder(src, a.files, n_classes=10, mean_bytes=100_000, progress=False)
    remote = os.path.join(GMNT, f"clients-{a.files}")
    loose, packed = os.path.join(remote, "loose"), os.path.join(remote, "packed")
    if not os.path.exists(os.path.join(packed, "index.fusefs")):
        shutil.rmtree(remote, ignore_errors=True)
        copy_tree(src, loose, threads=8)
        pack(src, packed, chunk_bytes=8 << 20, progress=False)
    n = sum(len(fs) for _, _, fs in os.walk(src))
    commit = common_commit()
    res = {"files": n, "delay_ms": a.delay_ms, "commit": commit, "rounds": []}
    mnt = os.path.join(a.out, "mnt")
    mounts = {"fusefs": []}
    if a.also_options:
        mounts[f"fusefs {a.also_options}"] = shlex.split(a.also_options)
    res["mounts"] = list(mounts)
    for _ in range(a.rounds):
        row = {"fio_loose": fio(loose), "tar_loose": tar_sha256(loose)}
        line = f"loose: fio {n / row['fio_loose']['wall_s']:4.0f}, tar {n / row['tar_loose']['wall_s']:4.0f}"
        for name, extra in mounts.items():
            with running_mount(packed, mnt, "--cache-size", "10%", *extra):
                row[f"fio_{name}"] = fio(mnt)
            with running_mount(packed, mnt, "--cache-size", "10%", *extra):
                row[f"tar_{name}"] = tar_sha256(mnt)
            same = row[f"tar_{name}"]["sha256"] == row["tar_loose"]["sha256"]
            line += (f";  {name}: fio {n / row[f'fio_{name}']['wall_s']:4.0f}, tar "
                     f"{n / row[f'tar_{name}']['wall_s']:4.0f} (digest {'agrees' if same else 'DIFFERS'})")
        res["rounds"].append(row)
        print(f"files/s, {line}", flush=True)
        for key, got in row.items():
            reader, system = key.split("_", 1)
            lines.write(bench="bench_clients", round=len(res["rounds"]), files=n, delay_ms=a.delay_ms,
                        reader=reader, system=system, files_per_s=round(n / got["wall_s"], 1),
                        digest_agrees=None if reader != "tar" else got["sha256"] == row["tar_loose"]["sha256"])
    with open(os.path.join(a.out, "bench_clients.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(f"saved {a.out}/bench_clients.json (commit {commit})")
    same = all(r["tar_loose"]["sha256"] == r[f"tar_{name}"]["sha256"] for r in res["rounds"] for name in mounts)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
