"""The parts a sample's bytes go through, made in one place, in the order they need each other.

`DataPlane.build` makes each part once and hands it what it needs when it is made; nothing
is assigned into a part afterwards: the policy and the cache, what the kernel holds, the
open handles and the holders over them, then the read-ahead's plan, what fetches bring (its
sink), the fetcher, the read-ahead's task, the reads and the orders. `mount.serve` builds
the data plane and hands it to the core (core.Core keeps the namespace, the handles and the
control namespace, and is a façade over the rest); a core made without one (tests, the
in-process benchmarks) builds it the same way.
"""
from __future__ import annotations

from dataclasses import dataclass

from .arrivals import Arrivals
from .cache import SampleCache
from .config import MountConfig
from .fetch import Fetcher, InFlight, Placement, batch_size, max_per_node
from .handles import Handles, held_cap
from .holders import Holders
from .index import Index
from .kernel_view import KernelView
from .namespace import file_base
from .orders import Orders, default_budget
from .policy import Policy
from .prefetch import ReadAheadPlan, Wake
from .prefetcher import Prefetcher
from .reads import Reads
from .store import ChunkStore


@dataclass(frozen=True)
class DataPlane:
    policy: Policy
    cache: SampleCache
    kernel_view: KernelView
    handles: Handles
    holders: Holders
    arrivals: Arrivals
    fetcher: Fetcher
    prefetcher: Prefetcher
    reads: Reads
    orders: Orders

    @classmethod
    def build(cls, index: Index, store: ChunkStore, config: MountConfig, stats, *, local=None,
              kernel=None, hold=None, table=None, idle=None) -> "DataPlane":
        """index's data plane over store's chunks, with config's sizes and fetch settings;
        stats: the core's counters (core.Stats); local: the local tier or None; kernel: the
        kernel page cache (fs.KernelCache) or None; hold(sid, bytes or None): the fast path's
        table (FastPath.hold), or None; table: the fast path the fetch threads hand samples
        to (FastPath: hold_many, expect), or None; idle(bool): told when the read-ahead has
        covered its orders, or no longer (FastPath.idle), or None."""
        policy = Policy(index.size)
        # (the fast path's table told of each entry in C, where there is one)
        api = getattr(table, "publish_api", None)
        mirror = api() if api is not None else hold
        cache = SampleCache(config.cache_bytes, config.static_bytes, mirror=mirror, samples=index.n_files)
        kernel_view = KernelView(index.n_files, stats, kernel, ino_base=file_base(index))
        handles = Handles(held_cap(config.cache_bytes), room=cache)  # open files, what they keep
        holders = Holders(cache, handles, kernel_view, serve=hold, table=table)
        placement, inflight, fetch = Placement(index), InFlight(index.n_files), config.fetch
        plan = ReadAheadPlan(index, policy, cache, nodes=len(placement.names),
                             chunk_node=placement.chunk_node, inflight=inflight, per_node=fetch.per_node,
                             max_per_node=max_per_node(fetch), batch=batch_size(fetch, index, readahead=True),
                             readahead=config.readahead, kernel_held=kernel_view.held)
        wake = Wake()
        arrivals = Arrivals(policy, cache, holders, plan, wake, local=local,
                            io_timeout=fetch.io_timeout)
        fetcher = Fetcher(store, fetch, sink=arrivals, placement=placement, inflight=inflight,
                          local=local)
        prefetcher = Prefetcher(plan, fetcher, arrivals, wake, on_idle=idle)
        reads = Reads(index, holders, policy, fetcher, prefetcher, arrivals, stats, kernel_view)
        budget = config.order_bytes if config.order_bytes is not None else \
            default_budget(config.cache_bytes, index.n_files)
        orders = Orders(index, policy, cache, reads, prefetcher, stats, budget, local=local)
        return cls(policy, cache, kernel_view, handles, holders, arrivals, fetcher, prefetcher,
                   reads, orders)
