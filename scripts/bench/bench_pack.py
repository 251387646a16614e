"""`fusefs pack` at ImageNet's count: seconds, CPU and peak memory a file.

A tree of tiny files (1,000 class folders as ImageNet's, 100 bytes each; made once under
--out and reused) is packed by `python -m fusefs pack SRC DST --force` in a child process,
the page cache warm (what is measured is pack's own work a file, not the disk's): its wall
seconds, its CPU seconds (user and system, getrusage of the child) a file, and its peak
resident memory against the index it writes. With --against REF the same for REF's
fusefs, alternating by round, side by side. With --in-place the same files lie in one tar
(written once with Python's tarfile, as CLASS/NAME members) and `fusefs pack --in-place`
indexes it instead.

usage: .venv/bin/python scripts/bench/bench_pack.py [--files N] [--rounds R] [--against REF] [--in-place]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import REPO, JsonLines, side_by_side  # noqa: E402

CLASSES = 1000
FILE_BYTES = 100


def make_tree(root: str, n: int) -> str:
    """A tree of n files of FILE_BYTES in CLASSES folders at root (reused when complete)."""
    done = os.path.join(root, ".complete")
    if os.path.exists(done):
        return os.path.join(root, "src")
    shutil.rmtree(root, ignore_errors=True)
    src = os.path.join(root, "src")
    body = b"x" * FILE_BYTES
    for c in range(CLASSES):
        folder = os.path.join(src, f"class{c:04d}")
        os.makedirs(folder)
        for i in range(c, n, CLASSES):
            fd = os.open(os.path.join(folder, f"img{i:08d}.jpg"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            os.write(fd, body)
            os.close(fd)
    open(done, "w").close()
    return src


def make_tar(root: str, n: int) -> str:
    """One tar of n members of FILE_BYTES in CLASSES folders at root (reused when complete)."""
    import io
    import tarfile
    path = os.path.join(root, "tree.tar")
    if os.path.exists(path):
        return path
    os.makedirs(root, exist_ok=True)
    body = b"x" * FILE_BYTES
    with tarfile.open(path + ".part", "w", format=tarfile.GNU_FORMAT) as t:
        for c in range(CLASSES):
            for i in range(c, n, CLASSES):
                ti = tarfile.TarInfo(f"class{c:04d}/img{i:08d}.jpg")
                ti.size, ti.mode = FILE_BYTES, 0o644
                t.addfile(ti, io.BytesIO(body))
    os.replace(path + ".part", path)
    return path


def pack_once(src: str, dst: str, env: dict, version: str, n: int, in_place: bool = False) -> dict:
    """One `fusefs pack` (--in-place: of the tar src) of src into dst in a child with env (its
    fusefs): the row."""
    t0 = time.perf_counter()
    extra = ["--in-place"] if in_place else []
    proc = subprocess.Popen([sys.executable, "-m", "fusefs", "pack", *extra, src, dst, "--force"], env=env,
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    err = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"bench_pack.py: pack with {version} failed: {err.decode(errors='replace')[-400:]}")
    index = os.path.getsize(os.path.join(dst, "index.fusefs"))
    return {"bench": "bench_pack", "regime": "in_place" if in_place else "pack", "version": version, "files": n, "seconds": round(seconds, 2),
            "files_per_s": round(n / seconds), "cpu_us_per_file": round(1e6 * (usage.ru_utime + usage.ru_stime) / n, 1),
            "peak_rss_mb": round(usage.ru_maxrss / 1024, 1), "index_mb": round(index / 2**20, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--files", type=int, default=1_281_000, help="files (default 1,281,000, ImageNet's count)")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--out", default=os.path.join(REPO, "out", "bench_pack"))
    p.add_argument("--against", metavar="REF", help="also pack with REF's fusefs, alternating by round")
    p.add_argument("--in-place", action="store_true", help="index one tar of the files in place instead")
    JsonLines.argument(p, "bench_pack")
    a = p.parse_args()
    results = JsonLines(a.results)
    src = make_tar(os.path.join(a.out, f"tar-{a.files}"), a.files) if a.in_place else \
        make_tree(os.path.join(a.out, f"tree-{a.files}"), a.files)
    dst = os.path.join(a.out, f"packed-{a.files}")
    with side_by_side(a.against) as versions:
        for i in range(a.rounds):  # (REF first in even rounds, last in odd ones)
            for version, env in (list(versions.items()) if i % 2 == 0 else list(versions.items())[::-1]):
                row = pack_once(src, dst, env, version, a.files, a.in_place)
                print(json.dumps(row), flush=True)
                results.write(**row)
    shutil.rmtree(dst, ignore_errors=True)


if __name__ == "__main__":
    main()
