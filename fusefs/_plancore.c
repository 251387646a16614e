/* fusefs._plancore: a plan's counting of a batch of uses, a group's next positions and the
 * read-ahead's walk, in C (plan.Plan.use_many, positions_of, ahead).
 *
 * The fast path's releases reach the loop in batches; each released sample's use moves its
 * plan on: its next occurrence marked consumed, its use counted, the frontier and the cursor
 * moved (occurrences passed unused taken as skipped), and where it is needed next returned
 * for the cache's re-key. In Python that was about 150 opcodes a sample on the loop
 * (docs/HOTPATH.md, "Per sample on the loop"); here it is one call a batch, over the plan's
 * own numpy arrays (no copy), with the GIL (the loop's). So is where each of a group of
 * samples is needed next (the cache's keys under one order: the read-ahead's reservations,
 * a fetched group's puts), and the read-ahead's walk through the orders past what is
 * consumed, in flight, queued, cached or the kernel's (a run of up to 64 samples a call).
 * plan.Plan.use and position_of are the one-sample references, and a walk in Python the
 * read-ahead's: tests/test_order.py holds each pair to the same results. The read-ahead's
 * queues are here too (Queues: a node's queue a linked list over arrays of the data set's
 * size; its batches dealt in one call), held by tests/test_readahead_plan.py to queues of
 * Python's. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { USES, TOTAL, BY_SAMPLE, FIRST, CONSUMED, NEXT_FIRST, WAS_PASSED, IDS, NARRAYS };

static const struct {
    const char *name;
    Py_ssize_t itemsize;
    int writable;
} arrays[NARRAYS] = {
    {"uses", 4, 1}, {"total", 4, 0}, {"by_sample", 4, 0}, {"first", 4, 0},
    {"consumed", 1, 1}, {"next_first", 4, 0}, {"was_passed", 1, 1}, {"ids", 8, 0},
};

typedef struct {
    int32_t *uses;
    const int32_t *total, *by_sample, *first, *next_first;
    uint8_t *consumed, *was_passed;
    const int64_t *ids;
    Py_ssize_t n_files, n;
    long long cursor, frontier, skip_window, max_skip_window, skipped, late;
    PyObject *passed;
} plan_t;

typedef struct {
    Py_buffer views[NARRAYS];
    int got; /* views taken */
} views_t;

static void release(views_t *v) {
    for (int k = 0; k < v->got; k++)
        PyBuffer_Release(&v->views[k]);
    v->got = 0;
}

/* The plan's arrays (a tuple, in the order of `arrays`) read into p, the scalars left to the
 * caller: 0, or -1 with an exception (release(v) either way). */
static int get_plan(PyObject *tuple, views_t *v, plan_t *p) {
    v->got = 0;
    if (PyTuple_GET_SIZE(tuple) != NARRAYS) {
        PyErr_Format(PyExc_ValueError, "a plan's %d arrays expected", NARRAYS);
        return -1;
    }
    Py_buffer *views = v->views;
    for (int k = 0; k < NARRAYS; k++) {
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(tuple, k), &views[k],
                               PyBUF_C_CONTIGUOUS | (arrays[k].writable ? PyBUF_WRITABLE : 0)) < 0)
            return -1;
        v->got++;
        if (views[k].itemsize != arrays[k].itemsize) {
            PyErr_Format(PyExc_ValueError, "a plan's %s: %zd-byte items expected", arrays[k].name,
                         arrays[k].itemsize);
            return -1;
        }
    }
    *p = (plan_t){
        .uses = views[USES].buf, .total = views[TOTAL].buf, .by_sample = views[BY_SAMPLE].buf,
        .first = views[FIRST].buf, .next_first = views[NEXT_FIRST].buf, .consumed = views[CONSUMED].buf,
        .was_passed = views[WAS_PASSED].buf, .ids = views[IDS].buf,
        .n_files = views[USES].len / 4, .n = views[IDS].len / 8,
    };
    if (views[TOTAL].len / 4 < p->n_files || views[FIRST].len / 4 < p->n_files
        || views[NEXT_FIRST].len / 4 < p->n_files || views[WAS_PASSED].len < p->n_files
        || views[CONSUMED].len < p->n || views[BY_SAMPLE].len / 4 < p->n) {
        PyErr_SetString(PyExc_ValueError, "the arrays of one plan expected");
        return -1;
    }
    return 0;
}

