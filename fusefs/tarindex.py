"""`fusefs pack --in-place SRC DST`: index uncompressed tar files where they lie, no copy.

SRC is one tar file, whose members make the tree, or a folder: each `NAME.tar` beneath it
becomes the folder NAME at its place, its members inside. A member that is itself a tar
(`n01440764.tar` inside ImageNet's training archive) becomes a folder the same way, so the
per-class tars of ImageNet's archive are the class folders ImageFolder sees, and a
WebDataset shard's keys stay as they are inside its shard's folder. Each tar is read once,
sequentially (plain ustar and GNU headers parsed here, extension records, links and the like
by tarfile), every member's bytes checksummed (xxh3-64, as pack's samples), and DST gets
only the index: its chunks are the tars (a nested member's offset is its place in the
outermost tar), read where they are. Members that are not regular files are skipped and
reported, as `pack` reports what it does not pack; a later member of a name replaces an
earlier one, as extracting would. Compressed tars are refused: their members have no place
to be read from.

The index names the source folder by its absolute path without links (realpath at
indexing); the mount opens it and every tar beneath it without following one
(store.ChunkStore), and shows no member more open than its tar is (`Access`, at indexing
and again at mount).
"""
from __future__ import annotations

import collections
import os
import stat
import tarfile
import time
from array import array

import numpy as np
import xxhash
from tqdm import tqdm

from . import beneath
from . import nodes as nodesmod
from .access import Access, resolve
from .index import CONTROL_NAME, INDEX_NAME, ChunkInfo, Index, TarStamp
from .pack import PackError, PackResult, _fsync_dir, _prepare_dst

TAR_SUFFIX = b".tar"
BLOCK = tarfile.BLOCKSIZE  # 512
READ_BUFFER = 1 << 20  # the sequential reader's buffer
HASH_BLOCK = 8 << 20  # a member larger than this is hashed in blocks, never held whole
MAX_NESTING = 8  # tars inside tars, at most this deep (deeper ones are kept as files)
# what a compressed tar starts with, and the suffixes that name one
COMPRESSED = ((b"\x1f\x8b", "gzip"), (b"\x28\xb5\x2f\xfd", "zstd"), (b"\xfd7zXZ\x00", "xz"),
              (b"BZh", "bzip2"), (b"\x04\x22\x4d\x18", "lz4"))
COMPRESSED_SUFFIXES = {b".tar.gz": "gzip", b".tgz": "gzip", b".tar.zst": "zstd", b".tzst": "zstd",
                       b".tar.xz": "xz", b".txz": "xz", b".tar.bz2": "bzip2", b".tbz2": "bzip2",
                       b".tar.lz4": "lz4"}
DECOMPRESS = {"gzip": "gunzip", "zstd": "unzstd", "xz": "unxz", "bzip2": "bunzip2", "lz4": "unlz4"}
# a member's path in the tree and each of its names, at most (longer ones are skipped: no reader
# could open them, and the index's names stay bounded by what the tars' headers hold)
PATH_MAX, NAME_MAX = 4095, 255
MAX_DEPTH = 256  # folders a member's path may pass through, in the tree (skipped past it)
SHOWN = 300  # characters of a member's name that a skip's message shows, at most
# the most a tar's extension record (a pax header, a GNU long name) may hold, in whole blocks:
# tarfile reads one whole into memory, and a crafted tar could make it gigabytes
MAX_EXTENSION = 1 << 20


class InPlaceError(PackError):
    """The in-place index cannot be made; the message says why."""


class NotATar(Exception):
    """A file named NAME.tar that holds no tar (skipped and reported)."""


def refuse_compressed(path: str, what: str) -> InPlaceError:
    return InPlaceError(f"{path} is {what}-compressed: its members cannot be read in place. "
                        f"Decompress it to a plain .tar (e.g. `{DECOMPRESS[what]} FILE`) "
                        "and index that, or `fusefs pack` the extracted tree")


