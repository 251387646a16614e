/* fusefs._cachecore: the sample cache's entries, reservations and eviction order in C
 * (cache.SampleCache is its Python subclass: the budget's rules, pins and what open handles
 * keep).
 *
 * In Python, each fetched sample cost the event loop a put into two dicts and a heap, an
 * eviction's pops of stale heap items (lazy deletion: each re-key left one), a reservation
 * and its settling: about a quarter of the loop's Python a fetched sample
 * (docs/HOTPATH.md, "Per sample on the loop"). Here a group's samples are put, reserved,
 * settled and re-keyed in one call each, and the heap is indexed (each entry's place in it is
 * kept), so a re-key moves its entry and leaves nothing stale: every operation is O(log n)
 * in the entries, and the heap holds one item an entry that is not pinned.
 *
 * Entries are kept by sample id in arrays of the data set's size (`samples`: about 50 bytes
 * a sample, cached or not), which grow past the largest id seen where it is not given. The eviction order: the entry of largest
 * key (the next use furthest away; inf: none) first, and of equal keys the one put or
 * re-keyed first (a full re-key, set_keys or set_pinned, orders equal keys by when they were
 * put). Every function runs with the GIL (the loop's). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "_publishapi.h"
#include <structmember.h>

#include <math.h>
#include <stdint.h>

#define PINNED 1 /* never evicted, not in the heap (set_pinned) */
#define KEPT 2   /* an open handle keeps its bytes: a leaving entry calls self._left(sid, data) */

typedef struct {
    PyObject_HEAD
    Py_ssize_t cap;      /* the arrays' length: sample ids below it */
    PyObject **data;     /* sid -> its bytes (a reference), NULL: not cached */
    double *key;         /* sid -> its next use (cached ones) */
    uint64_t *seq;       /* sid -> its place among equal keys (smaller: evicted first) */
    uint64_t *put_seq;   /* sid -> when it was put */
    int32_t *pos;        /* sid -> its index in heap, -1: not there */
    int64_t *res;        /* sid -> what its reservation costs the budget, -1: none */
    uint8_t *flags;      /* sid -> PINNED | KEPT */
    int32_t *heap;       /* the entries not pinned, a max-heap on (key, -seq) */
    Py_ssize_t hlen, count, reservations;
    uint64_t next_seq;
    long long budget, overhead, used, reserved, outside, peak, evictions, pinned_bytes;
    PyObject *mirror;    /* mirror(sid, bytes or None) of every entry that comes or goes, or NULL */
    const fusefs_publish_api *table;  /* or, the mirror being the fast path's capsule: told in C */
} Entries;

static Py_ssize_t data_len(PyObject *d) {
    return PyBytes_CheckExact(d) ? PyBytes_GET_SIZE(d) : PyObject_Size(d);
}

/* ---- the indexed heap ---- */

static inline int before(const Entries *c, int32_t a, int32_t b) { /* a is evicted before b */
    double ka = c->key[a], kb = c->key[b];
    return ka > kb || (ka == kb && c->seq[a] < c->seq[b]);
}

static inline void heap_set(Entries *c, Py_ssize_t i, int32_t s) {
    c->heap[i] = s;
    c->pos[s] = (int32_t)i;
}

static void sift_up(Entries *c, Py_ssize_t i) {
    int32_t s = c->heap[i];
    while (i > 0) {
        Py_ssize_t p = (i - 1) / 2;
        if (!before(c, s, c->heap[p]))
            break;
        heap_set(c, i, c->heap[p]);
        i = p;
    }
    heap_set(c, i, s);
}

static void sift_down(Entries *c, Py_ssize_t i) {
    int32_t s = c->heap[i];
    Py_ssize_t n = c->hlen;
    for (;;) {
        Py_ssize_t l = 2 * i + 1, m;
        if (l >= n)
            break;
        m = (l + 1 < n && before(c, c->heap[l + 1], c->heap[l])) ? l + 1 : l;
        if (!before(c, c->heap[m], s))
            break;
        heap_set(c, i, c->heap[m]);
        i = m;
    }
    heap_set(c, i, s);
}

static void heap_push(Entries *c, int32_t s) {
    heap_set(c, c->hlen, s);
    c->hlen++;
    sift_up(c, c->hlen - 1);
}

