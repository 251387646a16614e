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
 * read-ahead's: tests/test_order.py holds each pair to the same results. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdint.h>

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

/* Sample id o of the plan (-1 with an IndexError: out of its range). */
static Py_ssize_t sid_in(const plan_t *p, PyObject *o) {
    Py_ssize_t sid = PyNumber_AsSsize_t(o, PyExc_IndexError);
    if (sid == -1 && PyErr_Occurred())
        return -1;
    if (sid < 0 || sid >= p->n_files) {
        PyErr_Format(PyExc_IndexError, "sample %zd out of range", sid);
        return -1;
    }
    return sid;
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


static PyMethodDef methods[] = {
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
    PyModuleDef_HEAD_INIT, "fusefs._plancore", "A plan's counting of a batch of uses in C.", -1, methods,
};

PyMODINIT_FUNC PyInit__plancore(void) {
    return PyModule_Create(&module);
}
