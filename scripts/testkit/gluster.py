"""The GlusterFS test bed's fault injection, for the tests and the faults benchmark (not
used by the daemon): restart the volume with error-gen options, kill and restart a brick,
read an epoch through a mount with several threads comparing every sample's bytes, and the
scenarios scripts/bench/faults.py reports. `scripts/testbed/gluster.sh` sets the volume up."""
from __future__ import annotations

import glob
import os
import shutil
import signal
import statistics
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import xxhash

from fusefs.client import mount_ids, mount_stats, write_order
from .mounts import running_mount

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GLUSTER_SH = os.path.join(REPO, "scripts", "testbed", "gluster.sh")

def drop_caches(level: int = 3) -> None:
    """Write back, then drop the page cache (3: and dentries and inodes; 1: pages only)."""
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write(f"{level}\n")


def drop_file_pages(root: str) -> None:
    """Drop the page cache's pages of every file under root (POSIX_FADV_DONTNEED), and
    nobody else's: what a test needs where drop_caches would empty the whole machine's."""
    for folder, _, names in os.walk(root):
        for name in names:
            fd = os.open(os.path.join(folder, name), os.O_RDONLY | os.O_NOFOLLOW)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def copy_tree(src: str, dst: str, threads: int = 16) -> None:
    """Copy a tree of files to dst (on the volume: each file costs round trips, so several
    at a time), with modes and times, folders' too (a tar of dst then equals one of src)."""
    pairs = []
    for d, _, files in os.walk(src):
        os.makedirs(os.path.join(dst, os.path.relpath(d, src)), exist_ok=True)
        pairs += [(os.path.join(d, f), os.path.join(dst, os.path.relpath(d, src), f)) for f in files]
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda p: shutil.copy2(*p), pairs))
    for d, _, _ in sorted(os.walk(src), key=lambda w: -w[0].count(os.sep)):  # folders last, deepest first
        shutil.copystat(d, os.path.join(dst, os.path.relpath(d, src)))


# The test bed's volume, its mount point and its bricks' folder: gluster.sh's, which reads the
# same environment (one set of names for the script, the tests and the benchmarks; another
# volume of the machine's is never touched)
VOL = os.environ.get("FUSEFS_GLUSTER_VOL", "fusefsvol")
GMNT = os.environ.get("FUSEFS_GLUSTER_MNT", "/mnt/fusefs-gluster")
BRICKS = os.environ.get("FUSEFS_GLUSTER_BRICKS", "/srv/fusefs-gluster")
G = ["gluster", "--mode=script"]


def sh(*cmd, check=True):
    return subprocess.run(cmd, check=check, capture_output=True, text=True, timeout=300)


def restart_volume(options: dict | None) -> None:
    """Stop the volume, set (or, with None, reset) the error-gen options, then start and
    remount it with `gluster.sh up` (which waits for the bricks to listen)."""
    sh("umount", GMNT, check=False)
    sh(*G, "volume", "stop", VOL, "force", check=False)
    if options:
        for k, v in options.items():
            sh(*G, "volume", "set", VOL, k, str(v))
    else:
        for k in ("debug.error-gen", "debug.error-failure", "debug.error-number",
                  "debug.random-failure", "debug.error-fops", "performance.quick-read"):
            sh(*G, "volume", "reset", VOL, k, check=False)
    gluster_up()


def gluster_up() -> None:
    """`gluster.sh up`: start what is down (asking until every brick listens), mount if
    need be."""
    r = sh("bash", GLUSTER_SH, "up", check=False)
    if r.returncode:
        raise RuntimeError(f"gluster.sh up failed: {r.stdout}{r.stderr}")


def injected_errors() -> int:
    """Errors error-gen has injected so far, from the brick logs (one line per error)."""
    n = 0
    for name in glob.glob("/var/log/glusterfs/bricks/*.log"):
        with open(name, errors="replace") as f:
            n += sum("error_gen_" in line and "unwind(" in line for line in f)
    return n


