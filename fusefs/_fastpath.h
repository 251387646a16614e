/* fusefs's fast path: a thread of pyfuse3 that reads /dev/fuse and answers, in C, the
 * requests a sample the kernel already holds costs (lookup, open, ioctl, release, forget
 * of a dataset file), and the reads of samples the daemon's cache holds; it hands every
 * other request to pyfuse3's request loop unchanged.
 *
 * scripts/pyfuse3_patched.py copies this file into pyfuse3's sources (patch "fast"):
 * _session_loop then takes its requests from fusefs_receive() and waits on
 * fusefs_wait_fd(), which are libfuse's receive and the FUSE fd until the thread runs.
 *
 * An open of a dataset file (inode in [file_base, file_base + n_files), no write flag) is
 * answered with handle (serial << sid_bits) | sample, keep_cache, exactly as fusefs's
 * Core.open would; a release of a handle below fh_base is answered at once. Both are
 * recorded, in order, as events (the handle; a release's with the `released` bit set) that fusefs drains
 * with fusefs_fast_take() for its accounting (the order's uses, the statistics): the
 * event fd becomes readable once `batch` events are waiting, or `delay_us` after the
 * first that fusefs must learn of soon. The opens and releases of samples the kernel holds
 * (its flags, below), while fusefs fetches nothing (no sample came into its cache,
 * fusefs_fast_hold, for FUSEFS_LAZY times the delay), only tell it of uses it has nothing
 * to do for: while nothing else waits they wait FUSEFS_LAZY times as long (an idle loop's
 * wake costs it several times a busy one's: docs/HOTPATH.md, "What a wake of the idle loop
 * costs"). While it fetches, the read-ahead needs them (the readers' progress moves it on).
 * While fusefs's read-ahead has covered its orders (fusefs_fast_idle: nothing it could
 * fetch waits for the readers' progress), they wait FUSEFS_IDLE times the delay, and
 * FUSEFS_IDLE_BATCH times the batch: only a new order gives it work then, and fusefs takes
 * the events before it applies one. So do, then, the opens, releases and reads of samples
 * the kernel does not hold (a read the thread answers needs nothing of the loop; one it
 * cannot answer goes to the loop, which takes the events first); a read of a sample
 * fusefs took the kernel to hold (`read_lost`) and a forget never wait longer than the
 * delay (the read-ahead may have to fetch again what it passed over).
 * fusefs also takes them before it handles each request handed to the loop, so that it
 * sees everything in the order the kernel sent it.
 *
 * A read of a dataset handle is answered here when the sample's bytes are held: fusefs
 * mirrors its cache into a table (fusefs_fast_hold: sample -> a bytes object, to which the
 * table holds a reference). The thread reads such an object's bytes without the GIL (a
 * bytes object's size and contents never change): it takes the object from the table under
 * `held_lock` and marks it as the one it copies from (`copying`) before it lets go of the
 * lock, and an object leaves the table under that lock; its reference is dropped once no
 * thread copies from it (a hold never waits for a reply, with the GIL held). The read is
 * an event too: the sample with the `read` bit set, `read_end` when it reached the
 * sample's end (the kernel then holds every page of it), and `read_lost` when fusefs
 * took the kernel to hold the sample's pages at the time of the read (its flags, one byte
 * per sample, fusefs_fast_kernel_flags): the kernel dropped them. The flag is read here,
 * when the read is answered, not when fusefs applies the event: a push of the sample that
 * ends after the read (it waits for the pages the read holds) must not make it look lost.
 *
 * A read of a sample that is not held but that a fetch's worker thread is to hold (fusefs
 * marks such samples as their batch starts: fusefs_fast_expect) waits here (parked: the
 * request is kept, with the fd it came from) instead of going to the loop. The hold of the
 * sample's bytes (fusefs_fast_hold, from that worker thread) takes the reads that wait for
 * it, and its caller answers them without the GIL (fusefs_fast_answer_parked), each as a
 * read of a held sample (its event, then its reply on its fd); a hold of NULL (the fetch
 * failed, or fusefs does not keep the sample) hands them to the loop as they came. The
 * `expected` byte of a sample is written under held_lock's write lock and a read parks under
 * its read lock, so a hold either sees a read parked or the read sees the sample held. An
 * interrupt of a parked read answers it EINTR (as the loop answers an interrupted read).
 * Parked reads are bounded by the kernel's requests outstanding.
 *
 * With misses told (fusefs_fast_misses, before the start), a read that takes the whole of a
 * sample (offset 0, the tree's size or more) neither held nor expected waits here too: it
 * marks the sample expected and becomes an event at once (`read` | `missed` | sample; a
 * second read of it meanwhile waits for the same, untold). fusefs fetches the sample and
 * its worker thread hands the bytes over (fusefs_fast_hand: the reads that wait are
 * answered, nothing is held; the answer of the read that told of the miss carries `missed`
 * and `read_end`), or fusefs lets the reads go to the loop (a hold of NULL). A read of part
 * of a sample still goes to the loop, which keeps its bytes for the handle's next read.
 *
 * A lookup of a dataset file's name (a file, not a folder, in one of the dataset's folders)
 * is answered here too, as fusefs's Core.lookup would, from the tree fusefs hands over
 * before the thread starts (fusefs_fast_tree: per folder its run of files, sorted by name;
 * per file its name, size, mode and mtime). Every other name goes to the loop. A forget
 * needs no answer: that of a dataset file is an event (`released` | `read` | sample), and
 * that of any other inode is dropped (fusefs keeps no lookup counts).
 *
 * An interrupt (FUSE_INTERRUPT) needs no answer. That of a request answered here (the
 * thread keeps the uniques of the last FUSEFS_ANSWERED it answered; the kernel sends an
 * interrupt as the signal comes, so its request is among them) is taken here: libfuse,
 * which never saw that request, would keep the interrupt on its list until the next
 * request it handles, and a reader that signals itself while every read is answered here
 * would grow that list without bound. Any other goes to the loop, where libfuse marks the
 * request it names and the binding answers an interrupted read EINTR at once (a killed
 * reader's request would otherwise be waited for until it is answered).
 *
 * The thread reads first and waits (poll) only when nothing is queued: under load a
 * request costs it a read and a writev, as in libfuse's own loop.
 *
 * There may be several such threads (fusefs_fast_start's nthreads): the first reads the
 * session's fd, each other its own clone of it (FUSE_DEV_IOC_CLONE), as libfuse's
 * multithreaded loop does, so the kernel hands requests to whichever thread waits. A
 * request's answer must be written to the fd it was read from: the threads answer theirs
 * on their own fd, and a request a thread hands to the loop is noted with its fd
 * (fusefs_route), which the loop's replies are written to through libfuse's custom I/O
 * (fusefs_fast_io: the session's writev looks the reply's request up). The threads share
 * the events (under `lock`), the held table (a rwlock, held only to take or change an
 * entry, never while a reply is copied), the handles' serial and the counts
 * (atomic). An open's or a read's event is queued before its reply, so that the release
 * that may follow at once on another thread comes after it.
 *
 * This header is compiled into pyfuse3's Cython module, after Python.h. */
#ifndef FUSEFS_FASTPATH_H
#define FUSEFS_FASTPATH_H

#include "_missapi.h"
#include "_publishapi.h"
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>
#include <linux/fuse.h>
#include <fuse_lowlevel.h>

#define FUSEFS_BUFSIZE (256 * 4096 + 4096) /* libfuse's: FUSE_MAX_MAX_PAGES pages + a header page */
#define FUSEFS_ANSWERED 1024  /* the uniques of the requests answered last, for their interrupts */
#define FUSEFS_LAZY 5  /* lazy events wait this many times the delay (fusefs_event) */
#define FUSEFS_IDLE 50  /* ... and this many, while the read-ahead is idle (fusefs_fast_idle) */
#define FUSEFS_IDLE_BATCH 16  /* ... when this many times the batch wait */
/* an event's hurry (fusefs_event): it reaches fusefs within the delay (NOW); may wait longer
 * (LAZY: fusefs_events_lazy_delays); or within the delay unless the read-ahead is idle,
 * then as a lazy one (IDLE); or at once (AT_ONCE: a miss, whose reader waits for fusefs) */
enum { FUSEFS_EV_NOW, FUSEFS_EV_LAZY, FUSEFS_EV_IDLE, FUSEFS_EV_AT_ONCE };
#define FUSEFS_MAX_THREADS 64  /* (fast_path_thread_counts' array in internal.pxi holds as many) */
#define FUSEFS_INT_REQ_BIT (1ULL << 0)  /* an interrupt's unique: its request's with this bit */
/* The events' bits are fusefs's (fusefs/core.py), given at the start: single, distinct
 * bits; `released` and `read` above every handle (serial_wrap << sid_bits), so that an open's
 * event (its handle) has neither and a release's never has `read`'s; `read_end` and
 * `read_lost`, which come only with `read` | sample, above every sample (1 << sid_bits); a
 * forget is `released` | `read` | sample (fusefs_fast_start checks them). */

/* the dataset's tree, for lookups (fusefs_fast_tree), or n_dirs 0 */
typedef struct {
    uint64_t n_dirs;  /* folder d is inode d + 1 */
    const uint64_t *dir_first_file, *dir_nfiles, *name_off, *size;
    const uint32_t *name_len, *mode;
    const int64_t *mtime_ns;
    const char *names;
    uint64_t names_len, timeout_s;
    uint32_t uid, gid, blksize;
} fusefs_tree;

typedef struct fusefs_req {
    struct fusefs_req *next;
    size_t len;
    char data[];
} fusefs_req;

/* a read of an expected sample (fusefs_fast_expect) that waits for a fetch thread's hold */
typedef struct fusefs_parked {
    struct fusefs_parked *next;
    int fd;          /* the fd it was read from: its answer goes there */
    uint64_t sid;
    uint64_t ev_bits; /* more bits of its answer's event: ev_missed for the read that told
                       * fusefs of its miss (its answer then has ev_missed and ev_read_end) */
    size_t len;
    char data[];     /* the request */
} fusefs_parked;

#define FUSEFS_EXPECTED 1  /* expected[sid]: a fetch thread will hold the sample, or let it go */
#define FUSEFS_WAITED 2    /* ... and a read of it waits (is parked) */

/* unique -> fd, for the requests a thread read from a cloned fd and handed to the loop:
 * open addressing, linear probing, backward-shift deletion; grows when half full */
typedef struct {
    uint64_t *keys;
    int *fds;
    size_t cap, n;
    pthread_mutex_t lock;
} fusefs_routes;

