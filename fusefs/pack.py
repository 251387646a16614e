"""`fusefs pack SRC DST`: turn a folder tree of small files into chunks plus one index.

Streaming: the tree's metadata is scanned into compact arrays, then chunk after chunk is
read (files in parallel on a thread pool) and handed to a writer thread, so at most
three chunks' bytes are in memory whatever the dataset's size; a file larger than
STREAM_BYTES is not read into memory at all but copied by the writer in blocks, so no file
makes pack hold more. The output depends only on the input (same tree, byte-identical
chunks and index). The index is written last and atomically: a pack that is interrupted
leaves no index, and `fusefs mount` refuses a folder without one.

What it reads (pack often runs as root over a tree other users wrote): every folder and file
is opened beneath the source folder without following a symbolic link (beneath.py; links
are reported and skipped unless `follow_symlinks`), files O_NONBLOCK and only if regular (a
FIFO swapped in never blocks it). What it writes is never more open than what it read: a
chunk file's mode gives a group or others read access only if every file in it was
readable by them in the source (its mode, and search access on every folder above it, up
to /), the index's only if every chunk's is and every folder was listable by them; or
`mode`, if the user gives one.
"""
from __future__ import annotations

import functools
import logging
import operator
import os
import queue
import resource
import shutil
import stat
import threading
import time
from array import array
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import xxhash
from tqdm import tqdm

from . import beneath
from . import chunk as chunkfmt
from . import nodes as nodesmod
from .access import Access
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
        self.d_gid = array("q"); self.d_reach = array("q")  # (see Access)
        self.f_name = array("Q"); self.f_len = array("I"); self.f_dir = array("I")
        self.f_size = array("Q"); self.f_mtime = array("q"); self.f_mode = array("I")
        self.f_gid = array("q")
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


# folders whose descriptors pack keeps open while it reads their files (opened once each,
# beneath the source without following a link), at most this many and what the open-file
# limit leaves; the files of any other folder are opened by a walk from the source's
DIR_FDS = 4096
FILE_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC


class Source:
    """The tree being packed: its folder's descriptor, and how its files are opened (beneath
    it without following links, from the descriptor of their folder, opened once; or
    following them with follow_symlinks)."""

    def __init__(self, src: str, follow_symlinks: bool = False):
        try:  # (judged by its real path: see Access.open_real)
            self.path, self.fd, self.reach = Access.open_real(src)
        except OSError as e:
            raise PackError(f"{src}: cannot open the source folder: {beneath.why(e)}") from None
        if self.path != os.fsencode(os.path.abspath(src)):
            log.info("%s is reached through a link: packing %s, its files as open as that "
                     "path lets them be", src, os.fsdecode(self.path))
        self.follow = follow_symlinks
        self._dirs: dict[int, int] = {}  # folder number -> its descriptor
        self._dirs_lock = threading.Lock()
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        room = DIR_FDS if soft == resource.RLIM_INFINITY else soft // 2 - 64  # (no limit: DIR_FDS)
        self._max_dirs = max(0, min(DIR_FDS, room))

    def open_dir(self, rel: bytes) -> int:
        return os.dup(self.fd) if not rel else beneath.open_dir(self.fd, rel)

    def _dir_fd(self, d: int, rel_dir: bytes) -> int | None:
        """The kept descriptor of folder d (rel_dir in the tree), opened beneath the source
        the first time; None past the folders pack keeps open (OSError if it cannot be)."""
        fd = self._dirs.get(d)
        if fd is not None:
            return fd
        with self._dirs_lock:
            fd = self._dirs.get(d)
            if fd is None:
                if len(self._dirs) >= self._max_dirs:
                    return None
                fd = self._dirs[d] = self.open_dir(rel_dir)
        return fd

    def open_file(self, rel: bytes, d: int | None = None, rel_dir: bytes = b""):
        """(descriptor, fstat) of the regular file rel (in folder d, rel_dir in the tree, if
        given: opened from that folder's kept descriptor), O_NONBLOCK: NotRegular for
        anything but a regular file (a FIFO swapped in never blocks); ELOOP for a link on
        the way unless following them. (O_NONBLOCK has no effect on a regular file's reads.)"""
        if self.follow:
            fd = os.open(os.path.join(self.path, rel), FILE_FLAGS & ~os.O_NOFOLLOW)
        else:
            dfd = None if d is None else self._dir_fd(d, rel_dir)
            if dfd is None:
                fd = beneath.open_file(self.fd, rel)  # (a walk: folders past the kept ones)
            else:
                fd = os.open(os.path.basename(rel), FILE_FLAGS, dir_fd=dfd)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise beneath.NotRegular(os.fsdecode(rel), beneath.kind(st.st_mode))
        except BaseException:
            os.close(fd)
            raise
        return fd, st

    def close(self) -> None:
        for fd in self._dirs.values():
            os.close(fd)
        self._dirs.clear()
        os.close(self.fd)


