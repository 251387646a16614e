"""trainer.HintedSampler: the same indices as torch's samplers, and orders through a mount."""
import errno
import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor

import numpy as np
import pytest
import torch
from torch.utils.data import DistributedSampler, RandomSampler

from fusefs import order as orderfmt
from fusefs.mount import running_mount
from trainer import HintedSampler, write_order
from trainer.hints import mount_ids

from conftest import read_tree


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
        stats = json.load(open(os.path.join(mnt, ".fusefs", "stats")))
        assert stats["orders_accepted"] == 1 and stats["eio"] == 0
        assert stats["plans"]["0"]["cursor"] == len(rels)
        assert stats["cache_peak"] <= stats["cache_budget"]
        assert stats["open_handles"] == 0


def test_bad_order_fails_close_with_einval_and_the_old_one_stays(tricky, tmp_path):
    mnt = str(tmp_path / "mnt")
    with running_mount(tricky[1], mnt) as (_, log):
        write_order(mnt, [0, 1, 2], epoch=3)
        for bad in (b"garbage", orderfmt.encode([0, 99999]), orderfmt.encode([0, 1])[:-1]):
            f = open(os.path.join(mnt, ".fusefs", "order"), "wb")
            f.write(bad)
            with pytest.raises(OSError) as e:
                f.close()
            assert e.value.errno == errno.EINVAL
        current = orderfmt.parse(open(os.path.join(mnt, ".fusefs", "order"), "rb").read(), 10**6)
        assert current.ids.tolist() == [0, 1, 2] and current.epoch == 3
        assert "unknown sample id 99999" in open(log).read()
        assert read_tree(mnt) == read_tree(tricky[0])  # still serving


def test_a_reader_killed_mid_read_leaves_the_daemon_serving(tricky, tmp_path):
    src, dst, files = tricky
    mnt = str(tmp_path / "mnt")
    with running_mount(dst, mnt) as (proc, _):
        code = ("import os,sys\nwhile True:\n for d,_,fs in os.walk(sys.argv[1]):\n"
                "  for f in fs: open(os.path.join(d,f),'rb').read()\n")
        readers = [subprocess.Popen([sys.executable, "-c", code, mnt]) for _ in range(3)]
        time.sleep(1.0)
        for r in readers:
            r.send_signal(signal.SIGKILL)
            r.wait()
        assert proc.poll() is None
        assert read_tree(mnt) == read_tree(src)
        deadline = time.monotonic() + 10
        while json.load(open(os.path.join(mnt, ".fusefs", "stats")))["open_handles"] > 1:
            assert time.monotonic() < deadline, "handles of killed readers were not released"
            time.sleep(0.1)
