"""Order hints on a slowed GlusterFS volume (issue 3); prints figures, saves JSON and a PNG.

Set-up: a synthetic ImageFolder of --files JPEGs (~110 KB each) is generated locally, copied
as loose files onto the 3-brick GlusterFS volume (scripts/testbed/gluster.sh up --delay-ms 2: every
lookup, stat, open and read on the bricks is delayed 2 ms; the script first times small
reads to confirm), and packed there too. Each setting runs Debian's torchvision
ImageFolder + DataLoader(batch_size=64, num_workers=4, a loader returning raw bytes) for two
shuffled epochs under /usr/bin/python3; the page cache is dropped before every epoch (a
dataset larger than memory), and every fusefs setting gets a fresh daemon:

  (a) loose files straight from the GlusterFS mount
  (b) fusefs over the packed set, no order hints, cache = 10% of the dataset
  (c) fusefs with trainer.HintedSampler, cache = 10% of the dataset
  (u) as (b), the loader unmodified (shuffle=True), run under `fusefs run --`: the launcher
      hands the mount each epoch's order from the loader's own sampler (this tree's daemon and
      launcher only, also with --against)
  (d) fusefs over a local copy of the packed set, whole dataset cached (epoch 2 is the
      ceiling of this daemon on this machine)
  (e), (f) as (c) and (d) with --no-kernel-cache: every read served by the daemon instead
      of pushing fetched samples into the kernel page cache
  (r) the peer a user would pick instead: ratarmount (PyPI) over one tar of the same loose
      files on the same volume, read by the same loader (shuffled, no hints)
  (t) as (c) over the same files as tar shards, one tar per class folder on the volume
      (`CLASS.tar` holding the class's files), indexed in place (`fusefs pack --in-place`:
      the index alone beside them, nothing copied); the indexing is timed against `cat` of
      the tars, page cache dropped before each, in the same run
  (s) the peer over those shards: ratarmount -r -s (each tar mounted as its class folder)

Every daemon's CPU per sample (fusefs: its own getrusage; ratarmount: /proc) is printed,
and with it the CPU per sample the others spent meanwhile: the loader's processes (the page
cache drops before each epoch included), the GlusterFS client and the brick daemons, and
how busy the machine's cores were (the share of their time not idle): whether a setting
was bound by the CPU or by waiting for the storage.

With --against REF each fusefs setting runs twice, REF's daemon first, then this tree's (the
rows carry their version; the figures after the table are this tree's).

usage: .venv/bin/python scripts/bench/bench_order.py [--files N] [--delay-ms MS] [--settings abcdefrstu] [--out DIR] [--against REF]
"""
from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import os
import re
import subprocess
import sys
import time

from common import (REPO, CpuMeter, JsonLines, commit as common_commit, cpu_seconds, pids_named,
                    side_by_side)

from fusefs.pack import pack
from testkit.synth import make_imagefolder
from testkit.gluster import GLUSTER_SH, GMNT, copy_tree
from testkit.mounts import running_mount
from trainer.hints import mount_stats

READER = os.path.join(REPO, "scripts", "workloads", "imagefolder_reader.py")


def sh(*cmd):
    subprocess.run(cmd, check=True)


FUSEFS_RUN = [os.path.join(os.path.dirname(sys.executable), "fusefs"), "run", "--"]


def run_reader(root: str, hinted: bool, launcher: bool = False) -> dict:
    """Run the loader over root (under `fusefs run` if launcher); its result, with the CPU
    seconds the loader processes, the GlusterFS client and the brick daemons spent meanwhile,
    and how busy the machine was."""
    env = dict(os.environ, PYTHONPATH=REPO)
    cmd = [*(FUSEFS_RUN if launcher else []), "/usr/bin/python3", READER, root, "--workers", "4",
           "--batch", "64", "--epochs", "2", "--drop-caches", "--no-digests",
           "--hinted" if hinted else "--shuffle"]
    with CpuMeter(glusterfs=pids_named("glusterfs"), bricks=pids_named("glusterfsd")) as cpu:
        r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise SystemExit(f"reader failed on {root}:\n{r.stderr[-3000:]}")
    res = json.loads(r.stdout)
    res["cpu_s"] = {"loader": cpu.seconds["children"], "glusterfs_client": cpu.seconds["glusterfs"],
                    "bricks": cpu.seconds["bricks"]}
    res["machine_busy"] = cpu.busy
    return res


