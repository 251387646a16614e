"""The measured parts of CPU+accelerator co-training, without torch: what a CPU replica
adds (`cpu_gain`) and whether it speeds training up at all (`OnOffProbe`). hybrid.py's
HybridTrainer uses both."""
from __future__ import annotations

import time


def cpu_gain(tc: float, tg: float) -> float:
    """What the CPU replica adds to the accelerator's throughput: TG / TC, from the seconds
    per batch of each (0.1: the CPU trains a tenth as many samples as the accelerator)."""
    if tc <= 0 or tg <= 0:
        raise ValueError(f"batch times must be positive, got TC={tc}, TG={tg}")
    return tg / tc


class OnOffProbe:
    """Whether the CPU replica speeds training up, measured: alternate windows of `batches`
    batches with the CPU replica allowed and not (on, off, on, off, ...), each window's
    samples per second of wall time; the CPU stays on only if the median "on" rate beats the
    median "off" rate by min_gain. Calibration times each replica alone; this catches what
    it cannot see: the CPU replica taking cores from the loader's workers, from the caller's
    thread or (with a CPU standing in for the accelerator) from the other replica, or the
    GIL. Caller's thread only."""

    def __init__(self, windows: int = 4, batches: int = 8, min_gain: float = 0.02, clock=time.perf_counter):
        self.plan = ["on" if i % 2 == 0 else "off" for i in range(windows)]
        self.batches = max(1, batches)
        self.min_gain = min_gain
        self.clock = clock
        self.rates: dict[str, list[float]] = {"on": [], "off": []}
        self.verdict: bool | None = None  # None while measuring
        self._n = self._samples = 0
        self._t0 = None

    @property
    def cpu_allowed(self) -> bool:
        return self.verdict if self.verdict is not None else self.plan[0] == "on"

    def count(self, samples: int, sync=None, cpu_busy: bool = False) -> None:
        """One batch handed out; sync() (the accelerator's) before a window's clock reads.
        cpu_busy: the CPU replica still has work given to it. An "off" window starts only
        once it has none: the tail of a batch given in the "on" window before would slow
        the "off" window down and count against it."""
        if self.verdict is not None:
            return
        if self._t0 is None:
            if cpu_busy and self.plan[0] == "off":
                return
            if sync:
                sync()
            self._t0 = self.clock()
            return  # a window starts after its first batch: the clock needs a start
        self._n += 1
        self._samples += samples
        if self._n < self.batches:
            return
        if sync:
            sync()
        now = self.clock()
        self.rates[self.plan.pop(0)].append(self._samples / max(now - self._t0, 1e-9))
        self._n = self._samples = 0
        self._t0 = None if cpu_busy and self.plan and self.plan[0] == "off" else now
        if not self.plan:
            on, off = (sorted(r)[len(r) // 2] for r in (self.rates["on"], self.rates["off"]))
            self.verdict = on >= off * (1 + self.min_gain)
