/* OPEN, RELEASE and GETATTR of dataset files answered in C (issue 11).
 *
 * A warm read of a small file costs the daemon an OPEN (the reader waits for it) and a RELEASE
 * (asynchronous): with long entry/attr timeouts and keep_cache, nothing else reaches it. Through
 * pyfuse3 each is a trio task running a Python handler. For the dataset both answers are fixed:
 * the dataset is immutable (every mutating call on it fails with EROFS, and no rank can create a
 * name the dataset has), the kernel checks permissions itself (default_permissions), and
 * MountView.open answers an open without write intent with the inode as file handle and
 * keep_cache, while MountView.release does nothing for such a handle. So once Python has
 * handed over the manifest's columns (_shim_dataset.c: inodes 1..n) and switched this on
 * (`fast_open`), an OPEN of such an inode without write intent is answered here with the same
 * handle (through the shim's fuse_reply_open, which adds noflush where enabled), and a RELEASE
 * of a dataset handle (1..n, whoever opened it) with success. Everything else goes to
 * pyfuse3's handlers. READ gets the same handle either way, so Python's read path is unchanged.
 *
 * GETATTR: on a writable mount the kernel marks a file's atime stale after every READ it sent,
 * so the next stat(2) (every open() in Python, cat, ...) asks the daemon again. A dataset
 * file's attributes come from the manifest, identical on every rank and never changed: with the
 * manifest's columns, a GETATTR of a dataset regular file is answered here with what
 * Operations._attr gives for it (fanstore_dataset_stat: nlink 1, rdev 0, blksize 128 KiB, all
 * times the mtime).
 *
 * NO OPEN (`no_open`, issue 11): every OPEN is answered ENOSYS, which sets the connection's
 * `no_open`: the kernel then opens every regular file without asking (fh 0, keep_cache) and sends
 * no RELEASE for it (CREATE still gets a handle and a RELEASE). So that the daemon can tell files
 * apart without handles, a request whose fh is 0 gets the node id as fh before anyone reads it
 * (`fh_of_inode`): a dataset file's READ then looks as it always did (fh == inode), and Python
 * sees an inode where a handle would be (MountView). INIT drops atomic O_TRUNC in this mode: with
 * it and no OPEN, the kernel would never tell the daemon about open(O_TRUNC); without it the
 * truncation comes as a SETATTR.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <time.h>
#include <stdint.h>
#include <string.h>
#include <sys/stat.h>

#include "_shim_dataset.h"
#include "_shim_ops.h"
#include "_shim_readdir.h"
#include "_shim_remote.h"

/* MountView.WRITE_FLAGS: an open with any of these goes to Python (EROFS there) */
#define WRITE_FLAGS (O_WRONLY | O_RDWR | O_TRUNC | O_APPEND | O_CREAT)

typedef void (*file_op_t)(fuse_req_t, fuse_ino_t, struct fuse_file_info *);
typedef int (*reply_err_t)(fuse_req_t, int);

typedef int (*reply_attr_t)(fuse_req_t, const struct stat *, double);

static file_op_t py_open, py_release, py_getattr;
static reply_attr_t reply_attr;
static reply_err_t reply_err; /* libfuse's fuse_reply_err (the shim does not link libfuse) */
static double attr_timeout;
static unsigned long long c_opens, c_releases, c_getattrs;
static int no_open; /* answer every OPEN with ENOSYS (the kernel's no_open mode) */
static unsigned long long c_no_opens;
typedef void (*init_t)(void *, struct fuse_conn_info *);
static init_t py_init;

static int open_here(uint64_t ino, uint32_t flags) {
    return fanstore_dataset_serves(FANSTORE_SERVE_FILES, ino) && !(flags & WRITE_FLAGS);
}

static int release_here(uint64_t fh) { return fanstore_dataset_serves(FANSTORE_SERVE_FILES, fh); }

static int getattr_here(uint64_t ino) {
    return fanstore_dataset_serves(FANSTORE_SERVE_FILES, ino) &&
           fanstore_ds.kind[ino - 1] == FANSTORE_KIND_FILE;
}

