"""CPU+accelerator co-training: the accelerator never waits for the CPU replica, merges
weigh the replicas by the samples they trained, a CPU too slow to help is left out,
snapshots never hold training up and never leave a half-written file, exact resume. Runs
with two CPU replicas here (one standing in for the accelerator)."""
import os
import signal
import subprocess
import sys
import textwrap
import threading

import pytest
import torch
from torch import nn

from trainer import (
    HybridTrainer,
    OnOffProbe,
    SnapshotWriter,
    average_into,
    cpu_gain,
)

from conftest import Clock

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def small_net():
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))


def data(n=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32,
                                       shuffle=True, generator=g)


def trainer(tmp_path=None, **kw):
    kw.setdefault("probe_windows", 0)  # the on/off probe has tests of its own
    torch.manual_seed(0)
    return HybridTrainer(small_net, lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
                         nn.CrossEntropyLoss(), data(), accel="cpu",
                         snapshot_dir=str(tmp_path) if tmp_path else None, **kw)


class Gate(nn.Module):
    """Passes its input through; blocks forward until `opened` is set (a CPU replica that
    takes as long as a test needs)."""

    def __init__(self):
        super().__init__()
        self.opened = threading.Event()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        assert self.opened.wait(30), "gate never opened"
        return x

    def __deepcopy__(self, memo):  # calibration's throwaway copies share the gate
        return self


def slow_cpu_trainer(cpu_gate, **kw):
    """The second model made (the CPU replica) starts with cpu_gate."""
    made = []

    def factory():
        made.append(1)
        net = small_net()
        return nn.Sequential(cpu_gate, net) if len(made) == 2 else nn.Sequential(nn.Identity(), net)
    kw.setdefault("probe_windows", 0)
    torch.manual_seed(0)
    return HybridTrainer(factory, lambda p: torch.optim.SGD(p, lr=0.1), nn.CrossEntropyLoss(), data(),
                         accel="cpu", **kw)


def test_the_accelerator_never_waits_for_the_cpu_replica():
    gate = Gate()
    ht = slow_cpu_trainer(gate, merge_every=2)
    first = ht.train_epoch()  # the CPU replica is stuck in its first batch all epoch
    assert gate.calls == 1 and not gate.opened.is_set()
    assert first["samples_cpu"] == 0 and first["samples_accel"] == 256 - 32
    assert ht.iteration == 7 and ht.merges == 0  # merges asked for wait for the CPU's offer
    gate.opened.set()
    second = ht.train_epoch()
    assert second["samples_cpu"] + second["samples_accel"] + first["samples"] <= 512
    # (when the released batch ends, in the second epoch or after it, is the scheduler's
    # choice: on a loaded machine the accelerator's 7 steps may all come first)
    ht.finish()
    assert ht.samples["cpu"] >= 32 and ht.merges >= 1
    ht.close()
    for (n1, t1), (n2, t2) in zip(ht.nc.state_dict().items(), ht.ng.state_dict().items()):
        assert torch.equal(t1, t2), n1  # close() merged the CPU's last batch


class Stall(nn.Module):
    """A replica's forward that costs `seconds` of the probe's clock (a Clock): the CPU
    replica's stands for the time it takes from the accelerator's loop (cores, the GIL),
    the accelerator's for its own step."""

    def __init__(self, clock, seconds):
        super().__init__()
        self.clock, self.seconds = clock, seconds

    def forward(self, x):
        self.clock.t += self.seconds
        return x

    def __deepcopy__(self, memo):  # calibration's throwaway copies share the clock
        return self


def stalled_trainer(clock, cpu_seconds, accel_seconds=0.001, **kw):
    """A trainer timed by clock, whose CPU replica's forward costs it cpu_seconds and the
    accelerator's accel_seconds."""
    made = []

    def factory():
        made.append(1)
        return nn.Sequential(Stall(clock, cpu_seconds if len(made) == 2 else accel_seconds), small_net())
    torch.manual_seed(0)
    return HybridTrainer(factory, lambda p: torch.optim.SGD(p, lr=0.1), nn.CrossEntropyLoss(), data(),
                         accel="cpu", clock=clock, **kw)


