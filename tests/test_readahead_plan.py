"""prefetch.ReadAheadPlan alone: no threads, no trio, no I/O. From an order, the cache and
what is in flight, it queues what to read ahead (its room reserved), hands out batches per
node within their request slots, and moves on as readers use what it read."""
import os
from collections import OrderedDict

import numpy as np
import pytest

from fusefs import order as orderfmt
from fusefs.cache import SampleCache
from fusefs.fetch import InFlight
from fusefs.index import INDEX_NAME, Index
from fusefs.policy import Policy
from fusefs.prefetch import ReadAheadPlan


def _plan(dst, budget_share=0.2, per_node=2, batch=4, kernel=False):
    """kernel: the plan is given the kernel's flags (plan.kernel_held, all False: set them)."""
    ix = Index.load(os.path.join(dst, INDEX_NAME))
    node = np.array([c.node for c in ix.chunks])[ix.chunk]
    policy = Policy(ix.size)
    cache = SampleCache(int(ix.total_bytes * budget_share))
    inflight = InFlight(ix.n_files)
    plan = ReadAheadPlan(ix, policy, cache, nodes=3, chunk_node=np.array([c.node for c in ix.chunks], np.int32),
                         inflight=inflight,
                         per_node=per_node, max_per_node=2 * per_node, batch=batch,
                         kernel_held=np.zeros(ix.n_files, bool) if kernel else None)
    order = np.random.default_rng(0).permutation(ix.n_files)
    policy.set_order(0, orderfmt.parse(orderfmt.encode(order), ix.n_files))
    return ix, node, policy, cache, inflight, plan, order


def test_the_plan_queues_the_order_ahead_within_its_depth_and_reserves_the_room(three_nodes):
    dst, _ = three_nodes
    ix, node, policy, cache, inflight, plan, order = _plan(dst)
    assert plan.advance() is False  # (the whole depth in one go: no step given)
    queued = [s for s in order.tolist() if s in plan.queued]
    assert queued == order[:len(queued)].tolist() and len(queued) > 0  # the order's head, in order
    assert sum(ix.size[queued]) <= plan.readahead + ix.size.max()
    assert cache.reserved == sum(cache.cost(int(ix.size[s])) for s in queued)
    for n, q in enumerate(plan.queues):  # each on its node, in the order's order
        assert list(q) == [s for s in queued if node[s] == n]


def test_batches_fill_each_nodes_slots_and_no_more(three_nodes):
    dst, _ = three_nodes
    ix, node, policy, cache, inflight, plan, order = _plan(dst, budget_share=0.5)
    plan.advance()
    queued_before = set(plan.queued)
    batches = plan.batches([0, 0, 0])
    per_node = {n: [b for m, b in batches if m == n] for n in range(3)}
    for n, bs in per_node.items():
        assert 0 < len(bs) <= plan.max_per_node
        assert all(len(b) <= plan.batch or len({int(ix.chunk[s]) for s in b}) == 1 for b in bs)
        assert all(node[s] == n for b in bs for s in b)
    taken = [s for _, b in batches for s in b]
    assert len(taken) == len(set(taken)) and not set(taken) & set(plan.queued)
    assert set(taken) | set(plan.queued) == set(queued_before)
    assert plan.batches([plan.max_per_node] * 3) == []  # (every slot busy: nothing to start)


def test_readers_using_a_refill_move_the_heads_on_and_the_kernels_samples_are_skipped(three_nodes):
    dst, _ = three_nodes
    ix, node, policy, cache, inflight, plan, order = _plan(dst, kernel=True)
    held = set(range(0, 300, 2))
    plan.kernel_held[list(held)] = True
    plan.reset()  # (what a new order does)
    assert plan.fresh and plan.due()
    assert plan.step() is False and not plan.fresh and not held & set(plan.queued)
    # the readers take what was queued: fetched (settled, cached), read, used
    first = [s for s in order.tolist() if s in plan.queued]
    for _, b in plan.batches([0, 0, 0]):
        for s in b:
            cache.settle(s)
            cache.put(s, bytes(int(ix.size[s])), policy.key(s))
    used = 0
    for s in order.tolist():
        policy.use(s)
        if s in cache:
            cache.rekey(s, policy.key(s))
        used += int(ix.size[s])
        if plan.used(int(ix.size[s])):
            break
    assert used >= plan.low_water and plan.due()
    plan.step()
    assert set(plan.queued) - set(first) and not held & set(plan.queued)


def test_the_plan_is_idle_once_it_has_covered_its_orders_and_not_before(three_nodes):
    """`idle` (which lets the fast path hold the readers' uses back longer) is set only by an
    advance that covered every order to its end: not while the depth or the budget stops
    it, not after a new order or a rewind until an advance covers it again."""
    dst, _ = three_nodes
    ix, node, policy, cache, inflight, plan, order = _plan(dst)
    assert plan.advance() is False and not plan.idle  # stopped at its depth
    ix, node, policy, cache, inflight, plan, order = _plan(dst, kernel=True)
    plan.kernel_held[order[:-1]] = True  # the kernel holds all but the order's last sample,
    # which is further ahead of the readers than the depth: the readers' progress lets it in
    assert plan.advance() is False and not plan.idle and not plan.queued
    plan.kernel_held[order[-1]] = True
    plan.rewind()
    assert plan.advance() is False and plan.idle  # nothing left to fetch
    assert plan.step() is False and plan.idle
    plan.reset()  # (a new order)
    assert not plan.idle and plan.advance() is False and plan.idle
    plan.rewind()  # (the kernel dropped pages)
    assert not plan.idle
    # the budget stops it: nothing it holds is needed later than the head's sample
    ix, node, policy, cache, inflight, plan, order = _plan(dst, budget_share=0.01)
    plan.readahead = int(ix.total_bytes)
    assert plan.advance() is False and not plan.idle and cache.free < int(ix.size.max())
    policy.plans.clear()  # no order at all: nothing to fetch
    plan.reset()
    assert plan.advance() is False and plan.idle


