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
#include <pthread.h>
#include <unistd.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/uio.h>
#include <time.h>

#include "_missapi.h"
#include "_publishapi.h"

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

/* A fetch's publishing to the fast path (read_group's publish): per member of the group, whether
 * the fast path is to hold it (serve), whether the reference the caller took for the fast path
 * is still the caller's (taken), and what the fast path let go of (old). */
typedef struct {
    const fusefs_publish_api *api;
    unsigned char *serve, *taken;
    void **old;
} publish_t;

/* (without the GIL) Read r, just made and checked (its members from j0 on, their objects
 * bufs), published: each clean member held (serve) or handed to the reads that wait for it. */
static void publish_read(publish_t *p, const read_t *r, Py_ssize_t j0, PyObject **bufs,
                         const array_t *members, Py_ssize_t mstart) {
    if (r->fd < 0 || r->error)
        return;
    for (Py_ssize_t q = 0; q < r->n; q++) {
        const member_t *m = &r->members[q];
        Py_ssize_t j = j0 + q;
        if (m->buf == NULL || m->rel + m->size > r->got || bufs[j] == NULL)
            continue; /* (a mismatch, a short read: the loop's) */
        uint64_t sid = (uint64_t)I64(*members, mstart + j);
        if (p->serve[j]) {
            p->api->hold_nogil(sid, bufs[j], m->buf, (uint64_t)m->size, &p->old[j]);
            p->taken[j] = 0;
        } else {
            p->api->hand_nogil(sid, m->buf, (uint64_t)m->size);
        }
    }
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
 *   how many of values are not bytes.
 *   publish: None, or (capsule, served): the fast path's (pyfuse3.fast_path_publish_api(),
 *   fusefs/_publishapi.h) and the samples of the batch it is to hold (int64, ascending): as
 *   each read is checked, without the GIL, its clean samples are published there (those of
 *   served held, the others handed to the reads that wait for them) and those reads
 *   answered, not at the group's end. */
