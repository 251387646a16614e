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
