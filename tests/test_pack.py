import hashlib
import os

import numpy as np
import pytest

from fusefs import chunk, pack as packmod
from fusefs.config import FetchConfig
from fusefs.index import INDEX_NAME, Index, IndexFormatError
from fusefs.mount import MountError, open_dataset
from testkit.mounts import resolve, running_mount
from fusefs.pack import PackError, pack, plan_chunks

from conftest import tricky_tree, write_tree


def _digest_tree(root):
    out = {}
    for dirpath, _, files in os.walk(root):
        for name in files:
            p = os.path.join(dirpath, name)
            out[os.path.relpath(p, root)] = hashlib.sha256(open(p, "rb").read()).hexdigest()
    return out


def test_index_describes_the_tree(tricky):
    src, dst, files = tricky
    ix = Index.load(os.path.join(dst, INDEX_NAME))
    regular = {k: v for k, v in files.items() if not k.endswith("/")}
    assert ix.n_files == len(regular)
    assert ix.classes == sorted(["cat", "dog", "with space", "ünïcødé", "zz", "empty class"])
    for rel, data in regular.items():
        kind, sid = resolve(ix, rel)
        assert kind == "file"
        assert os.fsdecode(ix.file_path(sid)) == rel
        assert int(ix.size[sid]) == len(data)
        assert int(ix.checksum[sid]) == chunk.checksum(data)
        st = os.stat(os.path.join(src, rel))
        assert int(ix.mtime_ns[sid]) == st.st_mtime_ns
        top = rel.split("/")[0]
        assert int(ix.label[sid]) == (ix.classes.index(top) if "/" in rel else -1)
    assert resolve(ix, "empty class") == ("dir", resolve(ix, "empty class")[1])
    assert resolve(ix, "cat/nope.jpg") is None


def test_chunks_hold_the_original_bytes(tricky):
    src, dst, files = tricky
    ix = Index.load(os.path.join(dst, INDEX_NAME))
    for k, info in enumerate(ix.chunks):
        raw = open(os.path.join(dst, info.path), "rb").read()
        head = chunk.parse_header(raw, file_size=len(raw))
        assert head.n == info.count
    for rel, data in files.items():
        if rel.endswith("/"):
            continue
        sid = resolve(ix, rel)[1]
        raw = open(os.path.join(dst, ix.chunks[int(ix.chunk[sid])].path), "rb").read()
        off = int(ix.offset[sid])
        assert raw[off:off + len(data)] == data


def test_chunk_size_target_and_count():
    assert plan_chunks([10] * 10, 25, None) == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert plan_chunks([10] * 10, None, 4) == [(0, 4), (4, 8), (8, 10)]
    assert plan_chunks([], 25, None) == []


def test_pack_is_deterministic(tmp_path):
    src = tmp_path / "src"
    write_tree(src, tricky_tree())
    pack(str(src), str(tmp_path / "a"), chunk_count=7, progress=False, workers=8)
    pack(str(src), str(tmp_path / "b"), chunk_count=7, progress=False, workers=2)
    a, b = _digest_tree(tmp_path / "a"), _digest_tree(tmp_path / "b")
    assert a == b and INDEX_NAME in a and len(a) > 3


def test_refuses_non_empty_dst_without_force(tmp_path, tricky):
    src = tricky[0]
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "precious.txt").write_text("keep me")
    with pytest.raises(PackError, match="not empty"):
        pack(src, str(dst), progress=False)
    pack(src, str(dst), progress=False, force=True)
    assert (dst / "precious.txt").read_text() == "keep me"  # --force only replaces our files
    pack(src, str(dst), progress=False, force=True, chunk_count=3)  # re-pack over a pack
    open_dataset(str(dst))


def test_unreadable_files_are_skipped_and_reported_or_stop_with_strict(tmp_path, monkeypatch):
    src = tmp_path / "src"
    write_tree(src, {"a/1.bin": b"1", "a/2.bin": b"22", "b/3.bin": b"333"})
    real = packmod._read_file

    def failing(source, rel, *where):
        if rel.endswith(b"2.bin"):
            raise PermissionError(13, "Permission denied")
        return real(source, rel, *where)

    monkeypatch.setattr(packmod, "_read_file", failing)
    r = pack(str(src), str(tmp_path / "dst"), progress=False)
    assert r.files == 2 and r.skipped == [("a/2.bin", "cannot read: Permission denied")]
    ix = Index.load(str(tmp_path / "dst" / INDEX_NAME))
    assert resolve(ix, "a/2.bin") is None and resolve(ix, "a/1.bin")[0] == "file"
    with pytest.raises(PackError, match="a/2.bin.*strict"):
        pack(str(src), str(tmp_path / "dst2"), progress=False, strict=True)


