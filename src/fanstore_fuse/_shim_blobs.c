/* The manifest's blob columns and this rank's local copies, held for reads in C (issue 11);
 * the interface and its rules are in _shim_blobs.h.
 *
 * Python (_fastread.py) hands over, once, before the session serves: the six blob columns
 * (the manifest's memoryviews, held as buffers), chunk_size, the zstd dictionary (codec 2), a
 * descriptor per partition present in the local dir (duplicated here; -1 where absent), and
 * the DenseMap of a rank that holds a share: per partition whether its local copy is dense,
 * and the held blob ids (ascending) with their local offsets. A blob is held when its
 * partition is here and, for a dense copy, the map lists it; its stored bytes then lie at the
 * map's offset, else at the manifest's. The checks are _blobcodec's: decoded lengths, the xxh3
 * of the raw bytes (codecs 0-2), the frame table against the manifest's xxh3 and each frame
 * against the table's (codec 3); a zstd frame claiming more than its raw size is refused
 * before decoding, and no output buffer is ever larger than the raw size (_shim_frames.c).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>
#define ZSTD_STATIC_LINKING_ONLY /* ZSTD_getFrameContentSize's constants */
#include <zstd.h>

#include "_shim_blobs.h"
#include "_shim_mapread.h"


struct fanstore_blobs fanstore_blobs;

enum { PART, OFFSET, STORED, RAW, CODEC, XXH3, NCOLS, DENSE_IDS = NCOLS, DENSE_OFFS, NHELD };
static const Py_ssize_t col_itemsize[NHELD] = {4, 8, 4, 4, 1, 8, 8, 8};
static Py_buffer held[NHELD]; /* held[k].obj != NULL while held */

static int *fds;          /* per partition: a descriptor of the local copy, or -1 */
static uint8_t *dense;    /* per partition: 1 when the local copy is dense */
static uint32_t nparts;
static const uint64_t *dense_ids, *dense_offs;
static uint64_t dense_n;
ZSTD_DDict *fanstore_ddict; /* codec 2; NULL without a dictionary */
static int nowait_ok = 1; /* cleared for good when the file system refuses RWF_NOWAIT */

/* Cold small blobs read around the page cache (issue 11, twenty-second session). A buffered
 * read that misses, RWF_NOWAIT ones included, starts the page cache's read-ahead there, in
 * small folios; a 2 MiB range holding any of them can no longer take one large folio, so the
 * stream (_shim_stream.c) then fills the rest of the copy page by page: measured on the bench's
 * copy, 35-60 ms of the stream's CPU per pass instead of 7-10, and 109-158 ms instead of
 * 83-120 for the stream itself (docs/performance.md, twenty-second session). So a whole blob of at most direct_max bytes is
 * first looked up in the page cache with cachestat(2) (Linux 6.5; ~0.5 us, against 2.4 for
 * mincore through a mapping and 7 for the RWF_NOWAIT read itself): not wholly resident, the
 * nowait read gives AGAIN without starting any I/O, and the blocking read reads exactly the
 * blob's 4 KiB-aligned span with O_DIRECT into a per-thread bounce buffer: no page cache
 * filled, the stream's large folios kept. FANSTORE_DIRECT_MISS=BYTES sets direct_max (0: off);
 * a kernel without cachestat, or a file system that refuses O_DIRECT, keeps the buffered
 * reads. */
#define DIRECT_MAX_DEFAULT (1u << 20)
#define DIRECT_ALIGN 4096u
#ifndef __NR_cachestat
#define __NR_cachestat 451
#endif
struct fs_cachestat_range {
    uint64_t off, len;
};
struct fs_cachestat {
    uint64_t nr_cache, nr_dirty, nr_writeback, nr_evicted, nr_recently_evicted;
};
static int *dfds;          /* per partition: an O_DIRECT descriptor of the copy, or -1 */
static size_t direct_max = DIRECT_MAX_DEFAULT;
static int direct_ok = 1;  /* cleared for good when cachestat or O_DIRECT is refused */
static unsigned long long direct_reads, direct_bytes, gated_again;
static __thread char *bounce;
static __thread size_t bounce_cap;

/* 1 when every page of [off, off + n) of `fd` is in the page cache, 0 when not, -1 when
 * cachestat is not to be had here. */
