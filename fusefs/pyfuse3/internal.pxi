'''
internal.pxi

This file defines functions and data structures that are used internally by
pyfuse3. It is included by __init__.pyx.

Copyright © 2013 Nikolaus Rath <Nikolaus.org>

This file is part of pyfuse3. This work may be distributed under
the terms of the GNU LGPL.
'''

cdef void save_retval(object val):
    global py_retval
    if py_retval is not None and val is not None:
        log.error('py_retval was not awaited - please report a bug at '
                  'https://github.com/libfuse/pyfuse3/issues!')
    py_retval = val

cdef object get_request_context(fuse_req_t req):
    '''Get RequestContext() object'''

    cdef const_fuse_ctx* context
    cdef RequestContext ctx

    context = fuse_req_ctx(req)
    ctx = RequestContext.__new__(RequestContext)
    ctx.pid = context.pid
    ctx.uid = context.uid
    ctx.gid = context.gid
    ctx.umask = context.umask

    return ctx

cdef void init_fuse_ops():
    '''Initialize fuse_lowlevel_ops structure'''

    string.memset(&fuse_ops, 0, sizeof(fuse_lowlevel_ops))

    fuse_ops.init = fuse_init
    fuse_ops.lookup = fuse_lookup
    fuse_ops.forget = fuse_forget
    fuse_ops.getattr = fuse_getattr
    fuse_ops.setattr = fuse_setattr
    fuse_ops.readlink = fuse_readlink
    fuse_ops.mknod = fuse_mknod
    fuse_ops.mkdir = fuse_mkdir
    fuse_ops.unlink = fuse_unlink
    fuse_ops.rmdir = fuse_rmdir
    fuse_ops.symlink = fuse_symlink
    fuse_ops.rename = fuse_rename
    fuse_ops.link = fuse_link
    fuse_ops.open = fuse_open
    fuse_ops.read = fuse_read
    fuse_ops.write = fuse_write
    fuse_ops.flush = fuse_flush
    fuse_ops.release = fuse_release
    fuse_ops.fsync = fuse_fsync
    fuse_ops.opendir = fuse_opendir
    fuse_ops.readdirplus = fuse_readdirplus
    fuse_ops.releasedir = fuse_releasedir
    fuse_ops.fsyncdir = fuse_fsyncdir
    fuse_ops.statfs = fuse_statfs
    ASSIGN_NOT_DARWIN(fuse_ops.setxattr, &fuse_setxattr)
    ASSIGN_NOT_DARWIN(fuse_ops.getxattr, &fuse_getxattr)
    fuse_ops.listxattr = fuse_listxattr
    fuse_ops.removexattr = fuse_removexattr
    fuse_ops.access = fuse_access
    fuse_ops.create = fuse_create
    fuse_ops.forget_multi = fuse_forget_multi
    fuse_ops.write_buf = fuse_write_buf
    fuse_ops.poll = fuse_poll
    fusefs_set_ioctl(&fuse_ops)

cdef make_fuse_args(args, fuse_args* f_args):
    cdef char* arg
    cdef int i
    cdef ssize_t size_s
    cdef size_t size

    args_new = [ b'pyfuse3' ]
    for el in args:
        args_new.append(b'-o')
        args_new.append(el.encode('us-ascii'))
    args = args_new

    f_args.argc = <int> len(args)
    if f_args.argc == 0:
        f_args.argv = NULL
        return

    f_args.allocated = 1
    f_args.argv = <char**> stdlib.calloc(<size_t> f_args.argc, sizeof(char*))

    if f_args.argv is NULL:
        cpython.exc.PyErr_NoMemory()

    try:
        for (i, el) in enumerate(args):
            PyBytes_AsStringAndSize(el, &arg, &size_s)
            size = <size_t> size_s # guaranteed positive
            f_args.argv[i] = <char*> stdlib.malloc((size+1)*sizeof(char))

            if f_args.argv[i] is NULL:
                cpython.exc.PyErr_NoMemory()

            string.strncpy(f_args.argv[i], arg, size+1)
    except:
        for i in range(f_args.argc):
            # Freeing a NULL pointer (if this element has not been allocated
            # yet) is fine.
            stdlib.free(f_args.argv[i])
        stdlib.free(f_args.argv)
        raise