static void heap_remove(Entries *c, int32_t s) {
    Py_ssize_t i = c->pos[s];
    if (i < 0)
        return;
    c->pos[s] = -1;
    c->hlen--;
    if (i == c->hlen)
        return;
    int32_t last = c->heap[c->hlen];
    heap_set(c, i, last);
    sift_up(c, i);
    sift_down(c, c->pos[last]);
}

/* The heap from scratch: every cached entry not pinned, equal keys in the order put. */
static void heap_rebuild(Entries *c) {
    c->hlen = 0;
    for (Py_ssize_t s = 0; s < c->cap; s++) {
        c->pos[s] = -1;
        if (c->data[s] != NULL && !(c->flags[s] & PINNED)) {
            c->seq[s] = c->put_seq[s];
            heap_set(c, c->hlen++, (int32_t)s);
        }
    }
    for (Py_ssize_t i = c->hlen / 2 - 1; i >= 0; i--)
        sift_down(c, i);
}

/* ---- the arrays ---- */

static int grow_one(void **p, Py_ssize_t cap, size_t item) {
    void *q = PyMem_Realloc(*p, (size_t)cap * item);
    if (q == NULL)
        return -1;
    *p = q;
    return 0;
}

/* The arrays for sample ids below cap (> c->cap; 0, or -1 with an exception). */
static int resize(Entries *c, Py_ssize_t cap) {
    if (cap > INT32_MAX)
        cap = INT32_MAX;
    if (grow_one((void **)&c->data, cap, sizeof(PyObject *)) || grow_one((void **)&c->key, cap, sizeof(double))
        || grow_one((void **)&c->seq, cap, sizeof(uint64_t)) || grow_one((void **)&c->put_seq, cap, sizeof(uint64_t))
        || grow_one((void **)&c->pos, cap, sizeof(int32_t)) || grow_one((void **)&c->res, cap, sizeof(int64_t))
        || grow_one((void **)&c->flags, cap, 1) || grow_one((void **)&c->heap, cap, sizeof(int32_t))) {
        PyErr_NoMemory(); /* (the arrays that grew hold the old ones' items: cap stays) */
        return -1;
    }
    for (Py_ssize_t s = c->cap; s < cap; s++) {
        c->data[s] = NULL;
        c->pos[s] = -1;
        c->res[s] = -1;
        c->flags[s] = 0;
    }
    c->cap = cap;
    return 0;
}

/* Room for sample ids up to sid (0, or -1 with an exception): twice the room, at least. */
static inline int ensure(Entries *c, Py_ssize_t sid) {
    if (sid < c->cap)
        return 0;
    Py_ssize_t cap = c->cap * 2 > sid + 1 ? c->cap * 2 : sid + 1;
    return resize(c, cap < 1024 ? 1024 : cap);
}

/* A sample id from o (-1 with an exception: not an int, or out of range). */
static Py_ssize_t sid_of(PyObject *o) {
    Py_ssize_t sid = PyNumber_AsSsize_t(o, PyExc_OverflowError);
    if (sid == -1 && PyErr_Occurred())
        return -1;
    if (sid < 0 || sid >= INT32_MAX) {
        PyErr_Format(PyExc_ValueError, "sample id %zd out of range", sid);
        return -1;
    }
    return sid;
}

/* The cached sample id o, or -1 (not an int, out of range or not cached; no exception). */
static Py_ssize_t cached(Entries *c, PyObject *o) {
    if (!PyLong_Check(o) && !PyIndex_Check(o))
        return -1;
    Py_ssize_t sid = PyNumber_AsSsize_t(o, PyExc_OverflowError);
    if (sid == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        return -1;
    }
    return sid >= 0 && sid < c->cap && c->data[sid] != NULL ? sid : -1;
}

static int tell(Entries *c, Py_ssize_t sid, PyObject *d) {
    if (c->table != NULL) {  /* (the fast path's table, in C: no Python call) */
        c->table->hold((uint64_t)sid, d);
        return 0;
    }
    if (c->mirror == NULL)
        return 0;
    PyObject *o = PyLong_FromSsize_t(sid);
    if (o == NULL)
        return -1;
    PyObject *r = PyObject_CallFunctionObjArgs(c->mirror, o, d ? d : Py_None, NULL);
    Py_DECREF(o);
    if (r == NULL)
        return -1;
    Py_DECREF(r);
    return 0;
}

