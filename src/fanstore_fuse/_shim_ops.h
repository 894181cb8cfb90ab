/* The patches _noflush.c's fuse_session_new applies to pyfuse3's table of operations.
 * Each lives in its own source file; each may replace or wrap entries of `ops` (keeping the
 * originals it wraps) and must leave the others alone. */
#ifndef FANSTORE_SHIM_OPS_H
#define FANSTORE_SHIM_OPS_H
#define FUSE_USE_VERSION 35
#include <fuse_lowlevel.h>

void *fanstore_libfuse_symbol(const char *name); /* libfuse3's own definition of `name` */
extern struct fuse_session *fanstore_session;   /* the patched session (_noflush.c), or NULL */

void fanstore_patch_readdir(struct fuse_lowlevel_ops *ops); /* _shim_readdir.c */
void fanstore_patch_open(struct fuse_lowlevel_ops *ops);    /* _shim_open.c */
void fanstore_patch_read(struct fuse_lowlevel_ops *ops);    /* _shim_read.c */

/* _shim_read.c: whether a READ (inode, the fuse_read_in body of `left` bytes) is answered in C
 * (_shim_open.c's request loop then keeps going without trio). */
int fanstore_read_answered(uint64_t ino, const void *body, size_t left);
/* _shim_push.c: the reply gate (its header comment). Replies made off the request threads go
 * through these; after the patched session's destroy they are dropped (-ENOTCONN). */
void fanstore_replies_open(void); /* a new patched session */
int fanstore_gated_reply_buf(fuse_req_t req, const char *buf, size_t n);
int fanstore_gated_reply_err(fuse_req_t req, int err);
/* _shim_read.c: whether READ is patched to its C handler and started (a READ that a C thread
 * cannot answer in C then goes to Python on that thread, never to pyfuse3's handler). */
int fanstore_read_in_c_started(void);

/* _shim_open.c: whether a request is answered in C (READ only `on_trio`, the pyfuse3 thread). */
int fanstore_answered(const struct fuse_buf *buf, int len, int on_trio);

/* _shim_threads.c: requests read by C threads (FANSTORE_FUSE_THREADS), the rest queued for the
 * trio thread. */
extern __thread int fanstore_c_thread;                /* 1 on those threads */
extern __thread int fanstore_reply_later; /* the request just taken is answered by another thread */
int fanstore_threads_on(struct fuse_session *se);    /* the threads read `se`'s requests */
int fanstore_threads_fd(void);                        /* readable while the queue holds one */
int fanstore_threads_pop(struct fuse_buf *buf);       /* the next queued request (-EINTR: none) */
int fanstore_threads_queued(void);                    /* whether a request is queued */
int fanstore_threads_dev_waiting(void);                /* whether /dev/fuse holds a request not read yet */
void fanstore_threads_destroy(struct fuse_session *se); /* threads stopped, before libfuse's */
/* A C thread about to call MPI (1) and back (0): _shim_threads.c's header comment. */
void fanstore_threads_mpi(int inside);
/* _shim_remote_tbell.c: the remote calls this C FUSE thread made with its own reply bell and
 * has not seen end; fanstore_remote_wait_own waits for them (answering their READs on this
 * thread) until a request is readable on `dev_fd` or none of them is left. */
int fanstore_remote_own_calls(void);
void fanstore_remote_wait_own(int dev_fd);
/* Whether this thread may call MPI for a READ: a C thread, room for a spare, and no thread
 * inside MPI for FANSTORE_STUCK_NS or more. */
int fanstore_threads_direct_ok(void);
#define FANSTORE_STUCK_NS 50000000LL /* as _shim_remote_int.h's STUCK_NS */
/* One more thread started for each one inside MPI for long (the remote reaper, every 200 ms):
 * how many were started now; fanstore_threads_spares: how many in all. */