static struct {
    int running;         /* the threads were started and not yet joined */
    int fd;              /* /dev/fuse: the session's */
    int fwd_fd;          /* eventfd: requests for the loop are queued, or the thread ended */
    int ev_fd;           /* eventfd: events are waiting */
    int stop_fd;         /* eventfd: the thread is to stop */
    int nthreads, alive; /* threads started; threads not yet ended (under lock) */
    pthread_t threads[FUSEFS_MAX_THREADS];
    int fds[FUSEFS_MAX_THREADS];  /* fds[0]: the session's; the others cloned from it */
    unsigned long long answered_by[FUSEFS_MAX_THREADS];  /* requests each thread answered (atomic) */
    pthread_mutex_t lock;
    fusefs_req *head, *tail;
    int ended, err;      /* the thread ended; with this errno (0: the mount went away) */
    int stop;            /* the thread is to stop (with a kick of stop_fd) */
    /* the dataset's files (set once, before the thread starts) */
    uint64_t file_base, n_files, fh_base, serial, serial_wrap, write_flags;
    unsigned sid_bits;
    /* events, under lock */
    uint64_t *ev;
    size_t ev_n, ev_cap, batch;
    int ev_signalled;
    int ev_urgent, ev_eager;  /* an event waits that is FUSEFS_EV_NOW, FUSEFS_EV_IDLE */
    struct timespec ev_first, ev_urgent_first, ev_eager_first;
    long delay_ns;
    long long filled_ns;  /* when a sample last came into fusefs's cache (atomic; monotonic ns) */
    int idle;             /* fusefs's read-ahead has covered its orders (atomic; fusefs_fast_idle) */
    /* requests answered here, and the bytes of the reads (atomic) */
    unsigned long long opens, releases, ioctls, reads, read_bytes;
    /* sample -> a bytes object holding its bytes, or NULL (n_files of them), under held_lock
     * (the threads read-lock it to take an object; a hold write-locks it to change one) */
    PyObject **held;
    pthread_rwlock_t held_lock;
    int held_lock_ready;
    /* per thread, the held object its reply is copied from, or NULL (atomic; set under
     * held_lock's read lock): an object a hold takes out of the table is released only once
     * no thread copies from it (until then it waits in `dropped`, under the GIL) */
    PyObject *copying[FUSEFS_MAX_THREADS];
    PyObject **dropped;
    size_t dropped_n, dropped_cap;
    /* sample -> nonzero while fusefs takes the kernel to hold its pages (fusefs's array;
     * read without a lock: a byte, and a stale value is what a read racing a push sees) */
    const unsigned char *kernel_flags;
    uint64_t kernel_flags_n;
    /* sample -> FUSEFS_EXPECTED | FUSEFS_WAITED bits (n_files bytes, with `held`): written
     * under held_lock's write lock, and WAITED under its read lock with parked_lock */
    unsigned char *expected;
    fusefs_parked *parked;  /* the reads that wait for expected samples, under parked_lock */
    size_t parked_n;
    pthread_mutex_t parked_lock;
    unsigned long long reads_parked, parked_forwarded, misses_parked;  /* (atomic) */
    fusefs_tree tree;  /* for lookups (fusefs_fast_tree; the caller keeps it alive) */
    unsigned long long lookups, forgets, interrupts, interrupts_forwarded;  /* (atomic) */
    uint64_t answered[FUSEFS_ANSWERED];  /* a ring of the uniques answered here (atomic) */
    unsigned long long answered_n;
    uint64_t ev_released, ev_read, ev_read_end, ev_read_lost;  /* the events' bits */
    uint64_t ev_missed;  /* with ev_read: a read of a sample neither held nor expected waits
                          * here (fusefs_fast_misses; 0: such reads go to the loop) */
    fusefs_routes routes;
} fusefs_fast = {0, -1, -1, -1, -1, .lock = PTHREAD_MUTEX_INITIALIZER,
                 .parked_lock = PTHREAD_MUTEX_INITIALIZER,
                 .routes = {.lock = PTHREAD_MUTEX_INITIALIZER}};

/* ---- the miss engine's lanes (fusefs/_missapi.h) ----
 * A miss the engine is to read is queued on its sample's lane (a ring per lane, under
 * `lock`), and that lane's reader (fusefs/_fetchio.c) takes the lane's queue as a batch. A
 * miss goes to the loop instead (told as an event, as without the engine) while the engine
 * is off, when the sample before it was missed lately (a scan: the loop fetches the samples
 * that follow along with it), when its lane is full, and while its lane's reader has been
 * reading one batch for FUSEFS_STUCK_NS (a node that does not answer: the loop waits for it
 * within the user's bound). done() read-locks `gate` and the stop write-locks it, so no
 * reader touches the fast path's tables once the engine stopped. */
#define FUSEFS_LANE_CAP 1024       /* misses queued on a lane at most */
#define FUSEFS_RECENT 64           /* the misses last queued or told, for a scan's */
#define FUSEFS_STUCK_NS 1000000000LL
#define FUSEFS_SLOW_NS 200000LL    /* a read this long: the node is slow, more readers read */

typedef struct {
    uint64_t ring[FUSEFS_LANE_CAP];
    size_t head, n;
    pthread_cond_t ready;
    int waiting, busy;     /* its readers waiting for misses; reading a batch */
    int slow;              /* its last batch's reads took over FUSEFS_SLOW_NS: its readers share */
    long long progress_ns; /* when one of its readers last took a batch or finished one */
} fusefs_lane;

static struct {
    pthread_mutex_t lock;
    pthread_rwlock_t gate;
    const unsigned char *lane_of;  /* per sample its lane (the caller keeps it alive) */
    uint64_t n;
    int nlanes, on, stopped;
    fusefs_lane *lanes;
    uint64_t recent[FUSEFS_RECENT];  /* sid + 2 of the misses last seen (0: none) */
    unsigned recent_at;
    unsigned long long queued, to_loop, answered, handed_back;  /* (under lock; answered and
                                                                   * handed_back atomic) */
} fusefs_miss = {.lock = PTHREAD_MUTEX_INITIALIZER, .gate = PTHREAD_RWLOCK_INITIALIZER, .stopped = 1};

static __thread int fusefs_tfd = -1;  /* the fd this thread reads (-1: not a fast path thread) */
static __thread int fusefs_tno = 0;   /* and its number */

static void fusefs_fast_drop_table(void);

static void fusefs_kick(int fd) {
    uint64_t one = 1;
    ssize_t r = write(fd, &one, sizeof one);
    (void) r;
}

static void fusefs_unkick(int fd) {
    uint64_t v;
    ssize_t r = read(fd, &v, sizeof v);
    (void) r;
}

/* the reply to request `unique`, written to fd (the one the request was read from) */
static void fusefs_reply_on(int fd, uint64_t unique, int err, const void *arg, size_t len) {
    struct fuse_out_header out;
    struct iovec iov[2];
    out.len = (uint32_t) (sizeof out + len);
    out.error = -err;
    out.unique = unique;
    iov[0].iov_base = &out;
    iov[0].iov_len = sizeof out;
    iov[1].iov_base = (void *) arg;
    iov[1].iov_len = len;
    /* (ENOENT: the request was interrupted and the kernel no longer waits for it) */
    ssize_t r = writev(fd, iov, len ? 2 : 1);
    (void) r;
    __atomic_add_fetch(&fusefs_fast.answered_by[fusefs_tno], 1, __ATOMIC_RELAXED);
    unsigned long long i = __atomic_fetch_add(&fusefs_fast.answered_n, 1, __ATOMIC_RELAXED);
    __atomic_store_n(&fusefs_fast.answered[i % FUSEFS_ANSWERED], unique, __ATOMIC_RELAXED);
}

/* the fd this thread answers on: its own, or (not a fast path thread) the session's */
static int fusefs_own_fd(void) {
    return fusefs_tfd >= 0 ? fusefs_tfd : fusefs_fast.fd;
}

static void fusefs_reply(uint64_t unique, int err, const void *arg, size_t len) {
    fusefs_reply_on(fusefs_own_fd(), unique, err, arg, len);
}

/* whether the request `unique` was among those answered here last */
static int fusefs_was_answered(uint64_t unique) {
    for (int i = 0; i < FUSEFS_ANSWERED; i++)
        if (__atomic_load_n(&fusefs_fast.answered[i], __ATOMIC_RELAXED) == unique)
            return 1;
    return 0;
}

static long fusefs_ns_since(const struct timespec *t) {
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (now.tv_sec - t->tv_sec) * 1000000000L + (now.tv_nsec - t->tv_nsec);
}

/* under lock: whether the waiting events, if every one is lazy, are to reach fusefs
 * within the delay all the same: a sample came into its cache (it fetches) within
 * FUSEFS_LAZY times the delay before the first of them, or since. */
static int fusefs_events_fetching(void) {
    long long first = (long long) fusefs_fast.ev_first.tv_sec * 1000000000LL + fusefs_fast.ev_first.tv_nsec;
    return __atomic_load_n(&fusefs_fast.filled_ns, __ATOMIC_RELAXED)
           > first - FUSEFS_LAZY * fusefs_fast.delay_ns;
}

/* under lock, with events waiting and every one lazy: how many times the delay they may
 * wait (1 if fusefs fetches; else FUSEFS_IDLE while its read-ahead is idle, FUSEFS_LAZY
 * while not) */
static int fusefs_events_lazy_delays(void) {
    if (fusefs_events_fetching())
        return 1;
    return __atomic_load_n(&fusefs_fast.idle, __ATOMIC_RELAXED) ? FUSEFS_IDLE : FUSEFS_LAZY;
}

/* under lock: whether a FUSEFS_EV_IDLE event waits and is to reach fusefs within the
 * delay (the read-ahead is not idle) */
static int fusefs_events_eager(void) {
    return fusefs_fast.ev_eager && !__atomic_load_n(&fusefs_fast.idle, __ATOMIC_RELAXED);
}

/* under lock: whether an event waits that is to reach fusefs within the delay (one
 * FUSEFS_EV_NOW, or fusefs_events_eager) */
static int fusefs_events_urgent(void) {
    return fusefs_fast.ev_urgent || fusefs_events_eager();
}

/* under lock, with events waiting: the ns left until they are to reach fusefs: the delay
 * after the first that is urgent (fusefs_events_urgent), or fusefs_events_lazy_delays times
 * it after the first of them */
static long fusefs_events_left_ns(void) {
    long left = fusefs_events_lazy_delays() * fusefs_fast.delay_ns - fusefs_ns_since(&fusefs_fast.ev_first);
    if (fusefs_fast.ev_urgent) {
        long l = fusefs_fast.delay_ns - fusefs_ns_since(&fusefs_fast.ev_urgent_first);
        left = l < left ? l : left;
    }
    if (fusefs_events_eager()) {
        long l = fusefs_fast.delay_ns - fusefs_ns_since(&fusefs_fast.ev_eager_first);
        left = l < left ? l : left;
    }
    return left;
}

/* under lock: whether as many events wait as are to reach fusefs now (the batch; while
 * none is urgent and fusefs's read-ahead is idle, FUSEFS_IDLE_BATCH times it) */
static int fusefs_events_full(void) {
    size_t n = fusefs_fast.ev_n;
    if (n < fusefs_fast.batch)
        return 0;
    return n / FUSEFS_IDLE_BATCH >= fusefs_fast.batch || fusefs_events_urgent()
           || fusefs_events_lazy_delays() != FUSEFS_IDLE;
}

