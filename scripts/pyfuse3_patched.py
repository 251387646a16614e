"""fusefs/pyfuse3, the FUSE binding fusefs builds and ships: pyfuse3 3.5.0 (its sdist pinned
by SHA-256) with five changes to its Cython sources, each found by measuring. This script
writes them anew from the sdist (when pyfuse3 or a patch changes); setup.py compiles what
it wrote, with fusefs's fast path (fusefs/_fastpath.h), as the extension fusefs.pyfuse3.

1. loop: a request that is already queued is taken at once. pyfuse3's request loop
   (`_session_loop`, internal.pxi) took a trio lock and waited for the FUSE fd to become
   readable (an epoll round trip and a pass of trio's scheduler) before every request, also
   when the kernel had many queued. With the fd non-blocking, the loop reads first and
   waits only when the read finds nothing (EAGAIN); a task yields to the others at least
   every 16 requests it takes in a row. Mark: `pyfuse3.REQUESTS_WITHOUT_WAIT`. Nothing in
   fusefs depends on it; it halves the daemon's CPU per request (docs/HOTPATH.md).
2. store: `notify_store_many(items)` pushes many (inode, data) into the kernel page cache
   in one stretch without the GIL, where notify_store releases and retakes it for each:
   a fetch thread pushes a group of samples with one GIL hand-off (docs/HOTPATH.md). Mark:
   `pyfuse3.STORE_MANY`; fusefs pushes one by one with notify_store without it (fs.py).
3. ioctl: FUSE_IOCTL requests are counted. Python's `open()` (3.13 and earlier) asks every
   file it opens whether it is a terminal (`isatty`: ioctl TCGETS), and the kernel sends
   that to the file system: one request per sample read by ImageFolder's loader. pyfuse3
   has no ioctl handler, so libfuse answered it by itself and the daemon never saw it.
   The patch answers it the same way, in C without the GIL (ENOTTY, which is what the
   kernel made of libfuse's ENOSYS), and counts it: `pyfuse3.ioctl_requests()`, which
   fusefs adds to its request counts. Mark: `pyfuse3.IOCTL_COUNTED`.
4. spawn: the request loop starts another task only when every other task is inside a
   handler that suspended. pyfuse3 starts one whenever a task takes a request while no
   task waits for the fd; with the loop patch tasks take queued requests without waiting,
   so under load it started (and soon ended) about one task per sample, each setting the
   fd's flags again and getting a fresh request buffer. `pyfuse3.loop_tasks_started()`
   counts them (fusefs's stats: `loop_tasks`). Mark: `pyfuse3.TASKS_WHEN_ALL_BUSY`.
5. fast: a thread in C reads /dev/fuse and answers the dataset files' lookup, open, ioctl,
   release and forget itself (lookups from the index's arrays, `fast_path_tree`), and the
   reads of samples fusefs holds for it (`fast_path_hold`: its cache's bytes)
   (fusefs/_fastpath.h, found by the compiler); every other request goes to the
   request loop, which takes it from the thread's queue instead of the fd. The opens,
   releases, reads and forgets reach fusefs as events in batches (`fast_path_events()`).
   Off until `fast_path_start(...)` is called after `init`: then a sample the kernel holds
   costs the Python loop nothing. Mark: `pyfuse3.FAST_PATH`.

    .venv/bin/python scripts/pyfuse3_patched.py   # rewrites fusefs/pyfuse3 (then: git diff)

Why a changed copy and not pyfuse3 from PyPI: docs/ARCHITECTURE.md, "pyfuse3's request loop".
"""
from __future__ import annotations

import argparse
import hashlib
import pathlib
import shutil
import subprocess
import sys
import tarfile
import tempfile

VENDOR_DIR = pathlib.Path(__file__).resolve().parent.parent / "fusefs" / "pyfuse3"
VERSION = "3.5.0"
# the sdist's SHA-256: a download that differs is refused (pyproject.toml pins the version)
SDIST_SHA256 = "88399a9494b88603230bba300f4ba9ad63fece5ed514ca3633d555a0c6a42b24"