def peak_rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def fusefs_setting(dst: str, mnt: str, cache: str, hinted: bool, *extra: str, env=None,
                   launcher: bool = False) -> dict:
    with running_mount(dst, mnt, "--cache-size", cache, *extra, env=env) as (proc, _):
        before = mount_stats(mnt)
        res = run_reader(mnt, hinted, launcher)
        stats = mount_stats(mnt)
        res["daemon_peak_rss"] = peak_rss(proc.pid)
        res["daemon_cpu_s"] = stats["cpu_s"] - before["cpu_s"]
    res["final_stats"] = stats
    return res


def ratarmount_setting(tar: str, mnt: str, index_dir: str, *extra: str) -> dict:
    """The peer: ratarmount (foreground) over one tar of the loose files (or the folder of
    tar shards, extra: -r -s)."""
    os.makedirs(mnt, exist_ok=True)
    os.makedirs(index_dir, exist_ok=True)
    exe = os.path.join(os.path.dirname(sys.executable), "ratarmount")
    proc = subprocess.Popen([exe, "-f", *extra, "--index-folders", index_dir, tar, mnt],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 900  # the first mount indexes the whole tar
        while not os.path.ismount(mnt):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"ratarmount did not mount {tar}")
            time.sleep(0.2)
        cpu0 = cpu_seconds(proc.pid)
        res = run_reader(mnt, hinted=False)
        res["daemon_cpu_s"] = cpu_seconds(proc.pid) - cpu0
        res["daemon_peak_rss"] = peak_rss(proc.pid)
    finally:
        subprocess.run(["fusermount3", "-u", "-z", mnt], capture_output=True)
        proc.terminate()
        proc.wait(timeout=30)
    return res


def drop_caches() -> None:
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def index_against_cat(shards: str, dst: str) -> dict:
    """`fusefs pack --in-place SHARDS DST` timed against `cat` of the tars, the page cache
    dropped before each (the backend's sequential rate, same run): wall seconds of the
    command, and the indexing's own (what the command prints, without Python's start)."""
    tars = sorted(os.path.join(shards, x) for x in os.listdir(shards))
    size = sum(os.path.getsize(t) for t in tars)
    subprocess.run(["sync"], check=True)
    drop_caches()
    t = time.perf_counter()
    subprocess.run(["cat", *tars], stdout=subprocess.DEVNULL, check=True)
    cat_s = time.perf_counter() - t
    drop_caches()
    t = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "fusefs", "pack", "--in-place", "-q", "--force", shards, dst],
                         check=True, cwd=REPO, capture_output=True, text=True).stdout
    wall_s = time.perf_counter() - t
    index_s = float(re.search(r" in ([0-9.]+) s ", out).group(1))
    return {"index_s": index_s, "index_wall_s": round(wall_s, 2), "cat_s": round(cat_s, 2),
            "index_tars": len(tars), "index_mb_per_s": size / 1e6 / index_s, "cat_mb_per_s": size / 1e6 / cat_s,
            "index_over_cat": cat_s / index_s,
            "index_bytes": os.path.getsize(os.path.join(dst, "index.fusefs"))}


