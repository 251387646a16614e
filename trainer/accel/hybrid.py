"""CPU + accelerator co-training with weighted parameter averaging and background snapshots.

Two replicas of one model train at the same time: NG on the accelerator, in the caller's
thread, and NC on the CPU, in a worker thread (a second CPU replica stands in where torch
sees no accelerator). Neither waits for the other:

- **Own share, own pace.** The loader's batches go to NG, except that a batch arriving
  while NC is idle and the accelerator busy goes to NC whole (up to NC's calibrated share
  of the epoch). The CPU trains what it can finish; the accelerator never waits for it,
  and every sample of an epoch is trained once, by one replica.
- **Merges by samples.** Every k batches (default a fifteenth of an epoch)
  NC, at the end of its current step, offers its state; NG takes the offer at its next
  iteration and becomes w_c * NC + (1 - w_c) * NG, where w_c is the share of the samples
  trained since the last merge that NC trained; NC then continues from the merged state.
  Samples rather than the calibrated R: the count is what each replica did, not what it was
  expected to do, so a replica that fell behind (a loader stall, a busy core) weighs less,
  and a replica that trained nothing since the last merge weighs nothing.
- **The accelerator pays only for copies it does not wait on.** On CUDA the CPU thread
  copies its state to the device on a side stream; NG's stream waits for that copy on the
  device, averages in place and copies the result into pinned host buffers, and the CPU
  thread waits for that copy, loads it and hands it to the snapshot writer. The caller's
  thread never synchronises with the device for a merge.
- **Accelerator alone when the CPU cannot help.** `calibrate()` times batches on each
  (TC, TG: seconds per batch); the CPU adds TG / TC of the accelerator's throughput. Below
  `min_gain` (default 2%) the trainer logs so and trains NG alone; merges then only bring
  NG's state to the host for snapshots. Then the first batches of training alternate
  windows with the CPU replica allowed and not (`OnOffProbe`): unless the windows with it
  were faster by min_gain, measured in samples per second of wall time, it is switched off
  for good (it can take cores from the loader's workers or hold the GIL).
- **Snapshots in the background** (`SnapshotWriter`): of a merged state, at most one per
  `snapshot_every` seconds (default 30) and one at `close()`; atomic (temporary file,
  fsync, rename), the newest replacing a waiting one; `resume()` loads the newest.

The CPU replica's intra-op threads (torch's setting is process-wide): by default the cores
left after the loader's workers and the caller's thread, at least one.

    from trainer import HybridTrainer
    ht = HybridTrainer(make_model, lambda p: torch.optim.SGD(p, lr=0.05), nn.CrossEntropyLoss(),
                       loader, snapshot_dir="/local/nvme/ckpt")
    ht.resume()                    # from the newest complete snapshot, if any
    ht.calibrate()                 # TC, TG, and whether the CPU trains at all
    for epoch in range(epochs):
        ht.train_epoch()
    ht.close()                     # the CPU's last batch merged, the last snapshot written
"""
from __future__ import annotations

import copy
import glob
import logging
import os
import queue
import re
import threading
import time

import torch

from .probe import OnOffProbe, cpu_gain

log = logging.getLogger("trainer.accel.hybrid")


# ---- the pieces, each testable alone --------------------------------------------------
@torch.no_grad()
def average_into(dst: list, src: list, w: float) -> None:
    """dst[i] = w * src[i] + (1 - w) * dst[i], in place, on dst's device (src already
    there); integer tensors (BatchNorm's num_batches_tracked) rounded to the nearest integer."""
    if w == 0:
        return
    for a, b in zip(dst, src):
        if a.is_floating_point():
            a.mul_(1 - w).add_(b, alpha=w)
        else:
            a.copy_(torch.round(a.double() * (1 - w) + b.double() * w))


def default_cpu_threads(loader) -> int:
    """Cores left for the CPU replica after the loader's worker processes and the caller's
    thread, at least 1."""
    workers = getattr(loader, "num_workers", 0) or 0
    return max(1, (os.cpu_count() or 1) - workers - 1)


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
_STOP, _MERGE, _LAST_MERGE = "stop", "merge", "last merge"