# The request loop of internal.pxi's _session_loop: every request waited for a trio lock
# and for the FUSE fd to become readable (an epoll round trip and a pass of trio's
# scheduler), also when requests were already queued.
LOOP_WAIT = """\
        if not await _wait_fuse_readable():
            break

        res = fuse_session_receive_buf(session, &buf)
"""
LOOP_TAKE = """\
        # fusefs: take a request that is already queued without waiting for the fd (the fd
        # is non-blocking); wait only when there is none
        res = fuse_session_receive_buf(session, &buf)
        if res == -errno.EAGAIN:
            in_a_row = 0
            if not await _wait_fuse_readable():
                break
            res = fuse_session_receive_buf(session, &buf)
            if res == -errno.EAGAIN:
                continue
"""
LOOP_START = "    cdef fuse_buf buf\n\n"
LOOP_START_NEW = """\
    cdef fuse_buf buf
    cdef int in_a_row = 0

    import fcntl
    fcntl.fcntl(session_fd, fcntl.F_SETFL, fcntl.fcntl(session_fd, fcntl.F_GETFL) | os.O_NONBLOCK)

"""
LOOP_END = """\
        if py_retval is not None:
            await py_retval
"""
LOOP_END_NEW = LOOP_END + """\
        # fusefs: other tasks run at least every 16 requests taken in a row
        in_a_row += 1
        if in_a_row >= 16:
            in_a_row = 0
            await trio.lowlevel.checkpoint()
"""


# The loop's rule for starting another task: pyfuse3 starts one when a task takes a request
# and no task is waiting for the fd. With the loop patch a task mostly takes requests
# without waiting, so that rule started a task for about one request in three, each of
# which set the fd's flags (two fcntl calls), got a fresh 1 MiB request buffer and then
# ended because others were idle. A task is needed only when every other one is inside a
# handler that suspended (waiting for a fetch): then none would be left to take requests.
SPAWN_OLD = """\
        if not worker_data.active_readers and worker_data.task_count < max_tasks:
"""
SPAWN_NEW = """\
        # fusefs: start another task only when every other one is inside a handler
        if fusefs_in_handlers + 1 >= worker_data.task_count and worker_data.task_count < max_tasks:
"""
SPAWN_AWAIT = """\
        if py_retval is not None:
            await py_retval
"""
SPAWN_AWAIT_NEW = """\
        if py_retval is not None:
            fusefs_in_handlers += 1
            try:
                await py_retval
            finally:
                fusefs_in_handlers -= 1
"""
SPAWN_DEF = "@async_wrapper\nasync def _session_loop("
SPAWN_DEF_NEW = """\
# fusefs: tasks of _session_loop inside a handler (awaiting it), and tasks started
cdef int fusefs_in_handlers = 0

def loop_tasks_started():
    "Tasks of the request loop started since the module was loaded (fusefs)."
    return worker_data.task_serial

""" + SPAWN_DEF
SPAWN_GLOBAL = "    cdef fuse_buf buf\n"
SPAWN_GLOBAL_NEW = "    global fusefs_in_handlers\n    cdef fuse_buf buf\n"


def edit_session_loop(text: str, edits, start: str = "async def _session_loop(") -> str:
    """internal.pxi's text with each (old, new) of edits made in _session_loop (from `start`
    to the next function), each old found there exactly once, or SystemExit."""
    begin = text.index(start)
    end = text.find("\nasync def ", begin + len(start))  # (the next function, or the end)
    end = len(text) if end < 0 else end
    loop = text[begin:end]
    for old, new in edits:
        if loop.count(old) != 1:
            raise SystemExit(f"pyfuse3 {VERSION}'s _session_loop changed: no {old.strip()!r}")
        loop = loop.replace(old, new)
    return text[:begin] + loop + text[end:]


def patch_spawn(text: str) -> str:
    """internal.pxi's text (with the loop patch) starting a task only when all are in handlers."""
    return edit_session_loop(text, ((SPAWN_OLD, SPAWN_NEW), (SPAWN_AWAIT, SPAWN_AWAIT_NEW),
                                    (SPAWN_GLOBAL, SPAWN_GLOBAL_NEW), (SPAWN_DEF, SPAWN_DEF_NEW)),
                             start=SPAWN_DEF)