/* Entry sid left (evicted or dropped): its bytes d, which a handle may still keep. */
static int left(Entries *c, Py_ssize_t sid, PyObject *d) {
    if (!(c->flags[sid] & KEPT))
        return 0;
    PyObject *r = PyObject_CallMethod((PyObject *)c, "_left", "nO", sid, d);
    if (r == NULL)
        return -1;
    Py_DECREF(r);
    return 0;
}

/* Take entry sid out (it is cached); gone: a list to add it to for the caller to tell the
 * mirror of, or NULL: told here. */
static int take_out(Entries *c, Py_ssize_t sid, PyObject *gone, int evicted) {
    PyObject *d = c->data[sid];
    c->data[sid] = NULL;
    heap_remove(c, (int32_t)sid);
    c->count--;
    Py_ssize_t n = data_len(d);
    int rc = n < 0 ? -1 : 0;
    c->used -= (n < 0 ? 0 : n) + c->overhead;
    if (evicted)
        c->evictions++;
    else if (c->flags[sid] & PINNED)
        c->pinned_bytes -= (n < 0 ? 0 : n) + c->overhead;
    if (rc == 0)
        rc = left(c, sid, d);
    if (rc == 0) {
        if (gone != NULL) {
            PyObject *o = PyLong_FromSsize_t(sid);
            rc = o == NULL || PyList_Append(gone, o) < 0 ? -1 : 0;
            Py_XDECREF(o);
        } else {
            rc = tell(c, sid, NULL);
        }
    }
    Py_DECREF(d);
    return rc;
}

/* Evict entries needed later than key (or never), furthest first, until need bytes are
 * free; evict nothing if that cannot free enough: 1 (room), 0 (none), -1 (an error). */
static int make_room(Entries *c, long long need, double key, PyObject *gone) {
    long long short_ = need - (c->budget - c->used - c->reserved);
    if (short_ <= 0)
        return 1;
    int32_t local[64], *taken = local;
    Py_ssize_t nt = 0, room = 64;
    while (c->hlen && short_ > 0) {
        int32_t s = c->heap[0];
        double k = c->key[s];
        if (!(k > key || k == INFINITY))
            break;
        if (nt == room) {
            int32_t *more = PyMem_Malloc((size_t)room * 2 * sizeof(int32_t));
            if (more == NULL) {
                short_ = 1; /* (put back below) */
                PyErr_NoMemory();
                break;
            }
            memcpy(more, taken, (size_t)nt * sizeof(int32_t));
            if (taken != local)
                PyMem_Free(taken);
            taken = more;
            room *= 2;
        }
        heap_remove(c, s);
        taken[nt++] = s;
        Py_ssize_t n = data_len(c->data[s]);
        short_ -= (n < 0 ? 0 : n) + c->overhead;
    }
    int rc = 1;
    if (short_ > 0) {
        for (Py_ssize_t i = 0; i < nt; i++)
            heap_push(c, taken[i]); /* (same keys and places: the same order) */
        rc = PyErr_Occurred() ? -1 : 0;
    } else {
        for (Py_ssize_t i = 0; i < nt; i++)
            if (take_out(c, taken[i], gone, 1) < 0)
                rc = -1;
    }
    if (taken != local)
        PyMem_Free(taken);
    return rc;
}

/* Evict entries no order needs (key inf, oldest first) while entries, reservations and
 * what handles keep outside them are past the budget. */
static int cover(Entries *c) {
    while (c->used + c->reserved + c->outside > c->budget && c->hlen) {
        int32_t s = c->heap[0];
        if (c->key[s] != INFINITY)
            return 0;
        if (take_out(c, s, NULL, 1) < 0)
            return -1;
    }
    return 0;
}

static inline void note_peak(Entries *c) {
    if (c->used + c->reserved > c->peak)
        c->peak = c->used + c->reserved;
}

/* ---- the type ---- */

static int Entries_init(Entries *c, PyObject *args, PyObject *kw) {
    static char *names[] = {"budget", "overhead", "mirror", "samples", NULL};
    long long budget, overhead;
    PyObject *mirror = Py_None;
    Py_ssize_t samples = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "LL|On", names, &budget, &overhead, &mirror, &samples))
        return -1;
    if (samples > c->cap && resize(c, samples) < 0)
        return -1;
    c->budget = budget;
    c->overhead = overhead;
    const fusefs_publish_api *table = NULL;
    if (PyCapsule_CheckExact(mirror)) {
        table = PyCapsule_GetPointer(mirror, FUSEFS_PUBLISH_API);
        if (table == NULL)
            return -1;
        if (table->version != FUSEFS_PUBLISH_API_VERSION) {
            PyErr_SetString(PyExc_RuntimeError, "Entries: the binding's publish API is not this module's version");
            return -1;
        }
    }
    c->table = table;
    Py_XSETREF(c->mirror, mirror == Py_None ? NULL : Py_NewRef(mirror));
    return 0;
}