static void open_in_c(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi) {
    if (no_open) {
        __atomic_add_fetch(&c_no_opens, 1, __ATOMIC_RELAXED);
        reply_err(req, ENOSYS);
        return;
    }
    if (open_here(ino, (uint32_t)fi->flags)) {
        fi->fh = ino;
        fi->keep_cache = 1;
        fi->direct_io = 0;
        fi->nonseekable = 0;
        __atomic_add_fetch(&c_opens, 1, __ATOMIC_RELAXED);
        fuse_reply_open(req, fi); /* _noflush.c's: noflush on read-only opens when enabled */
        return;
    }
    if (fanstore_c_thread) /* cannot happen: a thread processes only what answered() took */
        reply_err(req, EIO);
    else
        py_open(req, ino, fi);
}

static void release_in_c(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi) {
    if (release_here(fi->fh)) {
        __atomic_add_fetch(&c_releases, 1, __ATOMIC_RELAXED);
        reply_err(req, 0);
        return;
    }
    if (fanstore_c_thread) /* cannot happen: a thread processes only what answered() took */
        reply_err(req, EIO);
    else
        py_release(req, ino, fi);
}

static void getattr_in_c(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi) {
    if (getattr_here(ino)) {
        struct stat st;
        fanstore_dataset_stat(ino - 1, &st);
        __atomic_add_fetch(&c_getattrs, 1, __ATOMIC_RELAXED);
        reply_attr(req, &st, attr_timeout);
        return;
    }
    if (fanstore_c_thread) /* cannot happen: a thread processes only what answered() took */
        reply_err(req, EIO);
    else
        py_getattr(req, ino, fi);
}

/* The request loop. pyfuse3 answers each request from a trio task: wait until /dev/fuse is
 * readable, fuse_session_receive_buf, fuse_session_process_buf, then the same again; tens of
 * microseconds of Python per request even when the shim answers it. This fuse_session_receive_buf
 * (interposed like _noflush.c's fuse_reply_open) answers the requests the handlers above answer
 * in C right away, then waits for the next one (GIL released, up to `linger_us`) and goes on:
 * a reader's LOOKUP, OPEN, READ, RELEASE, GETATTR, LOOKUP... never return to trio. The first request C does not
 * answer is returned to pyfuse3 as usual; nothing arriving in time, LINGER_BATCH requests
 * answered in a row, or 1 ms spent here, returns -EINTR, on which pyfuse3 waits again (other
 * trio tasks run first). With _shim_threads.c's request threads (FANSTORE_FUSE_THREADS) the
 * requests come from their queue instead of /dev/fuse (fanstore_threads_pop, waiting on its
 * eventfd): what reaches this thread then is what they could not answer, READs in C included. */
struct in_header { /* struct fuse_in_header of <linux/fuse.h>: the kernel's ABI */
    uint32_t len, opcode;
    uint64_t unique, nodeid;
    uint32_t uid, gid, pid;
    uint16_t total_extlen, padding;
};
enum { OP_LOOKUP = 1, OP_GETATTR = 3, OP_SETATTR = 4, OP_OPEN = 14, OP_READ = 15, OP_WRITE = 16,
       OP_RELEASE = 18, OP_FSYNC = 20, OP_FLUSH = 25, OP_GETLK = 31, OP_SETLK = 32, OP_SETLKW = 33,
       OP_IOCTL = 39, OP_POLL = 40, OP_FALLOCATE = 43, OP_LSEEK = 46, OP_COPY_FILE_RANGE = 47 };
#define FATTR_FH_BIT (1u << 3) /* fuse_setattr_in.valid: fh is set */
enum { LINGER_BATCH = 64 };
#define LINGER_TOTAL_NS 1000000 /* and never longer than 1 ms in all before trio runs again */

typedef int (*receive_t)(struct fuse_session *, struct fuse_buf *);
typedef void (*process_t)(struct fuse_session *, const struct fuse_buf *);
typedef int (*session_fd_t)(struct fuse_session *);