int fanstore_range_resident(int fd, off_t off, size_t n) {
    if (n == 0)
        return 1; /* (cachestat reads a length of 0 as "to the end of the file") */
    struct fs_cachestat_range r = {(uint64_t)off, n};
    struct fs_cachestat cs;
    if (syscall(__NR_cachestat, fd, &r, &cs, 0) != 0)
        return -1;
    uint64_t pages = (((uint64_t)off + n + 4095) >> 12) - ((uint64_t)off >> 12);
    return cs.nr_cache >= pages;
}

/* ------------------------------------------------------------------ local copies */

static int64_t dense_offset(uint64_t blob) {
    uint64_t a = 0, b = dense_n;
    while (a < b) {
        uint64_t m = a + (b - a) / 2;
        if (dense_ids[m] < blob)
            a = m + 1;
        else
            b = m;
    }
    return a < dense_n && dense_ids[a] == blob ? (int64_t)dense_offs[a] : -1;
}

/* Where `blob`'s stored bytes lie here: the local offset (and *fd), or -1 when not held. */
static int64_t where(uint64_t blob, int *fd) {
    const struct fanstore_blobs *b = &fanstore_blobs;
    if (blob >= b->n)
        return -1;
    uint32_t p = b->part[blob];
    if (p >= nparts || fds[p] < 0)
        return -1;
    *fd = fds[p];
    return dense[p] ? dense_offset(blob) : (int64_t)b->offset[blob];
}

int64_t fanstore_blob_locate(uint64_t blob, int *fd) {
    return where(blob, fd);
}

size_t fanstore_pages_missing(const void *p, size_t len) {
    uintptr_t a = (uintptr_t)p & ~(uintptr_t)4095;
    len += (uintptr_t)p - a;
    size_t pages = (len + 4095) / 4096, missing = 0;
    unsigned char small[2048], *vec = pages <= sizeof(small) ? small : malloc(pages);
    if (vec == NULL || mincore((void *)a, len, vec) != 0)
        missing = pages;
    else
        for (size_t i = 0; i < pages; i++)
            missing += !(vec[i] & 1);
    if (vec != small)
        free(vec);
    return missing;
}

uint32_t fanstore_blob_parts(void) {
    return nparts;
}

int fanstore_blob_part_fd(uint32_t part) {
    return part < nparts ? fds[part] : -1;
}

int fanstore_blob_held(uint64_t blob) {
    int fd;
    return where(blob, &fd) >= 0;
}

const char *fanstore_direct_span(int dfd, off_t off, size_t n, int *status) {
    *status = FANSTORE_BLOB_AGAIN;
    if (dfd < 0 || !__atomic_load_n(&direct_ok, __ATOMIC_RELAXED))
        return NULL;
    off_t a = off & ~(off_t)(DIRECT_ALIGN - 1);
    size_t lead = (size_t)(off - a);
    size_t span = (lead + n + DIRECT_ALIGN - 1) & ~(size_t)(DIRECT_ALIGN - 1);
    if (bounce_cap < span) {
        free(bounce);
        bounce_cap = 0;
        bounce = aligned_alloc(DIRECT_ALIGN, span);
        *status = FANSTORE_BLOB_NOMEM;
        if (bounce == NULL)
            return NULL;
        bounce_cap = span;
    }
    size_t got = 0;
    while (got < lead + n) {
        ssize_t r = pread(dfd, bounce + got, span - got, a + (off_t)got);
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0 && errno == EINVAL && got == 0) {
            __atomic_store_n(&direct_ok, 0, __ATOMIC_RELAXED);
            *status = FANSTORE_BLOB_AGAIN;
            return NULL;
        }
        *status = FANSTORE_BLOB_IO; /* an error, or the file ends before the span does */
        if (r <= 0)
            return NULL;
        got += (size_t)r;
        if ((size_t)r % DIRECT_ALIGN != 0)
            break; /* the end of the file */
    }
    if (got < lead + n)
        return NULL;
    *status = FANSTORE_BLOB_OK;
    return bounce + lead;
}

size_t fanstore_direct_max(void) {
    return __atomic_load_n(&direct_ok, __ATOMIC_RELAXED) ? direct_max : 0;
}

