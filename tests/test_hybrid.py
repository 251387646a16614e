"""CPU+accelerator co-training (issue 6): R and the split, the weighted average, snapshots
that never hold training up and never leave a half-written file, exact resume. Runs with
two CPU replicas here (the second standing in for the accelerator)."""
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from torch import nn

from trainer import HybridTrainer, SnapshotWriter, cpu_share, split_sizes, weighted_average

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
    torch.manual_seed(0)
    return HybridTrainer(small_net, lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
                         nn.CrossEntropyLoss(), data(), accel="cpu",
                         snapshot_dir=str(tmp_path) if tmp_path else None, **kw)


def test_share_and_split_from_given_times():
    assert cpu_share(3.0, 1.0) == 0.25  # the CPU is 3x slower: a quarter of each batch
    assert split_sizes(64, 0.25) == (16, 48)
    assert split_sizes(64, cpu_share(1.0, 1.0)) == (32, 32)
    assert split_sizes(64, 0.001) == (1, 63) and split_sizes(64, 0.999) == (63, 1)  # never 0
    assert split_sizes(10, 0.26) == (3, 7)
    assert split_sizes(64, 0.001, min_part=2) == (2, 62)  # BatchNorm trains on 2 or more
    with pytest.raises(ValueError):
        split_sizes(1, 0.5)
    with pytest.raises(ValueError):
        split_sizes(3, 0.5, min_part=2)
    with pytest.raises(ValueError):
        cpu_share(0.0, 1.0)


def test_weighted_average_is_exact_including_batchnorm_buffers():
    a, b = small_net(), small_net()
    with torch.no_grad():
        for t in a.state_dict().values():
            t.fill_(1) if t.is_floating_point() else t.fill_(10)
        for t in b.state_dict().values():
            t.fill_(3) if t.is_floating_point() else t.fill_(30)
    merged = weighted_average(a.state_dict(), b.state_dict(), 0.25)
    assert set(merged) == set(a.state_dict())
    for name, t in merged.items():
        want = 2.5 if t.is_floating_point() else 25  # 0.25 * 1 + 0.75 * 3; 0.25 * 10 + 0.75 * 30
        assert t.dtype == a.state_dict()[name].dtype
        assert torch.equal(t, torch.full_like(t, want)), name
    assert "1.running_var" in merged and "1.num_batches_tracked" in merged


def test_training_with_two_cpu_replicas_learns_and_merges(tmp_path):
    ht = trainer(tmp_path, merge_every=3)
    r = ht.calibrate()
    assert 0 < r < 1 and ht.tc > 0 and ht.tg > 0
    first = ht.train_epoch()
    for _ in range(4):
        last = ht.train_epoch()
    assert last["loss"] < first["loss"] * 0.8
    assert ht.merges >= 5 * (8 // 3)
    for (n1, t1), (n2, t2) in zip(ht.nc.state_dict().items(), ht.ng.state_dict().items()):
        assert torch.equal(t1, t2), n1  # one model after the epoch's final merge
    ht.close()
    assert 1 <= len(SnapshotWriter.snapshots(str(tmp_path))) <= 3


def test_a_slow_snapshot_writer_does_not_slow_the_steps(tmp_path):
    def slow_save(payload, f):
        time.sleep(0.3)
        torch.save(payload, f)

    rates = {}
    for name, writer in (("without", None), ("with", SnapshotWriter(str(tmp_path), write=slow_save))):
        ht = trainer(merge_every=1, snapshot_writer=writer)
        ht.train_epoch()  # warm-up
        t0 = time.perf_counter()
        steps = 0
        for _ in range(3):
            steps += len(ht.loader)
            ht.train_epoch()
        rates[name] = steps / (time.perf_counter() - t0)
        if writer is not None:
            assert writer.replaced > 0  # snapshots came faster than the disk: newest kept
            ht.close()
    ratio = rates["with"] / rates["without"]
    print(f"steps/s without snapshots {rates['without']:.0f}, with a 0.3 s writer "
          f"{rates['with']:.0f}: ratio {ratio:.2f}")
    # a writer in the step would cost 0.3 s per merge: 24+ merges, 7 s or more
    assert ratio > 0.5


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
        p.wait()
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