def error_gen(percent: float) -> dict:
    return {"debug.error-gen": "posix", "debug.error-failure": f"{percent:g}%",
            "debug.random-failure": "off", "debug.error-number": "EIO", "debug.error-fops": "read",
            # quick-read serves files up to 64 KiB from the lookup; off, every read is a readv
            "performance.quick-read": "off"}


def exited(pid: int) -> bool:
    """Whether process pid has ended: gone, or a zombie (a killed process lingers so until
    PID 1 reaps it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:  # gone
        return True


def brick_pid(brick: str) -> int:
    """The live glusterfsd of brick (a killed one lingers as a zombie until it is reaped)."""
    out = sh("pgrep", "-f", f"glusterfsd.*{brick.replace('/', '-').lstrip('-')}", check=False).stdout.split()
    live = [int(p) for p in out if not exited(int(p))]
    if not live:
        raise RuntimeError(f"no glusterfsd for {brick}")
    return live[0]


def client_pid(mnt: str = GMNT) -> int | None:
    """The GlusterFS client process serving the mount at mnt (its command line names it)."""
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if argv and os.path.basename(argv[0]) == b"glusterfs" and os.fsencode(mnt) in argv \
                and not exited(int(name)):
            return int(name)
    return None


def own_pids() -> list[int]:
    """The processes of this test bed's own: its volume's three bricks, the client of its
    mount, and glusterd if gluster.sh started it (its record in /run/fusefs-testbed).
    Killing these, and only these, stands for a crash of the test bed."""
    pids = [brick_pid(f"{BRICKS}/b{k}") for k in (1, 2, 3)]
    client = client_pid()
    if client is not None:
        pids.append(client)
    try:
        with open(f"/run/fusefs-testbed/{VOL}.glusterd.pid") as f:
            pid = int(f.read().strip())
        with open(f"/proc/{pid}/comm") as f:
            if f.read().strip() == "glusterd":
                pids.append(pid)
    except (OSError, ValueError):
        pass
    return pids


def read_epoch(mnt: str, rels: list[str], digests: dict, readers: int = 4,
               halfway=None) -> dict:
    """Set the order, read every sample once in it with reader threads; count outcomes.
    With halfway (a fault), the mount is told the order's first half only, and the second
    half once halfway() has run, before any reader takes a sample of it: whatever the
    machine's speed, the read-ahead cannot have fetched a sample of the second half before
    the fault."""
    ids = mount_ids(mnt)
    order = [ids[os.fsencode(r)] for r in rels]
    half = len(rels) // 2
    write_order(mnt, order if halfway is None else order[:half])
    out = {"served": 0, "eio": 0, "other_errors": 0, "wrong": 0, "failed": []}
    times = {"before": [], "after_ok": [], "after_eio": []}  # read latencies around the fault
    phase = {"after": halfway is None}
    lock, pos = threading.Lock(), iter(range(len(rels)))

    def reader():
        while True:
            with lock:  # (held through the fault: no reader takes a sample past it before)
                i = next(pos, None)
                if i is not None and halfway is not None and i == half:
                    halfway()
                    write_order(mnt, order[half:])
                    phase["after"] = True
            if i is None:
                return
            after = phase["after"]
            t0 = time.perf_counter()
            try:
                with open(os.path.join(mnt, rels[i]), "rb") as f:
                    data = f.read()
            except OSError as e:
                with lock:
                    out["eio" if e.errno == 5 else "other_errors"] += 1
                    out["failed"].append(rels[i])
                    times["after_eio" if after else "before"].append(time.perf_counter() - t0)
                continue
            with lock:
                times["after_ok" if after else "before"].append(time.perf_counter() - t0)
                if xxhash.xxh3_64_intdigest(data) != digests[rels[i]]:
                    out["wrong"] += 1
                else:
                    out["served"] += 1

    t0 = time.perf_counter()
    threads = [threading.Thread(target=reader) for _ in range(readers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out["seconds"] = round(time.perf_counter() - t0, 2)
    for k, v in times.items():
        out[f"read_ms_{k}"] = round(1000 * statistics.median(v), 2) if v else None
    out["read_ms_max"] = round(1000 * max((x for v in times.values() for x in v), default=0), 2)
    return out


def stats_of(mnt: str) -> dict:
    s = mount_stats(mnt)
    return {"requests": sum(v["requests"] for v in s["nodes"].values()),
            "retries": s["backend_retries"], "backend_errors": s["backend_errors"],
            "daemon_eio_replies": s["eio"], "per_node": {n: {k: v[k] for k in ("requests", "errors", "retries", "samples", "down")}
                                          for n, v in s["nodes"].items()}}


def scenario_errors(packed, mnt, rels, digests, percent) -> dict:
    restart_volume(error_gen(percent))
    try:
        before = injected_errors()
        with running_mount(packed, mnt, "--cache-size", "10%"):
            res = read_epoch(mnt, rels, digests)
            res.update(stats_of(mnt))
        res["injected"] = injected_errors() - before
    finally:
        restart_volume(None)
    res["recovery_s"] = 0.0  # nothing to recover from: every error was retried or one EIO
    return res


def scenario_brick_restart(packed, mnt, rels, digests, down_s: float = 10.0, brick="b2") -> dict:
    """The default patience (--io-timeout): a brick killed halfway through an epoch and
    restarted down_s seconds later while the readers go on; the reads of its samples wait
    for it. The result holds the longest read (`read_ms_max`) and what the daemon logged."""
    restarted = threading.Event()

    def kill():
        os.kill(brick_pid(f"{BRICKS}/{brick}"), signal.SIGKILL)

        def restart():
            time.sleep(down_s)
            gluster_up()
            restarted.set()
        threading.Thread(target=restart, daemon=True).start()

    try:
        drop_file_pages(packed)  # (chunk pages cached from an earlier read would be served without the brick)
        with running_mount(packed, mnt, "--cache-size", "10%") as (_, log_path):
            res = read_epoch(mnt, rels, digests, halfway=kill)
            restarted.wait(down_s + 300)
            res.update(stats_of(mnt))
        with open(log_path, errors="replace") as f:
            res["log"] = [line.rstrip("\n") for line in f if "fusefs" in line or "node" in line]
    finally:
        sh("bash", GLUSTER_SH, "up", check=False)
    return res


def scenario_brick_kill(packed, mnt, rels, digests, brick="b2") -> dict:
    def kill():
        pid = brick_pid(f"{BRICKS}/{brick}")
        os.kill(pid, signal.SIGKILL)

    try:  # (--io-timeout 0: a read of the dead brick fails after its retries)
        drop_file_pages(packed)  # (chunk pages cached from an earlier read would be served without the brick)
        with running_mount(packed, mnt, "--cache-size", "10%", "--io-timeout", "0"):
            res = read_epoch(mnt, rels, digests, halfway=kill)
            gluster_up()  # restarts the killed brick
            t0 = time.perf_counter()
            recovered = None
            probe = res["failed"][0] if res["failed"] else None
            while probe is not None and time.perf_counter() - t0 < 120:
                try:
                    with open(os.path.join(mnt, probe), "rb") as f:
                        ok = xxhash.xxh3_64_intdigest(f.read()) == digests[probe]
                    recovered = time.perf_counter() - t0
                    res["wrong"] += not ok
                    break
                except OSError:
                    time.sleep(0.5)
            res["recovery_s"] = None if recovered is None else round(recovered, 2)
            again = 0
            for rel in res["failed"]:  # without a remount
                with open(os.path.join(mnt, rel), "rb") as f:
                    again += xxhash.xxh3_64_intdigest(f.read()) == digests[rel]
            res["failed_then_served"] = again
            res.update(stats_of(mnt))
    finally:
        sh("bash", GLUSTER_SH, "up", check=False)
    return res