void fanstore_direct_refused(void) {
    __atomic_store_n(&direct_ok, 0, __ATOMIC_RELAXED);
}

/* The `n` bytes at `off` of a copy read with O_DIRECT (`dfd`), copied to `buf`: OK, IO, NOMEM,
 * or AGAIN when O_DIRECT cannot be used (then never again). */
static int direct_pread(int dfd, off_t off, size_t n, void *buf) {
    int status;
    const char *at = fanstore_direct_span(dfd, off, n, &status);
    if (at == NULL)
        return status;
    memcpy(buf, at, n);
    __atomic_add_fetch(&direct_reads, 1, __ATOMIC_RELAXED);
    __atomic_add_fetch(&direct_bytes, n, __ATOMIC_RELAXED);
    return FANSTORE_BLOB_OK;
}

/* Whether a read of `n` bytes of held `blob` from `rel` is one the O_DIRECT path takes: the
 * whole blob, with bytes, at most direct_max of them, its partition open with O_DIRECT. */
static int direct_candidate(uint64_t blob, uint64_t rel, size_t n) {
    return rel == 0 && n > 0 && n == fanstore_blobs.stored[blob] && n <= direct_max &&
           dfds != NULL && dfds[fanstore_blobs.part[blob]] >= 0 &&
           __atomic_load_n(&direct_ok, __ATOMIC_RELAXED);
}

int fanstore_blob_direct(uint64_t blob) {
    int fd;
    return where(blob, &fd) >= 0 && direct_candidate(blob, 0, fanstore_blobs.stored[blob]);
}

/* An O_DIRECT descriptor of each held partition (none when FANSTORE_DIRECT_MISS=0). */
static void open_direct(void) {
    const char *k = getenv("FANSTORE_DIRECT_MISS");
    direct_max = k != NULL && *k != 0 ? (size_t)strtoull(k, NULL, 10) : DIRECT_MAX_DEFAULT;
    dfds = malloc((nparts ? nparts : 1) * sizeof(*dfds));
    for (uint32_t p = 0; dfds != NULL && p < nparts; p++) {
        dfds[p] = -1;
        if (direct_max == 0 || fds[p] < 0)
            continue;
        char path[64];
        snprintf(path, sizeof(path), "/proc/self/fd/%d", fds[p]);
        dfds[p] = open(path, O_RDONLY | O_DIRECT | O_CLOEXEC);
    }
}

static void close_direct(void) {
    for (uint32_t p = 0; dfds != NULL && p < nparts; p++)
        if (dfds[p] >= 0)
            close(dfds[p]);
    free(dfds);
    dfds = NULL;
}

PyObject *fanstore_py_direct_counts(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    return Py_BuildValue("(KKK)", __atomic_load_n(&direct_reads, __ATOMIC_RELAXED),
                         __atomic_load_n(&direct_bytes, __ATOMIC_RELAXED),
                         __atomic_load_n(&gated_again, __ATOMIC_RELAXED));
}

PyObject *fanstore_py_data_counts(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    unsigned long long c[3];
    fanstore_data_counts(c);
    return Py_BuildValue("(KKK)", c[0], c[1], c[2]);
}

int fanstore_blob_pread(uint64_t blob, uint64_t rel, size_t n, void *buf, int nowait) {
    int fd;
    int64_t at = where(blob, &fd);
    if (at < 0)
        return FANSTORE_BLOB_NOT_HELD;
    if (rel > fanstore_blobs.stored[blob] || n > fanstore_blobs.stored[blob] - rel)
        return FANSTORE_BLOB_IO; /* a caller's mistake: never read past the blob */
    if (nowait && !nowait_ok)
        return FANSTORE_BLOB_AGAIN;
    char *p = buf;
    off_t off = (off_t)(at + (int64_t)rel);
    uint32_t part = fanstore_blobs.part[blob];
    int in_cache = 1;
    if (direct_candidate(blob, rel, n) && (in_cache = fanstore_range_resident(fd, off, n)) == 0) {
        if (nowait) { /* no buffered read: it would start the read-ahead in small folios */
            __atomic_add_fetch(&gated_again, 1, __ATOMIC_RELAXED);
            fanstore_stream_cold(part);
            return FANSTORE_BLOB_AGAIN;
        }
        int r = direct_pread(dfds[part], off, n, buf);
        if (r != FANSTORE_BLOB_AGAIN)
            return r;
        /* O_DIRECT refused here: the buffered read below */
    } else if (in_cache < 0) {
        __atomic_store_n(&direct_ok, 0, __ATOMIC_RELAXED); /* no cachestat: buffered reads */
    }
    while (n > 0) {
        struct iovec v = {p, n};
        ssize_t r = nowait ? preadv2(fd, &v, 1, off, RWF_NOWAIT) : pread(fd, p, n, off);
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0 && nowait && (errno == EAGAIN || errno == EOPNOTSUPP || errno == EINVAL)) {
            if (errno != EAGAIN)
                nowait_ok = 0;
            else
                fanstore_stream_cold(fanstore_blobs.part[blob]);
            return FANSTORE_BLOB_AGAIN;
        }
        if (r <= 0)
            return FANSTORE_BLOB_IO; /* an error, or a partition shorter than the manifest says */
        p += r;
        off += r;
        n -= (size_t)r;
    }
    return FANSTORE_BLOB_OK;
}