def _notify_loop():
    '''Process async invalidate_entry calls.'''

    while True:
        req = _notify_queue.get()
        if req is None:
            log.debug('terminating notify thread')
            break

        (inode_p, name, deleted, ignore_enoent) = req
        try:
            invalidate_entry(inode_p, name, deleted)
        except Exception as exc:
            if ignore_enoent and isinstance(exc, FileNotFoundError):
                pass
            else:
                log.exception('Failed to submit invalidate_entry request for '
                              'parent inode %d, name %s', req[0], req[1])

cdef str2bytes(s):
    '''Convert *s* to bytes'''

    return s.encode(fse, 'surrogateescape')

cdef bytes2str(s):
    '''Convert *s* to str'''

    return s.decode(fse, 'surrogateescape')

cdef strerror(int errno):
    try:
        return os.strerror(errno)
    except ValueError:
        return 'errno: %d' % errno

cdef PyBytes_from_bufvec(fuse_bufvec *src):
    cdef fuse_bufvec dst
    cdef size_t len_
    cdef ssize_t res

    len_ = fuse_buf_size(src) - src.off
    if len_ > PY_SSIZE_T_MAX:
        raise OverflowError('Value too long to convert to Python')
    buf = PyBytes_FromStringAndSize(NULL, <ssize_t> len_)
    dst.count = 1
    dst.idx = 0
    dst.off = 0
    dst.buf[0].mem = PyBytes_AS_STRING(buf)
    dst.buf[0].size = len_
    dst.buf[0].flags = 0
    res = fuse_buf_copy(&dst, src, 0)
    if res < 0:
        raise OSError(errno.errno, 'fuse_buf_copy failed with '
                      + strerror(errno.errno))
    elif <size_t> res < len_:
        # This is expected to be rare
        return buf[:res]
    else:
        return buf

cdef void* calloc_or_raise(size_t nmemb, size_t size) except NULL:
    cdef void* mem
    mem = stdlib.calloc(nmemb, size)
    if mem is NULL:
        raise MemoryError()
    return mem

cdef class _WorkerData:
    """For internal use by pyfuse3 only."""

    cdef int task_count
    cdef int task_serial
    cdef object read_lock
    cdef int active_readers

    def __init__(self):
        self.read_lock = None
        self.active_readers = 0

    cdef get_name(self):
        self.task_serial += 1
        return 'pyfuse-%02d' % self.task_serial

# Delay initialization so that pyfuse3.asyncio can replace
# the trio module.
cdef _WorkerData worker_data

# fusefs: the fast path, a thread in C answering the dataset files' open, ioctl and release,
# and the reads of samples held for it
from cpython.object cimport PyObject
from libc.stdint cimport int64_t, uintptr_t