static int no_ioctl; /* no ioctl handler: libfuse answers IOCTL with ENOSYS in C */
static long linger_us; /* 0: the loop is off (every request goes back to pyfuse3) */
static unsigned long long lingered; /* requests answered without returning to trio */
static unsigned long long trio_returns; /* times the loop handed back to trio */
static unsigned long long trio_busy;    /* of which because another trio task was runnable */
/* Trio-aware lingering (linger_trio): trio's wake-up sockets (other threads' run_sync_soon,
 * trio.from_thread, signals; forced wake-ups) and its run queue. While no task is runnable and
 * no thread or signal wants trio, it has nothing to do that cannot wait a little, so the loop
 * waits longer (TRIO_IDLE_US) for the next request and keeps going (trio_total_ns, FANSTORE_FUSE_TRIO_TOTAL_US): each
 * return to trio costs pyfuse3 a task spawned and torn down, a lock and an epoll round
 * (~100 us of CPU, measured), once per cold READ with the plain linger. Trio's epoll itself
 * cannot tell: pyfuse3's spare task always waits there on /dev/fuse. Timers and other
 * descriptors of trio tasks are late by at most that. */
#define TRIO_FDS 2
static int trio_fds[TRIO_FDS] = {-1, -1};
static int trio_fd = -1; /* >= 0: trio-aware (the first wake-up socket) */
static PyObject *trio_runq;
#define TRIO_IDLE_US 5000
static int64_t trio_total_ns = 5000000; /* fast_open's trio_total_us */

/* Whether a request thread of _shim_threads.c answers dataset READs itself, local and remote
 * (FANSTORE_FUSE_THREAD_READS, default 1: a hop through trio costs ~5 us of CPU per READ). */
static int thread_reads(void) {
    static int on = -1;
    if (on < 0) {
        const char *v = getenv("FANSTORE_FUSE_THREAD_READS");
        on = v == NULL || strcmp(v, "0") != 0;
    }
    return on;
}

/* In no_open mode, a request about an open file whose fh is 0 (opened without OPEN) gets the
 * node id as its fh, in the buffer itself, before C or Python looks at it. Handles are never 0
 * (dataset: the inode; written: WRITE_FH + k; remote: REMOTE_FH + k), so this is idempotent. */
static void fh_of_inode(const struct fuse_buf *buf, int len) {
    if (!no_open || (buf->flags & FUSE_BUF_IS_FD) || buf->mem == NULL ||
        len < (int)sizeof(struct in_header) + 16)
        return;
    struct in_header *h = buf->mem;
    char *body = (char *)buf->mem + sizeof(*h);
    size_t at = 0;
    uint32_t valid;
    switch (h->opcode) {
    case OP_READ: case OP_WRITE: case OP_FSYNC: case OP_FLUSH: case OP_GETLK: case OP_SETLK:
    case OP_SETLKW: case OP_IOCTL: case OP_POLL: case OP_FALLOCATE: case OP_LSEEK:
    case OP_COPY_FILE_RANGE: /* fh first in each one's *_in struct (copy: fh_in) */
        break;
    case OP_SETATTR: /* fuse_setattr_in: valid, padding, fh */
        memcpy(&valid, body, 4);
        if (!(valid & FATTR_FH_BIT))
            return;
        at = 8;
        break;
    default:
        return;
    }
    uint64_t fh;
    memcpy(&fh, body + at, 8);
    if (fh == 0 && h->nodeid != 0)
        memcpy(body + at, &h->nodeid, 8);
}

/* Whether the handlers above answer this request in C (the same tests they make), on the trio
 * thread (`on_trio`) or on the request threads of _shim_threads.c (no Python, no GIL). */
