"""Importance-aware epochs (issue 4): the loss tracker, the variance/KMeans split, the
ImportanceSampler's selection and state, and the mount's pinned (static) cache share."""
import json
import os
import random
import time

import numpy as np
import pytest
import torch
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from fusefs import order as orderfmt
from testkit.mounts import running_mount
from trainer import ImportanceSampler, LossTracker, WithIndex, reevaluate
from trainer.hints import mount_stats

from conftest import make_core
from conftest import exact_within_budget, run_epoch


class Paths(list):
    """A dataset that is just its file paths (what the samplers look at)."""


def _sampler(n=100, keep=0.7, explore=0.0, warmup=3):
    tracker = LossTracker(n, window=warmup)
    s = ImportanceSampler(Paths(f"/x/{i}" for i in range(n)), tracker, keep=keep,
                          explore=explore, warmup=warmup, write=False)
    return s, tracker


def _warm(s, tracker, losses_per_epoch):
    for e, losses in enumerate(losses_per_epoch):
        s.set_epoch(e)
        assert sorted(s) == list(range(s.n))  # warm-up: every sample, shuffled
        tracker.record(np.arange(s.n), losses)
        tracker.end_epoch()


def test_tracker_takes_tensors_without_waiting_and_fits_in_tens_of_mb():
    t = LossTracker(10, collect_every=1000)
    t.record(torch.tensor([3, 1]), torch.tensor([0.5, 0.25]))
    assert np.isnan(t.last[3])  # still pending: no copy in the training step
    t.end_epoch()
    assert t.last[3] == 0.5 and t.last[1] == 0.25 and t.history[0, 3] == 0.5
    big = LossTracker(1_280_000)
    assert big.last.nbytes + big.history.nbytes <= 25 << 20


def test_selection_keeps_the_most_important_share_shuffled():
    s, tracker = _sampler(n=100, keep=0.7)
    rng = np.random.default_rng(1)
    _warm(s, tracker, [rng.uniform(0, 1, 100) for _ in range(3)])
    s.set_epoch(3)
    assert s.reevaluation() == np.flatnonzero(s.fluctuating).tolist()
    last = tracker.last.copy()
    idx = list(s)
    assert len(idx) == len(s) == 70
    assert set(idx) == set(np.argsort(-last)[:70].tolist())  # the 70 highest losses
    assert idx != sorted(idx, key=lambda i: -last[i])  # shuffled, not in importance order
    s2, tr2 = _sampler(n=100, keep=lambda epoch: 0.5, explore=0.2)
    _warm(s2, tr2, [rng.uniform(0, 1, 100) for _ in range(3)])
    s2.set_epoch(3)
    idx = list(s2)
    top = set(np.argsort(-tr2.last)[:50].tolist())
    assert len(idx) == 50 + 10 and top <= set(idx) and len(set(idx)) == 60


def test_reevaluation_order_goes_on_with_a_provisional_training_order(monkeypatch):
    """The order written with the re-evaluation: the fluctuating samples first, then the
    selection by the importance known before their re-evaluation, with importance values;
    the final order keeps the provisional one's relative order for the samples both hold."""
    import trainer.importance as imp_mod
    written = []
    monkeypatch.setattr(imp_mod, "write_order",
                        lambda mount, ids, importance=None, epoch=0, rank=0:
                        written.append((np.asarray(ids), importance)))
    s, tracker = _sampler(n=200, keep=0.6)
    s.write, s.ids = True, np.arange(200) + 1000  # as if on a mount (ids: the mount's)
    rng = np.random.default_rng(2)
    _warm(s, tracker, [rng.uniform(0, 1, 200) for _ in range(3)])
    written.clear()
    s.set_epoch(3)
    todo = s.reevaluation()
    ids, importance = written[-1]
    assert ids[:len(todo)].tolist() == [1000 + i for i in todo] and len(todo) > 0
    provisional = (ids[len(todo):] - 1000).tolist()
    assert set(provisional) == set(np.argsort(-tracker.last)[:120].tolist())
    assert importance is not None and np.all(np.isfinite(importance))
    np.testing.assert_allclose(importance[len(todo):], tracker.last[provisional])
    tracker.record(np.array(todo), rng.uniform(0, 1, len(todo)))  # re-evaluated
    final = list(s)
    common = set(final) & set(provisional)
    assert len(common) >= 120 - len(todo)
    assert [i for i in final if i in common] == [i for i in provisional if i in common]