int fanstore_threads_unstick(void);
unsigned long long fanstore_threads_spares(void);
/* For _shim_uring.c's ring threads: a request laid out as /dev/fuse gives it (`*mem`, `len`
 * bytes; the buffer may be swapped for a new one), answered in C or queued for trio; the calling
 * thread made a C thread (ring thread of queue `qid`, which sends remote READs itself; -1: no
 * direct MPI sends); a thread started with its signals blocked and named `name`N (0, or an
 * errno). */
void fanstore_threads_dispatch(char **mem, size_t len);
void fanstore_threads_ring_thread(int qid);
/* _shim_remote_tbell.c, for a ring thread, which waits in its ring instead of in ppoll: the
 * fds of its reply bell to poll there (how many: 0 while it has none), and what to do when
 * one (`fd`) was rung or a wait of FANSTORE_BELL_WAIT_NS ended with calls in flight (-1). */
int fanstore_remote_bell_fds(int fds[2]);
void fanstore_remote_take_own(int fd);
#define FANSTORE_BELL_WAIT_NS 2000000LL /* as _shim_remote_tbell.c's WAIT_NS */
int fanstore_threads_spawn(pthread_t *tid, void *(*fn)(void *), void *arg, const char *name, int n);

/* _shim_uring.c: FUSE over io_uring (FANSTORE_FUSE_URING=1). The custom io's writev and read
 * (every libfuse reply leaves through the writev), the INIT request seen, start and stop. */
int fanstore_uring_wanted(void);
ssize_t fanstore_uring_writev(int fd, struct iovec *iov, int count, void *userdata);
ssize_t fanstore_uring_read(int fd, void *buf, size_t len, void *userdata);
void fanstore_uring_saw_init(const char *mem, size_t n);
void fanstore_uring_setup(int fd, size_t bufsize);
void fanstore_uring_stop(void);
int fanstore_uring_waiting(void); /* a ring holds a request its thread has not taken yet */

#ifdef Py_PYTHON_H /* the module's functions defined next to their patch */
/* Reply to `req` with what a Python fallback returned (bytes, or a positive errno; EIO for
 * anything else, an exception reported as unraisable against `who`); steals `res`. GIL held.
 * _shim_read.c; _shim_remote_read.c's fallback uses it too. */
void fanstore_reply_from_python(fuse_req_t req, PyObject *res, PyObject *who);
PyObject *fanstore_fast_open(PyObject *self, PyObject *args);     /* _shim_open.c */
PyObject *fanstore_fast_counts(PyObject *self, PyObject *unused); /* _shim_open.c */
PyObject *fanstore_linger_trio(PyObject *self, PyObject *args);    /* _shim_open.c */
PyObject *fanstore_no_open(PyObject *self, PyObject *arg);        /* _shim_open.c */
PyObject *fanstore_py_fast_read(PyObject *self, PyObject *args);    /* _shim_read.c */
PyObject *fanstore_py_read_start(PyObject *self, PyObject *fallback);
PyObject *fanstore_py_read_counts(PyObject *self, PyObject *unused);
PyObject *fanstore_py_stream_counts(PyObject *self, PyObject *unused);
PyObject *fanstore_py_mapread_counts(PyObject *self, PyObject *unused); /* _shim_mapread.c */
PyObject *fanstore_py_direct_counts(PyObject *self, PyObject *unused); /* _shim_blobs.c */
PyObject *fanstore_py_data_counts(PyObject *self, PyObject *unused); /* _shim_blobs.c */
PyObject *fanstore_py_fuse_threads(PyObject *self, PyObject *args);        /* _shim_threads.c */
PyObject *fanstore_py_fuse_thread_counts(PyObject *self, PyObject *unused);
PyObject *fanstore_py_fuse_queued(PyObject *self, PyObject *unused);
PyObject *fanstore_py_fuse_uring_counts(PyObject *self, PyObject *unused); /* _shim_uring.c */
#endif

#endif
