"""fusefs's own share of a cached sample's CPU: the open and release handlers (fs.Operations
over core.Core) called in-process, with no kernel, no /dev/fuse and no pyfuse3 request loop.

A sample the kernel page cache holds costs the daemon an open, Python's isatty ioctl and a
release (bench_hotpath.py's `kernel` regime); this times the Python that fusefs runs for the
open and the release, under an order (each release counts the sample's use) with every
sample taken as held by the kernel, as in `kernel`. What `kernel` spends beyond it is the
binding's and the kernel's (docs/HOTPATH.md). Prints one JSON line: CPU us per sample (this
thread's, CLOCK_THREAD_CPUTIME_ID: getrusage's thread figure moves in scheduler ticks), the
median of --passes passes over the set, each under a fresh order.

bench_hotpath.py runs it once per round and version (PYTHONPATH picks the version of fusefs).

usage: .venv/bin/python scripts/bench/handlers_cost.py PACKED [--passes 3]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import types

import numpy as np
import trio

from fusefs import order as orderfmt
from fusefs.core import Core
from fusefs.fs import Operations
from fusefs.index import INDEX_NAME, Index
from fusefs.store import ChunkStore


async def one_pass(core: Core, ops: Operations, order, epoch: int) -> float:
    """CPU seconds of opening and releasing every sample once, in order."""
    core.set_order(0, orderfmt.encode(order, epoch))
    view = getattr(core, "kernel_view", None)  # (a version of --against REF before it: in_kernel)
    (view.held if view is not None else core.in_kernel)[:] = True  # (as in `kernel`: no read reaches the daemon)
    ctx = types.SimpleNamespace(uid=os.getuid(), gid=os.getgid(), pid=os.getpid(), umask=0o022)
    base, flags = core.file_base, os.O_RDONLY
    t0 = time.thread_time()
    for sid in order.tolist():
        info = await ops.open(base + sid, flags, ctx)
        await ops.release(info.fh)
    return time.thread_time() - t0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("packed")
    p.add_argument("--passes", type=int, default=3)
    a = p.parse_args()
    index = Index.load(os.path.join(a.packed, INDEX_NAME))
    core = Core(index, ChunkStore(a.packed, index))
    ops = Operations(core)
    rng = np.random.default_rng(0)

    async def run():
        return [await one_pass(core, ops, rng.permutation(index.n_files), e) for e in range(a.passes)]

    per_pass = [1e6 * s / index.n_files for s in trio.run(run)]
    print(json.dumps({"regime": "handlers", "samples": index.n_files,
                      "daemon_cpu_us_per_sample": round(statistics.median(per_pass), 2),
                      "passes_us_per_sample": [round(x, 2) for x in per_pass]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
