/* READ of dataset files answered in C (issue 11).
 *
 * Through pyfuse3, every READ is a trio task, a Python handler and (for a cold blob) a worker
 * thread hop: ~150 us of the daemon's CPU before any byte is read. Once Python has handed over
 * the manifest's entry columns (_shim_dataset.c), the blob columns and this rank's local copies
 * (_shim_blobs.c) and started this (read_start, in the trio run), a READ whose bytes are all
 * here is answered without Python:
 *
 * - which: the handle is the inode of a dataset regular file (what MountView.open and
 *   _shim_open.c answer for an open without write intent; written files have other handles),
 *   and every blob covering [off, off + size) is held here and is framed (codec 3: only the
 *   frames covering the range are read) or at most WHOLE_MAX raw bytes (decoded whole, as
 *   Python's BlobCache would; larger non-framed blobs, from a version-2 or `--frame-kib 0` prep,
 *   go to Python, whose blob cache serves their many 128 KiB reads from one decode). A READ
 *   spanning several blobs is answered by concatenating their ranges. Anything else goes to
 *   pyfuse3's read handler, unchanged; the test is a pure function of the request and the held
 *   columns, so _shim_open.c's request loop may use it too (fanstore_read_answered).
 * - where: a READ of at most `inline_max` bytes is first tried on the FUSE thread from the
 *   page cache alone (RWF_NOWAIT preads: no disk wait, no thread hop); when that would wait
 *   and nothing else is to be done (alone()), it is read there, GIL released; otherwise it is
 *   queued to a pool of threads (no GIL; FANSTORE_FASTREAD_THREADS, 16: a libaio reader's
 *   16 requests reach the disk together) that pread, verify, decode and reply (libfuse's
 *   reply calls are thread-safe).
 * - errors: nothing that failed a check is ever sent. On any error in C (checksum, short read,
 *   I/O error, decode) the thread takes the GIL and calls Python's fallback (_fastread: the
 *   same read through Operations.read on the trio thread, which logs, counts, tries other
 *   copies where there are any and gives EIO when nothing is good) and replies with its bytes
 *   or errno.
 *
 * The kernel's page cache (keep_cache on every dataset open) keeps what was read. A READ of part
 * of one zstd frame decodes the whole frame (its xxh3 covers it): the frame is kept in C
 * (_shim_fcache.c, for O_DIRECT readers whose every 4 KiB comes here) and, for a buffered READ,
 * pushed into the page cache after the reply (_shim_push.c), so the frame's other pages never
 * come here (a raw sub-block read in part is pushed the same way). The first try on the FUSE
 * thread (FANSTORE_CHEAP) decodes no zstd frame: a decode (~0.2 ms for 128 KiB) runs there only
 * when nothing else waits, else on a thread, so that 16 O_DIRECT READs in flight decode on
 * every core.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "_shim_blobs.h"
#include "_shim_cache.h"
#include "_shim_dataset.h"
#include "_shim_ops.h"
#include "_shim_mapread.h"

#define WHOLE_MAX (512u << 10) /* non-framed blobs decoded whole for a READ up to this size */
#define QUEUE 1024             /* READs waiting for a thread (more: answered by Python) */
#define MAX_THREADS 64

typedef void (*read_op_t)(fuse_req_t, fuse_ino_t, size_t, off_t, struct fuse_file_info *);
typedef int (*reply_buf_t)(fuse_req_t, const char *, size_t);
typedef int (*reply_err_t)(fuse_req_t, int);

static read_op_t py_read;
static reply_buf_t reply_buf;
static reply_err_t reply_err;
static reply_buf_t reply_from_python_buf; /* fanstore_reply_from_python's own */
static reply_err_t reply_from_python_err;
static PyObject *fallback; /* _fastread._Fallback: (fh, off, size) -> bytes | errno */
static size_t inline_max;
static int nthreads;
static unsigned long long c_reads, c_bytes, c_inline, c_fallbacks;

struct job {
    fuse_req_t req;
    uint64_t ino, off;
    uint32_t size;
    int flags; /* the file's open flags (O_DIRECT: nothing pushed to the page cache) */
};

static pthread_mutex_t qlock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t qcond = PTHREAD_COND_INITIALIZER;
static struct job queue[QUEUE];
static unsigned qhead, qlen, busy; /* queued, and being served by a thread */
static int started;
static int (*session_fd)(struct fuse_session *);

/* Whether blob b can be read here for a READ. */
static int blob_ok(uint64_t b) {
    if (!fanstore_blob_held(b)) /* held elsewhere: this rank's disk cache (_shim_cache.c) */
        return fanstore_cache_ok(b, WHOLE_MAX);
    return fanstore_blob_held(b) && (fanstore_blobs.codec[b] == FANSTORE_CODEC_FRAMED ||
                                     fanstore_blobs.raw[b] <= WHOLE_MAX);
}