def summarize(name: str, res: dict) -> dict:
    eps = res["epochs"]
    row = {"setting": name, "samples_per_s": [e["samples_per_s"] for e in eps]}
    n = sum(e["samples"] for e in eps)
    if "daemon_cpu_s" in res:
        row["daemon_cpu_us_per_sample"] = round(1e6 * res["daemon_cpu_s"] / n, 1)
    # who else spent the machine's CPU per sample meanwhile, and how busy its cores were
    row["cpu_us_per_sample"] = {k: round(1e6 * v / n, 1) for k, v in res["cpu_s"].items()}
    row["machine_busy"] = round(res["machine_busy"], 3)
    if "final_stats" in res:
        s = res["final_stats"]
        row["cache_budget"] = s["cache_budget"]
        row["cache_peak"] = s["cache_peak"]
        row["daemon_peak_rss"] = res["daemon_peak_rss"]
        row["index_bytes"] = res.get("index_bytes", 0)
        hits, waits, misses = [], [], []
        for e in eps:
            a, b = e["stats_first_batch"], e["stats_end"]
            hits.append(b["hits"] - a["hits"])
            waits.append(b["read_waits"] - a["read_waits"])
            misses.append(b["misses"] - a["misses"])
        row["hit_ratio_after_first_batch"] = [h / max(1, h + w + m) for h, w, m in zip(hits, waits, misses)]
        row["reads_that_waited"] = waits
        row["read_wait_s"] = s["read_wait_s"]
        row["backend_requests_per_sample"] = s["backend_requests"] / n
        if all(e.get("stats_start") for e in eps):
            row["backend_requests_per_sample_per_epoch"] = [
                (e["stats_end"]["backend_requests"] - e["stats_start"]["backend_requests"]) / e["samples"]
                for e in eps]
        row["backend_reads_per_sample"] = s["backend_reads"] / n
        row["backend_bytes_per_sample"] = s["backend_bytes"] / n
        row["nodes"] = {k: v["requests"] for k, v in s["nodes"].items()}
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--files", type=int, default=20_000)
    p.add_argument("--delay-ms", type=float, default=2.0)
    p.add_argument("--out", default=os.path.join(REPO, "out", "bench_order"))
    p.add_argument("--settings", default="abcdefru", help="which settings to run (default abcdefru)")
    p.add_argument("--against", metavar="REF",
                   help="run each fusefs setting (b-f) with the daemon of commit REF too, just before "
                        "this tree's (its worktree built as bench_hotpath.py --against builds it)")
    JsonLines.argument(p, "bench_order")
    a = p.parse_args()
    lines = JsonLines(a.results)
    os.makedirs(a.out, exist_ok=True)
    src = os.path.join(a.out, f"src-{a.files}")
    local_packed = os.path.join(a.out, f"packed_local-{a.files}")
    base = os.path.join(GMNT, f"bench-{a.files}")
    loose, packed = os.path.join(base, "loose"), os.path.join(base, "packed")

    sh("bash", GLUSTER_SH, "up", "--delay-ms", str(a.delay_ms))
    probe = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "testbed", "gluster_probe.py"), GMNT],
                           capture_output=True, text=True, check=True).stdout.strip()
    print(f"GlusterFS delay check: {probe}")
    if not os.path.isdir(src):
        g = make_imagefolder(src, a.files, n_classes=100, mean_bytes=110_000, progress=True)
        print(f"generated {g['files']} JPEGs, {g['bytes'] / 1e9:.2f} GB, mean {g['mean_bytes'] / 1e3:.0f} KB")
    if not os.path.isdir(loose):
        t = time.perf_counter()
        copy_tree(src, loose)
        print(f"copied loose files to GlusterFS in {time.perf_counter() - t:.0f} s")
    if not os.path.exists(os.path.join(packed, "index.fusefs")):
        r = pack(loose, packed, force=True)
        print(f"packed on GlusterFS (read from GlusterFS): {r.mb_per_s:.0f} MB/s, {r.chunks} chunks")
    if not os.path.exists(os.path.join(local_packed, "index.fusefs")):
        pack(src, local_packed, force=True)
    index_bytes = os.path.getsize(os.path.join(packed, "index.fusefs"))
    tar = os.path.join(base, "loose.tar")
    shards = os.path.join(base, "shards")
    if ("s" in a.settings or "t" in a.settings) and not os.path.isdir(shards):
        t = time.perf_counter()
        os.makedirs(shards + ".part", exist_ok=True)
        for cls in sorted(os.listdir(src)):
            sh("tar", "-cf", os.path.join(shards + ".part", f"{cls}.tar"), "-C", os.path.join(src, cls), ".")
        os.replace(shards + ".part", shards)
        print(f"wrote one tar a class of the loose files to GlusterFS in {time.perf_counter() - t:.0f} s")
    if "r" in a.settings and not os.path.exists(tar):
        t = time.perf_counter()
        sh("tar", "-cf", tar + ".part", "-C", src, ".")
        os.replace(tar + ".part", tar)
        print(f"wrote one tar of the loose files to GlusterFS in {time.perf_counter() - t:.0f} s")

    in_place = os.path.join(base, "inplace")
    indexing = {}
    if "t" in a.settings:
        indexing = index_against_cat(shards, in_place)
        print(f"indexed {indexing['index_tars']} tars in place: {indexing['index_mb_per_s']:.0f} MB/s "
              f"({indexing['index_wall_s']:.1f} s with Python's start), cat of them "
              f"{indexing['cat_mb_per_s']:.0f} MB/s ({indexing['index_over_cat']:.2f} of cat's rate)")
    mnt = os.path.join(a.out, "mnt")
    results = {"probe": probe, "files": a.files, "delay_ms": a.delay_ms, "commit": common_commit()}
    print(f"commit {results['commit']}")
    rows = []
    stack = contextlib.ExitStack()
    atexit.register(stack.close)  # (REF's worktree goes when the script ends, however it ends)
    versions = stack.enter_context(side_by_side(a.against))  # {version: env}, REF's first
    here = common_commit()
    fusefs_settings = [
        ("b: fusefs, no hints, cache 10%", lambda env: fusefs_setting(packed, mnt, "10%", False, env=env)),
        ("c: fusefs + HintedSampler, cache 10%", lambda env: fusefs_setting(packed, mnt, "10%", True, env=env)),
        ("d: fusefs local copy, all cached",
         lambda env: fusefs_setting(local_packed, mnt, "120%", False, env=env)),
        ("e: as c, --no-kernel-cache",
         lambda env: fusefs_setting(packed, mnt, "10%", True, "--no-kernel-cache", env=env)),
        ("f: as d, --no-kernel-cache",
         lambda env: fusefs_setting(local_packed, mnt, "120%", False, "--no-kernel-cache", env=env)),
    ]
    settings = [("a: loose files on GlusterFS", None, lambda: run_reader(loose, hinted=False))]
    for name, run in fusefs_settings:  # (REF's daemon first, then this tree's)
        settings += [(name, version, lambda run=run, env=env: run(env)) for version, env in versions.items()]
    settings.append(("u: fusefs run, the loader unmodified, cache 10%", None,
                     lambda: fusefs_setting(packed, mnt, "10%", False, launcher=True)))
    settings.append(("r: ratarmount, one tar on GlusterFS", None, lambda: ratarmount_setting(
        tar, mnt + "-ratarmount", os.path.join(a.out, "ratarmount-index"))))
    settings.append(("s: ratarmount -r -s, the tar shards on GlusterFS", None, lambda: ratarmount_setting(
        shards, mnt + "-ratarmount", os.path.join(a.out, "ratarmount-index-shards"), "-r", "-s")))
    settings.append(("t: fusefs + HintedSampler, the tar shards in place, cache 10%", None,
                     lambda: dict(fusefs_setting(in_place, mnt, "10%", True), **indexing)))
    for name, version, run in settings:
        if name[0] not in a.settings:
            continue
        res = run()
        res.setdefault("index_bytes", index_bytes)
        row = summarize(name, res)
        row.update({k: v for k, v in res.items() if k.startswith(("index_", "cat_"))})
        if version is not None and a.against:
            row["version"] = version
        if version is None or version == here:
            rows.append(row)
        lines.write(bench="bench_order", files=a.files, delay_ms=a.delay_ms, probe=probe, **row)
        if version is not None and a.against:
            name = f"{name} [{version}]"
        rates = " / ".join(f"{x:.0f}" for x in row["samples_per_s"])
        extra = ""
        if "hit_ratio_after_first_batch" in row:
            extra = (f"; hit ratio {' / '.join(f'{h:.3f}' for h in row['hit_ratio_after_first_batch'])}"
                     f"; waited {row['reads_that_waited']}; backend requests/sample "
                     f"{row['backend_requests_per_sample']:.3f}; peak RSS {row['daemon_peak_rss'] / 1e6:.0f} MB "
                     f"(budget {row['cache_budget'] / 1e6:.0f} MB, index {index_bytes / 1e6:.1f} MB)")
        if "daemon_cpu_us_per_sample" in row:
            extra += f"; daemon CPU {row['daemon_cpu_us_per_sample']:.0f} us/sample"
        others = row["cpu_us_per_sample"]
        extra += (f"; CPU us/sample of the loader {others['loader']:.0f}, GlusterFS client "
                  f"{others['glusterfs_client']:.0f}, bricks {others['bricks']:.0f}; "
                  f"cores {100 * row['machine_busy']:.0f}% busy")
        print(f"{name:<40} samples/s epoch 1 / 2: {rates}{extra}", flush=True)
    results["rows"] = rows
    by = {r["setting"][0]: r for r in rows}
    if "t" in by:
        results["t_over_c"] = [t / x for t, x in zip(by["t"]["samples_per_s"], by["c"]["samples_per_s"])]
        print(f"t/c (in place over packed chunks) per epoch: "
              f"{' / '.join(f'{x:.2f}' for x in results['t_over_c'])}")
    if "u" in by and "c" in by:
        results["u_over_c"] = {k: [u / x for u, x in zip(by["u"][k], by["c"][k])]
                               for k in ("samples_per_s", "backend_requests_per_sample_per_epoch")
                               if k in by["u"] and k in by["c"]}
        print("u/c (the unmodified loader under fusefs run over HintedSampler) per epoch: " +
              "; ".join(f"{k} {' / '.join(f'{x:.2f}' for x in v)}" for k, v in results["u_over_c"].items()))
    if "t" in by and "s" in by:
        results["t_over_s"] = [t / x for t, x in zip(by["t"]["samples_per_s"], by["s"]["samples_per_s"])]
        print(f"t/s (in place over ratarmount, the same tars) per epoch: "
              f"{' / '.join(f'{x:.2f}' for x in results['t_over_s'])}")
    if not set("acd") <= set(by):
        print(json.dumps(rows, indent=1))
        return 0
    best = lambda r: max(r["samples_per_s"])
    results["c_over_a"] = [c / x for c, x in zip(by["c"]["samples_per_s"], by["a"]["samples_per_s"])]
    results["c_over_d"] = best(by["c"]) / best(by["d"])
    print(f"c/a per epoch: {' / '.join(f'{x:.2f}' for x in results['c_over_a'])}; "
          f"c/d (best epochs): {results['c_over_d']:.2f}")
    if "r" in by:
        results["c_over_r"] = [c / x for c, x in zip(by["c"]["samples_per_s"], by["r"]["samples_per_s"])]
        print(f"c/r (fusefs over the ratarmount peer) per epoch: "
              f"{' / '.join(f'{x:.2f}' for x in results['c_over_r'])}")
    with open(os.path.join(a.out, "bench_order.json"), "w") as f:
        json.dump(results, f, indent=1)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 3.8))
    for k, r in enumerate(rows):
        for e, rate in enumerate(r["samples_per_s"]):
            ax.bar(k + (e - 0.5) * 0.38, rate, 0.38, color=["#4878a8", "#e0a040"][e],
                   label=f"epoch {e + 1}" if k == 0 else None)
    ax.set_xticks(range(len(rows)), [r["setting"] for r in rows], fontsize=7)
    ax.set_ylabel("samples/s")
    ax.set_title(f"ImageFolder+DataLoader(4 workers), {a.files} files, GlusterFS +{a.delay_ms:g} ms/op")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(a.out, "bench_order.png"), dpi=100)
    print(f"saved {a.out}/bench_order.json and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