static int Entries_traverse(Entries *c, visitproc visit, void *arg) {
    Py_VISIT(c->mirror);
    return 0;
}

static int Entries_clear(Entries *c) {
    Py_CLEAR(c->mirror);
    return 0;
}

static void Entries_dealloc(Entries *c) {
    PyObject_GC_UnTrack(c);
    Entries_clear(c);
    for (Py_ssize_t s = 0; s < c->cap; s++)
        Py_XDECREF(c->data[s]);
    PyMem_Free(c->data);
    PyMem_Free(c->key);
    PyMem_Free(c->seq);
    PyMem_Free(c->put_seq);
    PyMem_Free(c->pos);
    PyMem_Free(c->res);
    PyMem_Free(c->flags);
    PyMem_Free(c->heap);
    Py_TYPE(c)->tp_free((PyObject *)c);
}

static Py_ssize_t Entries_len(Entries *c) {
    return c->count;
}

static int Entries_contains(Entries *c, PyObject *o) {
    return cached(c, o) >= 0;
}

static PyObject *Entries_get(Entries *c, PyObject *o) {
    Py_ssize_t sid = cached(c, o);
    return Py_NewRef(sid >= 0 ? c->data[sid] : Py_None);
}

static PyObject *Entries_rekey(Entries *c, PyObject *const *args, Py_ssize_t n) {
    if (n != 2)
        return PyErr_Format(PyExc_TypeError, "rekey(sid, key)");
    Py_ssize_t sid = cached(c, args[0]);
    double key = PyFloat_AsDouble(args[1]);
    if (key == -1.0 && PyErr_Occurred())
        return NULL;
    if (sid >= 0 && c->key[sid] != key) {
        c->key[sid] = key;
        if (!(c->flags[sid] & PINNED)) {
            c->seq[sid] = c->next_seq++;
            sift_up(c, c->pos[sid]);
            sift_down(c, c->pos[sid]);
        }
    }
    Py_RETURN_NONE;
}

static PyObject *Entries_rekey_many(Entries *c, PyObject *pairs) {
    PyObject *f = PySequence_Fast(pairs, "rekey_many: a sequence [sid, key, ...]");
    if (f == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(f);
    PyObject **it = PySequence_Fast_ITEMS(f);
    for (Py_ssize_t i = 0; i + 1 < n; i += 2) {
        PyObject *a[2] = {it[i], it[i + 1]};
        PyObject *r = Entries_rekey(c, a, 2);
        if (r == NULL) {
            Py_DECREF(f);
            return NULL;
        }
        Py_DECREF(r);
    }
    Py_DECREF(f);
    Py_RETURN_NONE;
}

static PyObject *Entries_reserve_many(Entries *c, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3)
        return PyErr_Format(PyExc_TypeError, "reserve_many(sids, sizes, keys)");
    PyObject *sids = PySequence_Fast(args[0], "reserve_many: sids"), *sizes = NULL, *keys = NULL;
    PyObject *gone = NULL, *out = NULL;
    if (sids == NULL || (sizes = PySequence_Fast(args[1], "reserve_many: sizes")) == NULL
        || (keys = PySequence_Fast(args[2], "reserve_many: keys")) == NULL || (gone = PyList_New(0)) == NULL)
        goto end;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(sids), done = n;
    if (PySequence_Fast_GET_SIZE(sizes) < n || PySequence_Fast_GET_SIZE(keys) < n) {
        PyErr_SetString(PyExc_ValueError, "reserve_many: a size and a key a sample");
        goto end;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t sid = sid_of(PySequence_Fast_GET_ITEM(sids, i));
        if (sid < 0 || ensure(c, sid) < 0)
            goto end;
        if (c->res[sid] >= 0)
            continue;
        long long size = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(sizes, i));
        double key = PyFloat_AsDouble(PySequence_Fast_GET_ITEM(keys, i));
        if (PyErr_Occurred())
            goto end;
        long long need = size + c->overhead;
        if (need > c->budget - c->used - c->reserved) {
            int r = make_room(c, need, key, gone);
            if (r < 0)
                goto end;
            if (r == 0) {
                done = i;
                break;
            }
        }
        c->res[sid] = need;
        c->reservations++;
        c->reserved += need;
        note_peak(c);
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(gone); i++)
        if (tell(c, PyLong_AsSsize_t(PyList_GET_ITEM(gone, i)), NULL) < 0)
            goto end;
    out = PyLong_FromSsize_t(done);