static int read_here(uint64_t ino, uint64_t fh, uint64_t off, uint64_t size) {
    if (!started || fh != ino || !fanstore_dataset_serves(FANSTORE_SERVE_READS, ino))
        return 0;
    uint64_t j = ino - 1, fsize = fanstore_ds.size[j], chunk = fanstore_blobs.chunk_size;
    if (fanstore_ds.kind[j] != FANSTORE_KIND_FILE || chunk == 0)
        return 0;
    if (off >= fsize || size == 0)
        return 1; /* end of file: an empty reply */
    uint64_t end = off + size < fsize ? off + size : fsize, first = fanstore_ds.first[j];
    uint64_t k0 = off / chunk, k1 = (end - 1) / chunk;
    if (k1 >= fanstore_ds.count[j])
        return 0; /* cannot happen with a validated manifest */
    for (uint64_t k = k0; k <= k1; k++)
        if (!blob_ok(first + k))
            return 0;
    return 1;
}

int fanstore_read_answered(uint64_t ino, const void *body, size_t left) {
    uint64_t fh, off;
    uint32_t size;
    if (left < 20)
        return 0;
    memcpy(&fh, body, 8); /* struct fuse_read_in: fh, offset, size, ... */
    memcpy(&off, (const char *)body + 8, 8);
    memcpy(&size, (const char *)body + 16, 4);
    return read_here(ino, fh, off, size);
}

struct worker {
    struct fanstore_scratch s;
    char *cat; /* a READ spanning blobs, concatenated */
    size_t cat_cap;
};

/* Answer the READ from the local copies: OK (replied), or an outcome (nothing replied). */
static int serve(const struct job *jb, int nowait, struct worker *w) {
    uint64_t j = jb->ino - 1, fsize = fanstore_ds.size[j], chunk = fanstore_blobs.chunk_size;
    if (jb->off >= fsize || jb->size == 0) {
        reply_buf(jb->req, NULL, 0);
        return FANSTORE_BLOB_OK;
    }
    uint64_t end = jb->off + jb->size < fsize ? jb->off + jb->size : fsize;
    uint64_t first = fanstore_ds.first[j], k0 = jb->off / chunk, k1 = (end - 1) / chunk;
    const char *out;
    int r;
    fanstore_scratch_release(&w->s); /* s.frame: this READ's frame, if any, from here on */
    w->s.want_frame = 0;
    if (k0 == k1 && !(jb->flags & O_DIRECT)) { /* large raw frames: checked where they lie */
        uint64_t base = k0 * chunk;
        r = fanstore_mapread_range(jb->req, first + k0, jb->off - base, end - base, nowait,
                                   reply_buf);
        if (r != FANSTORE_MAPREAD_NO)
            return r;
    }
    if (k0 == k1) {
        uint64_t base = k0 * chunk;
        w->s.want_frame = !(jb->flags & O_DIRECT) && fanstore_push_on();
        r = fanstore_cache_blob_range(first + k0, jb->off - base, end - base, nowait, &w->s, &out);
        if (r != FANSTORE_BLOB_OK)
            return r;
        reply_buf(jb->req, out, end - jb->off);
        if (w->s.frame != NULL && w->s.want_frame) { /* part of a frame or sub-block */
            fanstore_push(jb->ino, base + w->s.frame->at, w->s.frame);
            w->s.frame = NULL;
        }
        return FANSTORE_BLOB_OK;
    }
    size_t n = end - jb->off;
    if (w->cat_cap < n) {
        char *c = fanstore_data_alloc(n);
        if (c == NULL)
            return FANSTORE_BLOB_NOMEM;
        free(w->cat);
        w->cat = c;
        w->cat_cap = n;
    }
    for (uint64_t k = k0; k <= k1; k++) {
        uint64_t base = k * chunk, lo = jb->off > base ? jb->off : base;
        uint64_t hi = end < base + chunk ? end : base + chunk;
        if ((r = fanstore_cache_blob_range(first + k, lo - base, hi - base, nowait, &w->s, &out)) !=
            FANSTORE_BLOB_OK)
            return r;
        memcpy(w->cat + (lo - jb->off), out, hi - lo);
    }
    reply_buf(jb->req, w->cat, n);
    return FANSTORE_BLOB_OK;
}

