"""Blocking access to the chunk files on the backend (called from worker threads only).

Every sample read here is checked against the checksum in the index before it is
returned: a mismatch raises CorruptSample, never hands out wrong bytes.
"""
from __future__ import annotations

import logging
import errno
import io
import math
import os
import resource
import stat
import threading
import time

import numpy as np

import xxhash

from . import beneath
from . import chunk as chunkfmt
from .access import Access, acl_of, others_can_change
from .errors import UserError
from .index import TAR_BLOCK, Index

try:  # the compiled reads (setup.py); without them (FUSEFS_NO_NATIVE=1), reads are made in Python
    from . import _fetchio
except ImportError:  # pragma: no cover (the install requires them unless opted out)
    _fetchio = None
NATIVE = _fetchio is not None

log = logging.getLogger("fusefs.store")

PAGE = os.sysconf("SC_PAGE_SIZE")
# A group of a batch's reads (ChunkStore.read_batch) goes on past its least reads while it
# has taken less than this: fast reads then come in one or two groups a batch.
GROUP_S = 0.001
# Samples of one chunk at most MAX_GAP bytes apart are read in one read, the gap read through
# (_fetchio.c's SCRATCH, which holds such gaps, is the same number: a test checks), and one
# read takes at most MAX_READ bytes (the read-ahead's runs of one chunk too).
MAX_GAP = 256 << 10
MAX_READ = 16 << 20


class StoreError(UserError):
    """The packed folder does not match its index (missing or truncated chunk)."""


class CorruptSample(IOError):
    """The sample's bytes, read whole, fail their checksum: they will not change by reading
    again (not retried; the sample is EIO until remount)."""

    def __init__(self, chunk_path: str, sample_path: str, why: str):
        super().__init__(f"{chunk_path}: sample {sample_path}: {why}")
        self.chunk_path, self.sample_path = chunk_path, sample_path


class ShortRead(OSError):
    """The chunk held fewer of the sample's bytes than the index says (a chunk truncated,
    or being replaced): the node answered, so it is no outage to wait for: EIO at once with
    the log line, not remembered (a chunk that is restored serves again)."""

    def __init__(self, chunk_path: str, sample_path: str, held: int, size: int):
        super().__init__(errno.EIO, f"{chunk_path}: sample {sample_path}: short read ({held} of {size} bytes)")


