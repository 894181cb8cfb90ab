/* FOPEN_NOFLUSH for files opened read-only (issue 11).
 *
 * pyfuse3 3.5's FileInfo cannot set fuse_file_info.noflush (libfuse >= 3.10), so the kernel
 * sends FLUSH on every close(2) of a writable mount, one round trip per dataset file. Imported
 * with RTLD_GLOBAL before the first open is answered, this module's fuse_reply_open comes first
 * in the global scope and so binds pyfuse3's lazily resolved call to libfuse's. When enabled, it
 * sets noflush on replies to O_RDONLY opens and calls libfuse's fuse_reply_open. Files opened for
 * writing keep FLUSH: close(2) of a written file still commits it (close-to-open).
 *
 * The same interposition sets cache_readdir and keep_cache (FOPEN_CACHE_DIR, FOPEN_KEEP_CACHE)
 * on the reply to an opendir whose handle Python marked just before returning it (mark_dir):
 * the kernel then keeps that directory's listing in its page cache across opens, so a second
 * `find` never reaches the daemon. Python marks only directories whose listing cannot change
 * (the dataset's, with no written entry); an unmarked opendir drops the cached listing.
 *
 * It also interposes fuse_session_new, which pyfuse3.init calls with its table of operations:
 * the shim hands libfuse a copy of that table, patched by the functions of _shim_ops.h (one per
 * concern, each in its own source file), so that some requests can be answered in C.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#define FUSE_USE_VERSION 35
#include <dlfcn.h>
#include <stdint.h>
#include <fcntl.h>
#include <fuse_lowlevel.h>
#include <string.h>

#include "_shim_blobs.h"
#include "_shim_cache.h"
#include "_shim_dataset.h"
#include "_shim_ops.h"
#include "_shim_readdir.h"
#include "_shim_remote.h"

typedef int (*reply_open_t)(fuse_req_t, const struct fuse_file_info *);

static reply_open_t real_reply_open;
static int enabled;
static unsigned long long noflush_opens;
static int dir_marked;
static uint64_t dir_mark_fh;
static unsigned long long cached_dirs;

void *fanstore_libfuse_symbol(const char *name) {
    static void *lib;
    if (lib == NULL)
        lib = dlopen("libfuse3.so.3", RTLD_NOW | RTLD_LOCAL);
    return lib ? dlsym(lib, name) : NULL;
}

static reply_open_t find_real(void) {
    return (reply_open_t)fanstore_libfuse_symbol("fuse_reply_open");
}

typedef struct fuse_session *(*session_new_t)(struct fuse_args *, const struct fuse_lowlevel_ops *,
                                              size_t, void *);

static struct fuse_lowlevel_ops patched_ops;
static int sessions_patched;
struct fuse_session *fanstore_session;

struct fuse_session *fuse_session_new(struct fuse_args *args, const struct fuse_lowlevel_ops *op,
                                      size_t op_size, void *userdata) {
    session_new_t real = (session_new_t)fanstore_libfuse_symbol("fuse_session_new");
    if (real == NULL || real == fuse_session_new)
        return NULL; /* libfuse not found: pyfuse3.init raises */
    if (op_size > sizeof(patched_ops))
        return real(args, op, op_size, userdata); /* a newer table than we know: leave it */
    memset(&patched_ops, 0, sizeof(patched_ops));
    memcpy(&patched_ops, op, op_size);
    fanstore_patch_readdir(&patched_ops);
    fanstore_patch_open(&patched_ops);
    fanstore_patch_read(&patched_ops);
    fanstore_patch_remote(&patched_ops); /* after READ's: it hands on what it does not take */
    fanstore_replies_open();
    sessions_patched++;
    fanstore_session = real(args, &patched_ops, sizeof(patched_ops), userdata);
    return fanstore_session;
}

int fuse_reply_open(fuse_req_t req, const struct fuse_file_info *fi) {
    if (real_reply_open == NULL)
        real_reply_open = find_real();
    if (real_reply_open == NULL || real_reply_open == fuse_reply_open)
        return -ENOSYS; /* cannot happen once enable() succeeded */
    /* a mark is for the very next reply on the trio thread only (Python's opendir) */
    int cache_dir = !fanstore_c_thread && dir_marked && fi->fh == dir_mark_fh;
    if (!fanstore_c_thread)
        dir_marked = 0;
    if (cache_dir) {
        struct fuse_file_info copy = *fi;
        copy.cache_readdir = 1;
        copy.keep_cache = 1;
        cached_dirs++;
        return real_reply_open(req, &copy);
    }
    if (enabled && (fi->flags & O_ACCMODE) == O_RDONLY) {
        struct fuse_file_info copy = *fi;
        copy.noflush = 1;
        __atomic_add_fetch(&noflush_opens, 1, __ATOMIC_RELAXED);
        return real_reply_open(req, &copy);
    }
    return real_reply_open(req, fi);
}

static int have_real(void) {
    if (real_reply_open == NULL)
        real_reply_open = find_real();
    if (real_reply_open == NULL || real_reply_open == fuse_reply_open) {
        PyErr_SetString(PyExc_OSError, "libfuse3.so.3's fuse_reply_open not found");
        return 0;
    }
    return 1;
}

