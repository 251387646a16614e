"""trainer.HintedSampler: the same indices as torch's samplers, and orders through a mount."""
import contextlib
import errno
import os
import random
import signal
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor

import pytest
import xxhash
import torch
from torch.utils.data import DistributedSampler, RandomSampler

from fusefs import order as orderfmt
from fusefs.kernel_view import MIN_DROPS
from testkit.mounts import running_mount
from trainer import HintedSampler, write_order
from trainer.hints import mount_ids, mount_stats

from conftest import REPO, check_two_nodes, page_cache_holds, passes, read_tree


class Paths(list):
    """A stand-in dataset: a list of paths, len() like a Dataset."""


@pytest.mark.parametrize("n", [1, 7, 100])
@pytest.mark.parametrize("seed, epoch", [(0, 0), (3, 5)])
def test_matches_random_sampler(n, seed, epoch):
    ds = Paths(f"/x/{i}" for i in range(n))
    s = HintedSampler(ds, seed=seed, write=False)
    s.set_epoch(epoch)
    g = torch.Generator()
    g.manual_seed(seed + epoch)
    assert list(s) == list(RandomSampler(range(n), generator=g))


@pytest.mark.parametrize("n", [10, 11, 13])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("shuffle", [True, False])
def test_matches_distributed_sampler(n, world, drop_last, shuffle):
    ds = Paths(f"/x/{i}" for i in range(n))
    for rank in range(world):
        for epoch in (0, 1):
            ours = HintedSampler(ds, num_replicas=world, rank=rank, shuffle=shuffle, seed=9,
                                 drop_last=drop_last, write=False)
            theirs = DistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=shuffle,
                                        seed=9, drop_last=drop_last)
            ours.set_epoch(epoch)
            theirs.set_epoch(epoch)
            assert list(ours) == list(theirs) and len(ours) == len(theirs)


def _read_in_order(args):
    mnt, rels, expect = args
    bad = 0
    for rel, digest in zip(rels, expect):
        with open(os.path.join(mnt, rel), "rb") as f:
            bad += hash(f.read()) != digest
    return bad


def test_four_readers_with_the_order_set_get_every_byte(tricky, tmp_path):
    src, dst, files = tricky
    regular = sorted(k for k in files if not k.endswith("/"))
    mnt = str(tmp_path / "mnt")
    with running_mount(dst, mnt, "--cache-size", "10%"):
        paths = [os.path.join(mnt, r) for r in regular]
        sampler = HintedSampler(Paths(paths), seed=1)
        order = list(sampler)  # writes the order
        assert sorted(order) == list(range(len(paths)))
        current = open(os.path.join(mnt, ".fusefs", "order"), "rb").read()
        ids = mount_ids(mnt)
        assert orderfmt.parse(current, len(ids)).ids.tolist() == [
            ids[os.fsencode(regular[i])] for i in order]
        rels = [regular[i] for i in order]
        shares = [(mnt, rels[k::4], [hash(files[r]) for r in rels[k::4]]) for k in range(4)]
        with ProcessPoolExecutor(4) as pool:
            assert sum(pool.map(_read_in_order, shares)) == 0
        stats = mount_stats(mnt)
        assert stats["orders_accepted"] == 1 and stats["eio"] == 0
        assert stats["plans"]["0"]["cursor"] == len(rels)
        assert stats["cache_peak"] <= stats["cache_budget"]
        assert stats["open_handles"] == 0


class Digests(Paths):
    """A dataset of the files' digests, read whole: what a loader's workers do per sample.
    Each file's pages then leave the kernel's page cache (as with a set larger than the
    node's memory), so that a second read of it reaches the daemon."""

    def __getitem__(self, i):
        with open(list.__getitem__(self, i), "rb") as f:
            digest = hash(f.read())
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        return i, digest


def test_four_loader_workers_and_a_tenth_of_the_set_cached_fetch_each_sample_once(three_nodes, tmp_path):
    """Through a mount with --cache-size 10%: DataLoader's four worker processes read the
    order HintedSampler wrote, and each sample is fetched from the chunks exactly once: the
    cache keeps what the order needs soonest. (Batches of 2: the loader's window of samples
    in flight, 4 workers x 2 batches, stays well inside the cache's ~30 samples, as at a
    real set's size. How many reads found their sample cached depends on how fast the
    workers are against the backend: test_readahead's settled readers show every read
    served from the cache, and bench_order measures the share.)"""
    from torch.utils.data import DataLoader
    dst, files = three_nodes
    mnt = str(tmp_path / "mnt")
    with running_mount(dst, mnt, "--cache-size", "10%", "--no-kernel-cache"):
        regular = sorted(files)
        data = Digests(os.path.join(mnt, r) for r in regular)
        # (lookahead off: with it, the next epoch's first samples are read ahead too)
        sampler = HintedSampler(data, seed=3, lookahead=False)
        loader = DataLoader(data, batch_size=2, sampler=sampler, num_workers=4)  # (see below)
        got = [(int(i), int(d)) for idx, digests in loader for i, d in zip(idx, digests)]
        s = mount_stats(mnt)
    assert sorted(i for i, _ in got) == list(range(len(regular)))
    assert all(d == hash(files[regular[i]]) for i, d in got)
    assert s["backend_samples"] == len(regular), s["backend_samples"]
    assert s["cache_peak"] <= s["cache_budget"] and s["eio"] == 0
    assert s["hits"] + s["read_waits"] + s["misses"] >= len(regular)  # (every read counted)