def patch_session_loop(text: str) -> str:
    """internal.pxi's text with _session_loop taking queued requests without waiting."""
    return edit_session_loop(text, ((LOOP_START, LOOP_START_NEW), (LOOP_WAIT, LOOP_TAKE),
                                    (LOOP_END, LOOP_END_NEW)))


# notify_store_many: what notify_store does, for many (inode, data) in one stretch without
# the GIL (appended to __init__.pyx, whose notify_store it follows).
STORE_ANCHOR = "        ret = fuse_lowlevel_notify_store(session, ino, off, &bufvec, 0)\n"
STORE_MANY = """

def notify_store_many(items):
    '''notify_store(inode, 0, data) for each (inode, data) of items, one after the other
    and all without the GIL (fusefs: one GIL hand-off per group of pushes, not one per
    sample). Returns a list of errnos, 0 for each store that was made.'''

    cdef Py_ssize_t n = len(items), i, held = 0
    cdef int *rets = <int *> stdlib.calloc(<size_t> max(n, 1), sizeof(int))
    cdef fuse_ino_t *inos = <fuse_ino_t *> stdlib.calloc(<size_t> max(n, 1), sizeof(fuse_ino_t))
    cdef Py_buffer *bufs = <Py_buffer *> stdlib.calloc(<size_t> max(n, 1), sizeof(Py_buffer))
    cdef fuse_bufvec bufvec
    if rets == NULL or inos == NULL or bufs == NULL:
        stdlib.free(rets)
        stdlib.free(inos)
        stdlib.free(bufs)
        raise MemoryError()
    try:
        for i in range(n):
            inode, data = items[i]
            inos[i] = inode
            PyObject_GetBuffer(data, &bufs[i], PyBUF_CONTIG_RO)
            held += 1
        with nogil:
            for i in range(n):
                bufvec.count = 1
                bufvec.idx = 0
                bufvec.off = 0
                bufvec.buf[0].flags = 0
                bufvec.buf[0].mem = bufs[i].buf
                bufvec.buf[0].size = <size_t> bufs[i].len
                rets[i] = fuse_lowlevel_notify_store(session, inos[i], 0, &bufvec, 0)
        return [-rets[i] for i in range(n)]
    finally:
        for i in range(held):
            PyBuffer_Release(&bufs[i])
        stdlib.free(rets)
        stdlib.free(inos)
        stdlib.free(bufs)
"""


def patch_store_many(text: str) -> str:
    """__init__.pyx's text with notify_store_many at its end."""
    if text.count(STORE_ANCHOR) != 1 or "\ndef notify_store(inode, offset, data):\n" not in text:
        raise SystemExit(f"pyfuse3 {VERSION}'s notify_store changed: no {STORE_ANCHOR.strip()!r}")
    return text + STORE_MANY


# The ioctl handler, in C (internal.pxi): count the request and answer ENOTTY.
IOCTL_ANCHOR = "    fuse_ops.poll = fuse_poll\n"
IOCTL_HANDLER = '''

# fusefs: FUSE_IOCTL requests (Python's open() asks isatty of every file) are answered
# here, in C, as libfuse answered them without a handler, and counted
cdef extern from *:
    """
    static unsigned long long fusefs_ioctl_requests = 0;
    static void fusefs_ioctl(fuse_req_t req, fuse_ino_t ino, int cmd, void *arg,
                             struct fuse_file_info *fi, unsigned flags, const void *in_buf,
                             size_t in_bufsz, size_t out_bufsz) {
        fusefs_ioctl_requests++;
        fuse_reply_err(req, ENOTTY);
    }
    static void fusefs_set_ioctl(struct fuse_lowlevel_ops *ops) { ops->ioctl = fusefs_ioctl; }
    """
    unsigned long long fusefs_ioctl_requests
    void fusefs_set_ioctl(fuse_lowlevel_ops *ops)


def ioctl_requests():
    "FUSE_IOCTL requests answered since the module was loaded (fusefs: each was ENOTTY)."
    return fusefs_ioctl_requests
'''


