"""Per-sample losses (trainer/losses.py, no torch): the variance over the window of epochs,
and the KMeans split of the fluctuating samples from the stable ones."""
import sys

import numpy as np

from trainer.losses import LossTracker, split_fluctuating


def _histories(n_stable=900, n_fluct=100, epochs=3, seed=0):
    """Loss histories with a known answer: stable samples drift by little, fluctuating
    ones jump between high and low losses."""
    rng = np.random.default_rng(seed)
    n = n_stable + n_fluct
    fluct = np.zeros(n, dtype=bool)
    fluct[rng.choice(n, n_fluct, replace=False)] = True
    tracker = LossTracker(n, window=epochs)
    base = rng.uniform(0.05, 2.0, n)
    for e in range(epochs):
        loss = base + rng.normal(0, 0.01, n)
        loss[fluct] = np.where((np.arange(n_fluct) + e) % 2, 3.0, 0.1) + rng.normal(0, 0.2, n_fluct)
        tracker.record(np.arange(n), loss)
        tracker.end_epoch()
    return tracker, fluct


def test_variance_over_the_window_is_numpys():
    tracker, _ = _histories(epochs=3)
    assert np.allclose(tracker.variance(), np.var(tracker.history, axis=0), atol=1e-6)
    half = LossTracker(4, window=3)
    half.record([0, 1], [1.0, 2.0])
    half.end_epoch()
    assert np.all(half.variance() == 0)  # one epoch known: no variance yet


def test_kmeans_split_finds_the_fluctuating_samples():
    tracker, fluct = _histories()
    got = split_fluctuating(tracker.variance())
    assert np.array_equal(got, fluct)
    assert not split_fluctuating(np.full(50, 0.3)).any()  # all alike: nothing fluctuates


def test_losses_import_without_torch():
    import subprocess
    r = subprocess.run([sys.executable, "-c", "import sys, trainer.losses; assert 'torch' not in sys.modules"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
