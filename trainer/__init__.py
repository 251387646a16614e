"""Training-side helpers for fusefs mounts (this package, not fusefs, imports torch)."""
from .hints import HintedSampler, find_mount, paths_to_ids, write_order

__all__ = ["HintedSampler", "find_mount", "paths_to_ids", "write_order"]