end:
    Py_XDECREF(sids);
    Py_XDECREF(sizes);
    Py_XDECREF(keys);
    Py_XDECREF(gone);
    return out;
}

static long long settle(Entries *c, Py_ssize_t sid) {
    if (sid >= c->cap || c->res[sid] < 0)
        return 0;
    long long need = c->res[sid];
    c->res[sid] = -1;
    c->reservations--;
    c->reserved -= need;
    return need;
}

static PyObject *Entries_settle(Entries *c, PyObject *o) {
    Py_ssize_t sid = sid_of(o);
    if (sid < 0)
        return NULL;
    return PyLong_FromLongLong(settle(c, sid));
}

static PyObject *Entries_settle_many(Entries *c, PyObject *items) {
    PyObject *f = PySequence_Fast(items, "settle_many: a sequence of (sid, _)");
    if (f == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(f); i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(f, i);
        PyObject *o = PyTuple_Check(item) && PyTuple_GET_SIZE(item) ? Py_NewRef(PyTuple_GET_ITEM(item, 0))
                                                                    : PySequence_GetItem(item, 0);
        Py_ssize_t sid = o == NULL ? -1 : sid_of(o);
        Py_XDECREF(o);
        if (sid < 0) {
            Py_DECREF(f);
            return NULL;
        }
        settle(c, sid);
    }
    Py_DECREF(f);
    Py_RETURN_NONE;
}

static PyObject *Entries_holds_reservation(Entries *c, PyObject *o) {
    Py_ssize_t sid = sid_of(o);
    if (sid < 0)
        return NULL;
    return PyBool_FromLong(sid < c->cap && c->res[sid] >= 0);
}

/* reserved_among(sids) -> {sid, ...}: those of sids that hold a reservation. */
static PyObject *Entries_reserved_among(Entries *c, PyObject *sids) {
    PyObject *seq = PySequence_Fast(sids, "reserved_among: sids must be a sequence");
    if (seq == NULL)
        return NULL;
    PyObject *out = PySet_New(NULL);
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; out != NULL && i < n; i++) {
        Py_ssize_t sid = sid_of(items[i]);
        if (sid < 0 || (sid < c->cap && c->res[sid] >= 0 && PySet_Add(out, items[i]) < 0))
            Py_CLEAR(out);
    }
    Py_DECREF(seq);
    return out;
}

/* drop(sid): take sid's entry out (not an eviction); whether it was cached. */
static int drop(Entries *c, Py_ssize_t sid) {
    return take_out(c, sid, NULL, 0);
}

static PyObject *Entries_drop(Entries *c, PyObject *o) {
    Py_ssize_t sid = cached(c, o);
    if (sid < 0)
        Py_RETURN_FALSE;
    if (drop(c, sid) < 0)
        return NULL;
    Py_RETURN_TRUE;
}

