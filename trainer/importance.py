"""Importance-aware epochs: train on the samples that matter, and tell the mount.

Most samples' loss settles after a few epochs; some keep fluctuating. After `warmup`
epochs of full, shuffled training, each sample's loss variance over the last `warmup`
epochs is split in two by KMeans (scikit-learn): the cluster of larger mean variance is
"fluctuating", the other "stable" (re-done every `every` epochs). From then on, each epoch:

1. the fluctuating samples are re-evaluated first: their order is written to the mount
   (so it fetches them first), and a forward pass without gradients records their loss;
   the decoded batches are kept in memory (up to `reuse_bytes`), so those of them chosen
   for training are not read and decoded a second time;
2. every sample's importance is its last recorded loss (stable samples: from the
   training forward passes, as they happen);
3. which samples are trained on, by `mode`:
   - "unbiased" (InfoBatch's rule, ICLR 2024): each sample of importance below the mean
     (well learned) is left out at random with probability `prune`; the well-learned ones
     kept get the weight 1 / (1 - prune) (`sampler.weights(idx)`: multiply their losses by
     it), so the epoch's gradient is the full epoch's in expectation; the last `anneal`
     share of the `epochs` is full, unweighted training;
   - "rank" (the first design, kept for comparison): the `keep` share of highest
     importance (plus, optionally, an `explore` share of the rest drawn at random), which
     biases the gradient toward hard samples;
   the chosen samples are shuffled, written to the mount as the epoch's order with the
   importance values, and trained on.

Typical loop (the dataset must return the sample index too: wrap it in `WithIndex`):

    tracker = LossTracker(len(train_set))
    sampler = ImportanceSampler(train_set, tracker, keep=0.7)
    loader = DataLoader(WithIndex(train_set), batch_size=64, sampler=sampler, num_workers=4)
    criterion = nn.CrossEntropyLoss(reduction="none")
    reloader = DataLoader(WithIndex(train_set), batch_size=16, num_workers=4,
                          sampler=sampler.reevaluation_sampler, persistent_workers=True)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        sampler.reevaluate(model, reloader, criterion)
        for x, y, idx in sampler.batches(loader):
            losses = criterion(model(x), y)
            tracker.record(idx, losses)
            (losses * sampler.weights(idx)).mean().backward(); ...
        tracker.end_epoch()

(with `ImportanceSampler(train_set, tracker, mode="unbiased", prune=0.5, epochs=epochs)`;
in "rank" mode, and in full epochs, `weights` is all ones.)

`sampler.batches(loader)` yields the re-evaluated samples chosen for training first (from
memory, shuffled, `loader.batch_size` at a time: the loader's workers start on the rest
meanwhile), then the loader's batches, which hold only the rest. Iterating `loader` itself
works too: it then yields every chosen sample, the re-evaluated ones read again.

The tracker keeps numpy arrays only (float32: the latest loss and `warmup` epochs of
history): 16 bytes per sample with the default warmup of 3, 20 MB for 1.28M samples.
`state_dict()`/`load_state_dict()` of the sampler carry everything (tracker included)
for the training checkpoint.
"""
from __future__ import annotations

import importlib
import os

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler, Subset

from .hints import dataset_paths, find_mount, paths_to_ids, write_order
from .losses import LossTracker, split_fluctuating  # noqa: F401 (the package's names)