static PyObject *read_group(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *reads_obj, *members_obj, *chunks_obj, *fds_obj, *offset_obj, *size_obj, *sum_obj;
    PyObject *publish = Py_None;
    Py_ssize_t start, mstart, least = -1, advise_from = -1;
    long long budget_us = 0;
    if (!PyArg_ParseTuple(args, "OOnnOOOOO|nLnO:read_group", &reads_obj, &members_obj, &start,
                          &mstart, &chunks_obj, &fds_obj, &offset_obj, &size_obj, &sum_obj,
                          &least, &budget_us, &advise_from, &publish))
        return NULL;
    const fusefs_publish_api *api = NULL;
    array_t served = {{0}};
    if (publish != Py_None) {
        PyObject *capsule, *served_obj;
        if (!PyArg_ParseTuple(publish, "OO:read_group's publish", &capsule, &served_obj))
            return NULL;
        api = PyCapsule_GetPointer(capsule, FUSEFS_PUBLISH_API);
        if (api == NULL)
            return NULL;
        if (api->version != FUSEFS_PUBLISH_API_VERSION) {
            PyErr_SetString(PyExc_RuntimeError, "read_group: the binding's publish API is not this module's version");
            return NULL;
        }
        if (get_array(served_obj, &served, 8, "served") < 0)
            return NULL;
    }
    array_t arr[7] = {{{0}}};
    PyObject *objs[7] = {reads_obj, members_obj, chunks_obj, fds_obj, offset_obj, size_obj, sum_obj};
    const char *names[7] = {"reads", "members", "chunks", "fds", "offset", "size", "checksum"};
    int got = 0;
    PyObject *out = NULL, *values = NULL, *failed = NULL;
    read_t *rs = NULL;
    member_t *ms = NULL;
    PyObject **bufs = NULL;
    char *scratch = NULL;
    publish_t pub = {api, NULL, NULL, NULL};
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

    if (api != NULL) { /* (the fast path's references to the samples it is to hold: taken now) */
        pub.serve = calloc((size_t)(mcount ? mcount : 1), 1);
        pub.taken = calloc((size_t)(mcount ? mcount : 1), 1);
        pub.old = calloc((size_t)(mcount ? mcount : 1), sizeof(void *));
        if (pub.serve == NULL || pub.taken == NULL || pub.old == NULL) {
            PyErr_NoMemory();
            goto done;
        }
        for (Py_ssize_t k = 0; k < mcount; k++) {
            if (bufs[k] == NULL)
                continue;
            int64_t sid = I64(members, mstart + k);
            Py_ssize_t lo = 0, hi = served.n; /* (sid among served: a binary search) */
            while (lo < hi) {
                Py_ssize_t mid = lo + (hi - lo) / 2;
                if (I64(served, mid) < sid)
                    lo = mid + 1;
                else
                    hi = mid;
            }
            if (lo < served.n && I64(served, lo) == sid) {
                pub.serve[k] = pub.taken[k] = 1;
                Py_INCREF(bufs[k]);
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
            if (api != NULL) /* (its readers answered now, not at the group's end) */
                publish_read(&pub, &rs[made], rs[made].members - ms, bufs, &members, mstart);
        }
        made++;
        if (least >= 0 && made >= least && now_us() - t0 >= budget_us)
            break;
    }
    Py_END_ALLOW_THREADS
    if (api != NULL) /* (the references the fast path did not take, and those it let go of) */
        for (Py_ssize_t k = 0; k < mcount; k++) {
            if (pub.taken[k])
                Py_DECREF(bufs[k]);
            if (pub.old[k] != NULL)
                api->let_go(pub.old[k]);
        }

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
    free(pub.serve);
    free(pub.taken);
    free(pub.old);
    if (api != NULL)
        PyBuffer_Release(&served.view);
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

/* ---- the miss engine: Misses ----
 * Reader threads a lane (a storage node's: fusefs/_missapi.h; as many as the fetches a node
 * has in flight) take the misses the fast path queued on their lane (one reader all there
 * is while the node answers quickly, a share each while it is slow: the binding's take),
 * read them (coalesced as plan()'s reads are, the backend told of the later reads at once
 * (WILLNEED), into a buffer the reader keeps and reuses, at most MISS_ARENA: no allocation
 * a sample once it has grown), check their checksums and answer the reads that wait from
 * the buffer, all without the GIL and without fusefs's loop. Whatever is not a clean read
 * goes to the loop as without the engine (done(sid, NULL)), which reads the sample itself and reports it as it does: a
 * checksum mismatch (the sample is then never read here again), a short read, a sample over
 * MISS_BIG, a read that failed (the chunk's descriptor is closed: the chunk's later misses
 * go to the loop too, which opens it again and waits for its node within the user's bound).
 * The descriptors are the engine's own (duplicated from the caller's at its start). */
#define MISS_BATCH 64         /* the misses a reader takes at most at once */
#define MISS_ARENA (2 << 20)  /* a reader's buffer at most: a batch is read in rounds that fit
                                 * (a whole read of a sample is one request of at most 1 MiB) */
#define MISS_BIG MISS_ARENA   /* a sample larger than this goes to the loop */

typedef struct Misses Misses;

typedef struct {
    Misses *m;
    int lane;
    pthread_t thread;
} lane_reader_t;

struct Misses {
    PyObject_HEAD
    PyObject *capsule;
    const fusefs_miss_api *api;
    array_t chunk, offset, size, sum;  /* the index's arrays (uint32, uint64 x 3) */
    int *fds;                          /* per chunk (-1: to the loop), under fd_lock */
    Py_ssize_t nchunks;
    pthread_mutex_t fd_lock;
    unsigned char *bad;                /* per sample: a mismatch was found (to the loop) */
    long long max_gap, max_read;
    int nlanes, per_lane, willneed, running;
    lane_reader_t *readers;           /* per_lane of them a lane */
    unsigned long long fetched, bytes, reads, to_loop;  /* (atomic) */
};

static int miss_fd(Misses *m, uint64_t chunk) {
    int fd;
    pthread_mutex_lock(&m->fd_lock);
    fd = (Py_ssize_t)chunk < m->nchunks ? m->fds[chunk] : -1;
    pthread_mutex_unlock(&m->fd_lock);
    return fd;
}

/* A read of chunk's descriptor fd failed: the chunk's misses go to the loop from now on. */
static void miss_retire(Misses *m, uint64_t chunk, int fd) {
    pthread_mutex_lock(&m->fd_lock);
    if (m->fds[chunk] == fd) {
        m->fds[chunk] = -1;
        close(fd);
    }
    pthread_mutex_unlock(&m->fd_lock);
}

/* Read places[0..k) (sorted by place; their bytes fit in arena) coalesced, and answer
 * each sample's reads from its bytes, or hand them to the loop; the reads made and the
 * microseconds they took added to *nreads and *read_us. */
static void miss_round(Misses *m, const place_t *places, size_t k, char *arena, char *scratch,
                       long long *nreads, long long *read_us) {
    const fusefs_miss_api *api = m->api;
    uint64_t rchunk[MISS_BATCH], msid[MISS_BATCH];
    member_t members[MISS_BATCH];
    read_t reads[MISS_BATCH];
    size_t nr = 0;
    char *p = arena;
    for (size_t j = 0; j < k; j++) {
        uint64_t sid = (uint64_t)places[j].sid, chunk = places[j].chunk;
        long long off = (long long)places[j].offset;
        Py_ssize_t sz = (Py_ssize_t)U64(m->size, sid);
        read_t *r = nr ? &reads[nr - 1] : NULL;
        if (r == NULL || rchunk[nr - 1] != chunk || off < r->offset + r->length
                || off - (r->offset + r->length) > m->max_gap || off + sz - r->offset > m->max_read) {
            r = &reads[nr];
            rchunk[nr++] = chunk;
            *r = (read_t){.fd = miss_fd(m, chunk), .offset = off, .members = &members[j]};
        }
        members[j] = (member_t){.rel = off - r->offset, .size = sz, .sum = U64(m->sum, sid), .buf = p};
        msid[j] = sid;
        p += sz;
        r->n++;
        r->length = off + sz - r->offset;
    }
    if (m->willneed)  /* (the backend's client fetches the later reads while the first is made) */
        for (size_t i = 1; i < nr; i++)
            if (reads[i].fd >= 0 && reads[i].length > 0)
                (void)posix_fadvise(reads[i].fd, (off_t)reads[i].offset, (off_t)reads[i].length,
                                    POSIX_FADV_WILLNEED);
    for (size_t i = 0; i < nr; i++) {
        read_t *r = &reads[i];
        size_t first = (size_t)(r->members - members);
        if (r->fd >= 0) {
            long long t = now_us();
            do_read(r, scratch);
            *read_us += now_us() - t;
            ++*nreads;
            verify(r);
        } else {
            r->error = EBADF;
        }
        __atomic_add_fetch(&m->reads, 1, __ATOMIC_RELAXED);
        if (r->error && r->fd >= 0)
            miss_retire(m, rchunk[i], r->fd);
        for (Py_ssize_t j = 0; j < r->n; j++) {
            member_t *mb = &r->members[j];
            uint64_t sid = msid[first + (size_t)j];
            if (r->error || mb->rel + mb->size > r->got || mb->buf == NULL) {
                if (!r->error && mb->rel + mb->size <= r->got)
                    m->bad[sid] = 1;  /* (a mismatch: the loop reads it, finds it, says so) */
                api->done(sid, NULL, 0);
                __atomic_add_fetch(&m->to_loop, 1, __ATOMIC_RELAXED);
            } else {
                api->done(sid, mb->buf, (uint64_t)mb->size);
                __atomic_add_fetch(&m->fetched, 1, __ATOMIC_RELAXED);
                __atomic_add_fetch(&m->bytes, (unsigned long long)mb->size, __ATOMIC_RELAXED);
            }
        }
    }
}

static void *miss_reader(void *arg) {
    lane_reader_t *lr = arg;
    Misses *m = lr->m;
    const fusefs_miss_api *api = m->api;
    uint64_t sids[MISS_BATCH];
    place_t places[MISS_BATCH];
    char *arena = NULL, *scratch = malloc(SCRATCH);
    size_t arena_cap = 0, n;
    long long read_ns = 0;
    uint64_t nsamples = (uint64_t)m->offset.n;
    while ((n = api->take(lr->lane, sids, MISS_BATCH, read_ns)) > 0) {
        size_t k = 0;
        long long nreads = 0, read_us = 0;
        for (size_t i = 0; i < n; i++) {
            uint64_t sid = sids[i];
            if (scratch == NULL || sid >= nsamples || m->bad[sid] || U64(m->size, sid) > MISS_BIG
                    || miss_fd(m, U32(m->chunk, sid)) < 0) {
                api->done(sid, NULL, 0);
                __atomic_add_fetch(&m->to_loop, 1, __ATOMIC_RELAXED);
                continue;
            }
            places[k++] = (place_t){U32(m->chunk, sid), U64(m->offset, sid), (int64_t)sid, (int64_t)i};
        }
        qsort(places, k, sizeof *places, by_place);
        for (size_t j0 = 0, j1; j0 < k; j0 = j1) {  /* (rounds whose bytes fit in MISS_ARENA) */
            size_t bytes = 0;
            for (j1 = j0; j1 < k && bytes + U64(m->size, places[j1].sid) <= MISS_ARENA; j1++)
                bytes += U64(m->size, places[j1].sid);
            if (bytes > arena_cap) {
                size_t cap = 2 * arena_cap > bytes ? 2 * arena_cap : bytes;
                free(arena);
                arena_cap = cap < MISS_ARENA ? cap : MISS_ARENA;
                arena = malloc(arena_cap);
            }
            if (arena == NULL) {
                arena_cap = 0;
                for (size_t j = j0; j < j1; j++)
                    api->done((uint64_t)places[j].sid, NULL, 0);
                __atomic_add_fetch(&m->to_loop, j1 - j0, __ATOMIC_RELAXED);
                continue;
            }
            miss_round(m, places + j0, j1 - j0, arena, scratch, &nreads, &read_us);
        }
        read_ns = 1000 * read_us / (nreads ? nreads : 1) + 1;  /* (a read's mean; at least 1) */
    }
    free(arena);
    free(scratch);
    return NULL;
}

static int Misses_init(Misses *m, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"api", "chunk", "offset", "size", "checksum", "fds", "lanes", "max_gap",
                             "max_read", "per_lane", "willneed", NULL};
    PyObject *capsule, *chunk, *offset, *size, *sum, *fds;
    int nlanes, per_lane = 1, willneed = 0;
    long long max_gap, max_read;
    if (m->capsule != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "Misses: initialised already");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOOOOiLL|ip:Misses", kwlist, &capsule, &chunk, &offset,
                                     &size, &sum, &fds, &nlanes, &max_gap, &max_read, &per_lane, &willneed))
        return -1;
    const fusefs_miss_api *api = PyCapsule_GetPointer(capsule, FUSEFS_MISS_API);
    if (api == NULL)
        return -1;
    if (api->version != FUSEFS_MISS_API_VERSION) {
        PyErr_Format(PyExc_RuntimeError, "Misses: the binding's miss API is version %d, not %d",
                     api->version, FUSEFS_MISS_API_VERSION);
        return -1;
    }
    if (nlanes < 1 || nlanes > FUSEFS_MISS_LANES || per_lane < 1 || per_lane > 64 || max_gap < 0
            || max_read < 1) {
        PyErr_SetString(PyExc_ValueError, "Misses: lanes or per_lane out of 1..64, or a bad max_gap or max_read");
        return -1;
    }
    array_t fd_arr;
    if (get_array(chunk, &m->chunk, 4, "chunk") < 0)
        return -1;
    if (get_array(offset, &m->offset, 8, "offset") < 0 || get_array(size, &m->size, 8, "size") < 0
            || get_array(sum, &m->sum, 8, "checksum") < 0 || get_array(fds, &fd_arr, 8, "fds") < 0)
        return -1;  /* (Misses_dealloc releases what was got) */
    if (m->chunk.n != m->offset.n || m->size.n != m->offset.n || m->sum.n != m->offset.n) {
        PyBuffer_Release(&fd_arr.view);
        PyErr_SetString(PyExc_ValueError, "Misses: the index's arrays differ in length");
        return -1;
    }
    m->nchunks = fd_arr.n;
    m->fds = malloc(sizeof *m->fds * (size_t)(fd_arr.n ? fd_arr.n : 1));
    m->bad = calloc((size_t)(m->offset.n ? m->offset.n : 1), 1);
    m->readers = calloc((size_t)nlanes * (size_t)per_lane, sizeof *m->readers);
    if (m->fds == NULL || m->bad == NULL || m->readers == NULL) {
        PyBuffer_Release(&fd_arr.view);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t k = 0; k < fd_arr.n; k++) {
        int64_t fd = I64(fd_arr, k);
        m->fds[k] = fd < 0 || fd > INT32_MAX ? -1 : fcntl((int)fd, F_DUPFD_CLOEXEC, 3);
    }
    PyBuffer_Release(&fd_arr.view);
    for (Py_ssize_t i = 0; i < m->chunk.n; i++)
        if ((Py_ssize_t)U32(m->chunk, i) >= m->nchunks) {
            PyErr_SetString(PyExc_ValueError, "Misses: a sample's chunk has no descriptor entry");
            return -1;
        }
    pthread_mutex_init(&m->fd_lock, NULL);
    m->api = api;
    m->nlanes = nlanes;
    m->per_lane = per_lane;
    m->willneed = willneed;
    m->max_gap = max_gap;
    m->max_read = max_read;
    Py_INCREF(capsule);
    m->capsule = capsule;
    return 0;
}

