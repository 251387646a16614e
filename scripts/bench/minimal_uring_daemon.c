/* A minimal FUSE daemon in C on the raw kernel protocol, with two transports: requests read
 * from /dev/fuse and answered with writev (--dev, what libfuse and fusefs's fast path do),
 * or FUSE over io_uring (--uring, Linux 6.14+, /sys/module/fuse/parameters/enable_uring=1):
 * ring entries registered per CPU queue, each request's reply committed together with the
 * fetch of the next one, no read or write system call per request. The same handlers serve
 * both, so bench_uring.py measures the transport alone (issue 54, item 1).
 *
 * It serves SRC's tree from RAM (read whole at start), read-only: lookup, getattr, open
 * (keep_cache), read, release, ioctl (ENOTTY, as fusefs answers Python's isatty), statfs;
 * everything else ENOSYS (no listing: readers open files by path). Entries and attributes
 * carry a day's timeout. One thread, one io_uring for every queue's entries (and, in
 * --uring mode, for the /dev/fuse reads that still carry forgets and requests sent before
 * the ring was ready). Mounts with mount(2): run as root. Stops when the mount goes away.
 *
 * build: gcc -O2 -o minimal_uring_daemon minimal_uring_daemon.c
 * usage: minimal_uring_daemon --dev|--uring SRC MNT
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <linux/fuse.h>
#include <linux/io_uring.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

/* FUSE over io_uring (include/uapi/linux/fuse.h, protocol 7.42; not in older headers) */
#define FUSE_OVER_IO_URING_FLAG2 (1u << (41 - 32))
#define FUSE_URING_IN_OUT_HEADER_SZ 128
#define FUSE_URING_OP_IN_OUT_SZ 128
struct fuse_uring_ent_in_out {
    uint64_t flags;
    uint64_t commit_id;
    uint32_t payload_sz;
    uint32_t padding;
    uint64_t reserved;
};
struct fuse_uring_req_header {
    char in_out[FUSE_URING_IN_OUT_HEADER_SZ];
    char op_in[FUSE_URING_OP_IN_OUT_SZ];
    struct fuse_uring_ent_in_out ring_ent_in_out;
};
enum { FUSE_IO_URING_CMD_REGISTER = 1, FUSE_IO_URING_CMD_COMMIT_AND_FETCH = 2 };
struct fuse_uring_cmd_req {
    uint64_t flags;
    uint64_t commit_id;
    uint16_t qid;
    uint8_t padding[6];
};

#define MAX_WRITE (128 * 1024)
#define PAYLOAD (MAX_WRITE)
#define ENTRIES_PER_QUEUE 8
#define DEV_BUF (MAX_WRITE + 4096)
#define DAY 86400
#define DEV_READ_TAG UINT64_MAX

typedef struct {
    char *name;
    uint64_t parent;
    int is_dir;
    char *data;
    size_t size;
} node_t;
static node_t *nodes; /* by inode; 0 unused, 1 the root */
static size_t n_nodes, cap_nodes;

static void die(const char *what) {
    perror(what);
    exit(1);
}

static uint64_t add_node(const char *name, uint64_t parent, int is_dir) {
    if (n_nodes == cap_nodes) {
        cap_nodes = cap_nodes ? 2 * cap_nodes : 1024;
        nodes = realloc(nodes, cap_nodes * sizeof *nodes);
        if (!nodes) die("realloc");
    }
    nodes[n_nodes] = (node_t){strdup(name), parent, is_dir, NULL, 0};
    return n_nodes++;
}

static void load(const char *path, uint64_t dir) {
    DIR *d = opendir(path);
    if (!d) die(path);
    struct dirent *e;
    while ((e = readdir(d))) {
        if (e->d_name[0] == '.') continue;
        char p[4096];
        snprintf(p, sizeof p, "%s/%s", path, e->d_name);
        struct stat st;
        if (lstat(p, &st)) die(p);
        if (S_ISDIR(st.st_mode)) {
            load(p, add_node(e->d_name, dir, 1));
        } else if (S_ISREG(st.st_mode)) {
            uint64_t ino = add_node(e->d_name, dir, 0);
            int fd = open(p, O_RDONLY);
            if (fd < 0) die(p);
            nodes[ino].data = malloc(st.st_size ? st.st_size : 1);
            if (read(fd, nodes[ino].data, st.st_size) != st.st_size) die(p);
            nodes[ino].size = st.st_size;
            close(fd);
        }
    }
    closedir(d);
}

static void fill_attr(uint64_t ino, struct fuse_attr *a) {
    memset(a, 0, sizeof *a);
    a->ino = ino;
    a->size = nodes[ino].size;
    a->blocks = (nodes[ino].size + 511) / 512;
    a->mode = nodes[ino].is_dir ? (S_IFDIR | 0555) : (S_IFREG | 0444);
    a->nlink = nodes[ino].is_dir ? 2 : 1;
    a->blksize = 4096;
}