/* under lock: make the event fd readable */
static void fusefs_signal_events(void) {
    if (fusefs_fast.ev_n && !fusefs_fast.ev_signalled) {
        fusefs_fast.ev_signalled = 1;
        fusefs_kick(fusefs_fast.ev_fd);
    }
}

/* Whether fusefs takes the kernel to hold sample sid's pages. */
static int fusefs_kernel_holds(uint64_t sid) {
    return sid < fusefs_fast.kernel_flags_n
           && __atomic_load_n(&fusefs_fast.kernel_flags[sid], __ATOMIC_RELAXED);
}

static long long fusefs_now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (long long) t.tv_sec * 1000000000LL + t.tv_nsec;
}

/* Queue event e for the loop, with its hurry (FUSEFS_EV_NOW, _LAZY or _IDLE: the batch's
 * deadline, fusefs_events_left_ns). */
static void fusefs_event(uint64_t e, int hurry) {
    pthread_mutex_lock(&fusefs_fast.lock);
    if (fusefs_fast.ev_n == fusefs_fast.ev_cap) {
        size_t cap = fusefs_fast.ev_cap ? 2 * fusefs_fast.ev_cap : 1024;
        uint64_t *ev = (uint64_t *) realloc(fusefs_fast.ev, cap * sizeof *ev);
        if (ev == NULL) {  /* (no room: the event is lost, and with it one use) */
            pthread_mutex_unlock(&fusefs_fast.lock);
            return;
        }
        fusefs_fast.ev = ev;
        fusefs_fast.ev_cap = cap;
    }
    if (fusefs_fast.ev_n == 0)
        clock_gettime(CLOCK_MONOTONIC, &fusefs_fast.ev_first);
    if ((hurry == FUSEFS_EV_NOW || hurry == FUSEFS_EV_AT_ONCE) && !fusefs_fast.ev_urgent) {
        fusefs_fast.ev_urgent = 1;
        clock_gettime(CLOCK_MONOTONIC, &fusefs_fast.ev_urgent_first);
    } else if (hurry == FUSEFS_EV_IDLE && !fusefs_fast.ev_eager) {
        fusefs_fast.ev_eager = 1;
        clock_gettime(CLOCK_MONOTONIC, &fusefs_fast.ev_eager_first);
    }
    fusefs_fast.ev[fusefs_fast.ev_n++] = e;
    if (hurry == FUSEFS_EV_AT_ONCE || fusefs_events_full())
        fusefs_signal_events();
    pthread_mutex_unlock(&fusefs_fast.lock);
}

static size_t fusefs_route_slot(const fusefs_routes *r, uint64_t unique) {
    return (size_t) ((unique * 0x9E3779B97F4A7C15ULL) >> 32) & (r->cap - 1);
}

/* (under the routes' lock) note that request `unique` is answered on fd; 0 or ENOMEM */
static int fusefs_route_put_locked(fusefs_routes *r, uint64_t unique, int fd) {
    if (2 * (r->n + 1) > r->cap) {
        size_t cap = r->cap ? 2 * r->cap : 256;
        uint64_t *keys = (uint64_t *) calloc(cap, sizeof *keys);
        int *fds = (int *) malloc(cap * sizeof *fds);
        if (keys == NULL || fds == NULL) {
            free(keys);
            free(fds);
            return ENOMEM;
        }
        fusefs_routes old = *r;
        r->keys = keys;
        r->fds = fds;
        r->cap = cap;
        r->n = 0;
        for (size_t i = 0; i < old.cap; i++)
            if (old.keys[i])
                fusefs_route_put_locked(r, old.keys[i], old.fds[i]);
        free(old.keys);
        free(old.fds);
    }
    size_t i = fusefs_route_slot(r, unique);
    while (r->keys[i] && r->keys[i] != unique)
        i = (i + 1) & (r->cap - 1);
    r->n += !r->keys[i];
    r->keys[i] = unique;
    r->fds[i] = fd;
    return 0;
}

/* The fd request `unique` is answered on (-1: the session's), taken out of the routes if
 * `take`. */
static int fusefs_route_get(uint64_t unique, int take) {
    fusefs_routes *r = &fusefs_fast.routes;
    int fd = -1;
    pthread_mutex_lock(&r->lock);
    if (r->cap) {
        size_t i = fusefs_route_slot(r, unique);
        while (r->keys[i] && r->keys[i] != unique)
            i = (i + 1) & (r->cap - 1);
        if (r->keys[i]) {
            fd = r->fds[i];
            if (take) {  /* backward-shift deletion: the probe runs stay whole */
                size_t j = i;
                r->keys[i] = 0;
                r->n--;
                for (;;) {
                    j = (j + 1) & (r->cap - 1);
                    if (!r->keys[j])
                        break;
                    size_t home = fusefs_route_slot(r, r->keys[j]);
                    if ((j > i && (home <= i || home > j)) || (j < i && (home <= i && home > j))) {
                        r->keys[i] = r->keys[j];
                        r->fds[i] = r->fds[j];
                        r->keys[j] = 0;
                        i = j;
                    }
                }
            }
        }
    }
    pthread_mutex_unlock(&r->lock);
    return fd;
}

/* libfuse's writes (the loop's replies), through the session's custom I/O: a reply to a
 * request read from a cloned fd goes to that fd (an interrupt's, to its request's) */
static ssize_t fusefs_io_writev(int fd, struct iovec *iov, int count, void *userdata) {
    (void) userdata;
    if (count > 0 && iov[0].iov_len >= sizeof (struct fuse_out_header)) {
        uint64_t unique = ((const struct fuse_out_header *) iov[0].iov_base)->unique;
        if (unique) {
            int to = fusefs_route_get(unique & ~FUSEFS_INT_REQ_BIT, !(unique & FUSEFS_INT_REQ_BIT));
            if (to >= 0)
                fd = to;
        }
    }
    return writev(fd, iov, count);
}

static ssize_t fusefs_io_read(int fd, void *buf, size_t len, void *userdata) {
    (void) userdata;
    return read(fd, buf, len);
}

static const struct fuse_custom_io fusefs_io = {.writev = fusefs_io_writev, .read = fusefs_io_read};

/* The custom I/O the session must use while several threads read (NULL: one does). */
static const struct fuse_custom_io *fusefs_fast_io(void) {
    return fusefs_fast.nthreads > 1 ? &fusefs_io : NULL;
}

/* a request for pyfuse3's loop, read from fd (its reply goes there) */
static void fusefs_forward_from(int fd, const char *data, size_t len) {
    fusefs_req *r = (fusefs_req *) malloc(sizeof *r + len);
    if (r == NULL) {  /* the kernel waits for an answer: tell it */
        fusefs_reply_on(fd, ((const struct fuse_in_header *) data)->unique, ENOMEM, NULL, 0);
        return;
    }
    r->next = NULL;
    r->len = len;
    memcpy(r->data, data, len);
    const struct fuse_in_header *h = (const struct fuse_in_header *) data;
    if (fd != fusefs_fast.fd && h->opcode != FUSE_INTERRUPT) {
        /* (read from a cloned fd: the loop's reply goes there) */
        pthread_mutex_lock(&fusefs_fast.routes.lock);
        int err = fusefs_route_put_locked(&fusefs_fast.routes, h->unique, fd);
        pthread_mutex_unlock(&fusefs_fast.routes.lock);
        if (err) {
            free(r);
            fusefs_reply_on(fd, h->unique, err, NULL, 0);
            return;
        }
    }
    pthread_mutex_lock(&fusefs_fast.lock);
    if (fusefs_fast.tail)
        fusefs_fast.tail->next = r;
    else {
        fusefs_fast.head = r;
        fusefs_kick(fusefs_fast.fwd_fd);
    }
    fusefs_fast.tail = r;
    pthread_mutex_unlock(&fusefs_fast.lock);
}

static void fusefs_forward(const char *data, size_t len) {
    fusefs_forward_from(fusefs_own_fd(), data, len);
}

/* Answer the read `in` (request unique, read from fd) of sample sid from its n bytes at buf:
 * its event first (as an open's: the release may come at once, on another thread). */
static void fusefs_read_reply(int fd, uint64_t unique, uint64_t sid, const struct fuse_read_in *in,
                              const char *buf, uint64_t n, uint64_t ev_bits) {
    uint64_t off = in->offset < n ? in->offset : n;
    uint64_t k = n - off < in->size ? n - off : in->size;
    int lost = fusefs_kernel_holds(sid);
    fusefs_event(fusefs_fast.ev_read | sid | (lost ? fusefs_fast.ev_read_lost : 0) | ev_bits
                 | (in->offset < n && in->offset + in->size >= n ? fusefs_fast.ev_read_end : 0),
                 lost ? FUSEFS_EV_NOW : FUSEFS_EV_IDLE);
    fusefs_reply_on(fd, unique, 0, buf + off, (size_t) k);
    __atomic_add_fetch(&fusefs_fast.reads, 1, __ATOMIC_RELAXED);
    __atomic_add_fetch(&fusefs_fast.read_bytes, k, __ATOMIC_RELAXED);
}

/* (under held_lock's read lock) 1 where the miss of sid is queued on its lane for the
 * engine's reader; 0: the loop is to hear of it. */
static int fusefs_miss_queue(uint64_t sid) {
    if (!__atomic_load_n(&fusefs_miss.on, __ATOMIC_RELAXED))
        return 0;
    int queued = 0, scan = 0;
    pthread_mutex_lock(&fusefs_miss.lock);
    for (unsigned i = 0; i < FUSEFS_RECENT; i++)
        if (fusefs_miss.recent[i] == sid + 1) {  /* (sid - 1's) */
            scan = 1;
            break;
        }
    fusefs_miss.recent[fusefs_miss.recent_at++ % FUSEFS_RECENT] = sid + 2;
    if (!scan && fusefs_miss.on && !fusefs_miss.stopped && sid < fusefs_miss.n) {
        fusefs_lane *l = &fusefs_miss.lanes[fusefs_miss.lane_of[sid]];
        if (l->n < FUSEFS_LANE_CAP && !(l->busy && !l->waiting
                                         && fusefs_now_ns() - l->progress_ns > FUSEFS_STUCK_NS)) {
            l->ring[(l->head + l->n++) % FUSEFS_LANE_CAP] = sid;
            if (!l->busy || l->slow)  /* (else the busy reader takes it next, with the others) */
                pthread_cond_signal(&l->ready);
            queued = 1;
        }
    }
    if (queued)
        fusefs_miss.queued++;
    else
        fusefs_miss.to_loop++;
    pthread_mutex_unlock(&fusefs_miss.lock);
    return queued;
}

/* (a lane's reader) Misses queued on lane, up to max, taken, waiting for one (read_ns: how
 * long a read of its last batch took on average, 0 at its first call); 0 once the engine
 * stopped. While the lane's reads are quick (a node that answers from memory) a reader
 * takes all there is, and a new miss wakes a reader only when none is reading: one reader
 * makes the batches and the others sleep (each wake costs CPU). Once a batch's reads took
 * FUSEFS_SLOW_NS (a node that answers slowly) the lane's readers share what is queued (each
 * takes the queue over the readers waiting, itself included, and wakes another while some
 * is left), and each new miss wakes one: their reads wait on the node side by side. */
