"""The index of a packed dataset: the tree, every sample's place, the chunks and nodes.

One file, `index.fusefs`, in the packed folder:

    offset  size  field
    0       8     magic b"FUSEFSIX"
    8       4     format version (u32, currently 1)
    12      4     flags (u32): 0, or IN_PLACE (the chunks are tar files read where they lie)
    16      8     length of the JSON metadata (u64)
    24      8     xxh3-64 of the JSON metadata (u64)
    32      ...   JSON metadata (UTF-8): classes, chunks, nodes, and for every array
                  its dtype, length, offset in this file and xxh3-64
    ...           the arrays, each starting on a 64-byte boundary

The tree is held as arrays, never as one Python object per sample, so the index of
1.28M samples loads in well under a second. Directories are numbered breadth-first (0 is
the root); the subdirectories of a directory, and its files, are contiguous runs sorted
by name, so a lookup is a binary search. Sample ids are file numbers in that order.
Names are raw bytes (any byte but '/' and NUL), so any name on the source round-trips.
"""
from __future__ import annotations

import errno
import json
import logging
import os
import stat
import struct
import time
from dataclasses import dataclass

import numpy as np
import xxhash

from . import beneath
from . import chunk as chunkfmt
from .access import Access
from .protocol import CONTROL
from .errors import UserError

log = logging.getLogger("fusefs")

MAGIC = b"FUSEFSIX"
VERSION = 1
INDEX_NAME = "index.fusefs"
CONTROL_NAME = CONTROL.encode()  # the mount's hidden control folder: no packed entry at the root may use it
_HEAD = struct.Struct("<8sIIQQ")
_ALIGN = 64
MAX_CHUNK_BYTES = 1 << 48  # a chunk's size (and sample count) beyond this is refused
IN_PLACE = 1  # flag: the chunks are tar files beneath `source`, indexed in place (tarindex.py)
TAR_BLOCK = 512  # a tar member's bytes follow at least one header block

# name -> dtype of every array, per file (sample) and per directory.
FILE_ARRAYS = {
    "file_name_off": "<u8", "file_name_len": "<u4", "file_dir": "<u4",
    "chunk": "<u4", "offset": "<u8", "size": "<u8", "label": "<i4",
    "checksum": "<u8", "mtime_ns": "<i8", "mode": "<u4",
}
DIR_ARRAYS = {
    "dir_name_off": "<u8", "dir_name_len": "<u4", "dir_parent": "<i4",
    "dir_mtime_ns": "<i8", "dir_mode": "<u4", "dir_first_file": "<u8",
    "dir_nfiles": "<u8", "dir_first_sub": "<u4", "dir_nsubs": "<u4",
}
ARRAY_DTYPES = {**FILE_ARRAYS, **DIR_ARRAYS, "names": "|u1"}  # every array of the file, by its type


class IndexFormatError(UserError, ValueError):
    """The index file is missing, truncated, damaged or inconsistent."""


@dataclass(frozen=True)
class ChunkInfo:
    path: str  # relative to the packed folder
    node: int  # index into Index.nodes
    size: int  # bytes
    count: int  # samples


@dataclass(frozen=True)
class TarStamp:
    """What the index knows of an in-place set's tar besides its ChunkInfo: the xxh3-64 of
    its first block and its mtime when it was indexed."""
    head: int
    mtime_ns: int