cdef extern from "_fastpath.h":
    ctypedef struct fusefs_parked:
        pass
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
                          const unsigned long long *events, int nthreads) nogil
    const void *fusefs_fast_io()
    int fusefs_fast_thread_counts(unsigned long long *out) nogil
    void fusefs_fast_stop() nogil
    void fusefs_fast_join() nogil
    int fusefs_wait_fd(int session_fd) nogil
    int fusefs_receive(fuse_session *se, fuse_buf *buf) nogil
    int fusefs_fast_event_fd() nogil
    void fusefs_fast_counts(unsigned long long *out) nogil
    unsigned long long *fusefs_fast_take(size_t *n) nogil
    int fusefs_fast_pending(size_t *n, int *signalled) nogil
    void fusefs_fast_idle(int idle) nogil
    enum:
        FUSEFS_LAZY
        FUSEFS_IDLE
        FUSEFS_IDLE_BATCH
    fusefs_parked *fusefs_fast_hold(unsigned long long sid, PyObject *o)
    void fusefs_fast_answer_parked(fusefs_parked *w, const char *buf, unsigned long long n) nogil
    void fusefs_fast_expect(const int64_t *sids, size_t n) nogil
    fusefs_parked *fusefs_fast_hand(unsigned long long sid)
    void fusefs_fast_misses(unsigned long long bit)
    int fusefs_fast_miss_lanes(const unsigned char *lane_of, unsigned long long n, int nlanes)
    void fusefs_fast_miss_engine(int on) nogil
    void fusefs_fast_miss_stop(int hand_back) nogil
    void fusefs_fast_miss_free()
    void fusefs_fast_miss_counts(unsigned long long *out) nogil
    object fusefs_fast_miss_api()
    object fusefs_fast_publish_api()
    void fusefs_fast_hold_one(unsigned long long sid, void *obj)
    void fusefs_fast_free_held()
    void fusefs_fast_kernel_flags(const unsigned char *flags, unsigned long long n)
    int fusefs_fast_tree(unsigned long long n_dirs, const unsigned long long *dir_first_file,
                         const unsigned long long *dir_nfiles, unsigned long long n_files,
                         const unsigned long long *name_off, const unsigned int *name_len,
                         const char *names, unsigned long long names_len,
                         const unsigned long long *size, const unsigned int *mode,
                         const long long *mtime_ns, unsigned int uid, unsigned int gid,
                         unsigned int blksize, unsigned long long timeout_s)


cdef extern from "fuse_lowlevel.h":
    int fuse_session_custom_io(fuse_session *se, const void *io, int fd)


def fast_path_start(file_base, n_files, fh_base, sid_bits, serial, serial_wrap, write_flags,
                    batch, delay_us, events, threads=1):
    """Start the fast path's threads (after init(), before main()): `threads` of them, the
    first on the session's fd, the others each on a clone of it. They answer the open of
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
                                     serial, serial_wrap, write_flags, batch, delay_us, bits, threads)
    if err:
        raise OSError(err, 'fast_path_start: ' + strerror(err))
    if fusefs_fast_io() != NULL:  # (the loop's replies go to the fd each request came from)
        err = -fuse_session_custom_io(session, fusefs_fast_io(), session_fd)
        if err:
            fusefs_fast_join()
            raise OSError(err, 'fast_path_start: custom I/O: ' + strerror(err))
    return fusefs_fast_event_fd()


def fast_path_thread_counts():
    """The requests each of the fast path's threads answered."""
    cdef unsigned long long c[64]
    cdef int n = fusefs_fast_thread_counts(c)
    return [c[i] for i in range(n)]


def fast_path_configure(fd, file_base, n_files, fh_base, sid_bits, serial, serial_wrap, write_flags,
                        events, delay_us=0, batch=1 << 30):
    """Tests: set the fast path up as fast_path_start does, without its thread, its replies
    written to fd (fast_path_tree and fast_path_kernel_flags stay; the table of held samples
    is new and empty: fast_path_hold fills it); then fast_path_answer. delay_us, batch: the
    events' delay and batch (fast_path_pending tells which deadline they wait for, and
    whether they were signalled)."""
    cdef unsigned long long bits[4]
    released, read, read_end, read_lost = events
    bits[0], bits[1], bits[2], bits[3] = released, read, read_end, read_lost
    cdef int err = fusefs_fast_configure(fd, file_base, n_files, fh_base, sid_bits, serial,
                                         serial_wrap, write_flags, batch, delay_us, bits)
    if err:
        raise OSError(err, 'fast_path_configure: ' + strerror(err))


