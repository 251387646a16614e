/* fusefs._fetchio: the backend reads of a fetch batch, checksums included, planned and made
 * in C without the GIL (store.ChunkStore uses it when it is built; see setup.py).
 *
 * In Python, each pread and each push of a fetched sample releases and retakes the GIL:
 * with the event loop and several fetch threads wanting it, every such hand-off costs
 * futex wakeups and context switches (docs/HOTPATH.md counts them). And per-sample Python
 * around the reads (the coalescing, each read's arguments, each result) cost tiny samples
 * more than their reads. Here a batch is planned in one call (plan: store.ChunkStore
 * .coalesce's reads, as int64 buffers), and each group of its reads (preadv straight into
 * each sample's own bytes object, gaps into a scratch buffer), their xxh3-64 checks and
 * the advice to the kernel of the reads to come are made in one stretch without the GIL
 * (read_group), reading each sample's place, size and checksum from the index's arrays.
 * See each function's comment.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/uio.h>
#include <time.h>

/* XXH3-64, the function of the checksums that `fusefs pack` writes with python-xxhash. On
 * x86, libxxhash's dispatcher picks the fastest variant for the CPU at run time (AVX2,
 * SSE2, ...); elsewhere (aarch64: NEON) the library's own build picks it. */
#if defined(__x86_64__) || defined(__i386__)
#include <xxh_x86dispatch.h>
#define FUSEFS_XXH3 XXH3_64bits_dispatch
#else
#include <xxhash.h>
#define FUSEFS_XXH3 XXH3_64bits
#endif

#define SCRATCH (256 << 10) /* gaps up to this are read into scratch; longer ones in parts */
#define MAX_IOV 1024

typedef struct {
    Py_ssize_t rel, size;
    uint64_t sum;
    char *buf; /* the member's bytes object's storage; NULL after a checksum mismatch */
} member_t;

typedef struct {
    int fd;
    long long offset;
    Py_ssize_t length, got;
    int error;
    Py_ssize_t n;
    member_t *members;
} read_t;

/* Read [offset, offset + length) of r into its members' buffers (gaps into scratch);
 * r->got: bytes the file held, r->error: errno. Without the GIL. */
static void do_read(read_t *r, char *scratch) {
    struct iovec iov[MAX_IOV];
    Py_ssize_t done = 0;
    while (done < r->length) {
        int n = 0;
        Py_ssize_t pos = done;
        Py_ssize_t i = 0;
        while (pos < r->length && n < MAX_IOV) {
            while (i < r->n && r->members[i].rel + r->members[i].size <= pos)
                i++; /* behind pos (or empty) */
            if (i < r->n && r->members[i].rel <= pos) {
                member_t *m = &r->members[i];
                Py_ssize_t skip = pos - m->rel;
                iov[n].iov_base = m->buf + skip;
                iov[n].iov_len = (size_t)(m->size - skip);
                i++;
            } else {
                Py_ssize_t next = i < r->n ? r->members[i].rel : r->length;
                Py_ssize_t len = next - pos;
                if (len > SCRATCH)
                    len = SCRATCH;
                iov[n].iov_base = scratch;
                iov[n].iov_len = (size_t)len;
            }
            pos += (Py_ssize_t)iov[n].iov_len;
            n++;
        }
        ssize_t got = preadv(r->fd, iov, n, r->offset + done);
        if (got < 0) {
            if (errno == EINTR)
                continue;
            r->error = errno;
            return;
        }
        if (got == 0)
            break; /* end of file */
        done += got;
    }
    r->got = done;
}

static long long now_us(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (long long)t.tv_sec * 1000000 + t.tv_nsec / 1000;
}

/* Check r's members against their checksums (m->buf = NULL on a mismatch). Without the
 * GIL. */
static void verify(read_t *r) {
    if (r->error)
        return;
    for (Py_ssize_t j = 0; j < r->n; j++) {
        member_t *m = &r->members[j];
        if (m->rel + m->size > r->got)
            continue; /* short: reported by the caller */
        if (FUSEFS_XXH3(m->buf, (size_t)m->size) != m->sum)
            m->buf = NULL;
    }
}

