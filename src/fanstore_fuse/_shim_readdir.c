/* Directory listings answered with plain READDIR where the kernel allows (issue 14).
 *
 * pyfuse3 3.5 registers only readdirplus and clears FUSE_CAP_READDIRPLUS_AUTO in its init, so
 * every listing chunk is a READDIRPLUS: the kernel instantiates an inode and a dentry for every
 * entry, which `find` (it needs only d_type) pays for in system time. This patch
 *
 * - wraps init: pyfuse3's runs first, then READDIRPLUS_AUTO is wanted again (when the kernel
 *   offers it). The kernel then asks READDIRPLUS for the first chunk of a listing and for a
 *   chunk after a lookup in that directory, plain READDIR otherwise (fs/fuse/readdir.c,
 *   fuse_use_readdirplus);
 * - answers READDIR with pyfuse3's readdirplus handler, the file handle it hands to Python
 *   marked with PLAIN_FH_BIT: Python's readdir strips the bit and calls plain_entries(True)
 *   around the (synchronous) readdir_reply calls of such a request;
 * - interposes fuse_add_direntry_plus (pyfuse3's readdir_reply calls it; the shim is in the
 *   global symbol scope before pyfuse3 is imported, see _noflush.c): while plain entries are on,
 *   it writes a plain record (inode and type from the attributes) with fuse_add_direntry, so
 *   sizes and offsets stay what the kernel expects of a READDIR reply.
 *
 * Once Python says the dataset's metadata is answered locally (serve_dataset; it never
 * changes), LOOKUP of a dataset name and READDIR/READDIRPLUS of the dataset part of a dataset
 * directory are answered here, from the manifest's columns _shim_dataset.c holds, without
 * Python: the same attributes Operations._attr gives (fanstore_dataset_stat). Anything else (".", "..", a name the
 * dataset lacks, which may be a written one, the written entries after a listing's dataset
 * part, directories written on this or another rank) goes to pyfuse3's handlers as before.
 *
 * The kernel counts no lookups for plain entries; the daemon keeps no lookup counts (inode
 * numbers are stable, forget does nothing), so nothing else changes. All of this runs on the one
 * thread that serves requests.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "_shim_dataset.h"
#include "_shim_ops.h"
#include "_shim_readdir.h"

#define PLAIN_FH_BIT (UINT64_C(1) << 63)

typedef void (*init_t)(void *, struct fuse_conn_info *);
typedef void (*readdir_t)(fuse_req_t, fuse_ino_t, size_t, off_t, struct fuse_file_info *);
typedef size_t (*add_plus_t)(fuse_req_t, char *, size_t, const char *,
                             const struct fuse_entry_param *, off_t);
typedef size_t (*add_plain_t)(fuse_req_t, char *, size_t, const char *, const struct stat *,
                              off_t);

typedef void (*lookup_t)(fuse_req_t, fuse_ino_t, const char *);
typedef int (*reply_entry_t)(fuse_req_t, const struct fuse_entry_param *);
typedef int (*reply_buf_t)(fuse_req_t, const char *, size_t);

static init_t py_init;
static readdir_t py_readdirplus;
static lookup_t py_lookup;
static reply_entry_t reply_entry;
static int (*reply_err)(fuse_req_t, int);
static reply_buf_t reply_buf;
static add_plus_t add_plus;
static add_plain_t add_plain;
static int auto_granted;
static unsigned long long plain_requests;
static unsigned long long plain_entries;

static void init_auto(void *userdata, struct fuse_conn_info *conn) {
    py_init(userdata, conn);
    if (conn->capable & FUSE_CAP_READDIRPLUS_AUTO) {
        conn->want |= FUSE_CAP_READDIRPLUS_AUTO;
        auto_granted = 1;
    }
}

/* ------------------------------------------------------------ the dataset's names */

#define NAME_MAX_BYTES 255

static const struct fanstore_dataset *const ds = &fanstore_ds;
static double entry_timeout;
static uint32_t plus_max; /* entries in a READDIRPLUS reply while nothing is stat'ed (0: all) */
static int plain_on;
static unsigned long long c_lookups, c_listings;
static unsigned long long file_lookups, file_lookups_seen; /* non-directories looked up */

/* Index of the dataset directory behind `ino`, or -1. */
static int64_t dataset_dir(fuse_ino_t ino) {
    if (!fanstore_dataset_serves(FANSTORE_SERVE_NAMES, ino) ||
        ds->kind[ino - 1] != FANSTORE_KIND_DIR)
        return -1;
    return (int64_t)(ino - 1);
}

