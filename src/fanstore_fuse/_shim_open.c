/* OPEN and RELEASE of dataset files answered in C (issue 11).
 *
 * A warm read of a small file costs the daemon an OPEN (the reader waits for it) and a RELEASE
 * (asynchronous): with long entry/attr timeouts and keep_cache, nothing else reaches it. Through
 * pyfuse3 each is a trio task running a Python handler. For the dataset both answers are fixed:
 * the dataset is immutable (every mutating call on it fails with EROFS, and no rank can create a
 * name the dataset has), the kernel checks permissions itself (default_permissions), and
 * MountView.open answers an open without write intent with the inode as file handle and
 * keep_cache, while MountView.release does nothing for such a handle. So once Python has said
 * how many entries the dataset has (`fast_open(n)`: inodes 1..n), an OPEN of such an inode
 * without write intent is answered here with the same handle (through the shim's
 * fuse_reply_open, which adds noflush where enabled), and a RELEASE of a dataset handle
 * (1..n, whoever opened it) with success. Everything else goes to pyfuse3's handlers. READ
 * gets the same handle either way, so Python's read path is unchanged.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <fcntl.h>

#include "_shim_ops.h"

/* MountView.WRITE_FLAGS: an open with any of these goes to Python (EROFS there) */
#define WRITE_FLAGS (O_WRONLY | O_RDWR | O_TRUNC | O_APPEND | O_CREAT)

typedef void (*file_op_t)(fuse_req_t, fuse_ino_t, struct fuse_file_info *);
typedef int (*reply_err_t)(fuse_req_t, int);

static file_op_t py_open, py_release;
static reply_err_t reply_err; /* libfuse's fuse_reply_err (the shim does not link libfuse) */
static uint64_t dataset_entries; /* inodes 1..n are the dataset's; 0: every request to Python */
static unsigned long long c_opens, c_releases;

static void open_in_c(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi) {
    if (ino >= 1 && ino <= dataset_entries && !(fi->flags & WRITE_FLAGS)) {
        fi->fh = ino;
        fi->keep_cache = 1;
        fi->direct_io = 0;
        fi->nonseekable = 0;
        c_opens++;
        fuse_reply_open(req, fi); /* _noflush.c's: noflush on read-only opens when enabled */
        return;
    }
    py_open(req, ino, fi);
}

static void release_in_c(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi) {
    if (fi->fh >= 1 && fi->fh <= dataset_entries) {
        c_releases++;
        reply_err(req, 0);
        return;
    }
    py_release(req, ino, fi);
}

void fanstore_patch_open(struct fuse_lowlevel_ops *ops) {
    reply_err = (reply_err_t)fanstore_libfuse_symbol("fuse_reply_err");
    if (ops->open == NULL || ops->release == NULL || reply_err == NULL)
        return;
    py_open = ops->open;
    py_release = ops->release;
    ops->open = open_in_c;
    ops->release = release_in_c;
}

PyObject *fanstore_fast_open(PyObject *self, PyObject *arg) {
    (void)self;
    unsigned long long n = PyLong_AsUnsignedLongLong(arg);
    if (n == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    if (n >= (1ULL << 40)) { /* written files' inodes start there (WRITE_INODE_BASE) */
        PyErr_SetString(PyExc_ValueError, "dataset too large for the fast open path");
        return NULL;
    }
    dataset_entries = n;
    Py_RETURN_NONE;
}

PyObject *fanstore_fast_counts(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    return Py_BuildValue("(KK)", c_opens, c_releases);
}
