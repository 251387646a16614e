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
yielding them writes the matching mount ids to `MNT/.fusefs/order.<rank>`. Only the
standard library, numpy and torch are needed here: no fusefs or FUSE packages.
"""
from __future__ import annotations

import math
import os

import numpy as np
import torch
from torch.utils.data import Sampler

from fusefs import order as orderfmt  # numpy only: no FUSE packages needed here

CONTROL = ".fusefs"


def find_mount(path: str) -> str:
    """The fusefs mount that holds path (the nearest folder upwards with `.fusefs/`)."""
    p = os.path.abspath(path)
    while True:
        if os.path.isdir(os.path.join(p, CONTROL)):
            return p
        parent = os.path.dirname(p)
        if parent == p:
            raise FileNotFoundError(f"{path} is not inside a fusefs mount")
        p = parent


_ID_TABLES: dict[str, dict[bytes, int]] = {}


def mount_ids(mount: str) -> dict[bytes, int]:
    """relative path (bytes) -> sample id, from `MNT/.fusefs/ids` (read once per mount)."""
    mount = os.path.abspath(mount)
    table = _ID_TABLES.get(mount)
    if table is None:
        with open(os.path.join(mount, CONTROL, "ids"), "rb") as f:
            names = f.read().split(b"\0")[:-1]
        table = _ID_TABLES[mount] = {name: i for i, name in enumerate(names)}
    return table


def paths_to_ids(paths, mount: str | None = None) -> np.ndarray:
    """Mount ids of absolute paths under a fusefs mount (KeyError names a stranger)."""
    paths = [os.path.abspath(os.fspath(p)) for p in paths]
    mount = os.path.abspath(mount or find_mount(paths[0]))
    table = mount_ids(mount)
    out = np.empty(len(paths), dtype=np.int64)
    for k, p in enumerate(paths):
        rel = os.fsencode(os.path.relpath(p, mount))
        try:
            out[k] = table[rel]
        except KeyError:
            raise KeyError(f"{p} is not a file of the fusefs mount at {mount}") from None
    return out


def write_order(mount: str, paths_or_ids, importance=None, epoch: int = 0, rank: int = 0) -> None:
    """Write an epoch's read order to `MNT/.fusefs/order.<rank>`.

    paths_or_ids: absolute paths under the mount, or the mount's sample ids. The mount
    refuses a bad order (OSError EINVAL on close; the previous order stays in force)."""
    items = list(paths_or_ids)
    if items and isinstance(items[0], (str, bytes, os.PathLike)):
        ids = paths_to_ids(items, mount)
    else:
        ids = np.asarray(items, dtype=np.int64)
    data = orderfmt.encode(ids, epoch=epoch, importance=importance)
    with open(os.path.join(mount, CONTROL, f"order.{rank}"), "wb") as f:
        f.write(data)


def dataset_paths(dataset) -> list[str]:
    """The file path of each index of a dataset: ImageFolder/DatasetFolder `.samples`,
    `.imgs`, or a plain list of paths."""
    for attr in ("samples", "imgs"):
        items = getattr(dataset, attr, None)
        if items is not None:
            return [s[0] if isinstance(s, (tuple, list)) else s for s in items]
    if isinstance(dataset, (list, tuple)):
        return [os.fspath(p) for p in dataset]
    raise TypeError("pass a dataset with .samples (ImageFolder) or a list of paths")


class HintedSampler(Sampler):
    """RandomSampler / DistributedSampler that also tells the mount the order.

    Without num_replicas: the indices of RandomSampler(generator seeded with seed+epoch).
    With num_replicas and rank: DistributedSampler's indices for that rank. The order is
    written at each __iter__ (call set_epoch before each epoch, as with
    DistributedSampler; without it every epoch repeats epoch 0's order).

    The order goes to the mount's file `order.<local_rank>`: one mount per node serves the
    training processes of that node, each with its own order file. local_rank defaults to
    the LOCAL_RANK environment variable (set by torchrun), else to rank.
    """

    def __init__(self, dataset, mount: str | None = None, num_replicas: int | None = None,
                 rank: int | None = None, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = False, importance=None, write: bool = True,
                 local_rank: int | None = None):
        self.paths = dataset_paths(dataset)
        self.n = len(self.paths)
        self.write = write and bool(self.paths)
        self.mount = mount or (find_mount(self.paths[0]) if self.write else None)
        self.ids = paths_to_ids(self.paths, self.mount) if self.write else None
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
        self.epoch = 0
        if self.distributed and drop_last and self.n % self.num_replicas:
            self.num_samples = math.ceil((self.n - self.num_replicas) / self.num_replicas)
        else:
            self.num_samples = math.ceil(self.n / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def indices(self) -> list[int]:
        """This epoch's dataset indices for this rank (what __iter__ yields)."""
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            idx = torch.randperm(self.n, generator=g).tolist()
        else:
            idx = list(range(self.n))
        if not self.distributed:
            return idx
        if not self.drop_last:
            pad = self.total_size - len(idx)
            if pad <= len(idx):
                idx += idx[:pad]
            else:
                idx += (idx * math.ceil(pad / len(idx)))[:pad]
        else:
            idx = idx[:self.total_size]
        return idx[self.rank:self.total_size:self.num_replicas]

    def __iter__(self):
        idx = self.indices()
        if self.write:
            imp = None if self.importance is None else np.asarray(self.importance, np.float32)[idx]
            write_order(self.mount, self.ids[idx], importance=imp, epoch=self.epoch,
                        rank=self.local_rank)
        return iter(idx)

    def __len__(self) -> int:
        return self.num_samples if self.distributed else self.n
