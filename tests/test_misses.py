"""The miss engine (fusefs/misses.py): without an order, once the cache has no room for a
miss, a sample a reader misses is read and answered in C by its node's reader threads;
whatever is not a clean read, a scan, and every miss once an order is in force go to the
loop as without it. Real mounts, read with open()."""
import contextlib
import errno
import shutil
import time

import pytest

from fusefs.index import INDEX_NAME, Index
from testkit.mounts import resolve, running_mount
from trainer.hints import mount_stats, write_order

from conftest import flip_byte


def _whole(files: dict) -> list[str]:
    """The files a whole read of which is one read request (up to 1 MiB, not empty)."""
    return [rel for rel, blob in sorted(files.items()) if blob is not None and 0 < len(blob) <= 1 << 20]


def _no_two_in_a_row(ix, names: list[str]) -> list[str]:
    """names whose sample ids are even, from the last: none follows a sample read before it,
    so none looks like a scan (which the loop fetches)."""
    by_sid = sorted(((resolve(ix, n)[1], n) for n in names), reverse=True)
    return [n for sid, n in by_sid if sid % 2 == 0]


def _read_each(mnt, names: list[str], files: dict) -> None:
    """Read each of names whole, with open(): its exact bytes."""
    for n in names:
        with open(mnt / n, "rb") as f:
            assert f.read() == files[n], n


def _delta(after: dict, before: dict, key: str) -> int:
    return after.get(key, 0) - before.get(key, 0)


def _counted(mnt, before: dict, key: str, n: int, bound: float = 30.0) -> dict:
    """The mount's counters once key has moved by n since before, or after bound seconds: the
    fetch thread answers a read before the loop counts its fetch (on its arrival)."""
    deadline = time.monotonic() + bound
    while True:
        s = mount_stats(str(mnt))
        if _delta(s, before, key) >= n or time.monotonic() > deadline:
            return s
        time.sleep(0.01)


@contextlib.contextmanager
def _engine_mount(dst, mnt, files: dict, *args):
    """A mount without a cache (--cache-size 0), its first miss read: the loop fetches it
    (the engine is off while the cache has room for one), and finds the cache full, which
    turns the engine on. The sample read has an odd id, the last such: yield (proc, log)."""
    ix = Index.load(f"{dst}/{INDEX_NAME}")
    first = max((resolve(ix, n)[1], n) for n in _whole(files) if resolve(ix, n)[1] % 2)[1]
    with running_mount(dst, mnt, "--cache-size", "0", *args) as (proc, log):
        before = mount_stats(str(mnt))
        _read_each(mnt, [first], files)
        s = _counted(mnt, before, "backend_samples", 1)  # (and the engine on: the cache is full)
        assert _delta(s, before, "engine_queued") == 0 and _delta(s, before, "backend_samples") == 1, s
        yield proc, log


def test_without_an_order_the_engine_reads_and_answers_each_miss_without_the_loop(tricky, tmp_path):
    """Each miss is queued on its node's lane, read by that lane's reader and answered from
    its bytes in C: the exact bytes, every read answered outside the loop, none of the
    loop's fetches made, nothing handed to the loop."""
    _, dst, files = tricky
    ix = Index.load(f"{dst}/{INDEX_NAME}")
    names = _no_two_in_a_row(ix, _whole(files))
    assert len(names) >= 10
    mnt = tmp_path / "mnt"
    with _engine_mount(dst, mnt, files) as (proc, log):
        before = mount_stats(str(mnt))
        _read_each(mnt, names, files)
        s = mount_stats(str(mnt))
        assert _delta(s, before, "engine_misses") == len(names), s
        assert _delta(s, before, "engine_queued") == len(names)
        assert _delta(s, before, "misses") == len(names)
        assert _delta(s, before, "engine_bytes") == sum(len(files[n]) for n in names)
        assert _delta(s, before, "misses_to_loop") == 0 and _delta(s, before, "engine_to_loop") == 0
        assert _delta(s, before, "backend_samples") == 0  # (the loop fetched nothing)
        assert s["fast_path_requests"]["read"] - before["fast_path_requests"].get("read", 0) == len(names)
        assert s["parked_to_loop"] == before["parked_to_loop"] and proc.poll() is None
        assert "miss engine, 1 lane" in open(log).read()