/* Sample id o, in [0, n) (-1 with an IndexError: out of that range). */
static Py_ssize_t sid_below(PyObject *o, Py_ssize_t n) {
    Py_ssize_t sid = PyNumber_AsSsize_t(o, PyExc_IndexError);
    if (sid == -1 && PyErr_Occurred())
        return -1;
    if (sid < 0 || sid >= n) {
        PyErr_Format(PyExc_IndexError, "sample %zd out of range", sid);
        return -1;
    }
    return sid;
}

/* Sample id o of the plan (-1 with an IndexError: out of its range). */
static Py_ssize_t sid_in(const plan_t *p, PyObject *o) {
    return sid_below(o, p->n_files);
}

/* Where sid is needed next once it has been used `uses` times (Plan.position_of): its next
 * occurrence here, or len(order) plus its first in the next order, or inf (never). */
static PyObject *next_of(const plan_t *p, Py_ssize_t sid, int32_t uses) {
    if (uses < p->total[sid])
        return PyLong_FromLong(p->by_sample[p->first[sid] + uses]);
    if (p->next_first[sid] >= 0)
        return PyLong_FromLongLong(p->n + p->next_first[sid]);
    return PyFloat_FromDouble(INFINITY);
}

/* The cursor past what is consumed, and past what lies more than skip_window behind the
 * frontier (skipped: counted as a use, and passed). */
static int advance(plan_t *p) {
    while (p->cursor < p->n && (p->consumed[p->cursor] || p->cursor < p->frontier - p->skip_window)) {
        Py_ssize_t at = p->cursor;
        if (!p->consumed[at]) { /* skipped by the readers */
            int64_t sid = p->ids[at];
            if (sid >= 0 && sid < p->n_files && p->uses[sid] < p->total[sid]
                && p->by_sample[p->first[sid] + p->uses[sid]] == at) {
                p->consumed[at] = 1;
                p->uses[sid]++;
                p->skipped++;
                PyObject *o = PyLong_FromLongLong(sid);
                if (o == NULL || PyList_Append(p->passed, o) < 0) {
                    Py_XDECREF(o);
                    return -1;
                }
                Py_DECREF(o);
                if (p->uses[sid] >= p->total[sid]) /* (its last: a later use is late) */
                    p->was_passed[sid] = 1;
            }
        }
        p->cursor++;
    }
    return 0;
}

static PyObject *use_many(PyObject *self, PyObject *args) {
    PyObject *tuple, *sids_o, *passed;
    long long cursor, frontier, skip_window, max_skip_window;
    if (!PyArg_ParseTuple(args, "O!OLLLLO!", &PyTuple_Type, &tuple, &sids_o, &cursor, &frontier, &skip_window,
                          &max_skip_window, &PyList_Type, &passed))
        return NULL;
    views_t v;
    plan_t p;
    PyObject *sids = NULL, *out = NULL, *result = NULL;
    if (get_plan(tuple, &v, &p) < 0)
        goto end;
    p.cursor = cursor, p.frontier = frontier, p.skip_window = skip_window;
    p.max_skip_window = max_skip_window, p.passed = passed;
    if ((sids = PySequence_Fast(sids_o, "use_many: a sequence of sample ids")) == NULL
        || (out = PyList_New(0)) == NULL)
        goto end;
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(sids); i++) {
        Py_ssize_t sid = sid_in(&p, PySequence_Fast_GET_ITEM(sids, i));
        if (sid < 0)
            goto end;
        int32_t uses = p.uses[sid], total = p.total[sid];
        if (uses >= total) {
            if (p.was_passed[sid]) { /* a late use: the readers lag each other by more than the window */
                p.was_passed[sid] = 0;
                p.late++;
                long long lag = p.frontier - p.by_sample[p.first[sid] + total - 1];
                long long w = 2 * lag > p.skip_window ? 2 * lag : p.skip_window;
                p.skip_window = w < p.max_skip_window ? w : p.max_skip_window;
            }
            continue;
        }
        Py_ssize_t at = (Py_ssize_t)p.first[sid] + uses;
        long long pos = p.by_sample[at];
        p.consumed[pos] = 1;
        p.uses[sid] = ++uses;
        PyObject *o = PyLong_FromSsize_t(sid), *next = next_of(&p, sid, uses);
        int bad = o == NULL || next == NULL || PyList_Append(out, o) < 0 || PyList_Append(out, next) < 0;
        Py_XDECREF(o);
        Py_XDECREF(next);
        if (bad)
            goto end;
        if (pos >= p.frontier)
            p.frontier = pos + 1;
        if ((pos == p.cursor || p.cursor < p.frontier - p.skip_window) && advance(&p) < 0)
            goto end;
    }
    result = Py_BuildValue("OLLLLL", out, p.cursor, p.frontier, p.skip_window, p.skipped, p.late);