/* start(): per_lane reader threads a lane. */
static PyObject *Misses_start(Misses *m, PyObject *unused) {
    (void)unused;
    if (m->api == NULL || m->running) {
        PyErr_SetString(PyExc_RuntimeError, "Misses.start: not initialised, or running");
        return NULL;
    }
    for (int i = 0; i < m->nlanes * m->per_lane; i++) {
        m->readers[i] = (lane_reader_t){.m = m, .lane = i / m->per_lane};
        int err = pthread_create(&m->readers[i].thread, NULL, miss_reader, &m->readers[i]);
        if (err) {
            m->running = i;  /* (join() waits for those started, once the binding stopped) */
            errno = err;
            return PyErr_SetFromErrno(PyExc_OSError);
        }
    }
    m->running = m->nlanes * m->per_lane;
    Py_RETURN_NONE;
}

/* join(timeout_s): wait for the readers (after the binding's stop: their take() ended),
 * each until timeout_s has passed; a reader still inside a read then (a node that does not
 * answer) is left to end by itself, with what it uses: True where all ended. */
static PyObject *Misses_join(Misses *m, PyObject *arg) {
    double timeout = PyFloat_AsDouble(arg);
    if (timeout == -1.0 && PyErr_Occurred())
        return NULL;
    int all = 1;
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_sec += (time_t)timeout;
    until.tv_nsec += (long)((timeout - (double)(time_t)timeout) * 1e9);
    if (until.tv_nsec >= 1000000000L) {
        until.tv_sec++;
        until.tv_nsec -= 1000000000L;
    }
    Py_BEGIN_ALLOW_THREADS
    for (int i = 0; i < m->running; i++) {
        if (pthread_timedjoin_np(m->readers[i].thread, NULL, &until) != 0) {
            pthread_detach(m->readers[i].thread);
            all = 0;
        }
    }
    Py_END_ALLOW_THREADS
    m->running = 0;
    if (!all)
        m->capsule = NULL;  /* (a reader left running keeps everything: nothing is freed) */
    return PyBool_FromLong(all);
}