def patch_ioctl(text: str) -> str:
    """internal.pxi's text with the counting ioctl handler set among the operations."""
    if text.count(IOCTL_ANCHOR) != 1:
        raise SystemExit(f"pyfuse3 {VERSION}'s init_fuse_ops changed: no {IOCTL_ANCHOR.strip()!r}")
    return text.replace(IOCTL_ANCHOR, IOCTL_ANCHOR + "    fusefs_set_ioctl(&fuse_ops)\n") + IOCTL_HANDLER


# The fast path (scripts/pyfuse3_fastpath.h): its C functions declared in internal.pxi, and
# the functions fusefs calls.
FAST_ANCHOR = "async def _wait_fuse_readable():\n"
FAST_DECLS = '''\
# fusefs: the fast path, a thread in C answering the dataset files' open, ioctl and release,
# and the reads of samples held for it
from cpython.object cimport PyObject
from libc.stdint cimport uintptr_t

cdef extern from "_fastpath.h":
    int fusefs_fast_configure(int fd, unsigned long long file_base, unsigned long long n_files,
                              unsigned long long fh_base, unsigned sid_bits,
                              unsigned long long serial, unsigned long long serial_wrap,
                              unsigned long long write_flags, size_t batch, long delay_us,
                              const unsigned long long *events) nogil
    int fusefs_fast_answer_one(const char *data, size_t len) nogil
    int fusefs_fast_start(int fd, unsigned long long file_base, unsigned long long n_files,
                          unsigned long long fh_base, unsigned sid_bits,
                          unsigned long long serial, unsigned long long serial_wrap,
                          unsigned long long write_flags, size_t batch, long delay_us,
                          const unsigned long long *events) nogil
    void fusefs_fast_stop() nogil
    void fusefs_fast_join() nogil
    int fusefs_wait_fd(int session_fd) nogil
    int fusefs_receive(fuse_session *se, fuse_buf *buf) nogil
    int fusefs_fast_event_fd() nogil
    void fusefs_fast_counts(unsigned long long *out) nogil
    unsigned long long *fusefs_fast_take(size_t *n) nogil
    void fusefs_fast_hold(unsigned long long sid, PyObject *o)
    void fusefs_fast_free_held()
    void fusefs_fast_kernel_flags(const unsigned char *flags, unsigned long long n)
    int fusefs_fast_tree(unsigned long long n_dirs, const unsigned long long *dir_first_file,
                         const unsigned long long *dir_nfiles, unsigned long long n_files,
                         const unsigned long long *name_off, const unsigned int *name_len,
                         const char *names, unsigned long long names_len,
                         const unsigned long long *size, const unsigned int *mode,
                         const long long *mtime_ns, unsigned int uid, unsigned int gid,
                         unsigned int blksize, unsigned long long timeout_s)


def fast_path_start(file_base, n_files, fh_base, sid_bits, serial, serial_wrap, write_flags,
                    batch, delay_us, events):
    """Start the fast path's thread (after init(), before main()). It answers the open of
    inodes [file_base, file_base + n_files) without write_flags, the k-th with handle
    ((serial + k) % serial_wrap << sid_bits) | (inode - file_base) and keep_cache; the
    release of handles below fh_base; every ioctl (ENOTTY). events: the bits of its events
    (released, read, read_end, read_lost), single bits above every handle (EINVAL
    otherwise). Returns the fd that is readable while events wait for fast_path_events():
    from `batch` of them, `delay_us` after the first, or with a request handed to the loop."""
    if session == NULL:
        raise RuntimeError('Need to call init() before fast_path_start()')
    cdef unsigned long long bits[4]
    released, read, read_end, read_lost = events
    bits[0], bits[1], bits[2], bits[3] = released, read, read_end, read_lost
    cdef int err = fusefs_fast_start(session_fd, file_base, n_files, fh_base, sid_bits,
                                     serial, serial_wrap, write_flags, batch, delay_us, bits)
    if err:
        raise OSError(err, 'fast_path_start: ' + strerror(err))
    return fusefs_fast_event_fd()


def fast_path_configure(fd, file_base, n_files, fh_base, sid_bits, serial, serial_wrap, write_flags,
                        events):
    """Tests: set the fast path up as fast_path_start does, without its thread, its replies
    written to fd (fast_path_tree and fast_path_kernel_flags stay; the table of held samples
    is new and empty: fast_path_hold fills it); then fast_path_answer."""
    cdef unsigned long long bits[4]
    released, read, read_end, read_lost = events
    bits[0], bits[1], bits[2], bits[3] = released, read, read_end, read_lost
    cdef int err = fusefs_fast_configure(fd, file_base, n_files, fh_base, sid_bits, serial,
                                         serial_wrap, write_flags, 1 << 30, 0, bits)
    if err:
        raise OSError(err, 'fast_path_configure: ' + strerror(err))


def fast_path_answer(request):
    """Tests: answer request (the bytes of a FUSE request) as the thread would, after
    fast_path_configure: True, or False where it would go to the loop (nothing written);
    fast_path_events() then has its event. Not while the thread runs (RuntimeError)."""
    cdef const char *data = request
    cdef int r = fusefs_fast_answer_one(data, len(request))
    if r < 0:
        raise RuntimeError('fast_path_answer: the thread runs, or the fast path is not configured')
    return bool(r)


def fast_path_events():
    """The events of the requests the fast path answered since the last call, in order:
    bytes of native 64-bit values (fast_path_start's events)."""
    cdef size_t n = 0
    cdef unsigned long long *ev = fusefs_fast_take(&n)
    try:
        return (<char *> ev)[:n * 8] if n else b''
    finally:
        stdlib.free(ev)


def fast_path_counts():
    """Requests the fast path's thread answered, by type (open, release, ioctl, read,
    lookup, forget: a batch of forgets counts one; interrupt: taken, not answered)."""
    cdef unsigned long long c[8]
    fusefs_fast_counts(c)
    return {'open': c[0], 'release': c[1], 'ioctl': c[2], 'read': c[3], 'lookup': c[5],
            'forget': c[6], 'interrupt': c[7]}


def fast_path_read_bytes():
    """The bytes of the reads the fast path's thread answered."""
    cdef unsigned long long c[8]
    fusefs_fast_counts(c)
    return c[4]


_fusefs_kernel_flags = None  # (kept alive while the thread reads them)


def fast_path_kernel_flags(flags):
    """Before fast_path_start: flags (a contiguous numpy uint8 array, one byte per sample)
    that are nonzero while the caller takes the kernel to hold a sample's pages; the thread
    reads a sample's flag when it answers a read of it, and sets bit 60 of the read's event
    if the flag was set (the kernel had dropped the pages). None: no flags."""
    global _fusefs_kernel_flags
    if flags is None:
        fusefs_fast_kernel_flags(NULL, 0)
    else:
        if flags.dtype.itemsize != 1 or not flags.flags.c_contiguous:
            raise TypeError('fast_path_kernel_flags: a contiguous array of bytes')
        fusefs_fast_kernel_flags(<const unsigned char *> <uintptr_t> flags.ctypes.data, len(flags))
    _fusefs_kernel_flags = flags


_fusefs_tree = None  # (kept alive while the thread reads it)


def _fusefs_array(a, dtype, n, what):
    if a.dtype != dtype or not a.flags.c_contiguous or len(a) != n:
        raise TypeError(f'fast_path_tree: {what} must be {n} contiguous {dtype}')
    return a.ctypes.data


def fast_path_tree(tree):
    """Before fast_path_start: the tree the thread answers the lookups of files from, or
    None (every lookup goes to the handlers). A dict of numpy arrays: dir_first_file,
    dir_nfiles (uint64, one per folder: folder d is inode d + 1, its files the samples
    dir_first_file[d] .. + dir_nfiles[d], sorted by name); name_off (uint64), name_len
    (uint32), size (uint64), mode (uint32, permission bits), mtime_ns (int64), one per
    sample; names (uint8, every name); and uid, gid, blksize, timeout (seconds) for every
    file. A
    file's inode is file_base + its sample (fast_path_start's)."""
    global _fusefs_tree
    if tree is None:
        fusefs_fast_tree(0, NULL, NULL, 0, NULL, NULL, NULL, 0, NULL, NULL, NULL, 0, 0, 0, 0)
        _fusefs_tree = None
        return
    nd, nf = len(tree['dir_first_file']), len(tree['size'])
    cdef int err = fusefs_fast_tree(
        nd, <const unsigned long long *> <uintptr_t> _fusefs_array(tree['dir_first_file'], 'uint64', nd, 'dir_first_file'),
        <const unsigned long long *> <uintptr_t> _fusefs_array(tree['dir_nfiles'], 'uint64', nd, 'dir_nfiles'), nf,
        <const unsigned long long *> <uintptr_t> _fusefs_array(tree['name_off'], 'uint64', nf, 'name_off'),
        <const unsigned int *> <uintptr_t> _fusefs_array(tree['name_len'], 'uint32', nf, 'name_len'),
        <const char *> <uintptr_t> _fusefs_array(tree['names'], 'uint8', len(tree['names']), 'names'),
        len(tree['names']),
        <const unsigned long long *> <uintptr_t> _fusefs_array(tree['size'], 'uint64', nf, 'size'),
        <const unsigned int *> <uintptr_t> _fusefs_array(tree['mode'], 'uint32', nf, 'mode'),
        <const long long *> <uintptr_t> _fusefs_array(tree['mtime_ns'], 'int64', nf, 'mtime_ns'),
        tree['uid'], tree['gid'], tree['blksize'], int(tree['timeout']))
    if err:
        raise OSError(err, 'fast_path_tree: ' + strerror(err))
    _fusefs_tree = tree


def _fusefs_free():
    """(close(), after the thread's join) Drop the held bytes, the kernel flags and the tree,
    and the references that kept the last two alive."""
    global _fusefs_kernel_flags, _fusefs_tree
    fusefs_fast_free_held()
    _fusefs_kernel_flags = _fusefs_tree = None


def fast_path_hold(sid, data):
    """Let the fast path answer the reads of a handle of sample sid from data (bytes), or
    no longer (None): each read is then an event, the sample with the `read` bit set, and
    `read_end` when it reached the sample's end. The thread keeps a reference to data meanwhile."""
    if data is None:
        fusefs_fast_hold(sid, NULL)
    elif type(data) is bytes:
        fusefs_fast_hold(sid, <PyObject *> data)
    else:
        raise TypeError('fast_path_hold: data must be bytes or None')


'''
FAST_RECEIVE = "fuse_session_receive_buf(session, &buf)"
FAST_WAIT = "await trio.lowlevel.wait_readable(session_fd)"
FAST_TERMINATE = "    fuse_session_exit(session)\n    trio.lowlevel.notify_closing(session_fd)\n"
FAST_CLOSE = "    if unmount:\n        log.debug('Calling fuse_session_unmount')\n"