int fanstore_answered(const struct fuse_buf *buf, int len, int on_trio) {
    if ((buf->flags & FUSE_BUF_IS_FD) || buf->mem == NULL || len < (int)sizeof(struct in_header))
        return 0;
    fh_of_inode(buf, len);
    const struct in_header *h = buf->mem;
    const char *body = (const char *)buf->mem + sizeof(*h);
    size_t left = (size_t)len - sizeof(*h);
    uint32_t u32;
    uint64_t u64;
    switch (h->opcode) {
    case OP_IOCTL: /* Python's open() asks isatty() (TCGETS) of every buffered file it opens */
        return no_ioctl;
    case OP_LOOKUP:
        return fanstore_lookup_answered(h->nodeid, body, left); /* _shim_readdir.c */
    case OP_GETATTR:
        return getattr_here(h->nodeid);
    case OP_OPEN:
        if (no_open)
            return 1; /* ENOSYS, once per connection in effect */
        if (left < 8)
            return 0;
        memcpy(&u32, body, 4); /* fuse_open_in.flags */
        return open_here(h->nodeid, u32);
    case OP_READ: /* on the request threads too: neither path needs the GIL (a fallback takes it) */
        return (on_trio || thread_reads()) &&
               (fanstore_read_answered(h->nodeid, body, left) || /* _shim_read.c */
                fanstore_remote_answered(h->nodeid, body, left)); /* _shim_remote_read.c */
    case OP_RELEASE:
        if (left < 8)
            return 0;
        memcpy(&u64, body, 8); /* fuse_release_in.fh */
        return release_here(u64);
    default:
        return 0;
    }
}

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* Whether `fd` became readable within `us` (and, in trio-aware mode, before trio's epoll
 * descriptor did: then trio has work, and the loop must hand back). */
static int wait_readable(int fd, long us) {
    struct pollfd p[1 + TRIO_FDS] = {{.fd = fd, .events = POLLIN}};
    for (int k = 0; k < TRIO_FDS; k++)
        p[1 + k] = (struct pollfd){.fd = trio_fd >= 0 ? trio_fds[k] : -1, .events = POLLIN};
    struct timespec t = {.tv_sec = us / 1000000, .tv_nsec = (us % 1000000) * 1000};
    int r;
    Py_BEGIN_ALLOW_THREADS r = ppoll(p, 1 + TRIO_FDS, &t, NULL);
    Py_END_ALLOW_THREADS if (r <= 0 || !(p[0].revents & POLLIN)) return 0;
    for (int k = 0; k < TRIO_FDS; k++)
        if (p[1 + k].revents & POLLIN)
            return 0;
    return 1;
}

/* Whether a trio task other than pyfuse3's own request loops ("pyfuse-NN": a spare one is
 * woken each time the loop's lock changes hands) is runnable. Under the GIL. */
static int trio_has_work(void) {
    if (trio_runq == NULL || PyObject_Length(trio_runq) <= 0) {
        PyErr_Clear();
        return 0;
    }
    PyObject *it = PyObject_GetIter(trio_runq), *task;
    int other = it == NULL;
    while (!other && it != NULL && (task = PyIter_Next(it)) != NULL) {
        PyObject *name = PyObject_GetAttrString(task, "name");
        const char *s = name != NULL && PyUnicode_Check(name) ? PyUnicode_AsUTF8(name) : NULL;
        other = s == NULL || strncmp(s, "pyfuse-", 7) != 0;
        Py_XDECREF(name);
        Py_DECREF(task);
    }
    Py_XDECREF(it);
    PyErr_Clear();
    return other;
}

int fuse_session_receive_buf(struct fuse_session *se, struct fuse_buf *buf) {
    static receive_t real_receive;
    static process_t real_process;
    static session_fd_t session_fd;
    if (real_receive == NULL) {
        real_receive = (receive_t)fanstore_libfuse_symbol("fuse_session_receive_buf");
        real_process = (process_t)fanstore_libfuse_symbol("fuse_session_process_buf");
        session_fd = (session_fd_t)fanstore_libfuse_symbol("fuse_session_fd");
    }
    if (real_receive == NULL || real_receive == fuse_session_receive_buf)
        return -ENOSYS; /* libfuse not found: cannot happen once a session exists */
    int threaded = fanstore_threads_on(se); /* requests come from _shim_threads.c's queue */
    int res = threaded ? fanstore_threads_pop(buf) : real_receive(se, buf);
    if (res > 0)
        fh_of_inode(buf, res);
    if (linger_us <= 0 || real_process == NULL || session_fd == NULL)
        return res;
    int fd = threaded ? fanstore_threads_fd() : session_fd(se);
    int64_t start = 0;
    int aware = trio_fd >= 0;
    long idle = aware && linger_us < TRIO_IDLE_US ? TRIO_IDLE_US : linger_us;
    for (int n = 0; res > 0 && fanstore_answered(buf, res, 1); n++) {
        real_process(se, buf);
        lingered++;
        if (n == 0)
            start = now_ns();
        else if (now_ns() - start > (aware ? trio_total_ns : LINGER_TOTAL_NS))
            break;
        if (!aware && n + 1 >= LINGER_BATCH)
            break;
        if (trio_has_work()) {
            trio_busy++;
            break;
        }
        if (!wait_readable(fd, idle))
            break;
        res = threaded ? fanstore_threads_pop(buf) : real_receive(se, buf);
        if (res <= 0 || !fanstore_answered(buf, res, 1))
            return res; /* pyfuse3 handles it (or the error) */
    }
    if (res > 0 && start != 0) {
        trio_returns++;
        return -EINTR;
    }
    return res;
}

