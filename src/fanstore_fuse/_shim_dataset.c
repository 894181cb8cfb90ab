/* The manifest's entry columns, held once for every answer the shim gives from the dataset:
 * _shim_open.c (OPEN, RELEASE, GETATTR of dataset files) and _shim_readdir.c (LOOKUP and
 * listings of dataset directories) read them through `fanstore_ds`, and build a dataset entry's
 * attributes with `fanstore_dataset_stat`, the rule Operations._attr follows in Python.
 *
 * Python hands the columns over with hold_dataset (the manifest's memoryviews, held as buffers
 * until drop_dataset or the end of the process; _fastclose.hold_dataset builds the tuple). The
 * same columns handed over again change nothing; other columns replace them with every feature
 * switched off. Each feature has its own switch (fast_open, serve_dataset), on only while
 * columns are held. All of it runs on the one thread that serves requests, under the GIL.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <sys/stat.h>

#include "_shim_dataset.h"

#define DIR_BLKSIZE (1 << 20) /* as Operations._attr */
#define FILE_BLKSIZE (1 << 17)
#define MAX_ENTRIES (UINT64_C(1) << 40) /* written files' inodes start there (WRITE_INODE_BASE) */

struct fanstore_dataset fanstore_ds;
static int root_owned;              /* dataset_root_owner was called: the root shows root_ids */
static uint32_t root_ids[2];        /* uid, gid */

enum { KIND, MODE, UID, GID, COUNT, MTIME, SIZE, FIRST, NAME_OFF, NAMES, NCOLS };
static const Py_ssize_t col_itemsize[NCOLS] = {1, 4, 4, 4, 4, 8, 8, 8, 8, 1};
static Py_buffer held[NCOLS]; /* held[k].obj != NULL while held */

void fanstore_dataset_stat(uint64_t j, struct stat *st) {
    const struct fanstore_dataset *d = &fanstore_ds;
    uint32_t mode = d->mode[j];
    memset(st, 0, sizeof(*st));
    st->st_ino = j + 1;
    st->st_mode = mode;
    st->st_nlink = 1;
    if (d->kind[j] == FANSTORE_KIND_DIR) { /* 2 + subdirectories, as Namespace._nlink */
        uint64_t c0 = d->first[j];
        st->st_nlink = 2;
        for (uint64_t k = c0; k < c0 + d->count[j]; k++)
            st->st_nlink += d->kind[k] == FANSTORE_KIND_DIR;
    }
    st->st_uid = j == 0 && root_owned ? root_ids[0] : d->uid[j];
    st->st_gid = j == 0 && root_owned ? root_ids[1] : d->gid[j];
    st->st_rdev = (S_ISCHR(mode) || S_ISBLK(mode)) ? (dev_t)d->first[j] : 0;
    st->st_size = (off_t)d->size[j];
    /* glibc's readdir reads a directory in st_blksize chunks (up to 1 MiB), and the kernel
     * asks for as much: one READDIRPLUS chunk then holds a 1,300-entry directory. */
    st->st_blksize = d->kind[j] == FANSTORE_KIND_DIR ? DIR_BLKSIZE : FILE_BLKSIZE;
    st->st_blocks = (blkcnt_t)((d->size[j] + 511) / 512);
    int64_t t = d->mtime_ns[j], sec = t / 1000000000, ns = t % 1000000000;
    if (ns < 0) { /* floor division, as pyfuse3's setters */
        ns += 1000000000;
        sec -= 1;
    }
    st->st_atim.tv_sec = st->st_mtim.tv_sec = st->st_ctim.tv_sec = sec;
    st->st_atim.tv_nsec = st->st_mtim.tv_nsec = st->st_ctim.tv_nsec = ns;
}

static void release_held(void) {
    memset(&fanstore_ds, 0, sizeof(fanstore_ds)); /* every feature off first */
    for (int k = 0; k < NCOLS; k++)
        if (held[k].obj != NULL)
            PyBuffer_Release(&held[k]);
}