def test_echo_epochs_through_a_mount_fetch_each_fresh_sample_once(three_nodes, tmp_path):
    """Data echoing through a mount: HintedSampler(mode="echo") writes the epoch's order
    (half the set fresh, each fresh sample twice, the second time a batch or two later),
    DataLoader's workers read it, and the daemon fetches each fresh sample once: its echo
    is served from the daemon's cache, which keeps it because the order says it is needed
    again. (Batches of 2, as above: with batches of 8 the loader's 64
    samples in flight are twice the cache, and echoes held for their second read and the
    read-ahead crowd each other out. A 5% cache, ~15 samples, is smaller than a batch for
    every request slot: a read-ahead as deep as that reserved every free byte, and a missed
    sample found no room to be kept for its echo, fetched again in every run.)"""
    from torch.utils.data import DataLoader
    dst, files = three_nodes
    mnt = str(tmp_path / "mnt")
    with running_mount(dst, mnt, "--cache-size", "5%", "--no-kernel-cache"):
        regular = sorted(files)
        data = Digests(os.path.join(mnt, r) for r in regular)
        sampler = HintedSampler(data, seed=5, mode="echo", batch_size=2, lookahead=False)
        loader = DataLoader(data, batch_size=2, sampler=sampler, num_workers=4)
        got = [(int(i), int(d)) for idx, digests in loader for i, d in zip(idx, digests)]
        written = orderfmt.parse(open(os.path.join(mnt, ".fusefs", "order"), "rb").read(), len(regular)).ids
        ids = mount_ids(mnt)
        s = mount_stats(mnt)
    read = [i for i, _ in got]
    fresh = set(read)
    assert len(read) == 2 * len(fresh) and all(read.count(i) == 2 for i in fresh)
    assert written.tolist() == [ids[os.fsencode(regular[i])] for i in read]  # the order read
    assert all(d == hash(files[regular[i]]) for i, d in got)
    assert s["backend_samples"] == len(fresh), (s["backend_samples"], len(fresh))
    assert s["opens"] == len(read) and s["eio"] == 0


def test_a_bad_order_is_refused_with_its_reason_and_the_old_one_stays(tricky, tmp_path):
    """A bad order is refused with the reason (OrderRefused, from the control socket), is
    named in the log, and the previous order stays; the order files show the order in
    force and take no writes (the mount is read-only)."""
    from fusefs.client import OrderRefused, send_order
    mnt = str(tmp_path / "mnt")
    with running_mount(tricky[1], mnt) as (_, log):
        write_order(mnt, [0, 1, 2], epoch=3)
        path = os.path.join(mnt, ".fusefs", "order")
        for bad in (b"garbage", orderfmt.encode([0, 99999]), orderfmt.encode([0, 1])[:-1],
                    orderfmt.encode([0, 1]) + b"next", orderfmt.encode([0, 1], next_follows=True)):
            with pytest.raises(OrderRefused) as e:
                send_order(mnt, bad)
            assert e.value.errno == errno.EINVAL and "previous one stays" in str(e.value), bad
        with pytest.raises(OrderRefused, match="unknown sample id 99999"):
            write_order(mnt, [0, 99999])
        current = orderfmt.parse(open(path, "rb").read(), 10**6)
        assert current.ids.tolist() == [0, 1, 2] and current.epoch == 3
        assert "unknown sample id 99999" in open(log).read()
        for name in ("order", "order.5", "stats"):
            with pytest.raises(OSError) as e:
                open(os.path.join(mnt, ".fusefs", name), "wb")
            assert e.value.errno == errno.EROFS
        write_order(mnt, [2, 1], epoch=4, next_ids=[1, 2, 0], rank=5)
        plan = mount_stats(mnt)["plans"]["5"]
        assert plan["epoch"] == 4 and plan["length"] == 2 and plan["next_length"] == 3
        assert orderfmt.parse(open(path + ".5", "rb").read(), 10**6).ids.tolist() == [2, 1]
        assert mount_stats(mnt)["orders_refused"] == 6
        assert read_tree(mnt) == read_tree(tricky[0])  # still serving


