/* A minimal libfuse3 low-level daemon in C serving a folder tree from RAM: the peer that
 * shows what a FUSE request costs without Python (scripts/bench/minimal_daemon.py is the
 * same daemon in pyfuse3 + trio; bench_hotpath.py runs both beside fusefs).
 *
 * As the Python one: every file is read into memory at start; entries and attributes carry
 * a day's timeout; open answers keep_cache, so a file's pages stay in the kernel across
 * opens; listings are readdirplus (entries with attributes, as pyfuse3's); no flush
 * handler (the kernel then stops sending flush); ioctl is answered ENOTTY,
 * as the patched pyfuse3 does (Python's open() asks isatty of every file). One thread
 * (fuse_session_loop), as pyfuse3's loop. It counts requests by type and reports them with
 * its CPU time (getrusage) as JSON in the file .minimal-stats at the root, read by name
 * only (a fresh snapshot per open).
 *
 * build: gcc -O2 -o minimal_c_daemon minimal_c_daemon.c $(pkg-config --cflags --libs fuse3)
 * usage: minimal_c_daemon SRC MNT   (foreground; SIGTERM or fusermount3 -u to stop)
 */
#define FUSE_USE_VERSION 34
#include <fuse_lowlevel.h>

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#define DAY (24 * 3600.0)
#define STATS_NAME ".minimal-stats"

typedef struct {
    char *name;
    fuse_ino_t parent;
    int is_dir;
    char *data; /* files */
    size_t size;
    fuse_ino_t *children; /* directories */
    size_t n_children, cap_children;
} node_t;

static node_t *nodes; /* by inode; 0 unused, 1 the root */
static size_t n_nodes, cap_nodes;
static fuse_ino_t stats_ino;

enum { R_LOOKUP, R_GETATTR, R_OPENDIR, R_READDIR, R_RELEASEDIR, R_OPEN, R_READ, R_RELEASE,
       R_IOCTL, R_FORGET, R_N };
static const char *const request_names[R_N] = {"lookup", "getattr", "opendir", "readdir",
                                               "releasedir", "open", "read", "release",
                                               "ioctl", "forget"};
static unsigned long requests[R_N];
static double cpu0;

static void *xmalloc(size_t n) {
    void *p = malloc(n ? n : 1);
    if (p == NULL) {
        perror("malloc");
        exit(1);
    }
    return p;
}

static fuse_ino_t add_node(const char *name, fuse_ino_t parent, int is_dir) {
    if (n_nodes == cap_nodes) {
        cap_nodes = cap_nodes ? 2 * cap_nodes : 1024;
        nodes = realloc(nodes, cap_nodes * sizeof(node_t));
        if (nodes == NULL) {
            perror("realloc");
            exit(1);
        }
    }
    fuse_ino_t ino = n_nodes++;
    memset(&nodes[ino], 0, sizeof(node_t));
    nodes[ino].name = strdup(name);
    nodes[ino].parent = parent;
    nodes[ino].is_dir = is_dir;
    if (parent) {
        node_t *p = &nodes[parent];
        if (p->n_children == p->cap_children) {
            p->cap_children = p->cap_children ? 2 * p->cap_children : 16;
            p->children = realloc(p->children, p->cap_children * sizeof(fuse_ino_t));
        }
        p->children[p->n_children++] = ino;
    }
    return ino;
}

static int by_name(const struct dirent **a, const struct dirent **b) {
    return strcmp((*a)->d_name, (*b)->d_name);
}

static void load(const char *path, fuse_ino_t dir) {
    struct dirent **list;
    int n = scandir(path, &list, NULL, by_name);
    if (n < 0) {
        perror(path);
        exit(1);
    }
    for (int i = 0; i < n; i++) {
        const char *name = list[i]->d_name;
        if (strcmp(name, ".") && strcmp(name, "..")) {
            char *full = xmalloc(strlen(path) + strlen(name) + 2);
            sprintf(full, "%s/%s", path, name);
            struct stat st;
            if (stat(full, &st) == 0 && S_ISDIR(st.st_mode)) {
                load(full, add_node(name, dir, 1));
            } else if (S_ISREG(st.st_mode)) {
                fuse_ino_t ino = add_node(name, dir, 0);
                node_t *f = &nodes[ino];
                f->size = (size_t)st.st_size;
                f->data = xmalloc(f->size);
                int fd = open(full, O_RDONLY);
                size_t got = 0;
                while (fd >= 0 && got < f->size) {
                    ssize_t r = read(fd, f->data + got, f->size - got);
                    if (r <= 0)
                        break;
                    got += (size_t)r;
                }
                if (fd < 0 || got != f->size) {
                    perror(full);
                    exit(1);
                }
                close(fd);
            }
            free(full);
        }
        free(list[i]);
    }
    free(list);
}