class WithIndex(Dataset):
    """dataset[i] + (i,): lets the training loop know which samples a batch holds."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i):
        item = self.dataset[i]
        return (*item, i) if isinstance(item, tuple) else (item, i)


class ImportanceSampler(Sampler):
    """Yields each epoch's training indices (see the module docstring) and writes the
    matching orders to the fusefs mount that holds the dataset (`write=False`, or a
    dataset off any mount, only samples).

    mode "unbiased": prune, the chance that a well-learned sample (importance below the
    mean) is left out of an epoch; epochs (the run's), anneal: its last share trained on in
    full (InfoBatch: an eighth). mode "rank": keep, share of samples trained on after the
    warm-up, a float or a function epoch -> float; explore, share of the samples left out
    that is drawn at random and added. warmup: epochs of full training (and of loss history) before the first split;
    every: epochs between splits. reuse_bytes: memory for the decoded batches of the
    re-evaluation (`reevaluate`), which `batches` hands to training (0: none kept).
    """

    MODES = ("rank", "unbiased")

    def __init__(self, dataset, tracker: LossTracker, keep=0.7, explore: float = 0.0,
                 warmup: int | None = None, every: int = 1, seed: int = 0,
                 mount: str | None = None, write: bool = True, local_rank: int = 0,
                 reuse_bytes: int = 512 << 20, mode: str = "rank", prune: float = 0.5,
                 epochs: int | None = None, anneal: float = 0.125):
        if mode not in self.MODES:
            raise ValueError(f"mode must be one of {', '.join(self.MODES)}, got {mode!r}")
        if not 0.0 <= prune < 1.0:
            raise ValueError(f"prune must lie in [0, 1), got {prune}")
        if not 0.0 <= anneal <= 1.0:
            raise ValueError(f"anneal must lie in [0, 1], got {anneal}")
        self.mode, self.prune, self.epochs, self.anneal = mode, prune, epochs, anneal
        self._weight: np.ndarray | None = None  # this epoch's loss weights (None: all 1)
        self.paths = dataset_paths(dataset)
        self.n = len(self.paths)
        if tracker.n != self.n:
            raise ValueError(f"tracker holds {tracker.n} samples, the dataset {self.n}")
        self.tracker = tracker
        importlib.import_module("sklearn.cluster")  # 0.5 s: now, not in the first split's epoch
        self.keep, self.explore = keep, explore
        self.warmup = tracker.window if warmup is None else warmup
        self.every, self.seed, self.local_rank = max(1, every), seed, local_rank
        self.write = write and self.n > 0
        if self.write:  # (paths are relative to mount if given, else to the working folder)
            try:
                self.mount = mount or find_mount(os.path.abspath(self.paths[0]))
            except FileNotFoundError:
                self.write, self.mount = False, None
        else:
            self.mount = None
        self.ids = paths_to_ids(self.paths, mount) if self.write else None
        self.epoch = 0
        self.fluctuating = np.zeros(self.n, dtype=bool)
        self.split_epoch = -1  # epoch of the last split (-1: none yet)
        self._selected: list[int] | None = None
        self._reevaluating: list[int] = []
        self.reuse_bytes = reuse_bytes
        self._held = _Held()  # this epoch's re-evaluated batches, for training
        self._prepared: list[int] | None = None  # batches()'s selection, for __iter__
        self._ready: list[int] = []  # held samples chosen for training, in order
        #: yields the current reevaluation() set: a sampler for one persistent DataLoader
        #: that re-evaluates every epoch without starting new worker processes
        self.reevaluation_sampler = _CurrentList(self)

    # ---- per epoch -------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self._selected = self._prepared = None
        self._held.clear()
        self._ready = []
        if self.importance_phase and (self.split_epoch < 0
                                      or epoch - self.split_epoch >= self.every):
            self.fluctuating = split_fluctuating(self.tracker.variance(), seed=self.seed + epoch)
            self.split_epoch = epoch

    @property
    def importance_phase(self) -> bool:
        return self.epoch >= self.warmup and self.tracker.epochs >= 2 and not self.annealing

    @property
    def annealing(self) -> bool:
        """In the last `anneal` share of the `epochs` (unbiased mode): full epochs."""
        if self.mode != "unbiased" or self.epochs is None:
            return False
        return self.epoch >= self.epochs - int(np.ceil(self.anneal * self.epochs))

    def weights(self, idx):
        """The loss weight of each index of idx (a tensor or array, as the loader yields
        it) this epoch: 1 / (1 - prune) for a well-learned sample kept in unbiased mode,
        else 1; a tensor for a tensor."""
        arr = np.asarray(idx.cpu() if hasattr(idx, "cpu") else idx, dtype=np.int64)
        w = np.ones(len(arr), dtype=np.float32) if self._weight is None else self._weight[arr]
        if hasattr(idx, "cpu"):
            import torch
            return torch.from_numpy(np.ascontiguousarray(w)).to(idx.device)
        return w

    def keep_fraction(self) -> float:
        k = self.keep(self.epoch) if callable(self.keep) else self.keep
        if not 0.0 < k <= 1.0:
            raise ValueError(f"keep must lie in (0, 1], got {k}")
        return float(k)

    def _n_keep(self) -> int:
        return max(1, int(round(self.keep_fraction() * self.n)))

    def reevaluation(self, held: bool = False) -> list[int]:
        """The fluctuating samples to re-evaluate before this epoch's training (none during
        the warm-up). Their order is written to the mount now, so it fetches them first.

        The order written goes on past them with a provisional training order: the
        selection by the importance known now (the fluctuating samples' from before their
        re-evaluation), with importance values. So the mount keeps the re-evaluated
        samples that training will probably read again instead of dropping them after
        the re-evaluation read, keeps its pinned samples (an order without importance
        values would unpin them), and reads ahead for training while the re-evaluation
        runs; the real order, written when training starts, replaces it. `held`: the
        re-evaluation keeps its decoded batches for training (`reevaluate`), so the
        provisional order leaves the fluctuating samples out: read once, then dropped."""
        if not self.importance_phase:
            self._reevaluating = []
            return []
        idx = np.flatnonzero(self.fluctuating)
        imp = self.importance()
        ahead = self.select(imp)
        if held:
            ahead = ahead[~self.fluctuating[ahead]]
        both = np.concatenate([idx, ahead])
        self._write(both, np.minimum(imp[both], np.finfo(np.float32).max))
        self._reevaluating = idx.tolist()
        return self._reevaluating

    def reevaluate(self, model, loader, criterion, *, device=None) -> int:
        """Re-evaluate this epoch's fluctuating samples (none during the warm-up): write
        their order, run the forward pass without gradients over `loader` (a DataLoader
        over the `WithIndex` dataset with `sampler=self.reevaluation_sampler`, or the
        `WithIndex` dataset itself) and record their losses. The decoded batches are kept,
        up to `reuse_bytes`, for `batches` to train on. Returns the samples evaluated."""
        hold = self.reuse_bytes > 0
        self._held.clear()
        todo = self.reevaluation(held=hold)
        return reevaluate(model, loader, todo, criterion, self.tracker, device=device,
                          hold=self._held.hold(self.reuse_bytes) if hold else None)

    def batches(self, loader):
        """This epoch's training batches from `loader` (a DataLoader with this sampler):
        first the held re-evaluated samples chosen for training, in the epoch's shuffled
        order, `loader.batch_size` at a time (while the loader's workers start on the
        rest), then the loader's batches, which leave those samples out."""
        self._prepare(leave_out_held=True)  # the selection, and the order written
        it = iter(loader)  # (its __iter__ takes the prepared selection)
        yield from self._held.batches(self._ready, loader.batch_size or 1)
        self._held.clear()
        yield from it

    @property
    def reused(self) -> int:
        """Samples of this epoch trained from the re-evaluation's batches, not read again."""
        return len(self._ready)

    def importance(self) -> np.ndarray:
        """Each sample's importance: its last recorded loss (unknown: +inf, so an unseen
        sample is always trained on)."""
        self.tracker.collect()
        return np.where(np.isfinite(self.tracker.last), self.tracker.last, np.inf)

    def select(self, imp: np.ndarray | None) -> np.ndarray:
        """This epoch's training indices, in their (shuffled) order, given every sample's
        importance (None: the warm-up, all samples)."""
        rng = np.random.default_rng((self.seed, self.epoch))
        self._weight = None
        if imp is None:
            return rng.permutation(self.n)
        if self.mode == "unbiased":
            perm = rng.permutation(self.n)
            known = np.isfinite(imp)
            low = known & (imp < (imp[known].mean() if known.any() else np.inf))
            kept = ~(low & (rng.random(self.n) < self.prune))
            self._weight = np.where(low & kept, np.float32(1 / (1 - self.prune)), np.float32(1))
            return perm[kept[perm]]
        # The shuffle: one random permutation of the epoch, kept to the chosen. (Uniform
        # over the chosen, and the same relative order for any chosen set: the provisional
        # order written with the re-evaluation and the final one agree on what comes
        # first, so what was read ahead stays useful.)
        perm = rng.permutation(self.n)
        ranked = np.argsort(-imp, kind="stable")
        n_keep = self._n_keep()
        chosen, rest = ranked[:n_keep], ranked[n_keep:]
        if self.explore > 0 and len(rest):
            extra = rng.choice(rest, int(round(self.explore * len(rest))), replace=False)
            chosen = np.concatenate([chosen, extra])
        wanted = np.zeros(self.n, dtype=bool)
        wanted[chosen] = True
        return perm[wanted[perm]]

    def __iter__(self):
        if self._prepared is None:
            self._prepare(leave_out_held=False)
        idx, self._prepared = self._prepared, None
        return iter(idx)

    def _prepare(self, leave_out_held: bool) -> None:
        """Select this epoch's samples and write their order; leave_out_held: those held
        from the re-evaluation go to batches() instead (self._ready)."""
        imp = self.importance() if self.importance_phase else None
        idx = self.select(imp)
        self._ready = []
        if leave_out_held and len(self._held):
            held = self._held.contains(idx)
            self._ready, idx = idx[held].tolist(), idx[~held]
        # finite values, as the order file needs (an unseen sample's +inf becomes the max)
        self._write(idx, None if imp is None else np.minimum(imp[idx], np.finfo(np.float32).max))
        self._selected = self._prepared = idx.tolist()

    def __len__(self) -> int:
        if self._selected is not None:
            return len(self._selected)
        if not self.importance_phase:
            return self.n
        if self.mode == "unbiased":  # (the draw is the epoch's: the same select() makes)
            return len(self.select(self.importance()))
        n_keep = self._n_keep()
        return n_keep + int(round(self.explore * (self.n - n_keep)))

    def _write(self, idx: np.ndarray, importance) -> None:
        if self.write and len(idx):
            write_order(self.mount, self.ids[idx], importance=importance, epoch=self.epoch,
                        rank=self.local_rank)

    # ---- checkpoints -----------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "fluctuating": self.fluctuating.copy(),
                "split_epoch": self.split_epoch, "tracker": self.tracker.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.tracker.load_state_dict(state["tracker"])
        self.epoch = int(state["epoch"])
        self.fluctuating = np.array(state["fluctuating"], dtype=bool)
        self.split_epoch = int(state["split_epoch"])
        self._selected = None