static PyObject *Entries_put_many(Entries *c, PyObject *args, PyObject *kw) {
    static char *names[] = {"items", "keys", "start", "told", NULL};
    PyObject *items_o, *keys_o, *told = NULL;
    Py_ssize_t start = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OO|nO", names, &items_o, &keys_o, &start, &told))
        return NULL;
    PyObject *items = PySequence_Fast(items_o, "put_many: a sequence of (sid, bytes)"), *keys = NULL;
    PyObject *out = NULL;
    if (items == NULL || (keys = PySequence_Fast(keys_o, "put_many: keys")) == NULL)
        goto end;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(items), kept = n;
    if (PySequence_Fast_GET_SIZE(keys) < n) {
        PyErr_SetString(PyExc_ValueError, "put_many: a key an item");
        goto end;
    }
    if (told != NULL && PyObject_Length(told) == 0)
        told = NULL;
    PyErr_Clear(); /* (a told without a length is asked of each sample) */
    for (Py_ssize_t i = start; i < n; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(items, i);
        if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 2) {
            PyErr_SetString(PyExc_TypeError, "put_many: items of (sid, bytes)");
            goto end;
        }
        PyObject *sid_o = PyTuple_GET_ITEM(item, 0), *d = PyTuple_GET_ITEM(item, 1);
        Py_ssize_t sid = sid_of(sid_o);
        double key = PyFloat_AsDouble(PySequence_Fast_GET_ITEM(keys, i));
        if (sid < 0 || (key == -1.0 && PyErr_Occurred()) || ensure(c, sid) < 0)
            goto end;
        Py_ssize_t len = data_len(d);
        if (len < 0)
            goto end;
        int dropped = c->data[sid] != NULL;
        if (dropped && drop(c, sid) < 0)
            goto end;
        long long need = len + c->overhead;
        if (need > c->budget - c->used - c->reserved) {
            int r = make_room(c, need, key, NULL);
            if (r < 0)
                goto end;
            if (r == 0) {
                kept = i;
                break;
            }
        }
        c->data[sid] = Py_NewRef(d);
        c->key[sid] = key;
        c->seq[sid] = c->put_seq[sid] = c->next_seq++;
        c->count++;
        if (c->mirror != NULL) {
            int known = 0;
            if (!dropped && told != NULL && (known = PySequence_Contains(told, sid_o)) < 0)
                goto end;
            if (!known && tell(c, sid, d) < 0)
                goto end;
        }
        if (c->flags[sid] & PINNED)
            c->pinned_bytes += need;
        else
            heap_push(c, (int32_t)sid);
        c->used += need;
        note_peak(c);
    }
    if (c->outside && cover(c) < 0)
        goto end;
    out = PyLong_FromSsize_t(kept);
end:
    Py_XDECREF(items);
    Py_XDECREF(keys);
    return out;
}

static PyObject *Entries_cover(Entries *c, PyObject *unused) {
    if (cover(c) < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* A buffer of n items of `itemsize` bytes (0, or -1 with an exception). */
static int get_items(PyObject *o, Py_buffer *v, Py_ssize_t itemsize, const char *what) {
    if (PyObject_GetBuffer(o, v, PyBUF_C_CONTIGUOUS) < 0)
        return -1;
    if (v->len % itemsize) {
        PyBuffer_Release(v);
        PyErr_Format(PyExc_ValueError, "%s: a buffer of %zd-byte items expected", what, itemsize);
        return -1;
    }
    return 0;
}

/* set_pinned(sids): the pinned entries are sids (an int64 buffer) from now on: pinned_bytes
 * counted again and the heap rebuilt. */
static PyObject *Entries_set_pinned(Entries *c, PyObject *o) {
    Py_buffer v;
    if (get_items(o, &v, 8, "set_pinned") < 0)
        return NULL;
    const int64_t *sids = v.buf;
    Py_ssize_t n = v.len / 8;
    for (Py_ssize_t i = 0; i < n; i++)
        if (sids[i] < 0 || sids[i] >= INT32_MAX || ensure(c, (Py_ssize_t)sids[i]) < 0) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_ValueError, "set_pinned: sample id out of range");
            PyBuffer_Release(&v);
            return NULL;
        }
    for (Py_ssize_t s = 0; s < c->cap; s++)
        c->flags[s] &= ~PINNED;
    for (Py_ssize_t i = 0; i < n; i++)
        c->flags[sids[i]] |= PINNED;
    PyBuffer_Release(&v);
    c->pinned_bytes = 0;
    for (Py_ssize_t s = 0; s < c->cap; s++)
        if (c->data[s] != NULL && (c->flags[s] & PINNED)) {
            Py_ssize_t len = data_len(c->data[s]);
            if (len < 0)
                return NULL;
            c->pinned_bytes += len + c->overhead;
        }
    heap_rebuild(c);
    Py_RETURN_NONE;
}

/* set_keys(sids, keys): each cached sid of an int64 buffer needed next at keys[i] (a float64
 * buffer), then the heap rebuilt: a new order. */