/* A request's reply: an error, or out args of len bytes at out. */
typedef struct {
    int error;
    const void *out;
    uint32_t len;
    int no_reply;
} reply_t;

static char scratch[4096];

/* in: the request's op header (op_in); extra: what follows it (a lookup's name). */
static reply_t handle(const struct fuse_in_header *h, const char *in, const char *extra) {
    reply_t r = {0, NULL, 0, 0};
    uint64_t ino = h->nodeid;
    switch (h->opcode) {
    case FUSE_LOOKUP: {
        for (size_t i = 2; i < n_nodes; i++) {
            if (nodes[i].parent == ino && strcmp(nodes[i].name, extra) == 0) {
                struct fuse_entry_out *e = (void *)scratch;
                memset(e, 0, sizeof *e);
                e->nodeid = i;
                e->entry_valid = e->attr_valid = DAY;
                fill_attr(i, &e->attr);
                r.out = e;
                r.len = sizeof *e;
                return r;
            }
        }
        r.error = -ENOENT;
        return r;
    }
    case FUSE_GETATTR: {
        struct fuse_attr_out *a = (void *)scratch;
        memset(a, 0, sizeof *a);
        a->attr_valid = DAY;
        fill_attr(ino, &a->attr);
        r.out = a;
        r.len = sizeof *a;
        return r;
    }
    case FUSE_OPEN: {
        struct fuse_open_out *o = (void *)scratch;
        memset(o, 0, sizeof *o);
        o->open_flags = FOPEN_KEEP_CACHE;
        r.out = o;
        r.len = sizeof *o;
        return r;
    }
    case FUSE_READ: {
        const struct fuse_read_in *rd = (const void *)in;
        size_t size = nodes[ino].size, off = rd->offset;
        size_t n = off < size ? size - off : 0;
        if (n > rd->size) n = rd->size;
        r.out = nodes[ino].data + (off < size ? off : 0);
        r.len = n;
        return r;
    }
    case FUSE_RELEASE:
    case FUSE_RELEASEDIR:
        return r;
    case FUSE_IOCTL:
        r.error = -ENOTTY;
        return r;
    case FUSE_STATFS: {
        struct fuse_statfs_out *s = (void *)scratch;
        memset(s, 0, sizeof *s);
        s->st.bsize = s->st.frsize = 4096;
        s->st.namelen = 255;
        r.out = s;
        r.len = sizeof *s;
        return r;
    }
    case FUSE_FORGET:
    case FUSE_BATCH_FORGET:
    case FUSE_INTERRUPT:
        r.no_reply = 1;
        return r;
    default:
        r.error = -ENOSYS;
        return r;
    }
}

/* The op header's size in a /dev/fuse request, for the opcodes handle() reads past it. */
static size_t op_in_size(uint32_t opcode) {
    switch (opcode) {
    case FUSE_READ: return sizeof(struct fuse_read_in);
    default: return 0; /* (lookup: the name follows the header; the rest read nothing) */
    }
}

static int fuse_fd;
static unsigned long served_dev, served_ring; /* requests, by the way they came */

static void dev_reply(const struct fuse_in_header *h, reply_t r) {
    if (r.no_reply) return;
    struct fuse_out_header oh = {sizeof oh + (r.error ? 0 : r.len), r.error, h->unique};
    struct iovec iov[2] = {{&oh, sizeof oh}, {(void *)r.out, r.error ? 0 : r.len}};
    if (writev(fuse_fd, iov, r.error || !r.len ? 1 : 2) < 0 && errno != ENOENT) die("writev");
}

static void dev_request(char *buf, ssize_t n) {
    const struct fuse_in_header *h = (const void *)buf;
    if (n < (ssize_t)sizeof *h) return;
    const char *in = buf + sizeof *h;
    served_dev++;
    dev_reply(h, handle(h, in, in + op_in_size(h->opcode)));
}