class _Held:
    """Batches (tuples of CPU tensors, the sample index last) kept from a re-evaluation,
    within a byte budget: the first whole batches that fit (after one that does not, no
    more are kept)."""

    def __init__(self):
        self.clear()

    def clear(self) -> None:
        self.parts: list[tuple] = []
        self.nbytes = 0
        self.rows: dict[int, int] = {}
        self.full = False

    def __len__(self) -> int:
        return len(self.rows)

    def hold(self, budget: int):
        """A callback for reevaluate: keep the batches handed to it while they fit."""
        def keep(batch) -> None:
            size = sum(t.element_size() * t.nelement() for t in batch
                       if isinstance(t, torch.Tensor))
            self.full = (self.full or self.nbytes + size > budget
                         or not all(isinstance(t, torch.Tensor) for t in batch))
            if self.full:
                return
            self.nbytes += size
            for i in batch[-1].tolist():
                self.rows[int(i)] = len(self.rows)
            self.parts.append(tuple(t.detach().cpu() for t in batch))
        return keep

    def contains(self, idx: np.ndarray) -> np.ndarray:
        return np.fromiter((int(i) in self.rows for i in idx), dtype=bool, count=len(idx))

    def batches(self, order: list[int], size: int):
        if not order:
            return
        fields = [torch.cat(col) for col in zip(*self.parts)]
        rows = torch.tensor([self.rows[i] for i in order])
        for start in range(0, len(rows), size):
            pick = rows[start:start + size]
            yield tuple(f[pick] for f in fields)