static int name_cmp(uint64_t j, const char *name, size_t len) {
    const char *c = ds->names + ds->name_off[j];
    size_t clen = ds->name_off[j + 1] - ds->name_off[j];
    int r = memcmp(c, name, clen < len ? clen : len);
    if (r != 0)
        return r;
    return clen < len ? -1 : clen > len;
}

static int64_t find_child(uint64_t dir, const char *name, size_t len) {
    uint64_t lo = ds->first[dir], hi = lo + ds->count[dir];
    while (lo < hi) {
        uint64_t mid = lo + (hi - lo) / 2;
        int r = name_cmp(mid, name, len);
        if (r == 0)
            return (int64_t)mid;
        if (r < 0)
            lo = mid + 1;
        else
            hi = mid;
    }
    return -1;
}

static void fill_entry(uint64_t j, struct fuse_entry_param *e) {
    memset(e, 0, sizeof(*e));
    e->ino = j + 1;
    e->attr_timeout = e->entry_timeout = entry_timeout;
    fanstore_dataset_stat(j, &e->attr);
}

/* The dataset entry `name` (`len` bytes) of `parent` that lookup_c answers, or -1. */
static int64_t dataset_child(fuse_ino_t parent, const char *name, size_t len) {
    int64_t dir = dataset_dir(parent);
    int dots = len > 0 && name[0] == '.' && (len == 1 || (len == 2 && name[1] == '.'));
    if (dir < 0 || len == 0 || len > NAME_MAX_BYTES || dots)
        return -1;
    return find_child((uint64_t)dir, name, len);
}

static void lookup_c(fuse_req_t req, fuse_ino_t parent, const char *name) {
    int64_t j = dataset_child(parent, name, strlen(name));
    if (j >= 0) {
        struct fuse_entry_param e;
        fill_entry((uint64_t)j, &e);
        __atomic_add_fetch(&c_lookups, 1, __ATOMIC_RELAXED); /* also on _shim_threads.c's */
        if (ds->kind[j] != FANSTORE_KIND_DIR)
            __atomic_add_fetch(&file_lookups, 1, __ATOMIC_RELAXED);
        reply_entry(req, &e);
        return;
    }
    if (fanstore_c_thread) /* cannot happen: such a thread takes only what C answers */
        reply_err(req, EIO);
    else
        py_lookup(req, parent, name); /* not the dataset's: maybe written */
}

int fanstore_lookup_answered(uint64_t parent, const void *body, size_t left) {
    size_t len = strnlen(body, left);
    return len < left && dataset_child(parent, body, len) >= 0; /* the name ends in a NUL */
}

/* How many entries a READDIRPLUS reply from `off` in `dir` may hold. The kernel asks READDIRPLUS
 * for a listing's first chunk (and after a lookup in the directory), READDIR otherwise. Whether
 * the attributes are wanted shows in the lookups that follow: a `find` looks up no file, a walk
 * that stats every entry looks up those not given with attributes. So: while files were looked
 * up since the previous READDIRPLUS reply, give every entry with its attributes but the last
 * (whose LOOKUP keeps this going); else only plus_max entries, the rest then comes plain. */
static uint64_t plus_entries(int64_t dir, off_t off) {
    uint64_t left = ds->count[dir] - (uint64_t)off;
    int stat_mode = file_lookups != file_lookups_seen;
    file_lookups_seen = file_lookups;
    if (stat_mode || plus_max == 0)
        return left > 1 && stat_mode ? left - 1 : left;
    return plus_max < left ? plus_max : left;
}

/* The dataset part of a dataset directory's listing from position `off`; 0 if not ours. */
static int readdir_c(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off, int plus) {
    int64_t dir = dataset_dir(ino);
    if (dir < 0 || off < 0 || (uint64_t)off >= ds->count[dir])
        return 0; /* the written entries after the dataset's, and the end: Python */
    uint64_t most = plus ? plus_entries(dir, off) : UINT64_MAX;
    char *buf = malloc(size ? size : 1);
    if (buf == NULL)
        return 0;
    char name[NAME_MAX_BYTES + 1];
    size_t used = 0;
    uint64_t n = 0;
    for (uint64_t pos = (uint64_t)off; pos < ds->count[dir]; pos++) {
        uint64_t j = ds->first[dir] + pos;
        size_t len = ds->name_off[j + 1] - ds->name_off[j], k;
        if (len > NAME_MAX_BYTES)
            len = NAME_MAX_BYTES; /* prep refuses such names; never read past the heap */
        memcpy(name, ds->names + ds->name_off[j], len);
        name[len] = 0;
        if (plus) {
            struct fuse_entry_param e;
            fill_entry(j, &e);
            k = add_plus(req, buf + used, size - used, name, &e, (off_t)pos + 1);
        } else {
            struct stat st;
            memset(&st, 0, sizeof(st));
            st.st_ino = j + 1;
            st.st_mode = ds->mode[j];
            k = add_plain(req, buf + used, size - used, name, &st, (off_t)pos + 1);
        }
        if (k > size - used)
            break;
        used += k;
        if (++n == most)
            break;
    }
    c_listings++;
    reply_buf(req, buf, used);
    free(buf);
    return 1;
}