def test_a_cpu_too_slow_to_help_is_left_out():
    clock = Clock()  # (the CPU replica's step costs 0.25 s of it, the accelerator's 1 ms)
    ht = stalled_trainer(clock, cpu_seconds=0.25, calibration_batches=2)
    gain = ht.calibrate()
    assert gain == pytest.approx(0.004) and not ht.cpu_active
    row = ht.train_epoch()
    assert row["samples_cpu"] == 0 and row["samples_accel"] == 256
    ht.close()


def test_a_cpu_replica_that_slows_training_is_switched_off_by_the_probe():
    """The trainer acts on the probe's verdict: with the CPU replica's batches costing the
    probe's clock 20 ms each and the accelerator's 1 ms, "on" windows are slower than "off"
    ones, and after the probe's windows the CPU replica trains no more."""
    ht = stalled_trainer(Clock(), cpu_seconds=0.02, probe_windows=10, probe_batches=3)
    ht.gain = 0.5  # as if calibration had found it worth a third of the work
    give = ht._give

    def give_and_wait(job):  # each CPU batch done before the next: its 20 ms are charged in
        give(job)            # the window it was given in, however the threads are scheduled
        if isinstance(job, tuple):
            assert ht._done.acquire(timeout=60)
            ht._done.release()
    ht._give = give_and_wait
    for _ in range(20):  # (windows of 3 batches, 8 batches an epoch: a few epochs)
        ht.train_epoch()
        if ht.probe.verdict is not None:
            break
    row = ht.train_epoch()
    assert ht.probe.verdict is False and not ht.cpu_active, ht.probe.rates
    assert row["samples_cpu"] == 0 and row["samples_accel"] == 256
    ht.close()


def test_merges_weigh_replicas_by_samples_trained():
    ht = trainer(merge_every=1000)
    with torch.no_grad():
        for t in ht.nc.state_dict().values():
            t.fill_(1) if t.is_floating_point() else t.fill_(10)
        for t in ht.ng.state_dict().values():
            t.fill_(3) if t.is_floating_point() else t.fill_(30)
    ht._n_c, ht._n_g = 32, 96  # the CPU trained a quarter of the samples since the last merge
    ht.finish()
    for model in (ht.nc, ht.ng):
        for name, t in model.state_dict().items():
            want = 2.5 if t.is_floating_point() else 25  # 0.25 * 1 + 0.75 * 3; 0.25 * 10 + 0.75 * 30
            assert torch.equal(t, torch.full_like(t, want)), name
    ht.close()


def test_average_into_is_in_place_and_skips_a_zero_weight():
    a, b = [torch.zeros(3), torch.tensor(4)], [torch.ones(3), torch.tensor(8)]
    ids = [id(t) for t in a]
    average_into(a, b, 0.5)
    assert [id(t) for t in a] == ids and torch.equal(a[0], torch.full((3,), 0.5)) and int(a[1]) == 6
    average_into(a, b, 0.0)
    assert torch.equal(a[0], torch.full((3,), 0.5))


def test_training_with_two_cpu_replicas_learns_and_merges(tmp_path):
    ht = trainer(tmp_path, merge_every=3)
    gain = ht.calibrate()
    assert gain > 0.02 and ht.cpu_active and ht.tc > 0 and ht.tg > 0
    first = ht.train_epoch()
    for _ in range(4):
        last = ht.train_epoch()
    assert last["loss"] < first["loss"] * 0.8
    assert ht.samples["cpu"] >= 32 * 5 and ht.samples["accel"] >= 32 * 5  # both trained
    assert ht.merges >= 1
    ht.close()
    for (n1, t1), (n2, t2) in zip(ht.nc.state_dict().items(), ht.ng.state_dict().items()):
        assert torch.equal(t1, t2), n1  # one model after close()'s final merge
    # within snapshot_every (30 s) of the start: close()'s snapshot only, of that model
    assert ht.writer.written == 1 and len(SnapshotWriter.snapshots(str(tmp_path))) == 1
    assert torch.equal(SnapshotWriter.latest(str(tmp_path))["state"]["0.weight"], ht.ng.state_dict()["0.weight"])