class _CurrentList(Sampler):
    """The sampler's current re-evaluation set, read at each iteration."""

    def __init__(self, owner: ImportanceSampler):
        self.owner = owner

    def __iter__(self):
        return iter(list(self.owner._reevaluating))

    def __len__(self) -> int:
        return len(self.owner._reevaluating)


@torch.no_grad()
def reevaluate(model, indexed_dataset, indices, criterion, tracker: LossTracker, *,
               batch_size: int = 256, num_workers: int = 0, device=None, hold=None) -> int:
    """Forward pass without gradients over `indices` of a `WithIndex` dataset; records
    each sample's loss (criterion with reduction='none'). Returns the samples evaluated.

    `indexed_dataset` may instead be a DataLoader built once over the `WithIndex` dataset
    with `sampler=importance_sampler.reevaluation_sampler` (persistent workers): it then
    yields this epoch's set and `indices` only says whether there is one. `hold`, if
    given, is handed each batch (x, y, idx) as loaded (`ImportanceSampler.reevaluate`
    keeps them for training)."""
    if not len(indices):
        return 0
    was_training = model.training
    model.eval()
    if isinstance(indexed_dataset, DataLoader):
        loader = indexed_dataset
    else:
        loader = DataLoader(Subset(indexed_dataset, list(indices)), batch_size=batch_size,
                            num_workers=num_workers, shuffle=False)
    done = 0
    try:
        for x, y, idx in loader:
            if hold is not None:
                hold((x, y, idx))
            if device is not None:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            tracker.record(idx, criterion(model(x), y))
            done += len(idx)
    finally:
        model.train(was_training)
    tracker.collect()
    return done
