/* The patches _noflush.c's fuse_session_new applies to pyfuse3's table of operations.
 * Each lives in its own source file; each may replace or wrap entries of `ops` (keeping the
 * originals it wraps) and must leave the others alone. */
#ifndef FANSTORE_SHIM_OPS_H
#define FANSTORE_SHIM_OPS_H
#define FUSE_USE_VERSION 35
#include <fuse_lowlevel.h>

void *fanstore_libfuse_symbol(const char *name); /* libfuse3's own definition of `name` */

void fanstore_patch_readdir(struct fuse_lowlevel_ops *ops); /* _shim_readdir.c */
void fanstore_patch_open(struct fuse_lowlevel_ops *ops);    /* _shim_open.c */

#ifdef Py_PYTHON_H /* the module's functions defined next to their patch */
PyObject *fanstore_fast_open(PyObject *self, PyObject *args);     /* _shim_open.c */
PyObject *fanstore_fast_counts(PyObject *self, PyObject *unused); /* _shim_open.c */
#endif

#endif