static size_t fusefs_miss_take(int lane, uint64_t *out, size_t max, long long read_ns) {
    size_t k = 0;
    pthread_mutex_lock(&fusefs_miss.lock);
    if (lane < 0 || lane >= fusefs_miss.nlanes || fusefs_miss.lanes == NULL) {
        pthread_mutex_unlock(&fusefs_miss.lock);
        return 0;
    }
    fusefs_lane *l = &fusefs_miss.lanes[lane];
    if (read_ns) {
        if (l->busy > 0)
            l->busy--;
        l->progress_ns = fusefs_now_ns();
        l->slow = read_ns > FUSEFS_SLOW_NS;
    }
    while (!fusefs_miss.stopped && l->n == 0) {
        l->waiting++;
        pthread_cond_wait(&l->ready, &fusefs_miss.lock);
        l->waiting--;
    }
    if (!fusefs_miss.stopped) {
        size_t share = l->slow ? (l->n + (size_t) l->waiting) / ((size_t) l->waiting + 1) : l->n;
        if (share > max)
            share = max;
        for (; k < share; k++, l->n--) {
            out[k] = l->ring[l->head];
            l->head = (l->head + 1) % FUSEFS_LANE_CAP;
        }
        l->busy++;
        l->progress_ns = fusefs_now_ns();
        if (l->n && l->waiting && l->slow)
            pthread_cond_signal(&l->ready);
    }
    pthread_mutex_unlock(&fusefs_miss.lock);
    return k;
}

static void fusefs_fast_answer_parked(fusefs_parked *w, const char *buf, uint64_t n);
static fusefs_parked *fusefs_unpark(uint64_t sid, uint64_t unique);

/* (a lane's reader) The reads that wait for sid answered from buf's n bytes, or handed to
 * the loop (buf NULL); sid no longer expected. Nothing once the engine stopped. */
static void fusefs_miss_done(uint64_t sid, const char *buf, uint64_t n) {
    pthread_rwlock_rdlock(&fusefs_miss.gate);
    if (!__atomic_load_n(&fusefs_miss.stopped, __ATOMIC_RELAXED) && fusefs_fast.expected != NULL
            && sid < fusefs_fast.n_files) {
        pthread_rwlock_wrlock(&fusefs_fast.held_lock);
        fusefs_parked *w = fusefs_fast.expected[sid] & FUSEFS_WAITED ? fusefs_unpark(sid, 0) : NULL;
        fusefs_fast.expected[sid] = 0;
        pthread_rwlock_unlock(&fusefs_fast.held_lock);
        fusefs_fast_answer_parked(w, buf, n);
        __atomic_add_fetch(buf != NULL ? &fusefs_miss.answered : &fusefs_miss.handed_back, 1, __ATOMIC_RELAXED);
    }
    pthread_rwlock_unlock(&fusefs_miss.gate);
}

static const fusefs_miss_api fusefs_miss_api_table = {FUSEFS_MISS_API_VERSION, fusefs_miss_take, fusefs_miss_done};

/* (with the GIL) The engine's lanes: lane_of[n] (each below nlanes <= FUSEFS_MISS_LANES; the
 * caller keeps it alive until fusefs_fast_miss_stop), the engine off until
 * fusefs_fast_miss_engine. 0, or an errno (EINVAL: a lane out of range; EBUSY: lanes set
 * and not stopped; ENOMEM). */
static int fusefs_fast_miss_lanes(const unsigned char *lane_of, uint64_t n, int nlanes) {
    if (nlanes < 1 || nlanes > FUSEFS_MISS_LANES)
        return EINVAL;
    for (uint64_t i = 0; i < n; i++)
        if (lane_of[i] >= nlanes)
            return EINVAL;
    if (fusefs_miss.lanes != NULL)
        return EBUSY;
    fusefs_lane *lanes = (fusefs_lane *) calloc((size_t) nlanes, sizeof *lanes);
    if (lanes == NULL)
        return ENOMEM;
    for (int i = 0; i < nlanes; i++)
        pthread_cond_init(&lanes[i].ready, NULL);
    pthread_mutex_lock(&fusefs_miss.lock);
    fusefs_miss.lanes = lanes;
    fusefs_miss.nlanes = nlanes;
    fusefs_miss.lane_of = lane_of;
    fusefs_miss.n = n;
    fusefs_miss.on = 0;
    fusefs_miss.stopped = 0;
    memset(fusefs_miss.recent, 0, sizeof fusefs_miss.recent);
    pthread_mutex_unlock(&fusefs_miss.lock);
    return 0;
}

/* Whether new misses go to the engine (1) or to the loop (0); those queued are read still. */
static void fusefs_fast_miss_engine(int on) {
    __atomic_store_n(&fusefs_miss.on, on && fusefs_miss.lanes != NULL, __ATOMIC_RELAXED);
}

/* (with the GIL, or from the fast path's drop) Stop the engine: its readers' take() ends,
 * no done() touches the fast path from now on, and the misses still queued are handed to
 * the loop (hand_back; else they are left parked, for the fast path's drop to free). Then
 * the lanes are freed: fusefs_fast_miss_lanes may set new ones once the readers ended. */
static void fusefs_fast_miss_stop(int hand_back) {
    uint64_t *left = NULL;
    size_t nleft = 0;
    pthread_rwlock_wrlock(&fusefs_miss.gate);
    pthread_mutex_lock(&fusefs_miss.lock);
    fusefs_miss.on = 0;
    if (fusefs_miss.lanes != NULL && !fusefs_miss.stopped) {
        size_t total = 0;
        for (int i = 0; i < fusefs_miss.nlanes; i++)
            total += fusefs_miss.lanes[i].n;
        left = hand_back && total ? (uint64_t *) malloc(total * sizeof *left) : NULL;
        for (int i = 0; i < fusefs_miss.nlanes; i++) {
            fusefs_lane *l = &fusefs_miss.lanes[i];
            for (; l->n; l->n--, l->head = (l->head + 1) % FUSEFS_LANE_CAP)
                if (left != NULL)
                    left[nleft++] = l->ring[l->head];
            pthread_cond_broadcast(&l->ready);
        }
    }
    __atomic_store_n(&fusefs_miss.stopped, 1, __ATOMIC_RELAXED);
    pthread_mutex_unlock(&fusefs_miss.lock);
    pthread_rwlock_unlock(&fusefs_miss.gate);
    for (size_t i = 0; i < nleft; i++) {  /* (as done(sid, NULL) would, the engine stopped) */
        if (fusefs_fast.expected == NULL || left[i] >= fusefs_fast.n_files)
            continue;
        pthread_rwlock_wrlock(&fusefs_fast.held_lock);
        fusefs_parked *w = fusefs_fast.expected[left[i]] & FUSEFS_WAITED ? fusefs_unpark(left[i], 0) : NULL;
        fusefs_fast.expected[left[i]] = 0;
        pthread_rwlock_unlock(&fusefs_fast.held_lock);
        fusefs_fast_answer_parked(w, NULL, 0);
    }
    free(left);
}

/* (with the GIL, once the engine's readers ended) Forget the lanes. */
static void fusefs_fast_miss_free(void) {
    fusefs_fast_miss_stop(0);
    pthread_mutex_lock(&fusefs_miss.lock);
    fusefs_lane *lanes = fusefs_miss.lanes;
    int nlanes = fusefs_miss.nlanes;
    fusefs_miss.lanes = NULL;
    fusefs_miss.nlanes = 0;
    fusefs_miss.lane_of = NULL;
    fusefs_miss.n = 0;
    pthread_mutex_unlock(&fusefs_miss.lock);
    if (lanes != NULL) {
        for (int i = 0; i < nlanes; i++)
            pthread_cond_destroy(&lanes[i].ready);
        free(lanes);
    }
}

/* (with the GIL) The capsule of fusefs_miss_api_table (a new reference, or NULL). */
static PyObject *fusefs_fast_miss_api(void) {
    return PyCapsule_New((void *) &fusefs_miss_api_table, FUSEFS_MISS_API, NULL);
}

/* (queued, told to the loop, answered, handed to the loop) misses of the engine */
static void fusefs_fast_miss_counts(unsigned long long out[4]) {
    pthread_mutex_lock(&fusefs_miss.lock);
    out[0] = fusefs_miss.queued;
    out[1] = fusefs_miss.to_loop;
    pthread_mutex_unlock(&fusefs_miss.lock);
    out[2] = __atomic_load_n(&fusefs_miss.answered, __ATOMIC_RELAXED);
    out[3] = __atomic_load_n(&fusefs_miss.handed_back, __ATOMIC_RELAXED);
}

/* (under held_lock's read lock) A read of sample sid, which is not held: if a fetch thread
 * is to hold it (FUSEFS_EXPECTED), the read waits here for that hold (fusefs_fast_hold
 * answers it, or hands it to the loop where the fetch fails), 1; else 0 (the loop's). */
static int fusefs_park(const char *data, size_t len, uint64_t sid) {
    if (fusefs_fast.expected == NULL)
        return 0;
    int missed = 0;
    if (!(__atomic_load_n(&fusefs_fast.expected[sid], __ATOMIC_RELAXED) & FUSEFS_EXPECTED)) {
        /* (a miss: it waits here, and fusefs hears of it as an event, if the read takes the
         * whole sample, so that one fetch answers it) */
        const struct fuse_read_in *in = (const struct fuse_read_in *) ((const struct fuse_in_header *) data + 1);
        if (!fusefs_fast.ev_missed || fusefs_fast.tree.size == NULL || sid >= fusefs_fast.n_files
                || in->offset != 0 || fusefs_fast.tree.size[sid] == 0 || in->size < fusefs_fast.tree.size[sid])
            return 0;
        missed = 1;
    }
    fusefs_parked *p = (fusefs_parked *) malloc(sizeof *p + len);
    if (p == NULL)
        return 0;
    p->fd = fusefs_own_fd();
    p->sid = sid;
    p->ev_bits = 0;
    p->len = len;
    memcpy(p->data, data, len);
    pthread_mutex_lock(&fusefs_fast.parked_lock);
    p->next = fusefs_fast.parked;
    fusefs_fast.parked = p;
    fusefs_fast.parked_n++;
    /* (a second read of a missed sample waits for the same fetch: no second event) */
    unsigned char was = __atomic_fetch_or(&fusefs_fast.expected[sid], FUSEFS_EXPECTED | FUSEFS_WAITED,
                                          __ATOMIC_RELAXED);
    missed = missed && !(was & FUSEFS_EXPECTED);
    if (missed)
        p->ev_bits = fusefs_fast.ev_missed;
    pthread_mutex_unlock(&fusefs_fast.parked_lock);
    __atomic_add_fetch(&fusefs_fast.reads_parked, 1, __ATOMIC_RELAXED);
    if (missed) {
        __atomic_add_fetch(&fusefs_fast.misses_parked, 1, __ATOMIC_RELAXED);
        if (!fusefs_miss_queue(sid))  /* (the engine reads it, or the loop hears of it) */
            fusefs_event(fusefs_fast.ev_read | fusefs_fast.ev_missed | sid, FUSEFS_EV_AT_ONCE);
    }
    return 1;
}