static double cpu_seconds(void) {
    struct rusage r;
    getrusage(RUSAGE_SELF, &r);
    return r.ru_utime.tv_sec + r.ru_utime.tv_usec / 1e6 + r.ru_stime.tv_sec + r.ru_stime.tv_usec / 1e6;
}

/* The statistics as JSON, malloc'd; *len its length. */
static char *stats_json(size_t *len) {
    char *buf = xmalloc(1024);
    int n = snprintf(buf, 1024, "{\"cpu_s\": %.6f, \"requests\": {", cpu_seconds() - cpu0);
    for (int i = 0; i < R_N; i++)
        if (requests[i])
            n += snprintf(buf + n, 1024 - (size_t)n, "%s\"%s\": %lu", buf[n - 1] == '{' ? "" : ", ",
                          request_names[i], requests[i]);
    n += snprintf(buf + n, 1024 - (size_t)n, "}}");
    *len = (size_t)n;
    return buf;
}

static void fill_entry(fuse_ino_t ino, struct fuse_entry_param *e) {
    memset(e, 0, sizeof(*e));
    e->ino = ino;
    e->attr.st_ino = ino;
    e->attr.st_uid = getuid();
    e->attr.st_gid = getgid();
    e->attr.st_nlink = 1;
    if (ino == stats_ino) {
        size_t len;
        free(stats_json(&len));
        e->attr.st_mode = S_IFREG | 0444;
        e->attr.st_size = (off_t)len;
        return; /* (timeouts 0: a fresh size at every stat) */
    }
    e->attr_timeout = e->entry_timeout = DAY;
    if (nodes[ino].is_dir) {
        e->attr.st_mode = S_IFDIR | 0755;
    } else {
        e->attr.st_mode = S_IFREG | 0444;
        e->attr.st_size = (off_t)nodes[ino].size;
    }
}

static int valid(fuse_ino_t ino) { return ino >= 1 && ino < n_nodes; }

static void op_lookup(fuse_req_t req, fuse_ino_t parent, const char *name) {
    requests[R_LOOKUP]++;
    struct fuse_entry_param e;
    if (parent == FUSE_ROOT_ID && strcmp(name, STATS_NAME) == 0) {
        fill_entry(stats_ino, &e);
        fuse_reply_entry(req, &e);
        return;
    }
    if (!valid(parent) || !nodes[parent].is_dir) {
        fuse_reply_err(req, ENOENT);
        return;
    }
    node_t *p = &nodes[parent];
    for (size_t i = 0; i < p->n_children; i++) {
        if (strcmp(nodes[p->children[i]].name, name) == 0) {
            fill_entry(p->children[i], &e);
            fuse_reply_entry(req, &e);
            return;
        }
    }
    fuse_reply_err(req, ENOENT);
}

static void op_getattr(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi) {
    (void)fi;
    requests[R_GETATTR]++;
    if (!valid(ino) && ino != stats_ino) {
        fuse_reply_err(req, ENOENT);
        return;
    }
    struct fuse_entry_param e;
    fill_entry(ino, &e);
    fuse_reply_attr(req, &e.attr, e.attr_timeout);
}

static void op_opendir(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi) {
    requests[R_OPENDIR]++;
    if (!valid(ino) || !nodes[ino].is_dir) {
        fuse_reply_err(req, ENOTDIR);
        return;
    }
    fi->fh = ino;
    fuse_reply_open(req, fi);
}

/* Listings; plus: readdirplus, as pyfuse3 answers readdir (each entry with its
 * attributes, so a listing spares the lookups of the first opens). */
static void list_dir(fuse_req_t req, size_t size, off_t off, struct fuse_file_info *fi, int plus) {
    requests[R_READDIR]++;
    node_t *d = &nodes[fi->fh];
    char *buf = xmalloc(size);
    size_t used = 0;
    for (size_t i = (size_t)off; i < d->n_children; i++) {
        fuse_ino_t child = d->children[i];
        struct fuse_entry_param e;
        fill_entry(child, &e);
        size_t need = plus ? fuse_add_direntry_plus(req, buf + used, size - used, nodes[child].name,
                                                    &e, (off_t)(i + 1))
                           : fuse_add_direntry(req, buf + used, size - used, nodes[child].name,
                                               &e.attr, (off_t)(i + 1));
        if (need > size - used)
            break;
        used += need;
    }
    fuse_reply_buf(req, buf, used);
    free(buf);
}

