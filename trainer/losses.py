"""Per-sample losses and what they tell apart, with numpy (torch only for the tensors a
training loop hands over): `LossTracker` keeps each sample's latest loss and its last
epochs' values, `split_fluctuating` finds the samples whose loss jumps between epochs.
importance.py's ImportanceSampler decides on them (its docstring has the method)."""
from __future__ import annotations

import numpy as np


def _is_tensor(x) -> bool:
    """Whether x is a torch tensor, without importing torch (only a caller that has torch
    hands one over)."""
    return type(x).__module__.startswith("torch") and hasattr(x, "detach")


def _numpy(x) -> np.ndarray:
    if _is_tensor(x):
        return x.detach().cpu().numpy()
    return np.asarray(x)


class LossTracker:
    """Per-sample losses: the latest one, and its value at the end of each of the last
    `window` epochs (a ring of rows). Losses handed over during an epoch are kept as
    tensors and copied out in bulk (every `collect_every` batches and at the epoch's end), so
    recording does not make the training step wait for the accelerator."""

    def __init__(self, n: int, window: int = 3, collect_every: int = 64):
        if window < 2:
            raise ValueError("a variance needs a window of at least 2 epochs")
        self.n, self.window, self.collect_every = n, window, collect_every
        self.last = np.full(n, np.nan, dtype=np.float32)
        self.history = np.full((window, n), np.nan, dtype=np.float32)
        self.epochs = 0  # finished epochs recorded in history
        self._pending: list = []  # (indices, losses) tensors, on the host or on their way

    def record(self, indices, losses) -> None:
        """Losses (reduction='none') of the samples `indices`, from any forward pass."""
        if _is_tensor(losses):
            import torch
            nb = losses.device.type != "cpu"
            self._pending.append((torch.as_tensor(indices).detach().to("cpu", non_blocking=nb),
                                  losses.detach().float().to("cpu", non_blocking=nb)))
            if len(self._pending) >= self.collect_every:
                self.collect()
        else:
            self.last[_numpy(indices).astype(np.int64)] = _numpy(losses).astype(np.float32)

    def collect(self) -> None:
        """Copy the losses recorded since the last collect into the arrays (one device sync)."""
        if self._pending:
            import torch
            if torch.cuda.is_available():
                torch.cuda.synchronize()
        for idx, loss in self._pending:
            self.last[idx.numpy().astype(np.int64)] = loss.numpy()
        self._pending.clear()

    def end_epoch(self) -> None:
        """The epoch is over: its latest losses become a history row."""
        self.collect()
        self.history[self.epochs % self.window] = self.last
        self.epochs += 1

    def variance(self) -> np.ndarray:
        """Each sample's loss variance over the recorded epochs of the window (0 where
        fewer than two are known)."""
        rows = self.history[:min(self.epochs, self.window)]
        known = np.isfinite(rows)
        count = known.sum(axis=0)
        filled = np.where(known, rows, 0.0).astype(np.float64)
        mean = filled.sum(axis=0) / np.maximum(count, 1)
        var = (np.where(known, (filled - mean) ** 2, 0.0)).sum(axis=0) / np.maximum(count, 1)
        var[count < 2] = 0.0
        return var

    def state_dict(self) -> dict:
        self.collect()
        return {"n": self.n, "window": self.window, "last": self.last.copy(),
                "history": self.history.copy(), "epochs": self.epochs}

    def load_state_dict(self, state: dict) -> None:
        if state["n"] != self.n or state["window"] != self.window:
            raise ValueError(f"tracker state for {state['n']} samples / window {state['window']}, "
                             f"this one has {self.n} / {self.window}")
        self._pending.clear()
        self.last = np.array(state["last"], dtype=np.float32)
        self.history = np.array(state["history"], dtype=np.float32)
        self.epochs = int(state["epochs"])


def split_fluctuating(variance: np.ndarray, seed: int = 0, max_fit: int = 200_000) -> np.ndarray:
    """KMeans with two clusters on the loss variances; True for the samples of the cluster
    with the larger mean variance ("fluctuating"). Fitted on at most max_fit samples drawn
    at random (all samples are then assigned), which keeps 1.28M samples to seconds."""
    from sklearn.cluster import KMeans
    v = np.nan_to_num(np.asarray(variance, dtype=np.float64)).reshape(-1, 1)
    if len(v) < 2 or np.all(v == v[0]):
        return np.zeros(len(v), dtype=bool)  # nothing to tell apart
    rng = np.random.default_rng(seed)
    fit = v if len(v) <= max_fit else v[rng.choice(len(v), max_fit, replace=False)]
    km = KMeans(n_clusters=2, n_init=4, random_state=seed).fit(fit)
    labels = km.predict(v)
    means = [v[labels == c].mean() if np.any(labels == c) else -np.inf for c in (0, 1)]
    return labels == int(np.argmax(means))
