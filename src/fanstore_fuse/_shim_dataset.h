/* The manifest's entry columns, held once for the shim's answers from the dataset
 * (_shim_dataset.c), and the attributes of a dataset entry built from them. */
#ifndef FANSTORE_SHIM_DATASET_H
#define FANSTORE_SHIM_DATASET_H
#include <stdint.h>
#include <sys/stat.h>

#define FANSTORE_KIND_FILE 0 /* _format.KIND_FILE */
#define FANSTORE_KIND_DIR 1  /* _format.KIND_DIR */

/* The features answering from the columns, each switched on by its own Python entry point;
 * a hand-over of other columns (or a release) switches all of them off. */
#define FANSTORE_SERVE_FILES 1u /* _shim_open.c: OPEN, RELEASE, GETATTR of dataset files */
#define FANSTORE_SERVE_NAMES 2u /* _shim_readdir.c: LOOKUP, listings of dataset directories */
#define FANSTORE_SERVE_READS 4u /* _shim_read.c: READ of dataset files held here */

struct fanstore_dataset {
    uint64_t n; /* entries; entry j is inode j + 1; 0: no columns held */
    const uint8_t *kind;
    const uint32_t *mode, *uid, *gid, *count;
    const int64_t *mtime_ns;
    const uint64_t *size, *first, *name_off; /* name_off: n + 1 offsets into names */
    const char *names;
    unsigned serving; /* FANSTORE_SERVE_* switched on */
};

extern struct fanstore_dataset fanstore_ds;

/* Whether `ino` is a dataset inode that `feature` answers. */
static inline int fanstore_dataset_serves(unsigned feature, uint64_t ino) {
    return (fanstore_ds.serving & feature) && ino >= 1 && ino <= fanstore_ds.n;
}

/* Entry j's attributes, as Operations._attr gives them (every other field 0). */
void fanstore_dataset_stat(uint64_t j, struct stat *st);

/* Switch `feature` (FANSTORE_SERVE_*) on for the held dataset; 0 with a ValueError naming
 * `who` when no dataset is held. */
int fanstore_dataset_serve(unsigned feature, const char *who);

#ifdef Py_PYTHON_H /* the module's functions, for _noflush.c's method table */
PyObject *fanstore_py_hold_dataset(PyObject *self, PyObject *args);
PyObject *fanstore_py_drop_dataset(PyObject *self, PyObject *unused);
PyObject *fanstore_py_dataset_root_owner(PyObject *self, PyObject *args);
#endif

#endif
