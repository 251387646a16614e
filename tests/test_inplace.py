"""Tars mounted in place (`fusefs pack --in-place`), through a real mount: torchvision's
ImageFolder + DataLoader over ImageNet's shape of archive, WebDataset shards read along an
order, and a tar changed under the mount."""
import errno
import io
import json
import os
import random
import subprocess
import tarfile

import pytest

from fusefs.client import write_order
from fusefs.index import INDEX_NAME, Index
from fusefs.mounts import is_mounted
from testkit.mounts import running_mount
from testkit.synth import make_imagefolder

from conftest import REPO, flip_byte, fusefs_cmd, read_tree, read_with_imagefolder, refused_mount, tar_bytes

_read = read_with_imagefolder


def _index(*args):
    r = subprocess.run(fusefs_cmd("pack", "--in-place", "-q", *args), capture_output=True,
                       text=True, timeout=300, cwd=REPO)
    return r


def imagenet_archive(tree, path):
    """ImageNet's training archive's shape: one tar of per-class tars (CLASS.tar holding the
    class's images, by name alone)."""
    with tarfile.open(path, "w") as outer:
        for cls in sorted(os.listdir(tree)):
            buf = io.BytesIO()
            with tarfile.open(fileobj=buf, mode="w") as inner:
                for name in sorted(os.listdir(os.path.join(tree, cls))):
                    inner.add(os.path.join(tree, cls, name), arcname=name)
            ti = tarfile.TarInfo(f"{cls}.tar")
            ti.size = len(buf.getvalue())
            outer.addfile(ti, io.BytesIO(buf.getvalue()))


@pytest.fixture(scope="module")
def imagenet(tmp_path_factory):
    base = tmp_path_factory.mktemp("inplace")
    make_imagefolder(str(base / "tree"), 160, n_classes=5, mean_bytes=12_000, seed=5)
    os.makedirs(base / "archive")
    imagenet_archive(base / "tree", base / "archive" / "train.tar")
    r = _index(base / "archive" / "train.tar", base / "dst")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("indexed 160 files") and "in 1 tars in place" in r.stdout
    return base


def _mount_source(mnt) -> str:
    """The source the mount table shows for mnt (/proc/self/mountinfo)."""
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            if fields[4] == str(mnt):
                return fields[fields.index("-") + 2].replace("\\040", " ")
    raise AssertionError(f"{mnt} is not mounted")


def test_an_imagenet_archive_reads_through_imagefolder_with_identical_bytes(imagenet, tmp_path):
    assert os.listdir(imagenet / "dst") == [INDEX_NAME]
    with running_mount(imagenet / "dst", tmp_path / "mnt", "--cache-size", "10%"):
        # (issue 87 item 10: DST, as the README says, not the tars' folder)
        assert _mount_source(tmp_path / "mnt") == str(imagenet / "dst")
        through = _read(tmp_path / "mnt", "--shuffle", "--epochs", "2")
    direct = _read(imagenet / "tree")
    assert through["classes"] == direct["classes"] and len(through["classes"]) == 5
    assert through["n"] == direct["n"] == 160
    assert through["files"] == direct["files"]
    assert [e["samples"] for e in through["epochs"]] == [160, 160]


def test_info_and_verify_read_an_in_place_set_where_it_lies(imagenet):
    r = subprocess.run(fusefs_cmd("info", imagenet / "dst", "--json"), capture_output=True,
                       text=True, timeout=60, cwd=REPO)
    info = json.loads(r.stdout)
    assert info["samples"] == 160 and info["chunks"] == 1 and info["classes"] == 5
    assert info["in_place"] == str(imagenet / "archive")
    r = subprocess.run(fusefs_cmd("verify", "-q", imagenet / "dst"), capture_output=True,
                       text=True, timeout=60, cwd=REPO)
    assert r.returncode == 0 and "all good" in r.stdout, r.stdout + r.stderr


@pytest.fixture
def shards(tmp_path):
    """Six WebDataset-shaped shards (key.jpg, key.cls per sample), indexed onto two nodes."""
    rng = random.Random(3)
    files = {}
    os.makedirs(tmp_path / "shards")
    for s in range(6):
        with tarfile.open(tmp_path / "shards" / f"shard-{s:06d}.tar", "w") as t:
            for k in range(40):
                key = f"{s:02d}{k:04d}"
                for ext, data in (("jpg", rng.randbytes(rng.randint(2_000, 30_000))),
                                  ("cls", str(k % 7).encode())):
                    ti = tarfile.TarInfo(f"{key}.{ext}")
                    ti.size = len(data)
                    t.addfile(ti, io.BytesIO(data))
                    files[f"shard-{s:06d}/{key}.{ext}"] = data
    r = _index(tmp_path / "shards", tmp_path / "dst", "--nodes", "2")
    assert r.returncode == 0, r.stderr
    return tmp_path, files


def _stats(mnt):
    with open(os.path.join(mnt, ".fusefs", "stats")) as f:
        return json.load(f)


def test_shards_are_read_ahead_along_the_order_in_batches_per_node(shards):
    base, files = shards
    mnt = base / "mnt"
    with running_mount(base / "dst", mnt, "--cache-size", "120%"):
        ids = open(mnt / ".fusefs" / "ids", "rb").read().split(b"\0")[:-1]
        order = list(range(len(ids)))
        random.Random(1).shuffle(order)
        write_order(str(mnt), order, epoch=0)
        for i in order:
            rel = os.fsdecode(ids[i])
            assert open(mnt / rel, "rb").read() == files[rel]
        s = _stats(mnt)
    assert len(ids) == len(files) == 480
    assert s["misses"] < 480 // 10 and s["prefetch_batches"] > 0, s  # (read ahead, not on demand)
    assert s["backend_requests"] < 480 // 4, s  # (batched)
    assert sorted(s["nodes"]) == ["node-0", "node-1"]
    assert all(node["requests"] > 0 for node in s["nodes"].values()), s["nodes"]