def compression(head: bytes) -> str | None:
    """The compression whose magic number head starts with, or None."""
    for magic, name in COMPRESSED:
        if head.startswith(magic):
            return name
    return None


def dir_mode(mode: int) -> int:
    """A folder's mode from a file's: search where read is allowed."""
    mode &= 0o777
    return mode | ((mode & 0o444) >> 2)


PLAIN = (b"0", b"\0", b"7", b"5")  # regular files (and contiguous ones), folders
POSIX_MAGIC, GNU_MAGIC = b"ustar\x0000", b"ustar  \x00"


class Entry:
    """A tar member as the index needs it: raw name, mode, size, mtime (ns), kind ("file",
    "dir" or why it is not indexed) and where its bytes start in its tar."""
    __slots__ = ("name", "mode", "size", "mtime", "kind", "offset_data")

    def __init__(self, name, mode, size, mtime, kind, offset_data):
        self.name, self.mode, self.size, self.mtime = name, mode, size, mtime
        self.kind, self.offset_data = kind, offset_data


def _octal(field: bytes) -> int:
    return int(field.strip(b" \0") or b"0", 8)


def plain_header(block: bytes, offset: int):
    """The Entry of a plain ustar or GNU header at offset (a file or folder, numbers in
    octal, its checksum right), or None: tarfile reads anything else."""
    kind = block[156:157]
    magic = block[257:265]
    if kind not in PLAIN or (magic != POSIX_MAGIC and magic != GNU_MAGIC) or block[124] & 0x80 \
            or block[136] & 0x80:
        return None
    try:
        chk, size = _octal(block[148:156]), _octal(block[124:136])
        mode, mtime = _octal(block[100:108]), _octal(block[136:148])
    except ValueError:
        return None
    if min(chk, size, mode, mtime) < 0:  # (int() takes a sign: tarfile reads and refuses it)
        return None
    if chk != sum(block) - sum(block[148:156]) + 256:
        return None
    name = block[:100].split(b"\0", 1)[0]
    if block[345] and magic == POSIX_MAGIC:  # (GNU keeps its atime and ctime there, no prefix)
        name = block[345:500].split(b"\0", 1)[0] + b"/" + name
    is_dir = kind == b"5" or (kind == b"\0" and name.endswith(b"/"))
    return Entry(name.rstrip(b"/") if is_dir else name, mode, 0 if is_dir else size,
                 mtime * 1_000_000_000, "dir" if is_dir else "file", offset + BLOCK)


def _from_tarinfo(ti) -> Entry:
    if ti.isdir():
        kind = "dir"
    elif ti.issparse():
        kind = "a sparse file"
    elif ti.isreg():
        kind = "file"
    elif ti.issym() or ti.islnk():
        kind = "a link"
    else:
        kind = "a special file"
    return Entry(os.fsencode(ti.name), ti.mode, ti.size, int(ti.mtime * 1_000_000_000), kind,
                 ti.offset_data)