def test_stable_importance_follows_the_training_losses():
    s, tracker = _sampler(n=10, keep=0.3)
    _warm(s, tracker, [np.linspace(0, 1, 10)] * 3)
    s.set_epoch(3)
    tracker.record(torch.tensor([0]), torch.tensor([9.0]))  # sample 0 got hard in training
    assert 0 in list(s)


def test_sampler_state_round_trips():
    s, tracker = _sampler(n=200)
    rng = np.random.default_rng(2)
    _warm(s, tracker, [rng.uniform(0, 1, 200) for _ in range(3)])
    s.set_epoch(3)
    first = list(s)
    state = s.state_dict()
    s2, _ = _sampler(n=200)
    s2.load_state_dict(state)
    assert np.array_equal(s2.fluctuating, s.fluctuating) and s2.split_epoch == 3
    assert np.array_equal(s2.tracker.history, tracker.history, equal_nan=True)
    assert list(s2) == first
    with pytest.raises(ValueError):
        _sampler(n=10)[0].load_state_dict(state)


def test_reevaluate_records_losses_of_the_named_samples():
    xs = torch.arange(8, dtype=torch.float32).reshape(8, 1)
    ds = [(xs[i], torch.tensor(0.0)) for i in range(8)]
    model = torch.nn.Linear(1, 1)
    torch.nn.init.ones_(model.weight), torch.nn.init.zeros_(model.bias)
    tracker = LossTracker(8)
    done = reevaluate(model, WithIndex(ds), [2, 5], lambda out, y: (out.squeeze(1) - y) ** 2,
                      tracker, batch_size=1)
    assert done == 2 and tracker.last[2] == 4.0 and tracker.last[5] == 25.0
    assert np.isnan(tracker.last[0]) and model.training


class _Rows(Paths):
    """Paths for the sampler, (x, 0) rows for the loader."""

    def __getitem__(self, i):
        return torch.tensor([float(i)]), torch.tensor(0.0)


def test_one_persistent_loader_reevaluates_each_epochs_set():
    n = 40
    ds = _Rows(f"/x/{i}" for i in range(n))
    tracker = LossTracker(n)
    s = ImportanceSampler(ds, tracker, keep=0.5, warmup=2, write=False)
    loader = torch.utils.data.DataLoader(WithIndex(ds), batch_size=8, num_workers=2,
                                         sampler=s.reevaluation_sampler, persistent_workers=True)
    model = torch.nn.Linear(1, 1)
    torch.nn.init.ones_(model.weight), torch.nn.init.zeros_(model.bias)
    square = lambda out, y: (out.squeeze(1) - y) ** 2  # noqa: E731
    rng = np.random.default_rng(3)
    seen = []
    for epoch in range(4):
        s.set_epoch(epoch)
        want = s.reevaluation()
        assert (epoch < 2) == (want == [])
        if epoch == 3:  # a different set in a later epoch reaches the same workers
            s.fluctuating = ~s.fluctuating
            inverted, want = set(want), s.reevaluation()
            assert inverted.isdisjoint(want) and len(inverted) + len(want) == n
        tracker.record(np.arange(n), rng.uniform(0, 1, n))  # training stand-in
        before = tracker.last.copy()
        assert reevaluate(model, loader, want, square, tracker) == len(want)
        changed = np.flatnonzero(tracker.last != before)
        assert set(changed) <= set(want) and all(tracker.last[i] == i * i for i in want)
        seen.append(set(want))
        tracker.end_epoch()
    assert seen[2] and seen[3] and seen[2] != seen[3]


class _Logged(_Rows):
    """_Rows that logs which rows were loaded (single-process loaders only)."""

    def __init__(self, *a):
        super().__init__(*a)
        self.loaded = []

    def __getitem__(self, i):
        self.loaded.append(i)
        return super().__getitem__(i)


