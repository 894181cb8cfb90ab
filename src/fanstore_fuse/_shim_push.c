/* Decoded frames pushed into the kernel's page cache (issue 11, compressed random reads).
 *
 * A buffered READ of part of a zstd frame made C decode (and check) the whole frame, one of part
 * of a raw 16 KiB sub-block read and check the whole sub-block; after the reply, _shim_read.c
 * hands the frame (fanstore_push) to one thread here, which stores it in the file's page cache
 * with fuse_lowlevel_notify_store: the next buffered reads of that frame are page-cache hits
 * that never reach the daemon, as squashfs does with a block in the kernel. Dataset files are
 * immutable and opened with keep_cache, so the pages stay valid.
 *
 * - O_DIRECT READs never push (they bypass the page cache); nor do READs of whole frames
 *   (sequential readers already get every page they asked for).
 * - one thread, off the READ path: notify_store locks each page it fills, and may wait for a
 *   page whose own READ is still being answered; the READ threads never wait for the pusher
 *   (its queue is bounded, a frame that finds it full is dropped: a later READ decodes again).
 * - only checked bytes: zstd frames from the frame cache (_shim_fcache.c), sub-blocks copied
 *   after their check (fanstore_blob_range's want_frame), referenced until stored. Never past
 *   the file's end (a frame lies inside its blob, the blob inside the file).
 * - fuse_session_destroy (interposed, like _noflush.c's fuse_session_new) stops the pusher and
 *   waits for a store in progress before libfuse frees the session.
 *
 * The reply gate, here beside that destroy: READs answered off the request threads (the READ
 * threads of _shim_read.c, the remote thread's callbacks and fallback threads of
 * _shim_remote_read.c) may be answered after pyfuse3.close destroyed the session (a READ in
 * flight at SIGTERM: the remote calls end only in remote_stop, after it). Their replies go
 * through fanstore_gated_reply_buf/err: once the session is gone, a reply is dropped (its
 * request is never answered; the kernel failed it when the connection went), never written
 * through freed memory. The destroy closes the gate under its write lock, so it waits for a
 * reply in progress; a new session opens it again.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pthread.h>
#include <signal.h>
#include <time.h>

#include "_shim_blobs.h"
#include "_shim_ops.h"

#define PUSH_QUEUE 256

typedef int (*notify_store_t)(struct fuse_session *, fuse_ino_t, off_t, struct fuse_bufvec *,
                              enum fuse_buf_copy_flags);
typedef void (*destroy_t)(struct fuse_session *);

struct push {
    uint64_t ino, off;
    struct fanstore_frame *f;
};

static notify_store_t notify_store;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t work = PTHREAD_COND_INITIALIZER, idle = PTHREAD_COND_INITIALIZER;
static struct push queue[PUSH_QUEUE];
static unsigned head, len;
static int on, storing, thread_up;
static unsigned long long pushes, push_bytes, push_fails, push_drops;

int fanstore_push_on(void) { return __atomic_load_n(&on, __ATOMIC_RELAXED); }

static void *pusher(void *arg) {
    (void)arg;
    for (;;) {
        pthread_mutex_lock(&lock);
        while (len == 0)
            pthread_cond_wait(&work, &lock);
        struct push p = queue[head];
        head = (head + 1) % PUSH_QUEUE;
        len--;
        int go = on && fanstore_session != NULL;
        storing = go;
        pthread_mutex_unlock(&lock);
        int r = -1;
        if (go) {
            struct fuse_bufvec v = FUSE_BUFVEC_INIT(p.f->len);
            v.buf[0].mem = p.f->data;
            r = notify_store(fanstore_session, p.ino, (off_t)p.off, &v, 0);
        }
        pthread_mutex_lock(&lock);
        storing = 0;
        if (r == 0) {
            pushes++;
            push_bytes += p.f->len;
        } else if (go) {
            push_fails++; /* ENOENT: the kernel forgot the inode; nothing else to do */
        }
        pthread_cond_broadcast(&idle);
        pthread_mutex_unlock(&lock);
        if (r == 0)
            fanstore_fcache_forget(p.f); /* the kernel keeps it now */
        fanstore_fcache_put(p.f);
    }
    return NULL;
}

void fanstore_push(uint64_t ino, uint64_t off, struct fanstore_frame *f) {
    pthread_mutex_lock(&lock);
    int ok = on && len < PUSH_QUEUE;
    if (ok) {
        queue[(head + len) % PUSH_QUEUE] = (struct push){ino, off, f};
        len++;
        pthread_cond_signal(&work);
    } else {
        push_drops++;
    }
    pthread_mutex_unlock(&lock);
    if (!ok)
        fanstore_fcache_put(f);
}