class Headers:
    """The members of the tar read through view (size bytes), in order: plain headers parsed
    here, anything else (pax and GNU extension records, links, devices) by tarfile, which
    takes over the rest of a tar that holds a global pax header. `end`: where the last header
    stopped, `short`: why the tar ended early (None if it did not)."""

    def __init__(self, view, size: int):
        self.view, self.size = view, size
        self.tf = None
        self.end, self.short = 0, None
        self.tarfile_only = False

    def __iter__(self):
        view, size, offset = self.view, self.size, 0
        while True:
            self.end = offset
            if offset + BLOCK > size:
                return
            if not self.tarfile_only:
                view.seek(offset)
                block = view.read(BLOCK)
                if len(block) < BLOCK:  # (the file is shorter than when it was opened)
                    self.short = "read short: the tar changed while it was indexed"
                    return
                if block[156:157] == b"g":
                    self.tarfile_only = True
                e = None if self.tarfile_only else plain_header(block, offset)
                if e is not None:
                    yield e
                    offset = e.offset_data + -(-e.size // BLOCK) * BLOCK
                    continue
                if not block.strip(b"\0"):
                    return
            ti = self._tarfile_next(offset)
            if ti is None:
                return
            e = _from_tarinfo(ti)
            back = None  # (why the next header's place is unknown)
            if e.size < 0:
                back = f"a negative size ({e.size})"
            elif self.tf.offset <= offset:  # mutation: equivalent, past a header of size >= 0 tarfile's next is a block on at least
                back = "a header that points back"
            if back is not None:
                e.kind = back
                self.short = f"{back} at byte {offset}"
                yield e
                return
            yield e
            offset = self.tf.offset

    def _tarfile_next(self, offset: int):
        try:
            if self.tf is None:
                self.view.seek(offset)
                self.tf = tarfile.TarFile(fileobj=self.view, mode="r")
                ti = self.tf.firstmember
                self.tf.firstmember = None
            else:
                self.tf.offset = offset
                ti = self.tf.next()
        except tarfile.ReadError as e:
            self.short = str(e)
            return None
        self.tf.members.clear()
        return ti


class _Window:
    """A tar's bytes, [base, base + size) of the outer reader (a nested tar's, or the whole
    file), as a file for the header reads: none larger than an extension record's bound."""

    def __init__(self, f, base: int, size: int):
        self.f, self.base, self.size, self.pos = f, base, size, 0

    def seek(self, pos: int, whence: int = 0) -> int:
        self.pos = pos if whence == 0 else (self.pos + pos if whence == 1 else self.size + pos)
        return self.pos

    def tell(self) -> int:
        return self.pos

    def read(self, n: int = -1) -> bytes:
        left = max(0, self.size - self.pos)
        n = left if n is None or n < 0 else min(n, left)
        if n > MAX_EXTENSION:  # (only tarfile reads more than a block: a record, whole)
            raise tarfile.ReadError(f"an extension record of {n:,} bytes, past the bound of "
                                    f"{MAX_EXTENSION:,}")
        self.f.seek(self.base + self.pos)
        data = self.f.read(n)
        self.pos += len(data)
        return data


class _Members:
    """What the tars hold, as compact arrays: the folders as a tree of names (a folder is its
    parent's number and its own name, so a path N folders deep costs N names, never N
    prefixes of it), each member's file as its folder's number and its name."""

    TAR, SOURCE = 2, 1  # who gave a folder's (mtime, mode): a tar's entry, the source's folder

    def __init__(self):
        self.sub: dict[tuple[int, bytes], int] = {}  # (folder, name) -> its subfolder
        self.parent, self.name = array("i", [-1]), [b""]  # folder -> its parent, its name
        self.length = array("I", [0])                 # folder -> its path's length
        self.depth = array("I", [0])                  # folder -> the folders its path passes through
        self.attrs: list = [None]                     # folder -> (mtime_ns, mode) or None
        self.given = array("B", [0])                  # folder -> who gave attrs (0: nobody)
        self.files: dict[int, dict[bytes, int]] = {}  # folder -> {name: its slot} (a later member replaces it)
        self.chunk, self.offset, self.size = array("I"), array("Q"), array("Q")
        self.checksum, self.mtime, self.mode = array("Q"), array("q"), array("I")

    def folder(self, at: int, parts) -> int:
        """The folder at parts beneath folder at, made where it is not yet."""
        for part in parts:
            nxt = self.sub.get((at, part))
            if nxt is None:
                nxt = self.sub[(at, part)] = len(self.name)
                self.parent.append(at)
                self.name.append(part)
                self.length.append(self.length[at] + (1 if at else 0) + len(part))
                self.depth.append(self.depth[at] + 1)
                self.attrs.append(None)
                self.given.append(0)
            at = nxt
        return at

    def give(self, d: int, attrs: tuple[int, int], who: int, replace: bool = True) -> None:
        """Folder d's (mtime_ns, mode) from who (TAR or SOURCE): a tar's replaces the source's,
        a later tar entry an earlier one's unless not replace."""
        if who > self.given[d] or (who == self.given[d] and replace):
            self.attrs[d], self.given[d] = attrs, who

    def add(self, d: int, name: bytes, tar: str, member: bytes, k: int, offset: int, size: int,
            checksum: int, mtime: int, mode: int, skipped: list) -> None:
        """File name of folder d: tar's member (for the message if it replaces one)."""
        files = self.files.get(d)
        if files is None:
            files = self.files[d] = {}
        elif name in files:
            skipped.append((f"{tar}: {_shown(member)}", "replaced by a later member of the same name"))
        files[name] = len(self.size)
        for a, v in ((self.chunk, k), (self.offset, offset), (self.size, size),
                     (self.checksum, checksum), (self.mtime, mtime), (self.mode, mode)):
            a.append(v)


class Indexer:
    """Reads tars into _Members: each sequentially, once, through one buffered reader."""

    def __init__(self, bar, skipped: list):
        self.members, self.bar, self.skipped = _Members(), bar, skipped

    def tar(self, fd: int, k: int, name: str, prefix: bytes, cap: int, mtime_ns: int) -> int:
        """Index the tar open as fd (chunk k, called name in messages) into the folder prefix
        of the tree, its members' modes within cap. Returns the xxh3-64 of its first block."""
        at = self.members.folder(0, prefix.split(b"/") if prefix else ())
        size = os.fstat(fd).st_size
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        with open(fd, "rb", buffering=READ_BUFFER, closefd=False) as f:
            head = f.read(BLOCK)
            what = compression(head)
            if what:
                raise refuse_compressed(name, what)
            if not _is_tar_header(head):
                raise NotATar("not a tar file (no tar header at its start), not indexed")
            self._walk(f, _Window(f, 0, size), 0, size, k, name, at, cap, mtime_ns, 0)
        return xxhash.xxh3_64_intdigest(head)

    def _walk(self, f, view, base: int, size: int, k: int, name: str, at: int, cap: int,
              mtime_ns: int, depth: int) -> None:
        """The members of the tar read through view (base: its place in the outer file f)
        into folder at."""
        self.members.give(at, (mtime_ns, dir_mode(cap)), _Members.TAR, replace=False)
        headers, done = Headers(view, size), 0
        try:
            for e in headers:
                if depth == 0 and e.offset_data - done >= READ_BUFFER:  # mutation: equivalent, the progress bar's step only
                    self.bar.update(e.offset_data - done)
                    done = e.offset_data
                self._member(f, base, size, e, k, name, at, cap, depth)
        finally:
            if depth == 0:
                self.bar.update(size - done)
        if headers.short is not None:
            self.skipped.append((name, f"ends early ({headers.short}): the members before are indexed"))
        else:
            self._check_end(view, headers.end, size, name)

    def _member(self, f, base: int, size: int, e: Entry, k: int, name: str, at: int, cap: int,
                depth: int) -> None:
        m, parts = self.members, _clean(e.name)

        def skip(why: str) -> None:
            self.skipped.append((f"{name}: {_shown(e.name)}", why))
        if parts is None:
            if e.kind == "dir" and not e.name.strip(b"./"):  # (`./`: the archive's own folder)
                m.give(at, (e.mtime, dir_mode(e.mode & cap)), _Members.TAR)
                return
            return skip("a path that leaves the archive or has no name, not indexed")
        depth_here = m.depth[at] + len(parts) - 1
        if depth_here > MAX_DEPTH:
            return skip(f"{depth_here:,} folders deep in the tree, more than {MAX_DEPTH}, not indexed")
        if len(e.name) > NAME_MAX or m.length[at] + 1 + len(e.name) > PATH_MAX:  # mutation: equivalent, a shortcut: the exact checks below give the same answer
            long = max(len(p) for p in parts)
            if long > NAME_MAX:
                return skip(f"a name of {long:,} bytes, more than NAME_MAX ({NAME_MAX}): no reader could "
                            "open it")
            length = m.length[at] + (1 if at else 0) + sum(len(p) for p in parts) + len(parts) - 1
            if length > PATH_MAX:
                return skip(f"a path of {length:,} bytes in the tree, more than PATH_MAX ({PATH_MAX}): "
                            "no reader could open it")
        if at == 0 and parts[0] == CONTROL_NAME:
            return skip("reserved name: the mount shows its hidden control folder there")
        if e.kind == "dir":
            m.give(m.folder(at, parts), (e.mtime, dir_mode(e.mode & cap)), _Members.TAR)
            return
        if e.kind != "file":
            return skip(f"{e.kind}, not indexed")
        if e.offset_data + e.size > size:
            return skip(f"its bytes run past the tar's end ({size} bytes): truncated")
        start, last = base + e.offset_data, parts[-1]
        if depth < MAX_NESTING and last.lower().endswith(TAR_SUFFIX) and len(last) > len(TAR_SUFFIX) \
                and e.size >= 2 * BLOCK and _is_tar_header(_pread(f, start, BLOCK)):
            if at == 0 and len(parts) == 1 and last[:-len(TAR_SUFFIX)] == CONTROL_NAME:
                return skip("reserved name: a tar there would be the folder where the mount "
                            "shows its hidden control folder")
            inner = m.folder(at, [*parts[:-1], last[:-len(TAR_SUFFIX)]])
            self._walk(f, _Window(f, start, e.size), start, e.size, k, f"{name}: {_shown(e.name)}",
                       inner, cap & e.mode, e.mtime, depth + 1)
            return
        m.add(m.folder(at, parts[:-1]) if len(parts) > 1 else at, last, name, e.name, k, start, e.size,
              _hash(f, start, e.size), e.mtime, e.mode & cap & 0o777, self.skipped)

    def _check_end(self, view, offset: int, size: int, name: str) -> None:
        """Where tarfile stopped: the end of the file, or zero blocks; else what follows is not
        a tar header (a damaged one), and nothing after it is indexed."""
        view.seek(offset)
        block = view.read(BLOCK)
        if block.strip(b"\0"):
            self.skipped.append((name, f"not a tar header at byte {offset} (damaged?): the members "
                                 "before it are indexed, none after"))


def _pread(f, offset: int, n: int) -> bytes:
    f.seek(offset)
    return f.read(n)


def _hash(f, offset: int, size: int) -> int:
    f.seek(offset)
    if size <= HASH_BLOCK:  # mutation: equivalent, whole or in blocks, the same hash
        data = f.read(size)
        if len(data) != size:
            raise InPlaceError("a tar changed while it was indexed (read short)")
        return xxhash.xxh3_64_intdigest(data)
    h, left = xxhash.xxh3_64(), size
    while left:
        block = f.read(min(left, HASH_BLOCK))
        if not block:
            raise InPlaceError("a tar changed while it was indexed (read short)")
        h.update(block)
        left -= len(block)
    return h.intdigest()


def _is_tar_header(block: bytes) -> bool:
    if len(block) < BLOCK or not block.strip(b"\0"):
        return False
    try:
        tarfile.TarInfo.frombuf(block, tarfile.ENCODING, "surrogateescape")
    except tarfile.HeaderError:
        return False
    return True


def _clean(name: bytes) -> list[bytes] | None:
    """A member's path relative to its archive, as its components (`./`, leading and doubled
    slashes dropped), or None for one with `..` or no name."""
    parts = [p for p in name.split(b"/") if p not in (b"", b".")]
    if not parts or b".." in parts or b"\0" in name:
        return None
    return parts


def _shown(name: bytes) -> str:
    """A member's name for a message: its first SHOWN characters."""
    text = os.fsdecode(name)
    return text if len(text) <= SHOWN else f"{text[:SHOWN]}... ({len(name):,} bytes)"


def _stem(name: bytes) -> bytes:
    return name[:-len(TAR_SUFFIX)]


class _Source:
    """The tars to index: [(relative path, folder they become, stat, reach)], found beneath
    the source folder without following a link."""

    def __init__(self, src: str, skipped: list):
        try:  # (judged by its real path, opened without a link: Access.open_real)
            real = resolve(src)
            st = os.lstat(real)
            if stat.S_ISDIR(st.st_mode):
                folder, tops = real, [b""]
            elif stat.S_ISREG(st.st_mode):
                folder, tops = os.path.dirname(real), None
            else:
                raise InPlaceError(f"{src} is neither a folder nor a tar file")
            root, self.fd, self.reach = Access.open_real(folder)
        except OSError as e:
            raise InPlaceError(f"{src}: cannot open the source: {beneath.why(e)}") from None
        self.root = os.fsdecode(root)
        self.tars: list[tuple[bytes, bytes, os.stat_result, int]] = []
        self.dirs: dict[bytes, os.stat_result] = {}  # the source's own folders, by tree path
        if tops is None:
            name = os.path.basename(real)
            _refuse_by_name(name, src)
            self.tars.append((name, b"", st, self.reach))
        else:
            self._walk(skipped)

    def _walk(self, skipped: list) -> None:
        queue = collections.deque([(b"", self.reach)])
        while queue:
            rel, reach = queue.popleft()
            try:
                fd = beneath.open_dir(self.fd, rel) if rel else os.dup(self.fd)
            except OSError as e:
                skipped.append((os.fsdecode(rel), f"cannot list: {beneath.why(e)}"))
                continue
            try:
                self.dirs[rel] = os.fstat(fd)
                with os.scandir(fd) as it:
                    entries = sorted((os.fsencode(e.name), e) for e in it)
                self._entries(fd, rel, reach, entries, queue, skipped)
            except OSError as e:
                skipped.append((os.fsdecode(rel), f"cannot list: {e.strerror}"))
            finally:
                os.close(fd)

    def _entries(self, fd: int, rel: bytes, reach: int, entries, queue: list, skipped: list) -> None:
        for name, e in entries:
            path = os.path.join(rel, name) if rel else name
            try:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                if stat.S_ISDIR(st.st_mode):
                    queue.append((path, Access.reach(reach, st)))
                elif stat.S_ISREG(st.st_mode):
                    _refuse_by_name(name, os.path.join(self.root, os.fsdecode(path)))
                    if not rel and _stem(name) == CONTROL_NAME and name.lower().endswith(TAR_SUFFIX):
                        skipped.append((os.fsdecode(path), "reserved name: its folder would be where the "
                                        "mount shows its hidden control folder (rename the tar)"))
                    elif name.lower().endswith(TAR_SUFFIX) and len(name) > len(TAR_SUFFIX):
                        self.tars.append((path, _stem(path), st, reach))
                    else:
                        skipped.append((os.fsdecode(path), "not a tar file (in-place indexes "
                                        "NAME.tar files; `fusefs pack` copies loose files)"))
                else:
                    skipped.append((os.fsdecode(path), "a link or special file, not indexed"))
            except OSError as err:
                skipped.append((os.fsdecode(path), f"cannot stat: {err.strerror}"))

    def close(self) -> None:
        os.close(self.fd)


def _refuse_by_name(name: bytes, path: str) -> None:
    low = name.lower()
    for suffix, what in COMPRESSED_SUFFIXES.items():
        if low.endswith(suffix):
            raise refuse_compressed(path, what)


def index_in_place(src: str, dst: str, *, nodes: int | None = None, strict: bool = False,
                   force: bool = False, progress: bool | None = None,
                   mode: int | None = None) -> PackResult:
    """Index the tars at src (a tar file, or a folder of them) into dst/index.fusefs."""
    t0 = time.perf_counter()
    if nodes is not None and nodes < 1:
        raise InPlaceError("--nodes must be at least 1")
    if mode is not None and not 0 <= mode <= 0o777:
        raise InPlaceError(f"--mode must be permission bits (0 to 0777), got {mode:o}")
    if not os.path.exists(src):
        raise InPlaceError(f"{src} does not exist")
    skipped: list = []
    source = _Source(src, skipped)
    try:
        if not source.tars:
            raise InPlaceError(f"{src}: no tar file to index")
        if strict and skipped:
            raise InPlaceError(f"{skipped[0][0]}: {skipped[0][1]} (--strict)")
        total = sum(st.st_size for _, _, st, _ in source.tars)
        bar = tqdm(total=total, unit="iB", unit_scale=True, unit_divisor=1024, desc="index",
                   disable=(None if progress is None else not progress), dynamic_ncols=True)
        indexer = Indexer(bar, skipped)
        chunks, tars, caps = [], [], []
        try:
            for rel, folder, st, reach in source.tars:
                name = os.fsdecode(rel)  # (as the source's other entries are reported)
                try:
                    fd = beneath.open_file(source.fd, rel)
                except OSError as e:  # (skipped and reported, as pack skips what it cannot read)
                    skipped.append((name, f"cannot open: {beneath.why(e)}"))
                    bar.update(st.st_size)
                    continue
                try:
                    st = os.fstat(fd)
                    cap = stat.S_IMODE(st.st_mode) & 0o777
                    head = indexer.tar(fd, len(chunks), name, folder, cap, st.st_mtime_ns)
                except NotATar as e:
                    skipped.append((name, str(e)))
                    bar.update(st.st_size)
                    continue
                finally:
                    os.close(fd)
                chunks.append((os.fsdecode(rel), st.st_size))
                tars.append(TarStamp(head, st.st_mtime_ns))
                caps.append((cap, st.st_gid, reach))
        finally:
            bar.close()
        if not chunks:
            raise InPlaceError(f"{src}: no tar could be indexed ({skipped[0][0]}: {skipped[0][1]})")
        if strict and skipped:
            raise InPlaceError(f"{skipped[0][0]}: {skipped[0][1]} (--strict)")
        files = [os.path.join(source.root, rel) for rel, _ in chunks]
        if nodes:
            node_names, node_of = [f"node-{j}" for j in range(nodes)], [k % nodes for k in range(len(files))]
        else:
            node_names, node_of = nodesmod.discover(files)
        index = build(indexer.members, source, chunks, node_of, node_names, tars, skipped)
        _prepare_dst(dst, force)
        if mode is None:
            tar_modes, gids, reaches = zip(*caps)
            mode, group = Access.mode(tar_modes, gids, reaches)
        else:
            group = None
        index.save(os.path.join(dst, INDEX_NAME), mode=mode, group=group)
        _fsync_dir(dst)
    finally:
        source.close()
    return PackResult(index.n_files, index.total_bytes, len(index.chunks), time.perf_counter() - t0, skipped)


_DTYPES = {"I": np.uint32, "Q": np.uint64, "q": np.int64}


def build(m: _Members, source: _Source, chunks, node_of, node_names, tars, skipped: list) -> Index:
    """The index of the members m, their folders numbered breadth-first and every run sorted
    by name (the layout index.py describes); chunks: each tar's (path, size). A folder is in
    it if a tar names it or a file lies beneath it; one no tar gives a mode has its source
    folder's (mtime, mode), or (0, 0755)."""
    for rel, st in source.dirs.items():
        m.give(m.folder(0, rel.split(b"/") if rel else ()), (st.st_mtime_ns, stat.S_IMODE(st.st_mode)),
               _Members.SOURCE)
    n = len(m.name)
    kept = bytearray(n)
    kept[0] = 1
    for d in range(n):
        if m.given[d] == _Members.TAR:
            kept[d] = 1
    for d in m.files:
        kept[d] = 1
    for d in range(n - 1, 0, -1):  # (a folder is made after its parent)
        if kept[d]:
            kept[m.parent[d]] = 1
    children: dict[int, list[int]] = {}
    for d in range(1, n):
        if kept[d]:
            children.setdefault(m.parent[d], []).append(d)
    files_of: dict[int, list[tuple[bytes, int]]] = {}
    for d, files in m.files.items():
        for name, slot in files.items():
            sub = m.sub.get((d, name))
            if sub is not None and kept[sub]:  # (a file where the tars also have a folder)
                skipped.append((_path(m, sub), "a file of the same name as a folder, not indexed"))
                continue
            files_of.setdefault(d, []).append((name, slot))
    names = bytearray()
    order: list[int] = [0]
    d_parent, d_name, d_len, d_first_sub, d_nsubs = [-1], [0], [0], [], []
    f_slots, f_name, f_len, f_dir, d_first_file, d_nfiles = [], [], [], [], [], []
    d = 0
    while d < len(order):
        subs = sorted(children.get(order[d], ()), key=m.name.__getitem__)
        d_first_sub.append(len(order)); d_nsubs.append(len(subs))
        for sub in subs:
            order.append(sub)
            base = m.name[sub]
            d_parent.append(d); d_name.append(len(names)); d_len.append(len(base))
            names += base
        mine = sorted(files_of.get(order[d], ()))
        d_first_file.append(len(f_slots)); d_nfiles.append(len(mine))
        for base, slot in mine:
            f_slots.append(slot); f_name.append(len(names)); f_len.append(len(base)); f_dir.append(d)
            names += base
        d += 1
    attrs = [m.attrs[f] or (0, 0o755) for f in order]
    top = np.zeros(len(order), np.int64)
    for i in range(1, len(order)):
        top[i] = i if d_parent[i] == 0 else top[d_parent[i]]
    d_class = np.where(top > 0, top - 1, -1)
    s = np.asarray(f_slots, np.int64)
    f_dir_a = np.asarray(f_dir, np.uint32)

    def col(a, dtype):
        return np.frombuffer(a, _DTYPES[a.typecode])[s].astype(dtype) if len(s) else np.zeros(0, dtype)

    arrays = {
        "file_name_off": np.asarray(f_name, np.uint64), "file_name_len": np.asarray(f_len, np.uint32),
        "file_dir": f_dir_a, "chunk": col(m.chunk, np.uint32), "offset": col(m.offset, np.uint64),
        "size": col(m.size, np.uint64), "label": d_class[f_dir_a].astype(np.int32) if len(s) else np.zeros(0, np.int32),
        "checksum": col(m.checksum, np.uint64), "mtime_ns": col(m.mtime, np.int64),
        "mode": col(m.mode, np.uint32),
        "dir_name_off": np.asarray(d_name, np.uint64), "dir_name_len": np.asarray(d_len, np.uint32),
        "dir_parent": np.asarray(d_parent, np.int32),
        "dir_mtime_ns": np.asarray([a[0] for a in attrs], np.int64),
        "dir_mode": np.asarray([a[1] & 0o777 for a in attrs], np.uint32),
        "dir_first_file": np.asarray(d_first_file, np.uint64), "dir_nfiles": np.asarray(d_nfiles, np.uint64),
        "dir_first_sub": np.asarray(d_first_sub, np.uint32), "dir_nsubs": np.asarray(d_nsubs, np.uint32),
    }
    classes = [os.fsdecode(m.name[order[i]]) for i in range(1, 1 + d_nsubs[0])]
    counts = np.bincount(arrays["chunk"], minlength=len(chunks))
    infos = [ChunkInfo(rel, node_of[k], size, int(counts[k])) for k, (rel, size) in enumerate(chunks)]
    return Index(arrays, bytes(names), classes, infos, node_names, source=source.root, tars=tars)


def _path(m: _Members, d: int) -> str:
    """Folder d's path in the tree (for a message)."""
    parts = []
    while d > 0:
        parts.append(m.name[d])
        d = m.parent[d]
    return os.fsdecode(b"/".join(reversed(parts)))
