"""The local cache tier (issue 5): memory, then DIR, then the backend; budgets, priorities,
warm restarts, damaged files, one mount per DIR."""
import os

import numpy as np
import pytest
import trio

from fusefs import order as orderfmt
from fusefs.index import INDEX_NAME, Index
from fusefs.local import LocalTier, LocalTierError
from testkit.mounts import running_mount
from trainer import mount_stats

from conftest import make_core, refused_mount
from conftest import exact_within_budget, run_epoch


def _tier(dst, folder, budget):
    return LocalTier(str(folder), budget, Index.load(os.path.join(dst, INDEX_NAME)))


def _disk_bytes(folder) -> int:
    total = 0
    for dirpath, _, names in os.walk(os.path.join(folder, "samples")):
        total += sum(os.path.getsize(os.path.join(dirpath, n)) for n in names)
    return total


def _epoch(dst, files, folder, budget, ids, cache_bytes=1 << 20, importance=None):
    """One epoch through a core with a local tier; returns (core statistics, tier)."""
    tier = _tier(dst, folder, budget)
    core = make_core(dst, cache_bytes=cache_bytes, local=tier)
    try:
        data = orderfmt.encode(ids, importance=importance)
        trio.run(run_epoch, core, ids, 3, 8, 0, exact_within_budget(core, files), data)
        assert tier.wait_written()
        return core.statistics(), tier
    finally:
        tier.close()


def test_tier_fills_within_budget_and_serves_the_next_mount(three_nodes, tmp_path):
    dst, files = three_nodes
    sizes = Index.load(os.path.join(dst, INDEX_NAME)).size
    n, budget = len(sizes), int(sizes.sum() // 2)
    ids = list(np.random.default_rng(0).permutation(n))
    s1, t1 = _epoch(dst, files, tmp_path / "local", budget, ids)
    held = set(np.flatnonzero(t1.held).tolist())
    assert s1["backend_samples"] == n  # (a read-ahead dropped before use may come back local)
    assert 0 < t1.used <= budget and _disk_bytes(tmp_path / "local") == t1.used
    assert budget - t1.used < sizes.max()  # filled up to the last sample that fit
    # a remount finds the tier warm: those samples never reach the backend again
    ids2 = list(np.random.default_rng(1).permutation(n))
    s2, t2 = _epoch(dst, files, tmp_path / "local", budget, ids2)
    assert t2.warm_samples == len(held)
    assert s2["local_hits"] == len(held) and s2["backend_samples"] == n - len(held)
    assert set(np.flatnonzero(t2.held).tolist()) == held  # no churn without importance
    assert s2["local"]["rejected"] == n - len(held)


def test_importance_decides_what_stays(three_nodes, tmp_path):
    dst, files = three_nodes
    sizes = Index.load(os.path.join(dst, INDEX_NAME)).size
    n, budget = len(sizes), int(sizes.sum() // 3)
    rng = np.random.default_rng(2)
    ids = rng.permutation(n)
    imp = rng.uniform(0, 1, n).astype(np.float32)
    s, tier = _epoch(dst, files, tmp_path / "local", budget, list(ids), importance=imp[ids])
    held = np.flatnonzero(tier.held)
    assert tier.used <= budget and s["local"]["evicted"] > 0  # full, and importance displaced some
    top, bottom = np.argsort(-imp)[:n // 4], np.argsort(imp)[:n // 4]
    assert np.isin(top, held).mean() > 0.6 > 0.2 > np.isin(bottom, held).mean()
    # the next epoch reads every held sample locally unless a more important one fetched
    # first displaced it (timing: a load-dependent race, hence the sum), and ends holding
    # at least as much importance
    s2, tier2 = _epoch(dst, files, tmp_path / "local", budget, list(ids), importance=imp[ids])
    assert s2["local_hits"] <= len(held) <= s2["local_hits"] + s2["local"]["evicted"]
    assert imp[np.flatnonzero(tier2.held)].sum() >= imp[held].sum()


def test_damaged_files_are_refetched_and_rewritten(three_nodes, tmp_path, caplog):
    dst, files = three_nodes
    sizes = Index.load(os.path.join(dst, INDEX_NAME)).size
    n = len(sizes)
    folder = tmp_path / "local"
    _, tier = _epoch(dst, files, folder, int(sizes.sum()), list(range(n)))
    assert np.count_nonzero(tier.held) == n
    flipped, torn, foreign = 3, 7, 11
    with open(tier.path(flipped), "r+b") as f:  # same size, one byte changed
        b = f.read(1)
        f.seek(0)
        f.write(bytes([b[0] ^ 0xFF]))
    with open(tier.path(torn), "r+b") as f:  # a crash while writing
        f.truncate(sizes[torn] // 2)
    with open(tier.path(foreign), "wb") as f:  # another dataset's sample 11, same size
        f.write(os.urandom(int(sizes[foreign])))
    open(os.path.join(folder, "tmp", "5.123"), "wb").write(b"half a write")
    s, tier = _epoch(dst, files, folder, int(sizes.sum()), list(range(n)))  # bytes checked
    assert s["local"]["corrupt"] == 3 and s["backend_samples"] == 3
    assert s["local_hits"] == n - 3 and s["eio"] == 0
    assert "checksum mismatch" in caplog.text
    assert os.listdir(os.path.join(folder, "tmp")) == []
    index = Index.load(os.path.join(dst, INDEX_NAME))
    for sid in (flipped, torn, foreign):  # written again, whole
        with open(tier.path(sid), "rb") as f:
            assert f.read() == files[os.fsdecode(index.file_path(sid))]


def test_one_folder_one_mount(three_nodes, tmp_path):
    dst, _ = three_nodes
    first = _tier(dst, tmp_path / "local", 1 << 20)
    try:
        with pytest.raises(LocalTierError, match=f"in use by another fusefs mount \\(pid {os.getpid()}\\)"):
            _tier(dst, tmp_path / "local", 1 << 20)
    finally:
        first.close()
    _tier(dst, tmp_path / "local", 1 << 20).close()  # free again once closed


def test_a_smaller_budget_trims_at_start(three_nodes, tmp_path):
    dst, files = three_nodes
    sizes = Index.load(os.path.join(dst, INDEX_NAME)).size
    _epoch(dst, files, tmp_path / "local", int(sizes.sum()), list(range(len(sizes))))
    small = _tier(dst, tmp_path / "local", int(sizes.sum() // 4))
    try:
        assert small.used <= small.budget and _disk_bytes(tmp_path / "local") == small.used
    finally:
        small.close()


def test_mount_with_local_tier_survives_a_remount(three_nodes, tmp_path):
    dst, files = three_nodes
    mnt, folder = tmp_path / "mnt", tmp_path / "local"
    mnt.mkdir()
    args = ("--local-cache", str(folder), "--local-cache-size", "100%")

    def read_all():
        for rel, blob in files.items():
            with open(mnt / rel, "rb") as f:
                assert f.read() == blob

    with running_mount(dst, mnt, *args):
        read_all()
        first = mount_stats(mnt)
        # a second mount of the same DIR is refused, with the reason
        other = tmp_path / "mnt2"
        other.mkdir()
        r = refused_mount(dst, other, "--local-cache", folder, mnt=other)
        assert r.returncode == 2 and "in use by another fusefs mount" in r.stderr
        assert not os.path.ismount(other)
    with running_mount(dst, mnt, *args):
        read_all()
        second = mount_stats(mnt)
    assert first["backend_samples"] == len(files) and first["local_hits"] == 0
    assert second["local"]["warm_samples"] == len(files)
    assert second["local_hits"] == len(files) and second["backend_samples"] == 0
