"""Training-side helpers for fusefs mounts (this package, not fusefs, imports torch)."""
from .hints import HintedSampler, find_mount, mount_chunks, mount_stats, paths_to_ids, write_order
from .hybrid import HybridTrainer, OnOffProbe, SnapshotWriter, average_into, cpu_gain, weighted_average
from .importance import ImportanceSampler, LossTracker, WithIndex, reevaluate, split_fluctuating
from .orders import chunk_block_order, echo_order
from .swap import SwapHooks, SwapScheduler

__all__ = ["HintedSampler", "HybridTrainer", "OnOffProbe", "SnapshotWriter", "average_into", "cpu_gain",
           "weighted_average", "ImportanceSampler", "LossTracker", "WithIndex", "chunk_block_order",
           "echo_order", "find_mount", "mount_chunks", "mount_stats", "paths_to_ids", "reevaluate",
           "split_fluctuating", "write_order", "SwapHooks", "SwapScheduler"]
