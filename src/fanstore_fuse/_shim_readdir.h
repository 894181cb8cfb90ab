/* _shim_readdir.c's Python methods, for _noflush.c's method table (include after Python.h). */
#ifndef FANSTORE_SHIM_READDIR_H
#define FANSTORE_SHIM_READDIR_H
#include <stddef.h>
#include <stdint.h>

/* Whether lookup_c answers a LOOKUP of `parent` whose body (the name and its NUL) is `body`, for
 * _shim_open.c's request loop (the same test: a pure function of the request and the columns). */
int fanstore_lookup_answered(uint64_t parent, const void *body, size_t left);

PyObject *fanstore_py_plain_entries(PyObject *self, PyObject *on);
PyObject *fanstore_py_readdir_stats(PyObject *self, PyObject *unused);
PyObject *fanstore_py_serve_dataset(PyObject *self, PyObject *args);

#define FANSTORE_READDIR_METHODS                                                                  \
    {"plain_entries", fanstore_py_plain_entries, METH_O,                                          \
     "plain_entries(on): readdir_reply writes plain READDIR entries"},                            \
    {"readdir_stats", fanstore_py_readdir_stats, METH_NOARGS,                                     \
     "readdir_stats(): (READDIRPLUS_AUTO granted, READDIRs, plain entries from Python, "          \
     "lookups and listings answered in C)"},                                                      \
    {"serve_dataset", fanstore_py_serve_dataset, METH_VARARGS,                                    \
     "serve_dataset(timeout, plus_max): answer lookups and listings of the held dataset in C"},

#endif
