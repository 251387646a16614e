"""Training-side helpers for fusefs mounts (this package, not fusefs, imports torch)."""
from .hints import HintedSampler, find_mount, paths_to_ids, write_order
from .importance import ImportanceSampler, LossTracker, WithIndex, reevaluate, split_fluctuating

__all__ = ["HintedSampler", "ImportanceSampler", "LossTracker", "WithIndex", "find_mount",
           "paths_to_ids", "reevaluate", "split_fluctuating", "write_order"]