void fanstore_reply_from_python(fuse_req_t req, PyObject *res, PyObject *who) {
    if (reply_from_python_buf == NULL) { /* the GIL is held: one thread at a time here */
        reply_from_python_buf = fanstore_gated_reply_buf; /* off the request threads too */
        reply_from_python_err = fanstore_gated_reply_err;
    }
    if (res != NULL && PyBytes_Check(res))
        reply_from_python_buf(req, PyBytes_AS_STRING(res), (size_t)PyBytes_GET_SIZE(res));
    else {
        long e = res != NULL && PyLong_Check(res) ? PyLong_AsLong(res) : EIO;
        if (PyErr_Occurred()) {
            PyErr_WriteUnraisable(who);
            e = EIO;
        }
        reply_from_python_err(req, e > 0 ? (int)e : EIO);
    }
    Py_XDECREF(res);
}

/* C could not answer: Python reads it its way (logs, counts, other copies, EIO). */
static void to_python(const struct job *jb) {
    __atomic_add_fetch(&c_fallbacks, 1, __ATOMIC_RELAXED);
    PyGILState_STATE g = PyGILState_Ensure();
    PyObject *res = fallback ? PyObject_CallFunction(fallback, "KKI", (unsigned long long)jb->ino,
                                                     (unsigned long long)jb->off, jb->size)
                             : NULL;
    fanstore_reply_from_python(jb->req, res, fallback);
    PyGILState_Release(g);
}

static void count(const struct job *jb, int on_fuse_thread) {
    uint64_t fsize = fanstore_ds.size[jb->ino - 1];
    uint64_t n = jb->off >= fsize ? 0 : (fsize - jb->off < jb->size ? fsize - jb->off : jb->size);
    __atomic_add_fetch(&c_reads, 1, __ATOMIC_RELAXED);
    __atomic_add_fetch(&c_bytes, n, __ATOMIC_RELAXED);
    if (on_fuse_thread)
        __atomic_add_fetch(&c_inline, 1, __ATOMIC_RELAXED);
}

static void *worker_main(void *arg) {
    (void)arg;
    struct worker w = {0};
    for (;;) {
        pthread_mutex_lock(&qlock);
        while (qlen == 0)
            pthread_cond_wait(&qcond, &qlock);
        struct job jb = queue[qhead];
        qhead = (qhead + 1) % QUEUE;
        qlen--;
        busy++;
        pthread_mutex_unlock(&qlock);
        if (serve(&jb, 0, &w) == FANSTORE_BLOB_OK)
            count(&jb, 0);
        else
            to_python(&jb);
        pthread_mutex_lock(&qlock);
        busy--;
        pthread_mutex_unlock(&qlock);
    }
    return NULL;
}

static int enqueue(const struct job *jb) {
    pthread_mutex_lock(&qlock);
    int ok = qlen < QUEUE;
    if (ok) {
        queue[(qhead + qlen) % QUEUE] = *jb;
        qlen++;
        pthread_cond_signal(&qcond);
    }
    pthread_mutex_unlock(&qlock);
    return ok;
}

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static int fuse_waiting(void) { /* queued by _shim_threads.c's readers, or in the kernel */
    if (fanstore_threads_on(fanstore_session)) /* queued for trio, or not yet read by them */
        return fanstore_threads_queued() || fanstore_threads_dev_waiting();
    struct pollfd p = {.fd = session_fd(fanstore_session), .events = POLLIN};
    return poll(&p, 1, 0) != 0;
}

/* Nothing else to do: no READ queued or being served by a thread, no request waiting on
 * /dev/fuse, and none came in during the last such read (else readers are concurrent: for
 * CONTENDED_NS, their reads go to the threads, so that their disk reads overlap). A small cold
 * READ is then read on the FUSE thread itself (GIL released): a thread hop costs two
 * wake-ups, and with nothing else waiting nothing is serialized behind it. */
#define CONTENDED_NS 20000000
static int64_t contended_until;

static int alone(void) {
    if (session_fd == NULL || fanstore_session == NULL ||
        now_ns() < __atomic_load_n(&contended_until, __ATOMIC_RELAXED))
        return 0;
    pthread_mutex_lock(&qlock);
    int idle = qlen == 0 && busy == 0;
    pthread_mutex_unlock(&qlock);
    return idle && !fuse_waiting();
}