/* ------------------------------------------------------------------ Python */

static void release_held(void) {
    fanstore_stream_stop(); /* it reads the descriptors closed below */
    memset(&fanstore_blobs, 0, sizeof(fanstore_blobs)); /* nothing held first */
    fanstore_mapread_forget(); /* no READ maps these partitions from now on */
    close_direct();
    for (uint32_t p = 0; p < nparts; p++)
        if (fds[p] >= 0)
            close(fds[p]);
    free(fds);
    free(dense);
    fds = NULL;
    dense = NULL;
    nparts = 0;
    dense_ids = dense_offs = NULL;
    dense_n = 0;
    if (fanstore_ddict != NULL)
        ZSTD_freeDDict(fanstore_ddict);
    fanstore_ddict = NULL;
    fanstore_tables_drop();
    for (int k = 0; k < NHELD; k++)
        if (held[k].obj != NULL)
            PyBuffer_Release(&held[k]);
}

static int take_fds(PyObject *seq, const Py_buffer *dense_flags) {
    Py_ssize_t np = PySequence_Size(seq);
    if (np < 0)
        return 0;
    if (np != dense_flags->len || np > UINT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "hold_blobs: one fd and one dense flag per partition");
        return 0;
    }
    int *got = malloc((np ? np : 1) * sizeof(int));
    uint8_t *flags = malloc(np ? np : 1);
    if (got == NULL || flags == NULL) {
        free(got);
        free(flags);
        PyErr_NoMemory();
        return 0;
    }
    Py_ssize_t p;
    for (p = 0; p < np; p++) {
        PyObject *o = PySequence_GetItem(seq, p);
        long fd = o ? PyLong_AsLong(o) : -1;
        Py_XDECREF(o);
        if (PyErr_Occurred())
            break;
        got[p] = fd < 0 ? -1 : fcntl((int)fd, F_DUPFD_CLOEXEC, 0);
        if (fd >= 0 && got[p] < 0) {
            PyErr_SetFromErrno(PyExc_OSError);
            break;
        }
        flags[p] = ((const uint8_t *)dense_flags->buf)[p] != 0;
    }
    if (p < np) {
        while (p-- > 0)
            if (got[p] >= 0)
                close(got[p]);
        free(got);
        free(flags);
        return 0;
    }
    fds = got;
    dense = flags;
    nparts = (uint32_t)np;
    open_direct();
    return 1;
}

/* hold_blobs((part, offset, stored, raw, codec, xxh3), n, chunk_size, zdict, fds, dense,
 * dense_ids, dense_offs): the columns C-contiguous buffers of their manifest types with n
 * items at least; zdict bytes (may be empty); fds one per partition (-1: not here; each is
 * duplicated); dense one byte per partition; dense_ids and dense_offs u64 buffers of equal
 * length, ids ascending. Replaces whatever was held. */