/* ------------------------------------------------------------------ the reply gate */

typedef int (*reply_buf_t)(fuse_req_t, const char *, size_t);
typedef int (*reply_err_t)(fuse_req_t, int);
static pthread_rwlock_t gate = PTHREAD_RWLOCK_INITIALIZER;
static int session_gone;
static reply_buf_t real_reply_buf;
static reply_err_t real_reply_err;

void fanstore_replies_open(void) {
    pthread_rwlock_wrlock(&gate);
    session_gone = 0;
    real_reply_buf = (reply_buf_t)fanstore_libfuse_symbol("fuse_reply_buf");
    real_reply_err = (reply_err_t)fanstore_libfuse_symbol("fuse_reply_err");
    pthread_rwlock_unlock(&gate);
}

static void replies_close(void) {
    pthread_rwlock_wrlock(&gate); /* waits for a reply in progress */
    session_gone = 1;
    pthread_rwlock_unlock(&gate);
}

int fanstore_gated_reply_buf(fuse_req_t req, const char *buf, size_t n) {
    pthread_rwlock_rdlock(&gate);
    int r = -ENOTCONN;
    if (!session_gone && real_reply_buf != NULL)
        r = real_reply_buf(req, buf, n);
    pthread_rwlock_unlock(&gate);
    return r;
}

int fanstore_gated_reply_err(fuse_req_t req, int err) {
    pthread_rwlock_rdlock(&gate);
    int r = -ENOTCONN;
    if (!session_gone && real_reply_err != NULL)
        r = real_reply_err(req, err);
    pthread_rwlock_unlock(&gate);
    return r;
}

void fuse_session_destroy(struct fuse_session *se) {
    destroy_t real = (destroy_t)fanstore_libfuse_symbol("fuse_session_destroy");
    fanstore_threads_destroy(se); /* _shim_threads.c: its readers stop before the fd closes */
    pthread_mutex_lock(&lock);
    on = 0; /* queued frames are dropped by the pusher */
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_sec += 2; /* a store waits only for pages of READs the unmount already ended */
    while (storing && pthread_cond_timedwait(&idle, &lock, &until) == 0)
        ;
    pthread_mutex_unlock(&lock);
    if (se == fanstore_session)
        replies_close(); /* READs still answered off the request threads: dropped from now on */
    if (real != NULL && real != fuse_session_destroy)
        real(se);
}

/* frame_cache(budget, push, subblocks=1): the frame cache's budget in bytes (0: off), whether
 * frames go to the page cache (needs the cache) and whether raw sub-blocks are kept too.
 * Before the session serves, or between tests. */
PyObject *fanstore_py_frame_cache(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long budget;
    int push, subblocks = 1;
    if (!PyArg_ParseTuple(args, "Kp|p", &budget, &push, &subblocks))
        return NULL;
    if (fanstore_fcache_set((size_t)budget) != 0)
        return PyErr_NoMemory();
    fanstore_fcache_set_subblocks(subblocks);
    if (push && notify_store == NULL)
        notify_store = (notify_store_t)fanstore_libfuse_symbol("fuse_lowlevel_notify_store");
    if (push && notify_store == NULL) {
        PyErr_SetString(PyExc_OSError, "frame_cache: libfuse has no fuse_lowlevel_notify_store");
        return NULL;
    }
    if (push && !thread_up) {
        sigset_t all, old;
        sigfillset(&all);
        pthread_sigmask(SIG_BLOCK, &all, &old); /* signals stay with the Python threads */
        pthread_t t;
        int e = pthread_create(&t, NULL, pusher, NULL);
        pthread_sigmask(SIG_SETMASK, &old, NULL);
        if (e != 0) {
            PyErr_SetString(PyExc_OSError, "frame_cache: the push thread could not start");
            return NULL;
        }
        pthread_detach(t);
        thread_up = 1;
    }
    pthread_mutex_lock(&lock);
    on = push && budget > 0;
    pthread_mutex_unlock(&lock);
    Py_RETURN_NONE;
}

/* frame_counts(): (hits, misses, evictions, bytes, entries, budget, pushes, pushed bytes,
 * failed pushes, dropped pushes) */
PyObject *fanstore_py_frame_counts(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    unsigned long long c[6];
    fanstore_fcache_counts(c);
    pthread_mutex_lock(&lock);
    PyObject *r = Py_BuildValue("(KKKKKKKKKK)", c[0], c[1], c[2], c[3], c[4], c[5], pushes,
                                push_bytes, push_fails, push_drops);
    pthread_mutex_unlock(&lock);
    return r;
}