static PyObject *Entries_set_keys(Entries *c, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2)
        return PyErr_Format(PyExc_TypeError, "set_keys(sids, keys)");
    Py_buffer s, k;
    if (get_items(args[0], &s, 8, "set_keys: sids") < 0)
        return NULL;
    if (get_items(args[1], &k, 8, "set_keys: keys") < 0) {
        PyBuffer_Release(&s);
        return NULL;
    }
    Py_ssize_t n = s.len / 8;
    if (k.len / 8 < n) {
        PyBuffer_Release(&s);
        PyBuffer_Release(&k);
        return PyErr_Format(PyExc_ValueError, "set_keys: a key a sample");
    }
    const int64_t *sids = s.buf;
    const double *keys = k.buf;
    for (Py_ssize_t i = 0; i < n; i++)
        if (sids[i] >= 0 && sids[i] < c->cap && c->data[sids[i]] != NULL)
            c->key[sids[i]] = keys[i];
    PyBuffer_Release(&s);
    PyBuffer_Release(&k);
    heap_rebuild(c);
    Py_RETURN_NONE;
}

/* The cached sample ids, ascending, as int64 bytes. */
static PyObject *Entries_cached_ids(Entries *c, PyObject *unused) {
    PyObject *out = PyBytes_FromStringAndSize(NULL, c->count * 8);
    if (out == NULL)
        return NULL;
    int64_t *p = (int64_t *)PyBytes_AS_STRING(out);
    for (Py_ssize_t s = 0; s < c->cap; s++)
        if (c->data[s] != NULL)
            *p++ = s;
    return out;
}

/* set_kept(sid, kept): whether an open handle keeps sid's bytes (an entry that leaves calls
 * self._left(sid, bytes) while it does). */
static PyObject *Entries_set_kept(Entries *c, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2)
        return PyErr_Format(PyExc_TypeError, "set_kept(sid, kept)");
    Py_ssize_t sid = sid_of(args[0]);
    int on = PyObject_IsTrue(args[1]);
    if (sid < 0 || on < 0 || ensure(c, sid) < 0)
        return NULL;
    c->flags[sid] = on ? c->flags[sid] | KEPT : c->flags[sid] & ~KEPT;
    Py_RETURN_NONE;
}

/* (checks) (entries {sid: bytes}, keys {sid: key}, reservations {sid: cost}, heap [sid...]) */
static PyObject *Entries_dump(Entries *c, PyObject *unused) {
    PyObject *entries = PyDict_New(), *keys = PyDict_New(), *res = PyDict_New();
    PyObject *heap = PyList_New(c->hlen), *out = NULL;
    if (entries == NULL || keys == NULL || res == NULL || heap == NULL)
        goto end;
    for (Py_ssize_t s = 0; s < c->cap; s++) {
        PyObject *o = PyLong_FromSsize_t(s), *v;
        if (o == NULL)
            goto end;
        int rc = 0;
        if (c->data[s] != NULL) {
            rc = PyDict_SetItem(entries, o, c->data[s]);
            if (rc == 0 && (v = PyFloat_FromDouble(c->key[s])) != NULL) {
                rc = PyDict_SetItem(keys, o, v);
                Py_DECREF(v);
            } else if (rc == 0) {
                rc = -1;
            }
        }
        if (rc == 0 && c->res[s] >= 0 && (v = PyLong_FromLongLong(c->res[s])) != NULL) {
            rc = PyDict_SetItem(res, o, v);
            Py_DECREF(v);
        } else if (rc == 0 && c->res[s] >= 0) {
            rc = -1;
        }
        Py_DECREF(o);
        if (rc < 0)
            goto end;
    }
    for (Py_ssize_t i = 0; i < c->hlen; i++) {
        PyObject *o = PyLong_FromLong(c->heap[i]);
        if (o == NULL)
            goto end;
        PyList_SET_ITEM(heap, i, o);
    }
    out = PyTuple_Pack(4, entries, keys, res, heap);
end:
    Py_XDECREF(entries);
    Py_XDECREF(keys);
    Py_XDECREF(res);
    Py_XDECREF(heap);
    return out;
}

static PyObject *Entries_free(Entries *c, void *unused) {
    return PyLong_FromLongLong(c->budget - c->used - c->reserved);
}