static PyObject *Misses_counts(Misses *m, PyObject *unused) {
    (void)unused;
    return Py_BuildValue("{sKsKsKsK}", "fetched", __atomic_load_n(&m->fetched, __ATOMIC_RELAXED),
                         "bytes", __atomic_load_n(&m->bytes, __ATOMIC_RELAXED),
                         "reads", __atomic_load_n(&m->reads, __ATOMIC_RELAXED),
                         "to_loop", __atomic_load_n(&m->to_loop, __ATOMIC_RELAXED));
}

static void Misses_dealloc(Misses *m) {
    if (m->running || (m->api != NULL && m->capsule == NULL)) {
        /* readers that may still run (never joined, or left inside a read): keep it all */
        return;
    }
    if (m->fds != NULL) {
        for (Py_ssize_t k = 0; k < m->nchunks; k++)
            if (m->fds[k] >= 0)
                close(m->fds[k]);
        free(m->fds);
    }
    if (m->api != NULL)
        pthread_mutex_destroy(&m->fd_lock);
    free(m->bad);
    free(m->readers);
    array_t *arrays[4] = {&m->chunk, &m->offset, &m->size, &m->sum};
    for (int i = 0; i < 4; i++)
        if (arrays[i]->view.obj != NULL)
            PyBuffer_Release(&arrays[i]->view);
    Py_XDECREF(m->capsule);
    Py_TYPE(m)->tp_free((PyObject *)m);
}

