"""CPU + accelerator co-training with weighted parameter averaging and asynchronous snapshots.

Two replicas of one model train side by side: NC on the CPU and NG on the accelerator
(a second CPU replica stands in where torch sees no accelerator). Before training, M
batches are timed on each (TC, TG: mean seconds per batch); the CPU's share of every
batch is R = TG / (TC + TG), so a batch of BS samples splits into BSC = round(BS * R) for
NC and BSG = BS - BSC for NG (each at least 1). Each iteration both replicas take a step
on their part at the same time, each with its own optimizer. Every k iterations (default
a fifteenth of an epoch) parameters and buffers are replaced by their weighted average,
R for NC and 1 - R for NG (local SGD with heterogeneous workers), computed on the
accelerator when its free memory holds the parameters, else on the CPU, and copied to the
other replica. After each merge the merged state is written as a snapshot, in the
background (SnapshotWriter): training never waits for the disk.

    from trainer import HybridTrainer
    ht = HybridTrainer(make_model, lambda p: torch.optim.SGD(p, lr=0.05), nn.CrossEntropyLoss(),
                       loader, snapshot_dir="/local/nvme/ckpt")
    ht.resume()                    # from the newest complete snapshot, if any
    ht.calibrate()                 # TC, TG, R (call again to re-measure)
    for epoch in range(epochs):
        ht.train_epoch()
    ht.close()
"""
from __future__ import annotations

import copy
import glob
import logging
import os
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch

log = logging.getLogger("trainer.hybrid")


# ---- the pieces, each testable alone --------------------------------------------------
def cpu_share(tc: float, tg: float) -> float:
    """R = TG / (TC + TG): the CPU's share of a batch, from the mean seconds per batch."""
    if tc <= 0 or tg <= 0:
        raise ValueError(f"batch times must be positive, got TC={tc}, TG={tg}")
    return tg / (tc + tg)


def split_sizes(batch: int, r: float, min_part: int = 1) -> tuple[int, int]:
    """(BSC, BSG) = (round(BS * R), BS - BSC), each at least min_part (BatchNorm needs 2
    samples to train on)."""
    if batch < 2 * min_part:
        raise ValueError(f"a batch of {batch} cannot be split into two parts of {min_part} or more")
    bsc = min(batch - min_part, max(min_part, int(round(batch * r))))
    return bsc, batch - bsc


@torch.no_grad()
def weighted_average(state_c: dict, state_g: dict, r: float, device="cpu") -> dict:
    """{name: r * state_c[name] + (1 - r) * state_g[name]} computed on device; integer
    tensors (BatchNorm's num_batches_tracked) are rounded to the nearest integer."""
    out = {}
    for name, a in state_c.items():
        b = state_g[name]
        if a.is_floating_point():
            out[name] = a.to(device, torch.float64).mul(r).add_(b.to(device, torch.float64), alpha=1 - r) \
                .to(a.dtype)
        else:
            out[name] = torch.round(a.to(device, torch.float64) * r
                                    + b.to(device, torch.float64) * (1 - r)).to(a.dtype)
    return out


def merge_device(model: torch.nn.Module, accel: torch.device) -> torch.device:
    """Where to merge: the accelerator when its free memory exceeds the state's size (both
    replicas' copies and the result), else the CPU."""
    if accel.type != "cuda":
        return torch.device("cpu")
    need = 3 * sum(t.numel() * t.element_size() for t in model.state_dict().values())
    free, _ = torch.cuda.mem_get_info(accel)
    return accel if free > need else torch.device("cpu")