class Index:
    """A packed dataset's index, held in numpy arrays. An in-place one (`source` set) reads
    its chunks, tar files, beneath the folder `source` (an absolute path without links);
    `tars` holds their TarStamp."""

    def __init__(self, arrays: dict, names: bytes, classes, chunks, nodes, *,
                 source: str | None = None, tars=()):
        for key in list(FILE_ARRAYS) + list(DIR_ARRAYS):
            setattr(self, key, arrays[key])
        self.names = names
        self.classes = list(classes)
        self.chunks = list(chunks)
        self.nodes = list(nodes)
        self.source, self.tars = source, list(tars)
        self.n_files = len(self.size)
        self.n_dirs = len(self.dir_parent)
        self._check()
        # served as permission bits only: a setuid, setgid or sticky bit of the source (or of
        # a crafted index) never reaches the mount (which is nosuid, nodev as well)
        self.mode, self.dir_mode = self.mode & 0o777, self.dir_mode & 0o777
        # a sample's size and chunk as Python ints, for the per-sample paths (indexing a
        # memoryview is 2-4 times faster than a numpy scalar and its arithmetic)
        self.size_v, self.chunk_v = memoryview(self.size), memoryview(self.chunk)
        self.offset_v, self.checksum_v = memoryview(self.offset), memoryview(self.checksum)

    # ---- consistency ---------------------------------------------------------------
    def _check(self):
        n, d = self.n_files, self.n_dirs
        for key in FILE_ARRAYS:
            if len(getattr(self, key)) != n:
                raise IndexFormatError(f"array {key} has {len(getattr(self, key))} entries, expected {n}")
        for key in DIR_ARRAYS:
            if len(getattr(self, key)) != d:
                raise IndexFormatError(f"array {key} has {len(getattr(self, key))} entries, expected {d}")
        if d == 0:
            raise IndexFormatError("no root directory")
        names = len(self.names)
        if n and (int(self.file_name_off.max()) > names
                  or int((self.file_name_off + self.file_name_len).max()) > names):
            raise IndexFormatError("a file name lies outside the name table")
        if int(self.dir_name_off.max()) > names or int((self.dir_name_off + self.dir_name_len).max()) > names:
            raise IndexFormatError("a directory name lies outside the name table")
        if (n and int(self.mode.max()) > 0o7777) or int(self.dir_mode.max()) > 0o7777:
            raise IndexFormatError("a mode holds more than permission bits")
        if self.dir_parent[0] != -1 or (d > 1 and not np.all(
                (self.dir_parent[1:] >= 0) & (self.dir_parent[1:] < np.arange(1, d)))):
            raise IndexFormatError("directory parents are not a breadth-first tree")
        if np.any(self.dir_first_file > n) or np.any(self.dir_nfiles > n - self.dir_first_file) or \
                np.any(self.dir_first_sub.astype(np.int64) + self.dir_nsubs > d):
            raise IndexFormatError("a directory's entries lie outside the tables")
        if n and (np.any(self.file_dir >= d)
                  or not np.array_equal(self.dir_first_file[self.file_dir] <= np.arange(n),
                                        np.ones(n, bool))):
            raise IndexFormatError("file parents are inconsistent")
        # every folder but the root and every file is listed once, in its parent's run: a
        # listing of the tree ends (a run that held a folder above it would loop)
        if not _runs_partition(self.dir_first_sub, self.dir_nsubs, self.dir_parent, 1, d):
            raise IndexFormatError("the folders' runs of subfolders do not match their parents")
        if not _runs_partition(self.dir_first_file, self.dir_nfiles, self.file_dir, 0, n):
            raise IndexFormatError("the folders' runs of files do not match the files' folders")
        for c in self.chunks:
            try:
                beneath.components(c.path)
            except ValueError:
                raise IndexFormatError(f"chunk path {c.path!r} is not a plain path inside the "
                                       "packed folder") from None
            if not (0 <= c.size <= MAX_CHUNK_BYTES and 0 <= c.count <= MAX_CHUNK_BYTES):
                raise IndexFormatError(f"chunk {c.path} has a size or count out of range")
            if not (0 <= c.node < len(self.nodes)):
                raise IndexFormatError(f"chunk {c.path} names node {c.node}, which does not exist")
        if len({c.path for c in self.chunks}) != len(self.chunks):
            raise IndexFormatError("two chunks have the same path")
        if self.source is not None:
            if not (self.source == "/" or (self.source.startswith("/") and _plain(self.source[1:]))):
                raise IndexFormatError(f"in-place source {self.source!r} is not an absolute path "
                                       "without '.', '..' or empty components")
            if len(self.tars) != len(self.chunks):
                raise IndexFormatError(f"{len(self.tars)} tars described for {len(self.chunks)} chunks")
        self._check_samples()
        self._check_names()

    def _check_samples(self):
        """Every sample within the data of its chunk (past the chunk's header and tables),
        and no two samples of a chunk overlapping: a sample's bytes are its own, as the
        chunk's header lists them (store.ChunkStore.check compares the two). Keeps the
        samples by chunk and offset (`by_chunk`, chunk k's run from `chunk_start[k]`)."""
        n, nc = self.n_files, len(self.chunks)
        self.by_chunk = np.zeros(0, np.int64)
        self.chunk_start = np.zeros(nc + 1, np.int64)
        if not n:
            return
        if np.any(self.chunk >= nc):
            raise IndexFormatError("a sample names a chunk that does not exist")
        ends = np.array([c.size for c in self.chunks], dtype=np.uint64)[self.chunk]
        starts = np.array([TAR_BLOCK if self.in_place else chunkfmt.data_start(c.count)
                           for c in self.chunks], dtype=np.uint64)[self.chunk]
        # (size first: offset + size could wrap around)
        if np.any(self.size > ends) or np.any(self.offset > ends - self.size) or np.any(self.offset < starts):
            raise IndexFormatError("a sample lies outside its chunk's data")
        order = np.lexsort((self.offset, self.chunk))
        chunk, offset, size = self.chunk[order], self.offset[order], self.size[order]
        same = chunk[1:] == chunk[:-1]
        if np.any(same & (offset[1:] < offset[:-1] + size[:-1])):
            raise IndexFormatError("two samples of a chunk overlap")
        self.by_chunk = order
        self.chunk_start = np.searchsorted(chunk, np.arange(nc + 1)).astype(np.int64)

    def _check_names(self):
        """Every name a safe path component (not empty, `.` or `..`, no `/` or NUL), the
        root unnamed, and names unique within each directory (kept sorted for lookups)."""
        if b"/" in self.names or b"\0" in self.names:
            raise IndexFormatError("a name holds '/' or a NUL byte (absolute or unsafe path)")
        if self.dir_name_len[0] != 0:
            raise IndexFormatError("the root directory has a name")
        blob = np.frombuffer(self.names, dtype=np.uint8)
        for what, off, length in (("file", self.file_name_off, self.file_name_len),
                                  ("directory", self.dir_name_off[1:], self.dir_name_len[1:])):
            if len(length) and int(length.min()) == 0:
                raise IndexFormatError(f"a {what} has an empty name")
            for k in (1, 2):  # "." and ".."
                at = off[length == k].astype(np.int64)
                if len(at) and np.any(np.all([blob[at + j] == ord(".") for j in range(k)], axis=0)):
                    raise IndexFormatError(f"a {what} is called {'.' * k!r} (path leaves its folder)")
        names, foff, flen = self.names, self.file_name_off.tolist(), self.file_name_len.tolist()
        doff, dlen = self.dir_name_off.tolist(), self.dir_name_len.tolist()
        for d, (f0, nf, s0, ns) in enumerate(zip(self.dir_first_file.tolist(), self.dir_nfiles.tolist(),
                                                 self.dir_first_sub.tolist(), self.dir_nsubs.tolist())):
            files = [names[foff[i]:foff[i] + flen[i]] for i in range(f0, f0 + nf)]
            subs = [names[doff[i]:doff[i] + dlen[i]] for i in range(s0, s0 + ns)]
            for group in (files, subs):
                if any(a >= b for a, b in zip(group, group[1:])):
                    raise IndexFormatError(f"directory {self.dir_path(d)!r} holds duplicate or "
                                           "unsorted names")
            if nf and ns and not set(files).isdisjoint(subs):
                raise IndexFormatError(f"directory {self.dir_path(d)!r} holds a file and a folder "
                                       "of the same name")
            if d == 0 and CONTROL_NAME in files + subs:
                raise IndexFormatError(f"the root holds {CONTROL_NAME.decode()!r}, the name "
                                       "reserved for the mount's control folder")

    @property
    def in_place(self) -> bool:
        return self.source is not None

    def data_root(self, dst: str) -> str:
        """The folder the chunks' paths are relative to: the packed folder dst, or an in-place
        set's source."""
        return self.source if self.in_place else dst

    def narrow_modes(self, caps, shown_gid: int) -> None:
        """Show no member of an in-place set more open than its tar is: caps holds each tar's
        (mode, gid, reach) as the mount found it (store.ChunkStore.check). Others keep their
        bits where every folder down to the tar lets them in; the group shown (shown_gid) keeps
        the tar's group bits if it is the tar's group, else no more than others have. A folder
        shows what the tars beneath it together allow (and search where read is allowed)."""
        cap = np.zeros(len(caps), np.uint32)
        for k, (mode, gid, reach) in enumerate(caps):
            others = mode & 0o007 if reach == Access.EVERYONE else 0
            group = mode & 0o070 if gid == shown_gid and reach in (Access.EVERYONE, gid) else others << 3
            cap[k] = (mode & 0o700) | group | others
        if not self.n_files:
            return
        self.mode = self.mode & cap[self.chunk]
        held = np.zeros(self.n_dirs, np.uint32)
        np.bitwise_or.at(held, self.file_dir, cap[self.chunk])
        parents = self.dir_parent.tolist()
        for d in range(self.n_dirs - 1, 0, -1):  # (breadth-first: a folder after its parent)
            held[parents[d]] |= held[d]
        held |= (held & 0o444) >> 2
        self.dir_mode = np.where(held > 0, self.dir_mode & held, self.dir_mode & 0o755).astype(np.uint32)

    # ---- names and paths -----------------------------------------------------------
    def file_name(self, i: int) -> bytes:
        off = int(self.file_name_off[i])
        return self.names[off:off + int(self.file_name_len[i])]

    def dir_name(self, d: int) -> bytes:
        off = int(self.dir_name_off[d])
        return self.names[off:off + int(self.dir_name_len[d])]

    def dir_path(self, d: int) -> bytes:
        parts = []
        while d > 0:
            parts.append(self.dir_name(d))
            d = int(self.dir_parent[d])
        return b"/".join(reversed(parts))

    def file_path(self, i: int) -> bytes:
        """Relative path (bytes) of sample i."""
        parent = self.dir_path(int(self.file_dir[i]))
        return parent + b"/" + self.file_name(i) if parent else self.file_name(i)

    def lookup_dir(self, d: int, name: bytes) -> int | None:
        """Subdirectory of d called name, or None."""
        lo, n = int(self.dir_first_sub[d]), int(self.dir_nsubs[d])
        return _bisect(self.dir_name, lo, lo + n, name)

    def lookup_file(self, d: int, name: bytes) -> int | None:
        """Sample id of the file called name in directory d, or None."""
        lo, n = int(self.dir_first_file[d]), int(self.dir_nfiles[d])
        return _bisect(self.file_name, lo, lo + n, name)

    @property
    def total_bytes(self) -> int:
        return int(self.size.sum())

    def chunks_per_node(self) -> dict[str, int]:
        counts = {name: 0 for name in self.nodes}
        for c in self.chunks:
            counts[self.nodes[c.node]] += 1
        return counts

    # ---- file I/O ------------------------------------------------------------------
    def save(self, path: str, mode: int = 0o644, group: int | None = None) -> None:
        """Write the index to path atomically (a temporary file, fsync, then rename), made
        with mode (less what the umask takes) and never through a link; group: the file's
        group (where that cannot be set, the mode's group bits are dropped)."""
        arrays = {k: np.ascontiguousarray(getattr(self, k), dtype=dt)
                  for k, dt in {**FILE_ARRAYS, **DIR_ARRAYS}.items()}
        arrays["names"] = np.frombuffer(self.names, dtype=np.uint8)
        meta = {"classes": self.classes, "nodes": self.nodes,
                "chunks": [[c.path, c.node, c.size, c.count] for c in self.chunks],
                "arrays": {}}
        if self.in_place:
            meta["in_place"] = {"source": self.source, "tars": [[t.head, t.mtime_ns] for t in self.tars]}
        # Array offsets depend on the metadata's length; lay them out relative first.
        rel = 0
        for key, arr in arrays.items():
            rel = _align(rel)
            meta["arrays"][key] = [arr.dtype.str, len(arr), rel, xxhash.xxh3_64_intdigest(arr)]
            rel += arr.nbytes
        blob = json.dumps(meta, sort_keys=True).encode()
        base = _align(_HEAD.size + len(blob) + 16)  # 16: room for the base field below
        meta["base"] = base
        blob = json.dumps(meta, sort_keys=True).encode().ljust(base - _HEAD.size)
        tmp = f"{path}.tmp.{os.getpid()}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
        if group is not None and group != os.getegid():
            try:
                os.fchown(fd, -1, group)
            except PermissionError:
                os.fchmod(fd, stat.S_IMODE(os.fstat(fd).st_mode) & ~0o070)
        with open(fd, "wb") as f:
            f.write(_HEAD.pack(MAGIC, VERSION, IN_PLACE if self.in_place else 0, len(blob), xxhash.xxh3_64_intdigest(blob)))
            f.write(blob)
            for key, arr in arrays.items():
                f.seek(base + meta["arrays"][key][2])
                f.write(arr.tobytes())
            f.truncate(base + rel)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str, retries: int = 0, backoff: float = 0.1, max_wait: float = 2.0) -> "Index":
        """Load and check an index file; IndexFormatError names what is wrong. A failed read
        is tried again `retries` times, the wait doubling from `backoff` seconds up to
        `max_wait`."""
        for attempt in range(retries + 1):
            try:
                data = _read_file(path)
                break
            except (FileNotFoundError, NotADirectoryError):
                raise IndexFormatError(f"{path}: no index (not a packed dataset, or the pack did not finish)") from None
            except beneath.NotRegular:
                raise IndexFormatError(f"{path}: not a regular file") from None
            except OSError as e:
                if e.errno == errno.ELOOP:
                    raise IndexFormatError(f"{path}: a symbolic link (not followed)") from None
                if attempt == retries:
                    raise IndexFormatError(f"{path}: cannot read index ({retries} retries): {e.strerror}") from None
                log.warning("%s: read failed (%s), retry %d of %d", path, e.strerror, attempt + 1, retries)
                time.sleep(min(backoff * 2 ** attempt, max_wait))
        try:
            return cls.from_bytes(data)
        except IndexFormatError as e:
            raise IndexFormatError(f"{path}: {e}") from None

    @classmethod
    def from_bytes(cls, data: bytes) -> "Index":
        if len(data) < _HEAD.size:
            raise IndexFormatError(f"truncated ({len(data)} bytes)")
        magic, version, flags, meta_len, meta_sum = _HEAD.unpack_from(data, 0)
        if magic != MAGIC:
            raise IndexFormatError("not a fusefs index (bad magic number)")
        if version != VERSION:
            raise IndexFormatError(f"unsupported index format version {version} (this fusefs reads {VERSION})")
        if flags & ~IN_PLACE:
            raise IndexFormatError(f"unknown index flags {flags:#x} (a newer fusefs wrote it?)")
        if meta_len > len(data) - _HEAD.size:
            raise IndexFormatError("truncated metadata")
        blob = data[_HEAD.size:_HEAD.size + meta_len]
        if xxhash.xxh3_64_intdigest(blob) != meta_sum:
            raise IndexFormatError("metadata fails its checksum")
        try:
            meta = json.loads(blob)  # (nesting too deep for Python: RecursionError, below)
            if not isinstance(meta, dict) or not isinstance(meta.get("arrays"), dict):
                raise IndexFormatError("malformed metadata (not an object with arrays)")
            for key in ("chunks", "classes", "nodes"):
                if not isinstance(meta.get(key), list):
                    raise IndexFormatError(f"malformed metadata ({key} is not a list)")
            if set(meta["arrays"]) != set(ARRAY_DTYPES):
                raise IndexFormatError("malformed metadata (the arrays are not the index's: "
                                       f"{sorted(set(meta['arrays']) ^ set(ARRAY_DTYPES))})")
            base = int(meta["base"])
            arrays = {}
            for key, (dtype, length, rel, digest) in meta["arrays"].items():
                if dtype != ARRAY_DTYPES[key]:
                    raise IndexFormatError(f"array {key} has type {dtype!r}, not {ARRAY_DTYPES[key]!r}")
                dt = np.dtype(dtype)
                if int(length) < 0 or int(rel) < 0:
                    raise IndexFormatError(f"array {key} has a negative length or offset")
                start, end = base + int(rel), base + int(rel) + dt.itemsize * int(length)
                if start < base or end > len(data):
                    raise IndexFormatError(f"truncated (array {key} ends at {end}, file has {len(data)} bytes)")
                arr = np.frombuffer(data, dtype=dt, count=int(length), offset=start)
                if xxhash.xxh3_64_intdigest(arr) != digest:
                    raise IndexFormatError(f"array {key} fails its checksum")
                arrays[key] = arr
            if not all(isinstance(c, list) and len(c) == 4 and isinstance(c[0], str)
                       and all(type(x) is int for x in c[1:]) for c in meta["chunks"]):
                raise IndexFormatError("malformed metadata (a chunk is not [path, node, size, count])")
            chunks = [ChunkInfo(p, n, s, c) for p, n, s, c in meta["chunks"]]
            source, tars = None, []
            if flags & IN_PLACE:
                place = meta.get("in_place")
                if not (isinstance(place, dict) and isinstance(place.get("source"), str)
                        and isinstance(place.get("tars"), list)
                        and all(isinstance(t, list) and len(t) == 2 and all(type(x) is int for x in t)
                                for t in place["tars"])):
                    raise IndexFormatError("malformed metadata (an in-place index without its "
                                           "source and tars)")
                source, tars = place["source"], [TarStamp(h, m) for h, m in place["tars"]]
            names = arrays.pop("names").tobytes()
            return cls(arrays, names, [str(c) for c in meta["classes"]], chunks,
                       [str(n) for n in meta["nodes"]], source=source, tars=tars)
        except IndexFormatError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError, RecursionError) as e:
            raise IndexFormatError(f"malformed metadata ({type(e).__name__}: {e})") from None