def fast_path_answer(request):
    """Tests: answer request (the bytes of a FUSE request) as the thread would, after
    fast_path_configure: True, or False where it would go to the loop (nothing written);
    fast_path_events() then has its event. Not while the thread runs (RuntimeError). It lets
    go of the GIL while it answers, as the thread does (one caller at a time)."""
    cdef const char *data = request
    cdef size_t n = len(request)
    cdef int r
    with nogil:
        r = fusefs_fast_answer_one(data, n)
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


# how many times the delay lazy events wait (an open or release of a sample the kernel
# holds while nothing came into the cache for a while), and while the read-ahead is idle
# (fast_path_idle), when also FAST_PATH_IDLE_BATCH times the batch may wait
FAST_PATH_LAZY = FUSEFS_LAZY
FAST_PATH_IDLE = FUSEFS_IDLE
FAST_PATH_IDLE_BATCH = FUSEFS_IDLE_BATCH


def fast_path_pending():
    """(the events waiting, how many times the delay they wait: 1, FAST_PATH_LAZY while
    every one is lazy, FAST_PATH_IDLE while the read-ahead is idle too, 0 when none waits;
    whether the event fd was made readable for them), fusefs/_fastpath.h."""
    cdef size_t n = 0
    cdef int signalled = 0
    cdef int delays = fusefs_fast_pending(&n, &signalled)
    return n, delays, bool(signalled)


def fast_path_idle(idle):
    """Tell the fast path whether the read-ahead is idle (it covered its orders: the
    readers' progress gives it nothing to fetch until a new order); its lazy events then
    wait FAST_PATH_IDLE times the delay."""
    fusefs_fast_idle(1 if idle else 0)


def fast_path_counts():
    """Requests the fast path's thread answered, by type (open, release, ioctl, read,
    lookup, forget: a batch of forgets counts one; interrupt: of a request answered here,
    taken, not answered)."""
    cdef unsigned long long c[12]
    fusefs_fast_counts(c)
    return {'open': c[0], 'release': c[1], 'ioctl': c[2], 'read': c[3], 'lookup': c[5],
            'forget': c[6], 'interrupt': c[7]}


def fast_path_read_bytes():
    """The bytes of the reads the fast path's thread answered."""
    cdef unsigned long long c[12]
    fusefs_fast_counts(c)
    return c[4]


def fast_path_interrupts_forwarded():
    """Interrupts the fast path's thread handed to the loop (their requests were not
    answered there)."""
    cdef unsigned long long c[12]
    fusefs_fast_counts(c)
    return c[8]


def fast_path_parked():
    """(reads that waited in the fast path for their sample's fetch, those of them handed to
    the loop after all, misses among them): fast_path_expect, fast_path_misses."""
    cdef unsigned long long c[12]
    fusefs_fast_counts(c)
    return c[9], c[10], c[11]


def fast_path_misses(bit):
    """Before fast_path_start: a read of a sample neither held nor expected that asks for the
    whole sample (offset 0, the size fast_path_tree gives or more) waits in the fast path
    too, and is told as an event at once (bit | the `read` bit | the sample; a second read
    of the sample meanwhile waits for the same one): the caller fetches the sample and hands
    it over (fast_path_hand, fast_path_hold), or lets the read go to the loop
    (fast_path_hold(sid, None)). 0: such reads go to the loop. The bit must be a single bit
    above every sample, none of the other events' (fast_path_start checks: EINVAL)."""
    fusefs_fast_misses(bit)


_fusefs_miss_lanes = None  # (kept alive while the engine reads it)