class HybridTrainer:
    """Train one model as two replicas, on the accelerator and on the CPU (see above).

    model_factory() -> a fresh model (called twice; NC starts from NG's values);
    optimizer_factory(params) -> its optimizer; loss_fn(output, target) -> scalar loss;
    loader yields (inputs, targets) batches on the CPU. accel: a torch device, default
    "cuda" when available, else "cpu" (then a second CPU replica stands in).
    merge_every: batches between merges (default len(loader) // 15, at least 1).
    cpu_threads: torch's intra-op threads (default `default_cpu_threads(loader)`); set for
    the process, as torch has one setting for all threads.
    min_gain: the least TG / TC at which the CPU trains at all, and the least gain the
    on/off probe must measure for it to go on training.
    probe_windows, probe_batches: the on/off probe's windows (0 windows: no probe).
    snapshot_dir: where merged snapshots go (None: no snapshots); keep: how many stay;
    snapshot_every: the fewest seconds between two snapshots (a merge within them writes
    none; close() always writes the last). clock: what calibration and the probe time
    with (seconds; tests give one that replicas advance).

    Threads: the caller's thread trains NG, takes NC's offers and never blocks on NC or
    on the device for a merge; the "hybrid-cpu" thread trains NC, offers its state and
    loads the merged one. NC's state and the host buffers belong to the CPU thread between
    an offer's hand-over and back.
    """

    def __init__(self, model_factory, optimizer_factory, loss_fn, loader, *, accel=None,
                 merge_every: int | None = None, calibration_batches: int = 3,
                 cpu_threads: int | None = None, min_gain: float = 0.02,
                 probe_windows: int = 4, probe_batches: int | None = None,
                 snapshot_dir: str | None = None, keep: int = 3, snapshot_writer=None,
                 snapshot_every: float = 30.0, clock=time.perf_counter):
        self.clock = clock
        self.accel = torch.device(accel or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.cpu_threads = cpu_threads or default_cpu_threads(loader)
        torch.set_num_threads(self.cpu_threads)
        self.ng = model_factory().to(self.accel)
        self.nc = model_factory().to("cpu")
        self.nc.load_state_dict(self.ng.state_dict())
        self.opt_g = optimizer_factory(self.ng.parameters())
        self.opt_c = optimizer_factory(self.nc.parameters())
        self.loss_fn = loss_fn
        self.loader = loader
        try:
            per_epoch = len(loader)
        except TypeError:
            per_epoch = 15
        self.merge_every = merge_every or max(1, per_epoch // 15)
        self.calibration_batches = calibration_batches
        self.min_gain = min_gain
        self.cpu_active = True  # until calibrate() or the probe finds the CPU does not help
        self.probe = OnOffProbe(probe_windows, probe_batches or max(8, self.merge_every), min_gain, clock)
        if not probe_windows:
            self.probe.verdict = True
        self.tc = self.tg = self.gain = None
        self.iteration = 0  # accelerator iterations
        self._since_merge = 0  # batches handed out since a merge was last asked for
        self._cpu_since_merge = 0  # of which to NC
        self._given = {"accel": 0, "cpu": 0}  # batches handed out this epoch
        self.merges = 0
        self.samples = {"accel": 0, "cpu": 0}  # trained, since the start
        self.writer = snapshot_writer or (SnapshotWriter(snapshot_dir, keep) if snapshot_dir else None)
        self.snapshot_dir = snapshot_dir
        self.snapshot_every = snapshot_every
        self._last_snapshot = time.monotonic()  # CPU thread's
        # the merge's buffers: state on the host (pinned for CUDA) and on the accelerator
        self._names = list(self.ng.state_dict().keys())
        cuda = self.accel.type == "cuda"
        self._host = [t.detach().to("cpu", copy=True) for t in self.nc.state_dict().values()]
        if cuda:
            self._host = [t.pin_memory() for t in self._host]
            self._dev = [torch.empty_like(t, device=self.accel) for t in self._host]
            self._side = torch.cuda.Stream(self.accel)
        else:
            self._dev, self._side = self._host, None
        self._ng_state = list(self.ng.state_dict().values())  # views of NG's tensors
        self._n_g = 0  # samples NG trained since the last merge
        self._n_c = 0  # samples NC trained since the last merge (CPU thread's)
        self._jobs: queue.Queue = queue.Queue()
        self._outstanding = 0  # jobs given and not finished (caller's thread counts)
        self._done = threading.Semaphore(0)  # one release per finished job
        self._offer = None  # (samples, event) from the CPU thread
        self._merged = queue.Queue(maxsize=1)  # (iteration, event) back to it
        self._merge_asked = False
        self._error: BaseException | None = None
        self._losses = {"accel": [0.0, 0], "cpu": [0.0, 0]}  # this epoch: sum, samples
        self._thread = threading.Thread(target=self._cpu_loop, name="hybrid-cpu", daemon=True)
        self._thread.start()

    # ---- calibration ---------------------------------------------------------------------
    def _time_batches(self, model, batches, device) -> float:
        """Mean seconds per training step of a throwaway copy of model on device."""
        probe = copy.deepcopy(model)
        opt = torch.optim.SGD(probe.parameters(), lr=0.0)  # same work, no change of values
        times = []
        for x, y in batches:
            x, y = x.to(device), y.to(device)
            t0 = self.clock()
            opt.zero_grad()
            self.loss_fn(probe(x), y).backward()
            opt.step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(self.clock() - t0)
        return sum(times[1:]) / max(1, len(times) - 1) if len(times) > 1 else times[0]

    def calibrate(self, batches=None) -> float:
        """Time whole batches on each replica (one extra first, as warm-up); the CPU trains
        only if it adds at least min_gain of the accelerator's throughput. Returns TG / TC."""
        self._wait_idle()
        if batches is None:
            batches = []
            for b in self.loader:
                batches.append(b)
                if len(batches) > self.calibration_batches:
                    break
        self.tg = self._time_batches(self.ng, batches, self.accel)
        self.tc = self._time_batches(self.nc, batches, torch.device("cpu"))
        self.gain = cpu_gain(self.tc, self.tg)
        self.cpu_active = self.gain >= self.min_gain
        log.info("calibrated: TC %.4f s, TG %.4f s per batch: the CPU adds %.1f%% %s", self.tc,
                 self.tg, 100 * self.gain, "" if self.cpu_active else
                 f"(under {100 * self.min_gain:.0f}%): training on {self.accel} alone")
        return self.gain

    # ---- the caller's thread ----------------------------------------------------------------
    def _give(self, job) -> None:
        self._outstanding += 1
        self._jobs.put(job)

    def _reap(self) -> None:
        while self._done.acquire(blocking=False):
            self._outstanding -= 1
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError("the CPU replica failed") from error

    def _take_offer(self) -> None:
        """Merge NC's offered state into NG (never waits), hand the result back."""
        offer, self._offer = self._offer, None
        if offer is None:
            return
        n_c, ready = offer
        if ready is not None:
            torch.cuda.current_stream(self.accel).wait_event(ready)
        total = n_c + self._n_g
        average_into(self._ng_state, self._dev, n_c / total if total else 0.0)
        with torch.no_grad():
            for host, t in zip(self._host, self._ng_state):
                host.copy_(t, non_blocking=True)
        done = None
        if self._side is not None:
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(self.accel))
        self._n_g = 0
        self.merges += 1
        self._merge_asked = False
        self._merged.put((self.iteration, done))

    def _snapshot_due(self) -> bool:
        return self.writer is not None and time.monotonic() - self._last_snapshot >= self.snapshot_every

    def _cpu_takes(self) -> bool:
        """Whether this batch goes to NC: only when NC is idle, while the accelerator is
        busy (CUDA: its stream still has work queued; an idle accelerator, starved by the
        loader, takes the batch itself), and while NC has had no more than its share of
        the epoch's batches (TG / (TC + TG): when both are busy, the part NC keeps up with)."""
        if not self.cpu_active or self._outstanding or not self.probe.cpu_allowed:
            return False
        if self._side is not None and torch.cuda.current_stream(self.accel).query():
            return False
        share = self.gain / (1 + self.gain) if self.gain else 0.5
        return self._given["cpu"] <= share * (self._given["cpu"] + self._given["accel"])

    def step(self, x, y) -> None:
        """One batch, to NC whole or a step of NG. Asks for a merge every merge_every
        batches if NC was given one since the last, or if a snapshot is due."""
        self._reap()
        self._take_offer()
        if self.probe.verdict is None:
            self._probe_count(len(y))
        self._since_merge += 1
        if self._since_merge >= self.merge_every and not self._merge_asked and (
                self._cpu_since_merge or self._snapshot_due()):
            self._merge_asked = True  # NC trained since the last merge, or a snapshot is due
            self._since_merge = self._cpu_since_merge = 0
            self._give(_MERGE)
        if self._cpu_takes():
            self._given["cpu"] += 1
            self._cpu_since_merge += 1
            self._give((x, y))
            return
        self._given["accel"] += 1
        x, y = x.to(self.accel, non_blocking=True), y.to(self.accel, non_blocking=True)
        self.opt_g.zero_grad()
        loss = self.loss_fn(self.ng(x), y)
        loss.backward()
        self.opt_g.step()
        acc = self._losses["accel"]
        acc[0] += loss.detach() * len(y)  # stays on the device: no synchronisation here
        acc[1] += len(y)
        self._n_g += len(y)
        self.samples["accel"] += len(y)
        self.iteration += 1

    def _probe_count(self, samples: int) -> None:
        self.probe.count(samples, self._sync, cpu_busy=self._outstanding > 0)
        if self.probe.verdict is False and self.cpu_active:
            self.cpu_active = False
            log.warning("the CPU replica made training slower (median %.0f against %.0f samples/s "
                        "without it): training on %s alone", sorted(self.probe.rates["on"])[len(
                            self.probe.rates["on"]) // 2], sorted(self.probe.rates["off"])[len(
                                self.probe.rates["off"]) // 2], self.accel)

    def _sync(self) -> None:
        if self.accel.type == "cuda":
            torch.cuda.synchronize(self.accel)

    def train_epoch(self) -> dict:
        """One pass over the loader. Samples count when trained; NC's batch in progress at
        the end counts in the next epoch (the accelerator does not wait for it)."""
        t0 = time.perf_counter()
        before = dict(self.samples)
        self._losses = {"accel": [0.0, 0], "cpu": [0.0, 0]}
        self._given = {"accel": 0, "cpu": 0}
        for x, y in self.loader:
            self.step(x, y)
        self._reap()
        self._take_offer()
        dt = time.perf_counter() - t0
        trained = {k: self.samples[k] - before[k] for k in self.samples}
        n = sum(trained.values())
        loss_sum = sum(float(s) for s, _ in self._losses.values())
        return {"samples": n, "seconds": dt, "samples_per_s": n / dt if dt else 0.0,
                "samples_accel": trained["accel"], "samples_cpu": trained["cpu"],
                "loss": loss_sum / max(1, sum(c for _, c in self._losses.values())),
                "cpu_active": self.cpu_active, "gain": self.gain, "merges": self.merges,
                "probe": {"verdict": self.probe.verdict, **self.probe.rates}}

    def _wait_idle(self, timeout: float = 600.0) -> None:
        """Serve NC's offers until it has finished every job (the end of training)."""
        deadline = time.monotonic() + timeout
        while True:
            self._reap()
            self._take_offer()
            if self._outstanding == 0:
                return
            if time.monotonic() > deadline:
                raise TimeoutError("the CPU replica did not finish its jobs")
            if self._done.acquire(timeout=0.005):
                self._done.release()

    def finish(self) -> None:
        """Wait for NC's batch in progress and merge it: both replicas then hold one model."""
        self._wait_idle()
        self._merge_asked = True
        self._give(_LAST_MERGE)
        self._wait_idle()

    @property
    def model(self) -> torch.nn.Module:
        """The accelerator's replica: the model with every merge so far."""
        return self.ng

    # ---- the CPU thread -----------------------------------------------------------------------
    def _cpu_loop(self) -> None:
        torch.set_num_threads(self.cpu_threads)  # per thread in some torch builds
        while True:
            job = self._jobs.get()
            if job is _STOP:
                return
            try:
                if job in (_MERGE, _LAST_MERGE):
                    self._offer_and_load(snapshot=job is _LAST_MERGE or self._snapshot_due())
                else:
                    self._cpu_step(*job)
            except BaseException as e:  # handed to the caller's thread at its next step
                log.exception("CPU replica: job failed")
                self._error = e
            finally:
                self._done.release()

    def _cpu_step(self, x, y) -> None:
        self.opt_c.zero_grad()
        loss = self.loss_fn(self.nc(x), y)
        loss.backward()
        self.opt_c.step()
        acc = self._losses["cpu"]
        acc[0] += float(loss.detach()) * len(y)
        acc[1] += len(y)
        self._n_c += len(y)
        self.samples["cpu"] += len(y)

    @torch.no_grad()
    def _offer_and_load(self, snapshot: bool) -> None:
        state = list(self.nc.state_dict().values())
        for host, t in zip(self._host, state):
            host.copy_(t)
        ready = None
        if self._side is not None:
            with torch.cuda.stream(self._side):
                for dev, host in zip(self._dev, self._host):
                    dev.copy_(host, non_blocking=True)
                ready = torch.cuda.Event()
                ready.record(self._side)
        n_c, self._n_c = self._n_c, 0
        self._offer = (n_c, ready)
        iteration, done = self._merged.get()
        if done is not None:
            done.synchronize()
        for t, host in zip(state, self._host):
            t.copy_(host)
        if snapshot and self.writer is not None:
            self._last_snapshot = time.monotonic()
            self.writer.submit(iteration, dict(zip(self._names, self._host)))

    # ---- resume and close -----------------------------------------------------------------------
    def resume(self) -> int | None:
        """Load the newest complete snapshot into both replicas; its iteration, or None."""
        if not self.snapshot_dir:
            return None
        snap = SnapshotWriter.latest(self.snapshot_dir)
        if snap is None:
            return None
        self._wait_idle()
        self.nc.load_state_dict(snap["state"])
        self.ng.load_state_dict(snap["state"])
        self.iteration = int(snap["iteration"])
        return self.iteration

    def close(self) -> None:
        """finish(), stop the CPU thread, write the last snapshot."""
        if self._thread.is_alive():
            try:
                self.finish()
            finally:
                self._jobs.put(_STOP)
                self._thread.join()
        if self.writer is not None:
            self.writer.close()