static PyMethodDef Entries_methods[] = {
    {"get", (PyCFunction)Entries_get, METH_O, "get(sid): sid's bytes, or None"},
    {"rekey", (PyCFunction)(void (*)(void))Entries_rekey, METH_FASTCALL,
     "rekey(sid, key): sid (if cached) is needed next at key now"},
    {"rekey_many", (PyCFunction)Entries_rekey_many, METH_O, "rekey() of each pair of [sid, key, sid, key, ...]"},
    {"reserve_many", (PyCFunction)(void (*)(void))Entries_reserve_many, METH_FASTCALL,
     "reserve_many(sids, sizes, keys): see cache.SampleCache"},
    {"settle", (PyCFunction)Entries_settle, METH_O, "settle(sid): see cache.SampleCache"},
    {"settle_many", (PyCFunction)Entries_settle_many, METH_O, "settle() of the sid of each (sid, _)"},
    {"holds_reservation", (PyCFunction)Entries_holds_reservation, METH_O, "whether sid holds a reservation"},
    {"reserved_among", (PyCFunction)Entries_reserved_among, METH_O,
     "reserved_among(sids) -> {sid, ...}: those of sids that hold a reservation"},
    {"put_many", (PyCFunction)(void (*)(void))Entries_put_many, METH_VARARGS | METH_KEYWORDS,
     "put_many(items, keys, start=0, told=()): see cache.SampleCache"},
    {"drop", (PyCFunction)Entries_drop, METH_O, "drop(sid): whether sid was cached (it is not now)"},
    {"_cover", (PyCFunction)Entries_cover, METH_NOARGS, "evict entries no order needs while past the budget"},
    {"_set_pinned", (PyCFunction)Entries_set_pinned, METH_O, "the pinned samples (an int64 buffer)"},
    {"_set_keys", (PyCFunction)(void (*)(void))Entries_set_keys, METH_FASTCALL,
     "_set_keys(sids, keys): int64 and float64 buffers; the heap rebuilt"},
    {"_cached_ids", (PyCFunction)Entries_cached_ids, METH_NOARGS, "the cached ids, int64 bytes"},
    {"_set_kept", (PyCFunction)(void (*)(void))Entries_set_kept, METH_FASTCALL,
     "_set_kept(sid, kept): whether a handle keeps sid's bytes"},
    {"_dump", (PyCFunction)Entries_dump, METH_NOARGS, "(entries, keys, reservations, heap), for checks"},
    {NULL},
};

static PyMemberDef Entries_members[] = {
    {"budget", T_LONGLONG, offsetof(Entries, budget), 0, "the byte budget"},
    {"overhead", T_LONGLONG, offsetof(Entries, overhead), READONLY, "what an entry costs beyond its bytes"},
    {"used", T_LONGLONG, offsetof(Entries, used), READONLY, "bytes the entries cost"},
    {"reserved", T_LONGLONG, offsetof(Entries, reserved), READONLY, "bytes the reservations cost"},
    {"outside", T_LONGLONG, offsetof(Entries, outside), 0, "bytes handles keep apart from the entries"},
    {"peak", T_LONGLONG, offsetof(Entries, peak), READONLY, "the most used + reserved"},
    {"evictions", T_LONGLONG, offsetof(Entries, evictions), READONLY, "entries evicted"},
    {"pinned_bytes", T_LONGLONG, offsetof(Entries, pinned_bytes), READONLY, "bytes the pinned entries cost"},
    {"heap_items", T_PYSSIZET, offsetof(Entries, hlen), READONLY, "items in the eviction heap"},
    {NULL},
};

static PyGetSetDef Entries_getset[] = {
    {"free", (getter)Entries_free, NULL, "budget - used - reserved", NULL},
    {NULL},
};

static PySequenceMethods Entries_as_sequence = {
    .sq_length = (lenfunc)Entries_len,
    .sq_contains = (objobjproc)Entries_contains,
};

static PyTypeObject EntriesType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "fusefs._cachecore.Entries",
    .tp_basicsize = sizeof(Entries),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "The sample cache's entries, reservations and eviction heap (see the module).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Entries_init,
    .tp_dealloc = (destructor)Entries_dealloc,
    .tp_traverse = (traverseproc)Entries_traverse,
    .tp_clear = (inquiry)Entries_clear,
    .tp_methods = Entries_methods,
    .tp_members = Entries_members,
    .tp_getset = Entries_getset,
    .tp_as_sequence = &Entries_as_sequence,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "fusefs._cachecore", "The sample cache's entries and eviction order in C.", -1, NULL,
};

PyMODINIT_FUNC PyInit__cachecore(void) {
    if (PyType_Ready(&EntriesType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddObjectRef(m, "Entries", (PyObject *)&EntriesType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