def test_a_snapshot_writer_that_never_finishes_does_not_hold_up_the_steps(tmp_path):
    """Three epochs of merges while the writer is stuck in its first snapshot: every step
    is taken, and the snapshots that come meanwhile replace one another (newest kept)."""
    started, release = threading.Event(), threading.Event()

    def stuck_save(payload, f):
        started.set()
        assert release.wait(60), "the test never released the writer"
        torch.save(payload, f)

    writer = SnapshotWriter(str(tmp_path), write=stuck_save)
    ht = trainer(merge_every=1, snapshot_writer=writer, snapshot_every=0)
    try:
        # (the first snapshot comes with the first merge, once the CPU replica has done a
        # batch: an epoch of a busy machine may end before it has; epochs are counted, not
        # waited for)
        for _ in range(100):
            ht.train_epoch()
            if started.is_set():
                break
        assert started.is_set(), "no merge (and so no snapshot) in 100 epochs"
        rows = [ht.train_epoch() for _ in range(3)]
        while not writer.replaced and len(rows) < 100:  # (the next merges' snapshots)
            rows.append(ht.train_epoch())
        assert all(r["samples"] == 256 for r in rows)  # (with the writer in the step: stuck)
        assert writer.written == 0 and writer.replaced > 0
    finally:
        release.set()
        ht.close()
    assert writer.written >= 1


def test_a_killed_write_leaves_no_snapshot_that_resume_would_take(tmp_path):
    script = textwrap.dedent(f"""
        import sys, time, torch
        sys.path.insert(0, {REPO!r})
        from trainer import SnapshotWriter
        def save(payload, f):
            if payload["iteration"] == 2:  # write half, then hang until killed
                f.write(b"x" * 1000); f.flush(); print("writing", flush=True); time.sleep(60)
            torch.save(payload, f)
        w = SnapshotWriter({str(tmp_path)!r}, write=save)
        w.submit(1, {{"w": torch.ones(3)}}); w.wait()
        w.submit(2, {{"w": torch.full((3,), 2.0)}})
        time.sleep(60)
    """)
    p = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "writing"
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=60)
    names = sorted(os.listdir(tmp_path))
    assert names == ["snapshot-000000001.pt", "snapshot-000000002.pt.tmp"]
    snap = SnapshotWriter.latest(str(tmp_path))
    assert snap["iteration"] == 1 and torch.equal(snap["state"]["w"], torch.ones(3))
    SnapshotWriter(str(tmp_path)).close()  # a new writer clears the leftover
    assert os.listdir(tmp_path) == ["snapshot-000000001.pt"]


def test_resume_restores_parameters_exactly(tmp_path):
    ht = trainer(tmp_path, merge_every=2)
    ht.calibrate()
    ht.train_epoch()
    ht.close()
    want = {k: v.clone() for k, v in ht.nc.state_dict().items()}
    again = trainer(tmp_path)
    assert again.resume() == ht.iteration
    for model in (again.nc, again.ng):
        for name, t in model.state_dict().items():
            assert torch.equal(t, want[name]), name
    again.close()
    assert trainer(tmp_path / "empty").resume() is None


@pytest.mark.parametrize("tc, tg", [(2.0, 1.0), (4.0, 1.0), (1.0, 1.0)])
def test_the_cpu_replica_gets_its_share_tg_over_tc_plus_tg(tc, tg):
    """When NC is free at every batch, it is given batches until it has had R = TG / (TC +
    TG) of the epoch's (the part it keeps up with while both are busy), the rest go to NG:
    a CPU 2x slower than the accelerator gets a third, 4x slower a fifth, as fast a half."""
    ht = trainer()
    ht.cpu_active, ht.gain = True, cpu_gain(tc, tg)
    given = ht._given
    for _ in range(600):
        given["cpu" if ht._cpu_takes() else "accel"] += 1
    assert given["cpu"] == pytest.approx(600 * tg / (tc + tg), abs=1), given
    ht.close()