def fast_path_miss_lanes(lane_of):
    """The miss engine's lanes (fusefs/_missapi.h): lane_of, a contiguous numpy uint8 array
    with each sample's lane (its node's), all below 64. The engine is off until
    fast_path_miss_engine(True). None: the lanes forgotten (after the engine's readers
    ended; the engine stopped first)."""
    global _fusefs_miss_lanes
    if lane_of is None:
        fusefs_fast_miss_free()
        _fusefs_miss_lanes = None
        return
    if lane_of.dtype.itemsize != 1 or not lane_of.flags.c_contiguous:
        raise TypeError('fast_path_miss_lanes: a contiguous array of bytes')
    nlanes = int(lane_of.max()) + 1 if len(lane_of) else 1
    err = fusefs_fast_miss_lanes(<const unsigned char *> <uintptr_t> lane_of.ctypes.data,
                                 len(lane_of), nlanes)
    if err:
        raise OSError(err, f'fast_path_miss_lanes: {os.strerror(err)}')
    _fusefs_miss_lanes = lane_of


def fast_path_miss_engine(on):
    """Whether the misses the fast path parks (fast_path_misses) go to the engine's lanes
    (True) or are told to the caller as events (False); those queued are read still."""
    fusefs_fast_miss_engine(1 if on else 0)


def fast_path_miss_stop():
    """Stop the engine: its readers end, and the misses still queued go to the loop."""
    with nogil:
        fusefs_fast_miss_stop(1)


def fast_path_miss_api():
    """The capsule of the functions the engine's readers call (fusefs/_missapi.h)."""
    return fusefs_fast_miss_api()


def fast_path_publish_api():
    """The capsule of the function a fetch's worker thread publishes a group's samples with
    (fusefs/_publishapi.h): held or handed over in C as they are read."""
    return fusefs_fast_publish_api()


def fast_path_miss_counts():
    """The engine's misses: (queued on a lane, told to the loop instead, answered by the
    engine, handed to the loop by the engine)."""
    cdef unsigned long long c[4]
    fusefs_fast_miss_counts(c)
    return c[0], c[1], c[2], c[3]


def fast_path_hand_many(items):
    """Of each (sid, data) of items (data other than bytes: skipped), the reads that wait for
    sid are answered from data, without the GIL, which the fast path does not hold (a fetched
    sample that readers missed, whether it is kept or not); sid is no longer expected. A
    sample no read waits for costs a look at one byte."""
    cdef fusefs_parked *w
    cdef const char *buf
    cdef unsigned long long n
    for sid, data in items:
        if type(data) is not bytes:
            continue
        w = fusefs_fast_hand(sid)
        if w != NULL:
            buf = <const char *> data
            n = len(data)
            with nogil:
                fusefs_fast_answer_parked(w, buf, n)


def fast_path_expect(sids):
    """Samples (ints) a fetch thread is fetching and will hand to fast_path_hold (with their
    bytes, or None where the fetch fails or they are not kept): until then a read of one
    waits in the fast path (parked), not in the loop, and that hold answers it (or hands it
    to the loop). Samples held already are left as they are."""
    cdef size_t n = len(sids), i = 0
    cdef int64_t *a = <int64_t *> stdlib.malloc((n if n else 1) * sizeof(int64_t))
    if a == NULL:
        raise MemoryError()
    try:
        for sid in sids:
            if i == n:
                break
            a[i] = sid
            i += 1
        with nogil:
            fusefs_fast_expect(a, i)
    finally:
        stdlib.free(a)


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


cdef _fusefs_hold(unsigned long long sid, data):
    if data is not None and type(data) is not bytes:
        raise TypeError('fast_path_hold: data must be bytes or None')
    # (the cache's mirror's hold: the reads that waited answered without the GIL, data's
    # reference, the caller's, keeping its bytes alive)
    fusefs_fast_hold_one(sid, <void *> data if data is not None else NULL)


def fast_path_hold(sid, data):
    """Let the fast path answer the reads of a handle of sample sid from data (bytes), or
    no longer (None): each read is then an event, the sample with the `read` bit set, and
    `read_end` when it reached the sample's end. The thread keeps a reference to data meanwhile.
    The reads that waited for sid (fast_path_expect) are answered from data now, without the
    GIL, or, with None, handed to the loop."""
    _fusefs_hold(sid, data)


