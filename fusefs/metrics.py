"""The daemon's counters in the Prometheus text exposition format, for a dashboard to scrape:
`MNT/.fusefs/metrics`, and with `fusefs mount --metrics-port PORT` over HTTP (127.0.0.1 by
default). Both render one `Core.statistics()` snapshot; the HTTP server's thread asks the
event loop for it (`trio.from_thread`), never reading the core's state itself, and at most
every `every` seconds however often it is scraped. The server serves at most
MAX_CONNECTIONS connections at a time, on a pool of as many threads (never more, even while
a connection that was closed is still ending), and a connection must have sent its
request and taken its answer within REQUEST_S seconds of its accept, or a watchdog closes
it (a client that drips its headers holds a thread that long at most); a client past the
connections makes the oldest one go instead (it dawdles: a scrape takes milliseconds), so
drips cannot starve a scraper; one that finds no slot even then is turned away, never given
a thread.
"""
from __future__ import annotations

import socket
import socketserver
import threading
import time
from typing import Callable
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, generate_latest, make_wsgi_app
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
)

from . import __version__
from .throttle import throttled

# (stats key, metric name without the fusefs_ prefix, help): totals since the mount started
COUNTERS = (
    ("opens", "opens", "Files opened"),
    ("reads", "reads", "read() requests answered by the daemon (the kernel page cache answers the rest)"),
    ("bytes_served", "served_bytes", "Bytes returned by read() requests"),
    ("hits", "cache_hits", "Samples found in the daemon's cache or the kernel's"),
    ("pushed", "kernel_pushed_samples", "Samples pushed into the kernel page cache"),
    ("kernel_dropped", "kernel_dropped_samples",
     "Pushed samples whose pages the kernel was found to have dropped (a read reached the daemon)"),
    ("kernel_forgotten", "kernel_forgotten_samples",
     "Samples taken as held in the kernel page cache whose inode the kernel forgot (and their pages)"),
    ("misses", "cache_misses", "Samples fetched on demand (not read ahead)"),
    ("eio", "eio", "Reads answered with EIO"),
    ("evictions", "cache_evictions", "Samples evicted from the cache"),
    ("orders_accepted", "orders_accepted", "Order files committed"),
    ("orders_refused", "orders_refused", "Order files refused"),
    ("local_hits", "local_hits", "Samples read from the local cache tier"),
)
GAUGES = (
    ("cache_bytes", "cache_bytes", "Bytes of samples in the cache"),
    ("cache_reserved", "cache_reserved_bytes", "Bytes reserved for fetches under way"),
    ("cache_budget", "cache_budget_bytes", "The cache's byte budget"),
    ("cache_samples", "cache_samples", "Samples in the cache"),
    ("open_handles", "open_handles", "Files open now"),
    ("samples", "dataset_samples", "Samples in the packed dataset"),
    ("dataset_bytes", "dataset_bytes", "Bytes of the packed dataset"),
)
NODE_COUNTERS = (("requests", "backend_requests"), ("reads", "backend_reads"),
                 ("bytes", "backend_bytes"), ("samples", "backend_samples"),
                 ("errors", "backend_errors"), ("retries", "backend_retries"))


def _histogram(name: str, doc: str, h: dict) -> HistogramMetricFamily:
    """A statistics histogram (histogram.Histogram.snapshot) as Prometheus's, cumulative."""
    buckets, total = [], 0
    for bound, n in zip([*h["bounds"], float("inf")], h["counts"]):
        total += n
        buckets.append(("+Inf" if bound == float("inf") else repr(bound), total))
    return HistogramMetricFamily(name, doc, buckets=buckets, sum_value=h["sum"])


def families(s: dict):
    """Metric families of one statistics snapshot."""
    for key, name, doc in COUNTERS:
        yield CounterMetricFamily(f"fusefs_{name}", doc, value=s.get(key) or 0)
    for key, name, doc in GAUGES:
        yield GaugeMetricFamily(f"fusefs_{name}", doc, value=s.get(key) or 0)
    yield CounterMetricFamily("fusefs_daemon_cpu_seconds", "CPU time of the daemon, every thread "
                              "(getrusage)", value=s["cpu_s"])
    yield _histogram("fusefs_read_wait_seconds", "How long reads waited for a fetch under way",
                     s["read_wait_seconds"])
    yield _histogram("fusefs_backend_request_seconds", "How long backend requests (a batch of "
                     "reads on one node) took", s["backend_request_seconds"])
    yield GaugeMetricFamily("fusefs_uptime_seconds", "Seconds since the mount started", value=s["uptime_s"])
    yield GaugeMetricFamily("fusefs_resident_memory_bytes", "The daemon's resident memory",
                            value=s["rss_bytes"])
    build = InfoMetricFamily("fusefs_build", "The fusefs that serves the mount")
    build.add_metric([], {"version": __version__})
    yield build
    mount = s.get("mount")
    if mount:
        info = InfoMetricFamily("fusefs_mount", "The mount point and the packed folder it serves "
                                "(tells two mounts on one node apart)")
        info.add_metric([], {"mountpoint": mount["mountpoint"], "source": mount["source"]})
        yield info
    requests = CounterMetricFamily("fusefs_fuse_requests", "FUSE requests answered, by type",
                                   labels=["type"])
    for kind, n in s["requests"].items():
        requests.add_metric([kind], n)
    yield requests
    nodes = s["nodes"]
    for key, name in NODE_COUNTERS:
        fam = CounterMetricFamily(f"fusefs_{name}", f"Backend {key} per storage node", labels=["node"])
        for node, st in nodes.items():
            fam.add_metric([node], st[key])
        yield fam
    up = GaugeMetricFamily("fusefs_backend_node_up", "1 while the node answers, 0 once marked down",
                           labels=["node"])
    inflight = GaugeMetricFamily("fusefs_backend_inflight_requests", "Requests in flight per node",
                                 labels=["node"])
    for node, st in nodes.items():
        up.add_metric([node], 0 if st["down"] else 1)
        inflight.add_metric([node], st["inflight"])
    yield up
    yield inflight
    plan_gauges = {"cursor": ("fusefs_plan_cursor", "Position of the readers in the rank's order"),
                   "length": ("fusefs_plan_length", "Samples in the rank's order"),
                   "epoch": ("fusefs_plan_epoch", "The epoch of the rank's order"),
                   "ahead_ready": ("fusefs_plan_ahead_ready", "Samples ahead of the cursor cached now"),
                   "ahead_planned": ("fusefs_plan_ahead_planned", "Samples ahead of the cursor the read-ahead covers"),
                   "skip_window": ("fusefs_plan_skip_window",
                                   "Positions behind the furthest read before an unread one counts as skipped")}
    for key, (name, doc) in plan_gauges.items():
        fam = GaugeMetricFamily(name, doc, labels=["rank"])
        for rank, plan in s["plans"].items():
            fam.add_metric([rank], plan[key])
        yield fam


