"""Tell a fusefs mount each epoch's read order.

Two-line change to a training script:

    from trainer import HintedSampler
    sampler = HintedSampler(dataset)                  # instead of shuffle=True
    loader = DataLoader(dataset, sampler=sampler, num_workers=4, ...)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)                      # as with DistributedSampler
        for batch in loader: ...

The sampler yields exactly the indices torch's RandomSampler (seeded with seed + epoch)
or DistributedSampler (same seed, epoch, shuffle, drop_last, padding) would, and before
yielding them hands the matching mount ids to the mount as rank's order (through
fusefs.client.write_order, which needs numpy only: no FUSE packages).
"""
from __future__ import annotations

import math
import os

import numpy as np
import torch
from torch.utils.data import Sampler

from fusefs.client import (
    find_mount,
    mount_chunks,
    mount_ids,
    mount_stats,
    paths_to_ids,
    write_order,
)

__all__ = ["HintedSampler", "dataset_paths", "find_mount", "mount_chunks", "mount_ids", "mount_stats",
           "paths_to_ids", "write_order"]  # the client calls, for `from trainer.hints import ...`

from .orders import chunk_block_order, echo_fresh_count, echo_order


def dataset_paths(dataset, paths=None) -> list[str]:
    """The file path of each index of a dataset: `paths` if given (a list, or a function of
    the index); else ImageFolder/DatasetFolder `.samples` or `.imgs`, a `Subset` of such a
    dataset (its indices mapped through), or a plain list of paths."""
    if paths is not None:
        if callable(paths):
            return [os.fspath(paths(i)) for i in range(len(dataset))]
        paths = [os.fspath(p) for p in paths]
        if len(paths) != len(dataset):
            raise ValueError(f"paths has {len(paths)} entries, the dataset {len(dataset)}")
        return paths
    inner = getattr(dataset, "dataset", None)
    indices = getattr(dataset, "indices", None)
    if inner is not None and indices is not None:  # (torch.utils.data.Subset, nested too)
        whole = dataset_paths(inner)
        return [whole[int(i)] for i in indices]
    for attr in ("samples", "imgs"):
        items = getattr(dataset, attr, None)
        if items is not None:
            return [s[0] if isinstance(s, (tuple, list)) else s for s in items]
    if isinstance(dataset, (list, tuple)):
        return [os.fspath(p) for p in dataset]
    raise TypeError(f"HintedSampler cannot tell the file of each sample of a {type(dataset).__name__}: "
                    "pass paths=[the file of each index] (or paths=function of the index), or a "
                    "dataset with .samples (ImageFolder), or a Subset of one")