def fast_path_hold_many(items):
    """fast_path_hold(sid, data) of each (sid, data) of items, in one call (data other than
    bytes: None)."""
    for sid, data in items:
        _fusefs_hold(sid, data if type(data) is bytes else None)


async def _wait_fuse_readable():
    '''Wait for FUSE fd to become readable

    Return True if the fd is readable, or False if the main loop
    should terminate.
    '''

    if worker_data.read_lock is None:
        worker_data.read_lock = trio.Lock()

    #name = trio.lowlevel.current_task().name
    worker_data.active_readers += 1
    try:
        #log.debug('%s: Waiting for read lock...', name)
        async with worker_data.read_lock:
            #log.debug('%s: Waiting for fuse fd to become readable...', name)
            if fuse_session_exited(session):
                log.debug('FUSE session exit flag set while waiting for FUSE fd '
                          'to become readable.')
                return False
            await trio.lowlevel.wait_readable(fusefs_wait_fd(session_fd))
            #log.debug('%s: fuse fd readable, unparking next task.', name)
    except trio.ClosedResourceError:
        log.debug('FUSE fd about to be closed.')
        return False

    finally:
        worker_data.active_readers -= 1

    return True

# fusefs: tasks of _session_loop inside a handler (awaiting it), and tasks started
cdef int fusefs_in_handlers = 0

def loop_tasks_started():
    "Tasks of the request loop started since the module was loaded (fusefs)."
    return worker_data.task_serial

@async_wrapper
async def _session_loop(nursery, int min_tasks, int max_tasks):
    cdef int res
    global fusefs_in_handlers
    cdef fuse_buf buf
    cdef int in_a_row = 0

    import fcntl
    fcntl.fcntl(session_fd, fcntl.F_SETFL, fcntl.fcntl(session_fd, fcntl.F_GETFL) | os.O_NONBLOCK)

    name = trio.lowlevel.current_task().name

    buf.mem = NULL
    buf.size = 0
    buf.pos = 0
    buf.flags = 0
    while not fuse_session_exited(session):
        if worker_data.active_readers > min_tasks:
            log.debug('%s: too many idle tasks (%d total, %d waiting), terminating.',
                      name, worker_data.task_count, worker_data.active_readers)
            break

        # fusefs: take a request that is already queued without waiting for the fd (the fd
        # is non-blocking); wait only when there is none
        res = fusefs_receive(session, &buf)
        if res == -errno.EAGAIN:
            in_a_row = 0
            if not await _wait_fuse_readable():
                break
            res = fusefs_receive(session, &buf)
            if res == -errno.EAGAIN:
                continue
        # fusefs: start another task only when every other one is inside a handler
        if fusefs_in_handlers + 1 >= worker_data.task_count and worker_data.task_count < max_tasks:
            worker_data.task_count += 1
            log.debug('%s: No tasks waiting, starting another worker (now %d total).',
                      name, worker_data.task_count)
            nursery.start_soon(_session_loop, nursery, min_tasks, max_tasks,
                               name=worker_data.get_name())

        if res == -errno.EINTR:
            continue
        elif res < 0:
            raise OSError(-res, 'fuse_session_receive_buf failed with '
                          + strerror(-res))
        elif res == 0:
            break

        # When fuse_session_process_buf() calls back into one of our handler
        # methods, the handler will start a co-routine and store it in
        # py_retval.
        #log.debug('%s: processing request...', name)
        save_retval(None)
        fuse_session_process_buf(session, &buf)
        if py_retval is not None:
            fusefs_in_handlers += 1
            try:
                await py_retval
            finally:
                fusefs_in_handlers -= 1
        # fusefs: other tasks run at least every 16 requests taken in a row
        in_a_row += 1
        if in_a_row >= 16:
            in_a_row = 0
            await trio.lowlevel.checkpoint()
        #log.debug('%s: processing complete.', name)

    log.debug('%s: terminated', name)
    stdlib.free(buf.mem)
    worker_data.task_count -= 1


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
