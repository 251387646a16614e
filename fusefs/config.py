"""The mount's settings: one frozen object that the CLI, mount.serve and the core share, with
the defaults and their checks in one place."""
from __future__ import annotations

import os
import signal
from dataclasses import dataclass

from .errors import UserError

CACHE_SIZE = "256MiB"  # the --cache-size default, as the CLI shows it
# the signals that stop a mount (each asks for the unmount: mount.Stops)
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class ConfigError(UserError):
    pass


def presented_modes(modes, file_mode: int | None, umask: int | None):
    """The permission bits shown for packed modes (an array): file_mode instead of each
    (if given), less the umask's bits. The array itself when nothing changes it."""
    import numpy as np
    if file_mode is None and not umask:
        return modes
    out = np.full_like(modes, file_mode) if file_mode is not None else modes.copy()
    if umask:
        out &= ~np.asarray(umask, dtype=out.dtype)
    return out


MAX_FAST_THREADS = 64  # (fusefs/_fastpath.h's FUSEFS_MAX_THREADS)


def default_fast_threads() -> int:
    """The fast path's threads by default: one for every 16 cores this process may run on, 1
    to 8 (a 16-core node: 1, a 64-core node: 4). On a 16-core node one thread read as fast as
    four and spent 28-32 us of CPU per cached sample against their 42-43 (docs/BENCHMARKS.md,
    "The GPU node"); one thread answers about 30,000 samples/s, so larger nodes get more."""
    return max(1, min(8, len(os.sched_getaffinity(0)) // 16))


@dataclass(frozen=True)
class MountConfig:
    cache_bytes: int = 256 << 20      # the sample cache's budget
    static_bytes: int = 0             # of it, kept for the highest importance across epochs
    readahead: int | None = None      # bytes ahead of the readers (None: the core's default)
    per_node: int = 4                 # backend requests in flight per storage node
    batch: int = 16                   # samples per backend request
    retries: int = 4                  # of a failed backend read (doubling backoff from 0.1 s)
    io_timeout: float = 300.0         # s a read waits for a node that does not answer (0: soft)
    kernel_cache: bool = True         # push fetched samples into the kernel page cache
    fast_path: bool = True            # opens and releases answered in C (needs the fast patch)
    fast_threads: int | None = None   # threads of the fast path (None: default_fast_threads())
    willneed: bool = True             # posix_fadvise WILLNEED a request's reads at once
    control_gid: int | None = None    # a group that may set orders too
    order_bytes: int | None = None    # what every rank's orders may hold (None: orders.default_budget)
    local_dir: str | None = None      # the local cache tier's folder
    local_bytes: int = 0              # and its budget
    metrics_port: int | None = None   # serve Prometheus metrics over HTTP on this port
    metrics_address: str = "127.0.0.1"  # ... on this address
    uid: int | None = None            # the files' owner (None: the daemon's user)
    gid: int | None = None            # and group (None: the daemon's group)
    umask: int | None = None          # bits taken from the packed modes
    file_mode: int | None = None      # every file's mode instead of its packed one (then umask)
    dir_mode: int | None = None       # every folder's mode instead of its packed one (then umask)

    def __post_init__(self):
        for name, least in (("per_node", 1), ("batch", 1), ("retries", 0), ("cache_bytes", 0),
                            ("static_bytes", 0), ("local_bytes", 0)):
            if getattr(self, name) < least:
                raise ConfigError(f"{name.replace('_', '-')} must be at least {least}, "
                                  f"got {getattr(self, name)}")
        if self.static_bytes > self.cache_bytes:
            raise ConfigError(f"the static cache ({self.static_bytes} bytes) is more than the cache "
                              f"budget ({self.cache_bytes} bytes)")
        if not self.io_timeout >= 0:
            raise ConfigError(f"io-timeout must not be negative, got {self.io_timeout}")
        if self.fast_threads is not None and not 1 <= self.fast_threads <= MAX_FAST_THREADS:
            raise ConfigError(f"fast-threads must lie in [1, {MAX_FAST_THREADS}], got {self.fast_threads}")
        if self.order_bytes is not None and self.order_bytes < 0:
            raise ConfigError(f"order-memory must not be negative, got {self.order_bytes}")
        if self.readahead is not None and self.readahead < 0:
            raise ConfigError(f"readahead must not be negative, got {self.readahead}")
        if self.metrics_port is not None and not 0 <= self.metrics_port < 65536:
            raise ConfigError(f"metrics-port must lie in [0, 65535], got {self.metrics_port}")
        for name in ("umask", "file_mode", "dir_mode"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= 0o777:
                raise ConfigError(f"{name.replace('_', '-')} must be an octal mode within 0777, got {value:o}")
        for name in ("uid", "gid"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise ConfigError(f"{name} must not be negative")
        if self.local_bytes and self.local_dir is None:
            raise ConfigError("a local cache size needs a local cache folder")


DEFAULTS = MountConfig()
