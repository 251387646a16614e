"""The fast path on several threads (issue 54, item 1): each thread reads its own clone of
/dev/fuse, answers opens, reads of held samples and releases on its own fd, and hands the
loop what it cannot answer, whose replies libfuse writes to the fd the request came from.
Many readers hammer one set of samples while the cache evicts under them: every byte
right, every thread at work, the daemon's accounting whole."""
import subprocess
import sys
import threading

import pytest

from conftest import read_tree
from testkit.mounts import resolve, running_mount

HAMMER = """
import os, random, sys
src, mnt, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
rels = [os.path.relpath(os.path.join(d, f), src) for d, _, fs in os.walk(src) for f in fs]
want = {r: open(os.path.join(src, r), 'rb').read() for r in rels}
rng = random.Random(seed)
bad = 0
for _ in range(1500):
    rel = rng.choice(rels)
    fd = os.open(os.path.join(mnt, rel), os.O_RDONLY | os.O_DIRECT)
    try:
        got = bytearray()
        while True:
            part = os.pread(fd, 1 << 17, len(got))
            if not part:
                break
            got += part
    finally:
        os.close(fd)
    bad += bytes(got) != want[rel]
print(bad)
"""


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_many_readers_get_right_bytes_from_every_thread_while_the_cache_evicts(tricky, tmp_path, threads):
    from fusefs.client import mount_stats
    src, dst, files = tricky
    mnt = tmp_path / "mnt"
    with running_mount(dst, mnt, "--fast-threads", threads, "--cache-size", "1MiB", "--no-kernel-cache"):
        readers = [subprocess.Popen([sys.executable, "-c", HAMMER, src, str(mnt), str(seed)],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                   for seed in range(8)]
        for p in readers:
            out, err = p.communicate(timeout=300)
            assert p.returncode == 0 and out.strip() == "0", err
        assert read_tree(mnt) == read_tree(src)  # (the tree as well, after it all)
        for _ in range(600):  # (the kernel sends the last releases after the closes)
            stats = mount_stats(str(mnt))
            if stats["open_handles"] == 0:
                break
            threading.Event().wait(0.05)
    assert stats["open_handles"] == 0 and stats["opens"] == stats["releases"] >= 8 * 1500
    assert stats["evictions"] > 0 and stats["fast_path_requests"]["read"] > 0
    assert len(stats["fast_path_threads"]) == threads and all(stats["fast_path_threads"]), stats["fast_path_threads"]


def _fast_thread_switches(pid: int) -> int:
    """Voluntary context switches (sleeps) of the daemon's fast-path threads so far."""
    import os
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            if open(f"/proc/{pid}/task/{tid}/comm").read().strip() != "fusefs-fast":
                continue
            for line in open(f"/proc/{pid}/task/{tid}/status"):
                if line.startswith("voluntary_ctxt_switches:"):
                    total += int(line.split()[1])
        except FileNotFoundError:
            continue
    return total


def test_a_request_wakes_one_fast_path_thread_not_all(tricky, tmp_path):
    """Every clone of /dev/fuse waits on the connection's one queue. With four threads and
    requests coming one at a time (a reader that opens, reads and closes file after file),
    each request must wake one thread, which answers it and sleeps again: about one sleep
    per request, where waking every thread cost four (and made the daemon's CPU per
    sample grow with its threads on the GPU node: 48-51 us with 4 threads, 18-21 with 1)."""
    import os
    from fusefs.client import mount_stats
    src, dst, files = tricky
    rels = sorted(r for r, data in files.items() if data)
    mnt = tmp_path / "mnt"
    with running_mount(dst, mnt, "--fast-threads", 4) as (proc, _):
        for rel in rels:  # (pushed into the kernel page cache: the reads below stay there)
            with open(mnt / rel, "rb") as f:
                f.read()
        before = mount_stats(str(mnt))
        slept = _fast_thread_switches(proc.pid)
        for _ in range(5):
            for rel in rels:
                fd = os.open(mnt / rel, os.O_RDONLY)
                os.read(fd, 1 << 20)
                os.close(fd)
        after = mount_stats(str(mnt))
        slept = _fast_thread_switches(proc.pid) - slept
    answered = sum(after["fast_path_threads"]) - sum(before["fast_path_threads"])
    assert answered >= 2 * 5 * len(rels)  # (an open and a release per file, at least)
    assert slept <= 1.5 * answered, (slept, answered)


def test_fetch_stress_readers_killed_evictions_and_corrupt_samples(three_nodes, tmp_path):
    """The fetch path under stress (issue 88, item 5; scripts/sanitize.sh runs it under
    AddressSanitizer): an order over eight passes of the set, four readers taking its
    positions in turn (O_DIRECT: every read reaches the daemon) through two fast-path
    threads, a tenth of the set cached (every pass
    fetches nearly every sample again, the read-ahead's reads parked in C until their fetch
    thread hands the bytes over, the cache evicting under them), three samples corrupt, and
    readers killed mid-pass and replaced, three times. Every read gets its bytes or, for a
    corrupt sample, EIO (the log names its chunk); no read hangs; the daemon keeps serving;
    the handles of the killed readers are released; its resident memory comes within
    fresh + budgets + 5%; and a read of every file afterwards finds nothing waiting or
    pinned (each gets its bytes, the corrupt ones EIO)."""
    import json
    import os
    import random
    from conftest import corrupt_three, rss_within, stress_readers
    from trainer import write_order
    from trainer.hints import mount_stats
    dst, files = three_nodes
    rels = sorted(files)
    rng = random.Random(88)
    copy = str(tmp_path / "dst")
    ix, bad, digest = corrupt_three(dst, copy, files, rng)
    order = [r for _ in range(8) for r in rng.sample(rels, len(rels))]
    nreaders = 4
    plans = []
    for k in range(nreaders):  # (reader k takes positions k, k + 4, ...: a loader's workers)
        plans.append(str(tmp_path / f"plan{k}.json"))
        with open(plans[-1], "w") as f:
            json.dump([(r, digest[r]) for r in order[k::nreaders]], f)
    mnt = str(tmp_path / "mnt")
    with running_mount(copy, mnt, "--cache-size", "10%", "--fast-threads", "2", "--no-kernel-cache") as (proc, log):
        write_order(mnt, order)
        stress_readers(mnt, plans, rng, 2)
        assert proc.poll() is None
        s = mount_stats(mnt)
        bound = int(1.05 * s["memory_bound"])  # (fresh + the cache's and orders' budgets)
        if "libasan" not in os.environ.get("LD_PRELOAD", ""):  # (AddressSanitizer, which
            # scripts/sanitize.sh preloads, replaces glibc's malloc and keeps freed memory)
            assert rss_within(proc.pid, bound) <= bound
        for rel in rels:  # (nothing left waiting or pinned: every file answers)
            path = os.path.join(mnt, rel)
            if rel in bad:
                with pytest.raises(OSError) as e:
                    open(path, "rb").read()
                assert e.value.errno == 5, rel
            else:
                assert open(path, "rb").read() == files[rel], rel
        text = open(log).read()
    for rel in bad:
        sid = resolve(ix, rel)[1]
        assert ix.chunks[int(ix.chunk[sid])].path in text, rel
    assert s["evictions"] > 0 and s["backend_samples"] > 2 * len(rels), s  # (fetched again)
    # (reads parked for the read-ahead's fetches, and misses parked for fetches of their own)
    assert s["reads_parked"] > s["misses_parked"] > 0 and s["eio"] > 0, s