class ChunkStore:
    """Reads of samples from the chunk files. willneed: read_batch first asks the kernel
    for all of a batch's reads but the first (posix_fadvise WILLNEED, which returns at
    once), then makes them one after the other: the backend's client (a network
    filesystem's, or a disk's) fetches them concurrently meanwhile, so a batch of k
    scattered samples costs about one round trip, not k."""

    def __init__(self, root: str, index: Index, *, willneed: bool = True,
                 native: bool | None = None):
        """root: the packed folder, or an in-place set's source (opened here, that one from /
        without following a link, and every chunk beneath its descriptor, no link followed:
        beneath.py); native: read with fusefs._fetchio (None: where it is built)."""
        self.root = root
        try:
            self.root_fd = beneath.open_absolute(root) if index.in_place else \
                os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as e:
            what = "the in-place set's source folder" if index.in_place else "the packed folder"
            raise StoreError(f"{root}: cannot open {what}: {beneath.why(e)}") from None
        self.caps: list[tuple[int, int, int]] = []  # an in-place set's tars: (mode, gid, reach)
        self._folders: dict[str, tuple[int, bool]] = {}  # (check) folder -> (reach, others may change it)
        self.index = index
        self.willneed = willneed
        if native and _fetchio is None:
            raise StoreError("fusefs._fetchio is not built (setup.py; scripts/setup.sh builds it)")
        self.native = _fetchio is not None if native is None else native
        self._fds: dict[int, _OpenChunk] = {}
        self._lock = threading.Lock()
        _raise_fd_limit(len(index.chunks) + 256)

    def chunk_path(self, k: int) -> str:
        return os.path.join(self.root, self.index.chunks[k].path)

    def open_chunk(self, k: int) -> int:
        """A descriptor of chunk k's file: a regular file beneath the packed folder, reached
        without following a link (beneath.open_file: ELOOP, NotRegular)."""
        return beneath.open_file(self.root_fd, self.index.chunks[k].path)

    def check(self, retries: int = 0, backoff: float = 0.1, max_wait: float = 2.0) -> None:
        """Refuse a packed folder whose chunks are missing, not regular files beneath it
        (a link on the way), not of the recorded size, or whose header does not list
        exactly the index's samples of it (offsets, sizes, checksums): a sample's bytes
        are then a chunk's own, as its header says, never a stranger's. Reads each chunk's
        header and tables (32 bytes a sample); a read that fails is tried again `retries`
        times, the wait doubling from `backoff` seconds up to `max_wait` (as the index's).
        Each chunk's descriptor stays open for the reads."""
        self.caps = []
        for k in range(len(self.index.chunks)):
            for attempt in range(retries + 1):
                try:
                    if self.index.in_place:
                        self.caps.append(self._check_tar(k))
                    else:
                        self._check_chunk(k)
                    break
                except OSError as e:  # (a read that failed: the backend may answer again)
                    if attempt == retries:
                        raise StoreError(f"{self.chunk_path(k)}: cannot read chunk ({retries} "
                                         f"retries): {e.strerror}") from None
                    log.warning("%s: read failed (%s), retry %d of %d", self.chunk_path(k),
                                e.strerror, attempt + 1, retries)
                    time.sleep(min(backoff * 2 ** attempt, max_wait))

    def _check_chunk(self, k: int) -> None:
        """check() of chunk k: StoreError for what is wrong with it, OSError for a read that
        failed."""
        ix, info, path = self.index, self.index.chunks[k], self.chunk_path(k)
        fd = self._open_checked(k, "chunk", "missing")
        try:
            size = os.fstat(fd).st_size
            if size != info.size:
                raise StoreError(f"{path}: chunk file is {size} bytes, the index says {info.size} "
                                 f"({'truncated' if size < info.size else 'altered'})")
            # the header alone: no read-ahead of samples, and its pages not kept (the mount
            # brings into the page cache nothing that a sample's read would then find there)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            with open(fd, "rb", closefd=False) as f:
                head = chunkfmt.read_header(f, size)
            read = chunkfmt.data_start(head.n) + io.DEFAULT_BUFFER_SIZE  # (what the buffer took)
            os.posix_fadvise(fd, 0, -(-read // PAGE) * PAGE, os.POSIX_FADV_DONTNEED)
            mine = ix.by_chunk[ix.chunk_start[k]:ix.chunk_start[k + 1]]
            if not (head.n == info.count == len(mine) and np.array_equal(head.offsets, ix.offset[mine])
                    and np.array_equal(head.sizes, ix.size[mine])
                    and np.array_equal(head.checksums, ix.checksum[mine])):
                raise StoreError(f"{path}: the chunk's header does not list the index's samples of "
                                 "it (another chunk, or a crafted index)")
        except BaseException as e:
            os.close(fd)
            if isinstance(e, chunkfmt.ChunkError):
                raise StoreError(f"{path}: not the chunk the index describes: {e}") from None
            raise
        self._keep(k, fd)

    def _keep(self, k: int, fd: int) -> None:
        """Keep chunk k's descriptor that check() opened for the reads (a first read then
        costs no open: on a network filesystem, a lookup and an open round trip a chunk),
        its read-ahead as the kernel's default again."""
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_NORMAL)
        with self._lock:
            if k not in self._fds:
                self._fds[k] = _OpenChunk(fd)
                return
        os.close(fd)

    def _open_checked(self, k: int, what: str, missing: str) -> int:
        """open_chunk(k) for check(): StoreError for a file that is missing or refused (a link
        on the way, not a regular file, no access), OSError for an open that failed."""
        try:
            return self.open_chunk(k)
        except FileNotFoundError:
            raise StoreError(f"{self.chunk_path(k)}: {what} file is {missing}") from None
        except OSError as e:
            if isinstance(e, beneath.NotRegular) or e.errno in (errno.ELOOP, errno.ENOTDIR, errno.EACCES,
                                                                  errno.EPERM):
                raise StoreError(f"{self.chunk_path(k)}: cannot open {what}: {beneath.why(e)}") from None
            raise

    def _check_tar(self, k: int) -> tuple[int, int, int]:
        """check() of an in-place set's tar k: a regular file beneath the source, no link on the
        way, of the size and first block it had when indexed, and (under a root daemon) one
        that no other user can change, nor any folder from / down to it. Returns (mode, gid,
        reach) of it, what the mount may show of its members (Index.narrow_modes)."""
        info, path = self.index.chunks[k], self.chunk_path(k)
        fd = self._open_checked(k, "tar", "missing (moved or removed since it was indexed)")
        try:
            st = os.fstat(fd)
            if st.st_size != info.size:
                raise StoreError(f"{path}: tar file is {st.st_size} bytes, the index says {info.size} "
                                 f"({'truncated' if st.st_size < info.size else 'altered'}): index it "
                                 "again (fusefs pack --in-place --force)")
            head = os.pread(fd, TAR_BLOCK, 0)
            os.posix_fadvise(fd, 0, TAR_BLOCK, os.POSIX_FADV_DONTNEED)
            if xxhash.xxh3_64_intdigest(head) != self.index.tars[k].head:
                raise StoreError(f"{path}: not the tar the index describes (its first header differs: "
                                 "rewritten since it was indexed?): index it again (fusefs pack --in-place --force)")
            reach, changeable = self._folder(os.path.dirname(info.path))
            if os.geteuid() == 0 and (changeable or others_can_change(st, 0, acl_of(fd))):
                raise StoreError(f"{path}: another user can change {'it' if not changeable else 'a folder above it'} "
                                 "(owner, group or others may write, or an ACL lets another user): a root "
                                 "mount refuses such a tar. "
                                 "Mount it as that user, or make the tar and its folders root's and "
                                 "writable by no one else")
        except BaseException:
            os.close(fd)
            raise
        if st.st_mtime_ns != self.index.tars[k].mtime_ns:
            log.warning("%s: changed since it was indexed (its mtime): every sample is checked by its "
                        "checksum, and one that changed is an I/O error", path)
        self._keep(k, fd)
        return stat.S_IMODE(st.st_mode), st.st_gid, reach

    def _folder(self, rel: str) -> tuple[int, bool]:
        """(reach, whether a user but root or this one could change it or a folder above it)
        of the source's folder rel (every folder from / down to it)."""
        got = self._folders.get(rel)
        if got is None:
            if not rel:
                reach, changeable, here = Access.EVERYONE, False, "/"
                for part in [""] + [p for p in self.root.split("/") if p]:
                    here = os.path.join(here, part)
                    st = os.lstat(here)
                    reach = Access.reach(reach, st)
                    changeable = changeable or others_can_change(st, os.geteuid(),
                                                                 acl_of(here, follow_symlinks=False))
            else:
                (reach, changeable), fd = self._folder(os.path.dirname(rel)), beneath.open_dir(self.root_fd, rel)
                try:
                    st, acl = os.fstat(fd), acl_of(fd)
                finally:
                    os.close(fd)
                reach = Access.reach(reach, st)
                changeable = changeable or others_can_change(st, os.geteuid(), acl)
            got = self._folders[rel] = (reach, changeable)
        return got

    def chunk_fds(self) -> np.ndarray:
        """Each chunk's open descriptor now (int64; -1: not open), for a reader that takes
        its own copies (misses.MissEngine)."""
        fds = np.full(len(self.index.chunks), -1, np.int64)
        with self._lock:
            for k, h in self._fds.items():
                fds[k] = h.fd
        return fds

    def _acquire(self, k: int) -> "_OpenChunk":
        with self._lock:
            h = self._fds.get(k)
            if h is not None:
                h.users += 1
                return h
        # Opened outside the lock: an open stuck on a slow node must not hold up the others.
        fd = self.open_chunk(k)
        with self._lock:
            h = self._fds.get(k)
            if h is None:
                h = self._fds[k] = _OpenChunk(fd)
            else:
                os.close(fd)
            h.users += 1
            return h

    def _release(self, k: int, h: "_OpenChunk", failed: bool) -> None:
        """After a failed read the fd is retired (a server that restarted may never serve it
        again) and closed once no other thread reads with it, so its number is not reused
        under a read still in progress."""
        with self._lock:
            h.users -= 1
            if failed and self._fds.get(k) is h:
                del self._fds[k]
                h.retired = True
            close = h.retired and h.users == 0
        if close:
            try:
                os.close(h.fd)
            except OSError:  # (the fd is released anyway; a FUSE backend whose server is gone
                pass         # answers the close with ENOTCONN)

    def read_range(self, k: int, offset: int, length: int) -> bytes:
        """length bytes of chunk k from offset (short only if the file is)."""
        h = self._acquire(k)
        parts, got, failed = [], 0, True
        try:
            while got < length:
                part = os.pread(h.fd, length - got, offset + got)
                if not part:
                    break
                parts.append(part)
                got += len(part)
            failed = got < length  # (short: the file may be replaced; open it again next time)
        finally:
            self._release(k, h, failed)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def verify(self, sid: int, data) -> bytes:
        """data if it is sample sid's exact bytes, else ShortRead (too few) or CorruptSample."""
        if len(data) != int(self.index.size[sid]):
            raise self.corrupt(sid, len(data))
        if chunkfmt.checksum(data) != int(self.index.checksum[sid]):
            raise self.corrupt(sid)
        return data if type(data) is bytes else bytes(data)

    def corrupt(self, sid: int, held: int | None = None) -> CorruptSample | ShortRead:
        """The error of sample sid: a checksum mismatch (CorruptSample), or (held: the bytes
        its chunk held) a short read (ShortRead)."""
        ix = self.index
        chunk, sample = self.chunk_path(int(ix.chunk[sid])), os.fsdecode(ix.file_path(sid))
        if held is not None:
            return ShortRead(chunk, sample, held, int(ix.size[sid]))
        return CorruptSample(chunk, sample, "checksum mismatch")

    def coalesce(self, sids, max_gap: int = MAX_GAP,
                 max_read: int = MAX_READ) -> list[tuple[int, int, int, list[int]]]:
        """Group samples into reads: (chunk, offset, length, sids) with samples of one chunk
        that are adjacent or at most max_gap bytes apart merged into one read of at most
        max_read bytes, and only while the bytes read in between (not wanted) stay within
        the bytes wanted: read amplification is at most 2x, also for tiny samples. The
        reads come in the order of their first sample in sids."""
        ix = self.index
        first = {}  # sid -> its first position in sids
        for pos, s in enumerate(sids):
            first.setdefault(int(s), pos)
        chunk_v, offset_v, size_v = ix.chunk_v, ix.offset_v, ix.size_v
        sids = sorted(first, key=lambda s: (chunk_v[s], offset_v[s]))
        reads, wanted = [], 0  # wanted: bytes of the samples in the last read
        for sid in sids:
            k, off, size = chunk_v[sid], offset_v[sid], size_v[sid]
            if reads:
                pk, poff, plen, members = reads[-1]
                length = max(plen, off + size - poff)
                if (pk == k and off - (poff + plen) <= max_gap and length <= max_read
                        and length <= 2 * (wanted + size)):
                    reads[-1] = (pk, poff, length, members + [sid])
                    wanted += size
                    continue
            reads.append((k, off, size, [sid]))
            wanted = size
        # in the order the samples were asked for (a read by its first member): with
        # read_batch's on_read, the sample needed first arrives first
        reads.sort(key=lambda r: min(first[s] for s in r[3]))
        return reads

    def read_batch(self, sids, max_gap: int = MAX_GAP, on_read=None, *,
                   first_alone: bool = False, group_s: float = GROUP_S,
                   publish=None) -> tuple[dict, int, int]:
        """Read several samples with as few reads as the layout allows, in the order of
        sids (see coalesce), in groups: each group is one call without the GIL and one
        hand-on of its results (on_read), so groups cost CPU per sample, and each makes
        its reader wait for the group's last read. A group makes at least 1, 1, 2, 4, 8,
        ... reads (the i-th read of a batch reaches its reader after at most about 2i
        reads) and goes on while it has taken less than group_s: reads that take longer
        (a remote node's round trip) come in those minimal groups, fast ones (the page
        cache, a local disk) in one or two groups a batch; group_s inf: every read in one
        group. first_alone: the first read is a group of its own (a reader waits for its
        sample).

        Returns ({sid: bytes or the exception for that sample}, reads made, bytes read).
        A failed read fails only the samples in it; a corrupt sample fails alone.
        on_read, if given, is called after each group with {sid: result} of its samples,
        and the group's reads made and bytes read.

        publish: None, or (the fast path's capsule, pyfuse3.fast_path_publish_api(); the
        samples it is to hold, int64 ascending): the compiled reads then publish each clean
        sample there in C as its read is checked, without the GIL (read_group in
        fusefs/_fetchio.c: those to hold held, the others handed to the reads that wait for
        them: those readers do not wait for the group's end), and on_read is told so
        (published=True); the Python reads publish nothing.
        """
        out, nreads, nbytes = {}, 0, 0
        tell = {}
        if self.native:
            read_group, total = self._native_groups(sids, max_gap, publish)
            if publish is not None:
                tell = {"published": True}
        else:
            reads = self.coalesce(sids, max_gap)
            if self.willneed:
                self.advise(reads[1:])
            total = len(reads)

            def read_group(done, least, budget):
                return self._read_python(reads[done:], least, budget)
        done = 0
        while done < total:
            budget = 0.0 if first_alone and done == 0 else group_s
            # (group_s inf: every read in one group)
            got, n, b, made = read_group(done, -1 if budget == math.inf else max(1, done), budget)
            done += made
            nreads += n
            nbytes += b
            out.update(got)
            if on_read is not None:
                on_read(got, n, b, **tell)
        return out, nreads, nbytes

    def _read_python(self, reads, least: int, budget_s: float) -> tuple[dict, int, int, int]:
        """(results, reads made, bytes read, reads done) of reads [(chunk, offset, length,
        sids)]: the first `least`, then more until budget_s has passed."""
        got, nreads, nbytes = {}, 0, 0
        ix = self.index
        start = time.perf_counter()
        for i, (k, off, length, members) in enumerate(reads):
            if i >= least and time.perf_counter() - start >= budget_s:
                return got, nreads, nbytes, i
            try:
                raw = self.read_range(k, off, length)
            except OSError as e:
                got.update(dict.fromkeys(members, e))
                continue
            nreads += 1
            nbytes += len(raw)
            if len(members) == 1:  # the read is the sample: no copy
                parts = {members[0]: raw}
            else:
                buf, parts = memoryview(raw), {}
                for sid in members:
                    rel = int(ix.offset[sid]) - off
                    parts[sid] = buf[rel:rel + int(ix.size[sid])]
            for sid, data in parts.items():
                try:
                    got[sid] = self.verify(sid, data)
                except (CorruptSample, ShortRead) as e:
                    got[sid] = e
        return got, nreads, nbytes, len(reads)

    def _native_groups(self, sids, max_gap: int, publish=None):
        """(read_group(done, least, budget_s) -> (results, reads made, bytes read, reads
        done), the number of reads): as _read_python over coalesce's reads, planned and made
        by fusefs._fetchio (plan, read_group) without per-sample Python: each group one
        stretch without the GIL, each sample read straight into its own bytes, the first
        group also advising the kernel of every read but the first (willneed), and its
        samples published to the fast path (publish: read_batch's)."""
        ix = self.index
        reads_b, members_b = _fetchio.plan(sids, ix.chunk, ix.offset, ix.size, max_gap, MAX_READ)
        reads = np.frombuffer(reads_b, np.int64).reshape(-1, 4)
        members = np.frombuffer(members_b, np.int64)
        first = 0  # the members of the reads done so far

        def read_group(done: int, least: int, budget_s: float):
            nonlocal first
            chunks = np.unique(reads[done:, 0])  # (each chunk of the reads left, once)
            fds = np.full(len(chunks), -1, np.int64)
            held, unopened, retire = {}, {}, set()
            try:
                for i, k in enumerate(chunks.tolist()):
                    try:
                        held[k] = h = self._acquire(k)
                        fds[i] = h.fd
                    except OSError as e:
                        unopened[k] = e
                made, ok, nbytes, values, failed, bad = _fetchio.read_group(
                    reads_b, members_b, done, first, chunks, fds, ix.offset, ix.size, ix.checksum, least,
                    int(min(budget_s, 1e6) * 1e6), 1 if done == 0 and self.willneed else -1, publish)
                ids = members[first:first + len(values)].tolist()
                got = dict(zip(ids, values))
                if bad:  # (a failed read, a chunk not open, a mismatch or a short read)
                    errors, at = dict(failed), 0
                    for i in range(done, done + made):
                        k, n = int(reads[i, 0]), int(reads[i, 3])
                        if i in errors:
                            err = errors[i]
                            e = unopened[k] if err == 0 else OSError(err, os.strerror(err))
                            got.update(dict.fromkeys(ids[at:at + n], e))
                            if err:
                                retire.add(k)
                        else:
                            for sid, v in zip(ids[at:at + n], values[at:at + n]):
                                if type(v) is int:  # (-1: a mismatch; else the bytes held: short)
                                    got[sid] = self.corrupt(sid, None if v < 0 else v)
                                    if v >= 0:
                                        retire.add(k)  # (the file may be replaced: open it again)
                        at += n
            finally:
                for k, h in held.items():
                    self._release(k, h, k in retire)
            first += len(values)
            return got, ok, nbytes, made

        return read_group, len(reads)

    def advise(self, reads) -> None:
        """posix_fadvise WILLNEED for each (chunk, offset, length, ...) of reads (the Python
        reads'; the compiled ones advise in read_group): a hint, so a failure here is left
        to the read itself to report. (An empty read is not advised: length 0 would mean
        the whole rest of the chunk.)"""
        for k, off, length, *_ in reads:
            if length <= 0:
                continue
            try:
                h = self._acquire(k)
            except OSError:
                continue
            try:
                os.posix_fadvise(h.fd, off, length, os.POSIX_FADV_WILLNEED)
            except OSError:
                pass
            finally:
                self._release(k, h, False)

    def read_sample(self, sid: int) -> bytes:
        ix = self.index
        data = self.read_range(int(ix.chunk[sid]), int(ix.offset[sid]), int(ix.size[sid]))
        return self.verify(sid, data)

    def close(self) -> None:
        with self._lock:
            for h in self._fds.values():
                os.close(h.fd)
            self._fds.clear()
            if self.root_fd >= 0:
                os.close(self.root_fd)
                self.root_fd = -1


class _OpenChunk:
    """A chunk's open fd, the reads using it, and whether it was retired after an error."""
    __slots__ = ("fd", "users", "retired")

    def __init__(self, fd: int):
        self.fd, self.users, self.retired = fd, 0, False


def _raise_fd_limit(want: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < want:
        target = want if hard == resource.RLIM_INFINITY else min(hard, want)
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


def verify(root: str, index: Index, progress: bool | None = None) -> list[str]:
    """Check every chunk header (an in-place set's tars: their sizes) and every sample
    checksum; return what is bad. root: Index.data_root's."""
    from tqdm import tqdm

    problems = []
    store = ChunkStore(root, index)
    order = np.argsort(index.chunk, kind="stable")
    bounds = np.searchsorted(index.chunk[order], np.arange(len(index.chunks) + 1))
    with tqdm(total=index.total_bytes, unit="iB", unit_scale=True, unit_divisor=1024, desc="verify",
              disable=None if progress is None else not progress) as bar:
        for k, info in enumerate(index.chunks):
            path = store.chunk_path(k)
            try:
                with open(store.open_chunk(k), "rb") as f:
                    size = os.fstat(f.fileno()).st_size
                    if index.in_place:  # (a tar: no header of fusefs's; its size, and each sample)
                        if size != info.size:
                            raise chunkfmt.ChunkError(f"tar file is {size} bytes, the index says {info.size}")
                        count = info.count
                    else:
                        count = chunkfmt.read_header(f, size).n
            except chunkfmt.ChunkError as e:
                problems.append(f"{path}: {e}")
                bar.update(int(index.size[order[bounds[k]:bounds[k + 1]]].sum()))
                continue
            except OSError as e:
                problems.append(f"{path}: {beneath.why(e)}")
                bar.update(int(index.size[order[bounds[k]:bounds[k + 1]]].sum()))
                continue
            for sid in order[bounds[k]:bounds[k + 1]]:
                sid = int(sid)
                try:
                    store.read_sample(sid)
                except CorruptSample as e:
                    problems.append(str(e))
                except OSError as e:
                    problems.append(f"{path}: sample {os.fsdecode(index.file_path(sid))}: {e.strerror}")
                bar.update(int(index.size[sid]))
            if count != info.count:
                problems.append(f"{path}: header holds {count} samples, the index says {info.count}")
    store.close()
    return problems