static void init_session(int uring) {
    static char buf[DEV_BUF];
    ssize_t n = read(fuse_fd, buf, sizeof buf);
    if (n < 0) die("read INIT");
    struct fuse_in_header *h = (void *)buf;
    struct fuse_init_in *in = (void *)(buf + sizeof *h);
    if (h->opcode != FUSE_INIT) {
        fprintf(stderr, "expected INIT, got %u\n", h->opcode);
        exit(1);
    }
    uint32_t flags2 = (in->flags & FUSE_INIT_EXT) ? in->flags2 : 0;
    if (uring && !(flags2 & FUSE_OVER_IO_URING_FLAG2)) {
        fprintf(stderr, "the kernel does not offer FUSE over io_uring (enable_uring=0?)\n");
        exit(2);
    }
    struct fuse_init_out o;
    memset(&o, 0, sizeof o);
    o.major = FUSE_KERNEL_VERSION;
    o.minor = FUSE_KERNEL_MINOR_VERSION;
    o.max_readahead = in->max_readahead;
    o.flags = in->flags & (FUSE_ASYNC_READ | FUSE_MAX_PAGES | FUSE_INIT_EXT | FUSE_BIG_WRITES);
    o.flags2 = uring ? FUSE_OVER_IO_URING_FLAG2 : 0;
    o.max_background = 16;
    o.congestion_threshold = 12;
    o.max_write = MAX_WRITE;
    o.time_gran = 1;
    o.max_pages = MAX_WRITE / 4096;
    struct fuse_out_header oh = {sizeof oh + sizeof o, 0, h->unique};
    struct iovec iov[2] = {{&oh, sizeof oh}, {&o, sizeof o}};
    if (writev(fuse_fd, iov, 2) < 0) die("writev INIT");
}

/* ---- io_uring, by hand (no liburing) ---- */
static int ring_fd;
static unsigned *sq_head, *sq_tail, *sq_mask, *sq_array, *cq_head, *cq_tail, *cq_mask;
static struct io_uring_cqe *cqes;
static char *sqes; /* 128-byte SQEs */
static unsigned to_submit;

static void ring_setup(unsigned entries) {
    struct io_uring_params p;
    memset(&p, 0, sizeof p);
    p.flags = IORING_SETUP_SQE128 | IORING_SETUP_CQSIZE;
    p.cq_entries = 2 * entries;
    ring_fd = syscall(__NR_io_uring_setup, entries, &p);
    if (ring_fd < 0) die("io_uring_setup");
    size_t sq_sz = p.sq_off.array + p.sq_entries * sizeof(unsigned);
    size_t cq_sz = p.cq_off.cqes + p.cq_entries * sizeof(struct io_uring_cqe);
    if (!(p.features & IORING_FEAT_SINGLE_MMAP)) {
        fprintf(stderr, "needs IORING_FEAT_SINGLE_MMAP\n");
        exit(1);
    }
    size_t sz = sq_sz > cq_sz ? sq_sz : cq_sz;
    char *sq = mmap(NULL, sz, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, ring_fd, IORING_OFF_SQ_RING);
    if (sq == MAP_FAILED) die("mmap sq");
    sq_head = (void *)(sq + p.sq_off.head);
    sq_tail = (void *)(sq + p.sq_off.tail);
    sq_mask = (void *)(sq + p.sq_off.ring_mask);
    sq_array = (void *)(sq + p.sq_off.array);
    cq_head = (void *)(sq + p.cq_off.head);
    cq_tail = (void *)(sq + p.cq_off.tail);
    cq_mask = (void *)(sq + p.cq_off.ring_mask);
    cqes = (void *)(sq + p.cq_off.cqes);
    sqes = mmap(NULL, p.sq_entries * 128, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, ring_fd, IORING_OFF_SQES);
    if (sqes == MAP_FAILED) die("mmap sqes");
}

static struct io_uring_sqe *get_sqe(void) {
    unsigned tail = *sq_tail, idx = tail & *sq_mask;
    struct io_uring_sqe *sqe = (void *)(sqes + 128 * idx);
    memset(sqe, 0, 128);
    sq_array[idx] = idx;
    __atomic_store_n(sq_tail, tail + 1, __ATOMIC_RELEASE);
    to_submit++;
    return sqe;
}

/* Submit what is queued and wait for at least one completion. */
static void ring_enter(void) {
    for (;;) {
        int r = syscall(__NR_io_uring_enter, ring_fd, to_submit, 1, IORING_ENTER_GETEVENTS, NULL, 0);
        if (r >= 0) {
            to_submit -= r;
            return;
        }
        if (errno != EINTR) die("io_uring_enter");
    }
}

typedef struct {
    struct fuse_uring_req_header hdr;
    struct iovec iov[2];
    uint16_t qid;
    char *payload;
} ent_t;

static void uring_cmd(ent_t *e, uint32_t op, uint64_t commit_id, uint64_t tag) {
    struct io_uring_sqe *sqe = get_sqe();
    sqe->opcode = IORING_OP_URING_CMD;
    sqe->fd = fuse_fd;
    sqe->cmd_op = op;
    sqe->user_data = tag;
    if (op == FUSE_IO_URING_CMD_REGISTER) {
        sqe->addr = (uint64_t)(uintptr_t)e->iov;
        sqe->len = 2;
    }
    struct fuse_uring_cmd_req *req = (void *)sqe->cmd;
    req->qid = e->qid;
    req->commit_id = commit_id;
}

static char dev_buf[DEV_BUF];