def _read_file(path: str) -> bytes:
    """The bytes of the regular file at path, whose last component is not followed if a
    link (the folder is the one the user named)."""
    folder = os.open(os.path.dirname(path) or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fd = beneath.open_file(folder, os.path.basename(path))
    finally:
        os.close(folder)
    with os.fdopen(fd, "rb") as f:
        return f.read()


def _plain(rel: str) -> bool:
    try:
        beneath.components(rel)
    except ValueError:
        return False
    return True


def _runs_partition(first, count, parent_of, lo: int, hi: int) -> bool:
    """Whether the runs [first[p], first[p] + count[p]) of every folder p together hold each
    of lo..hi-1 exactly once, and each member's parent_of is the folder whose run holds it."""
    count = count.astype(np.int64)
    if int(count.sum()) != hi - lo:
        return False
    owner = np.repeat(np.arange(len(count)), count)
    within = np.arange(hi - lo) - np.repeat(np.cumsum(count) - count, count)
    members = np.repeat(first.astype(np.int64), count) + within
    if len(members) and (members.min() < lo or members.max() >= hi):
        return False
    seen = np.zeros(hi - lo, dtype=bool)
    seen[members - lo] = True
    return bool(seen.all()) and bool(np.all(parent_of[members] == owner))


def _align(x: int) -> int:
    return (x + _ALIGN - 1) // _ALIGN * _ALIGN


def _bisect(name_of, lo: int, hi: int, name: bytes) -> int | None:
    """Position of name in the sorted run name_of(lo..hi-1), or None."""
    end = hi
    while lo < hi:
        mid = (lo + hi) // 2
        if name_of(mid) < name:
            lo = mid + 1
        else:
            hi = mid
    return lo if lo < end and name_of(lo) == name else None