def _reuse_setup(n=60, reuse_bytes=512 << 20, keep=0.5):
    ds = _Logged(f"/x/{i}" for i in range(n))
    tracker = LossTracker(n)
    s = ImportanceSampler(ds, tracker, keep=keep, warmup=2, write=False, reuse_bytes=reuse_bytes)
    loader = torch.utils.data.DataLoader(WithIndex(ds), batch_size=8, sampler=s)
    reloader = torch.utils.data.DataLoader(WithIndex(ds), batch_size=8,
                                           sampler=s.reevaluation_sampler)
    model = torch.nn.Linear(1, 1)
    torch.nn.init.ones_(model.weight), torch.nn.init.zeros_(model.bias)
    rng = np.random.default_rng(6)
    for epoch in range(2):  # warm-up: losses made up, and made to fluctuate for some
        s.set_epoch(epoch)
        loss = rng.uniform(0, 1, n)
        loss[::3] = 5.0 * (epoch % 2)
        tracker.record(np.arange(n), loss)
        tracker.end_epoch()
    s.set_epoch(2)
    return s, ds, loader, reloader, model


def test_reevaluated_samples_are_trained_from_memory_not_read_again():
    """sampler.batches(loader): the held re-evaluated samples chosen for training come
    first (their own rows, in the selection's order), then the loader's batches, which
    leave them out; together every chosen sample once."""
    s, ds, loader, reloader, model = _reuse_setup()
    square = lambda out, y: (out.squeeze(1) - y) ** 2  # noqa: E731
    n_re = s.reevaluate(model, reloader, square)
    todo = s._reevaluating
    assert n_re == len(todo) > 0 and sorted(ds.loaded) == sorted(todo)
    assert all(s.tracker.last[i] == i * i for i in todo)  # the re-evaluation's losses
    ds.loaded.clear()
    got = [(x, idx) for x, _, idx in s.batches(loader)]
    rows = torch.cat([idx for _, idx in got]).tolist()
    xs = torch.cat([x for x, _ in got]).squeeze(1).tolist()
    assert xs == [float(i) for i in rows]  # each row's own data
    chosen = set(np.argsort(-s.importance(), kind="stable")[:30].tolist())
    assert sorted(rows) == sorted(chosen)  # every chosen sample, once
    reused = set(chosen) & set(todo)
    assert s.reused == len(reused) > 0
    assert set(rows[:len(reused)]) == reused  # first, from memory
    assert reused.isdisjoint(ds.loaded) and sorted(ds.loaded) == sorted(chosen - reused)
    assert len(got[0][1]) == 8  # held rows are re-batched at the loader's size


def test_a_small_reuse_budget_holds_whole_batches_and_reads_the_rest():
    # batches of 8, 8, 4 rows (x and y 32 B, idx 64 B at 8 rows): the first fits, the
    # second does not, and the third, which would, is not kept either
    s, ds, loader, reloader, model = _reuse_setup(reuse_bytes=128 + 64)
    s.reevaluate(model, reloader, lambda out, y: (out.squeeze(1) - y) ** 2)
    assert len(s._held) == 8
    ds.loaded.clear()
    rows = [i for _, _, idx in s.batches(loader) for i in idx.tolist()]
    assert len(rows) == len(set(rows)) == 30 and len(ds.loaded) == 30 - s.reused


def test_iterating_the_loader_itself_reads_every_chosen_sample():
    s, ds, loader, reloader, model = _reuse_setup()
    s.reevaluate(model, reloader, lambda out, y: (out.squeeze(1) - y) ** 2)
    ds.loaded.clear()
    rows = [i for _, _, idx in loader for i in idx.tolist()]
    assert len(rows) == 30 and sorted(ds.loaded) == sorted(rows) and s.reused == 0


def test_held_reevaluation_leaves_its_samples_out_of_the_provisional_order(monkeypatch):
    import trainer.importance as imp_mod
    written = []
    monkeypatch.setattr(imp_mod, "write_order",
                        lambda mount, ids, importance=None, epoch=0, rank=0: written.append(np.asarray(ids)))
    s, *_ = _reuse_setup()
    s.write, s.ids = True, np.arange(60)
    todo = s.reevaluation(held=True)
    assert written[-1][:len(todo)].tolist() == todo
    assert set(written[-1][len(todo):].tolist()) == set(s.select(s.importance()).tolist()) - set(todo)