/* A buffer argument of n items of `itemsize` bytes (an index array, or plan()'s output). */
typedef struct {
    Py_buffer view;
    Py_ssize_t n;
} array_t;

static int get_array(PyObject *obj, array_t *a, Py_ssize_t itemsize, const char *what) {
    if (PyObject_GetBuffer(obj, &a->view, PyBUF_C_CONTIGUOUS) < 0)
        return -1;
    if (a->view.len % itemsize) {
        PyErr_Format(PyExc_ValueError, "%s: a buffer of %zd-byte items expected", what, itemsize);
        PyBuffer_Release(&a->view);
        return -1;
    }
    a->n = a->view.len / itemsize;
    return 0;
}

#define I64(a, i) (((const int64_t *)(a).view.buf)[i])
#define U64(a, i) (((const uint64_t *)(a).view.buf)[i])
#define U32(a, i) (((const uint32_t *)(a).view.buf)[i])

typedef struct {
    uint64_t chunk, offset;
    int64_t sid, pos; /* pos: the sample's first position in sids */
} place_t;

static int by_sid(const void *a, const void *b) {
    const place_t *x = a, *y = b;
    return x->sid != y->sid ? (x->sid < y->sid ? -1 : 1) : (x->pos > y->pos) - (x->pos < y->pos);
}

static int by_place(const void *a, const void *b) {
    const place_t *x = a, *y = b;
    if (x->chunk != y->chunk)
        return x->chunk < y->chunk ? -1 : 1;
    if (x->offset != y->offset)
        return x->offset < y->offset ? -1 : 1;
    return (x->pos > y->pos) - (x->pos < y->pos);
}

typedef struct {
    int64_t chunk, offset, length, first, n, pos; /* first: its first member in keys */
} plan_read_t;

static int by_pos(const void *a, const void *b) {
    const plan_read_t *x = a, *y = b;
    return (x->pos > y->pos) - (x->pos < y->pos);
}

/* plan(sids, chunk, offset, size, max_gap, max_read) -> (reads, members): store.ChunkStore
 * .coalesce's reads, as two buffers of int64: reads, 4 a read (chunk, offset, length,
 * number of members), in the order of their first sample in sids; members, the sample ids
 * of each read in turn (in chunk order). chunk (uint32), offset and size (uint64): the
 * index's arrays. */
