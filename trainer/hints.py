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
import warnings

import numpy as np
import torch
from torch.utils.data import DistributedSampler

from fusefs.client import (
    dataset_paths,
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


_WARNED_NOT_A_MOUNT = False


def _warn_not_a_mount(path: str) -> None:
    """One warning per process: the files are not on a fusefs mount, so no order is told."""
    global _WARNED_NOT_A_MOUNT
    if not _WARNED_NOT_A_MOUNT:
        _WARNED_NOT_A_MOUNT = True
        warnings.warn(f"HintedSampler: {path} is not on a fusefs mount: sampling as torch's "
                      "samplers do, without telling a mount the order", stacklevel=3)


def _process_group() -> tuple[int, int] | None:
    """(world size, rank) of torch.distributed's default process group, if one is set up."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return None


class HintedSampler(DistributedSampler):
    """RandomSampler / DistributedSampler that also tells the mount the order.

    Without num_replicas: the indices of RandomSampler(generator seeded with seed+epoch),
    or of RandomSampler(generator=generator) when one is given. With num_replicas and rank
    (taken from torch.distributed's process group when one is initialised, as
    DistributedSampler does): DistributedSampler's indices for that rank. It is a
    DistributedSampler, so frameworks that shard any other sampler themselves (Lightning's
    DistributedSamplerWrapper, for one) keep it as it is. The sample files come from the
    dataset (ImageFolder's .samples, a Subset of one) or from `paths` (a list, or a
    function of the index) for any other dataset. The order is written at each __iter__
    (call set_epoch before each epoch, as with DistributedSampler; without it every epoch
    repeats epoch 0's order).

    On files that are not on a fusefs mount it samples all the same, without telling
    anyone (one warning per process): the script runs unchanged on a copy of the data.

    state_dict() / load_state_dict(): the epoch, the seed (and the generator's state at the
    epoch's start) and how many indices this epoch's iterator has yielded; after
    load_state_dict the next __iter__ yields the rest of that epoch's indices and tells the
    mount just those (mid-epoch resume, as torchdata's StatefulDataLoader asks of a sampler).

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
    function of seed and epoch; with a generator, what it will draw next), so the mount's
    cache keeps across the epoch boundary what the next epoch needs first, and reads it
    ahead before the next epoch starts.
    """

    MODES = ("random", "chunks", "echo")

    def __init__(self, dataset, mount: str | None = None, num_replicas: int | None = None,
                 rank: int | None = None, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = False, importance=None, write: bool = True,
                 local_rank: int | None = None, mode: str = "random", group: int = 1,
                 batch_size: int | None = None, chunks=None, lookahead: bool = True, paths=None,
                 generator: torch.Generator | None = None):
        # (DistributedSampler.__init__ is not called: it needs a process group)
        self.dataset = dataset
        try:
            self.paths = dataset_paths(dataset, paths)
        except TypeError as e:
            raise TypeError(f"HintedSampler {e}: pass paths=[the file of each index] (or "
                            "paths=function of the index)") from None
        self.n = len(self.paths)
        self.write = write and bool(self.paths)
        given = mount  # (paths are relative to it if given, else to the working folder)
        if self.write and mount is None:
            try:
                mount = find_mount(os.path.abspath(self.paths[0]))
            except FileNotFoundError:
                _warn_not_a_mount(self.paths[0])
                self.write = False
        self.mount = mount if self.write else None
        self.ids = paths_to_ids(self.paths, given) if self.write else None
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
        if generator is not None and mode != "random":
            raise ValueError("generator= is for mode='random' (the other modes draw from seed)")
        self.generator = generator
        self.importance = importance
        self.lookahead = lookahead
        self.epoch = 0
        self.yielded = 0      # indices the current epoch's iterator has yielded
        self._resume = 0      # where the next __iter__ starts (load_state_dict)
        self._gen_state = None  # the generator's state at the current epoch's start
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

    @property
    def num_samples(self) -> int:
        """Indices per rank (DistributedSampler's attribute)."""
        return self._per_rank()

    @property
    def total_size(self) -> int:
        """Indices of all ranks together (DistributedSampler's attribute)."""
        return self._per_rank() * self.num_replicas

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _epoch_order(self, epoch: int, generator: torch.Generator | None = None) -> list[int]:
        """The whole epoch's order, before it is shared out among ranks (drawn from
        `generator` where one is given: the sampler's own, or a copy of it)."""
        if self.mode == "chunks":
            return chunk_block_order(self.chunk_of, self.group,
                                     np.random.default_rng((self.seed, epoch))).tolist()
        if self.mode == "echo":
            return echo_order(self.n, self.batch_size, epoch, self.seed).tolist()
        if not self.shuffle:
            return list(range(self.n))
        if generator is None:
            generator = torch.Generator()
            generator.manual_seed(self.seed + epoch)
            return torch.randperm(self.n, generator=generator).tolist()
        order = torch.randperm(self.n, generator=generator).tolist()
        # (RandomSampler ends each epoch with a second, empty draw: the generator is left
        # as RandomSampler leaves it after a whole epoch)
        torch.randperm(self.n, generator=generator)
        return order

    def _per_rank(self, epoch: int | None = None) -> int:
        """Indices per rank, as DistributedSampler counts them (drop_last drops the rest)."""
        epoch = self.epoch if epoch is None else epoch
        total = 2 * echo_fresh_count(self.n, epoch) if self.mode == "echo" else self.n
        if not self.distributed:
            return total
        if self.drop_last and total % self.num_replicas:
            return total // self.num_replicas
        return math.ceil(total / self.num_replicas)

    def indices(self, epoch: int | None = None, generator: torch.Generator | None = None) -> list[int]:
        """An epoch's dataset indices for this rank (this epoch's: what __iter__ yields):
        DistributedSampler's padding (repeating from the start) or truncation, then a
        strided share for the random order and a contiguous slice for the chunk and echo
        orders (each rank keeps its chunks and echo pairs). With the sampler's generator,
        only __iter__ knows the epoch's indices (it draws them): here `generator` (a copy
        of it) draws."""
        epoch = self.epoch if epoch is None else epoch
        idx = self._epoch_order(epoch, generator)
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
        start, self._resume = self._resume, 0
        gen = self.generator if self.mode == "random" and self.shuffle else None
        if gen is not None:
            if start and self._gen_state is not None:  # (resuming: the epoch's draw again)
                gen.set_state(self._gen_state)
            self._gen_state = gen.get_state()
        idx = self.indices(generator=gen)
        start = min(start, len(idx))
        if self.write:
            imp = None if self.importance is None else np.asarray(self.importance, np.float32)
            nxt = None
            if self.lookahead:  # (what the generator draws next, from a copy of it)
                ahead = None if gen is None else torch.Generator().set_state(gen.get_state())
                nxt = self.indices(self.epoch + 1, ahead)
            rest = idx[start:]
            write_order(self.mount, self.ids[rest], importance=None if imp is None else imp[rest],
                        epoch=self.epoch, rank=self.local_rank,
                        next_ids=None if nxt is None else self.ids[nxt],
                        next_importance=None if imp is None or nxt is None else imp[nxt])
        self.yielded = start
        return self._yield(idx, start)

    def _yield(self, idx: list[int], start: int):
        for i in idx[start:]:
            self.yielded += 1
            yield i

    def state_dict(self) -> dict:
        """Where this sampler stands: its epoch, seed, the indices this epoch's iterator has
        yielded, and (with a generator) the generator's state at the epoch's start."""
        state = {"epoch": self.epoch, "seed": self.seed, "yielded": self.yielded}
        if self.generator is not None and self._gen_state is not None:
            state["generator"] = self._gen_state.clone()
        return state

    def load_state_dict(self, state: dict) -> None:
        """Resume from state_dict(): the next __iter__ yields the rest of that epoch (and
        tells the mount just those)."""
        if int(state.get("seed", self.seed)) != self.seed:
            raise ValueError(f"the state is of seed {state['seed']}, this sampler's seed is {self.seed}")
        self.epoch = int(state["epoch"])
        self._resume = self.yielded = int(state["yielded"])
        if self.generator is not None and state.get("generator") is not None:
            self._gen_state = state["generator"]
            self.generator.set_state(self._gen_state)

    def __len__(self) -> int:
        return self._per_rank()
