/* fusefs._eventscore: a batch of the fast path's events scanned in C (core.Core.answered).
 *
 * The fast path's C threads answer opens, reads and releases of samples the daemon or the
 * kernel holds, and tell the loop of each as an event (handles.py gives their layout). A
 * fetched sample costs the loop three: its open (counted as an open of a pushed sample where
 * the kernel holds its pages), its read (a hit, a recent read for the scan detection, and
 * the kernel taken to hold the pages of a read that reached the sample's end) and its
 * release (a use to count). In Python that was about 150 opcodes a sample; here the common
 * events of a batch are counted in one call, and the release's uses and the misses to fetch
 * come back as lists. The scan stops at an event that needs the loop's Python in its turn
 * (a forget, whose sample's uses before it must be counted first; a read of pages the
 * kernel had dropped): the caller applies it and calls again from the next, so a call costs
 * the events it counts, not the batch's: the events are read where they lie (a buffer of
 * native 64-bit values, what the fast path hands over), a list or tuple item by item. With
 * the GIL (the loop's). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

/* scan(events, start, held, through, bits) -> (stop, opens, reads, releases, opens_held, last,
 * used, missed, recent): see the module's comment (recent: the reads that are hits); held: the kernel's flags, a byte a
 * sample (a read that reached its sample's end sets its flag where `through`); bits:
 * (RELEASED, READ, READ_END, READ_LOST, MISSED, SID_MASK), handles.py's. */
static PyObject *scan(PyObject *self, PyObject *args) {
    PyObject *events_o, *held_o;
    Py_ssize_t start;
    int through;
    unsigned long long released, read, read_end, read_lost, missed_bit, sid_mask;
    if (!PyArg_ParseTuple(args, "OnOp(KKKKKK)", &events_o, &start, &held_o, &through, &released, &read,
                          &read_end, &read_lost, &missed_bit, &sid_mask))
        return NULL;
    /* the events: a buffer of unsigned 64-bit values read in place, or a list or tuple
     * (never copied whole: a call from `start` must not cost the events before it) */
    Py_buffer ev = {0};
    int in_buffer = 0;
    const uint64_t *evbuf = NULL;
    PyObject *events = NULL;
    Py_ssize_t n;
    if (PyObject_CheckBuffer(events_o)) {
        if (PyObject_GetBuffer(events_o, &ev, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
            return NULL;
        const char *f = ev.format ? ev.format : "B";
        if (*f == '<' || *f == '=' || *f == '@')
            f++;
        if (ev.itemsize != 8 || (strcmp(f, "Q") != 0 && strcmp(f, "L") != 0 && strcmp(f, "K") != 0)) {
            PyBuffer_Release(&ev);
            PyErr_SetString(PyExc_TypeError, "scan: events must be unsigned 64-bit values");
            return NULL;
        }
        in_buffer = 1;
        evbuf = ev.buf;
        n = ev.len / 8;
    } else if (PyList_Check(events_o) || PyTuple_Check(events_o)) {
        events = events_o;
        Py_INCREF(events);
        n = PySequence_Fast_GET_SIZE(events);
    } else {
        PyErr_SetString(PyExc_TypeError, "scan: events must be a buffer of 64-bit values, a list or a tuple");
        return NULL;
    }
    Py_buffer v;
    if (PyObject_GetBuffer(held_o, &v, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) {
        Py_XDECREF(events);
        if (in_buffer)
            PyBuffer_Release(&ev);
        return NULL;
    }
    uint8_t *held = v.buf;
    Py_ssize_t nheld = v.len, i = start < 0 ? 0 : start;
    long long opens = 0, reads = 0, releases = 0, opens_held = 0;
    unsigned long long last = 0;
    PyObject *used = PyList_New(0), *missed = PyList_New(0), *recent = PyList_New(0), *out = NULL;
    if (used == NULL || missed == NULL || recent == NULL)
        goto end;
    for (; i < n; i++) {
        unsigned long long e;
        if (in_buffer) {
            e = evbuf[i];
        } else {
            e = PyLong_AsUnsignedLongLong(PySequence_Fast_GET_ITEM(events, i));
            if (e == (unsigned long long)-1 && PyErr_Occurred())
                goto end;
        }
        unsigned long long sid = e & sid_mask;
        if (sid >= (unsigned long long)nheld) {
            PyErr_Format(PyExc_IndexError, "scan: sample %llu out of range", sid);
            goto end;
        }
        PyObject *to = NULL;
        if (e >= released) {
            if (e & read)
                break; /* a forget: the caller's */
            releases++;
            to = used;
        } else if (e >= read) {
            if ((e & missed_bit) && !(e & read_end)) {
                to = missed; /* (its answer has READ_END: counted then) */
            } else {
                if (e & read_lost)
                    break; /* the kernel had dropped its pages: the caller's */
                reads++;
                if (!(e & missed_bit)) /* a hit (a miss's answer was counted as a miss) */
                    to = recent;
                if ((e & read_end) && through)
                    held[sid] = 1;
            }
        } else {
            opens++;
            if (held[sid])
                opens_held++;
            last = e;
        }
        if (to != NULL) {
            PyObject *o = PyLong_FromUnsignedLongLong(sid);
            if (o == NULL || PyList_Append(to, o) < 0) {
                Py_XDECREF(o);
                goto end;
            }
            Py_DECREF(o);
        }
    }
    out = Py_BuildValue("nLLLLKOOO", i, opens, reads, releases, opens_held, last, used, missed, recent);
end:
    PyBuffer_Release(&v);
    Py_XDECREF(events);
    if (in_buffer)
        PyBuffer_Release(&ev);
    Py_XDECREF(used);
    Py_XDECREF(missed);
    Py_XDECREF(recent);
    return out;
}

static PyMethodDef methods[] = {
    {"scan", scan, METH_VARARGS,
     "scan(events, start, held, through, bits) -> (stop, opens, reads, releases, opens_held, last, used, "
     "missed, recent): a batch of the fast path's events counted (see the source)"},
    {NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "fusefs._eventscore", "A batch of the fast path's events scanned in C.", -1, methods,
};

PyMODINIT_FUNC PyInit__eventscore(void) {
    return PyModule_Create(&module);
}