PyObject *fanstore_py_hold_blobs(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *cols, *fd_seq, *ids_obj, *offs_obj;
    unsigned long long n, chunk;
    Py_buffer zd, flags;
    if (!PyArg_ParseTuple(args, "O!KKy*Oy*OO", &PyTuple_Type, &cols, &n, &chunk, &zd, &fd_seq,
                          &flags, &ids_obj, &offs_obj))
        return NULL;
    Py_buffer got[NHELD];
    int k = 0;
    if (PyTuple_GET_SIZE(cols) != NCOLS) {
        PyErr_Format(PyExc_ValueError, "hold_blobs: %d columns expected", NCOLS);
        goto fail;
    }
    for (; k < NHELD; k++) {
        PyObject *o = k < NCOLS ? PyTuple_GET_ITEM(cols, k) : (k == DENSE_IDS ? ids_obj : offs_obj);
        if (PyObject_GetBuffer(o, &got[k], PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
            goto fail;
        Py_ssize_t items = got[k].len / (got[k].itemsize ? got[k].itemsize : 1);
        if (got[k].itemsize != col_itemsize[k] || (k < NCOLS && (uint64_t)items < n) ||
            (k == DENSE_OFFS && got[k].len != got[DENSE_IDS].len)) {
            PyBuffer_Release(&got[k]);
            PyErr_Format(PyExc_ValueError, "hold_blobs: buffer %d of unexpected shape", k);
            goto fail;
        }
    }
    ZSTD_DDict *dd = NULL;
    if (zd.len > 0 && (dd = ZSTD_createDDict(zd.buf, (size_t)zd.len)) == NULL) {
        PyErr_SetString(PyExc_ValueError, "hold_blobs: zstd dictionary refused");
        goto fail;
    }
    release_held();
    if (!take_fds(fd_seq, &flags)) {
        if (dd != NULL)
            ZSTD_freeDDict(dd);
        goto fail;
    }
    fanstore_ddict = dd;
    memcpy(held, got, sizeof(held));
    dense_ids = held[DENSE_IDS].buf;
    dense_offs = held[DENSE_OFFS].buf;
    dense_n = (uint64_t)(held[DENSE_IDS].len / 8);
    fanstore_blobs.part = held[PART].buf;
    fanstore_blobs.offset = held[OFFSET].buf;
    fanstore_blobs.stored = held[STORED].buf;
    fanstore_blobs.raw = held[RAW].buf;
    fanstore_blobs.codec = held[CODEC].buf;
    fanstore_blobs.xxh3 = held[XXH3].buf;
    fanstore_blobs.chunk_size = chunk;
    fanstore_blobs.n = n; /* last: everything above is in place */
    fanstore_stream_allow();
    PyBuffer_Release(&zd);
    PyBuffer_Release(&flags);
    Py_RETURN_NONE;
fail:
    while (k-- > 0)
        PyBuffer_Release(&got[k]);
    PyBuffer_Release(&zd);
    PyBuffer_Release(&flags);
    return NULL;
}

PyObject *fanstore_py_drop_blobs(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    release_held();
    Py_RETURN_NONE;
}

static const char *outcome(int r) {
    switch (r) {
    case FANSTORE_BLOB_AGAIN:
        return "not in the page cache";
    case FANSTORE_BLOB_NOT_HELD:
        return "not held here";
    case FANSTORE_BLOB_IO:
        return "read failed or short";
    case FANSTORE_BLOB_CORRUPT:
        return "corrupt (checksum, decode or frame table)";
    case FANSTORE_BLOB_NOMEM:
        return "out of memory";
    default:
        return "unknown";
    }
}

/* blob_read(blob, lo, hi): fanstore_blob_range as bytes (the GIL released while reading);
 * OSError(outcome, text) on anything but OK. */
PyObject *fanstore_py_blob_read(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long blob, lo, hi;
    if (!PyArg_ParseTuple(args, "KKK", &blob, &lo, &hi))
        return NULL;
    struct fanstore_scratch s = {0};
    const char *out = NULL;
    int r;
    Py_BEGIN_ALLOW_THREADS r = fanstore_blob_range(blob, lo, hi, 0, &s, &out);
    Py_END_ALLOW_THREADS PyObject *res =
        r == FANSTORE_BLOB_OK ? PyBytes_FromStringAndSize(out, (Py_ssize_t)(hi - lo)) : NULL;
    if (r != FANSTORE_BLOB_OK)
        PyErr_SetObject(PyExc_OSError, Py_BuildValue("(is)", r, outcome(r)));
    fanstore_scratch_free(&s);
    return res;
}
