"""Hands a fusefs mount the epoch order of every torch DataLoader that reads it (`fusefs run`).

`fusefs run -- COMMAND` starts COMMAND with `fusefs/boot/` leading PYTHONPATH, so every
Python process it starts (ranks, loader workers, another interpreter) loads
`fusefs/boot/sitecustomize.py`, which calls install() once `torch.utils.data.dataloader` has
been imported.

install() wraps the one call through which every torch loader iterator takes its next index
or batch, `_BaseDataLoaderIter._next_index` (torch's single- and multi-process iterators, and
torchdata's StatefulDataLoader's, which derive from them). At an epoch's first call the
wrapper runs the loader's own sampler (or batch sampler) iterator for the epoch's length,
hands the mount the epoch's sample ids as this process's rank's order, and then hands out
what it took, one by one. The loader yields exactly what it would have yielded: the same
sampler drew the same indices from the same generators, at the same point in the process's
random streams (the epoch's first index); only when is different (at once, not batch by
batch). A sampler that raises gets its exception where it raised it, after the indices it
yielded before; one that yields past its length goes on lazily past the order.

The order is written before the loader dispatches the epoch's first index, so before the
epoch's first read, in the slot of this process's rank (LOCAL_RANK). A loader that runs
between an epoch's steps in the same process (a validation every N steps) has its own order
told in that slot while it runs; when the interrupted epoch goes on after it has ended, the
rest of that epoch (what its loader has not yet handed out) is told again (_Told). A resumed StatefulDataLoader (torchdata)
fast-forwards its sampler before the first call: its order is the rest of the epoch. Its
snapshots of the sampler iterator's state are what that iterator said at that position.

Nothing here may reach the training script: a failure makes that loader run unhinted, with
one line on stderr saying why (once per reason per process). A loader over files that are
not on a fusefs mount is left as it is, silently.
"""
from __future__ import annotations

import itertools
import os
import sys
import weakref

import numpy as np

from . import client

PREFIX = "fusefs run: "
QUIET_ENV = "FUSEFS_RUN_QUIET"  # (set by `fusefs run --quiet`: only the lines that say why not)

_said: set = set()
_denied: set[str] = set()   # mounts that refused this process's orders: not asked again
_targets: dict[int, tuple] = {}  # id(dataset) -> (reference to it, _Target or None)


def say(key, text: str) -> None:
    """One line on stderr, once per key per process."""
    if key in _said:
        return
    _said.add(key)
    try:
        print(PREFIX + text, file=sys.stderr, flush=True)
    except Exception:  # (a closed stderr: nothing to say it on)
        pass


class _Target:
    """Where a dataset's samples lie: the mount and the mount id of each dataset index."""

    def __init__(self, mount: str, ids: np.ndarray, name: str):
        self.mount, self.ids, self.name = mount, ids, name
        self.epochs = 0


def _target(dataset) -> _Target | None:
    """The mount ids of a dataset's files, worked out once per dataset (None: not on a
    mount, or no files to name; the reason said once)."""
    key = id(dataset)
    held = _targets.get(key)
    if held is not None:
        ref, target = held
        if (ref() if isinstance(ref, weakref.ref) else ref) is dataset and (
                target is None or len(target.ids) == len(dataset)):
            return target
    target = _find_target(dataset)
    try:  # (the entry goes with its dataset: one made per epoch leaves nothing behind)
        ref = weakref.ref(dataset, lambda gone, key=key: _targets.get(key, (None,))[0] is gone
                          and _targets.pop(key))
    except TypeError:
        ref = dataset
    _targets[key] = (ref, target)
    return target


