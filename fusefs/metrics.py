"""The daemon's counters in the Prometheus text exposition format, for a dashboard to scrape:
`MNT/.fusefs/metrics`, and with `fusefs mount --metrics-port PORT` over HTTP (127.0.0.1 by
default). Both render one `Core.statistics()` snapshot; the HTTP server's thread asks the
event loop for it (`trio.from_thread`), never reading the core's state itself, and at most
every `every` seconds however often it is scraped. The server serves at most
MAX_CONNECTIONS connections at a time, each a thread, and closes one that is idle for
CONNECTION_TIMEOUT seconds: a client past them is turned away, never given a thread.
"""
from __future__ import annotations

import socketserver
import threading
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
from .control import throttled

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
                   "ahead_planned": ("fusefs_plan_ahead_planned", "Samples ahead of the cursor the read-ahead covers")}
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


MAX_CONNECTIONS = 8        # connections served at a time (a thread each)
CONNECTION_TIMEOUT = 10.0  # seconds a connection may stay idle


class _Handler(WSGIRequestHandler):
    timeout = CONNECTION_TIMEOUT

    def log_message(self, *args) -> None:  # (no line per scrape)
        pass


class _Server(socketserver.ThreadingMixIn, WSGIServer):
    daemon_threads = True

    def __init__(self, *args, **kwargs):
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        super().__init__(*args, **kwargs)

    def process_request(self, request, client_address) -> None:
        if not self._slots.acquire(blocking=False):  # (all busy: turned away, no thread)
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


def serve_http(snapshot: Callable[[], dict], port: int, address: str = "127.0.0.1", every: float = 0.25):
    """Serve /metrics on address:port from a thread of its own; snapshot() is called in the
    server's threads (at most every `every` seconds) and must hand the work to the event
    loop. Returns the server (shutdown() and server_close() stop it)."""
    server = make_server(address, port, make_wsgi_app(registry(throttled(snapshot, every))),
                         server_class=_Server, handler_class=_Handler)
    threading.Thread(target=server.serve_forever, name="fusefs-metrics", daemon=True).start()
    return server
