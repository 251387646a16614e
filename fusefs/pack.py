"""`fusefs pack SRC DST`: turn a folder tree of small files into chunks plus one index.

Streaming: the tree's metadata is scanned into compact arrays, then chunk after chunk is
read (files in parallel on a thread pool) and handed to a writer thread, so at most
three chunks' bytes are in memory whatever the dataset's size. The output depends only
on the input (same tree, byte-identical chunks and index). The index is written last
and atomically: a pack that is interrupted leaves no index, and `fusefs mount` refuses a
folder without one.
"""
from __future__ import annotations

import logging
import os
import queue
import shutil
import stat
import threading
import time
from array import array
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
from tqdm import tqdm

from . import chunk as chunkfmt
from . import nodes as nodesmod
from .errors import UserError
from .index import CONTROL_NAME, INDEX_NAME, ChunkInfo, Index

log = logging.getLogger("fusefs.pack")

DEFAULT_CHUNK_BYTES = 64 << 20
CHUNKS_DIR = "chunks"  # the chunk files of a flat layout (without --nodes), under DST


class PackError(UserError):
    """The pack cannot start or cannot finish; the message says why."""


@dataclass
class PackResult:
    files: int
    bytes: int
    chunks: int
    seconds: float
    skipped: list = field(default_factory=list)  # (path, reason)

    @property
    def mb_per_s(self) -> float:
        return self.bytes / 1e6 / self.seconds if self.seconds > 0 else 0.0


class _Tree:
    """The scanned tree as compact arrays (no Python object per file)."""

    def __init__(self):
        self.names = bytearray()
        self.d_name = array("Q"); self.d_len = array("I"); self.d_parent = array("i")
        self.d_mtime = array("q"); self.d_mode = array("I"); self.d_class = array("i")
        self.d_first_sub = array("I"); self.d_nsubs = array("I")
        self.d_first_file = array("Q"); self.d_nfiles = array("Q")
        self.f_name = array("Q"); self.f_len = array("I"); self.f_dir = array("I")
        self.f_size = array("Q"); self.f_mtime = array("q"); self.f_mode = array("I")
        self.paths: list[bytes] = []  # dir paths, for reading
        self.classes: list[bytes] = []

    def add_name(self, name: bytes) -> int:
        off = len(self.names)
        self.names += name
        return off

    def file_path(self, i: int) -> bytes:
        d = self.f_dir[i]
        name = bytes(self.names[self.f_name[i]:self.f_name[i] + self.f_len[i]])
        return os.path.join(self.paths[d], name) if self.paths[d] else name


def scan(src: bytes, skipped: list) -> _Tree:
    """Walk src breadth-first, sorted by name; unrepresentable entries go to skipped."""
    t = _Tree()
    st = os.stat(src)
    t.d_name.append(0); t.d_len.append(0); t.d_parent.append(-1)
    t.d_mtime.append(st.st_mtime_ns); t.d_mode.append(stat.S_IMODE(st.st_mode))
    t.d_class.append(-1); t.paths.append(b"")
    d = 0
    while d < len(t.paths):
        rel = t.paths[d]
        try:
            with os.scandir(os.path.join(src, rel) if rel else src) as it:
                entries = sorted(it, key=lambda e: e.name)
        except OSError as e:
            skipped.append((os.fsdecode(rel), f"cannot list: {e.strerror}"))
            entries = []
        subs, files = [], []
        for e in entries:
            path = os.path.join(rel, e.name) if rel else e.name
            if d == 0 and e.name == CONTROL_NAME:
                skipped.append((os.fsdecode(path), "reserved name: the mount shows its hidden "
                                "control folder there"))
                continue
            try:
                if e.is_dir(follow_symlinks=False):
                    subs.append((e.name, e.stat(follow_symlinks=False)))
                elif e.is_file(follow_symlinks=True):
                    files.append((e.name, e.stat(follow_symlinks=True)))
                else:
                    kind = "symbolic link" if e.is_symlink() else "special file"
                    skipped.append((os.fsdecode(path), f"{kind}, not packed"))
            except OSError as err:
                skipped.append((os.fsdecode(path), f"cannot stat: {err.strerror}"))
        t.d_first_sub.append(len(t.paths)); t.d_nsubs.append(len(subs))
        for name, s in subs:
            t.d_name.append(t.add_name(name)); t.d_len.append(len(name)); t.d_parent.append(d)
            t.d_mtime.append(s.st_mtime_ns); t.d_mode.append(stat.S_IMODE(s.st_mode))
            if d == 0:
                t.d_class.append(len(t.classes)); t.classes.append(name)
            else:
                t.d_class.append(t.d_class[d])
            t.paths.append(os.path.join(rel, name) if rel else name)
        t.d_first_file.append(len(t.f_size)); t.d_nfiles.append(len(files))
        for name, s in files:
            t.f_name.append(t.add_name(name)); t.f_len.append(len(name)); t.f_dir.append(d)
            t.f_size.append(s.st_size); t.f_mtime.append(s.st_mtime_ns)
            t.f_mode.append(stat.S_IMODE(s.st_mode))
        d += 1
    return t