end:
    release(&v);
    Py_XDECREF(sids);
    Py_XDECREF(out);
    return result;
}

static PyObject *positions_of(PyObject *self, PyObject *args) {
    PyObject *tuple, *sids_o;
    if (!PyArg_ParseTuple(args, "O!O", &PyTuple_Type, &tuple, &sids_o))
        return NULL;
    views_t v;
    plan_t p;
    PyObject *sids = NULL, *out = NULL;
    if (get_plan(tuple, &v, &p) < 0
        || (sids = PySequence_Fast(sids_o, "positions_of: a sequence of sample ids")) == NULL
        || (out = PyList_New(PySequence_Fast_GET_SIZE(sids))) == NULL)
        goto end;
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(sids); i++) {
        Py_ssize_t sid = sid_in(&p, PySequence_Fast_GET_ITEM(sids, i));
        PyObject *o = sid < 0 ? NULL : next_of(&p, sid, p.uses[sid]);
        if (o == NULL) {
            Py_CLEAR(out);
            goto end;
        }
        PyList_SET_ITEM(out, i, o);
    }
end:
    release(&v);
    Py_XDECREF(sids);
    return out;
}

#define MAX_FLAGS 4  /* flag arrays ahead() takes */

/* Whether sid is set in any of the flag arrays (flags[k]: nflags[k] bytes), or in any of
 * the containers (a tuple: dicts, sets, the cache): 1, 0, or -1 with an exception. */
static int skipped_sid(PyObject *skip, const uint8_t *const *flags, const Py_ssize_t *nflags, int nf,
                       int64_t sid, PyObject *o) {
    for (int k = 0; k < nf; k++)
        if (sid < nflags[k] && flags[k][sid])
            return 1;
    for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(skip); k++) {
        PyObject *c = PyTuple_GET_ITEM(skip, k);
        int r = PyDict_CheckExact(c) ? PyDict_Contains(c, o) : PySequence_Contains(c, o);
        if (r != 0)
            return r;
    }
    return 0;
}

/* ahead((ids, consumed, next_ids, cum), pos, frontier, readahead, max_run, step, skip, flags)
 * -> (sids, positions, pos, looked, stop): prefetch.ReadAheadPlan.advance's walk of one plan
 * from pos through its order and then the next one, taking up to max_run samples that are
 * not consumed, not in any of skip's containers and set in none of flags' arrays (a tuple of
 * at most MAX_FLAGS arrays of a byte a sample), while looking at fewer
 * than step positions (-1: no bound) and staying within readahead bytes of the frontier;
 * pos: where it got to; looked: positions looked at; stop: 0 (it may go on), 1 (covered to
 * the end), 2 (as far ahead as it may look). */