static PyObject *plan(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *sids_obj, *chunk_obj, *offset_obj, *size_obj;
    long long max_gap, max_read;
    if (!PyArg_ParseTuple(args, "OOOOLL:plan", &sids_obj, &chunk_obj, &offset_obj, &size_obj,
                          &max_gap, &max_read))
        return NULL;
    PyObject *out = NULL, *reads_b = NULL, *members_b = NULL;
    place_t *keys = NULL;
    plan_read_t *reads = NULL;
    array_t chunk = {0}, offset = {0}, size = {0};
    int got = 0;
    PyObject *sids = PySequence_Fast(sids_obj, "plan: sids must be a sequence");
    if (sids == NULL)
        return NULL;
    if (get_array(chunk_obj, &chunk, 4, "plan: chunk") < 0)
        goto done;
    got = 1;
    if (get_array(offset_obj, &offset, 8, "plan: offset") < 0)
        goto done;
    got = 2;
    if (get_array(size_obj, &size, 8, "plan: size") < 0)
        goto done;
    got = 3;
    if (chunk.n != offset.n || chunk.n != size.n) {
        PyErr_SetString(PyExc_ValueError, "plan: the index's arrays differ in length");
        goto done;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(sids);
    keys = malloc((size_t)(n ? n : 1) * sizeof(place_t));
    reads = malloc((size_t)(n ? n : 1) * sizeof(plan_read_t));
    if (keys == NULL || reads == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        long long sid = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(sids, i));
        if (sid == -1 && PyErr_Occurred())
            goto done;
        if (sid < 0 || sid >= chunk.n) {
            PyErr_Format(PyExc_IndexError, "plan: sample %lld is not in the index", sid);
            goto done;
        }
        keys[i] = (place_t){U32(chunk, sid), U64(offset, sid), sid, i};
    }
    /* each sample once, at its first position */
    qsort(keys, (size_t)n, sizeof(place_t), by_sid);
    Py_ssize_t m = 0;
    for (Py_ssize_t i = 0; i < n; i++)
        if (m == 0 || keys[m - 1].sid != keys[i].sid)
            keys[m++] = keys[i];
    qsort(keys, (size_t)m, sizeof(place_t), by_place);
    Py_ssize_t r = 0;
    int64_t wanted = 0;
    for (Py_ssize_t i = 0; i < m; i++) {
        int64_t k = (int64_t)keys[i].chunk, off = (int64_t)keys[i].offset;
        int64_t sz = (int64_t)U64(size, keys[i].sid);
        if (r) {
            plan_read_t *p = &reads[r - 1];
            int64_t length = off + sz - p->offset > p->length ? off + sz - p->offset : p->length;
            if (p->chunk == k && off - (p->offset + p->length) <= max_gap && length <= max_read
                    && length <= 2 * (wanted + sz)) {
                p->length = length;
                p->n++;
                if (keys[i].pos < p->pos)
                    p->pos = keys[i].pos;
                wanted += sz;
                continue;
            }
        }
        reads[r++] = (plan_read_t){k, off, sz, i, 1, keys[i].pos};
        wanted = sz;
    }
    qsort(reads, (size_t)r, sizeof(plan_read_t), by_pos);
    reads_b = PyBytes_FromStringAndSize(NULL, r * 4 * (Py_ssize_t)sizeof(int64_t));
    members_b = PyBytes_FromStringAndSize(NULL, m * (Py_ssize_t)sizeof(int64_t));
    if (reads_b == NULL || members_b == NULL)
        goto done;
    int64_t *ro = (int64_t *)PyBytes_AS_STRING(reads_b), *mo = (int64_t *)PyBytes_AS_STRING(members_b);
    for (Py_ssize_t i = 0; i < r; i++) {
        ro[4 * i] = reads[i].chunk;
        ro[4 * i + 1] = reads[i].offset;
        ro[4 * i + 2] = reads[i].length;
        ro[4 * i + 3] = reads[i].n;
        for (int64_t j = 0; j < reads[i].n; j++)
            *mo++ = keys[reads[i].first + j].sid;
    }
    out = PyTuple_Pack(2, reads_b, members_b);
done:
    Py_XDECREF(reads_b);
    Py_XDECREF(members_b);
    free(keys);
    free(reads);
    if (got > 2)
        PyBuffer_Release(&size.view);
    if (got > 1)
        PyBuffer_Release(&offset.view);
    if (got > 0)
        PyBuffer_Release(&chunk.view);
    Py_DECREF(sids);
    return out;
}

/* read_group(reads, members, start, mstart, chunks, fds, offset, size, checksum, least=-1,
 *            budget_us=0, advise_from=-1) -> (made, reads ok, bytes, values, failed, bad)
 *   reads, members: plan()'s buffers; the group reads from read `start` on (its members
 *   from `mstart` on); chunks, fds: int64, the chunks of those reads (ascending) and each
 *   one's file (-1: not open); offset, size,
 *   checksum: the index's uint64 arrays. First, without the GIL as the rest:
 *   posix_fadvise(WILLNEED) for each read from advise_from on (-1: none; not the empty
 *   ones, whose length 0 would mean the chunk's rest). Then the reads are made in order,
 *   each checked as soon as it is read; after `least` of them (-1: all), the call returns
 *   once it has taken budget_us microseconds.
 *   made: the reads made (start .. start + made - 1); reads ok, bytes: those that did not
 *   fail and the bytes they brought; values: for each of their members in turn, its bytes
 *   if they match its checksum, else -1 for a mismatch, or the number of its bytes the
 *   file held (a short read), or None (its read failed, or its chunk is not open); failed:
 *   (read, errno) of each read that failed, errno 0 for one whose chunk is not open; bad:
 *   how many of values are not bytes. */