static void op_readdir(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off,
                       struct fuse_file_info *fi) {
    (void)ino;
    list_dir(req, size, off, fi, 0);
}

static void op_readdirplus(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off,
                           struct fuse_file_info *fi) {
    (void)ino;
    list_dir(req, size, off, fi, 1);
}

static void op_releasedir(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi) {
    (void)ino, (void)fi;
    requests[R_RELEASEDIR]++;
    fuse_reply_err(req, 0);
}

typedef struct {
    char *data;
    size_t len;
} snapshot_t;

static void op_open(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi) {
    requests[R_OPEN]++;
    if (ino == stats_ino) { /* a snapshot per open, under a handle of its own */
        snapshot_t *s = xmalloc(sizeof(*s));
        s->data = stats_json(&s->len);
        fi->fh = (uint64_t)(uintptr_t)s;
        fi->direct_io = 1;
    } else if (!valid(ino) || nodes[ino].is_dir) {
        fuse_reply_err(req, EISDIR);
        return;
    } else {
        fi->fh = 0;
        fi->keep_cache = 1;
    }
    fuse_reply_open(req, fi);
}

static void op_read(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off,
                    struct fuse_file_info *fi) {
    requests[R_READ]++;
    const char *data;
    size_t len;
    if (fi->fh) {
        snapshot_t *s = (snapshot_t *)(uintptr_t)fi->fh;
        data = s->data, len = s->len;
    } else {
        data = nodes[ino].data, len = nodes[ino].size;
    }
    if ((size_t)off >= len) {
        fuse_reply_buf(req, NULL, 0);
        return;
    }
    if (size > len - (size_t)off)
        size = len - (size_t)off;
    fuse_reply_buf(req, data + off, size);
}

static void op_release(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi) {
    (void)ino;
    requests[R_RELEASE]++;
    if (fi->fh) {
        snapshot_t *s = (snapshot_t *)(uintptr_t)fi->fh;
        free(s->data);
        free(s);
    }
    fuse_reply_err(req, 0);
}

static void op_ioctl(fuse_req_t req, fuse_ino_t ino, int cmd, void *arg,
                     struct fuse_file_info *fi, unsigned flags, const void *in_buf,
                     size_t in_bufsz, size_t out_bufsz) {
    (void)ino, (void)cmd, (void)arg, (void)fi, (void)flags, (void)in_buf, (void)in_bufsz,
        (void)out_bufsz;
    requests[R_IOCTL]++;
    fuse_reply_err(req, ENOTTY);
}

static void op_forget(fuse_req_t req, fuse_ino_t ino, uint64_t nlookup) {
    (void)ino, (void)nlookup;
    requests[R_FORGET]++;
    fuse_reply_none(req);
}

static void op_init(void *userdata, struct fuse_conn_info *conn) {
    (void)userdata;
    conn->want &= ~FUSE_CAP_READDIRPLUS_AUTO; /* always readdirplus, as pyfuse3 asks */
}

static const struct fuse_lowlevel_ops ops = {
    .init = op_init, .lookup = op_lookup, .getattr = op_getattr, .opendir = op_opendir, .readdir = op_readdir,
    .readdirplus = op_readdirplus, .releasedir = op_releasedir, .open = op_open, .read = op_read, .release = op_release,
    .ioctl = op_ioctl, .forget = op_forget,
};

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: %s SRC MNT\n", argv[0]);
        return 2;
    }
    add_node("", 0, 1); /* 0: unused */
    add_node("", 0, 1); /* FUSE_ROOT_ID */
    load(argv[1], FUSE_ROOT_ID);
    stats_ino = n_nodes;
    char *fuse_argv[] = {argv[0], "-o", "default_permissions,fsname=minimal_c", NULL};
    struct fuse_args args = FUSE_ARGS_INIT(3, fuse_argv);
    struct fuse_session *se = fuse_session_new(&args, &ops, sizeof(ops), NULL);
    if (se == NULL)
        return 1;
    int ret = 1;
    if (fuse_set_signal_handlers(se) == 0) {
        if (fuse_session_mount(se, argv[2]) == 0) {
            cpu0 = cpu_seconds();
            ret = fuse_session_loop(se);
            fuse_session_unmount(se);
        }
        fuse_remove_signal_handlers(se);
    }
    fuse_session_destroy(se);
    return ret ? 1 : 0;
}