def mixed_order(labels) -> np.ndarray:
    """File ids in an order that interleaves the classes in proportion: a file's key is its
    place within its class as a fraction of the class (files outside any class folder make
    one group of their own), so any run of this order, and so any chunk, holds each class
    in the share it has of the whole tree. Deterministic, and each class keeps its own order."""
    labels = np.asarray(labels, dtype=np.int64)
    by_class = np.argsort(labels, kind="stable")
    _, first, counts = np.unique(labels[by_class], return_index=True, return_counts=True)
    group = np.repeat(np.arange(len(counts)), counts)
    key = np.empty(len(labels))
    key[by_class] = (np.arange(len(labels)) - first[group] + 0.5) / counts[group]
    return np.lexsort((labels, key))


def plan_chunks(sizes, chunk_bytes: int | None, chunk_count: int | None) -> list[tuple[int, int]]:
    """Split a list of file sizes, in order, into runs [start, end) by a byte target or a count."""
    runs, start, acc = [], 0, 0
    for i, size in enumerate(sizes):
        acc += size
        if (chunk_count and i + 1 - start >= chunk_count) or (chunk_bytes and acc >= chunk_bytes):
            runs.append((start, i + 1))
            start, acc = i + 1, 0
    if start < len(sizes):
        runs.append((start, len(sizes)))
    return runs


def _prepare_dst(dst: str, force: bool) -> None:
    if os.path.exists(dst) and not os.path.isdir(dst):
        raise PackError(f"{dst} exists and is not a folder")
    os.makedirs(dst, exist_ok=True)
    existing = os.listdir(dst)
    if not existing:
        return
    if not force:
        raise PackError(f"{dst} is not empty ({len(existing)} entries); use --force to replace a packed dataset there")
    ours = [e for e in existing if e == INDEX_NAME or e == CHUNKS_DIR or e.startswith("node-")
            or e.startswith(INDEX_NAME + ".tmp")]
    if INDEX_NAME in ours:  # first, so that a half-replaced dataset never mounts
        os.unlink(os.path.join(dst, INDEX_NAME))
    for e in ours:
        p = os.path.join(dst, e)
        if os.path.isdir(p):
            shutil.rmtree(p)
        elif os.path.exists(p):
            os.unlink(p)
    others = sorted(set(existing) - set(ours))
    if others:
        log.warning("%s: leaving %d entries that fusefs did not write: %s", dst, len(others),
                    ", ".join(others[:5]))