def test_write_order_and_the_stats_need_no_torch(tricky, tmp_path):
    """`import trainer; trainer.write_order(...)` in a Python where torch cannot be imported
    (sys.modules["torch"] = None makes every `import torch` fail): the client side is numpy
    only, and the accelerator methods are not loaded."""
    mnt = str(tmp_path / "mnt")
    with running_mount(tricky[1], mnt):
        paths = sorted(os.path.join(mnt, p) for p, data in read_tree(mnt).items() if data is not None)[:3]
        script = (
            "import sys; sys.modules['torch'] = None\n"
            "import trainer\n"
            f"ids = trainer.paths_to_ids({paths!r})\n"
            f"trainer.write_order({mnt!r}, ids[::-1], epoch=7)\n"
            f"print(trainer.mount_stats({mnt!r})['plans']['0']['epoch'], ids[::-1].tolist())\n"
            "assert 'torch' not in [m.split('.')[0] for m in sys.modules if sys.modules[m] is not None]\n"
            "try:\n    trainer.HintedSampler\nexcept ImportError:\n    print('no sampler without torch')\n")
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                             cwd=REPO, timeout=120)
        assert out.returncode == 0, out.stderr
        epoch, ids = out.stdout.splitlines()[0].split(" ", 1)
        assert epoch == "7" and orderfmt.parse(open(os.path.join(mnt, ".fusefs", "order"), "rb").read(),
                                               10**6).ids.tolist() == eval(ids)
        assert out.stdout.splitlines()[1] == "no sampler without torch"


# reads every file under MNT over and over, a line after each pass
READ_IN_A_LOOP = ("import os,sys\nwhile True:\n for d,_,fs in os.walk(sys.argv[1]):\n"
                  "  for f in fs: open(os.path.join(d,f),'rb').read()\n print('pass', flush=True)\n")


def test_a_reader_killed_mid_read_leaves_the_daemon_serving(tricky, tmp_path):
    src, dst, files = tricky
    mnt = str(tmp_path / "mnt")
    with running_mount(dst, mnt) as (proc, _):
        readers = [subprocess.Popen([sys.executable, "-c", READ_IN_A_LOOP, mnt], stdout=subprocess.PIPE)
                   for _ in range(3)]
        passes(readers, 2)  # (each is in its third pass over the files when killed)
        for r in readers:
            r.send_signal(signal.SIGKILL)
            r.wait(timeout=60)
        assert proc.poll() is None
        assert read_tree(mnt) == read_tree(src)
        deadline = time.monotonic() + 10
        while mount_stats(mnt)["open_handles"] > 1:
            assert time.monotonic() < deadline, "handles of killed readers were not released"
            time.sleep(0.1)


def test_readers_of_the_same_files_get_their_bytes_with_the_kernel_cache(tricky, tmp_path):
    """Four processes reading the same files over and over: each open pushes the cached
    sample to the kernel while other readers' reads of that file are in flight. (With
    the push on the event loop the daemon and the kernel waited for each other: a read
    after 8 s of this failed with EIO, and a test run hung.)"""
    src, dst, files = tricky
    mnt = str(tmp_path / "mnt")
    with running_mount(dst, mnt, "--kernel-cache") as (proc, _):
        readers = [subprocess.Popen([sys.executable, "-c", READ_IN_A_LOOP, mnt], stdout=subprocess.PIPE)
                   for _ in range(4)]
        try:
            passes(readers, 20)  # (each reader read every file 20 times, and no read failed)
            got = subprocess.run(["timeout", "20", "cat", os.path.join(mnt, "root file.txt")],
                                 capture_output=True, timeout=300)
            assert got.returncode == 0 and got.stdout == files["root file.txt"], got.stderr
            assert mount_stats(mnt)["pushed"] > 0
        finally:
            for r in readers:
                r.kill()
                r.wait(timeout=60)