def scan(source: Source, skipped: list) -> _Tree:
    """Walk the source breadth-first, sorted by name; unrepresentable entries go to skipped.
    Each folder is listed from a descriptor opened beneath the source without following a
    link; a link is skipped (reported) unless the source follows them (files only)."""
    t = _Tree()
    st = os.fstat(source.fd)
    t.d_name.append(0); t.d_len.append(0); t.d_parent.append(-1)
    t.d_mtime.append(st.st_mtime_ns); t.d_mode.append(stat.S_IMODE(st.st_mode))
    t.d_class.append(-1); t.paths.append(b"")
    t.d_gid.append(st.st_gid); t.d_reach.append(source.reach)
    d = 0
    while d < len(t.paths):
        rel = t.paths[d]
        subs, files = [], []
        try:
            fd = source.open_dir(rel)
        except OSError as e:
            skipped.append((os.fsdecode(rel), f"cannot list: {beneath.why(e)}"))
        else:
            try:
                _list(fd, rel, d == 0, source.follow, subs, files, skipped)
            finally:
                os.close(fd)
        t.d_first_sub.append(len(t.paths)); t.d_nsubs.append(len(subs))
        for name, s in subs:
            t.d_name.append(t.add_name(name)); t.d_len.append(len(name)); t.d_parent.append(d)
            t.d_mtime.append(s.st_mtime_ns); t.d_mode.append(stat.S_IMODE(s.st_mode))
            t.d_gid.append(s.st_gid); t.d_reach.append(Access.reach(t.d_reach[d], s))
            if d == 0:
                t.d_class.append(len(t.classes)); t.classes.append(name)
            else:
                t.d_class.append(t.d_class[d])
            t.paths.append(os.path.join(rel, name) if rel else name)
        t.d_first_file.append(len(t.f_size)); t.d_nfiles.append(len(files))
        for name, s in files:
            t.f_name.append(t.add_name(name)); t.f_len.append(len(name)); t.f_dir.append(d)
            t.f_size.append(s.st_size); t.f_mtime.append(s.st_mtime_ns)
            t.f_mode.append(stat.S_IMODE(s.st_mode)); t.f_gid.append(s.st_gid)
        d += 1
    return t


def _list(fd: int, rel: bytes, top: bool, follow: bool, subs: list, files: list, skipped: list) -> None:
    """The folder open as fd (rel in the tree), sorted by name, into subs and files
    [(name, stat)]; what is not packed into skipped."""
    try:
        with os.scandir(fd) as it:
            entries = sorted(((os.fsencode(e.name), e) for e in it), key=lambda x: x[0])
    except OSError as e:
        skipped.append((os.fsdecode(rel), f"cannot list: {e.strerror}"))
        return
    for name, e in entries:
        path = os.path.join(rel, name) if rel else name
        if top and name == CONTROL_NAME:
            skipped.append((os.fsdecode(path), "reserved name: the mount shows its hidden "
                            "control folder there"))
            continue
        try:
            if e.is_dir(follow_symlinks=False):
                subs.append((name, e.stat(follow_symlinks=False)))
            elif e.is_file(follow_symlinks=follow):
                files.append((name, e.stat(follow_symlinks=follow)))
            else:
                kind = "symbolic link" if e.is_symlink() else "special file"
                hint = " (--follow-symlinks packs what links to files point at)" \
                    if kind == "symbolic link" and not follow else ""
                skipped.append((os.fsdecode(path), f"{kind}, not packed{hint}"))
        except OSError as err:
            skipped.append((os.fsdecode(path), f"cannot stat: {err.strerror}"))


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
        if os.path.isdir(p) and not os.path.islink(p):
            shutil.rmtree(p)
        elif os.path.lexists(p):
            os.unlink(p)
    others = sorted(set(existing) - set(ours))
    if others:
        log.warning("%s: leaving %d entries that fusefs did not write: %s", dst, len(others),
                    ", ".join(others[:5]))


STREAM_BYTES = 8 << 20  # a file larger than this is copied by the writer in blocks, never held whole
BLOCK = 1 << 20         # the writer's block


class _Streamed:
    """A file too large to hold: the writer copies it in blocks (its descriptor, open)."""
    __slots__ = ("fd",)

    def __init__(self, fd: int):
        self.fd = fd