static void readdirplus_c(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off,
                          struct fuse_file_info *fi) {
    if (!readdir_c(req, ino, size, off, 1))
        py_readdirplus(req, ino, size, off, fi);
}

static void readdir_plain(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off,
                          struct fuse_file_info *fi) {
    struct fuse_file_info copy = *fi;
    copy.fh |= PLAIN_FH_BIT;
    plain_requests++;
    if (!readdir_c(req, ino, size, off, 0))
        py_readdirplus(req, ino, size, off, &copy);
}

void fanstore_patch_readdir(struct fuse_lowlevel_ops *ops) {
    const char *off = getenv("FANSTORE_READDIRPLUS");
    if (off != NULL && strcmp(off, "always") == 0)
        return; /* every chunk READDIRPLUS, as pyfuse3 has it (for comparisons) */
    if (ops->readdirplus == NULL || ops->readdir != NULL || ops->init == NULL)
        return; /* not pyfuse3's table as we know it */
    add_plain = (add_plain_t)fanstore_libfuse_symbol("fuse_add_direntry");
    add_plus = (add_plus_t)fanstore_libfuse_symbol("fuse_add_direntry_plus");
    reply_entry = (reply_entry_t)fanstore_libfuse_symbol("fuse_reply_entry");
    reply_buf = (reply_buf_t)fanstore_libfuse_symbol("fuse_reply_buf");
    reply_err = (int (*)(fuse_req_t, int))fanstore_libfuse_symbol("fuse_reply_err");
    if (add_plain == NULL || add_plus == NULL || reply_entry == NULL || reply_buf == NULL ||
        reply_err == NULL ||
        ops->lookup == NULL) {
        add_plain = NULL; /* serve_dataset refuses */
        return;
    }
    py_init = ops->init;
    py_readdirplus = ops->readdirplus;
    py_lookup = ops->lookup;
    ops->init = init_auto;
    ops->readdir = readdir_plain;
    ops->readdirplus = readdirplus_c;
    ops->lookup = lookup_c;
}

size_t fuse_add_direntry_plus(fuse_req_t req, char *buf, size_t bufsize, const char *name,
                              const struct fuse_entry_param *e, off_t off) {
    if (plain_on) { /* only ever set when the table was patched: add_plain is there */
        size_t n = add_plain(req, buf, bufsize, name, &e->attr, off);
        if (n <= bufsize)
            plain_entries++;
        return n;
    }
    if (add_plus == NULL)
        add_plus = (add_plus_t)fanstore_libfuse_symbol("fuse_add_direntry_plus");
    return add_plus(req, buf, bufsize, name, e, off);
}

/* ------------------------------------------------------------ Python's side (_fastclose.py) */

PyObject *fanstore_py_plain_entries(PyObject *self, PyObject *on) {
    (void)self;
    int v = PyObject_IsTrue(on);
    if (v < 0)
        return NULL;
    plain_on = v;
    Py_RETURN_NONE;
}

PyObject *fanstore_py_readdir_stats(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    return Py_BuildValue("(iKKKK)", auto_granted, plain_requests, plain_entries, c_lookups,
                         c_listings);
}

/* serve_dataset(timeout, plus_max): answer dataset lookups and listings from the held columns
 * (hold_dataset first), with `timeout` as entry and attribute timeout and at most `plus_max`
 * entries (0: no limit) per READDIRPLUS reply while nothing is stat'ed. */
PyObject *fanstore_py_serve_dataset(PyObject *self, PyObject *args) {
    (void)self;
    double timeout;
    unsigned int most;
    if (!PyArg_ParseTuple(args, "dI", &timeout, &most))
        return NULL;
    if (add_plain == NULL || py_lookup == NULL) {
        PyErr_SetString(PyExc_OSError, "the FUSE table of operations was not patched");
        return NULL;
    }
    entry_timeout = timeout;
    plus_max = most;
    if (!fanstore_dataset_serve(FANSTORE_SERVE_NAMES, "serve_dataset"))
        return NULL;
    Py_RETURN_NONE;
}