def marks(patches) -> dict:
    """The marks a build with these patches sets on the module (fusefs looks for them)."""
    return {PATCHES[name][2]: True for name in patches}


def patch_fast_loop(text: str) -> str:
    """internal.pxi's text with the fast path declared, and the request loop taking its
    requests from it (libfuse's receive and the FUSE fd while its thread does not run)."""
    begin = text.index("async def _session_loop(")
    if text.count(FAST_ANCHOR) != 1 or text.count(FAST_WAIT) != 1 or FAST_RECEIVE not in text[begin:]:
        raise SystemExit(f"pyfuse3 {VERSION}'s request loop changed: no {FAST_RECEIVE!r}")
    text = text[:begin] + text[begin:].replace(FAST_RECEIVE, "fusefs_receive(session, &buf)")
    text = text.replace(FAST_WAIT, "await trio.lowlevel.wait_readable(fusefs_wait_fd(session_fd))")
    return text.replace(FAST_ANCHOR, FAST_DECLS + FAST_ANCHOR)


def patch_fast_init(text: str) -> str:
    """__init__.pyx's text with terminate() stopping the fast path's thread and close()
    joining it."""
    if text.count(FAST_TERMINATE) != 1 or text.count(FAST_CLOSE) != 1:
        raise SystemExit(f"pyfuse3 {VERSION}'s terminate or close changed")
    text = text.replace(FAST_TERMINATE, "    fusefs_fast_stop()\n" + FAST_TERMINATE)
    return text.replace(FAST_CLOSE, "    fusefs_fast_join()\n    _fusefs_free()\n" + FAST_CLOSE)