static void read_in_c(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off,
                      struct fuse_file_info *fi) {
    struct job jb = {req, ino, (uint64_t)off, (uint32_t)size, fi->flags};
    if (off < 0 || !read_here(ino, fi->fh, (uint64_t)off, size)) {
        if (fanstore_c_thread) { /* a remote READ whose fetch could not start: Python reads it */
            fanstore_reply_later = 1;
            to_python(&jb);
        }
        else
            py_read(req, ino, size, off, fi);
        return;
    }
    /* the trio thread's (GIL held: released around waits) or a request thread's (no GIL at
     * all: _shim_threads.c) own scratch */
    static struct worker fuse_thread;
    static __thread struct worker request_thread;
    struct worker *me = fanstore_c_thread ? &request_thread : &fuse_thread;
    if (size <= inline_max) {
        /* page cache, cached frames and raw frames only: a zstd frame to decode waits for
         * alone() (else a thread decodes it while this one takes the next request) */
        if (serve(&jb, FANSTORE_CHEAP, me) == FANSTORE_BLOB_OK) {
            count(&jb, 1);
            return;
        }
        if (alone()) {
            int r;
            if (fanstore_c_thread)
                r = serve(&jb, 0, me);
            else {
                Py_BEGIN_ALLOW_THREADS r = serve(&jb, 0, me);
                Py_END_ALLOW_THREADS
            }
            if (fuse_waiting())
                __atomic_store_n(&contended_until, now_ns() + CONTENDED_NS, __ATOMIC_RELAXED);
            if (r == FANSTORE_BLOB_OK) {
                count(&jb, 1);
                return;
            }
        }
    }
    fanstore_reply_later = 1; /* a READ thread or Python answers it */
    if (enqueue(&jb))
        return;
    if (fanstore_c_thread) /* more READs waiting than QUEUE: Python takes it */
        to_python(&jb);
    else
        py_read(req, ino, size, off, fi);
}

int fanstore_read_in_c_started(void) {
    return py_read != NULL && __atomic_load_n(&started, __ATOMIC_ACQUIRE) && fallback != NULL;
}

void fanstore_patch_read(struct fuse_lowlevel_ops *ops) {
    session_fd = (int (*)(struct fuse_session *))fanstore_libfuse_symbol("fuse_session_fd");
    if (ops->read == NULL || fanstore_libfuse_symbol("fuse_reply_buf") == NULL ||
        fanstore_libfuse_symbol("fuse_reply_err") == NULL || nthreads == 0)
        return;
    reply_buf = fanstore_gated_reply_buf; /* the READ threads answer off the request threads */
    reply_err = fanstore_gated_reply_err;
    py_read = ops->read;
    ops->read = read_in_c;
}

/* fast_read(threads, inline_max): patch READ in the next FUSE session (call before
 * pyfuse3.init, after hold_blobs); nothing is answered in C before read_start. */
PyObject *fanstore_py_fast_read(PyObject *self, PyObject *args) {
    (void)self;
    int threads;
    Py_ssize_t inl;
    if (!PyArg_ParseTuple(args, "in", &threads, &inl))
        return NULL;
    if (threads < 1 || threads > MAX_THREADS || inl < 0) {
        PyErr_Format(PyExc_ValueError, "fast_read: 1..%d threads, inline_max >= 0", MAX_THREADS);
        return NULL;
    }
    if (fanstore_blobs.n == 0) {
        PyErr_SetString(PyExc_ValueError, "fast_read: no blobs held (hold_blobs first)");
        return NULL;
    }
    if (started) {
        PyErr_SetString(PyExc_ValueError, "fast_read: already started");
        return NULL;
    }
    nthreads = threads;
    inline_max = (size_t)inl;
    Py_RETURN_NONE;
}

/* read_start(fallback): start the threads and answer READs from now on. */
PyObject *fanstore_py_read_start(PyObject *self, PyObject *fb) {
    (void)self;
    if (py_read == NULL) {
        PyErr_SetString(PyExc_ValueError, "read_start: READ not patched (fast_read before init)");
        return NULL;
    }
    if (started)
        Py_RETURN_NONE;
    if (!fanstore_dataset_serve(FANSTORE_SERVE_READS, "read_start"))
        return NULL;
    Py_INCREF(fb);
    fallback = fb;
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, &old); /* signals stay with the Python threads */
    int made = 0;
    for (; made < nthreads; made++) {
        pthread_t t;
        if (pthread_create(&t, NULL, worker_main, NULL) != 0)
            break;
        pthread_detach(t);
    }
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (made == 0) {
        PyErr_SetString(PyExc_OSError, "read_start: no thread could be started");
        return NULL;
    }
    started = 1;
    Py_RETURN_NONE;
}

PyObject *fanstore_py_read_counts(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    return Py_BuildValue("(KKKK)", __atomic_load_n(&c_reads, __ATOMIC_RELAXED),
                         __atomic_load_n(&c_bytes, __ATOMIC_RELAXED),
                         __atomic_load_n(&c_inline, __ATOMIC_RELAXED),
                         __atomic_load_n(&c_fallbacks, __ATOMIC_RELAXED));
}