def test_a_corrupt_sample_through_the_engine_is_eio_named_once_and_not_read_again(tricky, tmp_path):
    """The engine's reader finds the checksum mismatch and hands the read to the loop, which
    reads the sample, answers EIO and names the chunk in the log; the next read of it is
    handed to the loop without a read of the engine's."""
    src, dst, files = tricky
    copy = tmp_path / "dst"
    shutil.copytree(dst, copy)
    ix = Index.load(str(copy / INDEX_NAME))
    name = next(n for n in _no_two_in_a_row(ix, _whole(files)) if len(files[n]) > 16)
    victim = resolve(ix, name)[1]
    chunk = copy / ix.chunks[int(ix.chunk[victim])].path
    flip_byte(chunk, int(ix.offset[victim]) + 5)
    mnt = tmp_path / "mnt"
    with _engine_mount(str(copy), mnt, files) as (proc, log):
        before = mount_stats(str(mnt))
        with pytest.raises(OSError) as e:
            open(mnt / name, "rb").read()
        assert e.value.errno == errno.EIO
        s = mount_stats(str(mnt))
        assert _delta(s, before, "engine_reads") == 1 and _delta(s, before, "engine_to_loop") == 1, s
        # (the kernel asks again after a failed read-ahead: EIO at once, the sample known bad)
        assert _delta(s, before, "engine_misses") == 0 and _delta(s, before, "eio") >= 1
        text = open(log).read()
        assert str(chunk) in text and name in text and "checksum" in text
        with pytest.raises(OSError) as e:  # (the kernel keeps no page of it: a miss again)
            open(mnt / name, "rb").read()
        assert e.value.errno == errno.EIO
        again = mount_stats(str(mnt))
        assert _delta(again, s, "engine_reads") == 0 and _delta(again, s, "eio") >= 1, again
        assert proc.poll() is None


def test_a_scan_and_every_miss_under_an_order_go_to_the_loop(tricky, tmp_path):
    """A miss of the sample after one missed lately looks like a scan: the loop hears of it
    and fetches the samples after it along with it. Once an
    order is in force the loop's read-ahead takes every miss: none is queued for the
    engine."""
    _, dst, files = tricky
    ix = Index.load(f"{dst}/{INDEX_NAME}")
    whole = set(_whole(files))
    by_sid = sorted((resolve(ix, n)[1], n) for n in whole)
    run = []  # the longest run of consecutive sample ids among them
    for sid, n in by_sid:
        run = run + [n] if run and resolve(ix, run[-1])[1] == sid - 1 else [n]
        if len(run) >= 6:
            break
    assert len(run) >= 6
    mnt = tmp_path / "mnt"
    with _engine_mount(dst, mnt, files) as (proc, log):
        before = mount_stats(str(mnt))
        _read_each(mnt, run, files)
        s = mount_stats(str(mnt))
        assert _delta(s, before, "engine_misses") == 1, s  # (the first: nothing before it)
        # (the loop fetches the samples after a scan's miss along with it)
        assert 1 <= _delta(s, before, "misses_to_loop") < _delta(s, before, "backend_samples"), s
        rest = [n for n in sorted(whole) if n not in run]
        write_order(str(mnt), rest[::-1])
        queued = mount_stats(str(mnt))["engine_queued"]
        _read_each(mnt, rest[:5], files)  # (the order's last: misses, whatever the read-ahead fetched)
        after = mount_stats(str(mnt))
        assert after["engine_queued"] == queued, after
        assert proc.poll() is None


def test_an_order_read_to_its_end_gives_the_misses_back_to_the_engine(tricky, tmp_path):
    """While an order has positions left the loop takes every miss; once it has been read
    to its end (and no other came), the engine reads the misses again: the first one the
    loop hears of turns it back on."""
    _, dst, files = tricky
    ix = Index.load(f"{dst}/{INDEX_NAME}")
    names = _no_two_in_a_row(ix, _whole(files))
    order, again = names[:8], names[8:12]
    assert len(again) == 4
    mnt = tmp_path / "mnt"
    with _engine_mount(dst, mnt, files) as (proc, log):
        write_order(str(mnt), order)
        before = mount_stats(str(mnt))
        _read_each(mnt, order, files)
        s = mount_stats(str(mnt))
        assert _delta(s, before, "engine_queued") == 0, s  # (the order's: the loop's)
        _read_each(mnt, again, files)
        after = mount_stats(str(mnt))
        assert _delta(after, s, "engine_misses") >= len(again) - 1, after  # (the first: the loop's)
        assert proc.poll() is None