class _Collector:
    def __init__(self, snapshot: Callable[[], dict]):
        self.snapshot = snapshot

    def collect(self):
        yield from families(self.snapshot())


def registry(snapshot: Callable[[], dict]) -> CollectorRegistry:
    """A registry that renders snapshot() (the core's statistics) at every scrape."""
    reg = CollectorRegistry(auto_describe=False)
    reg.register(_Collector(snapshot))
    return reg


def exposition(stats: dict) -> bytes:
    """The text exposition of one snapshot (the control file `metrics`)."""
    return generate_latest(registry(lambda: stats))


MAX_CONNECTIONS = 8    # connections served at a time (a thread each)
REQUEST_S = 5.0        # a connection's request and answer, from its accept


EVICT_WAIT_S = 0.5     # a new connection's wait for the slot of one it made go


def _close(conn) -> None:
    """End a connection's reads and writes (its thread then finishes and frees its slot)."""
    try:
        conn.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


class _Handler(WSGIRequestHandler):
    timeout = REQUEST_S  # (each read and write; the watchdog bounds them together)

    def log_message(self, *args) -> None:  # (no line per scrape)
        pass


class _Server(socketserver.ThreadingMixIn, WSGIServer):
    daemon_threads = True

    def __init__(self, *args, **kwargs):
        from concurrent.futures import ThreadPoolExecutor
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        # (a slot is released as its connection ends, before its thread can have ended: on
        # a pool the next connection takes that thread, where a thread of its own would
        # make one more for a moment)
        self._pool = ThreadPoolExecutor(MAX_CONNECTIONS, thread_name_prefix="fusefs-metrics-conn")
        self._deadlines: dict = {}  # connection -> when the watchdog closes it
        self._lock = threading.Lock()
        self._closed = threading.Event()
        super().__init__(*args, **kwargs)
        threading.Thread(target=self._watch, name="fusefs-metrics-watch", daemon=True).start()

    def process_request(self, request, client_address) -> None:
        if not self._slots.acquire(blocking=False):
            # every slot taken: the oldest connection goes (a scrape takes milliseconds, so
            # the oldest is one that dawdles), and this one waits a moment for its slot, or
            # is turned away without a thread
            with self._lock:
                oldest = min(self._deadlines, key=self._deadlines.get, default=None)
            if oldest is not None:
                _close(oldest)
            if not self._slots.acquire(timeout=EVICT_WAIT_S):
                self.shutdown_request(request)
                return
        with self._lock:
            self._deadlines[request] = time.monotonic() + REQUEST_S
        try:
            self._pool.submit(self.process_request_thread, request, client_address)
        except BaseException:
            self._done(request)
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._done(request)

    def _done(self, request) -> None:
        with self._lock:
            self._deadlines.pop(request, None)
        self._slots.release()

    def _watch(self) -> None:
        """Close each connection still open REQUEST_S after its accept (its thread's read
        or write then ends), until the server closes."""
        while True:
            now = time.monotonic()
            with self._lock:
                late = [c for c, at in self._deadlines.items() if at <= now]
                for c in late:
                    del self._deadlines[c]
                wake = min(self._deadlines.values(), default=now + REQUEST_S)
            for c in late:
                _close(c)
            if self._closed.wait(max(0.01, wake - now)):
                return

    def server_close(self) -> None:
        self._closed.set()
        with self._lock:  # (the connections still open end now: their threads with them)
            open_now = list(self._deadlines)
        for c in open_now:
            _close(c)
        self._pool.shutdown(wait=False, cancel_futures=True)
        super().server_close()


def serve_http(snapshot: Callable[[], dict], port: int, address: str = "127.0.0.1", every: float = 0.25):
    """Serve /metrics on address:port from a thread of its own; snapshot() is called in the
    server's threads (at most every `every` seconds) and must hand the work to the event
    loop. Returns the server (shutdown() and server_close() stop it)."""
    server = make_server(address, port, make_wsgi_app(registry(throttled(snapshot, every))),
                         server_class=_Server, handler_class=_Handler)
    threading.Thread(target=server.serve_forever, name="fusefs-metrics", daemon=True).start()
    return server
