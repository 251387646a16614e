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
  .venv/bin/python scripts/bench/faults.py [--files 2000] [--out out/faults]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys

import xxhash

from common import JsonLines  # (importing common puts scripts/ on sys.path, for testkit)

from fusefs.pack import pack
from testkit.synth import make_imagefolder
from testkit.gluster import (
    GLUSTER_SH,
    GMNT,
    REPO,
    scenario_brick_kill,
    scenario_brick_restart,
    scenario_errors,
    sh,
)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--files", type=int, default=2000)
    p.add_argument("--out", default=os.path.join(REPO, "out", "faults"))
    p.add_argument("--scenarios", default="errors-1%,errors-10%,errors-50%,brick-kill,brick-restart")
    JsonLines.argument(p, "faults")
    a = p.parse_args()
    lines = JsonLines(a.results)
    os.makedirs(a.out, exist_ok=True)
    sh("bash", GLUSTER_SH, "up")
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
        elif name == "brick-restart":
            res = scenario_brick_restart(packed, mnt, rels, digests)
            res.pop("log")
        else:
            raise SystemExit(f"unknown scenario {name}")
        res["failed"] = len(res["failed"])
        results[name] = res
        lines.write(bench="faults", scenario=name, files=len(rels), **res)
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
