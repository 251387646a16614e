"""A value made at most every so often: what the control files and the metrics server
render from the statistics for callers who may ask in a loop."""
from __future__ import annotations

import math
import threading
import time
from typing import Callable


def throttled(make: Callable[[], object], every: float) -> Callable[..., object]:
    """make, called at most every `every` seconds: get() returns its last result in between,
    get(fresh=True) calls it anyway. Thread-safe (the metrics server's threads share one)."""
    lock, last = threading.Lock(), {"at": -math.inf, "value": None}

    def get(fresh: bool = False):
        with lock:
            now = time.monotonic()
            if fresh or now - last["at"] >= every:
                last["value"], last["at"] = make(), now
            return last["value"]
    return get
