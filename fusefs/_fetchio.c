/* fusefs._fetchio: the backend reads of a fetch batch, checksums included, in one call that
 * runs without the GIL (store.ChunkStore uses it when it is built; see setup.py).
 *
 * In Python, each pread and each push of a fetched sample releases and retakes the GIL:
 * with the event loop and several fetch threads wanting it, every such hand-off costs
 * futex wakeups and context switches (docs/HOTPATH.md counts them). Here a batch's reads (preadv straight into
 * each sample's own bytes object, gaps into a scratch buffer) and their xxh3-64 checks
 * run in one stretch without it.
 *
 * read_verified(reads, least=-1, budget_us=0) -> list
 *   reads: a list of (fd, offset, length, members), members a list of
 *          (relative offset, size, checksum) within length, those that are not empty in
 *          increasing relative offset and not overlapping.
 *   The reads are made in order, each checked as soon as it is read (its bytes are still
 *   in the CPU's caches). After `least` of them (-1: all), the call returns once it has
 *   taken budget_us microseconds: the result lists the reads made, a prefix of reads.
 *   For each read made: an int errno if the read failed, else (bytes read, entries) with
 *   one entry per member: its bytes if they match the checksum, else an int: -1 for a
 *   checksum mismatch, or the number of its bytes the file held (a short read).
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

static void free_reads(read_t *reads, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++)
        free(reads[i].members);
    free(reads);
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

static PyObject *read_verified(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *arg;
    Py_ssize_t least = -1;
    long long budget_us = 0;
    if (!PyArg_ParseTuple(args, "O|nL:read_verified", &arg, &least, &budget_us))
        return NULL;
    PyObject *list = PySequence_Fast(arg, "read_verified: reads must be a list");
    if (list == NULL)
        return NULL;
    Py_ssize_t nreads = PySequence_Fast_GET_SIZE(list);
    read_t *reads = calloc((size_t)(nreads ? nreads : 1), sizeof(read_t));
    PyObject *bufs = PyList_New(0); /* every member's bytes object, in order */
    PyObject *out = NULL;
    char *scratch = NULL;
    if (reads == NULL || bufs == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < nreads; i++) {
        read_t *r = &reads[i];
        PyObject *members;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(list, i), "iLnO", &r->fd, &r->offset,
                              &r->length, &members))
            goto done;
        PyObject *ms = PySequence_Fast(members, "read_verified: members must be a list");
        if (ms == NULL)
            goto done;
        r->n = PySequence_Fast_GET_SIZE(ms);
        r->members = calloc((size_t)(r->n ? r->n : 1), sizeof(member_t));
        if (r->members == NULL) {
            Py_DECREF(ms);
            PyErr_NoMemory();
            goto done;
        }
        Py_ssize_t end = 0;
        for (Py_ssize_t j = 0; j < r->n; j++) {
            member_t *m = &r->members[j];
            unsigned long long sum;
            if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(ms, j), "nnK", &m->rel, &m->size, &sum)) {
                Py_DECREF(ms);
                goto done;
            }
            m->sum = sum;
            if ((m->size > 0 && m->rel < end) || m->rel < 0 || m->size < 0 ||
                m->rel + m->size > r->length) {
                Py_DECREF(ms);
                PyErr_SetString(PyExc_ValueError, "read_verified: members overlap or leave the read");
                goto done;
            }
            if (m->size > 0)
                end = m->rel + m->size;
            PyObject *b = PyBytes_FromStringAndSize(NULL, m->size);
            if (b == NULL || PyList_Append(bufs, b) < 0) {
                Py_XDECREF(b);
                Py_DECREF(ms);
                goto done;
            }
            Py_DECREF(b); /* (bufs holds it) */
            m->buf = PyBytes_AS_STRING(b);
        }
        Py_DECREF(ms);
    }
    scratch = malloc(SCRATCH);
    if (scratch == NULL) {
        PyErr_NoMemory();
        goto done;
    }

    Py_ssize_t made = 0;
    Py_BEGIN_ALLOW_THREADS
    long long start = now_us();
    while (made < nreads) {
        do_read(&reads[made], scratch);
        verify(&reads[made]);
        made++;
        if (least >= 0 && made >= least && now_us() - start >= budget_us)
            break;
    }
    Py_END_ALLOW_THREADS

    out = PyList_New(made);
    if (out == NULL)
        goto done;
    Py_ssize_t k = 0; /* position in bufs */
    for (Py_ssize_t i = 0; i < made; i++) {
        read_t *r = &reads[i];
        PyObject *item;
        if (r->error) {
            item = PyLong_FromLong(r->error);
        } else {
            item = PyList_New(r->n);
            for (Py_ssize_t j = 0; item != NULL && j < r->n; j++) {
                member_t *m = &r->members[j];
                PyObject *v;
                if (m->rel + m->size > r->got) {
                    Py_ssize_t held = r->got > m->rel ? r->got - m->rel : 0;
                    v = PyLong_FromSsize_t(held);
                } else if (m->buf == NULL) {
                    v = PyLong_FromLong(-1);
                } else {
                    v = PyList_GET_ITEM(bufs, k + j);
                    Py_INCREF(v);
                }
                if (v == NULL) {
                    Py_CLEAR(item);
                    break;
                }
                PyList_SET_ITEM(item, j, v);
            }
        }
        k += r->n;
        if (item != NULL && !r->error)
            item = Py_BuildValue("(nN)", r->got, item);
        if (item == NULL) {
            Py_CLEAR(out);
            goto done;
        }
        PyList_SET_ITEM(out, i, item);
    }

done:
    free(scratch);
    if (reads != NULL)
        free_reads(reads, nreads);
    Py_XDECREF(bufs);
    Py_DECREF(list);
    return out;
}

/* willneed(reads): posix_fadvise(fd, offset, length, WILLNEED) for each (fd, offset, length)
 * of reads, all in one stretch without the GIL (in Python each call releases and retakes it:
 * a hand-off per read of a batch). A hint: failures are ignored. */
static PyObject *willneed(PyObject *self, PyObject *arg) {
    (void)self;
    PyObject *list = PySequence_Fast(arg, "willneed: reads must be a list");
    if (list == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(list);
    struct advice {
        int fd;
        long long offset, length;
    } *advice = malloc((size_t)(n ? n : 1) * sizeof(struct advice));
    if (advice == NULL) {
        Py_DECREF(list);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(list, i), "iLL", &advice[i].fd,
                              &advice[i].offset, &advice[i].length)) {
            free(advice);
            Py_DECREF(list);
            return NULL;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++)
        (void)posix_fadvise(advice[i].fd, (off_t)advice[i].offset, (off_t)advice[i].length,
                            POSIX_FADV_WILLNEED);
    Py_END_ALLOW_THREADS
    free(advice);
    Py_DECREF(list);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"willneed", willneed, METH_O,
     "willneed(reads): posix_fadvise WILLNEED each (fd, offset, length) without the GIL."},
    {"read_verified", read_verified, METH_VARARGS,
     "read_verified(reads, least=-1, budget_us=0) -> list: a batch's reads and checksums "
     "without the GIL, all of them or from `least` on until budget_us has passed (see the "
     "module's source)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "fusefs._fetchio",
                                    "A fetch batch's reads and checksums without the GIL.", -1,
                                    methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__fetchio(void) { return PyModule_Create(&module); }