def _find_target(dataset) -> _Target | None:
    name = type(dataset).__name__
    try:
        paths = client.dataset_paths(dataset)
    except TypeError as e:
        say(("paths", name), f"a DataLoader over {name} runs unhinted: {e}")
        return None
    if not paths:
        return None
    try:  # (relative paths are the working folder's, as the loader's workers open them)
        mount = client.find_mount(os.path.abspath(paths[0]))
    except (FileNotFoundError, OSError):
        return None  # (not on a fusefs mount: nothing changes)
    try:
        ids = client.paths_to_ids(paths)
    except KeyError as e:
        say(("stranger", name), f"a DataLoader over {name} runs unhinted: {e.args[0]}")
        return None
    except OSError as e:
        say(("ids", mount), f"DataLoaders over {mount} run unhinted: cannot read its sample ids "
                            f"({e.strerror or e})")
        return None
    if os.environ.get(QUIET_ENV) != "1":
        say(("hinting", mount, name), f"hinting DataLoaders over {name} ({len(ids)} files on "
                                      f"{mount}): each epoch's order goes to the mount as rank "
                                      f"{_rank_slot()}'s")
    return _Target(mount, ids, name)


def _rank_slot() -> int:
    """The order slot of this process: LOCAL_RANK (torchrun, Lightning, Accelerate set it),
    else the process group's rank, else 0."""
    local = os.environ.get("LOCAL_RANK", "")
    if local.isdigit():
        return int(local)
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return 0


class _Epoch:
    """An epoch's indices (or batches), taken from the loader's sampler iterator at its first
    call: handed out in order, then the sampler's exception if it raised one, then the rest
    of the sampler iterator (past the epoch's length, if it goes on). `order`: what the mount
    was told (None: nothing)."""

    def __init__(self, taken: list, rest, error: Exception | None, order: _Told | None = None):
        self.taken, self.pos, self.rest, self.error, self.order = taken, 0, rest, error, order

    def __iter__(self):
        return self

    def __next__(self):
        pos = self.pos
        order = self.order
        if order is not None and order.displaced_by is not None:
            order.resume(pos)
        if pos < len(self.taken):
            self.pos = pos + 1
            return self.taken[pos]
        if self.error is not None:
            error, self.error = self.error, None
            raise error
        try:
            if self.rest is None:
                raise StopIteration
            item = next(self.rest)
        except StopIteration:
            if order is not None:
                order.finished = True
            raise
        self.pos = pos + 1
        return item


class _Told:
    """An epoch's order as the mount was told it. A later loader's epoch over the same mount
    in the same rank's slot (a validation between two steps) displaces it; when this epoch
    goes on after that one has ended, the rest of this one (what its loader has not yet
    handed out) is told again. An epoch that displaced it and has not ended (two loaders
    read in turn, or one left unfinished) leaves the slot as it is: no order is told per step."""

    def __init__(self, target: _Target, index: np.ndarray, ends: np.ndarray | None, epoch: int, rank: int):
        self.target, self.index, self.ends, self.epoch, self.rank = target, index, ends, epoch, rank
        self.finished, self.displaced_by = False, None
        slot = (target.mount, rank)
        before = _current.get(slot)
        before = before() if before is not None else None
        if before is not None and not before.finished:
            before.displaced_by = weakref.ref(self)
        _current[slot] = weakref.ref(self)

    def resume(self, pos: int) -> None:
        """This epoch goes on with its pos-th item: tell the mount its rest again if what
        displaced it has ended."""
        by = self.displaced_by()
        if by is not None and not by.finished:
            return
        self.displaced_by = None
        _current[(self.target.mount, self.rank)] = weakref.ref(self)
        done = pos if self.ends is None else int(self.ends[pos - 1]) if pos else 0
        try:
            rest = self.index[done:]
            if len(rest) and self.target.mount not in _denied:
                client.write_order(self.target.mount, self.target.ids[rest], epoch=self.epoch, rank=self.rank)
        except Exception as e:
            say(("failed", type(e).__name__), f"an interrupted epoch's order was not told again: "
                                              f"{type(e).__name__}: {e}")


_current: dict[tuple, weakref.ref] = {}  # (mount, rank slot) -> the order told last there


class _StatefulEpoch(_Epoch):
    """The same for a sampler iterator with state (torchdata's Stateful): its state after
    each index taken is kept, so a snapshot says where the loader is, not where the taking
    got to."""

    def __init__(self, taken: list, rest, error, order, sampler_iter, states: list):
        super().__init__(taken, rest, error, order)
        self.sampler_iter, self.states = sampler_iter, states

    def state_dict(self):
        if self.pos < len(self.states):  # (states[k]: the state after k taken)
            return self.states[self.pos]
        return self.sampler_iter.state_dict()  # (past what was taken: where it really is)

    def load_state_dict(self, state) -> None:
        self.sampler_iter.load_state_dict(state)
        self.taken, self.states, self.pos, self.rest, self.error = [], [], 0, self.sampler_iter, None


