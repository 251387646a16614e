"""Pack onto a real 3-brick GlusterFS volume, mount fusefs over it, check bytes and nodes."""
import collections
import errno
import json
import os
import shutil
import signal
import sys
import subprocess
import time
import uuid

import pytest

from fusefs.index import INDEX_NAME, Index
from fusefs.nodes import PATHINFO_XATTR, parse_pathinfo
from fusefs.pack import pack
from testkit.gluster import BRICKS, GLUSTER_SH as GLUSTER, GMNT, VOL, brick_pid, exited, own_pids
from trainer import mount_stats, write_order

from testkit.mounts import running_mount

from conftest import REPO, fusefs_cmd, read_tree


pytestmark = pytest.mark.gluster


@pytest.fixture(scope="session")
def volume():
    """The test bed's volume, mounted; taken down at the end only if this run made it."""
    existed = subprocess.run([GLUSTER, "exists"], capture_output=True, timeout=120).returncode == 0
    r = subprocess.run([GLUSTER, "up"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    try:
        yield GMNT
    finally:
        if not existed:
            subprocess.run([GLUSTER, "down"], capture_output=True, timeout=300)


def test_up_recovers_from_a_killed_run(volume):
    """A run killed outright (as a CI machine's leftovers) leaves a stale client mount
    (ENOTCONN on every access) and none of the test bed's brick processes (nor its
    glusterd, where it started one): `up` must start clean. Only the test bed's own
    processes are killed (own_pids), never others of the machine's by name."""
    keep = os.path.join(volume, f"keep-{uuid.uuid4().hex[:8]}")
    with open(keep, "wb") as f:
        f.write(b"survives")
    pids = own_pids()
    assert len(pids) >= 4, pids  # three bricks and the client at least
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    # `up` runs as soon as they are gone: it must not take a zombie for a running process
    deadline = time.monotonic() + 30
    while not all(exited(p) for p in pids):
        assert time.monotonic() < deadline, [p for p in pids if not exited(p)]
        time.sleep(0.05)
    try:  # (a dead client: ENOTCONN, or ECONNABORTED for a request caught in the abort)
        with pytest.raises(OSError) as e:
            os.stat(volume)
        assert e.value.errno in (errno.ENOTCONN, errno.ECONNABORTED), e.value
    finally:  # (up, whatever the check found: the run's other tests need the volume)
        r = subprocess.run([GLUSTER, "up"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    with open(keep, "rb") as f:
        assert f.read() == b"survives"
    os.unlink(keep)


def test_up_returns_once_the_client_reaches_a_restarted_brick(volume):
    """`up` after a brick was killed restarts it under the live client mount; files made
    right after must spread over all three bricks (a directory made before the client
    reconnects gets a layout without that brick: every file on the other two)."""
    os.kill(brick_pid(f"{BRICKS}/b2"), signal.SIGKILL)
    r = subprocess.run([GLUSTER, "up"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    d = os.path.join(volume, f"spread-{uuid.uuid4().hex[:8]}")
    try:
        os.mkdir(d)
        bricks = collections.Counter()
        for i in range(24):
            path = os.path.join(d, f"f{i}")
            with open(path, "wb") as f:
                f.write(b"x")
            bricks[parse_pathinfo(os.getxattr(path, PATHINFO_XATTR).decode()).rsplit("/", 1)[-1]] += 1
        assert set(bricks) == {"b1", "b2", "b3"}, bricks
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_pack_onto_gluster_names_each_chunks_brick_and_mounts(volume, tricky, tmp_path):
    src = tricky[0]
    dst = os.path.join(volume, f"test-{uuid.uuid4().hex[:8]}")
    try:
        pack(src, dst, chunk_count=3, progress=False)
        ix = Index.load(os.path.join(dst, INDEX_NAME))
        assert len(ix.chunks) >= 12
        seen_nodes = set()
        for c in ix.chunks:
            raw = os.getxattr(os.path.join(dst, c.path), PATHINFO_XATTR).decode()
            brick = parse_pathinfo(raw)
            assert brick and brick.startswith(os.uname().nodename + ":/")
            assert ix.nodes[c.node] == brick
            seen_nodes.add(brick)
        assert len(seen_nodes) >= 2  # DHT spreads a dozen chunks over several bricks

        r = subprocess.run(fusefs_cmd("info", dst, "--json", "--chunks"), capture_output=True,
                           text=True, cwd=REPO, timeout=300)
        assert r.returncode == 0, r.stderr
        info = json.loads(r.stdout)
        for path, node in info["chunk_nodes"].items():
            raw = os.getxattr(os.path.join(dst, path), PATHINFO_XATTR).decode()
            assert node == parse_pathinfo(raw)
        assert sum(info["chunks_per_node"].values()) == len(ix.chunks)

        mnt = str(tmp_path / "mnt")
        with running_mount(dst, mnt):
            assert read_tree(mnt) == read_tree(src)
        # with an order set, fetches are grouped by brick: per-node statistics name them
        with running_mount(dst, mnt, "--cache-size", "30%", "--batch", "4"):
            ids = list(range(ix.n_files))[::-1]
            write_order(mnt, ids)
            for i in ids:
                with open(os.path.join(mnt, os.fsdecode(ix.file_path(i))), "rb") as f:
                    f.read()
            stats = mount_stats(mnt)
        nodes = {k: v for k, v in stats["nodes"].items() if v["requests"]}
        assert set(nodes) == seen_nodes
        assert sum(v["samples"] for v in nodes.values()) == ix.n_files
        assert stats["eio"] == 0
    finally:
        shutil.rmtree(dst, ignore_errors=True)


def test_tars_on_gluster_indexed_in_place_name_each_tars_brick_and_read_by_brick(volume, tmp_path):
    """`pack --in-place` over shards on the volume: each tar's node is its brick (pathinfo),
    and reads along an order go to the bricks by tar."""
    import io
    import tarfile
    base = os.path.join(volume, f"inplace-{uuid.uuid4().hex[:8]}")
    files = {}
    try:
        os.makedirs(os.path.join(base, "shards"))
        for s in range(12):
            with tarfile.open(os.path.join(base, "shards", f"shard-{s:04d}.tar"), "w") as t:
                for k in range(10):
                    data = os.urandom(3000 + 17 * k)
                    ti = tarfile.TarInfo(f"{s:02d}{k:02d}.jpg")
                    ti.size = len(data)
                    t.addfile(ti, io.BytesIO(data))
                    files[f"shard-{s:04d}/{s:02d}{k:02d}.jpg"] = data
        dst = os.path.join(base, "index")
        r = subprocess.run(fusefs_cmd("pack", "--in-place", "-q", os.path.join(base, "shards"), dst),
                           capture_output=True, text=True, cwd=REPO, timeout=300)
        assert r.returncode == 0, r.stderr
        assert os.listdir(dst) == [INDEX_NAME]
        ix = Index.load(os.path.join(dst, INDEX_NAME))
        bricks = set()
        for c in ix.chunks:
            raw = os.getxattr(os.path.join(ix.source, c.path), PATHINFO_XATTR).decode()
            assert ix.nodes[c.node] == parse_pathinfo(raw)
            bricks.add(ix.nodes[c.node])
        assert len(bricks) >= 2  # (DHT spreads a dozen tars over several bricks)
        mnt = str(tmp_path / "mnt")
        with running_mount(dst, mnt, "--cache-size", "30%", "--batch", "4"):
            ids = list(range(ix.n_files))[::-1]
            write_order(mnt, ids)
            for i in ids:
                rel = os.fsdecode(ix.file_path(i))
                with open(os.path.join(mnt, rel), "rb") as f:
                    assert f.read() == files[rel]
            stats = mount_stats(mnt)
        nodes = {k: v for k, v in stats["nodes"].items() if v["requests"]}
        assert set(nodes) == bricks and stats["eio"] == 0
        assert sum(v["samples"] for v in nodes.values()) == ix.n_files
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_pack_names_the_bricks_its_chunks_missed(volume, tricky, tmp_path, caplog):
    """With every brick below cluster.min-free-disk (set to 99% here, as a disk filled by
    other data does at 10%), DHT puts every new file on one brick: pack says which bricks
    got no chunk and why; with the option reset the chunks spread again and it says nothing."""
    src = tricky[0]
    dst = os.path.join(volume, f"test-{uuid.uuid4().hex[:8]}")
    warned = lambda: [r.getMessage() for r in caplog.records if "landed on" in r.getMessage()]
    try:
        subprocess.run(["gluster", "volume", "set", VOL, "cluster.min-free-disk", "99%"],
                       check=True, capture_output=True, timeout=60)
        try:
            with caplog.at_level("WARNING", logger="fusefs.pack"):
                pack(src, dst, chunk_count=2, progress=False)
        finally:
            subprocess.run(["gluster", "volume", "reset", VOL, "cluster.min-free-disk"],
                           check=True, capture_output=True, timeout=60)
        ix = Index.load(os.path.join(dst, INDEX_NAME))
        assert len(ix.chunks) >= 24 and len(ix.nodes) == 1
        (message,) = warned()
        left_out = [f"{os.uname().nodename}:{BRICKS}/{b}" for b in ("b1", "b2", "b3")
                    if f"{os.uname().nodename}:{BRICKS}/{b}" != ix.nodes[0]]
        assert all(b in message.split("none on ")[1] for b in left_out), message
        assert "min-free-disk" in message

        caplog.clear()
        with caplog.at_level("WARNING", logger="fusefs.pack"):
            pack(src, dst, chunk_count=2, progress=False, force=True)
        ix = Index.load(os.path.join(dst, INDEX_NAME))
        assert len(ix.nodes) == 3 and warned() == []
    finally:
        shutil.rmtree(dst, ignore_errors=True)


def _faults():
    from testkit import gluster as testbed  # the faults benchmark's scenarios, shared with it
    return testbed


@pytest.fixture(scope="module")
def small_packed(volume, tmp_path_factory):
    """300 small JPEGs packed onto the volume in 64 KiB chunks; (packed, rels, digests)."""
    import random
    import xxhash
    from testkit.synth import make_imagefolder
    src = str(tmp_path_factory.mktemp("faults") / "src")
    make_imagefolder(src, 300, n_classes=5, mean_bytes=8_000, progress=False)
    packed = os.path.join(volume, f"faults-{uuid.uuid4().hex[:8]}")
    pack(src, packed, chunk_bytes=64 << 10, progress=False)
    rels, digests = [], {}
    for d, _, files in os.walk(src):
        for name in files:
            rel = os.path.relpath(os.path.join(d, name), src)
            rels.append(rel)
            digests[rel] = xxhash.xxh3_64_intdigest(open(os.path.join(d, name), "rb").read())
    random.Random(1).shuffle(rels)
    yield packed, rels, digests
    shutil.rmtree(packed, ignore_errors=True)


def test_a_killed_brick_fails_only_its_reads_and_recovers_without_remount(small_packed, tmp_path):
    packed, rels, digests = small_packed
    res = _faults().scenario_brick_kill(packed, str(tmp_path / "mnt"), rels, digests)
    assert res["wrong"] == 0 and res["other_errors"] == 0
    assert 0 < len(res["failed"]) < len(rels) / 2  # only samples on the dead brick, after the kill
    assert res["recovery_s"] is not None
    assert res["failed_then_served"] == len(res["failed"])  # back without a remount
    failing = [n for n, s in res["per_node"].items() if s["errors"]]
    assert len(failing) == 1 and "b2" in failing[0]  # the other bricks went on


def test_injected_read_errors_are_retried_and_never_give_wrong_bytes(small_packed, tmp_path):
    """error-gen on the bricks fails 10%, then 50% of read operations. At 10% the epoch
    completes in full; at 50% some samples run out of retries and get EIO, no other error,
    and never wrong bytes."""
    packed, rels, digests = small_packed
    faults = _faults()
    res = faults.scenario_errors(packed, str(tmp_path / "mnt"), rels, digests, 10)
    assert res["injected"] > 0  # the translator did fail reads at the bricks
    assert res["wrong"] == 0 and res["other_errors"] == 0
    assert res["served"] == len(rels) and res["eio"] == 0

    res = faults.scenario_errors(packed, str(tmp_path / "mnt"), rels, digests, 50)
    assert res["wrong"] == 0 and res["other_errors"] == 0
    assert res["backend_errors"] > 0 and res["retries"] > 0  # fusefs saw them and retried
    assert res["served"] + res["eio"] == len(rels) and res["served"] > len(rels) / 2
    vol = subprocess.run(["gluster", "volume", "info", VOL], capture_output=True, text=True,
                         timeout=60).stdout
    assert "error-gen" not in vol  # the volume change was undone


def test_two_mounts_on_the_volume_as_two_nodes_read_the_epoch_once(small_packed, tmp_path):
    """The two-node check of test_hints, on a set packed onto the GlusterFS volume."""
    from conftest import check_two_nodes
    packed, rels, digests = small_packed
    check_two_nodes(packed, rels, digests, tmp_path)


def test_a_brick_restarted_mid_epoch_costs_a_pause_not_an_eio(small_packed, tmp_path):
    """The default --io-timeout: the reads of the killed brick's samples wait for it while
    the others are served; once it is back every sample is served, right, and the log has
    one line for its going down and one for its coming back, not one per sample."""
    packed, rels, digests = small_packed
    down_s = 5.0
    res = _faults().scenario_brick_restart(packed, str(tmp_path / "mnt"), rels, digests, down_s=down_s)
    assert res["eio"] == 0 and res["other_errors"] == 0 and res["wrong"] == 0
    assert res["served"] == len(rels)
    assert res["read_ms_max"] >= 1000 * down_s * 0.5  # (a read did wait for the brick)
    assert sum("does not answer" in line for line in res["log"]) == 1, res["log"]
    assert sum("answers again" in line for line in res["log"]) == 1, res["log"]
    assert not any("EIO" in line for line in res["log"]), res["log"]


def _volume_state(vol: str, bricks: str, mnt: str) -> dict:
    """What another volume of the machine's GlusterFS is: its options, its brick processes,
    its mount, and its bricks' files (paths, sizes, digests; the bricks' own metadata
    folder left out)."""
    import hashlib
    import re
    info = subprocess.run(["gluster", "--mode=script", "volume", "info", vol], capture_output=True,
                          text=True, timeout=120).stdout
    # (its lines as a set: glusterd lists the options in no fixed order)
    info = sorted(line.strip() for line in info.splitlines() if line.strip())
    status = subprocess.run(["gluster", "--mode=script", "volume", "status", vol, "--xml"],
                            capture_output=True, text=True, timeout=120).stdout
    files = {}
    for folder, dirs, names in os.walk(bricks):
        dirs[:] = [d for d in dirs if d != ".glusterfs"]
        for name in names:
            path = os.path.join(folder, name)
            with open(path, "rb") as f:
                files[os.path.relpath(path, bricks)] = hashlib.sha256(f.read()).hexdigest()
    mounts = [line.split()[:3] for line in open("/proc/mounts") if line.split()[1] == mnt]
    return {"info": info, "brick_pids": sorted(re.findall(r"<pid>(\d+)</pid>", status)),
            "mounts": mounts, "files": files}


@pytest.mark.machine
@pytest.mark.timeout(1500)
def test_the_gluster_tests_leave_another_volume_of_the_machine_alone():
    """With another volume of the machine's GlusterFS set up, started and mounted (another
    name, bricks and mount point; delay-gen at 2 ms), `pytest -m gluster` leaves its
    options, brick processes, mount and bricks' files as they were: the test bed touches its
    own volume only, and stops only what it started."""
    name = f"fusefs-other-{uuid.uuid4().hex[:6]}"
    other = {"FUSEFS_GLUSTER_VOL": name, "FUSEFS_GLUSTER_BRICKS": f"/srv/{name}",
             "FUSEFS_GLUSTER_MNT": f"/mnt/{name}"}
    env = dict(os.environ, **other)
    r = subprocess.run([GLUSTER, "up", "--delay-ms", "2"], env=env, capture_output=True, text=True, timeout=300)
    try:
        assert r.returncode == 0, r.stdout + r.stderr
        with open(os.path.join(other["FUSEFS_GLUSTER_MNT"], "keep.bin"), "wb") as f:
            f.write(os.urandom(100_000))
        before = _volume_state(name, other["FUSEFS_GLUSTER_BRICKS"], other["FUSEFS_GLUSTER_MNT"])
        assert before["brick_pids"] and before["mounts"] and "keep.bin" in str(before["files"])
        inner = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gluster", "--deselect",
             "tests/test_gluster.py::test_the_gluster_tests_leave_another_volume_of_the_machine_alone",
             "tests"], cwd=REPO, capture_output=True, text=True, timeout=1200)
        assert inner.returncode == 0, inner.stdout[-3000:] + inner.stderr[-2000:]
        after = _volume_state(name, other["FUSEFS_GLUSTER_BRICKS"], other["FUSEFS_GLUSTER_MNT"])
        assert after == before
    finally:
        subprocess.run([GLUSTER, "down"], env=env, capture_output=True, timeout=300)
    assert not os.path.exists(other["FUSEFS_GLUSTER_BRICKS"])