class SnapshotWriter:
    """Writes state dicts to DIR/snapshot-<iteration>.pt in a background thread.

    `submit` copies the tensors to CPU memory (the only work done in the caller) and
    returns; if a write is still running, the newest submitted snapshot replaces any
    waiting one (training never queues behind the disk). Each write goes to a temporary
    file, is fsynced, then renamed: a snapshot file exists whole or not at all, so a
    killed write leaves only a `.tmp` that `latest` ignores. The newest `keep` stay.
    """

    PATTERN = re.compile(r"snapshot-(\d+)\.pt$")

    def __init__(self, folder: str, keep: int = 3, write=torch.save):
        self.folder = folder
        self.keep = max(1, keep)
        self._write = write
        os.makedirs(folder, exist_ok=True)
        for tmp in glob.glob(os.path.join(folder, "*.tmp")):  # an earlier killed write
            os.unlink(tmp)
        self._cv = threading.Condition()
        self._pending = None
        self._busy = False
        self._closed = False
        self.written = self.replaced = 0
        self.errors = 0
        self._thread = threading.Thread(target=self._run, name="snapshot-writer", daemon=True)
        self._thread.start()

    def submit(self, iteration: int, state: dict) -> None:
        payload = {"iteration": iteration,
                   "state": {k: (v.detach().to("cpu", copy=True) if torch.is_tensor(v) else copy.deepcopy(v))
                             for k, v in state.items()}}
        with self._cv:
            if self._pending is not None:
                self.replaced += 1
            self._pending = payload
            self._cv.notify()

    def _run(self) -> None:
        while True:
            with self._cv:
                while self._pending is None and not self._closed:
                    self._cv.wait()
                if self._pending is None:
                    return
                payload, self._pending = self._pending, None
                self._busy = True
            try:
                self._save(payload)
            except Exception:
                self.errors += 1
                log.exception("snapshot %d not written", payload["iteration"])
            finally:
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()

    def _save(self, payload: dict) -> None:
        final = os.path.join(self.folder, f"snapshot-{payload['iteration']:09d}.pt")
        tmp = final + ".tmp"
        with open(tmp, "wb") as f:
            self._write(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
        dfd = os.open(self.folder, os.O_RDONLY)
        try:
            os.fsync(dfd)  # the rename itself survives a crash
        finally:
            os.close(dfd)
        self.written += 1
        for old in self.snapshots(self.folder)[:-self.keep]:
            os.unlink(old)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until nothing is pending or being written (tests, the end of training)."""
        with self._cv:
            return self._cv.wait_for(lambda: self._pending is None and not self._busy, timeout)

    def close(self) -> None:
        self.wait()
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join()

    @classmethod
    def snapshots(cls, folder: str) -> list[str]:
        """Complete snapshot files, oldest first."""
        names = [n for n in os.listdir(folder) if cls.PATTERN.match(n)] if os.path.isdir(folder) else []
        return [os.path.join(folder, n) for n in sorted(names)]

    @classmethod
    def latest(cls, folder: str) -> dict | None:
        """The newest snapshot that loads ({"iteration", "state"}), or None."""
        for path in reversed(cls.snapshots(folder)):
            try:
                return torch.load(path, map_location="cpu")
            except Exception as e:  # unreadable: fall back to the one before
                log.warning("snapshot %s unreadable (%s): trying an older one", path, e)
        return None


# ---- the trainer ----------------------------------------------------------------------
class HybridTrainer:
    """Train one model as two replicas, on the CPU and on the accelerator (see above).

    model_factory() -> a fresh model (called twice; NG starts from NC's values);
    optimizer_factory(params) -> its optimizer; loss_fn(output, target) -> scalar loss;
    loader yields (inputs, targets) batches on the CPU. accel: a torch device, default
    "cuda" when available, else "cpu" (then a second CPU replica stands in).
    merge_every: iterations between merges (default len(loader) // 15, at least 1).
    snapshot_dir: where merged snapshots go (None: no snapshots); keep: how many stay.
    """

    def __init__(self, model_factory, optimizer_factory, loss_fn, loader, *, accel=None,
                 merge_every: int | None = None, calibration_batches: int = 3,
                 snapshot_dir: str | None = None, keep: int = 3, snapshot_writer=None,
                 min_part: int = 2):
        self.accel = torch.device(accel or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.nc = model_factory().to("cpu")
        self.ng = model_factory().to(self.accel)
        self.ng.load_state_dict(self.nc.state_dict())
        self.opt_c = optimizer_factory(self.nc.parameters())
        self.opt_g = optimizer_factory(self.ng.parameters())
        self.loss_fn = loss_fn
        self.loader = loader
        try:
            per_epoch = len(loader)
        except TypeError:
            per_epoch = 15
        self.merge_every = merge_every or max(1, per_epoch // 15)
        self.calibration_batches = calibration_batches
        self.min_part = min_part  # fewest samples a replica trains on (BatchNorm: 2)
        self.r = 0.5
        self.tc = self.tg = None
        self.iteration = 0
        self.merges = 0
        self.merge_seconds = 0.0
        self.writer = snapshot_writer or (SnapshotWriter(snapshot_dir, keep) if snapshot_dir else None)
        self.snapshot_dir = snapshot_dir
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="hybrid-cpu")

    # ---- R -------------------------------------------------------------------------------
    def _time_batches(self, model, batches, device) -> float:
        """Mean seconds per training step of a throwaway copy of model on device."""
        probe = copy.deepcopy(model)
        opt = torch.optim.SGD(probe.parameters(), lr=0.0)  # same work, no change of values
        times = []
        for x, y in batches:
            x, y = x.to(device), y.to(device)
            t0 = time.perf_counter()
            opt.zero_grad()
            self.loss_fn(probe(x), y).backward()
            opt.step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - t0)
        return sum(times[1:]) / max(1, len(times) - 1) if len(times) > 1 else times[0]

    def calibrate(self, batches=None) -> float:
        """Time M batches on each replica (one extra first, as warm-up) and set R."""
        if batches is None:
            batches = []
            for b in self.loader:
                batches.append(b)
                if len(batches) > self.calibration_batches:
                    break
        self.tc = self._time_batches(self.nc, batches, torch.device("cpu"))
        self.tg = self._time_batches(self.ng, batches, self.accel)
        self.r = cpu_share(self.tc, self.tg)
        log.info("calibrated: TC %.4f s, TG %.4f s per batch, R = %.3f", self.tc, self.tg, self.r)
        return self.r

    # ---- training --------------------------------------------------------------------------
    def _step(self, model, opt, x, y) -> float:
        opt.zero_grad()
        loss = self.loss_fn(model(x), y)
        loss.backward()
        opt.step()
        return float(loss.detach())

    def step(self, x, y) -> float:
        """One iteration: both replicas train on their part of (x, y) concurrently; merges
        every merge_every iterations. Returns the batch's mean loss. A batch too small to
        split (a last partial batch) goes to the accelerator's replica alone."""
        if len(x) < 2 * self.min_part:
            bsc, bsg = 0, len(x)
        else:
            bsc, bsg = split_sizes(len(x), self.r, self.min_part)
        xg, yg = x[bsc:].to(self.accel, non_blocking=True), y[bsc:].to(self.accel, non_blocking=True)
        cpu = self._pool.submit(self._step, self.nc, self.opt_c, x[:bsc], y[:bsc]) if bsc else None
        loss_g = self._step(self.ng, self.opt_g, xg, yg)
        loss_c = cpu.result() if cpu is not None else 0.0
        self.iteration += 1
        if self.iteration % self.merge_every == 0:
            self.merge()
        return (loss_c * bsc + loss_g * bsg) / (bsc + bsg)

    def train_epoch(self) -> dict:
        t0, n, total = time.perf_counter(), 0, 0.0
        for x, y in self.loader:
            total += self.step(x, y) * len(x)
            n += len(x)
        if self.iteration % self.merge_every:  # the epoch ends with one model
            self.merge()
        dt = time.perf_counter() - t0
        return {"samples": n, "seconds": dt, "samples_per_s": n / dt if dt else 0.0,
                "loss": total / max(1, n), "r": self.r}

    @torch.no_grad()
    def merge(self) -> None:
        """Weighted average of both replicas into both; then a snapshot (background)."""
        t0 = time.perf_counter()
        where = merge_device(self.nc, self.accel)
        merged = weighted_average(self.nc.state_dict(), self.ng.state_dict(), self.r, where)
        self.nc.load_state_dict(merged)
        self.ng.load_state_dict(merged)
        self.merges += 1
        self.merge_seconds += time.perf_counter() - t0
        if self.writer is not None:
            self.writer.submit(self.iteration, merged)

    @property
    def model(self) -> torch.nn.Module:
        """The CPU replica (equal to the other right after a merge)."""
        return self.nc

    # ---- resume ----------------------------------------------------------------------------
    def resume(self) -> int | None:
        """Load the newest complete snapshot into both replicas; its iteration, or None."""
        if not self.snapshot_dir:
            return None
        snap = SnapshotWriter.latest(self.snapshot_dir)
        if snap is None:
            return None
        self.nc.load_state_dict(snap["state"])
        self.ng.load_state_dict(snap["state"])
        self.iteration = int(snap["iteration"])
        return self.iteration

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self._pool.shutdown()
