"""prefetch.ReadAheadPlan alone: no threads, no trio, no I/O. From an order, the cache and
what is in flight, it queues what to read ahead (its room reserved), hands out batches per
node within their request slots, and moves on as readers use what it read."""
import os

import numpy as np

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
    plan = ReadAheadPlan(ix, policy, cache, nodes=3, node_of=lambda s: int(node[s]), inflight=inflight,
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
    queued_before = dict(plan.queued)
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