static PyObject *read_group(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *reads_obj, *members_obj, *chunks_obj, *fds_obj, *offset_obj, *size_obj, *sum_obj;
    Py_ssize_t start, mstart, least = -1, advise_from = -1;
    long long budget_us = 0;
    if (!PyArg_ParseTuple(args, "OOnnOOOOO|nLn:read_group", &reads_obj, &members_obj, &start,
                          &mstart, &chunks_obj, &fds_obj, &offset_obj, &size_obj, &sum_obj,
                          &least, &budget_us, &advise_from))
        return NULL;
    array_t arr[7] = {{{0}}};
    PyObject *objs[7] = {reads_obj, members_obj, chunks_obj, fds_obj, offset_obj, size_obj, sum_obj};
    const char *names[7] = {"reads", "members", "chunks", "fds", "offset", "size", "checksum"};
    int got = 0;
    PyObject *out = NULL, *values = NULL, *failed = NULL;
    read_t *rs = NULL;
    member_t *ms = NULL;
    PyObject **bufs = NULL;
    char *scratch = NULL;
    for (; got < 7; got++)
        if (get_array(objs[got], &arr[got], 8, names[got]) < 0)
            goto done;
    array_t reads = arr[0], members = arr[1], chunks = arr[2], fds = arr[3], offset = arr[4],
            size = arr[5], sums = arr[6];
    if (reads.n % 4 || offset.n != size.n || offset.n != sums.n || chunks.n != fds.n) {
        PyErr_SetString(PyExc_ValueError, "read_group: malformed reads or index arrays");
        goto done;
    }
    Py_ssize_t nreads = reads.n / 4;
    if (start < 0 || start > nreads || mstart < 0 || mstart > members.n) {
        PyErr_SetString(PyExc_ValueError, "read_group: start out of range");
        goto done;
    }
    Py_ssize_t count = nreads - start, mcount = 0;
    for (Py_ssize_t i = start; i < nreads; i++)
        mcount += I64(reads, 4 * i + 3);
    if (mcount > members.n - mstart) {
        PyErr_SetString(PyExc_ValueError, "read_group: the reads name more members than there are");
        goto done;
    }
    rs = calloc((size_t)(count ? count : 1), sizeof(read_t));
    ms = calloc((size_t)(mcount ? mcount : 1), sizeof(member_t));
    bufs = calloc((size_t)(mcount ? mcount : 1), sizeof(PyObject *));
    scratch = malloc(SCRATCH);
    if (rs == NULL || ms == NULL || bufs == NULL || scratch == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    Py_ssize_t j = 0; /* members, from mstart */
    for (Py_ssize_t i = 0; i < count; i++) {
        read_t *r = &rs[i];
        const int64_t *t = &I64(reads, 4 * (start + i));
        Py_ssize_t lo = 0, hi = chunks.n; /* (its chunk among chunks: a binary search) */
        while (lo < hi) {
            Py_ssize_t mid = lo + (hi - lo) / 2;
            if (I64(chunks, mid) < t[0])
                lo = mid + 1;
            else
                hi = mid;
        }
        if (lo == chunks.n || I64(chunks, lo) != t[0] || t[1] < 0 || t[2] < 0 || t[3] < 0) {
            PyErr_SetString(PyExc_ValueError, "read_group: a read's chunk is not among chunks, or its offset or length is out of range");
            goto done;
        }
        r->fd = (int)I64(fds, lo);
        r->offset = t[1];
        r->length = t[2];
        r->n = t[3];
        r->members = &ms[j];
        Py_ssize_t end = 0;
        for (Py_ssize_t q = 0; q < r->n; q++, j++) {
            int64_t sid = I64(members, mstart + j);
            if (sid < 0 || sid >= offset.n) {
                PyErr_Format(PyExc_IndexError, "read_group: sample %lld is not in the index", (long long)sid);
                goto done;
            }
            member_t *m = &ms[j];
            m->rel = (Py_ssize_t)((int64_t)U64(offset, sid) - r->offset);
            m->size = (Py_ssize_t)U64(size, sid);
            m->sum = U64(sums, sid);
            if ((m->size > 0 && m->rel < end) || m->rel < 0 || m->size < 0 || m->rel + m->size > r->length) {
                PyErr_SetString(PyExc_ValueError, "read_group: members overlap or leave the read");
                goto done;
            }
            if (m->size > 0)
                end = m->rel + m->size;
            if (r->fd >= 0) {
                bufs[j] = PyBytes_FromStringAndSize(NULL, m->size);
                if (bufs[j] == NULL)
                    goto done;
                m->buf = PyBytes_AS_STRING(bufs[j]);
            }
        }
    }

    Py_ssize_t made = 0;
    Py_BEGIN_ALLOW_THREADS
    if (advise_from >= 0)
        for (Py_ssize_t i = advise_from > start ? advise_from - start : 0; i < count; i++)
            if (rs[i].fd >= 0 && rs[i].length > 0)
                (void)posix_fadvise(rs[i].fd, (off_t)rs[i].offset, (off_t)rs[i].length, POSIX_FADV_WILLNEED);
    long long t0 = now_us();
    while (made < count) {
        if (rs[made].fd >= 0) {
            do_read(&rs[made], scratch);
            verify(&rs[made]);
        }
        made++;
        if (least >= 0 && made >= least && now_us() - t0 >= budget_us)
            break;
    }
    Py_END_ALLOW_THREADS

    Py_ssize_t ok = 0, nmade = 0, bad = 0;
    long long nbytes = 0;
    for (Py_ssize_t i = 0; i < made; i++)
        nmade += rs[i].n;
    values = PyList_New(nmade);
    failed = PyList_New(0);
    if (values == NULL || failed == NULL)
        goto done;
    j = 0;
    for (Py_ssize_t i = 0; i < made; i++) {
        read_t *r = &rs[i];
        int bad_read = r->fd < 0 || r->error;
        if (bad_read) {
            PyObject *f = Py_BuildValue("(ni)", start + i, r->fd < 0 ? 0 : r->error);
            if (f == NULL || PyList_Append(failed, f) < 0) {
                Py_XDECREF(f);
                goto done;
            }
            Py_DECREF(f);
        } else {
            ok++;
            nbytes += r->got;
        }
        for (Py_ssize_t q = 0; q < r->n; q++, j++) {
            member_t *m = &r->members[q];
            PyObject *v;
            if (bad_read) {
                v = Py_None;
                Py_INCREF(v);
            } else if (m->rel + m->size > r->got) {
                v = PyLong_FromSsize_t(r->got > m->rel ? r->got - m->rel : 0);
            } else if (m->buf == NULL) {
                v = PyLong_FromLong(-1);
            } else {
                v = bufs[j];
                bufs[j] = NULL; /* (the list takes it) */
            }
            if (v == NULL)
                goto done;
            bad += !PyBytes_CheckExact(v);
            PyList_SET_ITEM(values, j, v);
        }
    }
    out = Py_BuildValue("(nnLOOn)", made, ok, nbytes, values, failed, bad);
done:
    if (bufs != NULL) {
        for (Py_ssize_t i = 0; i < mcount; i++)
            Py_XDECREF(bufs[i]);
        free(bufs);
    }
    free(ms);
    free(rs);
    free(scratch);
    Py_XDECREF(values);
    Py_XDECREF(failed);
    while (got > 0)
        PyBuffer_Release(&arr[--got].view);
    return out;
}

static PyMethodDef methods[] = {
    {"plan", plan, METH_VARARGS,
     "plan(sids, chunk, offset, size, max_gap, max_read) -> (reads, members): a batch's "
     "coalesced reads as int64 buffers (see the module's source)."},
    {"read_group", read_group, METH_VARARGS,
     "read_group(reads, members, start, mstart, chunks, fds, offset, size, checksum, least=-1, "
     "budget_us=0, advise_from=-1) -> (made, reads ok, bytes, values, failed, bad): a group of "
     "a batch's reads and checksums without the GIL (see the module's source)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "fusefs._fetchio",
                                    "A fetch batch's reads and checksums without the GIL.", -1,
                                    methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__fetchio(void) { return PyModule_Create(&module); }
