"""Training-side accelerator methods that have nothing to do with the mount: CPU+GPU
co-training (hybrid.py) and activation swapping within a memory budget (swap.py), which need
torch, and their pure parts (probe.py: when the CPU replica helps; qplan.py: the swap plan's
learning), which need numpy only. docs/TRAINER.md describes both. Names are loaded when first
used, so `trainer.accel.qplan` imports without torch."""
from __future__ import annotations

import importlib

_WHERE = {"HybridTrainer": ".hybrid", "SnapshotWriter": ".hybrid", "average_into": ".hybrid",
          "OnOffProbe": ".probe", "cpu_gain": ".probe",
          "PinnedPool": ".swap", "SwapHooks": ".swap", "SwapScheduler": ".swap",
          "PlanLearner": ".qplan"}

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module 'trainer.accel' has no attribute {name!r}")
    value = getattr(importlib.import_module(where, __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_WHERE))