/* INIT: pyfuse3's answer, then (no_open) without atomic O_TRUNC (see the top of this file). */
static void init_in_c(void *userdata, struct fuse_conn_info *conn) {
    if (py_init != NULL)
        py_init(userdata, conn);
    if (no_open)
        conn->want &= ~FUSE_CAP_ATOMIC_O_TRUNC;
}

void fanstore_patch_open(struct fuse_lowlevel_ops *ops) {
    reply_err = (reply_err_t)fanstore_libfuse_symbol("fuse_reply_err");
    no_ioctl = ops->ioctl == NULL;
    py_init = ops->init;
    ops->init = init_in_c;
    if (ops->open == NULL || ops->release == NULL || reply_err == NULL)
        return;
    py_open = ops->open;
    py_release = ops->release;
    ops->open = open_in_c;
    ops->release = release_in_c;
    reply_attr = (reply_attr_t)fanstore_libfuse_symbol("fuse_reply_attr");
    if (ops->getattr != NULL && reply_attr != NULL) {
        py_getattr = ops->getattr;
        ops->getattr = getattr_in_c;
    }
}

/* fast_open(linger_us, timeout, trio_total_us): answer OPEN, RELEASE and GETATTR of the held
 * dataset's files (attribute timeout `timeout`), lingering `linger_us` after each (0: no
 * linger), at most `trio_total_us` in a row while trio is idle. */
PyObject *fanstore_fast_open(PyObject *self, PyObject *args) {
    (void)self;
    long linger, total_us = 5000;
    double timeout;
    if (!PyArg_ParseTuple(args, "ld|l", &linger, &timeout, &total_us))
        return NULL;
    trio_total_ns = (int64_t)(total_us > 0 ? total_us : 1) * 1000;
    attr_timeout = timeout;
    linger_us = linger;
    if (!fanstore_dataset_serve(FANSTORE_SERVE_FILES, "fast_open"))
        return NULL;
    Py_RETURN_NONE;
}

PyObject *fanstore_fast_counts(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    return Py_BuildValue("(KKKKKKK)", c_opens, c_releases, c_getattrs, lingered, trio_returns,
                         trio_busy, c_no_opens);
}

/* no_open(on): before the session starts, answer every OPEN with ENOSYS (see the top). */
PyObject *fanstore_no_open(PyObject *self, PyObject *arg) {
    (void)self;
    int on = PyObject_IsTrue(arg);
    if (on < 0)
        return NULL;
    no_open = on;
    Py_RETURN_NONE;
}

/* linger_trio(wakeup_fd, wakeup_fd2, runq): in the trio run, trio's wake-up sockets and run
 * queue (a sized container): the request loop lingers while trio has nothing to do (see
 * TRIO_IDLE_US). */
PyObject *fanstore_linger_trio(PyObject *self, PyObject *args) {
    (void)self;
    int fd, fd2;
    PyObject *runq;
    if (!PyArg_ParseTuple(args, "iiO", &fd, &fd2, &runq))
        return NULL;
    if (PyObject_Length(runq) < 0)
        return NULL;
    trio_fds[0] = fd;
    trio_fds[1] = fd2;
    Py_INCREF(runq);
    Py_XDECREF(trio_runq);
    trio_runq = runq;
    trio_fd = fd;
    Py_RETURN_NONE;
}