static PyObject *enable(PyObject *self, PyObject *arg) {
    (void)self;
    int on = PyObject_IsTrue(arg);
    if (on < 0)
        return NULL;
    if (!have_real())
        return NULL;
    enabled = on;
    Py_RETURN_NONE;
}

static PyObject *mark_dir(PyObject *self, PyObject *arg) {
    (void)self;
    unsigned long long fh = PyLong_AsUnsignedLongLong(arg);
    if (fh == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    if (!have_real())
        return NULL;
    dir_mark_fh = fh;
    dir_marked = 1;
    Py_RETURN_NONE;
}

static PyObject *dirs(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    return PyLong_FromUnsignedLongLong(cached_dirs);
}

static PyObject *count(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    return PyLong_FromUnsignedLongLong(__atomic_load_n(&noflush_opens, __ATOMIC_RELAXED));
}

static PyObject *patched(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    return PyLong_FromLong(sessions_patched);
}

static PyMethodDef methods[] = {
    {"patched", patched, METH_NOARGS, "patched(): FUSE sessions created with the patched table"},
    {"enable", enable, METH_O, "enable(on): set noflush on replies to read-only opens"},
    {"count", count, METH_NOARGS, "count(): opens answered with noflush so far"},
    {"mark_dir", mark_dir, METH_O, "mark_dir(fh): cache the listing of the next opendir reply"},
    {"dirs", dirs, METH_NOARGS, "dirs(): opendir replies sent with cache_readdir so far"},
    {"fast_open", fanstore_fast_open, METH_VARARGS, "fast_open(linger_us, timeout, trio_total_us=5000): OPEN/RELEASE/GETATTR of the held dataset's files in C"},
    {"fast_counts", fanstore_fast_counts, METH_NOARGS, "fast_counts(): (opens, releases, getattrs, lingered, returns to trio) in C"},
    {"fuse_threads", fanstore_py_fuse_threads, METH_VARARGS, "fuse_threads(n): the next session's requests read by n C threads (0: by pyfuse3; before pyfuse3.init)"},
    {"fuse_uring_counts", fanstore_py_fuse_uring_counts, METH_NOARGS, "fuse_uring_counts(): (io_uring queues live, requests taken from them, replies committed by another thread than the queue's, ring errors)"},
    {"fuse_thread_counts", fanstore_py_fuse_thread_counts, METH_NOARGS, "fuse_thread_counts(): (threads, answered on them, handed to trio, started SCHED_BATCH, spins, spins that found a request, ns spent spinning, extra threads woken by overlapping readers, overlaps, requests they read)"},
    {"fuse_queued", fanstore_py_fuse_queued, METH_NOARGS, "fuse_queued(): whether a request the threads read waits for pyfuse3"},
    {"no_open", fanstore_no_open, METH_O, "no_open(on): answer every OPEN with ENOSYS (the kernel's no_open mode)"},
    {"linger_trio", fanstore_linger_trio, METH_VARARGS, "linger_trio(epoll_fd, runq): linger while trio has nothing to do"},
    FANSTORE_READDIR_METHODS
    FANSTORE_BLOBS_METHODS
    FANSTORE_REMOTE_METHODS
    {"fast_read", fanstore_py_fast_read, METH_VARARGS, "fast_read(threads, inline_max): patch READ of the held dataset's files (before pyfuse3.init)"},
    {"read_start", fanstore_py_read_start, METH_O, "read_start(fallback): answer READs in C from now on; fallback(fh, off, size) -> bytes | errno on errors"},
    {"read_counts", fanstore_py_read_counts, METH_NOARGS, "read_counts(): (reads, bytes, inline, fallbacks) in C"},
    {"mapread_counts", fanstore_py_mapread_counts, METH_NOARGS, "mapread_counts(): (READs, bytes) answered from a mapping of the local copies"},
    {"data_counts", fanstore_py_data_counts, METH_NOARGS, "data_counts(): (large blocks allocated afresh, of them advised MADV_HUGEPAGE, taken from the pool)"},
    {"direct_counts", fanstore_py_direct_counts, METH_NOARGS, "direct_counts(): (reads, bytes) of cold small blobs read with O_DIRECT, nowait reads refused by the residency gate"},
    {"stream_counts", fanstore_py_stream_counts, METH_NOARGS, "stream_counts(): (streams, refused, windows, bytes, ns, cold blobs seen, disk-cache segments streamed, skipped) of local copies and cache segments read into the page cache"},
    FANSTORE_CACHE_METHODS
    {"hold_dataset", fanstore_py_hold_dataset, METH_VARARGS, "hold_dataset((kind, mode, uid, gid, count, mtime_ns, size, first, name_off, names), n): hold the manifest's columns for the C answers"},
    {"dataset_root_owner", fanstore_py_dataset_root_owner, METH_VARARGS, "dataset_root_owner(uid, gid): the dataset's root shows these owner ids in the C answers"},
    {"drop_dataset", fanstore_py_drop_dataset, METH_NOARGS, "drop_dataset(): every C answer from the dataset off, the columns released"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_noflush", NULL, -1, methods,
                                     NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__noflush(void) { return PyModule_Create(&module); }
