"""Order modes (issue 5): chunk-block orders and data echoing, as pure orders, through the
core (what the backend sees) and through a real mount (HintedSampler modes)."""
import os

import numpy as np
import pytest
import trio

from testkit.mounts import running_mount
from trainer import HintedSampler, chunk_block_order, echo_order, mount_chunks
from trainer.orders import echo_fresh

from conftest import make_core
from conftest import exact_within_budget, run_epoch


def _groups(order, chunk_of, group):
    """Check the chunk-block property; return the number of groups."""
    chunk_of = np.asarray(chunk_of)
    seq = chunk_of[order]
    _, first = np.unique(seq, return_index=True)
    shuffled = seq[np.sort(first)]  # chunks by first appearance: the shuffled chunk list
    pos = 0
    for k in range(0, len(shuffled), group):
        members = np.flatnonzero(np.isin(chunk_of, shuffled[k:k + group]))
        assert set(order[pos:pos + len(members)].tolist()) == set(members.tolist())
        pos += len(members)
    assert pos == len(order)
    return -(-len(shuffled) // group)


@pytest.mark.parametrize("group", [1, 4, 16, 1000])
def test_chunk_block_orders_are_permutations_with_the_stated_locality(group):
    rng = np.random.default_rng(0)
    chunk_of = np.sort(rng.integers(0, 40, 900))  # 40 chunks of uneven sizes, ids in chunk order
    order = chunk_block_order(chunk_of, group, np.random.default_rng(1))
    assert sorted(order.tolist()) == list(range(900))
    assert _groups(order, chunk_of, group) == -(-40 // group)
    # shuffled within groups, and another epoch draws another order
    assert order.tolist() != sorted(order.tolist())
    assert chunk_block_order(chunk_of, group, np.random.default_rng(2)).tolist() != order.tolist()
    # chunk changes along the order: G=1 changes only between chunks
    changes = int(np.count_nonzero(np.diff(chunk_of[order])))
    if group == 1:
        assert changes == 39
    else:
        assert changes > 39
    with pytest.raises(ValueError):
        chunk_block_order(chunk_of, 0, rng)


@pytest.mark.parametrize("n,batch", [(1000, 64), (37, 8), (5, 64)])
def test_echo_orders_repeat_each_fresh_sample_once_a_batch_later(n, batch):
    h = batch // 2
    for epoch in (0, 1):
        order = echo_order(n, batch, epoch, seed=3)
        fresh = echo_fresh(n, epoch, 3)
        ids, counts = np.unique(order, return_counts=True)
        assert set(ids.tolist()) == set(fresh.tolist()) and (counts == 2).all()
        first = {}
        for p, s in enumerate(order.tolist()):
            if s in first:  # the echo: after its fresh read, at most two batches later
                assert first[s] < p <= first[s] + 4 * h
            else:
                first[s] = p
        # every batch past the first: half fresh, half echoes
        for b in range(1, len(order) // batch - 1):
            part = order[b * batch:(b + 1) * batch].tolist()
            fresh_here = sum(first[s] >= b * batch for s in part)
            assert fresh_here == h
    # two epochs in a row read every sample fresh exactly once
    both = np.concatenate([echo_fresh(n, 0, 3), echo_fresh(n, 1, 3)])
    assert sorted(both.tolist()) == list(range(n))


def test_chunk_order_reads_chunks_in_few_large_requests(three_nodes):
    dst, files = three_nodes
    probe = make_core(dst)
    n, chunk_of = probe.index.n_files, probe.index.chunk
    budget = int(probe.index.size.sum() // 10)
    out = {}
    for name, ids in (("random", np.random.default_rng(0).permutation(n)),
                      ("chunks", chunk_block_order(chunk_of, 1, np.random.default_rng(0)))):
        core = make_core(dst, cache_bytes=budget)
        trio.run(run_epoch, core, ids.tolist(), 3, 8, 0, exact_within_budget(core, files))
        out[name] = core.statistics()
    assert out["chunks"]["backend_samples"] == out["random"]["backend_samples"] == n
    assert out["chunks"]["backend_reads"] * 3 <= out["random"]["backend_reads"]
    assert out["chunks"]["backend_reads"] <= len(probe.index.chunks) * 3  # a chunk: 1-3 reads


def test_echoed_samples_come_from_the_cache_once(three_nodes):
    dst, files = three_nodes
    probe = make_core(dst)
    n, sizes = probe.index.n_files, probe.index.size
    order = echo_order(n, 16, 0, seed=0)
    core = make_core(dst, cache_bytes=int(sizes.max() * 40))  # a few batches' worth
    trio.run(run_epoch, core, order.tolist(), 3, 8, 0, exact_within_budget(core, files))
    s = core.statistics()
    assert s["backend_samples"] == len(set(order.tolist())) == len(order) // 2
    assert s["eio"] == 0  # each kept past its echo only while no order needs the room
    assert all(key == float("inf") for key in core.cache._dump()[1].values())


def test_sampler_modes_through_a_mount(three_nodes, tmp_path):
    dst, files = three_nodes
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    paths = sorted(str(mnt / rel) for rel in files)
    with running_mount(dst, mnt):
        probe = make_core(dst)
        assert np.array_equal(mount_chunks(str(mnt)), probe.index.chunk)
        assert ".fusefs" not in os.listdir(mnt)
        s = HintedSampler(paths, mode="chunks", group=2, seed=1)
        for epoch in (0, 1):
            s.set_epoch(epoch)
            idx = list(s)
            assert sorted(idx) == list(range(len(paths))) and len(s) == len(paths)
            _groups(np.array(idx), s.chunk_of, 2)
            with open(mnt / ".fusefs" / "order", "rb") as f:
                from fusefs import order as orderfmt
                written = orderfmt.parse(f.read(), probe.index.n_files).ids
            assert np.array_equal(written, s.ids[idx])
        e = HintedSampler(paths, mode="echo", batch_size=8, num_replicas=2, rank=1)
        e.set_epoch(3)
        assert len(list(e)) == len(e)
        with pytest.raises(ValueError, match="batch_size"):
            HintedSampler(paths, mode="echo")
    with pytest.raises(ValueError, match="chunk layout"):
        HintedSampler(paths, mode="chunks", write=False)
    assert list(HintedSampler(paths, mode="chunks", chunks=np.arange(len(paths)) // 10,
                              write=False)) != list(range(len(paths)))