def _is_stateful(obj) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def begin_epoch(loader_iter, sampler_iter):
    """The iterator the loader takes this epoch's indices from (see the module's text)."""
    try:
        target = _epoch_target(loader_iter)
    except Exception as e:  # (never the training script's problem)
        say(("failed", type(e).__name__), f"a DataLoader runs unhinted: {type(e).__name__}: {e}")
        target = None
    if target is None:
        return _Epoch([], sampler_iter, None)
    try:
        length = len(loader_iter._index_sampler)
    except TypeError:
        say(("length", target.name), f"a DataLoader over {target.name} runs unhinted: its sampler "
                                     "has no length (an epoch without an end has no order)")
        return _Epoch([], sampler_iter, None)
    stateful = _is_stateful(sampler_iter)
    taken, states, error = [], [], None
    if stateful:
        states.append(sampler_iter.state_dict())
    try:  # (the user's sampler: what it raises is its own, raised where it raised it)
        for item in itertools.islice(sampler_iter, length):
            taken.append(item)
            if stateful:
                states.append(sampler_iter.state_dict())
    except Exception as e:  # (handed back to the loader after what came before it)
        error = e
    rest = sampler_iter if len(taken) == length and error is None else None
    try:
        order = _hand_over(target, taken, loader_iter._auto_collation)
    except Exception as e:
        say(("failed", type(e).__name__), f"a DataLoader over {target.name} runs unhinted: "
                                          f"{type(e).__name__}: {e}")
        order = None
    if stateful:
        return _StatefulEpoch(taken, rest, error, order, sampler_iter, states)
    return _Epoch(taken, rest, error, order)


def _epoch_target(loader_iter) -> _Target | None:
    dataset = loader_iter._dataset
    if getattr(loader_iter, "_dataset_kind", 0) != 0:  # (_DatasetKind.Iterable: no sampler)
        name = type(dataset).__name__
        say(("iterable", name), f"a DataLoader over {name} runs unhinted: an iterable-style "
                                "dataset has no sampler to take the order from")
        return None
    if _is_stateful(loader_iter._index_sampler) and not loader_iter._auto_collation:
        say(("stateful", type(loader_iter._index_sampler).__name__),
            f"a DataLoader with a {type(loader_iter._index_sampler).__name__} and no batch size "
            "runs unhinted: that sampler keeps its own state")
        return None
    return _target(dataset)


def _hand_over(target: _Target, taken: list, batched: bool) -> _Told | None:
    """The epoch's ids to the mount as this process's rank's order: what it was told."""
    if target.mount in _denied or not taken:
        return None
    flat = itertools.chain.from_iterable(taken) if batched else taken
    index = np.fromiter((int(i) for i in flat), dtype=np.int64)
    if len(index) and (index.min() < 0 or index.max() >= len(target.ids)):
        raise IndexError(f"the sampler yielded an index outside the dataset's {len(target.ids)}")
    ends = np.cumsum([len(batch) for batch in taken]) if batched else None
    epoch, target.epochs, rank = target.epochs, target.epochs + 1, _rank_slot()
    try:
        client.write_order(target.mount, target.ids[index], epoch=epoch, rank=rank)
    except PermissionError as e:
        _denied.add(target.mount)
        say(("denied", target.mount), f"DataLoaders over {target.mount} run unhinted: {e.strerror or e}")
        return None
    return _Told(target, index, ends, epoch, rank)


def install(dataloader_module) -> None:
    """Wrap `_next_index` of torch's loader iterators (torch.utils.data.dataloader)."""
    base = dataloader_module._BaseDataLoaderIter
    take = base._next_index
    if getattr(take, "_fusefs_hinted", False):
        return

    def _next_index(self):
        it = self._sampler_iter
        if not isinstance(it, _Epoch):
            it = self._sampler_iter = begin_epoch(self, it)
        return take(self)

    _next_index._fusefs_hinted = True
    _next_index.__wrapped__ = take
    base._next_index = _next_index