# name -> (the source file it changes, the change, the mark it sets on the module, why)
PATCHES = {
    "loop": ("internal.pxi", patch_session_loop, "REQUESTS_WITHOUT_WAIT",
             "the request loop takes a queued request without waiting for the fd"),
    "store": ("__init__.pyx", patch_store_many, "STORE_MANY",
              "notify_store_many pushes many samples to the page cache without the GIL"),
    "ioctl": ("internal.pxi", patch_ioctl, "IOCTL_COUNTED",
              "ioctl requests are answered in C (ENOTTY) and counted: ioctl_requests()"),
    "spawn": ("internal.pxi", patch_spawn, "TASKS_WHEN_ALL_BUSY",
              "the request loop starts a task only when every other is inside a handler"),
    "fast": ("internal.pxi", patch_fast_loop, "FAST_PATH",
             "a thread in C answers the dataset files' open, ioctl, release and held reads: fast_path_start()"),
}
# other files a patch changes (a file it adds gets its change of "")
EXTRA = {"fast": (("__init__.pyx", patch_fast_init),)}


def patched_source(into: pathlib.Path, patches) -> pathlib.Path:
    """Download pyfuse3's sdist into `into` and apply the patches to its sources; the
    source tree (holding pyproject.toml), with the .pyx to be compiled again."""
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                    "--no-binary", ":all:", f"pyfuse3=={VERSION}", "-d", str(into)], check=True)
    sdist = next(into.glob("pyfuse3-*.tar.gz"))
    digest = hashlib.sha256(sdist.read_bytes()).hexdigest()
    if digest != SDIST_SHA256:
        raise SystemExit(f"{sdist.name}: SHA-256 {digest}, not pyfuse3 {VERSION}'s {SDIST_SHA256}")
    with tarfile.open(sdist) as tar:
        if hasattr(tarfile, "data_filter"):  # (Python 3.11.4 and later)
            tar.extractall(into, filter="data")
        else:
            tar.extractall(into)
    src = into / f"pyfuse3-{VERSION}" / "src" / "pyfuse3"
    want, lines = marks(patches), []
    for name in patches:
        file, patch, mark, why = PATCHES[name]
        for f, change in ((file, patch), *EXTRA.get(name, ())):
            (src / f).write_text(change((src / f).read_text() if (src / f).exists() else ""))
        lines.append(f"\n# fusefs: {why}\n{mark} = {want[mark]!r}\n")
    init = src / "__init__.pyx"
    init.write_text(init.read_text() + "".join(lines))
    (src / "__init__.c").unlink(missing_ok=True)  # generated from the .pyx: regenerate
    return src.parent.parent