def _process_group() -> tuple[int, int] | None:
    """(world size, rank) of torch.distributed's default process group, if one is set up."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return None


class HintedSampler(Sampler):
    """RandomSampler / DistributedSampler that also tells the mount the order.

    Without num_replicas: the indices of RandomSampler(generator seeded with seed+epoch).
    With num_replicas and rank (taken from torch.distributed's process group when one is
    initialised, as DistributedSampler does): DistributedSampler's indices for that rank.
    The sample files come from the dataset (ImageFolder's .samples, a Subset of one) or
    from `paths` (a list, or a function of the index) for any other dataset. The order is
    written at each __iter__ (call set_epoch before each epoch, as with
    DistributedSampler; without it every epoch repeats epoch 0's order).

    The order goes to the mount as rank local_rank's (`order.<local_rank>` shows it): one
    mount per node serves the training processes of that node, each with its own order. local_rank defaults to
    the LOCAL_RANK environment variable (set by torchrun), else to rank.

    mode (see trainer/orders.py for the trade-offs):
      "random"  the full shuffle above (default);
      "chunks"  chunk-block order with `group` chunks per shuffle group (the chunk layout
                comes from the mount, or pass `chunks`: the chunk of each dataset index);
      "echo"    data echoing: half the data set fresh, each fresh sample repeated once one
                or two batches later (`batch_size` must be the DataLoader's).
    In these modes ranks take contiguous slices of the epoch's order (padded to equal
    length as DistributedSampler pads), so each keeps its chunks and echo pairs.

    lookahead (default on): the order also carries the next epoch's order (the same
    function of seed and epoch), so the mount's cache keeps across the epoch boundary what
    the next epoch needs first, and reads it ahead before the next epoch starts.
    """

    MODES = ("random", "chunks", "echo")

    def __init__(self, dataset, mount: str | None = None, num_replicas: int | None = None,
                 rank: int | None = None, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = False, importance=None, write: bool = True,
                 local_rank: int | None = None, mode: str = "random", group: int = 1,
                 batch_size: int | None = None, chunks=None, lookahead: bool = True, paths=None):
        self.paths = dataset_paths(dataset, paths)
        self.n = len(self.paths)
        self.write = write and bool(self.paths)
        self.mount = mount or (find_mount(self.paths[0]) if self.write else None)
        self.ids = paths_to_ids(self.paths, self.mount) if self.write else None
        pg = _process_group()  # (as DistributedSampler: the process group's, unless given)
        if pg is not None:
            num_replicas = pg[0] if num_replicas is None else num_replicas
            rank = pg[1] if rank is None else rank
        self.distributed = num_replicas is not None
        self.num_replicas = num_replicas or 1
        self.rank = rank or 0
        if not 0 <= self.rank < self.num_replicas:
            raise ValueError(f"rank {self.rank} is not in [0, {self.num_replicas})")
        if local_rank is None:
            local_rank = int(os.environ.get("LOCAL_RANK", self.rank))
        self.local_rank = local_rank
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.importance = importance
        self.lookahead = lookahead
        self.epoch = 0
        if mode not in self.MODES:
            raise ValueError(f"mode must be one of {', '.join(self.MODES)}, got {mode!r}")
        self.mode, self.group, self.batch_size = mode, group, batch_size
        self.chunk_of = None
        if mode == "chunks":
            if group < 1:
                raise ValueError(f"group must be at least 1, got {group}")
            if chunks is not None:
                self.chunk_of = np.asarray(chunks, dtype=np.int64)
            elif self.ids is not None:
                self.chunk_of = mount_chunks(self.mount)[self.ids]
            else:
                raise ValueError("mode='chunks' needs the chunk layout: a dataset on a fusefs "
                                 "mount, or chunks=<the chunk of each index>")
            if len(self.chunk_of) != self.n:
                raise ValueError(f"chunks has {len(self.chunk_of)} entries, the dataset {self.n}")
        if mode == "echo" and not batch_size:
            raise ValueError("mode='echo' needs batch_size (the DataLoader's)")

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _epoch_order(self, epoch: int) -> list[int]:
        """The whole epoch's order, before it is shared out among ranks."""
        if self.mode == "chunks":
            return chunk_block_order(self.chunk_of, self.group,
                                     np.random.default_rng((self.seed, epoch))).tolist()
        if self.mode == "echo":
            return echo_order(self.n, self.batch_size, epoch, self.seed).tolist()
        if not self.shuffle:
            return list(range(self.n))
        g = torch.Generator()
        g.manual_seed(self.seed + epoch)
        return torch.randperm(self.n, generator=g).tolist()

    def _per_rank(self, epoch: int | None = None) -> int:
        """Indices per rank, as DistributedSampler counts them (drop_last drops the rest)."""
        epoch = self.epoch if epoch is None else epoch
        total = 2 * echo_fresh_count(self.n, epoch) if self.mode == "echo" else self.n
        if not self.distributed:
            return total
        if self.drop_last and total % self.num_replicas:
            return total // self.num_replicas
        return math.ceil(total / self.num_replicas)

    def indices(self, epoch: int | None = None) -> list[int]:
        """An epoch's dataset indices for this rank (this epoch's: what __iter__ yields):
        DistributedSampler's padding (repeating from the start) or truncation, then a
        strided share for the random order and a contiguous slice for the chunk and echo
        orders (each rank keeps its chunks and echo pairs)."""
        epoch = self.epoch if epoch is None else epoch
        idx = self._epoch_order(epoch)
        if not self.distributed:
            return idx
        per = self._per_rank(epoch)
        total = per * self.num_replicas
        if len(idx) < total:
            pad = total - len(idx)
            idx += (idx * math.ceil(pad / len(idx)))[:pad]
        idx = idx[:total]
        if self.mode == "random":
            return idx[self.rank:total:self.num_replicas]
        return idx[self.rank * per:(self.rank + 1) * per]

    def __iter__(self):
        idx = self.indices()
        if self.write:
            imp = None if self.importance is None else np.asarray(self.importance, np.float32)
            nxt = self.indices(self.epoch + 1) if self.lookahead else None
            write_order(self.mount, self.ids[idx], importance=None if imp is None else imp[idx],
                        epoch=self.epoch, rank=self.local_rank,
                        next_ids=None if nxt is None else self.ids[nxt],
                        next_importance=None if imp is None or nxt is None else imp[nxt])
        return iter(idx)

    def __len__(self) -> int:
        return self._per_rank()