static void dev_read_sqe(void) {
    struct io_uring_sqe *sqe = get_sqe();
    sqe->opcode = IORING_OP_READ;
    sqe->fd = fuse_fd;
    sqe->addr = (uint64_t)(uintptr_t)dev_buf;
    sqe->len = sizeof dev_buf;
    sqe->off = (uint64_t)-1;
    sqe->user_data = DEV_READ_TAG;
}

static int serve_uring(void) {
    int queues = (int)sysconf(_SC_NPROCESSORS_CONF);
    int n = queues * ENTRIES_PER_QUEUE;
    ring_setup(2 * n + 8);
    ent_t *ents = calloc(n, sizeof *ents);
    for (int i = 0; i < n; i++) {
        ents[i].qid = i / ENTRIES_PER_QUEUE;
        ents[i].payload = aligned_alloc(4096, PAYLOAD);
        ents[i].iov[0] = (struct iovec){&ents[i].hdr, sizeof ents[i].hdr};
        ents[i].iov[1] = (struct iovec){ents[i].payload, PAYLOAD};
        uring_cmd(&ents[i], FUSE_IO_URING_CMD_REGISTER, 0, i);
    }
    dev_read_sqe();
    for (;;) {
        ring_enter();
        unsigned head = *cq_head, tail = __atomic_load_n(cq_tail, __ATOMIC_ACQUIRE);
        for (; head != tail; head++) {
            struct io_uring_cqe *c = &cqes[head & *cq_mask];
            if (c->user_data == DEV_READ_TAG) {
                if (c->res < 0) {
                    if (c->res == -ENODEV) return 0; /* unmounted */
                    if (c->res != -EINTR && c->res != -EAGAIN && c->res != -ENOENT) {
                        fprintf(stderr, "dev read: %s\n", strerror(-c->res));
                        return 1;
                    }
                } else {
                    dev_request(dev_buf, c->res);
                }
                dev_read_sqe();
                continue;
            }
            ent_t *e = &ents[c->user_data];
            if (c->res < 0) {
                if (c->res == -ENOTCONN || c->res == -ECONNABORTED || c->res == -ENODEV) return 0;
                fprintf(stderr, "ring entry %llu: %s\n", (unsigned long long)c->user_data, strerror(-c->res));
                return 1;
            }
            struct fuse_in_header *h = (void *)e->hdr.in_out;
            served_ring++;
            uint64_t commit_id = e->hdr.ring_ent_in_out.commit_id;
            /* (lookup's name is in the payload; the op header, if any, in op_in) */
            reply_t r = handle(h, e->hdr.op_in, e->payload);
            struct fuse_out_header *oh = (void *)e->hdr.in_out;
            uint64_t unique = h->unique;
            uint32_t len = r.error ? 0 : r.len;
            if (len && r.out != e->payload) memcpy(e->payload, r.out, len);
            oh->len = sizeof *oh + len;
            oh->error = r.error;
            oh->unique = unique;
            e->hdr.ring_ent_in_out.payload_sz = len;
            uring_cmd(e, FUSE_IO_URING_CMD_COMMIT_AND_FETCH, commit_id, c->user_data);
        }
        __atomic_store_n(cq_head, head, __ATOMIC_RELEASE);
    }
}

static int serve_dev(void) {
    static char buf[DEV_BUF];
    for (;;) {
        ssize_t n = read(fuse_fd, buf, sizeof buf);
        if (n < 0) {
            if (errno == ENODEV) return 0; /* unmounted */
            if (errno == EINTR || errno == EAGAIN || errno == ENOENT) continue;
            die("read");
        }
        dev_request(buf, n);
    }
}

int main(int argc, char **argv) {
    if (argc != 4 || (strcmp(argv[1], "--dev") && strcmp(argv[1], "--uring"))) {
        fprintf(stderr, "usage: %s --dev|--uring SRC MNT\n", argv[0]);
        return 2;
    }
    int uring = strcmp(argv[1], "--uring") == 0;
    add_node("", 0, 1);  /* 0: unused */
    add_node("", 1, 1);  /* 1: the root */
    load(argv[2], 1);
    fuse_fd = open("/dev/fuse", O_RDWR | O_CLOEXEC);
    if (fuse_fd < 0) die("/dev/fuse");
    char opts[256];
    snprintf(opts, sizeof opts, "fd=%d,rootmode=40000,user_id=0,group_id=0,allow_other", fuse_fd);
    if (mount("minimal", argv[3], "fuse.minimal", MS_NOSUID | MS_NODEV | MS_RDONLY, opts)) die("mount");
    init_session(uring);
    fprintf(stderr, "serving %zu nodes over %s\n", n_nodes - 2, uring ? "io_uring" : "/dev/fuse");
    int ret = uring ? serve_uring() : serve_dev();
    fprintf(stderr, "served %lu requests from /dev/fuse reads, %lu from ring entries\n",
            served_dev, served_ring);
    return ret;
}