static PyObject *ahead(PyObject *self, PyObject *args) {
    PyObject *tuple, *skip, *flags_o;
    long long pos, frontier, readahead, max_run, step;
    if (!PyArg_ParseTuple(args, "O!LLLLLO!O!", &PyTuple_Type, &tuple, &pos, &frontier, &readahead, &max_run,
                          &step, &PyTuple_Type, &skip, &PyTuple_Type, &flags_o))
        return NULL;
    enum { A_IDS, A_CONSUMED, A_NEXT, A_CUM, A_N };
    static const Py_ssize_t size[A_N] = {8, 1, 8, 8};
    Py_buffer v[A_N + MAX_FLAGS];
    int got = 0;
    PyObject *sids = NULL, *positions = NULL, *result = NULL;
    if (PyTuple_GET_SIZE(tuple) != A_N) {
        PyErr_SetString(PyExc_ValueError, "ahead: a plan's ids, consumed, next ids and cumulative sizes expected");
        return NULL;
    }
    int nf = (int) PyTuple_GET_SIZE(flags_o);
    if (nf > MAX_FLAGS) {
        PyErr_SetString(PyExc_ValueError, "ahead: too many flag arrays");
        return NULL;
    }
    for (; got < A_N; got++) {
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(tuple, got), &v[got], PyBUF_C_CONTIGUOUS) < 0)
            goto end;
        if (v[got].itemsize != size[got]) {
            PyErr_SetString(PyExc_ValueError, "ahead: arrays of the wrong type");
            got++;
            goto end;
        }
    }
    const uint8_t *flags[MAX_FLAGS];
    Py_ssize_t nflags[MAX_FLAGS];
    for (int k = 0; k < nf; k++) {
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(flags_o, k), &v[A_N + k], PyBUF_C_CONTIGUOUS) < 0)
            goto end;
        got++;
        if (v[A_N + k].itemsize != 1) {
            PyErr_SetString(PyExc_ValueError, "ahead: flags of a byte a sample expected");
            goto end;
        }
        flags[k] = v[A_N + k].buf;
        nflags[k] = v[A_N + k].len;
    }
    const int64_t *ids = v[A_IDS].buf, *next_ids = v[A_NEXT].buf, *cum = v[A_CUM].buf;
    const uint8_t *consumed = v[A_CONSUMED].buf;
    Py_ssize_t n = v[A_IDS].len / 8, end_ = n + v[A_NEXT].len / 8;
    if (v[A_CONSUMED].len < n || v[A_CUM].len / 8 < end_ + 1 || frontier < 0 || frontier > end_) {
        PyErr_SetString(PyExc_ValueError, "ahead: the arrays of one plan expected");
        goto end;
    }
    if ((sids = PyList_New(0)) == NULL || (positions = PyList_New(0)) == NULL)
        goto end;
    long long looked = 0;
    int stop = 0;
    if (pos < 0)
        pos = 0;
    while (PyList_GET_SIZE(sids) < max_run && (step < 0 || looked < step)) {
        long long start = pos;
        int64_t sid = -1;
        PyObject *o = NULL;
        for (; pos < end_; pos++) {
            if (pos < n) {
                if (consumed[pos])
                    continue;
                sid = ids[pos];
            } else {
                sid = next_ids[pos - n];
            }
            if ((o = PyLong_FromLongLong(sid)) == NULL)
                goto end;
            int r = skipped_sid(skip, flags, nflags, nf, sid, o);
            if (r < 0) {
                Py_DECREF(o);
                goto end;
            }
            if (!r)
                break;
            Py_CLEAR(o);
        }
        if (pos >= end_ || cum[pos] - cum[frontier] > readahead) {
            Py_XDECREF(o);
            stop = pos >= end_ ? 1 : 2;
            break;
        }
        PyObject *at = PyLong_FromLongLong(pos);
        int bad = at == NULL || PyList_Append(sids, o) < 0 || PyList_Append(positions, at) < 0;
        Py_DECREF(o);
        Py_XDECREF(at);
        if (bad)
            goto end;
        pos++;
        looked += pos - start;
    }
    result = Py_BuildValue("OOLLi", sids, positions, pos, looked, stop);
end:
    for (int k = 0; k < got; k++)
        PyBuffer_Release(&v[k]);
    Py_XDECREF(sids);
    Py_XDECREF(positions);
    return result;
}


/* ---- the read-ahead's queues (prefetch.ReadAheadPlan) ---------------------------------
 *
 * Per storage node, the samples waiting for a request slot, in the order they are needed: a
 * doubly linked list a node over two arrays of the data set's size (8 bytes a sample), so that
 * taking a sample out of the middle (a reader that missed it) is O(1), and a byte a sample
 * in `flags` (the caller's bytearray, which Plan.ahead reads: a queued sample is not walked
 * over again). A sample's node is its chunk's (chunk, chunk_node: the index's and the
 * placement's arrays, read where they lie); its size is the index's. */

typedef struct {
    PyObject_HEAD
    Py_buffer flags_v, chunk_v, chunk_node_v, size_v;
    int have;                 /* buffers got (for the dealloc) */
    Py_ssize_t n, nodes, count;
    int32_t *next, *prev;     /* n each: the links (-1: none) */
    int32_t *head, *tail;     /* nodes each (-1: empty) */
    Py_ssize_t *len;          /* nodes */
} Queues;

static void Queues_dealloc(Queues *q) {
    Py_buffer *v[] = {&q->flags_v, &q->chunk_v, &q->chunk_node_v, &q->size_v};
    for (int k = 0; k < q->have; k++)
        PyBuffer_Release(v[k]);
    free(q->next);
    free(q->prev);
    free(q->head);
    free(q->tail);
    free(q->len);
    Py_TYPE(q)->tp_free((PyObject *)q);
}

