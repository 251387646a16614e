"""Prometheus metrics: `MNT/.fusefs/metrics` and `fusefs mount --metrics-port`, scraped from a
real mount after real reads and parsed with prometheus_client's own parser."""
import os
import socket
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from conftest import free_port, read_tree, refused_mount
from fusefs.client import mount_stats, write_order
from testkit.mounts import running_mount


def parse(text: str) -> dict:
    """{(sample name, frozenset(labels)): value} of an exposition."""
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def test_metrics_file_and_http_agree_with_the_stats(tricky, tmp_path):
    src, dst, files = tricky
    mnt = str(tmp_path / "mnt")
    port = free_port()
    with running_mount(dst, mnt, "--metrics-port", port):
        write_order(mnt, [0, 1, 2], epoch=4)
        tree = read_tree(mnt)
        assert {k: v for k, v in tree.items() if v is not None} == files_of(files)
        root_listing = os.listdir(mnt)
        stats = mount_stats(mnt)
        with open(os.path.join(mnt, ".fusefs", "metrics")) as f:
            m = parse(f.read())
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            h = parse(r.read().decode())
    for scraped in (m, h):
        assert scraped[("fusefs_opens_total", frozenset())] >= stats["opens"] >= len(files_of(files))
        assert scraped[("fusefs_cache_budget_bytes", frozenset())] == stats["cache_budget"]
        assert scraped[("fusefs_dataset_samples", frozenset())] == stats["samples"]
        assert scraped[("fusefs_daemon_cpu_seconds_total", frozenset())] > 0
        nodes = {dict(k[1])["node"] for k in scraped if k[0] == "fusefs_backend_bytes_total"}
        assert nodes == set(stats["nodes"]) and nodes
        assert sum(v for k, v in scraped.items() if k[0] == "fusefs_backend_bytes_total") > 0
        assert scraped[("fusefs_backend_node_up", frozenset({("node", "local")}))] == 1
        assert scraped[("fusefs_plan_epoch", frozenset({("rank", "0")}))] == 4
        assert scraped[("fusefs_plan_length", frozenset({("rank", "0")}))] == 3
        assert scraped[("fusefs_plan_skip_window", frozenset({("rank", "0")}))] == stats["plans"]["0"]["skip_window"] > 0
        assert ("fusefs_read_wait_seconds_count", frozenset()) in scraped
        # histograms (cumulative buckets from 10 us to 30 s), uptime, memory, version, mount
        requests = scraped[("fusefs_backend_request_seconds_count", frozenset())]
        assert requests == sum(n["requests"] for n in stats["nodes"].values()) > 0
        assert scraped[("fusefs_backend_request_seconds_bucket", frozenset({("le", "+Inf")}))] == requests
        assert scraped[("fusefs_backend_request_seconds_bucket", frozenset({("le", "1e-05")}))] <= requests
        assert scraped[("fusefs_uptime_seconds", frozenset())] > 0
        assert scraped[("fusefs_resident_memory_bytes", frozenset())] > 10 << 20
        from fusefs import __version__
        assert scraped[("fusefs_build_info", frozenset({("version", __version__)}))] == 1
        assert scraped[("fusefs_mount_info", frozenset({("mountpoint", mnt), ("source", dst)}))] == 1
        assert scraped[("fusefs_kernel_dropped_samples_total", frozenset())] >= stats["kernel_dropped"]
        assert scraped[("fusefs_fuse_requests_total", frozenset({("type", "open")}))] > 0
    assert ".fusefs" not in root_listing  # the control folder is reached by path, never listed


def files_of(files: dict) -> dict:
    return {os.path.normpath(k): v for k, v in files.items() if not k.endswith("/")}


def test_a_metrics_port_in_use_is_refused_before_mounting(tricky, tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        mnt = tmp_path / "mnt"
        mnt.mkdir()
        r = refused_mount(tricky[1], mnt, "--metrics-port", port, mnt=mnt)
    assert r.returncode == 2 and f"127.0.0.1:{port}" in r.stderr, r.stderr
    assert not os.path.ismount(mnt)