def test_without_an_order_the_miss_engine_reads_the_shards_where_they_lie(shards):
    """A full cache (--cache-size 0) and no order: the miss engine's readers, a lane per
    node, read the members out of the tars (the index's offsets into them) with the exact
    bytes; the loop takes only the first miss and those that look like a scan."""
    base, files = shards
    mnt = base / "mnt"
    names = sorted(files)
    random.Random(2).shuffle(names)
    with running_mount(base / "dst", mnt, "--cache-size", "0") as (proc, log):
        for rel in names:
            assert open(mnt / rel, "rb").read() == files[rel], rel
        s = _stats(mnt)
        assert proc.poll() is None
        text = open(log).read()
    assert "miss engine, 2 lanes" in text
    assert s["engine_misses"] >= len(names) // 2 and s["engine_to_loop"] == 0, s
    assert s["engine_misses"] + s["misses_to_loop"] + 1 >= len(names), s


def test_a_member_changed_under_the_mount_is_eio_and_a_log_line_the_rest_is_served(shards):
    base, files = shards
    ix = Index.load(str(base / "dst" / INDEX_NAME))
    victim = "shard-000002/020007.jpg"
    d = ix.lookup_dir(0, b"shard-000002")
    sid = int(ix.lookup_file(d, b"020007.jpg"))
    tar = os.path.join(ix.source, ix.chunks[int(ix.chunk[sid])].path)
    flip_byte(tar, int(ix.offset[sid]) + 9)
    mnt = base / "mnt"
    with running_mount(base / "dst", mnt) as (proc, log):
        for _ in range(2):
            with pytest.raises(OSError) as e:
                open(mnt / victim, "rb").read()
            assert e.value.errno == errno.EIO
        got = read_tree(mnt / "shard-000001")
        assert {f"shard-000001/{k}": v for k, v in got.items() if v is not None} == \
            {k: v for k, v in files.items() if k.startswith("shard-000001/")}
        assert proc.poll() is None
        text = open(log).read()
    assert tar in text and victim in text and "checksum" in text


def test_the_mount_refuses_a_tar_cut_short_since_it_was_indexed_naming_it(shards):
    base, _ = shards
    tar = base / "shards" / "shard-000004.tar"
    with open(tar, "r+b") as f:
        f.truncate(os.path.getsize(tar) - 1024)
    (base / "mnt").mkdir()
    r = refused_mount(base / "dst", base / "mnt", mnt=base / "mnt")
    assert r.returncode == 2 and str(tar) in r.stderr and "truncated" in r.stderr, r.stderr
    assert "--in-place --force" in r.stderr
    assert not is_mounted(base / "mnt")


def test_a_compressed_tar_is_refused_in_one_line(tmp_path):
    os.makedirs(tmp_path / "src")
    subprocess.run(["tar", "czf", str(tmp_path / "src" / "a.tar.gz"), "-C", REPO, "README.md"], check=True,
                   timeout=60)
    r = _index(tmp_path / "src", tmp_path / "dst")
    assert r.returncode == 2, r
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and "gzip-compressed" in lines[0] and "Decompress" in lines[0], r.stderr


def test_reading_the_ids_of_a_deep_set_costs_the_daemon_no_copy_of_them(tmp_path):
    """Issue 87 item 5: a nested tar under a prefix of 3.8 KB, of 20,000 empty members (a 10
    MB tar): every path is near PATH_MAX, 77 MB of ids. Before, a trusted reader of
    `.fusefs/ids` made the daemon render and keep them all (2,000 folders deep: 80 MB, the
    daemon 47 -> 206 MB); now they are rendered per read, and the daemon stays within fresh
    + cache budget + order memory + 5% while and after they are read."""
    from fusefs.client import mount_stats
    from conftest import resident_bytes_of
    inner = tar_bytes([(f"m{i:05d}", b"") for i in range(20_000)])
    prefix = "/".join(f"{i:02d}" + "d" * 250 for i in range(15))  # (3.8 KB of path)
    os.makedirs(tmp_path / "src")
    (tmp_path / "src" / "deep.tar").write_bytes(tar_bytes([(f"{prefix}/inner.tar", inner)]))
    r = _index(tmp_path / "src", tmp_path / "dst")
    assert r.returncode == 0 and "indexed 20000 files" in r.stdout, r.stderr
    with running_mount(tmp_path / "dst", tmp_path / "mnt", "--cache-size", "16MiB") as (proc, _):
        stats = mount_stats(tmp_path / "mnt")
        fresh = resident_bytes_of(proc.pid)
        bound = 1.05 * (fresh + stats["cache_budget"] + stats["order_budget"])
        peak = 0
        with open(tmp_path / "mnt" / ".fusefs" / "ids", "rb") as f:
            got = bytearray()
            while part := f.read(1 << 17):
                got += part
                peak = max(peak, resident_bytes_of(proc.pid))
        paths = got.split(b"\0")[:-1]
        assert len(paths) == 20_000 and paths[7] == f"deep/{prefix}/inner/m00007".encode()
        assert peak <= bound and resident_bytes_of(proc.pid) <= bound, (fresh, peak, bound)
