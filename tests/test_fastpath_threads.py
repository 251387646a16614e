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
from testkit.mounts import running_mount

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