def test_special_entries_are_reported(tmp_path):
    src = tmp_path / "src"
    write_tree(src, {"a/1.bin": b"1"})
    os.mkfifo(src / "a" / "pipe")
    os.symlink("/nonexistent", src / "a" / "dangling")
    r = pack(str(src), str(tmp_path / "dst"), progress=False)
    assert sorted(p for p, _ in r.skipped) == ["a/dangling", "a/pipe"]
    assert r.files == 1


def test_the_control_folder_name_is_reserved_at_the_root_only(tmp_path):
    src = tmp_path / "src"
    write_tree(src, {"a/1.bin": b"1", ".fusefs/x.bin": b"x", "a/.fusefs/y.bin": b"y"})
    r = pack(str(src), str(tmp_path / "dst"), progress=False)
    assert [p for p, _ in r.skipped] == [".fusefs"] and "reserved" in r.skipped[0][1]
    ix = Index.load(str(tmp_path / "dst" / INDEX_NAME))
    assert resolve(ix, "a/.fusefs/y.bin") is not None and resolve(ix, ".fusefs/x.bin") is None
    with pytest.raises(PackError, match=r"\.fusefs.*reserved.*strict"):
        pack(str(src), str(tmp_path / "dst2"), progress=False, strict=True)


def test_interrupted_pack_never_looks_complete(tmp_path, monkeypatch, tricky):
    src = tricky[0]
    dst = tmp_path / "dst"
    pack(src, str(dst), progress=False, chunk_count=2)  # a complete pack to be replaced
    calls = {"n": 0}
    real = packmod._read_file

    def interrupted(source, rel, *where):
        calls["n"] += 1
        if calls["n"] == 20:
            raise KeyboardInterrupt
        return real(source, rel, *where)

    monkeypatch.setattr(packmod, "_read_file", interrupted)
    with pytest.raises(KeyboardInterrupt):
        pack(src, str(dst), progress=False, chunk_count=2, force=True)
    assert any(p.startswith("chunk-") for p in os.listdir(dst / "chunks"))  # it did start
    assert not (dst / INDEX_NAME).exists()
    with pytest.raises(MountError, match="no index"):
        open_dataset(str(dst))


def test_nodes_layout(tmp_path, tricky):
    dst = tmp_path / "dst"
    pack(tricky[0], str(dst), progress=False, chunk_count=5, nodes=3)
    ix = Index.load(str(dst / INDEX_NAME))
    assert ix.nodes == ["node-0", "node-1", "node-2"]
    for k, c in enumerate(ix.chunks):
        assert c.node == k % 3
        assert c.path.startswith(f"node-{k % 3}/")
        assert (dst / c.path).exists()
    assert sum(ix.chunks_per_node().values()) == len(ix.chunks)