static int already_held(PyObject *cols, uint64_t n) {
    if (fanstore_ds.n != n)
        return 0;
    for (int k = 0; k < NCOLS; k++)
        if (held[k].obj != PyTuple_GET_ITEM(cols, k))
            return 0;
    return 1;
}

/* hold_dataset((kind, mode, uid, gid, count, mtime_ns, size, first, name_off, names), n): each
 * column a C-contiguous buffer of native integers of its manifest type holding (at least) n
 * entries, name_off n + 1, names name_off[n] bytes. */
PyObject *fanstore_py_hold_dataset(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *cols;
    unsigned long long n;
    if (!PyArg_ParseTuple(args, "O!K", &PyTuple_Type, &cols, &n))
        return NULL;
    if (PyTuple_GET_SIZE(cols) != NCOLS) {
        PyErr_Format(PyExc_ValueError, "hold_dataset: %d columns expected", NCOLS);
        return NULL;
    }
    if (n == 0 || n >= MAX_ENTRIES) {
        PyErr_SetString(PyExc_ValueError, "hold_dataset: dataset empty or too large for the shim");
        return NULL;
    }
    if (already_held(cols, n))
        Py_RETURN_NONE;
    Py_buffer got[NCOLS];
    int k;
    for (k = 0; k < NCOLS; k++) {
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(cols, k), &got[k],
                               PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
            break;
        uint64_t need = k == NAME_OFF ? n + 1 : (k == NAMES ? 0 : n);
        if (got[k].itemsize != col_itemsize[k] || (uint64_t)(got[k].len / got[k].itemsize) < need ||
            (k == NAMES && (uint64_t)got[k].len < ((const uint64_t *)got[NAME_OFF].buf)[n])) {
            PyBuffer_Release(&got[k]);
            PyErr_Format(PyExc_ValueError, "hold_dataset: column %d of unexpected shape", k);
            break;
        }
    }
    if (k < NCOLS) {
        while (k-- > 0)
            PyBuffer_Release(&got[k]);
        return NULL;
    }
    release_held();
    memcpy(held, got, sizeof(held));
    fanstore_ds.kind = held[KIND].buf;
    fanstore_ds.mode = held[MODE].buf;
    fanstore_ds.uid = held[UID].buf;
    fanstore_ds.gid = held[GID].buf;
    fanstore_ds.count = held[COUNT].buf;
    fanstore_ds.mtime_ns = held[MTIME].buf;
    fanstore_ds.size = held[SIZE].buf;
    fanstore_ds.first = held[FIRST].buf;
    fanstore_ds.name_off = held[NAME_OFF].buf;
    fanstore_ds.names = held[NAMES].buf;
    fanstore_ds.n = n; /* serving stays 0: each feature switches itself on */
    Py_RETURN_NONE;
}

PyObject *fanstore_py_drop_dataset(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    release_held();
    Py_RETURN_NONE;
}

int fanstore_dataset_serve(unsigned feature, const char *who) {
    if (fanstore_ds.n == 0) {
        PyErr_Format(PyExc_ValueError, "%s: no dataset held (hold_dataset first)", who);
        return 0;
    }
    fanstore_ds.serving |= feature;
    return 1;
}

/* dataset_root_owner(uid, gid): the root (entry 0) shows these owner ids from now on, as
 * Operations._attr shows them (MountView.root_owner: a mount run by a user other than root);
 * dataset_root_owner(): the manifest's ids again. */
PyObject *fanstore_py_dataset_root_owner(PyObject *self, PyObject *args) {
    (void)self;
    unsigned int uid = 0, gid = 0;
    if (!PyArg_ParseTuple(args, "|II", &uid, &gid))
        return NULL;
    root_ids[0] = uid;
    root_ids[1] = gid;
    root_owned = PyTuple_GET_SIZE(args) == 2;
    Py_RETURN_NONE;
}
