"""Training-side helpers for fusefs mounts.

Two parts, imported lazily (a name is loaded when first used):
- the mount's client side: `write_order`, `paths_to_ids`, `mount_stats`, ... (fusefs.client,
  numpy only) and `HintedSampler` (hints.py), `ImportanceSampler` and friends
  (importance.py), chunk-block and echo orders (orders.py), which need torch;
- the accelerator methods (trainer.accel: HybridTrainer, SwapScheduler, ...), which need
  torch and have nothing to do with the mount.

`import trainer; trainer.write_order(...)` works without torch installed.
"""
from __future__ import annotations

import importlib

_WHERE = {
    # the client side
    "find_mount": "fusefs.client", "mount_chunks": "fusefs.client", "mount_ids": "fusefs.client",
    "mount_stats": "fusefs.client", "paths_to_ids": "fusefs.client", "write_order": "fusefs.client",
    "HintedSampler": "trainer.hints",
    "ImportanceSampler": "trainer.importance", "LossTracker": "trainer.losses",
    "WithIndex": "trainer.importance", "reevaluate": "trainer.importance",
    "split_fluctuating": "trainer.losses",
    "chunk_block_order": "trainer.orders", "echo_order": "trainer.orders",
    # the accelerator methods
    "HybridTrainer": "trainer.accel.hybrid", "OnOffProbe": "trainer.accel.probe",
    "SnapshotWriter": "trainer.accel.hybrid", "average_into": "trainer.accel.hybrid",
    "cpu_gain": "trainer.accel.probe",
    "PinnedPool": "trainer.accel.swap", "SwapHooks": "trainer.accel.swap",
    "SwapScheduler": "trainer.accel.swap",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module 'trainer' has no attribute {name!r}")
    value = getattr(importlib.import_module(where), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_WHERE))