def _read_file(path: bytes) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def pack(src: str, dst: str, *, chunk_bytes: int | None = DEFAULT_CHUNK_BYTES,
         chunk_count: int | None = None, nodes: int | None = None, workers: int = 16,
         strict: bool = False, force: bool = False, progress: bool | None = None,
         mix_classes: bool = False) -> PackResult:
    """Pack the tree at src into dst. See the module docstring. Files go into chunks in
    the tree's order (class by class), or with mix_classes in `mixed_order`."""
    if not os.path.isdir(src):
        raise PackError(f"{src} is not a folder")
    if nodes is not None and nodes < 1:
        raise PackError("--nodes must be at least 1")
    if not chunk_bytes and not chunk_count:
        raise PackError("give a chunk size in bytes or a sample count")
    t0 = time.perf_counter()
    skipped: list = []
    srcb = os.fsencode(os.path.abspath(src))
    tree = scan(srcb, skipped)
    if strict and skipped:
        raise PackError(f"{skipped[0][0]}: {skipped[0][1]} (--strict)")
    _prepare_dst(dst, force)

    labels_all = np.asarray(tree.d_class, dtype=np.int32)[np.asarray(tree.f_dir, dtype=np.int64)] \
        if len(tree.f_dir) else np.zeros(0, np.int32)
    order = mixed_order(labels_all) if mix_classes else np.arange(len(tree.f_size))
    runs = plan_chunks(np.asarray(tree.f_size, dtype=np.uint64)[order].tolist(), chunk_bytes, chunk_count)
    total = sum(tree.f_size)
    kept = np.ones(len(tree.f_size), dtype=bool)
    sizes = np.zeros(len(tree.f_size), dtype=np.uint64)
    sums = np.zeros(len(tree.f_size), dtype=np.uint64)
    chunk_of = np.zeros(len(tree.f_size), dtype=np.uint32)
    offsets = np.zeros(len(tree.f_size), dtype=np.uint64)
    chunk_paths: list[str] = []
    chunk_meta: list[tuple[int, int]] = []  # (size, count)

    # Writer thread: takes (chunk number, [(file id, bytes)]) and writes the chunk file.
    work: queue.Queue = queue.Queue(maxsize=1)
    failure: list[BaseException] = []

    def writer():
        while True:
            item = work.get()
            if item is None:
                return
            if failure:
                continue
            k, members = item
            try:
                rel = (f"node-{k % nodes}/chunk-{k:06d}.fck" if nodes
                       else f"{CHUNKS_DIR}/chunk-{k:06d}.fck")
                path = os.path.join(dst, rel)
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with open(path, "wb") as f:
                    head = chunkfmt.write_chunk(f, [(data, int(labels_all[i])) for i, data in members])
                    f.flush()
                    os.fsync(f.fileno())
                ids = [i for i, _ in members]
                sizes[ids], sums[ids], offsets[ids] = head.sizes, head.checksums, head.offsets
                chunk_of[ids] = k
                chunk_paths.append(rel)
                chunk_meta.append((head.file_size, head.n))
            except BaseException as e:  # reported by the main thread
                failure.append(e)

    wt = threading.Thread(target=writer, name="fusefs-pack-writer", daemon=True)
    wt.start()
    bar = tqdm(total=total, unit="iB", unit_scale=True, unit_divisor=1024, desc="pack", disable=(None if progress is None else not progress),
               dynamic_ncols=True)
    nfiles = len(tree.f_size)
    done_files = 0
    k = 0
    try:
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="fusefs-pack") as pool:
            for start, end in runs:
                ids = order[start:end].tolist()
                paths = [os.path.join(srcb, tree.file_path(i)) for i in ids]
                futures = [pool.submit(_read_file, p) for p in paths]
                members = []
                for i, fut in zip(ids, futures):
                    try:
                        data = fut.result()
                    except OSError as e:
                        rel = os.fsdecode(tree.file_path(i))
                        if strict:
                            raise PackError(f"{rel}: cannot read: {e.strerror} (--strict)") from None
                        skipped.append((rel, f"cannot read: {e.strerror}"))
                        kept[i] = False
                        continue
                    members.append((i, data))
                    bar.update(len(data))
                done_files += end - start
                bar.set_postfix_str(f"{done_files}/{nfiles} files", refresh=False)
                if not members:
                    continue
                if failure:
                    break
                work.put((k, members))
                k += 1
    finally:
        work.put(None)
        wt.join()
        bar.close()
    if failure:
        raise PackError(f"writing chunks to {dst} failed: {failure[0]}") from failure[0]

    chunk_files = [os.path.join(dst, p) for p in chunk_paths]
    if nodes:
        node_names = [f"node-{j}" for j in range(nodes)]
        node_of = [k % nodes for k in range(len(chunk_paths))]
    else:
        node_names, node_of = nodesmod.discover(chunk_files)
        folder = os.path.join(dst, CHUNKS_DIR)
        left_out = nodesmod.bricks_left_out(folder, node_names, len(chunk_files))
        if left_out:
            log.warning("%s: the %d chunks landed on %s only, none on %s: GlusterFS puts a "
                        "new file elsewhere when the brick its name hashes to is below "
                        "cluster.min-free-disk (10%% free by default) or unreachable. Fetches "
                        "are spread over the bricks that hold chunks only; free space on the "
                        "bricks (or check `gluster volume status`) and pack again", folder,
                        len(chunk_files), ", ".join(node_names), ", ".join(left_out))
    chunks = [ChunkInfo(p, n, s, c) for p, n, (s, c) in zip(chunk_paths, node_of, chunk_meta)]
    index = _build_index(tree, kept, chunk_of, offsets, sizes, sums, labels_all, chunks, node_names)
    index.save(os.path.join(dst, INDEX_NAME))
    _fsync_dir(dst)
    for rel, why in skipped:
        log.warning("skipped %s: %s", rel, why)
    return PackResult(index.n_files, index.total_bytes, len(chunks), time.perf_counter() - t0, skipped)


def _build_index(tree: _Tree, kept, chunk_of, offsets, sizes, sums, labels, chunks, node_names) -> Index:
    f_dir = np.asarray(tree.f_dir, dtype=np.uint32)
    d_nfiles = np.bincount(f_dir[kept], minlength=len(tree.paths)).astype(np.uint64)
    d_first = np.zeros(len(tree.paths), dtype=np.uint64)
    np.cumsum(d_nfiles[:-1], out=d_first[1:])
    arrays = {
        "file_name_off": np.asarray(tree.f_name, dtype=np.uint64)[kept],
        "file_name_len": np.asarray(tree.f_len, dtype=np.uint32)[kept],
        "file_dir": f_dir[kept], "chunk": chunk_of[kept], "offset": offsets[kept],
        "size": sizes[kept], "label": labels[kept], "checksum": sums[kept],
        "mtime_ns": np.asarray(tree.f_mtime, dtype=np.int64)[kept],
        "mode": np.asarray(tree.f_mode, dtype=np.uint32)[kept],
        "dir_name_off": np.asarray(tree.d_name, dtype=np.uint64),
        "dir_name_len": np.asarray(tree.d_len, dtype=np.uint32),
        "dir_parent": np.asarray(tree.d_parent, dtype=np.int32),
        "dir_mtime_ns": np.asarray(tree.d_mtime, dtype=np.int64),
        "dir_mode": np.asarray(tree.d_mode, dtype=np.uint32),
        "dir_first_file": d_first, "dir_nfiles": d_nfiles,
        "dir_first_sub": np.asarray(tree.d_first_sub, dtype=np.uint32),
        "dir_nsubs": np.asarray(tree.d_nsubs, dtype=np.uint32),
    }
    classes = [os.fsdecode(c) for c in tree.classes]
    return Index(arrays, bytes(tree.names), classes, chunks, node_names)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