@pytest.mark.parametrize("mode", ["daemon-opens", "python-opens", "no-kernel-cache"])
def test_read_ahead_bytes_reach_the_kernel_page_cache(tricky, tmp_path, mode):
    """With --kernel-cache the kernel page cache comes to hold every sample read ahead (the
    tree was listed first, as ImageFolder does, so the kernel knows its inode): with the
    fast path, the first epoch's reads are answered in C on the fast path's thread from the
    cache, which keeps every sample read ahead, and the kernel keeps the pages they bring
    (keep_cache); with --no-fast-path each sample is pushed to the kernel as it arrives. A
    reader of a sample the kernel holds then costs exactly an open and a release (answered
    in C on the fast path's thread, none of them by the Python loop; in Python with
    --no-fast-path); no read, no flush, no getattr; and the next epoch reads nothing from
    the backend. The kernel may drop clean pages when memory is short (it did on a CI
    machine): a read reaches the daemon only for a sample whose pages mincore found gone
    just before it, and each such sample is counted as dropped once (answered from the
    cache by the fast path's thread). Without --kernel-cache, every read reaches the daemon
    (the fast path's thread answers it from the cache) and makes the kernel ask for the
    file's attributes at the next fstat (the mount is not read-only)."""
    src, dst, files = tricky
    rels = sorted(k for k, v in files.items() if not k.endswith("/") and v)
    mnt = str(tmp_path / "mnt")
    kernel_cache = mode != "no-kernel-cache"
    pushes = mode == "python-opens"  # (the fast path answers the reads of what the cache keeps)
    flags = {"daemon-opens": [], "python-opens": ["--no-fast-path"],
             "no-kernel-cache": ["--no-kernel-cache"]}[mode]
    with running_mount(dst, mnt, "--cache-size", "200%", *flags):
        stats = lambda: mount_stats(mnt)  # noqa: E731
        listed = [os.path.join(d, f) for d, _, fs in os.walk(mnt) for f in fs]
        assert len(listed) == len([k for k in files if not k.endswith("/")])
        ids = mount_ids(mnt)
        dropped = []
        for epoch in range(2):
            # (the kernel marks a file's atime stale when the daemon answers a read of it,
            # so Python's fstat in open() then costs a getattr: a dropped sample's, once)
            stale = len(dropped)
            write_order(mnt, [ids[os.fsencode(r)] for r in rels], epoch=epoch)
            deadline = time.monotonic() + 30
            # (a sample is cached before its worker thread has pushed it)
            while (stats()["cache_samples"] < len(rels)
                   or pushes and stats()["pushed"] < len(rels)) and time.monotonic() < deadline:
                time.sleep(0.05)
            before = stats()
            assert before["cache_samples"] == len(rels)
            dropped = []  # samples whose pages the kernel no longer held when read
            for i, r in enumerate(rels):  # every other file with Python's open(): it asks
                path = os.path.join(mnt, r)  # isatty, an ioctl request (counted since the
                if i % 2:                    # pyfuse3 patch); os.open and os.read do not
                    with open(path, "rb") as f:
                        if not page_cache_holds(f.fileno(), len(files[r])):
                            dropped.append(r)
                        assert f.read() == files[r], r
                else:
                    fd = os.open(path, os.O_RDONLY)
                    try:
                        if not page_cache_holds(fd, len(files[r])):
                            dropped.append(r)
                        assert os.read(fd, len(files[r]) + 1) == files[r], r
                    finally:
                        os.close(fd)
            s = stats()
            again = stats()  # what reading the stats costs, to take off
            asked = {k: v - before["requests"].get(k, 0) - (again["requests"][k] - s["requests"][k])
                     for k, v in s["requests"].items()}
            asked = {k: v for k, v in asked.items() if v}
            reads = asked.pop("read", 0)
            getattrs = asked.pop("getattr", 0)
            ioctl = len(rels) // 2
            if pushes or kernel_cache and epoch == 1:  # the kernel holds every sample
                opened = {"open": len(rels), "release": len(rels)}
                assert asked == {**opened, "ioctl": ioctl}, asked
                in_c = {k: v - before["fast_path_requests"][k] - (again["fast_path_requests"][k] - v)
                        for k, v in s["fast_path_requests"].items()} if mode == "daemon-opens" else None
                # (the reads of dropped samples too: from the cache's bytes, held for it)
                # (no lookup: the names were listed before; no forget)
                assert in_c == ({"open": len(rels), "release": len(rels), "ioctl": ioctl, "read": reads,
                                 "lookup": 0, "forget": 0, "interrupt": 0} if mode == "daemon-opens" else None), in_c
                assert s["fast_path_requests"] is None or mode == "daemon-opens"
                # (fewer drops than it takes to distrust every push: kernel_view.MIN_DROPS)
                assert len(dropped) < MIN_DROPS, dropped
                assert (reads > 0) == bool(dropped) and getattrs <= stale, (reads, getattrs, dropped)
                assert s["kernel_dropped"] - before["kernel_dropped"] == len(dropped), (s, dropped)
                assert before["pushed"] == s["pushed"] == (len(rels) if pushes else 0), s
            else:  # every read reaches the daemon (the first epoch's, with the fast path)
                assert asked["open"] == asked["release"] == len(rels) and "flush" not in asked, asked
                assert asked["ioctl"] == ioctl and getattrs == 0, asked  # (read-only: no getattr at open)
                assert s["pushed"] == 0
                if epoch == 0:  # (then the kernel keeps what the reads brought: keep_cache)
                    assert reads >= len(rels), asked
                # every read answered by the fast path's thread, from the cached bytes
                in_c = s["fast_path_requests"]["read"] - before["fast_path_requests"]["read"]
                assert in_c == reads and s["hits"] - before["hits"] == reads, (in_c, reads)
                # (each read to a sample's end: taken as held, so not read ahead again)
                assert s["in_kernel"] == (len(rels) if kernel_cache else 0), s
            assert s["backend_samples"] == len(rels)  # fetched once, in the first epoch
            assert s["cache_samples"] == len(rels)  # kept: room is not needed