# ---- the mount's side ---------------------------------------------------------------
def test_pinned_samples_survive_epochs_and_serve_the_next_one(three_nodes):
    dst, files = three_nodes
    probe = make_core(dst)
    n, sizes = probe.index.n_files, probe.index.size
    budget = int(sizes.sum() * 0.2)
    core = make_core(dst, cache_bytes=budget, static_bytes=int(budget * 0.5), batch=8)
    importance = np.random.default_rng(3).uniform(0, 1, n).astype(np.float32)
    for epoch in range(2):
        ids = np.random.default_rng(epoch).permutation(n)
        before = core.statistics()["backend_samples"]
        order = orderfmt.encode(ids, epoch=epoch, importance=importance[ids])
        trio.run(run_epoch, core, ids.tolist(), 3, 8, epoch, None, order)
        s = core.statistics()
        assert s["cache_peak"] <= budget and s["eio"] == 0
        pinned = sorted(core.cache.pin_set)
        # the pins are the highest-importance samples that fit in the static share
        ranked = np.argsort(-importance)
        fit = np.cumsum(core.cache.cost(sizes[ranked].astype(np.int64))) <= core.cache.static
        assert pinned == sorted(ranked[:int(np.argmin(fit))].tolist())
        assert all(sid in core.cache for sid in pinned)  # kept after their last use
        assert s["pinned_bytes"] <= core.cache.static
        fetched = s["backend_samples"] - before
        # pinned: no refetch (and samples kept because room was not needed: fewer still)
        assert fetched == n if epoch == 0 else fetched <= n - len(pinned), s


@given(data=st.data())
@settings(max_examples=20, deadline=None)
def test_budget_never_exceeded_with_pins(three_nodes, data):
    dst, files = three_nodes
    probe = make_core(dst)
    n, sizes = probe.index.n_files, probe.index.size
    budget = data.draw(st.integers(int(sizes.max()), int(sizes.sum())))
    static = data.draw(st.integers(0, budget))
    core = make_core(dst, cache_bytes=budget, static_bytes=static, batch=data.draw(st.integers(1, 16)))
    check = exact_within_budget(core, files)
    for epoch in range(2):
        ids = data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=300))
        imp = data.draw(st.lists(st.floats(0, 10), min_size=len(ids), max_size=len(ids)))
        order = orderfmt.encode(ids, epoch=epoch, importance=imp)
        trio.run(run_epoch, core, ids, 3, 8, epoch, check, order)
        assert core.cache.peak <= budget and core.cache.pinned_bytes <= static