def test_index_damage_is_named(tmp_path, tricky):
    dst = tricky[1]
    raw = open(os.path.join(dst, INDEX_NAME), "rb").read()
    for bad, why in [(raw[: len(raw) // 2], "truncated"), (raw[:100] + b"\0" + raw[101:], "checksum"),
                     (b"nonsense" + raw[8:], "magic")]:
        p = tmp_path / "bad.fusefs"
        p.write_bytes(bad)
        with pytest.raises(IndexFormatError, match=why) as e:
            Index.load(str(p))
        assert str(p) in str(e.value)


def test_a_failing_index_read_is_retried_longer_at_start_then_named(tricky, monkeypatch, caplog):
    """The index is read once, at start: open_dataset retries it INDEX_RETRIES times even
    when the per-sample retries are fewer, waiting at most 2 s between tries, and a read
    that keeps failing is refused with the path and the error."""
    from fusefs import index as indexmod
    from fusefs.mount import INDEX_RETRIES
    dst = tricky[1]
    real_read, waits, fails = indexmod._read_file, [], {"left": INDEX_RETRIES}

    def flaky(path):
        if str(path).endswith(INDEX_NAME) and fails["left"] > 0:
            fails["left"] -= 1
            raise OSError(5, "Input/output error")
        return real_read(path)

    monkeypatch.setattr(indexmod, "_read_file", flaky)
    monkeypatch.setattr(indexmod.time, "sleep", waits.append)
    index, _ = open_dataset(dst, FetchConfig(retries=1))  # fails INDEX_RETRIES times, then reads
    assert index.n_files == sum(v is not None for v in tricky[2].values()) and fails["left"] == 0
    assert len(waits) == INDEX_RETRIES and max(waits) == 2.0 and waits[0] == 0.1
    assert caplog.text.count("read failed (Input/output error)") == INDEX_RETRIES

    fails["left"] = INDEX_RETRIES + 1
    with pytest.raises(MountError, match=rf"{INDEX_NAME}: cannot read index \({INDEX_RETRIES} "
                                         r"retries\): Input/output error"):
        open_dataset(dst, FetchConfig(retries=1))


def test_mixed_order_interleaves_classes_in_proportion():
    labels = np.array([-1] * 3 + [0] * 10 + [1] * 20 + [2] * 30)
    order = packmod.mixed_order(labels)
    assert sorted(order.tolist()) == list(range(len(labels)))
    for c in (-1, 0, 1, 2):  # each class keeps its own order
        mine = order[labels[order] == c]
        assert (np.diff(mine) > 0).all()
    share = np.array([(labels == c).mean() for c in (-1, 0, 1, 2)])
    for start in range(0, len(order) - 12):
        run = labels[order[start:start + 12]]
        counts = np.array([(run == c).sum() for c in (-1, 0, 1, 2)])
        assert (np.abs(counts - 12 * share) <= 1.5).all(), (start, counts)


def test_mix_classes_puts_every_class_in_every_chunk_and_reads_back(tmp_path):
    import random
    rng = random.Random(3)
    files = {f"class {c}/f{i:03d}.jpg": rng.randbytes(rng.randrange(10, 5000))
             for c in range(4) for i in range(15)}
    write_tree(tmp_path / "src", files)
    for name, mix in (("sorted", False), ("mixed", True), ("mixed2", True)):
        pack(str(tmp_path / "src"), str(tmp_path / name), chunk_count=8, progress=False, mix_classes=mix)
    per_chunk = {}
    for name in ("sorted", "mixed"):
        ix = Index.load(str(tmp_path / name / INDEX_NAME))
        per_chunk[name] = [len(set(ix.label[ix.chunk == k].tolist())) for k in range(len(ix.chunks))]
    assert per_chunk["sorted"][0] == 1  # class by class
    assert per_chunk["mixed"] == [4] * len(per_chunk["mixed"])  # 8 = 2 of each class
    assert _digest_tree(tmp_path / "mixed") == _digest_tree(tmp_path / "mixed2")  # deterministic
    with running_mount(str(tmp_path / "mixed"), tmp_path / "mnt"):
        assert _digest_tree(tmp_path / "mnt") == _digest_tree(tmp_path / "src")


def test_pack_makes_an_open_an_fstat_and_a_read_a_file_and_opens_each_folder_once(tmp_path, monkeypatch):
    """What pack asks of the source's filesystem grows with the files by one open, one
    fstat, one read and one close each (a file's first read bringing the size its fstat
    gave is the whole file), and each folder is opened beneath the source once to list it
    and once for the reads of its files: on a parallel filesystem each is a round trip."""
    folders, per = 4, 60
    src = tmp_path / "src"
    write_tree(src, {f"c{k}/f{j:03d}.bin": bytes([j]) * (j + 1) for k in range(folders) for j in range(per)})
    counts = {"open": 0, "fstat": 0, "read": 0, "walks": 0}
    real = {name: getattr(os, name) for name in ("open", "fstat", "read")}

    def counting(name):
        def call(*a, **kw):
            counts[name] += 1
            return real[name](*a, **kw)
        return call
    for name in real:
        monkeypatch.setattr(os, name, counting(name))
    real_walk = packmod.beneath.open_dir

    def walk(*a):
        counts["walks"] += 1
        return real_walk(*a)
    monkeypatch.setattr(packmod.beneath, "open_dir", walk)
    r = pack(str(src), str(tmp_path / "dst"), progress=False)
    for name in real:
        monkeypatch.setattr(os, name, real[name])
    files = folders * per
    assert r.files == files
    assert counts["walks"] == 2 * folders  # (listed, then read from: each once)
    assert files <= counts["open"] <= files + 2 * folders + 16   # (chunks, the index, folders)
    assert files <= counts["fstat"] <= files + 2 * folders + 16
    assert files <= counts["read"] <= files + 16


def test_the_folders_kept_open_stay_within_the_open_file_limit(tmp_path, monkeypatch):
    """pack keeps at most half the open-file limit's descriptors of folders (DIR_FDS with
    no limit at all); past them a file is opened by a walk from the source, the same bytes."""
    import resource
    src = tmp_path / "src"
    write_tree(src, {f"c{k}/f.bin": bytes([k]) for k in range(6)})
    monkeypatch.setattr(resource, "getrlimit", lambda what: (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    assert packmod.Source(str(src))._max_dirs == packmod.DIR_FDS
    monkeypatch.setattr(resource, "getrlimit", lambda what: (136, 136))  # (room for 4 folders)
    source = packmod.Source(str(src))
    try:
        assert source._max_dirs == 4
        got = [packmod._read_file(source, f"c{k}/f.bin".encode(), k + 1, f"c{k}".encode()) for k in range(6)]
        assert got == [bytes([k]) for k in range(6)] and len(source._dirs) == 4
    finally:
        source.close()