# what fusefs/pyfuse3 holds of the patched sources (the rest of the sdist is not needed to build)
VENDORED = ("__init__.pyx", "handlers.pxi", "internal.pxi", "macros.pxd", "macros.c", "pyfuse3.h",
            "xattr.h", "gettime.h", "_pyfuse3.py", "__init__.pyi", "py.typed")


def vendor(dest: pathlib.Path) -> None:
    """Write the patched sources into dest (fusefs/pyfuse3: setup.py builds them as the
    extension fusefs.pyfuse3), with pyfuse3's Cython declarations of libfuse (include/) and
    its licence; what was there goes."""
    with tempfile.TemporaryDirectory() as tmp:
        tree = patched_source(pathlib.Path(tmp), list(PATCHES))
        if dest.exists():
            shutil.rmtree(dest)
        (dest / "include").mkdir(parents=True)
        for name in VENDORED:
            shutil.copy(tree / "src" / "pyfuse3" / name, dest / name)
        for pxd in (tree / "Include").glob("*.pxd"):
            shutil.copy(pxd, dest / "include" / pxd.name)
        shutil.copy(tree / "LICENSE", dest / "LICENSE")
    print(f"pyfuse3 {VERSION} with the patches {', '.join(PATCHES)}: {dest}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--into", default=str(VENDOR_DIR),
                   help=f"where to write the patched sources (default {VENDOR_DIR})")
    vendor(pathlib.Path(p.parse_args().into))


if __name__ == "__main__":
    main()