def test_while_the_cache_has_room_the_loop_keeps_each_miss_and_the_next_pass_is_memory(tricky, tmp_path):
    """With a cache that holds the set and no order, the engine stays off: the loop fetches
    each miss and the cache keeps it, so a second pass (the kernel's copies dropped: O_DIRECT
    reads) is answered from the daemon's memory, no sample read from the chunks again."""
    import os
    _, dst, files = tricky
    names = _whole(files)
    mnt = tmp_path / "mnt"
    with running_mount(dst, mnt, "--cache-size", "120%") as (proc, log):
        _read_each(mnt, names, files)
        before = mount_stats(str(mnt))
        for n in names:
            fd = os.open(mnt / n, os.O_RDONLY | os.O_DIRECT)
            try:
                got = bytearray()
                while part := os.pread(fd, 1 << 20, len(got)):
                    got += part
            finally:
                os.close(fd)
            assert bytes(got) == files[n], n
        s = mount_stats(str(mnt))
        assert s["engine_queued"] == 0 and _delta(s, before, "backend_samples") == 0, s
        assert _delta(s, before, "hits") >= len(names) and proc.poll() is None


def test_no_miss_engine_leaves_every_miss_to_the_loop(tricky, tmp_path):
    """--no-miss-engine: no lanes, no reader; the loop fetches each miss, which waits in the
    fast path as without the engine."""
    _, dst, files = tricky
    ix = Index.load(f"{dst}/{INDEX_NAME}")
    names = _no_two_in_a_row(ix, _whole(files))[:10]
    mnt = tmp_path / "mnt"
    with running_mount(dst, mnt, "--cache-size", "0", "--no-miss-engine") as (proc, log):
        before = mount_stats(str(mnt))
        _read_each(mnt, names, files)
        s = mount_stats(str(mnt))
        assert "engine_misses" not in s and "miss engine" not in open(log).read()
        assert _delta(s, before, "misses_parked") == len(names)
        assert _delta(s, before, "backend_samples") >= len(names) and proc.poll() is None


def test_engine_stress_readers_killed_and_corrupt_samples_on_three_nodes(three_nodes, tmp_path):
    """The engine under stress (scripts/sanitize.sh runs it under AddressSanitizer): no
    order, six readers each reading the set in an order of its own (O_DIRECT: every read
    reaches the daemon, and every one is a miss) through two fast-path threads and three
    lanes, three samples corrupt, readers killed mid-pass and replaced, three times. Every
    read gets its bytes or, for a corrupt sample, EIO (the log names its chunk); no read
    hangs; the daemon keeps serving; the killed readers' handles are released; its resident
    memory comes within fresh + budgets (the readers' buffers among them) + 5%; a read of
    every file afterwards finds nothing waiting (each its bytes, the corrupt ones EIO)."""
    import json
    import os
    import random
    from conftest import corrupt_three, rss_within, stress_readers
    dst, files = three_nodes
    rels = sorted(files)
    rng = random.Random(90)
    copy = str(tmp_path / "dst")
    ix, bad, digest = corrupt_three(dst, copy, files, rng)
    nreaders = 6
    plans = []
    for k in range(nreaders):
        plans.append(str(tmp_path / f"plan{k}.json"))
        with open(plans[-1], "w") as f:
            json.dump([(r, digest[r]) for r in rng.sample(rels, len(rels))], f)
    mnt = str(tmp_path / "mnt")

    with running_mount(copy, mnt, "--cache-size", "10%", "--fast-threads", "2", "--no-kernel-cache") as (proc, log):
        before = mount_stats(mnt)
        stress_readers(mnt, plans, rng, 1)
        assert proc.poll() is None
        s = mount_stats(mnt)
        bound = int(1.05 * s["memory_bound"])  # (fresh + the budgets, the readers' buffers among them)
        if "libasan" not in os.environ.get("LD_PRELOAD", ""):  # (AddressSanitizer's malloc keeps freed memory)
            assert rss_within(proc.pid, bound) <= bound
        for rel in rels:  # (nothing left waiting: every file answers)
            path = os.path.join(mnt, rel)
            if rel in bad:
                with pytest.raises(OSError) as e:
                    open(path, "rb").read()
                assert e.value.errno == errno.EIO, rel
            else:
                assert open(path, "rb").read() == files[rel], rel
        text = open(log).read()
    assert "miss engine, 3 lanes" in text
    for rel in bad:
        sid = resolve(ix, rel)[1]
        assert ix.chunks[int(ix.chunk[sid])].path in text, rel
    assert _delta(s, before, "engine_misses") > 4 * len(rels), s
    assert 3 <= _delta(s, before, "engine_to_loop") and _delta(s, before, "eio") >= 3, s
    assert s["engine_bytes"] > 0 and s["parked_to_loop"] >= 3, s