static int Queues_init(Queues *q, PyObject *args, PyObject *kw) {
    static char *names[] = {"flags", "chunk", "chunk_node", "size", "nodes", NULL};
    PyObject *flags, *chunk, *chunk_node, *size;
    Py_ssize_t nodes;
    if (q->have || q->next) {
        PyErr_SetString(PyExc_RuntimeError, "Queues: initialised once");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOOn", names, &flags, &chunk, &chunk_node, &size, &nodes))
        return -1;
    Py_buffer *v[] = {&q->flags_v, &q->chunk_v, &q->chunk_node_v, &q->size_v};
    PyObject *o[] = {flags, chunk, chunk_node, size};
    static const Py_ssize_t itemsize[] = {1, 4, 4, 8};
    for (int k = 0; k < 4; k++) {
        if (PyObject_GetBuffer(o[k], v[k], k == 0 ? PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS : PyBUF_C_CONTIGUOUS) < 0)
            return -1;
        q->have++;
        if (v[k]->itemsize != itemsize[k]) {
            PyErr_SetString(PyExc_ValueError, "Queues: flags (bytes), chunk (uint32), chunk_node (int32) "
                            "and size (uint64) expected");
            return -1;
        }
    }
    q->n = q->flags_v.len;
    if (q->chunk_v.len / 4 != q->n || q->size_v.len / 8 != q->n || nodes < 1 || q->n >= INT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "Queues: arrays of the data set's size and a node at least expected");
        return -1;
    }
    const uint32_t *ch = q->chunk_v.buf;
    const int32_t *cn = q->chunk_node_v.buf;
    Py_ssize_t nchunks = q->chunk_node_v.len / 4;
    for (Py_ssize_t i = 0; i < q->n; i++)  /* (checked once: every sample's node is a node) */
        if ((Py_ssize_t) ch[i] >= nchunks || cn[ch[i]] < 0 || cn[ch[i]] >= nodes) {
            PyErr_SetString(PyExc_ValueError, "Queues: a sample's chunk or node out of range");
            return -1;
        }
    q->nodes = nodes;
    q->next = malloc((size_t)(q->n ? q->n : 1) * sizeof *q->next);
    q->prev = malloc((size_t)(q->n ? q->n : 1) * sizeof *q->prev);
    q->head = malloc((size_t) nodes * sizeof *q->head);
    q->tail = malloc((size_t) nodes * sizeof *q->tail);
    q->len = calloc((size_t) nodes, sizeof *q->len);
    if (!q->next || !q->prev || !q->head || !q->tail || !q->len) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t k = 0; k < nodes; k++)
        q->head[k] = q->tail[k] = -1;
    memset(q->flags_v.buf, 0, (size_t) q->n);
    return 0;
}

static inline int32_t node_of_sid(Queues *q, Py_ssize_t sid) {
    return ((const int32_t *) q->chunk_node_v.buf)[((const uint32_t *) q->chunk_v.buf)[sid]];
}

static inline int queued(Queues *q, Py_ssize_t sid) {
    return ((uint8_t *) q->flags_v.buf)[sid] != 0;
}

static void append(Queues *q, int32_t sid) {
    int32_t k = node_of_sid(q, sid);
    q->next[sid] = -1;
    q->prev[sid] = q->tail[k];
    if (q->tail[k] >= 0)
        q->next[q->tail[k]] = sid;
    else
        q->head[k] = sid;
    q->tail[k] = sid;
    q->len[k]++;
    q->count++;
    ((uint8_t *) q->flags_v.buf)[sid] = 1;
}

static void unlink_sid(Queues *q, int32_t sid) {
    int32_t k = node_of_sid(q, sid), p = q->prev[sid], nx = q->next[sid];
    if (p >= 0)
        q->next[p] = nx;
    else
        q->head[k] = nx;
    if (nx >= 0)
        q->prev[nx] = p;
    else
        q->tail[k] = p;
    q->len[k]--;
    q->count--;
    ((uint8_t *) q->flags_v.buf)[sid] = 0;
}

static int node_arg(Queues *q, Py_ssize_t k) {
    if (k < 0 || k >= q->nodes) {
        PyErr_Format(PyExc_IndexError, "Queues: no node %zd", k);
        return -1;
    }
    return 0;
}