/* The parked reads that match: those of sample sid (unique 0), or the one of request
 * `unique`; taken off the list. */
static fusefs_parked *fusefs_unpark(uint64_t sid, uint64_t unique) {
    fusefs_parked *out = NULL;
    pthread_mutex_lock(&fusefs_fast.parked_lock);
    fusefs_parked **pp = &fusefs_fast.parked;
    while (*pp) {
        fusefs_parked *p = *pp;
        if (unique ? ((const struct fuse_in_header *) p->data)->unique == unique : p->sid == sid) {
            *pp = p->next;
            p->next = out;
            out = p;
            fusefs_fast.parked_n--;
        } else {
            pp = &p->next;
        }
    }
    pthread_mutex_unlock(&fusefs_fast.parked_lock);
    return out;
}

/* (any thread, no GIL needed) Answer the parked reads w from the n bytes at buf, or, with
 * buf NULL, hand them to the loop; free them. */
static void fusefs_fast_answer_parked(fusefs_parked *w, const char *buf, uint64_t n) {
    while (w) {
        fusefs_parked *next = w->next;
        const struct fuse_in_header *h = (const struct fuse_in_header *) w->data;
        if (buf != NULL) {
            fusefs_read_reply(w->fd, h->unique, w->sid, (const struct fuse_read_in *) (h + 1), buf, n,
                              w->ev_bits && n ? w->ev_bits : 0);
        } else {
            fusefs_forward_from(w->fd, w->data, w->len);
            __atomic_add_fetch(&fusefs_fast.parked_forwarded, 1, __ATOMIC_RELAXED);
        }
        free(w);
        w = next;
    }
}

static void fusefs_free_parked(void) {
    fusefs_parked *p = fusefs_fast.parked;
    while (p) {
        fusefs_parked *next = p->next;
        free(p);
        p = next;
    }
    fusefs_fast.parked = NULL;
    fusefs_fast.parked_n = 0;
}

/* file sid's name against name (n bytes), as Python compares bytes */
static int fusefs_name_cmp(uint64_t sid, const char *name, size_t n) {
    const char *s = fusefs_fast.tree.names + fusefs_fast.tree.name_off[sid];
    size_t m = fusefs_fast.tree.name_len[sid];
    int c = memcmp(s, name, m < n ? m : n);
    return c ? c : (m < n ? -1 : m > n);
}