@contextlib.contextmanager
def _listed_mount(dst: str, files: dict, tmp_path, cache_size: str):
    """A mount of dst (the tricky tree's files) with --cache-size cache_size, its tree
    listed as ImageFolder lists it (the kernel then knows every inode, so fetched samples
    can be pushed): (mount point, the non-empty files' paths, their sample ids)."""
    rels = sorted(k for k, v in files.items() if not k.endswith("/") and v)
    mnt = str(tmp_path / "mnt")
    with running_mount(dst, mnt, "--cache-size", cache_size):
        assert len([f for _, _, fs in os.walk(mnt) for f in fs]) == len(files) - 2  # listed
        yield mnt, rels, mount_ids(mnt)


def _kernel_forgets(mnt: str, what: str) -> dict:
    """Drop the machine's caches (/proc/sys/vm/drop_caches: what), wait until the mount
    takes no sample as held in the kernel page cache, and return its stats then."""
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write(what)
    deadline = time.monotonic() + 10
    while mount_stats(mnt)["in_kernel"] and time.monotonic() < deadline:
        time.sleep(0.05)
    after = mount_stats(mnt)
    assert after["in_kernel"] == 0, after
    return after


@pytest.mark.machine  # (the kernel forgets inodes only when the whole machine's are dropped)
@pytest.mark.skipif(os.geteuid() != 0, reason="dropping the kernel's inodes needs root (CI runs as root)")
def test_inodes_the_kernel_forgets_are_no_longer_taken_to_hold_pages(tricky, tmp_path):
    """When the kernel forgets a file's inode it drops its pages (the README's benchmark
    drops dentries and inodes before each epoch). The forgets are answered by the fast
    path's thread, none by the Python loop, and reach the core as events: every sample
    the kernel held before (read through once) is taken as held no longer; its reads reach
    the daemon again."""
    _, dst, files = tricky
    with _listed_mount(dst, files, tmp_path, "200%") as (mnt, rels, ids):
        _epoch(mnt, rels, files, ids, 0)
        write_order(mnt, [ids[os.fsencode(r)] for r in rels], epoch=1)  # (needed again)
        before = mount_stats(mnt)
        assert before["in_kernel"] == len(rels), before
        after = _kernel_forgets(mnt, "3")  # (pages, then dentries and inodes)
        # (the order still needs them: past MIN_DROPS such forgets every flag is cleared at
        # once, the later forgets find none set)
        assert after["kernel_drops"], after
        assert MIN_DROPS <= after["kernel_forgotten"] - before["kernel_forgotten"] <= len(rels), after
        fast = after["fast_path_requests"]["forget"] - before["fast_path_requests"]["forget"]
        assert fast > 0 and after["requests"]["forget"] - before["requests"].get("forget", 0) == fast
        for r in rels:  # (served from the daemon's cache: read in C, not counted as drops)
            with open(os.path.join(mnt, r), "rb") as f:
                assert f.read() == files[r], r
        s = mount_stats(mnt)
        assert s["fast_path_requests"]["read"] - after["fast_path_requests"]["read"] >= len(rels)
        assert s["kernel_dropped"] == before["kernel_dropped"], s


@pytest.mark.machine  # (the kernel forgets inodes only when the whole machine's are dropped)
@pytest.mark.skipif(os.geteuid() != 0, reason="dropping the kernel's inodes needs root (CI runs as root)")
def test_the_read_ahead_fetches_again_what_the_order_needs_once_the_kernel_forgets_it(tricky, tmp_path):
    """A cache of a fifth of the set and every sample pushed to the kernel: the next order
    finds them held and fetches nothing. Then the kernel forgets their inodes, pages and
    all (memory pressure reclaims them so): the forgets of samples the order still needs
    count as drops, the read-ahead goes back for them, and the epoch's readers find them
    fetched or on their way, not missed (before: every read of the epoch missed)."""
    _, dst, files = tricky
    with _listed_mount(dst, files, tmp_path, "20%") as (mnt, rels, ids):
        _epoch(mnt, rels, files, ids, 0)
        shuffled = random.Random(1).sample(rels, len(rels))
        write_order(mnt, [ids[os.fsencode(r)] for r in shuffled], epoch=1)
        before = mount_stats(mnt)
        assert before["in_kernel"] >= MIN_DROPS and before["cache_samples"] < len(rels) // 2, before
        after = _kernel_forgets(mnt, "2")  # (dentries and inodes, and with them their pages)
        assert after["kernel_drops"], after
        for r in shuffled:
            with open(os.path.join(mnt, r), "rb") as f:
                assert f.read() == files[r], r
        s = mount_stats(mnt)
        assert s["misses"] - before["misses"] <= len(rels) // 4, (before, s)
        assert s["backend_samples"] - before["backend_samples"] >= len(rels) - before["cache_samples"], s


def _epoch(mnt, rels, files, ids, epoch):
    """Write an order of rels and read them in it (each read to its end: the kernel then
    holds its pages, read through or pushed). The stats' changes over the epoch, with the
    FUSE requests it cost by type."""
    write_order(mnt, [ids[os.fsencode(r)] for r in rels], epoch=epoch)
    before = mount_stats(mnt)
    for r in rels:
        with open(os.path.join(mnt, r), "rb") as f:
            assert f.read() == files[r], r
    after = mount_stats(mnt)
    delta = {k: after[k] - before[k] for k in ("pushed", "backend_samples", "kernel_dropped", "kernel_forgotten")}
    delta["requests"] = {k: v - before["requests"].get(k, 0) for k, v in after["requests"].items()
                         if v - before["requests"].get(k, 0)}
    return delta, after