/* push_many(sids, count): the first count of sids appended to their nodes' queues (those
 * queued already stay where they are) */
static PyObject *Queues_push_many(Queues *q, PyObject *args) {
    PyObject *sids;
    Py_ssize_t count;
    if (!PyArg_ParseTuple(args, "On", &sids, &count))
        return NULL;
    PyObject *seq = PySequence_Fast(sids, "Queues.push_many: a sequence of samples expected");
    if (seq == NULL)
        return NULL;
    Py_ssize_t m = PySequence_Fast_GET_SIZE(seq);
    if (count > m)
        count = m;
    for (Py_ssize_t i = 0; i < count; i++) {
        Py_ssize_t sid = sid_below(PySequence_Fast_GET_ITEM(seq, i), q->n);
        if (sid < 0) {
            Py_DECREF(seq);
            return NULL;
        }
        if (!queued(q, sid))
            append(q, (int32_t) sid);
    }
    Py_DECREF(seq);
    Py_RETURN_NONE;
}

/* remove(sid) -> its node, or -1 where it was not queued */
static PyObject *Queues_remove(Queues *q, PyObject *o) {
    Py_ssize_t sid = sid_below(o, q->n);
    if (sid < 0)
        return NULL;
    if (!queued(q, sid))
        return PyLong_FromLong(-1);
    unlink_sid(q, (int32_t) sid);
    return PyLong_FromLong(node_of_sid(q, sid));
}

/* tail(node) -> the sample last in node's queue, or -1 */
static PyObject *Queues_tail(Queues *q, PyObject *o) {
    Py_ssize_t k = PyLong_AsSsize_t(o);
    if ((k == -1 && PyErr_Occurred()) || node_arg(q, k) < 0)
        return NULL;
    return PyLong_FromLong(q->tail[k]);
}

/* take(node, count, last) -> up to count samples taken out of node's queue: from its head,
 * or (last) from its tail */
static PyObject *Queues_take(Queues *q, PyObject *args) {
    Py_ssize_t k, count;
    int last;
    if (!PyArg_ParseTuple(args, "nnp", &k, &count, &last) || node_arg(q, k) < 0)
        return NULL;
    PyObject *out = PyList_New(0);
    for (Py_ssize_t i = 0; out != NULL && i < count && q->len[k]; i++) {
        int32_t sid = last ? q->tail[k] : q->head[k];
        unlink_sid(q, sid);
        PyObject *s = PyLong_FromLong(sid);
        if (s == NULL || PyList_Append(out, s) < 0)
            Py_CLEAR(out);
        Py_XDECREF(s);
    }
    return out;
}

/* deal(node, want, batches, max_bytes) -> [batch, ...]: the head of node's queue as runs (a
 * run: one sample, or samples of one chunk that follow each other, up to max_bytes) holding
 * at least want samples in all (at least one run), dealt round robin over at most `batches`
 * batches, and taken out of the queue (prefetch.ReadAheadPlan.batches) */
