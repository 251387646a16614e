"""torchvision's ImageFolder + DataLoader(num_workers=2), run by Debian's /usr/bin/python3."""
import json
import os
import subprocess
import sys

import pytest

from fusefs.pack import pack
from testkit.synth import make_imagefolder

from testkit.mounts import running_mount

from conftest import REPO, read_with_imagefolder

SYSTEM_PYTHON = "/usr/bin/python3"
_read = read_with_imagefolder


@pytest.fixture(scope="module")
def jpegs(tmp_path_factory):
    base = tmp_path_factory.mktemp("jpegs")
    make_imagefolder(str(base / "src"), 240, n_classes=6, mean_bytes=20_000, seed=3)
    pack(str(base / "src"), str(base / "dst"), chunk_bytes=1 << 20, progress=False)
    return base


def test_imagefolder_reads_identical_bytes_through_the_mount(jpegs, tmp_path):
    with running_mount(jpegs / "dst", tmp_path / "mnt"):
        through = _read(tmp_path / "mnt")
    direct = _read(jpegs / "src")
    assert through["classes"] == direct["classes"] and len(through["classes"]) == 6
    assert through["n"] == direct["n"] == 240
    assert through["files"] == direct["files"]
    assert through["delivered"] == direct["delivered"]
    assert through["epochs"][0]["samples"] == 240


def test_imagefolder_decodes_identical_images(jpegs, tmp_path):
    with running_mount(jpegs / "dst", tmp_path / "mnt"):
        through = _read(tmp_path / "mnt", "--decode", "--batch", "1")
    direct = _read(jpegs / "src", "--decode", "--batch", "1")
    assert through["epochs"][0]["samples"] == 240
    assert through["epochs"][0]["tensor_sum"] == direct["epochs"][0]["tensor_sum"] != 0


def test_imagefolder_batches_training_crops_and_reports_its_cpu(jpegs, tmp_path):
    """bench_node.py's decoded loader: RandomResizedCrop lets images of several sizes batch;
    each epoch reports the CPU seconds of the loader's processes and how busy the cores were."""
    with running_mount(jpegs / "dst", tmp_path / "mnt", "--cache-size", "120%"):
        r = _read(tmp_path / "mnt", "--decode", "--size", "32", "--batch", "16", "--shuffle",
                  "--epochs", "2", "--no-digests")
    assert [e["samples"] for e in r["epochs"]] == [240, 240]
    for e in r["epochs"]:
        assert e["tensor_sum"] > 0
        assert e["cpu_s"] > 0 and 0 < e["busy"] <= 1


def test_bench_node_compares_loose_files_fusefs_and_the_minimal_daemons(tmp_path):
    """scripts/bench/bench_node.py end to end at a tiny scale (the GPU node runs it as is):
    a row per system (fusefs with its fast path on the default threads and on one, and
    without it, and read without an order; the minimal daemons in pyfuse3 and in C), each
    mount's ratio to the loose files, the daemons' requests, and no sample fetched by fusefs
    once its cache holds the set."""
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "bench", "bench_node.py"),
                        "--files", "120", "--workers", "2", "--loaders", "raw", "--epochs", "1",
                        "--python", SYSTEM_PYTHON, "--out", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = {row["system"]: row for row in json.load(open(out / "bench_node.json"))["rows"]}
    assert set(rows) == {"loose", "fusefs", "fusefs_n1", "fusefs_python", "fusefs_shuffle", "minimal", "minimal_c"}
    assert all(row["samples_per_s"][0] > 0 for row in rows.values())
    assert rows["fusefs_n1"]["fast_threads"] == 1 and rows["fusefs"]["fast_threads"] >= 1
    assert "fast_threads" not in rows["fusefs_python"]
    for system in ("fusefs", "fusefs_n1", "fusefs_python", "fusefs_shuffle", "minimal", "minimal_c"):
        assert rows[system]["ratio_to_loose"] > 0
        assert rows[system]["requests_per_sample"]["open"] >= 1.0
        assert rows[system]["daemon_cpu_us_per_sample"] > 0
    fusefs = ("fusefs", "fusefs_n1", "fusefs_python", "fusefs_shuffle")
    assert all(rows[s]["fetched_samples"] == 0 for s in fusefs)
    # HintedSampler hands the mount an order for the epoch; torch's shuffle hands it none
    assert all(rows[s]["hinted"] and rows[s]["orders_accepted"] >= 1 for s in fusefs[:3])
    assert not rows["fusefs_shuffle"]["hinted"] and rows["fusefs_shuffle"]["orders_accepted"] == 0
    assert (out / "bench_node.png").stat().st_size > 0
    assert not os.path.ismount(out / "mnt")
    # each row also went out as a JSON line as it was measured, with where it came from
    lines = [json.loads(x) for x in open(out / "bench_node.jsonl")]
    assert [x["system"] for x in lines] == ["loose", *fusefs, "minimal", "minimal_c"]
    for x in lines:
        assert x["samples_per_s"] == rows[x["system"]]["samples_per_s"]
        assert x["commit"] and x["date"].startswith("20") and "cores, kernel " in x["machine"]
        assert x["command"].startswith("scripts/bench/bench_node.py --files 120")
