"""Training-side accelerator methods that have nothing to do with the mount (they need
torch): CPU+GPU co-training (hybrid.py) and activation swapping within a memory budget
(swap.py). docs/TRAINER.md describes both."""
from .hybrid import HybridTrainer, OnOffProbe, SnapshotWriter, average_into, cpu_gain
from .swap import PinnedPool, SwapHooks, SwapScheduler

__all__ = ["HybridTrainer", "OnOffProbe", "PinnedPool", "SnapshotWriter", "SwapHooks", "SwapScheduler",
           "average_into", "cpu_gain"]
