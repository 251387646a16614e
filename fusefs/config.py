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


def _at_least(section, names_least) -> None:
    for name, least in names_least:
        if getattr(section, name) < least:
            raise ConfigError(f"{name.replace('_', '-')} must be at least {least}, "
                              f"got {getattr(section, name)}")


@dataclass(frozen=True)
class FetchConfig:
    """How samples are read from the storage nodes (fetch.Fetcher, store.ChunkStore; the
    index is read with these retries too, at least mount.INDEX_RETRIES)."""
    per_node: int = 4                 # backend requests in flight per storage node
    batch: int = 16                   # samples per backend request
    retries: int = 4                  # of a failed backend read (doubling backoff from 0.1 s)
    io_timeout: float = 300.0         # s a read waits for a node that does not answer (0: soft)
    willneed: bool = True             # posix_fadvise WILLNEED a request's reads at once

    def __post_init__(self):
        _at_least(self, (("per_node", 1), ("batch", 1), ("retries", 0)))
        if not self.io_timeout >= 0:
            raise ConfigError(f"io-timeout must not be negative, got {self.io_timeout}")


@dataclass(frozen=True)
class FilesConfig:
    """The owner and permission bits the files and folders show (core.Core)."""
    uid: int | None = None            # the files' owner (None: the daemon's user)
    gid: int | None = None            # and group (None: the daemon's group)
    umask: int | None = None          # bits taken from the packed modes
    file_mode: int | None = None      # every file's mode instead of its packed one (then umask)
    dir_mode: int | None = None       # every folder's mode instead of its packed one (then umask)

    def __post_init__(self):
        for name in ("umask", "file_mode", "dir_mode"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= 0o777:
                raise ConfigError(f"{name.replace('_', '-')} must be an octal mode within 0777, got {value:o}")
        for name in ("uid", "gid"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise ConfigError(f"{name} must not be negative")


@dataclass(frozen=True)
class FastPathConfig:
    """The dataset files' requests answered in C (fastpath.py)."""
    enabled: bool = True              # (needs the binding's fast patch)
    threads: int | None = None        # threads reading /dev/fuse (None: default_fast_threads())
    miss_engine: bool = True          # misses read and answered in C while no order is in force (misses.py)

    def __post_init__(self):
        if self.threads is not None and not 1 <= self.threads <= MAX_FAST_THREADS:
            raise ConfigError(f"fast-threads must lie in [1, {MAX_FAST_THREADS}], got {self.threads}")


@dataclass(frozen=True)
class LocalConfig:
    """The local cache tier (local.LocalTier): off without a folder."""
    dir: str | None = None            # its folder
    bytes: int = 0                    # and its budget

    def __post_init__(self):
        _at_least(self, (("bytes", 0),))
        if self.bytes and self.dir is None:
            raise ConfigError("a local cache size needs a local cache folder")


@dataclass(frozen=True)
class MetricsConfig:
    """Prometheus metrics over HTTP (metrics.serve_http): off without a port."""
    port: int | None = None
    address: str = "127.0.0.1"

    def __post_init__(self):
        if self.port is not None and not 0 <= self.port < 65536:
            raise ConfigError(f"metrics-port must lie in [0, 65535], got {self.port}")


@dataclass(frozen=True)
class MountConfig:
    """The whole mount's settings, checked when made; each part takes its own section."""
    cache_bytes: int = 256 << 20      # the sample cache's budget
    static_bytes: int = 0             # of it, kept for the highest importance across epochs
    readahead: int | None = None      # bytes ahead of the readers (None: the core's default)
    order_bytes: int | None = None    # what every rank's orders may hold (None: orders.default_budget)
    kernel_cache: bool = True         # the kernel page cache holds fetched samples (kernel_view.py)
    control_gid: int | None = None    # a group that may set orders too
    fetch: FetchConfig = FetchConfig()
    files: FilesConfig = FilesConfig()
    fast_path: FastPathConfig = FastPathConfig()
    local: LocalConfig = LocalConfig()
    metrics: MetricsConfig = MetricsConfig()

    def __post_init__(self):
        _at_least(self, (("cache_bytes", 0), ("static_bytes", 0)))
        if self.static_bytes > self.cache_bytes:
            raise ConfigError(f"the static cache ({self.static_bytes} bytes) is more than the cache "
                              f"budget ({self.cache_bytes} bytes)")
        if self.order_bytes is not None and self.order_bytes < 0:
            raise ConfigError(f"order-memory must not be negative, got {self.order_bytes}")
        if self.readahead is not None and self.readahead < 0:
            raise ConfigError(f"readahead must not be negative, got {self.readahead}")

    # the sections' settings by their command-line names (`of`)
    SECTIONS = {"fetch": (FetchConfig, {"per_node": "per_node", "batch": "batch", "retries": "retries",
                                        "io_timeout": "io_timeout", "willneed": "willneed"}),
                "files": (FilesConfig, {"uid": "uid", "gid": "gid", "umask": "umask",
                                        "file_mode": "file_mode", "dir_mode": "dir_mode"}),
                "fast_path": (FastPathConfig, {"fast_path": "enabled", "fast_threads": "threads",
                                                      "miss_engine": "miss_engine"}),
                "local": (LocalConfig, {"local_dir": "dir", "local_bytes": "bytes"}),
                "metrics": (MetricsConfig, {"metrics_port": "port", "metrics_address": "address"})}

    @classmethod
    def of(cls, **settings) -> MountConfig:
        """A MountConfig from settings named as the command line names them (per_node=,
        fast_threads=, local_dir=, ...): each goes to its section."""
        sections = {}
        for section, (kind, names) in cls.SECTIONS.items():
            given = {field: settings.pop(name) for name, field in names.items() if name in settings}
            if given:
                sections[section] = kind(**given)
        return cls(**settings, **sections)


DEFAULTS = MountConfig()