def _read_file(source: Source, rel: bytes, d: int | None = None, rel_dir: bytes = b""):
    """The bytes of source file rel (in folder d, see Source.open_file), or a _Streamed for
    one larger than STREAM_BYTES (by its size, or by what it holds when read: a file that
    grows is never held whole). A file whose first read brings exactly the size its fstat
    gave is taken as read whole: an open, an fstat, a read and a close a file."""
    fd, st = source.open_file(rel, d, rel_dir)
    try:
        size = st.st_size
        parts, got = [], 0
        if size <= STREAM_BYTES:
            first = os.read(fd, size + 1)
            if len(first) == size:
                return first
            parts, got = [first], len(first)
        while size <= STREAM_BYTES and got <= STREAM_BYTES:
            part = os.read(fd, STREAM_BYTES + 1 - got)
            if not part:
                return b"".join(parts)
            parts.append(part)
            got += len(part)
        os.set_blocking(fd, True)  # (the writer copies it in blocks)
        streamed, fd = _Streamed(fd), -1
        return streamed
    finally:
        if fd >= 0:
            os.close(fd)


GROUP = 64  # files a reader thread reads in one task (a task a file costs the GIL more)


def _read_group(source: Source, tree: "_Tree", ids: list) -> list:
    """_read_file of each file id of tree in ids: its bytes, a _Streamed, or the OSError."""
    out = []
    paths, f_dir = tree.paths, tree.f_dir
    for i in ids:
        d = f_dir[i]
        try:
            out.append(_read_file(source, tree.file_path(i), d, paths[d]))
        except OSError as e:
            out.append(e)
    return out


class _MemberFailed(Exception):
    def __init__(self, pos: int, error: OSError):
        self.pos, self.error = pos, error


def _write_chunk(fd: int, members: list, labels, progress) -> chunkfmt.ChunkHeader:
    """Write members [(file id, bytes or _Streamed)] as one chunk to the empty file fd: the
    samples from the end of the header's room on (a streamed one in blocks, its checksum
    made as it goes), then the header. _MemberFailed names a streamed member whose read
    failed (the chunk is then written again without it)."""
    start = chunkfmt.data_start(len(members))
    os.lseek(fd, start, os.SEEK_SET)
    sizes, sums = [], []
    for pos, (i, data) in enumerate(members):
        if isinstance(data, _Streamed):
            h, size = xxhash.xxh3_64(), 0
            os.lseek(data.fd, 0, os.SEEK_SET)
            while True:
                try:
                    block = os.read(data.fd, BLOCK)
                except OSError as e:
                    raise _MemberFailed(pos, e) from None
                if not block:
                    break
                h.update(block)
                _write_all(fd, block)
                size += len(block)
                progress(len(block))
            sizes.append(size)
            sums.append(h.intdigest())
        else:
            _write_all(fd, data)
            sizes.append(len(data))
            sums.append(chunkfmt.checksum(data))
    head = chunkfmt.encode_header(sizes, [int(labels[i]) for i, _ in members], sums)
    os.pwrite(fd, head, 0)
    return chunkfmt.parse_header(head, file_size=start + sum(sizes))


def _write_all(fd: int, data) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def pack(src: str, dst: str, *, chunk_bytes: int | None = DEFAULT_CHUNK_BYTES,
         chunk_count: int | None = None, nodes: int | None = None, workers: int = 16,
         strict: bool = False, force: bool = False, progress: bool | None = None,
         mix_classes: bool = False, follow_symlinks: bool = False,
         mode: int | None = None) -> PackResult:
    """Pack the tree at src into dst. See the module docstring. Files go into chunks in
    the tree's order (class by class), or with mix_classes in `mixed_order`. mode: the
    chunks' and the index's (default: the most restrictive their contents had)."""
    if not os.path.isdir(src):
        raise PackError(f"{src} is not a folder")
    if nodes is not None and nodes < 1:
        raise PackError("--nodes must be at least 1")
    if not chunk_bytes and not chunk_count:
        raise PackError("give a chunk size in bytes or a sample count")
    if mode is not None and not 0 <= mode <= 0o777:
        raise PackError(f"--mode must be permission bits (0 to 0777), got {mode:o}")
    t0 = time.perf_counter()
    skipped: list = []
    source = Source(src, follow_symlinks)
    umask = os.umask(0o022)  # (read once, before any thread: what the user's umask takes)
    os.umask(umask)
    try:
        return _pack(source, dst, chunk_bytes, chunk_count, nodes, workers, strict, force, progress,
                     mix_classes, mode, umask, skipped, t0)
    finally:
        source.close()