/* The sample called name (n bytes) in folder inode parent, or -1 (not a file there). */
static int64_t fusefs_lookup_file(uint64_t parent, const char *name, size_t n) {
    uint64_t d = parent - 1;
    if (parent < 1 || d >= fusefs_fast.tree.n_dirs)
        return -1;
    uint64_t lo = fusefs_fast.tree.dir_first_file[d];
    uint64_t end = lo + fusefs_fast.tree.dir_nfiles[d], hi = end;
    if (end > fusefs_fast.n_files || lo > end)
        return -1;
    while (lo < hi) {
        uint64_t mid = lo + (hi - lo) / 2;
        if (fusefs_name_cmp(mid, name, n) < 0)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo < end && fusefs_name_cmp(lo, name, n) == 0 ? (int64_t) lo : -1;
}

/* a forget of inode ino (no answer) */
static void fusefs_forgot(uint64_t ino) {
    if (ino >= fusefs_fast.file_base && ino - fusefs_fast.file_base < fusefs_fast.n_files)
        fusefs_event(fusefs_fast.ev_released | fusefs_fast.ev_read | (ino - fusefs_fast.file_base),
                     FUSEFS_EV_NOW);
}

/* 1 if the request was answered here */
static int fusefs_answer(const char *data, size_t len) {
    const struct fuse_in_header *h = (const struct fuse_in_header *) data;
    if (len < sizeof *h)
        return 0;
    switch (h->opcode) {
    case FUSE_OPEN: {
        const struct fuse_open_in *in = (const struct fuse_open_in *) (h + 1);
        uint64_t sid = h->nodeid - fusefs_fast.file_base;
        if (len < sizeof *h + sizeof *in || h->nodeid < fusefs_fast.file_base
                || sid >= fusefs_fast.n_files || (in->flags & fusefs_fast.write_flags))
            return 0;
        struct fuse_open_out out;
        memset(&out, 0, sizeof out);
        uint64_t serial = __atomic_add_fetch(&fusefs_fast.serial, 1, __ATOMIC_RELAXED) % fusefs_fast.serial_wrap;
        out.fh = (serial << fusefs_fast.sid_bits) | sid;
        out.open_flags = FOPEN_KEEP_CACHE;
        /* (before the reply: its release may come at once, on another thread) */
        fusefs_event(out.fh, fusefs_kernel_holds(sid) ? FUSEFS_EV_LAZY : FUSEFS_EV_IDLE);
        fusefs_reply(h->unique, 0, &out, sizeof out);
        __atomic_add_fetch(&fusefs_fast.opens, 1, __ATOMIC_RELAXED);
        return 1;
    }
    case FUSE_RELEASE: {
        const struct fuse_release_in *in = (const struct fuse_release_in *) (h + 1);
        if (len < sizeof *h + sizeof *in || in->fh >= fusefs_fast.fh_base)
            return 0;
        fusefs_event(in->fh | fusefs_fast.ev_released,
                     fusefs_kernel_holds(in->fh & ((1ULL << fusefs_fast.sid_bits) - 1))
                     ? FUSEFS_EV_LAZY : FUSEFS_EV_IDLE);
        fusefs_reply(h->unique, 0, NULL, 0);
        __atomic_add_fetch(&fusefs_fast.releases, 1, __ATOMIC_RELAXED);
        return 1;
    }
    case FUSE_READ: {
        const struct fuse_read_in *in = (const struct fuse_read_in *) (h + 1);
        if (len < sizeof *h + sizeof *in || in->fh >= fusefs_fast.fh_base)
            return 0;
        uint64_t sid = in->fh & ((1ULL << fusefs_fast.sid_bits) - 1);
        if (sid >= fusefs_fast.n_files)
            return 0;
        pthread_rwlock_rdlock(&fusefs_fast.held_lock);
        PyObject *o = fusefs_fast.held[sid];
        if (o == NULL) {  /* (a sample being fetched: its read waits here) */
            int parked = fusefs_park(data, len, sid);
            pthread_rwlock_unlock(&fusefs_fast.held_lock);
            return parked;
        }
        /* (before the unlock: a hold that takes o out of the table then sees it copied) */
        __atomic_store_n(&fusefs_fast.copying[fusefs_tno], o, __ATOMIC_RELAXED);
        pthread_rwlock_unlock(&fusefs_fast.held_lock);
        fusefs_read_reply(fusefs_own_fd(), h->unique, sid, in, PyBytes_AS_STRING(o),
                          (uint64_t) PyBytes_GET_SIZE(o), 0);
        __atomic_store_n(&fusefs_fast.copying[fusefs_tno], NULL, __ATOMIC_RELEASE);
        return 1;
    }
    case FUSE_LOOKUP: {
        const char *name = (const char *) (h + 1);
        size_t room = len - sizeof *h, n = strnlen(name, room);
        if (fusefs_fast.tree.n_dirs == 0 || n == room)
            return 0;
        int64_t found = fusefs_lookup_file(h->nodeid, name, n);
        if (found < 0)
            return 0;
        uint64_t sid = (uint64_t) found;
        int64_t t = fusefs_fast.tree.mtime_ns[sid];
        int64_t sec = t / 1000000000 - (t % 1000000000 < 0);  /* (floor, as the kernel wants) */
        uint32_t nsec = (uint32_t) (t - sec * 1000000000);
        struct fuse_entry_out out;
        memset(&out, 0, sizeof out);
        out.nodeid = out.attr.ino = fusefs_fast.file_base + sid;
        out.entry_valid = out.attr_valid = fusefs_fast.tree.timeout_s;
        out.attr.size = fusefs_fast.tree.size[sid];
        out.attr.blocks = (out.attr.size + 511) / 512;
        out.attr.atime = out.attr.mtime = out.attr.ctime = (uint64_t) sec;
        out.attr.atimensec = out.attr.mtimensec = out.attr.ctimensec = nsec;
        out.attr.mode = S_IFREG | fusefs_fast.tree.mode[sid];
        out.attr.nlink = 1;
        out.attr.uid = fusefs_fast.tree.uid;
        out.attr.gid = fusefs_fast.tree.gid;
        out.attr.blksize = fusefs_fast.tree.blksize;
        fusefs_reply(h->unique, 0, &out, sizeof out);
        __atomic_add_fetch(&fusefs_fast.lookups, 1, __ATOMIC_RELAXED);
        return 1;
    }
    case FUSE_FORGET:
        if (len < sizeof *h + sizeof (struct fuse_forget_in))
            return 0;
        fusefs_forgot(h->nodeid);
        __atomic_add_fetch(&fusefs_fast.forgets, 1, __ATOMIC_RELAXED);
        return 1;
    case FUSE_BATCH_FORGET: {
        const struct fuse_batch_forget_in *in = (const struct fuse_batch_forget_in *) (h + 1);
        if (len < sizeof *h + sizeof *in
                || (len - sizeof *h - sizeof *in) / sizeof (struct fuse_forget_one) < in->count)
            return 0;
        const struct fuse_forget_one *one = (const struct fuse_forget_one *) (in + 1);
        for (uint32_t i = 0; i < in->count; i++)
            fusefs_forgot(one[i].nodeid);
        __atomic_add_fetch(&fusefs_fast.forgets, 1, __ATOMIC_RELAXED);
        return 1;
    }
    case FUSE_INTERRUPT: {  /* answered by nothing; to the loop unless its request was answered here */
        const struct fuse_interrupt_in *in = (const struct fuse_interrupt_in *) (h + 1);
        fusefs_parked *p = len < sizeof *h + sizeof *in || !in->unique
            || !__atomic_load_n(&fusefs_fast.parked_n, __ATOMIC_RELAXED) ? NULL : fusefs_unpark(0, in->unique);
        if (p != NULL) {  /* (a read parked here: EINTR, as the loop answers an interrupted read) */
            fusefs_reply_on(p->fd, in->unique, EINTR, NULL, 0);
            free(p);
            __atomic_add_fetch(&fusefs_fast.interrupts, 1, __ATOMIC_RELAXED);
            return 1;
        }
        if (len < sizeof *h + sizeof *in || !fusefs_was_answered(in->unique)) {
            __atomic_add_fetch(&fusefs_fast.interrupts_forwarded, 1, __ATOMIC_RELAXED);
            return 0;
        }
        __atomic_add_fetch(&fusefs_fast.interrupts, 1, __ATOMIC_RELAXED);
        return 1;
    }
    case FUSE_IOCTL:  /* as the ioctl patch answers it: ENOTTY (Python's open() asks isatty) */
        fusefs_reply(h->unique, ENOTTY, NULL, 0);
        __atomic_add_fetch(&fusefs_fast.ioctls, 1, __ATOMIC_RELAXED);
        return 1;
    }
    return 0;
}

/* A thread's wait for its next request: its own epoll set, holding its /dev/fuse descriptor
 * with EPOLLEXCLUSIVE and the stop eventfd. Every clone of the session waits on the one
 * queue of the connection: with poll() each request woke every thread (N - 1 of them to
 * find nothing and sleep again: the fast path's CPU per sample grew with its threads);
 * exclusive waiters are woken one per request. -1 (errno set) where it cannot be made. */
static int fusefs_wait_set(int fd) {
    int ep = epoll_create1(EPOLL_CLOEXEC);
    if (ep < 0)
        return -1;
    struct epoll_event in = {.events = EPOLLIN | EPOLLEXCLUSIVE, .data = {.u32 = 0}};
    struct epoll_event stop = {.events = EPOLLIN, .data = {.u32 = 1}};
    if (epoll_ctl(ep, EPOLL_CTL_ADD, fd, &in) < 0
            || epoll_ctl(ep, EPOLL_CTL_ADD, fusefs_fast.stop_fd, &stop) < 0) {
        int e = errno;
        close(ep);
        errno = e;
        return -1;
    }
    return ep;
}

static void *fusefs_thread(void *arg) {
    char *buf = (char *) malloc(FUSEFS_BUFSIZE);
    struct epoll_event got_ev[2];
    int err = buf == NULL ? ENOMEM : 0;
    fusefs_tno = (int) (intptr_t) arg;
    fusefs_tfd = fusefs_fast.fds[fusefs_tno];
    int ep = err ? -1 : fusefs_wait_set(fusefs_tfd);
    if (!err && ep < 0)
        err = errno;
    pthread_setname_np(pthread_self(), "fusefs-fast");
    while (!err && !__atomic_load_n(&fusefs_fast.stop, __ATOMIC_RELAXED)) {
        ssize_t got = read(fusefs_tfd, buf, FUSEFS_BUFSIZE);
        if (got > 0) {
            if (!fusefs_answer(buf, (size_t) got))
                fusefs_forward(buf, (size_t) got);
            continue;
        }
        if (got == 0 || (got < 0 && errno == ENODEV))  /* unmounted */
            break;
        if (errno != EAGAIN && errno != EINTR && errno != ENOENT) {
            err = errno;
            break;
        }
        if (errno != EAGAIN)
            continue;
        /* nothing queued: hand over the events that wait for their delay, and wait */
        int timeout = -1;
        pthread_mutex_lock(&fusefs_fast.lock);
        if (fusefs_fast.ev_n && !fusefs_fast.ev_signalled) {
            long left = fusefs_events_left_ns();
            if (left <= 0)
                fusefs_signal_events();
            else
                timeout = (int) ((left + 999999) / 1000000);
        }
        pthread_mutex_unlock(&fusefs_fast.lock);
        int n = epoll_wait(ep, got_ev, 2, timeout);
        if (n < 0) {
            if (errno != EINTR)
                err = errno;
            continue;
        }
        int stopping = 0;
        for (int i = 0; i < n; i++)
            stopping |= got_ev[i].data.u32 == 1;
        if (stopping)
            break;
    }
    if (ep >= 0)
        close(ep);
    free(buf);
    pthread_mutex_lock(&fusefs_fast.lock);
    if (err && !fusefs_fast.err)
        fusefs_fast.err = err;
    if (--fusefs_fast.alive == 0) {  /* (the last thread: the loop sees the end) */
        fusefs_fast.ended = 1;
        fusefs_kick(fusefs_fast.fwd_fd);
    }
    fusefs_signal_events();
    pthread_mutex_unlock(&fusefs_fast.lock);
    return NULL;
}

/* (with the GIL, while the thread does not run) What the thread answers by, set and
 * checked: the FUSE fd, the dataset's files, the handles' layout and the events' bits
 * (released, read, read_end, read_lost); a table for held samples (empty). 0, or EBUSY,
 * EINVAL (bits), ENOMEM. */
static int fusefs_fast_configure(int fd, uint64_t file_base, uint64_t n_files, uint64_t fh_base,
                                 unsigned sid_bits, uint64_t serial, uint64_t serial_wrap,
                                 uint64_t write_flags, size_t batch, long delay_us,
                                 const uint64_t events[4]) {
    if (fusefs_fast.running)
        return EBUSY;
    /* released, read, read_end, read_lost: single, distinct bits above every handle (the
     * first two) or every sample (the other two) */
    if (sid_bits >= 64 || serial_wrap == 0 || (serial_wrap << sid_bits) >> sid_bits != serial_wrap)
        return EINVAL;
    uint64_t seen = 0;
    for (int i = 0; i < 4; i++) {
        uint64_t b = events[i];
        if (b == 0 || (b & (b - 1)) || (b & seen) || b < (i < 2 ? serial_wrap << sid_bits : 1ULL << sid_bits))
            return EINVAL;
        seen |= b;
    }
    fusefs_fast.ev_released = events[0];
    fusefs_fast.ev_read = events[1];
    fusefs_fast.ev_read_end = events[2];
    fusefs_fast.ev_read_lost = events[3];
    uint64_t m = fusefs_fast.ev_missed;
    if (m && ((m & (m - 1)) || (m & seen) || m < (1ULL << sid_bits)))
        return EINVAL;
    fusefs_fast_drop_table();  /* (a table an earlier run left, if its close never came) */
    fusefs_fast.fd = fd;
    fusefs_fast.file_base = file_base;
    fusefs_fast.n_files = n_files;
    fusefs_fast.fh_base = fh_base;
    fusefs_fast.sid_bits = sid_bits;
    fusefs_fast.serial = serial;
    fusefs_fast.serial_wrap = serial_wrap;
    fusefs_fast.write_flags = write_flags;
    fusefs_fast.batch = batch ? batch : 1;
    fusefs_fast.delay_ns = delay_us * 1000L;
    fusefs_fast.filled_ns = LLONG_MIN / 2;  /* (nothing came into the cache yet) */
    fusefs_fast.idle = 0;
    fusefs_fast.ended = fusefs_fast.err = fusefs_fast.stop = 0;
    fusefs_fast.opens = fusefs_fast.releases = fusefs_fast.ioctls = 0;
    fusefs_fast.reads = fusefs_fast.read_bytes = 0;
    fusefs_fast.lookups = fusefs_fast.forgets = fusefs_fast.interrupts = 0;
    fusefs_fast.interrupts_forwarded = fusefs_fast.answered_n = 0;
    memset(fusefs_fast.answered, 0, sizeof fusefs_fast.answered);
    memset(fusefs_fast.answered_by, 0, sizeof fusefs_fast.answered_by);
    fusefs_fast.nthreads = 0;
    if (!fusefs_fast.held_lock_ready) {  /* (writers first: a hold does not wait for a stream of readers) */
        pthread_rwlockattr_t attr;
        pthread_rwlockattr_init(&attr);
        pthread_rwlockattr_setkind_np(&attr, PTHREAD_RWLOCK_PREFER_WRITER_NONRECURSIVE_NP);
        pthread_rwlock_init(&fusefs_fast.held_lock, &attr);
        pthread_rwlockattr_destroy(&attr);
        fusefs_fast.held_lock_ready = 1;
    }
    fusefs_fast.reads_parked = fusefs_fast.parked_forwarded = fusefs_fast.misses_parked = 0;
    fusefs_fast.held = (PyObject **) calloc(n_files ? n_files : 1, sizeof *fusefs_fast.held);
    fusefs_fast.expected = (unsigned char *) calloc(n_files ? n_files : 1, 1);
    if (fusefs_fast.held == NULL || fusefs_fast.expected == NULL) {
        free(fusefs_fast.held);
        free(fusefs_fast.expected);
        fusefs_fast.held = NULL;
        fusefs_fast.expected = NULL;
        return ENOMEM;
    }
    return 0;
}

static void fusefs_close_clones(void) {
    for (int i = 1; i < fusefs_fast.nthreads; i++)
        if (fusefs_fast.fds[i] >= 0)
            close(fusefs_fast.fds[i]);
}

/* Configure (above) and start nthreads threads: the first on fd, each other on a clone of
 * it (/dev/fuse opened anew, FUSE_DEV_IOC_CLONE). 0 or an errno. With more than one, the
 * session's writes must go through fusefs_fast_io() (the caller sets it). */
static int fusefs_fast_start(int fd, uint64_t file_base, uint64_t n_files, uint64_t fh_base,
                             unsigned sid_bits, uint64_t serial, uint64_t serial_wrap,
                             uint64_t write_flags, size_t batch, long delay_us,
                             const uint64_t events[4], int nthreads) {
    if (nthreads < 1 || nthreads > FUSEFS_MAX_THREADS)
        return EINVAL;
    int err = fusefs_fast_configure(fd, file_base, n_files, fh_base, sid_bits, serial, serial_wrap,
                                    write_flags, batch, delay_us, events);
    if (err)
        return err;
    fusefs_fast.fds[0] = fd;
    for (int i = 1; i < nthreads; i++) {
        uint32_t session = (uint32_t) fd;
        int c = open("/dev/fuse", O_RDWR | O_CLOEXEC);
        if (c >= 0 && ioctl(c, FUSE_DEV_IOC_CLONE, &session) < 0) {
            int e = errno;
            close(c);
            c = -1;
            errno = e;
        }
        if (c < 0) {
            err = errno;
            fusefs_fast.nthreads = i;
            fusefs_close_clones();
            fusefs_fast.nthreads = 0;
            return err;
        }
        fusefs_fast.fds[i] = c;
    }
    fusefs_fast.nthreads = nthreads;
    for (int i = 0; i < nthreads; i++)  /* (the threads read first) */
        if (fcntl(fusefs_fast.fds[i], F_SETFL, fcntl(fusefs_fast.fds[i], F_GETFL) | O_NONBLOCK) < 0) {
            err = errno;
            fusefs_close_clones();
            fusefs_fast.nthreads = 0;
            return err;
        }
    fusefs_fast.fwd_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    fusefs_fast.ev_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    fusefs_fast.stop_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    int started = 0;
    if (fusefs_fast.fwd_fd >= 0 && fusefs_fast.ev_fd >= 0 && fusefs_fast.stop_fd >= 0) {
        fusefs_fast.alive = nthreads;
        for (; started < nthreads; started++)
            if (pthread_create(&fusefs_fast.threads[started], NULL, fusefs_thread,
                               (void *) (intptr_t) started) != 0)
                break;
    }
    if (started < nthreads) {
        int e = errno ? errno : EAGAIN;
        if (started) {  /* (those started: stop them) */
            __atomic_store_n(&fusefs_fast.stop, 1, __ATOMIC_RELAXED);
            fusefs_kick(fusefs_fast.stop_fd);
            for (int i = 0; i < started; i++)
                pthread_join(fusefs_fast.threads[i], NULL);
        }
        if (fusefs_fast.fwd_fd >= 0) close(fusefs_fast.fwd_fd);
        if (fusefs_fast.ev_fd >= 0) close(fusefs_fast.ev_fd);
        if (fusefs_fast.stop_fd >= 0) close(fusefs_fast.stop_fd);
        fusefs_fast.fwd_fd = fusefs_fast.ev_fd = fusefs_fast.stop_fd = -1;
        fusefs_close_clones();
        fusefs_fast.nthreads = 0;
        return e;
    }
    fusefs_fast.running = 1;
    return 0;
}

/* (tests, with the GIL, while the thread does not run, after fusefs_fast_configure) Answer
 * the request data[len] as the thread would, the reply written to fusefs_fast.fd: 1, or 0
 * where the thread would hand it to the loop (nothing written). */
static int fusefs_fast_answer_one(const char *data, size_t len) {
    if (fusefs_fast.running || fusefs_fast.held == NULL)
        return -1;
    return fusefs_answer(data, len);
}

/* Ask the threads to stop (one may be inside a read: it ends with the mount, or on the next
 * request); the loop's tasks then see the end. */
static void fusefs_fast_stop(void) {
    if (fusefs_fast.running) {
        __atomic_store_n(&fusefs_fast.stop, 1, __ATOMIC_RELAXED);
        fusefs_kick(fusefs_fast.stop_fd);
    }
}

/* Stop the threads, wait for them, drop what they left (from close(), after the loop
 * ended). */
static void fusefs_fast_join(void) {
    if (!fusefs_fast.running)
        return;
    fusefs_fast_stop();
    for (int i = 0; i < fusefs_fast.nthreads; i++)
        pthread_join(fusefs_fast.threads[i], NULL);
    fusefs_fast.running = 0;
    fusefs_close_clones();
    pthread_mutex_lock(&fusefs_fast.routes.lock);
    free(fusefs_fast.routes.keys);
    free(fusefs_fast.routes.fds);
    fusefs_fast.routes.keys = NULL;
    fusefs_fast.routes.fds = NULL;
    fusefs_fast.routes.cap = fusefs_fast.routes.n = 0;
    pthread_mutex_unlock(&fusefs_fast.routes.lock);
    while (fusefs_fast.head) {
        fusefs_req *r = fusefs_fast.head;
        fusefs_fast.head = r->next;
        free(r);
    }
    fusefs_fast.tail = NULL;
    fusefs_free_parked();  /* (the mount is gone: no one waits for their answers) */
    free(fusefs_fast.ev);
    fusefs_fast.ev = NULL;
    fusefs_fast.ev_n = fusefs_fast.ev_cap = 0;
    fusefs_fast.ev_signalled = fusefs_fast.ev_urgent = fusefs_fast.ev_eager = 0;
    close(fusefs_fast.fwd_fd);
    close(fusefs_fast.ev_fd);
    close(fusefs_fast.stop_fd);
    fusefs_fast.fwd_fd = fusefs_fast.ev_fd = fusefs_fast.stop_fd = -1;
}

/* The fd the loop waits on for its next request. */
static int fusefs_wait_fd(int session_fd) {
    return fusefs_fast.running ? fusefs_fast.fwd_fd : session_fd;
}

/* The loop's next request: as fuse_session_receive_buf (-EAGAIN: none queued; 0: the
 * session ended). */
static int fusefs_receive(struct fuse_session *se, struct fuse_buf *buf) {
    fusefs_req *r;
    if (!fusefs_fast.running)
        return fuse_session_receive_buf(se, buf);
    pthread_mutex_lock(&fusefs_fast.lock);
    r = fusefs_fast.head;
    if (r == NULL) {
        int ended = fusefs_fast.ended, err = fusefs_fast.err;
        if (!ended)
            fusefs_unkick(fusefs_fast.fwd_fd);  /* (under lock: the next request kicks again) */
        pthread_mutex_unlock(&fusefs_fast.lock);
        if (!ended)
            return -EAGAIN;
        fuse_session_exit(se);
        return err ? -err : 0;
    }
    fusefs_fast.head = r->next;
    if (fusefs_fast.head == NULL)
        fusefs_fast.tail = NULL;
    pthread_mutex_unlock(&fusefs_fast.lock);
    if (buf->mem == NULL) {
        buf->mem = malloc(FUSEFS_BUFSIZE);
        if (buf->mem == NULL) {
            fusefs_reply(((struct fuse_in_header *) r->data)->unique, ENOMEM, NULL, 0);
            free(r);
            return -EINTR;  /* (the loop takes the next one) */
        }
    }
    memcpy(buf->mem, r->data, r->len);
    buf->size = r->len;
    buf->flags = (enum fuse_buf_flags) 0;
    buf->pos = 0;
    free(r);
    return (int) buf->size;
}

/* The fd that is readable while events wait (-1: no thread). */
static int fusefs_fast_event_fd(void) {
    return fusefs_fast.running ? fusefs_fast.ev_fd : -1;
}

/* The requests answered here since the start: opens, releases, ioctls, reads; the bytes
 * the reads answered; lookups, forgets, interrupts taken; interrupts handed to the loop;
 * reads that waited for a fetch thread's hold (parked), and those of them handed to the
 * loop (their fetch failed, or the cache did not keep the sample); misses that waited
 * (fusefs_fast_misses: each an event). */
static void fusefs_fast_counts(unsigned long long out[12]) {
    out[0] = __atomic_load_n(&fusefs_fast.opens, __ATOMIC_RELAXED);
    out[1] = __atomic_load_n(&fusefs_fast.releases, __ATOMIC_RELAXED);
    out[2] = __atomic_load_n(&fusefs_fast.ioctls, __ATOMIC_RELAXED);
    out[3] = __atomic_load_n(&fusefs_fast.reads, __ATOMIC_RELAXED);
    out[4] = __atomic_load_n(&fusefs_fast.read_bytes, __ATOMIC_RELAXED);
    out[5] = __atomic_load_n(&fusefs_fast.lookups, __ATOMIC_RELAXED);
    out[6] = __atomic_load_n(&fusefs_fast.forgets, __ATOMIC_RELAXED);
    out[7] = __atomic_load_n(&fusefs_fast.interrupts, __ATOMIC_RELAXED);
    out[8] = __atomic_load_n(&fusefs_fast.interrupts_forwarded, __ATOMIC_RELAXED);
    out[9] = __atomic_load_n(&fusefs_fast.reads_parked, __ATOMIC_RELAXED);
    out[10] = __atomic_load_n(&fusefs_fast.parked_forwarded, __ATOMIC_RELAXED);
    out[11] = __atomic_load_n(&fusefs_fast.misses_parked, __ATOMIC_RELAXED);
}

/* The requests each thread answered since the start (out: FUSEFS_MAX_THREADS of them); the
 * number of threads. */
static int fusefs_fast_thread_counts(unsigned long long *out) {
    for (int i = 0; i < fusefs_fast.nthreads; i++)
        out[i] = __atomic_load_n(&fusefs_fast.answered_by[i], __ATOMIC_RELAXED);
    return fusefs_fast.nthreads;
}

/* Whether a thread copies a reply from o now. */
static int fusefs_copying(PyObject *o) {
    for (int i = 0; i < FUSEFS_MAX_THREADS; i++)
        if (__atomic_load_n(&fusefs_fast.copying[i], __ATOMIC_ACQUIRE) == o)
            return 1;
    return 0;
}

/* (with the GIL) Release the objects taken out of the table that no thread copies from
 * any longer. */
static void fusefs_release_dropped(void) {
    size_t kept = 0;
    for (size_t i = 0; i < fusefs_fast.dropped_n; i++) {
        PyObject *o = fusefs_fast.dropped[i];
        if (fusefs_copying(o))
            fusefs_fast.dropped[kept++] = o;
        else
            Py_DECREF(o);
    }
    fusefs_fast.dropped_n = kept;
}

/* (with the GIL) Hold o, a bytes object, as sample sid's bytes (NULL: hold none); the
 * table takes a reference to o and drops the one to the object it held before: at once,
 * or, while a thread copies a reply from that object, at a later hold once none does (a
 * hold never waits for a reply: its caller holds the GIL). The sample is no longer
 * expected (fusefs_fast_expect); the reads that waited for it are returned, for the caller
 * to answer from o, or hand to the loop where o is NULL (fusefs_fast_answer_parked: without
 * the GIL, o kept alive meanwhile). Does nothing while the thread has no table (not
 * started, or after fusefs_fast_free_held). */
static void fusefs_fast_let_go(PyObject *old);

/* (any thread, without the GIL) fusefs_fast_hold's change of the table: o (a reference the
 * table takes, or NULL) becomes sample sid's; *old: the object the table held before (for
 * fusefs_fast_let_go), or o itself where there is no table (nothing changed). The reads that
 * waited for sid are returned. */
static fusefs_parked *fusefs_fast_swap(uint64_t sid, PyObject *o, PyObject **old) {
    fusefs_parked *waiting = NULL;
    if (o != NULL)  /* (a fetch: the read-ahead needs the readers' progress, fusefs_event) */
        __atomic_store_n(&fusefs_fast.filled_ns, fusefs_now_ns(), __ATOMIC_RELAXED);
    pthread_rwlock_wrlock(&fusefs_fast.held_lock);
    if (fusefs_fast.held == NULL || sid >= fusefs_fast.n_files) {
        pthread_rwlock_unlock(&fusefs_fast.held_lock);
        *old = o;
        return NULL;
    }
    *old = fusefs_fast.held[sid];
    fusefs_fast.held[sid] = o;
    unsigned char was = fusefs_fast.expected[sid];
    fusefs_fast.expected[sid] = 0;
    if (was & FUSEFS_WAITED)  /* (parked under the read lock: none parks now) */
        waiting = fusefs_unpark(sid, 0);
    pthread_rwlock_unlock(&fusefs_fast.held_lock);
    return waiting;
}

static fusefs_parked *fusefs_fast_hold(uint64_t sid, PyObject *o) {
    PyObject *old;
    if (fusefs_fast.held == NULL || sid >= fusefs_fast.n_files)
        return NULL;
    Py_XINCREF(o);
    fusefs_parked *waiting = fusefs_fast_swap(sid, o, &old);
    fusefs_fast_let_go(old);
    return waiting;
}

/* (with the GIL) An object the table let go of (fusefs_fast_swap; NULL: none): its
 * reference dropped at once, or, while a thread copies a reply from it, at a later hold once
 * none does (a hold never waits for a reply: its caller holds the GIL). The objects dropped
 * earlier that no thread copies from any longer are released first. */
static void fusefs_fast_let_go(PyObject *old) {
    if (fusefs_fast.dropped_n)
        fusefs_release_dropped();
    if (old == NULL)
        return;
    if (!fusefs_copying(old)) {  /* (after the lock: a thread that took old marked it) */
        Py_DECREF(old);
        return;
    }
    if (fusefs_fast.dropped_n == fusefs_fast.dropped_cap) {
        size_t cap = fusefs_fast.dropped_cap ? 2 * fusefs_fast.dropped_cap : FUSEFS_MAX_THREADS;
        PyObject **more = (PyObject **) realloc(fusefs_fast.dropped, cap * sizeof *more);
        if (more == NULL) {  /* (no room to keep it: wait for the copy, as the lock did) */
            while (fusefs_copying(old))
                sched_yield();
            Py_DECREF(old);
            return;
        }
        fusefs_fast.dropped = more;
        fusefs_fast.dropped_cap = cap;
    }
    fusefs_fast.dropped[fusefs_fast.dropped_n++] = old;
}

/* (any thread, no GIL needed) The reads that wait for sample sid (parked), taken, for the
 * caller to answer from its bytes (fusefs_fast_answer_parked) without holding them: a
 * fetched sample that a missed read waits for, whether fusefs keeps it or not. The sample
 * is no longer expected. NULL (at once, without a lock) where none waits, or where the
 * table is gone (it is dropped under the lock). */
static fusefs_parked *fusefs_fast_hand(uint64_t sid) {
    if (fusefs_fast.expected == NULL || sid >= fusefs_fast.n_files
            || !(__atomic_load_n(&fusefs_fast.expected[sid], __ATOMIC_RELAXED) & FUSEFS_WAITED))
        return NULL;
    fusefs_parked *waiting = NULL;
    pthread_rwlock_wrlock(&fusefs_fast.held_lock);
    if (fusefs_fast.expected != NULL) {
        waiting = fusefs_fast.expected[sid] & FUSEFS_WAITED ? fusefs_unpark(sid, 0) : NULL;
        fusefs_fast.expected[sid] = 0;
    }
    pthread_rwlock_unlock(&fusefs_fast.held_lock);
    return waiting;
}

/* (any thread, without the GIL) fusefs_publish_api's hold_nogil: obj (a bytes object whose
 * reference the caller took for the table) held as sample sid's, and the reads that waited
 * for it answered from its n bytes at buf; *old for let_go. */
static void fusefs_fast_hold_nogil(uint64_t sid, void *obj, const char *buf, uint64_t n, void **old) {
    PyObject *was;
    fusefs_parked *w = fusefs_fast_swap(sid, (PyObject *) obj, &was);
    *old = was;
    if (w != NULL)
        fusefs_fast_answer_parked(w, buf, n);
}

/* (any thread, without the GIL) fusefs_publish_api's hand_nogil: the reads that wait for
 * sample sid answered from its n bytes at buf, which are not held (fusefs_fast_hand's). */
static void fusefs_fast_hand_nogil(uint64_t sid, const char *buf, uint64_t n) {
    fusefs_parked *w = fusefs_fast_hand(sid);
    if (w != NULL)
        fusefs_fast_answer_parked(w, buf, n);
}

/* (with the GIL) fusefs_publish_api's let_go. */
static void fusefs_fast_let_go_api(void *old) {
    fusefs_fast_let_go((PyObject *) old);
}

/* (with the GIL) fusefs_publish_api's hold: fusefs_fast_hold of obj where it is a bytes
 * object (else of none), the reads that waited answered with the GIL let go. */
static void fusefs_fast_hold_one(uint64_t sid, void *obj) {
    PyObject *o = obj != NULL && PyBytes_CheckExact((PyObject *) obj) ? (PyObject *) obj : NULL;
    fusefs_parked *w = fusefs_fast_hold(sid, o);
    if (w != NULL) {
        const char *buf = o != NULL ? PyBytes_AS_STRING(o) : NULL;
        uint64_t n = o != NULL ? (uint64_t) PyBytes_GET_SIZE(o) : 0;
        Py_BEGIN_ALLOW_THREADS
        fusefs_fast_answer_parked(w, buf, n);
        Py_END_ALLOW_THREADS
    }
}

static const fusefs_publish_api fusefs_publish_api_table = {
    FUSEFS_PUBLISH_API_VERSION, fusefs_fast_hold_nogil, fusefs_fast_hand_nogil, fusefs_fast_let_go_api,
    fusefs_fast_hold_one};

/* (with the GIL) The capsule of fusefs_publish_api_table (a new reference, or NULL). */
static PyObject *fusefs_fast_publish_api(void) {
    return PyCapsule_New((void *) &fusefs_publish_api_table, FUSEFS_PUBLISH_API, NULL);
}

/* (with the GIL, before the thread starts) The event bit of a miss that waits here (with
 * `read` and the sample), or 0: such reads go to the loop. Checked at the start (a single
 * bit above every sample, not one of the other events'); forgotten at fusefs_fast_free_held. */
static void fusefs_fast_misses(uint64_t bit) {
    fusefs_fast.ev_missed = bit;
}

/* (any thread) Samples sids[n] (out of range ones ignored) are being fetched by a thread
 * that will hold them (fusefs_fast_hold with their bytes, or NULL where the fetch fails or
 * they are not kept): until then a read of one waits here (parked) instead of going to the
 * loop. */
static void fusefs_fast_expect(const int64_t *sids, size_t n) {
    if (fusefs_fast.expected == NULL)
        return;
    pthread_rwlock_wrlock(&fusefs_fast.held_lock);
    for (size_t i = 0; i < n; i++)
        if (sids[i] >= 0 && (uint64_t) sids[i] < fusefs_fast.n_files && fusefs_fast.held[sids[i]] == NULL)
            fusefs_fast.expected[sids[i]] |= FUSEFS_EXPECTED;
    pthread_rwlock_unlock(&fusefs_fast.held_lock);
}

/* (with the GIL, before the thread starts) The kernel flags, n bytes, one per sample: the
 * caller keeps them alive until fusefs_fast_free_held. */
static void fusefs_fast_kernel_flags(const unsigned char *flags, uint64_t n) {
    fusefs_fast.kernel_flags = flags;
    fusefs_fast.kernel_flags_n = flags ? n : 0;
}

/* (with the GIL, before the thread starts) The tree that lookups are answered from: n_dirs
 * folders (folder d is inode d + 1), the files of folder d are samples dir_first_file[d] ..
 * + dir_nfiles[d], sorted by name; sample i's name is names[name_off[i] .. + name_len[i]],
 * its size, mode (permission bits) and mtime (ns) size[i], mode[i], mtime_ns[i]; every
 * file's owner is uid:gid, its st_blksize blksize; the kernel may keep names and
 * attributes timeout_s seconds.
 * The caller keeps the arrays alive until fusefs_fast_free_held. n_dirs 0: no tree (every
 * lookup goes to the loop). EBUSY while the thread runs, EINVAL for a tree that points
 * outside its arrays (n_files samples, names_len bytes of names). */
static int fusefs_fast_tree(uint64_t n_dirs, const uint64_t *dir_first_file,
                            const uint64_t *dir_nfiles, uint64_t n_files,
                            const uint64_t *name_off, const uint32_t *name_len,
                            const char *names, uint64_t names_len, const uint64_t *size,
                            const uint32_t *mode, const int64_t *mtime_ns, uint32_t uid,
                            uint32_t gid, uint32_t blksize, uint64_t timeout_s) {
    if (fusefs_fast.running)
        return EBUSY;
    for (uint64_t d = 0; d < n_dirs; d++)
        if (dir_first_file[d] > n_files || dir_nfiles[d] > n_files - dir_first_file[d])
            return EINVAL;
    for (uint64_t i = 0; i < n_files; i++)
        if (name_off[i] > names_len || name_len[i] > names_len - name_off[i])
            return EINVAL;
    fusefs_fast.tree = (fusefs_tree) {
        .n_dirs = n_dirs, .dir_first_file = dir_first_file, .dir_nfiles = dir_nfiles,
        .name_off = name_off, .size = size, .name_len = name_len, .mode = mode,
        .mtime_ns = mtime_ns, .names = names, .names_len = names_len, .timeout_s = timeout_s,
        .uid = uid, .gid = gid, .blksize = blksize};
    return 0;
}

/* (with the GIL, while the thread does not run) Drop every held object and the table. */
static void fusefs_fast_drop_table(void) {
    PyObject **held = fusefs_fast.held;
    if (held == NULL)
        return;
    fusefs_fast_miss_stop(0);  /* (no reader of the engine touches the tables from now on) */
    pthread_rwlock_wrlock(&fusefs_fast.held_lock);  /* (a hold without the GIL sees none) */
    fusefs_fast.held = NULL;
    unsigned char *expected = fusefs_fast.expected;
    fusefs_fast.expected = NULL;
    pthread_rwlock_unlock(&fusefs_fast.held_lock);
    for (uint64_t i = 0; i < fusefs_fast.n_files; i++)
        Py_XDECREF(held[i]);
    free(held);
    free(expected);
    fusefs_free_parked();
    while (fusefs_fast.head) {  /* (what a configured, unstarted fast path handed the loop) */
        fusefs_req *r = fusefs_fast.head;
        fusefs_fast.head = r->next;
        free(r);
    }
    fusefs_fast.tail = NULL;
    memset(fusefs_fast.copying, 0, sizeof fusefs_fast.copying);
    fusefs_release_dropped();  /* (no thread runs: every one) */
    free(fusefs_fast.dropped);
    fusefs_fast.dropped = NULL;
    fusefs_fast.dropped_n = fusefs_fast.dropped_cap = 0;
}

/* (with the GIL, after fusefs_fast_join) Drop the table, forget the kernel flags and the
 * tree. */
static void fusefs_fast_free_held(void) {
    fusefs_fast_drop_table();
    fusefs_fast_misses(0);
    fusefs_fast_kernel_flags(NULL, 0);
    memset(&fusefs_fast.tree, 0, sizeof fusefs_fast.tree);
}

/* The events waiting (their number in *n, whether the event fd was made readable for them
 * in *signalled), and how many times the delay they wait: 1, FUSEFS_LAZY or FUSEFS_IDLE
 * (0: none waits). */
static int fusefs_fast_pending(size_t *n, int *signalled) {
    pthread_mutex_lock(&fusefs_fast.lock);
    *n = fusefs_fast.ev_n;
    *signalled = fusefs_fast.ev_signalled;
    int delays = !*n ? 0 : fusefs_events_urgent() ? 1 : fusefs_events_lazy_delays();
    pthread_mutex_unlock(&fusefs_fast.lock);
    return delays;
}

/* Whether fusefs's read-ahead is idle: it has covered its orders, and the readers'
 * progress gives it nothing to fetch until a new order (lazy events then wait longer). A
 * thread asleep takes a change at its next request. */
static void fusefs_fast_idle(int idle) {
    __atomic_store_n(&fusefs_fast.idle, idle, __ATOMIC_RELAXED);
}

/* The waiting events, taken (their number in *n; free() the array). */
static uint64_t *fusefs_fast_take(size_t *n) {
    uint64_t *ev;
    pthread_mutex_lock(&fusefs_fast.lock);
    ev = fusefs_fast.ev;
    *n = fusefs_fast.ev_n;
    fusefs_fast.ev = NULL;
    fusefs_fast.ev_n = fusefs_fast.ev_cap = 0;
    fusefs_fast.ev_urgent = fusefs_fast.ev_eager = 0;
    if (fusefs_fast.ev_signalled) {
        fusefs_unkick(fusefs_fast.ev_fd);
        fusefs_fast.ev_signalled = 0;
    }
    pthread_mutex_unlock(&fusefs_fast.lock);
    return ev;
}

#endif
