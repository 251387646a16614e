"""Storage faults under a reading epoch (issue 8): prints, per scenario, samples served, EIOs
returned, wrong bytes (must be 0), backend retries and errors, and the time until reads
succeed again; saves JSON.

Set-up: a synthetic ImageFolder (--files JPEGs) packed onto the 3-brick GlusterFS volume in
small chunks (so every brick holds some), a fusefs mount over it with the order set, and
4 reader threads that read every sample of a shuffled epoch and compare its xxh3 with the
source's. Scenarios:

  errors-1%, -10%, -50%   GlusterFS's debug translator error-gen on the bricks fails that
                          share of read operations (set, then the volume restarted); at 50%
                          some samples exhaust their retries and get EIO. The kernel
                          retries a failed buffered read of the GlusterFS mount once by
                          itself, so fusefs sees fewer errors than the bricks inject
                          ("injected" counts those, from the brick logs).
  brick-kill              the glusterfsd of one brick is killed (SIGKILL) halfway through
                          the epoch; after the epoch the brick is restarted with
                          `gluster.sh up` and the failed samples re-read

Every volume change is undone at the end. usage:
  .venv/bin/python scripts/faults.py [--files 2000] [--out out/faults]
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import threading
import time

import xxhash

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from fusefs.testing import running_mount  # noqa: E402
from fusefs.pack import pack  # noqa: E402
from fusefs.synth import make_imagefolder  # noqa: E402
from trainer import mount_stats, write_order  # noqa: E402
from trainer.hints import mount_ids  # noqa: E402

VOL, GMNT, BRICKS = "fusefsvol", "/mnt/fusefs-gluster", "/srv/fusefs-gluster"
G = ["gluster", "--mode=script"]


def sh(*cmd, check=True):
    return subprocess.run(cmd, check=check, capture_output=True, text=True)


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
    r = sh("bash", os.path.join(REPO, "scripts", "gluster.sh"), "up", check=False)
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


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:  # gone
        return True


def brick_pid(brick: str) -> int:
    """The live glusterfsd of brick (a killed one lingers as a zombie until it is reaped)."""
    out = sh("pgrep", "-f", f"glusterfsd.*{brick.replace('/', '-').lstrip('-')}", check=False).stdout.split()
    live = [int(p) for p in out if not _zombie(int(p))]
    if not live:
        raise RuntimeError(f"no glusterfsd for {brick}")
    return live[0]


def read_epoch(mnt: str, rels: list[str], digests: dict, readers: int = 4,
               halfway=None) -> dict:
    """Set the order, read every sample once in it with reader threads; count outcomes."""
    ids = mount_ids(mnt)
    write_order(mnt, [ids[os.fsencode(r)] for r in rels])
    out = {"served": 0, "eio": 0, "other_errors": 0, "wrong": 0, "failed": []}
    times = {"before": [], "after_ok": [], "after_eio": []}  # read latencies around the fault
    phase = {"after": halfway is None}
    lock, pos = threading.Lock(), iter(range(len(rels)))

    def reader():
        while True:
            with lock:
                i = next(pos, None)
            if i is None:
                return
            if halfway is not None and i == len(rels) // 2:
                halfway()
                phase["after"] = True
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


def scenario_brick_kill(packed, mnt, rels, digests, brick="b2") -> dict:
    def kill():
        pid = brick_pid(f"{BRICKS}/{brick}")
        os.kill(pid, signal.SIGKILL)

    try:
        with running_mount(packed, mnt, "--cache-size", "10%"):
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
        sh("bash", os.path.join(REPO, "scripts", "gluster.sh"), "up", check=False)
    return res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--files", type=int, default=2000)
    p.add_argument("--out", default=os.path.join(REPO, "out", "faults"))
    p.add_argument("--scenarios", default="errors-1%,errors-10%,errors-50%,brick-kill")
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    sh("bash", os.path.join(REPO, "scripts", "gluster.sh"), "up")
    src = os.path.join(a.out, f"src-{a.files}")
    if not os.path.isdir(src):
        make_imagefolder(src, a.files, n_classes=10, mean_bytes=20_000, progress=False)
    packed = os.path.join(GMNT, f"faults-{a.files}")
    if not os.path.exists(os.path.join(packed, "index.fusefs")):
        pack(src, packed, chunk_bytes=1 << 20, force=True, progress=False)
    rels, digests = [], {}
    for d, _, files in os.walk(src):
        for name in files:
            rel = os.path.relpath(os.path.join(d, name), src)
            rels.append(rel)
            with open(os.path.join(d, name), "rb") as f:
                digests[rel] = xxhash.xxh3_64_intdigest(f.read())
    random.Random(0).shuffle(rels)
    mnt = os.path.join(a.out, "mnt")
    results = {}
    for name in a.scenarios.split(","):
        if name.startswith("errors-"):
            res = scenario_errors(packed, mnt, rels, digests, float(name[7:].rstrip("%")))
        elif name == "brick-kill":
            res = scenario_brick_kill(packed, mnt, rels, digests)
        else:
            raise SystemExit(f"unknown scenario {name}")
        res["failed"] = len(res["failed"])
        results[name] = res
        print(f"{name:<11} served {res['served']}/{len(rels)}, EIO {res['eio']}, wrong bytes "
              f"{res['wrong']}, backend requests {res['requests']}, injected at the bricks "
              f"{res.get('injected', '-')}, errors seen {res['backend_errors']}, "
              f"retries {res['retries']}, "
              f"recovery {res['recovery_s']} s, epoch {res['seconds']} s; median read ms: "
              f"before {res['read_ms_before']}, after the fault {res['read_ms_after_ok']} "
              f"(served) / {res['read_ms_after_eio']} (EIO)", flush=True)
    with open(os.path.join(a.out, "faults.json"), "w") as f:
        json.dump(results, f, indent=1)
    print(f"saved {a.out}/faults.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