def _pack(source, dst, chunk_bytes, chunk_count, nodes, workers, strict, force, progress,
          mix_classes, mode, umask, skipped, t0) -> PackResult:
    tree = scan(source, skipped)
    if strict and skipped:
        raise PackError(f"{skipped[0][0]}: {skipped[0][1]} (--strict)")
    _prepare_dst(dst, force)

    f_dir = np.asarray(tree.f_dir, dtype=np.int64)
    labels_all = np.asarray(tree.d_class, dtype=np.int32)[f_dir] if len(f_dir) else np.zeros(0, np.int32)
    f_mode, f_gid = np.asarray(tree.f_mode, np.int64), np.asarray(tree.f_gid, np.int64)
    f_reach = np.asarray(tree.d_reach, np.int64)[f_dir] if len(f_dir) else np.zeros(0, np.int64)
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
    chunk_modes: list[int] = []

    bar = tqdm(total=total, unit="iB", unit_scale=True, unit_divisor=1024, desc="pack",
               disable=(None if progress is None else not progress), dynamic_ncols=True)
    # Writer thread: takes a chunk's [(file id, bytes or _Streamed)] and writes it.
    work: queue.Queue = queue.Queue(maxsize=1)
    failure: list[BaseException] = []

    def drop(i: int, error: OSError) -> None:
        rel = os.fsdecode(tree.file_path(i))
        if strict:
            raise PackError(f"{rel}: cannot read: {beneath.why(error)} (--strict)")
        skipped.append((rel, f"cannot read: {beneath.why(error)}"))
        kept[i] = False

    def write(members: list) -> None:
        k = len(chunk_paths)  # (chunks numbered as written: one whose every file failed is none)
        rel = (f"node-{k % nodes}/chunk-{k:06d}.fck" if nodes else f"{CHUNKS_DIR}/chunk-{k:06d}.fck")
        path = os.path.join(dst, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        while members:
            ids = [i for i, _ in members]
            want, group = (mode, None) if mode is not None else Access.mode(f_mode[ids], f_gid[ids], f_reach[ids])
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, want)
            try:
                if mode is not None:
                    os.fchmod(fd, mode)  # (exactly what the user gave)
                elif group is not None and group != os.getegid():
                    try:
                        os.fchown(fd, -1, group)
                    except PermissionError:  # (not ours to give: no group access, then)
                        want &= ~0o040
                        os.fchmod(fd, want & ~umask)
                head = _write_chunk(fd, members, labels_all, bar.update)
                os.fsync(fd)
            except _MemberFailed as e:
                os.close(fd)
                os.unlink(path)
                i, data = members.pop(e.pos)
                os.close(data.fd)
                drop(i, e.error)
                continue
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)
            sizes[ids], sums[ids], offsets[ids] = head.sizes, head.checksums, head.offsets
            chunk_of[ids] = k
            chunk_paths.append(rel)
            chunk_meta.append((head.file_size, head.n))
            chunk_modes.append(want)
            return

    def writer():
        while True:
            item = work.get()
            if item is None:
                return
            members = item
            try:
                if not failure:
                    write(members)
            except BaseException as e:  # reported by the main thread
                failure.append(e)
            finally:
                for _, data in members:
                    if isinstance(data, _Streamed):
                        os.close(data.fd)

    wt = threading.Thread(target=writer, name="fusefs-pack-writer", daemon=True)
    wt.start()
    nfiles = len(tree.f_size)
    done_files = 0
    try:
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="fusefs-pack") as pool:
            for start, end in runs:
                ids = order[start:end].tolist()
                groups = [ids[g:g + GROUP] for g in range(0, len(ids), GROUP)]
                futures = [pool.submit(_read_group, source, tree, group) for group in groups]
                members = []
                for i, data in zip(ids, (data for fut in futures for data in fut.result())):
                    if isinstance(data, OSError):
                        drop(i, data)
                        continue
                    members.append((i, data))
                    if not isinstance(data, _Streamed):
                        bar.update(len(data))
                done_files += end - start
                bar.set_postfix_str(f"{done_files}/{nfiles} files", refresh=False)
                if not members:
                    continue
                if failure:
                    break
                work.put(members)
    finally:
        work.put(None)
        wt.join()
        bar.close()
    if failure:
        if isinstance(failure[0], PackError):
            raise failure[0]
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
    if mode is None:  # (what the files kept and every folder were: their names are in it)
        d_mode, d_gid, d_reach = (np.asarray(a, np.int64) for a in (tree.d_mode, tree.d_gid, tree.d_reach))
        mode_index, group = Access.mode(np.concatenate([f_mode[kept], d_mode]),
                                        np.concatenate([f_gid[kept], d_gid]),
                                        np.concatenate([f_reach[kept], d_reach]))
        mode_index = functools.reduce(operator.and_, chunk_modes, mode_index)  # (nor than a chunk)
    index.save(os.path.join(dst, INDEX_NAME), mode=mode if mode is not None else mode_index,
               group=None if mode is not None else group)
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