def test_an_order_without_importance_behaves_as_before(three_nodes):
    dst, _ = three_nodes
    probe = make_core(dst)
    budget = int(probe.index.total_bytes * 0.1)
    ids = np.random.default_rng(4).permutation(probe.index.n_files).tolist()
    # (hits against read waits depends on thread timing, so their sum is compared)
    keys = ("backend_samples", "evictions", "cache_bytes", "served", "pins_picked")
    results = []
    for static in (0, budget // 2):
        core = make_core(dst, cache_bytes=budget, static_bytes=static, batch=8)
        for epoch in range(2):
            trio.run(run_epoch, core, ids, 1, 1, epoch, None, orderfmt.encode(ids, epoch=epoch))
        s = core.statistics()
        s["served"] = s["hits"] + s["read_waits"] + s["misses"]
        assert s["pinned_samples"] == 0
        results.append({k: s[k] for k in keys})
    assert results[0] == results[1]


def test_the_fluctuating_samples_are_fetched_first_through_a_mount(tricky, tmp_path):
    """The re-evaluation order is written before training: the mount fetches those samples
    first (statistics: ready in a row), pins the most important samples, and keeps the
    re-evaluated samples that training then reads: each sample is fetched once."""
    src, dst, files = tricky
    mnt = str(tmp_path / "mnt")
    with running_mount(dst, mnt, "--cache-size", "200%", "--static-cache", "30%"):
        paths = sorted(os.path.join(mnt, k) for k, v in files.items() if not k.endswith("/") and v)
        tracker = LossTracker(len(paths))
        sampler = ImportanceSampler(Paths(paths), tracker, keep=0.5)
        rng = np.random.default_rng(5)
        for epoch in range(3):  # a warm-up without reads (or orders): losses made up
            sampler.set_epoch(epoch)
            tracker.record(np.arange(len(paths)), rng.uniform(0, 1, len(paths)))
            tracker.end_epoch()
        stats = lambda: mount_stats(mnt)  # noqa: E731
        assert stats()["backend_samples"] == 0
        sampler.set_epoch(3)
        todo = sampler.reevaluation()
        assert 0 < len(todo) < len(paths)
        deadline = time.time() + 10
        while stats()["plans"]["0"]["ready_in_a_row"] < len(todo) and time.time() < deadline:
            time.sleep(0.05)
        s = stats()
        plan = s["plans"]["0"]
        # the re-evaluation set first, then the provisional training order (importance)
        assert plan["ready_in_a_row"] >= len(todo)
        assert plan["length"] == len(todo) + round(len(paths) * 0.5) and plan["importance"]
        assert s["pins_picked"] > 0 and s["cache_static"] > 0
        for i in todo:  # the re-evaluation pass: every read a hit
            with open(paths[i], "rb") as f:
                f.read()
        assert stats()["misses"] == s["misses"]
        idx = list(sampler)
        for i in idx:  # the training epoch
            with open(paths[i], "rb") as f:
                f.read()
        s = stats()
        assert s["plans"]["0"]["importance"] and s["plans"]["0"]["length"] == len(idx)
        # a re-evaluated sample that training reads again was kept, not fetched twice
        assert set(todo) & set(idx)
        assert s["backend_samples"] == len(set(todo) | set(idx)), s


class _FileRows(Paths):
    """Paths that load as (file length, i): a real read of the file through the mount."""

    def __getitem__(self, i):
        with open(list.__getitem__(self, i), "rb") as f:
            return torch.tensor([float(len(f.read()))]), torch.tensor(i)


def test_held_reevaluation_through_a_mount_reads_each_sample_once(tricky, tmp_path):
    """sampler.reevaluate + sampler.batches with DataLoader worker processes on a mount:
    the re-evaluated samples are fetched and read once (training takes them from memory),
    the training order written leaves them out, and every chosen sample is trained."""
    src, dst, files = tricky
    mnt = str(tmp_path / "mnt")
    with running_mount(dst, mnt, "--cache-size", "50%", "--static-cache", "30%"):
        names = sorted(k for k, v in files.items() if not k.endswith("/") and v)
        ds = _FileRows(os.path.join(mnt, k) for k in names)
        tracker = LossTracker(len(ds))
        sampler = ImportanceSampler(ds, tracker, keep=0.5)
        rng = np.random.default_rng(8)
        for epoch in range(3):  # a warm-up without reads: losses made up, a third fluctuating
            sampler.set_epoch(epoch)
            loss = rng.uniform(0, 1, len(ds))
            loss[::3] = 3.0 * ((epoch + 1) % 2) * rng.uniform(0, 1, len(loss[::3]))
            tracker.record(np.arange(len(ds)), loss)
            tracker.end_epoch()
        loader_args = dict(batch_size=4, num_workers=2, persistent_workers=True)
        loader = torch.utils.data.DataLoader(WithIndex(ds), sampler=sampler, **loader_args)
        reloader = torch.utils.data.DataLoader(WithIndex(ds), sampler=sampler.reevaluation_sampler,
                                               **loader_args)
        sampler.set_epoch(3)
        # re-evaluated losses as known before: the selection stays the provisional one
        same = lambda out, y: torch.from_numpy(tracker.last[y.numpy()].copy())  # noqa: E731
        n_re = sampler.reevaluate(torch.nn.Identity(), reloader, same)
        todo = set(sampler._reevaluating)
        s = mount_stats(mnt)
        assert n_re == len(todo) > 0
        rows, sizes = [], {}
        for x, _, idx in sampler.batches(loader):
            rows += idx.tolist()
            sizes.update(zip(idx.tolist(), x.squeeze(1).tolist()))
        s2 = mount_stats(mnt)
        chosen = set(rows)
        assert len(rows) == len(chosen) == round(0.5 * len(ds))
        assert all(sizes[i] == len(files[names[i]]) for i in rows)  # each row its own file
        assert 0 < sampler.reused == len(todo & chosen) < len(todo)
        assert s2["plans"]["0"]["length"] == len(chosen) - sampler.reused  # held: not in the order
        assert s2["backend_samples"] == len(todo | chosen), s2
        assert s2["opens"] - s["opens"] == len(chosen - todo)  # training opened only those


def test_random_sampler_state_is_independent_of_global_rng():
    s, tracker = _sampler(n=50)
    _warm(s, tracker, [np.arange(50, dtype=float)] * 3)
    s.set_epoch(3)
    random.seed(0), np.random.seed(0), torch.manual_seed(0)
    a = list(s)
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    assert list(s) == a


def test_importance_training_through_a_mount_with_torchvision(tmp_path):
    """scripts/workloads/train_importance.py under Debian's Python (torchvision ImageFolder +
    DataLoader with 2 worker processes) trains through a mount: after the 3 warm-up
    epochs it trains on 70% of the samples, and the mount fetches fewer bytes; with the mount's
    pages evicted before each epoch, its rows count the samples found dropped."""
    import subprocess
    from conftest import REPO
    from fusefs.pack import pack
    from testkit.synth import make_digits
    make_digits(str(tmp_path / "digits"))
    pack(str(tmp_path / "digits" / "train"), str(tmp_path / "packed"), chunk_count=64, progress=False)
    mnt = str(tmp_path / "mnt")
    with running_mount(str(tmp_path / "packed"), mnt, "--cache-size", "20%", "--static-cache", "30%"):
        r = subprocess.run(["/usr/bin/python3", os.path.join(REPO, "scripts", "workloads", "train_importance.py"),
                            mnt, str(tmp_path / "digits" / "test"), "--mode", "importance",
                            "--epochs", "4", "--keep", "0.7", "--evict", mnt],
                           capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=REPO),
                           timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        from trainer import mount_stats
        dropped = mount_stats(mnt)["kernel_dropped"]  # (nothing was pushed before epoch 0)
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    n = rows[0]["trained"]
    assert [row["trained"] for row in rows] == [n, n, n, round(0.7 * n)]
    assert rows[-1]["test_acc"] > 0.5  # it learned
    # the first epoch fetches every sample (at least once: a 20% cache refetches some);
    # the last, training 70% of them, fetches fewer bytes
    from fusefs.index import INDEX_NAME, Index
    total = int(Index.load(str(tmp_path / "packed" / INDEX_NAME)).size.sum())
    assert rows[0]["backend_bytes"] >= total
    assert rows[-1]["backend_bytes"] < 0.9 * rows[0]["backend_bytes"]
    # the mount's files leave the page cache before each epoch (--evict: fadvise DONTNEED,
    # the inodes stay): pushed samples read again are found dropped; each row's
    # kernel_dropped is its epoch's share of the mount's count
    assert rows[0]["kernel_dropped"] == 0 and all(row["kernel_dropped"] > 0 for row in rows[1:])
    assert sum(row["kernel_dropped"] for row in rows) == dropped

    # The same script on the plain folder (no mount): training alone, no hints, no stats.
    r = subprocess.run(["/usr/bin/python3", os.path.join(REPO, "scripts", "workloads", "train_importance.py"),
                        str(tmp_path / "digits" / "train"), str(tmp_path / "digits" / "test"),
                        "--mode", "full", "--epochs", "1"],
                       capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=REPO),
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    row = json.loads(r.stdout.splitlines()[0])
    assert row["trained"] == n and "backend_bytes" not in row and "kernel_dropped" not in row


def _unbiased(n, prune=0.5, epochs=None, warmup=3):
    tracker = LossTracker(n, window=warmup)
    s = ImportanceSampler(Paths(f"/x/{i}" for i in range(n)), tracker, mode="unbiased",
                          prune=prune, epochs=epochs, warmup=warmup, write=False)
    return s, tracker


def test_unbiased_epochs_drop_well_learned_samples_at_random_and_weight_the_rest():
    """InfoBatch's rule: a sample of loss below the mean is left out with probability
    prune, one kept gets the weight 1 / (1 - prune); the others are all trained on, with
    weight 1. Over epochs, the weighted sum of the kept samples' losses is the full sum in
    expectation (the gradient is unbiased)."""
    n, prune = 4000, 0.5
    s, tracker = _unbiased(n, prune)
    rng = np.random.default_rng(2)
    losses = rng.exponential(1.0, n)
    _warm(s, tracker, [losses for _ in range(3)])
    low = losses < losses.mean()
    sums = []
    for epoch in range(3, 40):
        s.set_epoch(epoch)
        s.reevaluation()
        idx = np.array(list(s))
        assert len(idx) == len(s) and len(set(idx.tolist())) == len(idx)
        kept = np.zeros(n, bool)
        kept[idx] = True
        assert kept[~low].all()  # every hard sample, every epoch
        w = s.weights(idx)
        assert np.all(w[low[idx]] == 2.0) and np.all(w[~low[idx]] == 1.0)
        sums.append(float((w * losses[idx]).sum()))
        if epoch == 3:
            share = 1 - kept[low].mean()
            assert abs(share - prune) < 0.05  # (2,500-odd draws: within a few points)
            t = torch.as_tensor(idx[:5])
            assert torch.equal(s.weights(t), torch.as_tensor(w[:5]))  # a tensor for a tensor
    full = float(losses.sum())
    assert abs(np.mean(sums) - full) < 0.01 * full  # unbiased: the mean over 37 epochs
    assert len(idx) < 0.8 * n  # and the epochs are shorter


def test_unbiased_epochs_anneal_to_full_epochs_at_the_end():
    n = 200
    s, tracker = _unbiased(n, prune=0.5, epochs=16)  # anneal 0.125: the last 2 are full
    rng = np.random.default_rng(3)
    _warm(s, tracker, [rng.exponential(1.0, n) for _ in range(3)])
    sizes = {}
    for epoch in range(3, 16):
        s.set_epoch(epoch)
        s.reevaluation()
        idx = list(s)
        sizes[epoch] = len(idx)
        if epoch >= 14:
            assert sorted(idx) == list(range(n)) and np.all(s.weights(np.array(idx)) == 1.0)
    assert all(sizes[e] < n for e in range(3, 14)) and not s.reevaluation()
    with pytest.raises(ValueError, match="prune"):
        _unbiased(10, prune=1.0)


def test_the_training_workload_runs_unbiased_epochs(tmp_path):
    """train_importance.py --mode unbiased under Debian's Python: full warm-up epochs, then
    shorter weighted epochs, then the annealed last epoch in full; it learns."""
    import subprocess
    from conftest import REPO
    from testkit.synth import make_digits
    make_digits(str(tmp_path / "digits"))
    r = subprocess.run(["/usr/bin/python3", os.path.join(REPO, "scripts", "workloads", "train_importance.py"),
                        str(tmp_path / "digits" / "train"), str(tmp_path / "digits" / "test"),
                        "--mode", "unbiased", "--epochs", "6", "--prune", "0.5", "--workers", "0"],
                       capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=REPO), timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    n = rows[0]["trained"]
    trained = [row["trained"] for row in rows]
    assert trained[:3] == [n] * 3 and all(t < n for t in trained[3:5]) and trained[5] == n
    assert rows[-1]["test_acc"] > 0.5


def test_the_training_workload_weights_each_loss_by_the_unbiased_samplers_weight():
    """train_importance.py's step multiplies each sample's loss by the sampler's weight
    before the mean: the gradient it takes is the weighted one, not the plain mean's (one
    sample of weight 2 and one of weight 0 give the first sample's gradient, doubled, over
    two). Run under Debian's Python (the workload's torchvision)."""
    import subprocess
    from conftest import REPO
    code = """
import sys, torch
from torch import nn
sys.path.insert(0, sys.argv[1])
from train_importance import train_step
from trainer import LossTracker
torch.manual_seed(0)
model = nn.Linear(3, 2)
x, y, idx = torch.randn(2, 3), torch.tensor([0, 1]), torch.tensor([0, 1])
opt = torch.optim.SGD(model.parameters(), lr=0.0)
criterion = nn.CrossEntropyLoss(reduction="none")
train_step(model, opt, criterion, x, y, idx, LossTracker(2), weights=lambda i: torch.tensor([2.0, 0.0]))
got = model.weight.grad.clone()
model.zero_grad()
(2 * criterion(model(x[:1]), y[:1]).sum() / 2).backward()
assert torch.allclose(got, model.weight.grad), (got, model.weight.grad)
train_step(model, opt, criterion, x, y, idx, LossTracker(2))
model2 = nn.Linear(3, 2); model2.load_state_dict(model.state_dict())
criterion(model2(x), y).mean().backward()
assert torch.allclose(model.weight.grad, model2.weight.grad)
print("ok")
"""
    r = subprocess.run(["/usr/bin/python3", "-c", code, os.path.join(REPO, "scripts", "workloads")],
                       capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=REPO), timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]


def test_paths_relative_to_the_working_folder_name_the_mounts_files(tricky, tmp_path, monkeypatch):
    """As HintedSampler: ImageFolder("mnt")'s relative paths are the working folder's."""
    from trainer.hints import mount_ids
    src, dst, files = tricky
    regular = sorted(k for k in files if not k.endswith("/") and files[k])
    with running_mount(dst, tmp_path / "mnt"):
        monkeypatch.chdir(tmp_path)
        s = ImportanceSampler(Paths(os.path.join("mnt", r) for r in regular), LossTracker(len(regular)))
        ids = mount_ids("mnt")
        assert s.write and s.ids.tolist() == [ids[os.fsencode(r)] for r in regular]
