"""Latency histograms of the daemon (a read's wait for a fetch, a backend request), for the
statistics and the metrics."""
from __future__ import annotations

import bisect


class Histogram:
    """Counts of observed seconds by bucket (cumulative when exported), the buckets from
    10 us to 30 s, a few per decade: a read's wait for a fetch and a backend request (the
    metrics export it as a Prometheus histogram)."""

    BOUNDS = (1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0)

    def __init__(self):
        self.counts = [0] * (len(self.BOUNDS) + 1)  # (the last: above every bound)
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(self.BOUNDS, seconds)] += 1
        self.sum += seconds

    def snapshot(self) -> dict:
        return {"bounds": list(self.BOUNDS), "counts": list(self.counts), "sum": round(self.sum, 6)}