static PyObject *Queues_deal(Queues *q, PyObject *args) {
    Py_ssize_t k, want, nb;
    unsigned long long max_bytes;
    if (!PyArg_ParseTuple(args, "nnnK", &k, &want, &nb, &max_bytes) || node_arg(q, k) < 0)
        return NULL;
    if (nb < 1)
        return PyList_New(0);
    const uint32_t *chunk = q->chunk_v.buf;
    const uint64_t *size = q->size_v.buf;
    /* the runs: their first samples and lengths, counted first (at most the queue's length) */
    Py_ssize_t runs = 0, taken = 0, run_len = 0;
    unsigned long long nbytes = 0;
    int32_t end = -1, sid = q->head[k], last = -1;
    for (; sid >= 0; last = sid, sid = q->next[sid]) {
        if (run_len && (chunk[sid] != chunk[last] || nbytes + size[sid] > max_bytes)) {
            runs++;
            taken += run_len;
            run_len = 0;
            nbytes = 0;
            if (taken >= want) {
                end = sid;
                break;
            }
        }
        run_len++;
        nbytes += size[sid];
    }
    if (run_len && end < 0)
        runs++;
    if (runs == 0)
        return PyList_New(0);
    if (nb > runs)
        nb = runs;
    PyObject *out = PyList_New(nb);
    if (out == NULL)
        return NULL;
    for (Py_ssize_t b = 0; b < nb; b++) {
        PyObject *l = PyList_New(0);
        if (l == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, b, l);
    }
    /* deal them: run r to batch r % nb, each taken out of the queue */
    Py_ssize_t r = 0;
    run_len = 0, nbytes = 0, last = -1;
    for (sid = q->head[k]; sid != end && sid >= 0;) {
        if (run_len && (chunk[sid] != chunk[last] || nbytes + size[sid] > max_bytes)) {
            r++;
            run_len = 0;
            nbytes = 0;
        }
        run_len++;
        nbytes += size[sid];
        int32_t nx = q->next[sid];
        unlink_sid(q, sid);
        PyObject *s = PyLong_FromLong(sid);
        if (s == NULL || PyList_Append(PyList_GET_ITEM(out, r % nb), s) < 0) {
            Py_XDECREF(s);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(s);
        last = sid;
        sid = nx;
    }
    return out;
}

/* lengths() -> [each node's queue length] */
static PyObject *Queues_lengths(Queues *q, PyObject *Py_UNUSED(ignored)) {
    PyObject *out = PyList_New(q->nodes);
    for (Py_ssize_t k = 0; out != NULL && k < q->nodes; k++) {
        PyObject *v = PyLong_FromSsize_t(q->len[k]);
        if (v == NULL) {
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, k, v);
    }
    return out;
}

/* of(node) -> node's queue, head first */
static PyObject *Queues_of(Queues *q, PyObject *o) {
    Py_ssize_t k = PyLong_AsSsize_t(o);
    if ((k == -1 && PyErr_Occurred()) || node_arg(q, k) < 0)
        return NULL;
    PyObject *out = PyList_New(0);
    for (int32_t sid = q->head[k]; out != NULL && sid >= 0; sid = q->next[sid]) {
        PyObject *s = PyLong_FromLong(sid);
        if (s == NULL || PyList_Append(out, s) < 0)
            Py_CLEAR(out);
        Py_XDECREF(s);
    }
    return out;
}

static Py_ssize_t Queues_length(Queues *q) {
    return q->count;
}

static int Queues_contains(Queues *q, PyObject *o) {
    Py_ssize_t sid = PyLong_AsSsize_t(o);
    if (sid == -1 && PyErr_Occurred()) {
        PyErr_Clear();  /* (not a sample: not queued) */
        return 0;
    }
    return sid >= 0 && sid < q->n && queued(q, sid);
}

static PyObject *Queues_iter(Queues *q) {
    PyObject *all = PyList_New(0);
    for (Py_ssize_t k = 0; all != NULL && k < q->nodes; k++)
        for (int32_t sid = q->head[k]; all != NULL && sid >= 0; sid = q->next[sid]) {
            PyObject *s = PyLong_FromLong(sid);
            if (s == NULL || PyList_Append(all, s) < 0)
                Py_CLEAR(all);
            Py_XDECREF(s);
        }
    if (all == NULL)
        return NULL;
    PyObject *it = PyObject_GetIter(all);
    Py_DECREF(all);
    return it;
}

static PyMethodDef Queues_methods[] = {
    {"push_many", (PyCFunction)Queues_push_many, METH_VARARGS,
     "push_many(sids, count): the first count of sids appended to their nodes' queues (one queued already stays)"},
    {"remove", (PyCFunction)Queues_remove, METH_O, "remove(sid) -> its node, or -1 where it was not queued"},
    {"tail", (PyCFunction)Queues_tail, METH_O, "tail(node) -> the sample last in node's queue, or -1"},
    {"take", (PyCFunction)Queues_take, METH_VARARGS,
     "take(node, count, last) -> up to count samples taken from the head of node's queue (last: its tail)"},
    {"deal", (PyCFunction)Queues_deal, METH_VARARGS,
     "deal(node, want, batches, max_bytes) -> [batch, ...]: the queue's head as runs of at least want samples "
     "in all, dealt round robin over at most `batches` batches and taken out (see the source)"},
    {"lengths", (PyCFunction)Queues_lengths, METH_NOARGS, "lengths() -> [each node's queue length]"},
    {"of", (PyCFunction)Queues_of, METH_O, "of(node) -> node's queue, head first"},
    {NULL},
};

static PySequenceMethods Queues_as_sequence = {
    .sq_length = (lenfunc)Queues_length,
    .sq_contains = (objobjproc)Queues_contains,
};

static PyTypeObject QueuesType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "fusefs._plancore.Queues",
    .tp_basicsize = sizeof(Queues),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The read-ahead's queues, a node each (see the source).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Queues_init,
    .tp_dealloc = (destructor)Queues_dealloc,
    .tp_methods = Queues_methods,
    .tp_as_sequence = &Queues_as_sequence,
    .tp_iter = (getiterfunc)Queues_iter,
};


