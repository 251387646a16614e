"""The daemon's hot path: CPU and FUSE requests per sample (the regression guard for fusefs/).

A local packed set of random files (~110 KB each, like ImageNet JPEGs) is mounted with a
cache larger than the set (a tenth of it in the small_* regimes); 4 reader processes read
whole files in an epoch order written to the mount (as HintedSampler writes it), each
taking every 4th position (as DataLoader workers do). The regimes, each one epoch in a
fresh order:

  chunks_cold  fresh daemon, page cache dropped: every sample is fetched from the local
           chunk files on disk (read, checksummed, delivered; its reads answered from the
           cache by the fast path, or with --no-fast-path it is pushed to the kernel)
  chunks   as chunks_cold with the chunk files in the page cache (a fresh daemon): the
           daemon's own cost of a fetched sample, without the disk's
  kernel   the next epoch: the kernel page cache holds every sample
  kernel_os  as kernel, the readers opening files with os.open instead of Python's open():
           no isatty, so no ioctl request per file (Python up to 3.13 asks isatty of every
           file it opens, ImageFolder's loader included)
  kernel_paced  as kernel, the readers opening --pace files a second together (1,000), evenly
           spread, as decoding workers do: most requests find the daemon idle and wake it
  daemon   the kernel page cache dropped (echo 1 > drop_caches), the daemon's cache holds
           every sample
  handlers fusefs's own share of `kernel`: its open and release handlers called in-process
           (scripts/bench/handlers_cost.py: no kernel, no pyfuse3 loop), a steady figure
  fetch_loop  the event loop's own CPU per fetched sample, in-process with a cache of a tenth
           of the set (scripts/bench/fetch_cost.py --cache 0.1: the core read along an order
           by threads standing in for the readers and the fast path), apart from the
           kernel's copies that set the fetched regimes' figures on this VM (a version whose
           fusefs the script cannot drive, an old REF, has no such row)
  fetch_loop_missed  the same without an order (fetch_cost.py --without-order): the
           readers' random reads are every one a miss, as a loader's that hands no order
  small_*  a fresh daemon with a cache of a tenth of the set (as in training): small_fill
           (first epoch, the chunk files on disk as in chunks_cold), small_kernel (the
           next: the kernel page cache still holds what was pushed), small_dropped (the
           kernel page cache dropped before the epoch, as memory pressure drops it, and the
           chunk files read back into it), small_dropped_16 (the same again with 16 readers,
           a GPU node's loader workers), small_forgot (as small_dropped, the kernel's
           dentries and inodes dropped too, as a loader that drops its caches each epoch
           drops them: the kernel forgets the mount's inodes, and what the forgets cost
           the daemon is counted with the epoch)
  small_missed  a fresh daemon with a tenth of the set cached that is never given an order
           (a loader that hands none: `fusefs mount` and an unmodified script), the chunk
           files in the page cache: every read a miss, each the daemon's cost of a miss
  scale    an epoch at ImageNet's count (bench_scale.py): --scale tiny samples (1,281,000;
           200,000 with --quick) with a 1 GiB cache, read along an order: a per-sample cost
           that grows with the data set, the queue or the cache shows here and nowhere else
  pack     `fusefs pack` of --scale tiny files in 1,000 folders (bench_pack.py): seconds,
           CPU a file and peak memory (a row per version, the median round)

The tree is listed first, as ImageFolder does (the kernel then knows every inode, so
fetched samples can be pushed into its page cache). Side by side in the same run: the same
readers on the loose source files (page cache cold and warm), and a minimal pyfuse3 daemon
serving the files from RAM (scripts/bench/minimal_daemon.py: its first epoch reads through the
daemon, its second is served from the kernel page cache, its third too, paced as
kernel_paced: rows minimal_*), the floor of the binding on this machine, and the same
daemon in C on libfuse3 (scripts/bench/minimal_c_daemon.c, compiled into --out: rows
minimal_c_*), the floor of FUSE without Python. One JSON line per row: samples/s,
daemon CPU us per sample (the daemon's own getrusage), the same split into the event-loop
thread and the other (fetch) threads, user and system (their user time together: the part
that holds the GIL, or runs beside it in C; with --against its ratio by round too), their
voluntary context switches
and the daemon's minor page faults per sample, FUSE requests per sample by type, and
the whole machine's CPU per sample (fusefs rows: all cores' busy time over the epoch, the
readers' and the kernel's included: a cost moved from the daemon to its readers shows
there; the kernel samples it at its ticks, so it reads low, even below the daemon's own,
where the cores idle between short bursts: kernel_paced).

usage: .venv/bin/python scripts/bench/bench_hotpath.py [--quick] [--files N] [--scale N] [--readers 4] [--out DIR]
       (--quick: 2,000 files and 200,000 tiny ones, a few minutes; run it before every commit
       that touches fusefs/)
Each fusefs regime runs --rounds times (3), each round with fresh daemons; the round of
median CPU per sample is printed, with every round's figure beside it.

--against REF measures two versions of fusefs/ side by side in one run: REF (a commit,
checked out into a temporary git worktree) and the working tree, each round running both
with fresh daemons, in alternating order (A B, B A, ...). Rows carry "version"; each
regime's line of the second version adds the per-round ratios to the first (round i of one
against round i of the other, which ran next to it). REF's compiled parts (its binding
fusefs.pyfuse3 and fusefs._fetchio) are built into its worktree (setup.py build_ext
--inplace; a REF from before fusefs built its binding gets the pyfuse3 its own
scripts/pyfuse3_patched.py builds): a fusefs and its binding always go together.
--against-options ARGS does the same for the working tree with and without extra mount
arguments. This machine is noisy: compare code and settings this way.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import shlex
import subprocess
import sys
import time

import numpy as np
import psutil

from bench_pack import make_tree, pack_once
from bench_scale import epoch as scale_epoch
from common import (REPO, CpuMeter, JsonLines, against, build_minimal_c, commit as common_commit,
                    minimal_daemon, read_files, warm_chunks)

from fusefs import client, order as orderfmt, protocol
from fusefs.pack import pack
from testkit.gluster import drop_caches
from testkit.mounts import running_mount
from testkit.synth import make_packed


def make_files(root: str, n: int, classes: int = 20, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    sizes = rng.integers(60_000, 160_000, n)
    for c in range(classes):
        os.makedirs(os.path.join(root, f"class{c:03d}"), exist_ok=True)
    for i, size in enumerate(sizes.tolist()):
        with open(os.path.join(root, f"class{i % classes:03d}", f"img{i:07d}.jpg"), "wb") as f:
            f.write(rng.bytes(size))


def _read_share_os(paths: list[str]) -> int:
    """As common.read_files with os.open and os.read: no isatty, so no ioctl request per file
    (Python's open() asks isatty of every file it opens, up to Python 3.13)."""
    n = 0
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            while chunk := os.read(fd, 1 << 20):
                n += len(chunk)
        finally:
            os.close(fd)
    return n


def _read_share_paced(args: tuple[list[str], float, float]) -> int:
    """As common.read_files, the k-th file not before start + k * period (CLOCK_MONOTONIC is the
    machine's, so readers started apart keep one schedule)."""
    paths, start, period = args
    n = 0
    for k, p in enumerate(paths):
        if (wait := start + k * period - time.monotonic()) > 0:
            time.sleep(wait)
        with open(p, "rb") as f:
            n += len(f.read())
    return n


def read_epoch(pool, paths: list[str], readers: int, os_reads: bool = False,
               pace: float = 0) -> float:
    """Wall seconds for readers processes to read paths, reader i taking positions i::readers
    (with Python's open(), or os.open and os.read); with pace, the readers together open
    pace files a second, evenly spread (reader i starts i / pace seconds after the first)."""
    shares = [paths[i::readers] for i in range(readers)]
    t = time.perf_counter()
    if pace:
        start = time.monotonic() + 0.05
        pool.map(_read_share_paced, [(s, start + i / pace, readers / pace)
                                     for i, s in enumerate(shares)], chunksize=1)
    else:
        pool.map(_read_share_os if os_reads else read_files, shares, chunksize=1)
    return time.perf_counter() - t


def stats(mnt: str, name: str = ".fusefs/stats") -> dict:
    with open(os.path.join(mnt, name)) as f:
        return json.load(f)


def list_tree(root: str) -> int:
    """os.walk with a stat of every entry, as ImageFolder's scan does (readdirplus)."""
    return sum(len(files) for _, _, files in os.walk(root))


def minimal_peer(src: str, mnt: str, pool, rels, orders, readers: int, pace: float,
                 prefix: str = "minimal", command: list[str] | None = None):
    """Three epochs through scripts/bench/minimal_daemon.py (or the daemon `command`, rows
    named PREFIX_*) over the loose files (the last paced as kernel_paced)."""
    with minimal_daemon(src, mnt, command=command):
        list_tree(mnt)
        out = []
        for epoch, kind in enumerate(("read", "kernel", "paced")):
            before = stats(mnt, ".minimal-stats")
            dt = read_epoch(pool, [os.path.join(mnt, rels[i]) for i in orders[epoch]], readers,
                            pace=pace if kind == "paced" else 0)
            out.append(row(f"{prefix}_{kind}", len(rels), dt, before, stats(mnt, ".minimal-stats")))
        return out


def write_order(mnt: str, ids, epoch: int) -> None:
    """The order over the control socket; a daemon of --against REF from before the control
    socket (6c1530e, docs/HOTPATH.md's reference) takes it written into its order file."""
    data = orderfmt.encode(ids, epoch=epoch)
    if os.path.lexists(os.path.join(mnt, protocol.CONTROL, protocol.CONTROL_SOCKET)):
        client.send_order(mnt, data)
        return
    with open(os.path.join(mnt, protocol.CONTROL, protocol.order_name(0)), "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())  # (that daemon commits the order here)


def thread_cpu(pid: int) -> dict:
    """CPU seconds [user, system] of the daemon's event-loop thread (the main thread, which
    runs every FUSE handler) and of all its other threads, those that exited included (the
    fetches' worker threads: trio retires idle ones); the voluntary context switches of the
    loop and of the other threads alive (a thread that waits for the GIL or for work makes
    one); and the daemon's minor page faults."""
    proc = psutil.Process(pid)
    total = proc.cpu_times()
    loop = next((t for t in proc.threads() if t.id == pid), None)
    lu, ls = (loop.user_time, loop.system_time) if loop else (0.0, 0.0)
    switches = {"loop": 0, "threads": 0}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                line = next(x for x in f if x.startswith("voluntary_ctxt_switches:"))
        except (OSError, StopIteration):
            continue  # (the thread exited meanwhile)
        switches["loop" if tid == str(pid) else "threads"] += int(line.split()[1])
    with open(f"/proc/{pid}/stat") as f:
        minflt = int(f.read().rsplit(")", 1)[1].split()[7])
    return {"loop": [lu, ls], "threads": [total.user - lu, total.system - ls],
            "switches": switches, "minflt": minflt}


USER_RATIO_MIN_S = 0.2  # (20 of the threads' clock ticks of 10 ms)


def user_cpu(r: dict) -> float | None:
    """The daemon's user CPU us per sample, the event loop's plus the other threads': the
    part that runs Python and holds the GIL, or runs beside it in C (system time is the
    kernel's FUSE and read work). From the threads' times, counted in clock ticks (10 ms):
    a step of 0.5 us a sample at 20,000 samples, 5 us at --quick's 2,000."""
    if "loop_cpu_us_per_sample" not in r:
        return None
    return r["loop_cpu_us_per_sample"][0] + r["threads_cpu_us_per_sample"][0]


def row(name: str, n: int, seconds: float, before: dict | None = None, after: dict | None = None,
        threads: tuple[dict, dict] | None = None) -> dict:
    out = {"regime": name, "samples": n, "samples_per_s": round(n / seconds, 1)}
    if threads is not None:  # us per sample: [user, system]
        t0, t1 = threads
        for k in ("loop", "threads"):
            out[f"{k}_cpu_us_per_sample"] = [round(1e6 * (t1[k][i] - t0[k][i]) / n) for i in (0, 1)]
        out["user_cpu_us_per_sample"] = user_cpu(out)
        out["switches_per_sample"] = {k: round((t1["switches"][k] - t0["switches"][k]) / n, 2)
                                      for k in ("loop", "threads")}
        out["minor_faults_per_sample"] = round((t1["minflt"] - t0["minflt"]) / n, 1)
    if before is not None:
        cpu = after["cpu_s"] - before["cpu_s"]
        reqs = {k: v - before["requests"].get(k, 0) for k, v in after["requests"].items()}
        reqs = {k: round(v / n, 3) for k, v in sorted(reqs.items()) if v}
        out.update(daemon_cpu_us_per_sample=round(1e6 * cpu / n, 1),
                   requests_per_sample=round(sum(reqs.values()), 3), requests=reqs)
        for k in ("backend_samples", "pushed", "loop_tasks", "engine_misses"):
            if k in after and k in before:  # (loop_tasks: tasks pyfuse3's loop started;
                out[k] = after[k] - before[k]  # engine_misses: misses the miss engine read)
    return out


NODE_READERS = 16  # a GPU node's loader workers: small_dropped_16's readers


def fusefs_round(dst, mnt, pool, rels, orders, a, env=None, options=(), pool16=None) -> dict:
    """One round of the fusefs regimes: chunks_cold (page cache dropped), then a fresh
    daemon over chunk files warm in the page cache: chunks, kernel, kernel_os, daemon; then a fresh
    daemon with a cache of a tenth of the set: small_fill, small_kernel, small_dropped,
    with pool16 (NODE_READERS reader processes) small_dropped_16, and small_forgot; then a
    fresh one without an order: small_missed. env: the daemons'
    environment (PYTHONPATH picks the version of fusefs); options: more mount arguments."""
    options = [*a.mount_option, *options]
    out = {}
    n = len(rels)

    def epoch(name, proc, order, number, prepare=None, hinted=True):
        # (counted from before the order: the read-ahead starts as soon as it is written;
        # prepare, a drop of the kernel's caches, in the count: what it makes the daemon do;
        # hinted=False: no order written, every read a miss)
        before, t0 = stats(mnt), thread_cpu(proc.pid)
        sixteen = name.endswith("_16")
        if prepare is not None:
            prepare()
        with CpuMeter() as machine:
            if hinted:
                write_order(mnt, order, number)
            dt = read_epoch(pool16 if sixteen else pool, [os.path.join(mnt, rels[i]) for i in order],
                            NODE_READERS if sixteen else a.readers,
                            os_reads=name == "kernel_os", pace=a.pace if name == "kernel_paced" else 0)
        out[name] = row(name, n, dt, before, stats(mnt), (t0, thread_cpu(proc.pid)))
        out[name]["machine_cpu_us_per_sample"] = round(1e6 * machine.machine_seconds / n, 1)
        if sixteen:
            out[name]["readers"] = NODE_READERS

    drop_caches()
    with running_mount(dst, mnt, "--cache-size", "120%", *options, env=env) as (proc, _):
        list_tree(mnt)
        epoch("chunks_cold", proc, orders[0], 0)
    warm_chunks(dst)
    with running_mount(dst, mnt, "--cache-size", "120%", *options, env=env) as (proc, _):
        list_tree(mnt)
        for number, (name, order) in enumerate((("chunks", orders[0]), ("kernel", orders[1]),
                                                ("kernel_os", orders[1][::-1]),
                                                ("kernel_paced", np.roll(orders[1], n // 2)),
                                                ("daemon", orders[2]))):
            if name == "daemon":
                drop_caches(1)
            epoch(name, proc, order, number)
    drop_caches(1)  # small_fill reads the chunk files from disk (as the daemon regime left them)
    with running_mount(dst, mnt, "--cache-size", "10%", *options, env=env) as (proc, _):
        list_tree(mnt)
        small = [("small_fill", orders[0]), ("small_kernel", orders[1]), ("small_dropped", orders[2])]
        if pool16 is not None:  # (the node's shape: 16 readers, every sample fetched again)
            small.append(("small_dropped_16", orders[0][::-1]))
        small.append(("small_forgot", orders[1][::-1]))
        for number, (name, order) in enumerate(small):
            if name.startswith("small_dropped"):  # as memory pressure does, without telling the daemon
                drop_caches(1)
                warm_chunks(dst)
            elif name == "small_forgot":  # (inodes too: the forgets they make are counted)
                epoch(name, proc, order, number, prepare=lambda: (drop_caches(3), warm_chunks(dst)))
                continue
            epoch(name, proc, order, number)
    drop_caches(1)  # small_missed: no order ever, the chunk files warm (as small_dropped's)
    warm_chunks(dst)
    with running_mount(dst, mnt, "--cache-size", "10%", *options, env=env) as (proc, _):
        list_tree(mnt)
        epoch("small_missed", proc, orders[2], 0, hinted=False)
    out["handlers"] = handlers_row(dst, env)
    out.update(fetch_loop_rows(dst, env))
    return out


def handlers_row(dst: str, env=None) -> dict:
    """fusefs's own open and release handlers, in-process (scripts/bench/handlers_cost.py),
    with the fusefs of env's PYTHONPATH."""
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "handlers_cost.py")
    r = subprocess.run([sys.executable, script, dst], env=env, capture_output=True, text=True,
                       check=True)
    return json.loads(r.stdout)


def fetch_loop_rows(dst: str, env=None) -> dict:
    """The loop's CPU per fetched sample, in-process (scripts/bench/fetch_cost.py, a cache of
    a tenth of the set, 3 passes), with the fusefs of env's PYTHONPATH: fetch_loop (along an
    order) and fetch_loop_missed (without one: every read a miss); none where that fusefs is
    too old for the script."""
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fetch_cost.py")
    env = {k: v for k, v in (env or os.environ).items() if k != "PYTHONSAFEPATH"}  # (it imports common)
    r = subprocess.run([sys.executable, script, dst, "--cache", "0.1", "--passes", "3", "--without-order",
                        "--results", "-"], env=env, capture_output=True, text=True)
    if r.returncode != 0:
        print(f"fetch_loop: fetch_cost.py failed with this version: {r.stderr.strip().splitlines()[-1:]}",
              file=sys.stderr)
        return {}
    out = {}
    for line in r.stdout.splitlines():
        if not line.startswith("{"):
            continue
        f = json.loads(line)
        name = "fetch_loop" if f["order"] else "fetch_loop_missed"
        out[name] = {"regime": name, "samples": f["samples"], "daemon_cpu_us_per_sample": f["loop_cpu_us_per_sample"],
                     "passes_us_per_sample": f["passes_us_per_sample"], "loop_reads": f["loop_reads"],
                     "task_shares": f["task_shares"]}
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="2,000 files and a scale epoch of 200,000 tiny samples (a few minutes)")
    p.add_argument("--files", type=int, help="number of files (default 20,000; 2,000 with --quick)")
    p.add_argument("--readers", type=int, default=4)
    p.add_argument("--out", default=os.path.join(REPO, "out", "bench_hotpath"))
    p.add_argument("--rounds", type=int, default=3, help="fresh daemons per regime (median reported)")
    p.add_argument("--no-peer", action="store_true", help="skip the minimal daemons (pyfuse3 and C)")
    p.add_argument("--pace", type=float, default=1000,
                   help="files a second the readers open together in kernel_paced (default 1,000)")
    p.add_argument("--mount-option", action="append", default=[], metavar="OPT",
                   help="an extra `fusefs mount` argument (repeat), e.g. --mount-option=--no-kernel-cache")
    p.add_argument("--scale", type=int, metavar="N",
                   help="also an epoch of N tiny samples with a 1 GiB cache (bench_scale.py; default "
                        "200,000 with --quick, else 1,281,000, ImageNet's count; 0: none)")
    p.add_argument("--against", metavar="REF",
                   help="also run fusefs/ of commit REF, side by side, alternating each round")
    p.add_argument("--against-options", metavar="ARGS",
                   help="also run the working tree with these extra mount arguments (one string), "
                        "side by side, e.g. --against-options=--no-willneed")
    p.add_argument("--results", metavar="PATH",
                   help="also append the rows to PATH as JSON lines (docs/HOTPATH.md's table comes "
                        "from scripts/bench/results/bench_hotpath.jsonl; guard runs leave it out)")
    a = p.parse_args()
    n = a.files or (2_000 if a.quick else 20_000)
    if a.scale is None:
        a.scale = 200_000 if a.quick else 1_281_000
    os.makedirs(a.out, exist_ok=True)
    src, dst, mnt = (os.path.join(a.out, f"{x}-{n}") for x in ("src", "packed", "mnt"))
    if not os.path.isdir(src):
        make_files(src, n)
    if not os.path.exists(os.path.join(dst, "index.fusefs")):
        pack(src, dst, force=True, progress=False)
    here = common_commit()
    # PYTHONSAFEPATH: `python -m fusefs` must not import fusefs/ from the current folder
    # version name -> (the daemons' environment, extra mount arguments)
    versions = {here: (dict(os.environ, PYTHONPATH=REPO, PYTHONSAFEPATH="1"), [])}
    rows = []
    results = JsonLines(a.results) if a.results else None

    def emit(r):
        rows.append(r)
        print(json.dumps(r), flush=True)
        # (the median rounds and the peers' rows: what HOTPATH.md's table shows)
        # (the scale row, bench_scale's, keeps its own counts and takes this benchmark's name)
        if results is not None and ("cpu_us_per_sample_all_rounds" in r or r["regime"].startswith("minimal")):
            results.write(**{"files": n, "readers": a.readers, **r, "bench": "bench_hotpath"})

    with contextlib.ExitStack() as stack:
        if a.against:
            ref, worktree = stack.enter_context(against(a.against))
            path = worktree
            if not os.path.isdir(os.path.join(worktree, "fusefs", "pyfuse3")):
                # (REF from before fusefs built its binding: pyfuse3 built by REF's own script)
                path = f"{worktree}/.pyfuse3:{worktree}"
                subprocess.run([sys.executable, "scripts/pyfuse3_patched.py", "--target", ".pyfuse3"],
                               cwd=worktree, check=True, capture_output=True)
            versions = {ref: (dict(os.environ, PYTHONPATH=path, PYTHONSAFEPATH="1"), []), **versions}
        if a.against_options:
            versions[f"{here} {a.against_options}"] = (versions[here][0], shlex.split(a.against_options))
        run(a, n, src, dst, mnt, versions, emit)
    result = {"files": n, "readers": a.readers, "commit": here, "against": a.against,
              "mount_options": a.mount_option, "rows": rows}
    with open(os.path.join(a.out, "bench_hotpath.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(f"saved {a.out}/bench_hotpath.json (commit {result['commit']})")
    return 0


def run(a, n, src, dst, mnt, versions, emit) -> None:
    with mp.get_context("fork").Pool(a.readers) as pool, mp.get_context("fork").Pool(NODE_READERS) as pool16:
        from fusefs.index import INDEX_NAME, Index
        ix = Index.load(os.path.join(dst, INDEX_NAME))
        rels = [os.fsdecode(ix.file_path(i)) for i in range(ix.n_files)]
        rng = np.random.default_rng(1)
        orders = [rng.permutation(n) for _ in range(3)]

        paths = [os.path.join(src, rels[i]) for i in orders[0]]
        drop_caches()
        emit(row("loose_cold", n, read_epoch(pool, paths, a.readers)))
        emit(row("loose_warm", n, read_epoch(pool, paths, a.readers)))

        trials: dict[tuple, list] = {}
        names = list(versions)
        scale = make_packed(os.path.join(a.out, f"packed-{a.scale}"), a.scale, reuse=True) if a.scale else None
        pack_tree = make_tree(os.path.join(a.out, f"pack-tree-{a.scale}"), a.scale) if a.scale else None
        packs: dict[str, list] = {}
        for i in range(a.rounds):  # fresh daemons each round; the median round is reported
            for version in (names if i % 2 == 0 else names[::-1]):
                for name, r in fusefs_round(dst, mnt, pool, rels, orders, a, *versions[version],
                                            pool16=pool16).items():
                    trials.setdefault((name, version), []).append(r)
                if scale is not None:  # (at ImageNet's count: a per-sample cost that grows shows)
                    env, options = versions[version]
                    r = scale_epoch(scale.dst, f"{mnt}-scale", scale, a.readers, "1GiB", env, version, options)
                    trials.setdefault(("scale", version), []).append(r)
                    # (and `fusefs pack` of as many tiny files: bench_pack.py; a version whose
                    # pack fails, an old REF's, has no such row)
                    try:
                        packs.setdefault(version, []).append(pack_once(
                            pack_tree, os.path.join(a.out, f"packed-pack-{a.scale}"), env, version, a.scale))
                    except SystemExit as e:
                        print(f"pack: {str(e).splitlines()[0]} ...{str(e).splitlines()[-1]}", flush=True)
        for version, rs in packs.items():  # (the median round, its seconds against REF's)
            if not rs:
                continue
            r = dict(sorted(rs, key=lambda r: r["seconds"])[len(rs) // 2])
            r["seconds_all_rounds"] = [x["seconds"] for x in rs]
            if version != names[0] and packs.get(names[0]):
                r["seconds_ratio_by_round"] = [round(x["seconds"] / y["seconds"], 3)
                                               for x, y in zip(rs, packs[names[0]])]
                r["ratio_to"] = names[0]
            emit(r)
        for (name, version), rs in trials.items():
            r = sorted(rs, key=lambda r: r["daemon_cpu_us_per_sample"])[len(rs) // 2]
            r["cpu_us_per_sample_all_rounds"] = cpu = [x["daemon_cpu_us_per_sample"] for x in rs]
            if "machine_cpu_us_per_sample" in r:
                r["machine_cpu_us_per_sample_all_rounds"] = [x["machine_cpu_us_per_sample"] for x in rs]
            user = [user_cpu(x) for x in rs]
            if None not in user:
                r["user_cpu_us_per_sample_all_rounds"] = user
            if len(versions) > 1:
                r["version"] = version
                if version != names[0] and (name, names[0]) in trials:
                    ref = [x["daemon_cpu_us_per_sample"] for x in trials[(name, names[0])]]
                    r["cpu_ratio_by_round"] = [round(x / y, 3) for x, y in zip(cpu, ref)]
                    ref_user = [user_cpu(x) for x in trials[(name, names[0])]]
                    # (a ratio only where each round's user time is 20 clock ticks or more: 5%)
                    if None not in user and None not in ref_user and \
                            min(user + ref_user) * r["samples"] / 1e6 >= USER_RATIO_MIN_S:
                        r["user_cpu_ratio_by_round"] = [round(x / max(y, 1e-9), 3) for x, y in zip(user, ref_user)]
                    r["ratio_to"] = names[0]
            emit(r)
        if not a.no_peer:
            drop_caches()
            for r in minimal_peer(src, mnt + "-minimal", pool, rels, orders, a.readers, a.pace):
                emit(r)
            drop_caches()
            for r in minimal_peer(src, mnt + "-minimal-c", pool, rels, orders, a.readers, a.pace,
                                  prefix="minimal_c", command=[build_minimal_c(a.out)]):
                emit(r)


if __name__ == "__main__":
    sys.exit(main())