def test_samples_the_kernel_holds_are_not_fetched_again_until_it_drops_pages(tricky, tmp_path):
    """A cache of a fifth of the set: a sample the kernel page cache holds (read through
    the daemon to its end, or pushed) is not read ahead from the backend again while the
    kernel holds it. When the kernel drops those pages (here POSIX_FADV_DONTNEED through
    the mount, as memory pressure or proactive reclaim does without telling the daemon),
    reads of such samples show it: once MIN_DROPS of them (and more than DROP_SHARE of the
    held samples opened) were dropped, what was held before is forgotten and the read-ahead
    fetches what it skipped; a new order counts drops afresh."""
    _, dst, files = tricky
    with _listed_mount(dst, files, tmp_path, "20%") as (mnt, rels, ids):
        first, s = _epoch(mnt, rels, files, ids, 0)
        pushed = s["in_kernel"]
        assert pushed >= len(rels) // 2, s  # every sample read to its end (less any dropped since)
        assert s["cache_samples"] < len(rels) // 2  # the daemon's cache holds few of them
        again, s = _epoch(mnt, rels, files, ids, 1)
        # only what was not pushed is fetched, and what the kernel was found to have dropped
        # or forgot the inode of meanwhile (it may reclaim cold pages and inodes at any
        # time: it did in CI); before: everything the cache did not hold
        lost = again["kernel_dropped"] + again["kernel_forgotten"]
        assert again["backend_samples"] <= len(rels) - pushed + lost, (again, s)
        assert again["kernel_dropped"] < MIN_DROPS and not s["kernel_drops"], again
        for r in rels:  # the kernel drops the pages of every file
            fd = os.open(os.path.join(mnt, r), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        dropped, s = _epoch(mnt, rels, files, ids, 2)
        assert dropped["kernel_dropped"] >= MIN_DROPS and s["kernel_drops"], (dropped, s)
        # after the first MIN_DROPS misses the read-ahead fetches the rest again
        assert dropped["backend_samples"] >= len(rels) - 2 * MIN_DROPS, dropped
        write_order(mnt, [ids[os.fsencode(r)] for r in rels], epoch=3)
        assert not mount_stats(mnt)["kernel_drops"]  # a new order counts drops afresh


def test_two_mounts_as_two_nodes_read_the_epoch_once_each_prefetching_its_share(tricky, tmp_path):
    src, dst, files = tricky
    rels = sorted(k for k, v in files.items() if not k.endswith("/") and v)
    rels = rels[:len(rels) // 2 * 2]  # even: no DistributedSampler padding
    check_two_nodes(dst, rels, {r: xxhash.xxh3_64_intdigest(files[r]) for r in rels}, tmp_path)


def test_the_process_group_gives_replicas_and_rank_as_for_distributed_sampler(monkeypatch):
    """With torch.distributed initialised (here: its answers stood in for), HintedSampler
    takes num_replicas and rank from it, as DistributedSampler does; explicit ones win."""
    dist = torch.distributed
    monkeypatch.setattr(dist, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 3)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 2)
    ds = Paths(f"/x/{i}" for i in range(11))
    ours = HintedSampler(ds, seed=4, write=False)
    theirs = DistributedSampler(range(11), seed=4)
    assert (ours.num_replicas, ours.rank) == (3, 2) and list(ours) == list(theirs)
    assert HintedSampler(ds, num_replicas=2, rank=0, write=False).num_replicas == 2


def test_a_subset_or_explicit_paths_give_the_files_and_anything_else_a_clear_error():
    from torch.utils.data import Dataset, Subset
    from trainer.hints import dataset_paths

    class Folder(Dataset):
        samples = [(f"/d/{i}.jpg", i % 2) for i in range(6)]

        def __len__(self):
            return 6

    assert dataset_paths(Subset(Folder(), [4, 1])) == ["/d/4.jpg", "/d/1.jpg"]
    assert dataset_paths(Subset(Subset(Folder(), [5, 4, 3]), [2])) == ["/d/3.jpg"]
    from torch.utils.data import ConcatDataset
    both = ConcatDataset([Subset(Folder(), [1]), Folder()])
    assert dataset_paths(both) == ["/d/1.jpg"] + [f"/d/{i}.jpg" for i in range(6)]
    assert len(dataset_paths(both)) == len(both)

    class Other(Dataset):
        def __len__(self):
            return 3
    assert dataset_paths(Other(), paths=lambda i: f"/o/{i}") == ["/o/0", "/o/1", "/o/2"]
    assert dataset_paths(Other(), paths=["/a", "/b", "/c"]) == ["/a", "/b", "/c"]
    with pytest.raises(ValueError, match="paths has 2 entries, the dataset 3"):
        dataset_paths(Other(), paths=["/a", "/b"])
    with pytest.raises(TypeError, match="a Other: .*pass paths="):
        HintedSampler(Other(), write=False)
    with pytest.raises(TypeError, match="of a Other"):  # (the part that names none)
        dataset_paths(ConcatDataset([Folder(), Other()]))


def _lightning_resolves(sampler, world: int, rank: int) -> list[int]:
    """The indices rank gets once Lightning (2.x, DDP) has resolved the DataLoader's sampler:
    `_requires_distributed_sampler` keeps a DistributedSampler as it is, and any other
    sampler is wrapped in DistributedSamplerWrapper, a DistributedSampler over the
    sampler's output (so each rank keeps a strided share of what its sampler yields)."""
    if isinstance(sampler, DistributedSampler):
        return list(sampler)
    out = list(sampler)
    wrap = DistributedSampler(range(len(out)), num_replicas=world, rank=rank, shuffle=True, seed=0)
    return [out[i] for i in wrap]


def test_lightning_keeps_the_sampler_and_every_sample_is_read_once_per_epoch():
    """Lightning's check finds a DistributedSampler, so it does not wrap it: 2 ranks of a
    1,001-sample set read 501 each, every sample once (one padded repeat), as with
    DistributedSampler. A sampler that is not one (the older HintedSampler) was cut to 251."""
    from torch.utils.data import Sampler
    n, world = 1001, 2
    ds = Paths(f"/x/{i}" for i in range(n))
    shares = []
    for rank in range(world):
        s = HintedSampler(ds, num_replicas=world, rank=rank, seed=3, write=False)
        s.set_epoch(1)
        assert isinstance(s, DistributedSampler) and (s.num_samples, s.total_size) == (501, 1002)
        shares.append(_lightning_resolves(s, world, rank))
    assert [len(x) for x in shares] == [501, 501]
    assert sorted(set(shares[0]) | set(shares[1])) == list(range(n))

    class NotDistributed(Sampler):  # what Lightning does to any other sampler of the rank's share
        def __init__(self, inner):
            self.inner = inner

        def __iter__(self):
            return iter(self.inner)

        def __len__(self):
            return len(self.inner)
    cut = _lightning_resolves(NotDistributed(HintedSampler(ds, num_replicas=world, rank=0, write=False)), world, 0)
    assert len(cut) == 251


@pytest.mark.parametrize("kw", [dict(), dict(num_replicas=3, rank=1), dict(generator=True),
                                dict(mode="echo", batch_size=8)])
def test_state_dict_resumes_mid_epoch_with_the_same_remaining_order(kw):
    ds = Paths(f"/x/{i}" for i in range(50))

    def make():
        k = dict(kw)
        if k.pop("generator", False):
            g = torch.Generator()
            g.manual_seed(11)
            k["generator"] = g
        return HintedSampler(ds, seed=2, write=False, **k)
    s = make()
    s.set_epoch(3)
    it = iter(s)
    head = [next(it) for _ in range(7)]
    state = s.state_dict()
    assert state["epoch"] == 3 and state["yielded"] == 7
    rest = list(it)
    resumed = make()
    resumed.load_state_dict(state)
    assert list(resumed) == rest and head + rest == make_epoch(make, 3)
    with pytest.raises(ValueError, match="seed"):
        HintedSampler(ds, seed=5, write=False).load_state_dict(state)


def make_epoch(make, epoch):
    s = make()
    s.set_epoch(epoch)
    return list(s)


def test_a_generator_gives_random_samplers_indices_epoch_after_epoch():
    n = 40
    ds = Paths(f"/x/{i}" for i in range(n))
    g1, g2 = torch.Generator(), torch.Generator()
    g1.manual_seed(7)
    g2.manual_seed(7)
    ours, theirs = HintedSampler(ds, generator=g1, write=False), RandomSampler(range(n), generator=g2)
    epochs = [(list(ours), list(theirs)) for _ in range(3)]
    assert all(a == b for a, b in epochs) and epochs[0][0] != epochs[1][0]
    with pytest.raises(ValueError, match="generator= is for mode='random'"):
        HintedSampler(ds, generator=g1, mode="echo", batch_size=4, write=False)


def test_off_a_mount_it_samples_as_torch_does_and_warns_once(tmp_path, monkeypatch):
    """A copy of the data on a plain folder: the same script runs, with torch's indices and
    one warning per process."""
    import trainer.hints as hints
    monkeypatch.setattr(hints, "_WARNED_NOT_A_MOUNT", False)
    paths = []
    for i in range(9):
        (tmp_path / f"{i}.jpg").write_bytes(b"x")
        paths.append(str(tmp_path / f"{i}.jpg"))
    with pytest.warns(UserWarning, match="is not on a fusefs mount") as caught:
        s = HintedSampler(Paths(paths), seed=1)
        again = HintedSampler(Paths(paths), num_replicas=2, rank=1, seed=1)
    assert len(caught) == 1 and not s.write and s.mount is None
    g = torch.Generator()
    g.manual_seed(1)
    assert list(s) == list(RandomSampler(range(9), generator=g))
    assert list(again) == list(DistributedSampler(range(9), num_replicas=2, rank=1, seed=1))


def test_a_resumed_epoch_tells_the_mount_only_the_rest(tricky, tmp_path):
    src, dst, files = tricky
    regular = sorted(k for k in files if not k.endswith("/") and files[k])
    mnt = str(tmp_path / "mnt")
    with running_mount(dst, mnt):
        paths = [os.path.join(mnt, r) for r in regular]
        s = HintedSampler(Paths(paths), seed=4, lookahead=False)
        s.set_epoch(2)
        it = iter(s)
        for _ in range(5):
            next(it)
        rest = list(it)
        resumed = HintedSampler(Paths(paths), seed=4, lookahead=False)
        resumed.load_state_dict(dict(s.state_dict(), yielded=5))
        assert list(resumed) == rest
        ids = mount_ids(mnt)
        current = orderfmt.parse(open(os.path.join(mnt, ".fusefs", "order"), "rb").read(), len(ids))
        assert current.epoch == 2 and current.ids.tolist() == [ids[os.fsencode(regular[i])] for i in rest]


def test_a_dataset_of_paths_relative_to_the_working_folder_gets_its_ids(tricky, tmp_path, monkeypatch):
    """ImageFolder("mnt") names its files relative to the working folder, as the loader's
    workers open them: those are the files the order names, not mnt/mnt/..."""
    src, dst, files = tricky
    regular = sorted(k for k in files if not k.endswith("/") and files[k])
    with running_mount(dst, tmp_path / "mnt"):
        monkeypatch.chdir(tmp_path)
        s = HintedSampler(Paths([os.path.join("mnt", r) for r in regular]), seed=1, lookahead=False)
        order = list(s)
        ids = mount_ids("mnt")
        current = orderfmt.parse(open(os.path.join("mnt", ".fusefs", "order"), "rb").read(), len(ids))
        assert current.ids.tolist() == [ids[os.fsencode(regular[i])] for i in order]


def test_every_spelling_of_a_mounts_file_gives_its_id_and_a_stranger_a_key_error(tricky, tmp_path, monkeypatch):
    from fusefs.client import paths_to_ids
    src, dst, files = tricky
    rel = sorted(k for k in files if "/" in k and not k.endswith("/") and files[k])[0]
    folder, name = rel.rsplit("/", 1)
    mnt = str(tmp_path / "mnt")
    with running_mount(dst, mnt):
        want = mount_ids(mnt)[os.fsencode(rel)]
        monkeypatch.chdir(tmp_path)
        spellings = [os.path.join(mnt, rel), os.fsencode(os.path.join(mnt, rel)), f"{mnt}/{folder}/./{name}",
                     f"{mnt}//{rel}", f"{mnt}/{rel}/../{name}", os.path.join("mnt", rel)]
        assert paths_to_ids(spellings).tolist() == [want] * len(spellings)
        assert paths_to_ids([rel, "./" + rel], mnt).tolist() == [want, want]  # (relative to the mount)
        for stranger in (os.path.join(mnt, rel + "x"), os.path.join(mnt, folder), str(tmp_path / rel)):
            with pytest.raises(KeyError, match="is not a file of the fusefs mount"):
                paths_to_ids([os.path.join(mnt, rel), stranger])


def test_another_data_set_mounted_at_the_same_path_gets_its_own_ids(tmp_path):
    """The client's id table belongs to one mount: a data set of other names mounted later
    at the same path takes an order by paths with its own ids (a stale table gave the
    first set's ids, which could pass the daemon's range check: a wrong order)."""
    from conftest import write_tree
    from fusefs.pack import pack
    mnt = str(tmp_path / "mnt")
    trees = [{f"c/{i:02d}.jpg": bytes([i]) * 100 for i in range(6)},
             {f"c/{i:02d}.jpg": bytes([i]) * 100 for i in range(3, 9)}]  # 03..05 at other ids
    for k, files in enumerate(trees):
        write_tree(tmp_path / f"src{k}", files)
        pack(str(tmp_path / f"src{k}"), str(tmp_path / f"dst{k}"), progress=False)
    for k in range(2):
        with running_mount(str(tmp_path / f"dst{k}"), mnt):
            paths = [os.path.join(mnt, "c", f"{i:02d}.jpg") for i in (5, 4, 3)]
            write_order(mnt, paths, epoch=k)
            ids = orderfmt.parse(open(os.path.join(mnt, ".fusefs", "order"), "rb").read(), 10).ids
            names = open(os.path.join(mnt, ".fusefs", "ids"), "rb").read().split(b"\0")
            assert [names[i] for i in ids] == [b"c/05.jpg", b"c/04.jpg", b"c/03.jpg"], k