def test_near_the_end_of_an_epoch_the_read_ahead_goes_on_into_the_next_epochs_order(three_nodes):
    """An order that carries the next epoch's (HintedSampler's): the read-ahead does not stop
    at the end of this epoch's order but walks the next one, in its order."""
    dst, _ = three_nodes
    ix, node, policy, cache, inflight, plan, _ = _plan(dst, budget_share=0.5)
    order = np.random.default_rng(1).permutation(ix.n_files)
    head, rest = order[:5], order[5:]
    data = orderfmt.encode(head, epoch=0, next_follows=True) + orderfmt.encode(rest, epoch=1)
    policy.set_order(0, orderfmt.parse(data, ix.n_files))
    plan.reset()
    plan.advance()
    queued = [s for s in order.tolist() if s in plan.queued]
    assert set(head.tolist()) <= set(queued)
    from_next = [s for s in queued if s not in set(head.tolist())]
    assert from_next and from_next == rest[:len(from_next)].tolist()  # the next order's head, in order


class PyQueues:
    """The read-ahead's queues in Python (an OrderedDict a node), as they were before
    fusefs._plancore.Queues: the reference the C queues are held to."""

    def __init__(self, chunk, chunk_node, size, nodes):
        self.chunk, self.chunk_node, self.size = chunk, chunk_node, size
        self.q = [OrderedDict() for _ in range(nodes)]
        self.node = {}

    def push_many(self, sids, count):
        for sid in sids[:count]:
            if sid not in self.node:
                n = int(self.chunk_node[self.chunk[sid]])
                self.q[n][sid] = None
                self.node[sid] = n

    def remove(self, sid):
        n = self.node.pop(sid, -1)
        if n >= 0:
            del self.q[n][sid]
        return n

    def take(self, n, count, last):
        out = []
        for _ in range(min(count, len(self.q[n]))):
            sid = self.q[n].popitem(last=last)[0]
            del self.node[sid]
            out.append(sid)
        return out

    def deal(self, n, want, batches, max_bytes):
        runs, run, taken, nbytes = [], [], 0, 0
        for sid in self.q[n]:
            if run and (self.chunk[sid] != self.chunk[run[-1]] or nbytes + self.size[sid] > max_bytes):
                runs.append(run)
                taken += len(run)
                run, nbytes = [], 0
                if taken >= want:
                    break
            run.append(sid)
            nbytes += int(self.size[sid])
        else:
            if run:
                runs.append(run)
        out = [[] for _ in range(min(batches, len(runs)))]
        for i, r in enumerate(runs):
            out[i % len(out)] += r
        for b in out:
            for sid in b:
                self.remove(sid)
        return out


def test_the_queues_in_c_do_what_the_queues_in_python_did():
    """fusefs._plancore.Queues against PyQueues over random pushes, removals, takes from
    either end and deals (random wants, batch counts and byte bounds, runs of one chunk):
    the same results, the same queues, the same flags."""
    from fusefs._plancore import Queues
    rng = np.random.default_rng(88)
    dealt_runs = 0
    for trial in range(200):
        n, nodes = int(rng.integers(1, 60)), int(rng.integers(1, 4))
        nchunks = int(rng.integers(1, 8))
        chunk = np.sort(rng.integers(0, nchunks, n)).astype(np.uint32)
        chunk_node = rng.integers(0, nodes, nchunks).astype(np.int32)
        size = rng.integers(1, 100, n).astype(np.uint64)
        flags = bytearray(n)
        c, p = Queues(flags, chunk, chunk_node, size, nodes), PyQueues(chunk, chunk_node, size, nodes)
        for step in range(40):
            op = int(rng.integers(0, 4))
            node = int(rng.integers(0, nodes))
            if op == 0:
                sids = rng.integers(0, n, int(rng.integers(0, 10)))
                sids = (np.sort(sids) if trial % 2 else sids).tolist()
                count = int(rng.integers(0, len(sids) + 1))
                c.push_many(sids, count), p.push_many(sids, count)
            elif op == 1:
                sid = int(rng.integers(0, n))
                assert c.remove(sid) == p.remove(sid)
            elif op == 2:
                count, last = int(rng.integers(0, 5)), bool(rng.integers(0, 2))
                assert c.take(node, count, last) == p.take(node, count, last)
            else:
                args = (node, int(rng.integers(0, 12)), int(rng.integers(1, 4)), int(rng.integers(1, 300)))
                got = c.deal(*args)
                assert got == p.deal(*args), (trial, step, args)
                dealt_runs += sum(len(b) > 1 for b in got)
            assert [c.of(k) for k in range(nodes)] == [list(q) for q in p.q]
            assert c.lengths() == [len(q) for q in p.q] and len(c) == len(p.node)
            assert [i for i in range(n) if flags[i]] == sorted(p.node) == sorted(c)
            assert all((i in c) == (i in p.node) for i in range(n))
            assert [c.tail(k) for k in range(nodes)] == [next(reversed(q), -1) for q in p.q]
    assert dealt_runs > 0  # (batches of more than one sample were dealt)
    with pytest.raises(IndexError):
        c.remove(n)
    with pytest.raises(IndexError):
        c.take(nodes, 1, False)
    with pytest.raises(ValueError):
        Queues(bytearray(3), np.zeros(3, np.uint32), np.array([5], np.int32), np.ones(3, np.uint64), 2)