/* The byte of flags (a writable buffer, one a sample) of the sample o names: an int, or a
 * tuple whose first item is one; NULL with IndexError or TypeError. */
static unsigned char *flag_of(Py_buffer *f, PyObject *o) {
    if (PyTuple_Check(o) && PyTuple_GET_SIZE(o) > 0)
        o = PyTuple_GET_ITEM(o, 0);
    Py_ssize_t s = PyNumber_AsSsize_t(o, PyExc_IndexError);
    if (s == -1 && PyErr_Occurred())
        return NULL;
    if (s < 0 || s >= f->len) {
        PyErr_Format(PyExc_IndexError, "sample %zd is not in the flags", s);
        return NULL;
    }
    return (unsigned char *)f->buf + s;
}

/* flag(flags, items, value) -> [item, ...]: the flag of each of items (a sample, or a tuple
 * whose first item is one) set to value (0 or 1): those whose flag was not value before,
 * in order, each once (fetch.InFlight: a claim sets 1, a settle 0); none is changed where
 * one of items is not a sample. */
static PyObject *flag(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *flags, *items, *out = NULL, *seq = NULL;
    int value;
    if (!PyArg_ParseTuple(args, "OOp:flag", &flags, &items, &value))
        return NULL;
    Py_buffer f;
    if (PyObject_GetBuffer(flags, &f, PyBUF_WRITABLE) < 0)
        return NULL;
    seq = PySequence_Fast(items, "flag: items must be a sequence");
    if (seq == NULL || (out = PyList_New(0)) == NULL)
        goto done;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **all = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < n; i++) {  /* (the changes listed first: none made on an error) */
        unsigned char *b = flag_of(&f, all[i]);
        if (b == NULL || ((*b != 0) != value && !(*b & 0x80) && PyList_Append(out, all[i]) < 0)) {
            Py_CLEAR(out);
            break;
        }
        if ((*b != 0) != value)
            *b |= 0x80;  /* (listed: a second of it is not) */
    }
    for (Py_ssize_t i = 0; i < n; i++) {  /* (the marks taken off; the changes made) */
        unsigned char *b = flag_of(&f, all[i]);
        if (b == NULL)
            break;
        if (*b & 0x80)
            *b = out != NULL ? (unsigned char)value : (unsigned char)(*b & 0x7f);
    }
done:
    Py_XDECREF(seq);
    PyBuffer_Release(&f);
    return out;
}

static PyMethodDef methods[] = {
    {"flag", flag, METH_VARARGS,
     "flag(flags, items, value) -> [item, ...]: each of items' flag (a sample's, or a tuple's first's) set "
     "to value (0 or 1): those whose flag was not value, in order, each once"},
    {"use_many", use_many, METH_VARARGS,
     "use_many(arrays, sids, cursor, frontier, skip_window, max_skip_window, passed) -> (out, cursor, "
     "frontier, skip_window, skipped, late): plan.Plan.use_many's counting (arrays: uses, total, "
     "by_sample, first, consumed, next_first, was_passed, ids; passed: the list the passed samples go "
     "to; out: [sid, next position, ...])"},
    {"positions_of", positions_of, METH_VARARGS,
     "positions_of(arrays, sids) -> [position, ...]: plan.Plan.position_of of each of sids"},
    {"ahead", ahead, METH_VARARGS,
     "ahead((ids, consumed, next_ids, cum), pos, frontier, readahead, max_run, step, skip, (flags, ...)) -> (sids, "
     "positions, pos, looked, stop): the read-ahead's walk of one plan (see the source)"},
    {NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "fusefs._plancore", "A plan's counting of a batch of uses, and the read-ahead's walk "
    "and queues, in C.", -1, methods,
};

PyMODINIT_FUNC PyInit__plancore(void) {
    if (PyType_Ready(&QueuesType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddObjectRef(m, "Queues", (PyObject *)&QueuesType) < 0)
        Py_CLEAR(m);
    return m;
}