static PyMethodDef Misses_methods[] = {
    {"start", (PyCFunction)Misses_start, METH_NOARGS, "Start per_lane reader threads a lane."},
    {"join", (PyCFunction)Misses_join, METH_O,
     "join(timeout_s) -> whether every reader ended (after the binding's fast_path_miss_stop)."},
    {"counts", (PyCFunction)Misses_counts, METH_NOARGS,
     "{fetched, bytes, reads, to_loop}: the misses answered here, their bytes, the reads made, "
     "the misses handed to the loop."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject MissesType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "fusefs._fetchio.Misses",
    .tp_basicsize = sizeof(Misses),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Misses(api, chunk, offset, size, checksum, fds, lanes, max_gap, max_read, per_lane=1, "
              "willneed=False): the miss engine's readers (per_lane threads a lane) over the "
              "index's arrays and the chunks' descriptors (duplicated; -1: that chunk's misses go "
              "to the loop); willneed: the backend is told of a batch's later reads at once.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Misses_init,
    .tp_dealloc = (destructor)Misses_dealloc,
    .tp_methods = Misses_methods,
};

static PyMethodDef methods[] = {
    {"plan", plan, METH_VARARGS,
     "plan(sids, chunk, offset, size, max_gap, max_read) -> (reads, members): a batch's "
     "coalesced reads as int64 buffers (see the module's source)."},
    {"read_group", read_group, METH_VARARGS,
     "read_group(reads, members, start, mstart, chunks, fds, offset, size, checksum, least=-1, "
     "budget_us=0, advise_from=-1, publish=None) -> (made, reads ok, bytes, values, failed, bad): a group of "
     "a batch's reads and checksums without the GIL (see the module's source)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "fusefs._fetchio",
                                    "A fetch batch's reads and checksums without the GIL.", -1,
                                    methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__fetchio(void) {
    if (PyType_Ready(&MissesType) < 0)
        return NULL;
    PyObject *mod = PyModule_Create(&module);
    if (mod == NULL)
        return NULL;
    /* (what a reader's buffers take at most: misses.MissEngine.buffer_bytes) */
    if (PyModule_AddIntConstant(mod, "MISS_BUFFERS", MISS_ARENA + SCRATCH) < 0) {
        Py_DECREF(mod);
        return NULL;
    }
    Py_INCREF(&MissesType);
    if (PyModule_AddObject(mod, "Misses", (PyObject *)&MissesType) < 0) {
        Py_DECREF(&MissesType);
        Py_DECREF(mod);
        return NULL;
    }
    return mod;
}
