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
 * before decoding, and no output buffer is ever larger than the raw size.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>
#include <unistd.h>
#define XXH_INLINE_ALL
#include <xxhash.h>
#define ZSTD_STATIC_LINKING_ONLY /* ZSTD_getFrameContentSize's constants */
#include <zstd.h>

#include "_shim_blobs.h"

#define TABLE_PROBE 4096 /* first read of a frame table (_blobstore._TABLE_PROBE) */
#define TABLE_SLOTS 4096 /* verified tables kept (_blobstore.MAX_TABLES), direct-mapped */
#define MIN_FRAME 4096   /* _blobcodec.MIN_FRAME */
#define HEAD 8           /* u32 frame_size, u32 count */
#define ENTRY 12         /* u32 word, u64 xxh3 */

struct fanstore_blobs fanstore_blobs;

enum { PART, OFFSET, STORED, RAW, CODEC, XXH3, NCOLS, DENSE_IDS = NCOLS, DENSE_OFFS, NHELD };
static const Py_ssize_t col_itemsize[NHELD] = {4, 8, 4, 4, 1, 8, 8, 8};
static Py_buffer held[NHELD]; /* held[k].obj != NULL while held */

static int *fds;          /* per partition: a descriptor of the local copy, or -1 */
static uint8_t *dense;    /* per partition: 1 when the local copy is dense */
static uint32_t nparts;
static const uint64_t *dense_ids, *dense_offs;
static uint64_t dense_n;
static ZSTD_DDict *ddict; /* codec 2; NULL without a dictionary */
static int nowait_ok = 1; /* cleared for good when the file system refuses RWF_NOWAIT */

uint64_t fanstore_checksum(const void *p, size_t n) {
    return XXH3_64bits_withSeed(p, n, FANSTORE_HASH_SEED);
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

int fanstore_blob_held(uint64_t blob) {
    int fd;
    return where(blob, &fd) >= 0;
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
    while (n > 0) {
        struct iovec v = {p, n};
        ssize_t r = nowait ? preadv2(fd, &v, 1, off, RWF_NOWAIT) : pread(fd, p, n, off);
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0 && nowait && (errno == EAGAIN || errno == EOPNOTSUPP || errno == EINVAL)) {
            if (errno != EAGAIN)
                nowait_ok = 0;
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

/* ------------------------------------------------------------------ decoding */

static pthread_key_t dctx_key;
static pthread_once_t dctx_once = PTHREAD_ONCE_INIT;

static void free_dctx(void *d) { ZSTD_freeDCtx(d); }
static void make_key(void) { pthread_key_create(&dctx_key, free_dctx); }

static ZSTD_DCtx *thread_dctx(void) { /* one per thread, made once (~100 us each) */
    pthread_once(&dctx_once, make_key);
    ZSTD_DCtx *d = pthread_getspecific(dctx_key);
    if (d == NULL && (d = ZSTD_createDCtx()) != NULL)
        pthread_setspecific(dctx_key, d);
    return d;
}

/* One zstd frame of `n` stored bytes into exactly `raw` bytes at `dst`. `exact`: the frame
 * must state that size (frames of codec 3), else it may omit it but not exceed it. */
static int unzstd(const void *src, size_t n, void *dst, size_t raw, int with_dict, int exact) {
    unsigned long long claimed = ZSTD_getFrameContentSize(src, n);
    if (claimed == ZSTD_CONTENTSIZE_ERROR)
        return FANSTORE_BLOB_CORRUPT;
    if (exact ? claimed != raw : (claimed != ZSTD_CONTENTSIZE_UNKNOWN && claimed > raw))
        return FANSTORE_BLOB_CORRUPT; /* a bomb, or not this blob: refused before decoding */
    if (with_dict && ddict == NULL)
        return FANSTORE_BLOB_CORRUPT;
    ZSTD_DCtx *d = thread_dctx();
    if (d == NULL)
        return FANSTORE_BLOB_NOMEM;
    size_t r = with_dict ? ZSTD_decompress_usingDDict(d, dst, raw, src, n, ddict)
                         : ZSTD_decompressDCtx(d, dst, raw, src, n);
    return ZSTD_isError(r) || r != raw ? FANSTORE_BLOB_CORRUPT : FANSTORE_BLOB_OK;
}

int fanstore_frames_raw(const struct fanstore_ftable *t, uint32_t k0, uint32_t k1) {
    for (uint32_t k = k0; k <= k1; k++)
        if (t->zstd[k])
            return 0;
    return 1;
}

int fanstore_frames_decode(const struct fanstore_ftable *t, uint32_t k0, uint32_t k1,
                           const void *span, void *out) {
    const char *base = (const char *)span - t->offsets[k0];
    for (uint32_t k = k0; k <= k1; k++) {
        const char *src = base + t->offsets[k];
        size_t n = t->offsets[k + 1] - t->offsets[k];
        uint32_t rlen = fanstore_frame_raw_size(t, k);
        const char *raw = src;
        if (t->zstd[k]) {
            if (out == NULL)
                return FANSTORE_BLOB_CORRUPT; /* the caller's mistake; never unchecked bytes */
            char *dst = (char *)out + (size_t)(k - k0) * t->frame_size;
            int r = unzstd(src, n, dst, rlen, 0, 1);
            if (r != FANSTORE_BLOB_OK)
                return r;
            raw = dst;
        } else if (n != rlen) {
            return FANSTORE_BLOB_CORRUPT; /* cannot happen with a parsed table */
        }
        if (fanstore_checksum(raw, rlen) != t->digests[k])
            return FANSTORE_BLOB_CORRUPT;
        if (!t->zstd[k] && out != NULL)
            memcpy((char *)out + (size_t)(k - k0) * t->frame_size, src, rlen);
    }
    return FANSTORE_BLOB_OK;
}

/* ------------------------------------------------------------------ frame tables */

static void table_free(struct fanstore_ftable *t) {
    free(t->offsets);
    free(t->zstd);
    free(t->digests);
    free(t);
}

static uint32_t get_u32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4); /* little-endian on every platform libfuse serves us here */
    return v;
}

/* The table's length from its first 8 bytes (bounded by the blob), or 0 when it cannot fit. */
static uint64_t table_len(const uint8_t *head, size_t len, uint64_t stored_len) {
    if (len < HEAD || stored_len < HEAD)
        return 0;
    uint64_t need = HEAD + (uint64_t)ENTRY * get_u32(head + 4);
    return need > stored_len ? 0 : need;
}

int fanstore_table_parse(const void *buf, size_t len, uint64_t stored_len, uint64_t raw_len,
                         uint64_t digest, struct fanstore_ftable **out) {
    const uint8_t *p = buf;
    uint64_t need = table_len(p, len, stored_len);
    if (need == 0 || len < need || fanstore_checksum(p, need) != digest)
        return FANSTORE_BLOB_CORRUPT;
    uint32_t size = get_u32(p), n = get_u32(p + 4);
    if (size < MIN_FRAME || n != (raw_len + size - 1) / size || (raw_len && !n))
        return FANSTORE_BLOB_CORRUPT;
    struct fanstore_ftable *t = calloc(1, sizeof(*t));
    if (t == NULL)
        return FANSTORE_BLOB_NOMEM;
    t->offsets = malloc(((size_t)n + 1) * sizeof(uint64_t));
    t->zstd = malloc(n ? n : 1);
    t->digests = malloc((n ? n : 1) * sizeof(uint64_t));
    if (t->offsets == NULL || t->zstd == NULL || t->digests == NULL) {
        table_free(t);
        return FANSTORE_BLOB_NOMEM;
    }
    t->frame_size = size;
    t->count = n;
    t->raw_len = raw_len;
    t->refs = 1;
    t->offsets[0] = need;
    for (uint32_t k = 0; k < n; k++) {
        const uint8_t *e = p + HEAD + (size_t)k * ENTRY;
        uint32_t word = get_u32(e), length = word & ~FANSTORE_ZSTD_BIT;
        int packed = (word & FANSTORE_ZSTD_BIT) != 0;
        uint64_t rlen = raw_len - (uint64_t)k * size < size ? raw_len - (uint64_t)k * size : size;
        if ((!packed && length != rlen) || (packed && length == 0)) {
            table_free(t);
            return FANSTORE_BLOB_CORRUPT;
        }
        t->offsets[k + 1] = t->offsets[k] + length;
        t->zstd[k] = (uint8_t)packed;
        memcpy(&t->digests[k], e + 4, 8);
    }
    if (t->offsets[n] != stored_len) {
        table_free(t);
        return FANSTORE_BLOB_CORRUPT;
    }
    *out = t;
    return FANSTORE_BLOB_OK;
}

static pthread_mutex_t table_lock = PTHREAD_MUTEX_INITIALIZER;
static struct fanstore_ftable *tables[TABLE_SLOTS];

void fanstore_table_put(const struct fanstore_ftable *ct) {
    struct fanstore_ftable *t = (struct fanstore_ftable *)ct;
    pthread_mutex_lock(&table_lock);
    int last = --t->refs == 0;
    pthread_mutex_unlock(&table_lock);
    if (last)
        table_free(t);
}

static void drop_tables(void) {
    for (int i = 0; i < TABLE_SLOTS; i++) {
        struct fanstore_ftable *t = tables[i];
        tables[i] = NULL;
        if (t != NULL)
            fanstore_table_put(t);
    }
}

int fanstore_table_get(uint64_t blob, int nowait, const struct fanstore_ftable **out) {
    const struct fanstore_blobs *b = &fanstore_blobs;
    if (blob >= b->n || b->codec[blob] != FANSTORE_CODEC_FRAMED)
        return FANSTORE_BLOB_CORRUPT;
    struct fanstore_ftable **slot = &tables[blob % TABLE_SLOTS];
    pthread_mutex_lock(&table_lock);
    struct fanstore_ftable *t = *slot;
    if (t != NULL && t->blob == blob) {
        t->refs++;
        pthread_mutex_unlock(&table_lock);
        *out = t;
        return FANSTORE_BLOB_OK;
    }
    pthread_mutex_unlock(&table_lock);
    uint64_t stored = b->stored[blob];
    uint8_t probe[TABLE_PROBE];
    size_t first = stored < TABLE_PROBE ? stored : TABLE_PROBE;
    int r = fanstore_blob_pread(blob, 0, first, probe, nowait);
    if (r != FANSTORE_BLOB_OK)
        return r;
    uint64_t need = table_len(probe, first, stored);
    if (need == 0)
        return FANSTORE_BLOB_CORRUPT;
    uint8_t *head = probe;
    if (need > first) { /* a table of more than 340 frames */
        if ((head = malloc(need)) == NULL)
            return FANSTORE_BLOB_NOMEM;
        if ((r = fanstore_blob_pread(blob, 0, need, head, nowait)) != FANSTORE_BLOB_OK) {
            free(head);
            return r;
        }
    }
    r = fanstore_table_parse(head, need, stored, b->raw[blob], b->xxh3[blob], &t);
    if (head != probe)
        free(head);
    if (r != FANSTORE_BLOB_OK)
        return r;
    t->blob = blob;
    t->refs = 2; /* the cache's and the caller's */
    pthread_mutex_lock(&table_lock);
    struct fanstore_ftable *old = *slot;
    *slot = t;
    pthread_mutex_unlock(&table_lock);
    if (old != NULL)
        fanstore_table_put(old);
    *out = t;
    return FANSTORE_BLOB_OK;
}

/* ------------------------------------------------------------------ whole blobs, ranges */

int fanstore_blob_decode(uint64_t blob, const void *stored, void *out) {
    const struct fanstore_blobs *b = &fanstore_blobs;
    if (blob >= b->n)
        return FANSTORE_BLOB_NOT_HELD;
    uint32_t n = b->stored[blob], raw = b->raw[blob];
    int r;
    switch (b->codec[blob]) {
    case FANSTORE_CODEC_RAW:
        if (n != raw || fanstore_checksum(stored, n) != b->xxh3[blob])
            return FANSTORE_BLOB_CORRUPT;
        if (out != stored)
            memcpy(out, stored, n);
        return FANSTORE_BLOB_OK;
    case FANSTORE_CODEC_ZSTD:
    case FANSTORE_CODEC_ZSTD_DICT:
        r = unzstd(stored, n, out, raw, b->codec[blob] == FANSTORE_CODEC_ZSTD_DICT, 0);
        if (r == FANSTORE_BLOB_OK && fanstore_checksum(out, raw) != b->xxh3[blob])
            r = FANSTORE_BLOB_CORRUPT;
        return r;
    case FANSTORE_CODEC_FRAMED: {
        struct fanstore_ftable *t;
        if ((r = fanstore_table_parse(stored, n, n, raw, b->xxh3[blob], &t)) != FANSTORE_BLOB_OK)
            return r;
        if (t->count > 0)
            r = fanstore_frames_decode(t, 0, t->count - 1, (const char *)stored + t->offsets[0],
                                       out);
        fanstore_table_put(t);
        return r;
    }
    default:
        return FANSTORE_BLOB_CORRUPT;
    }
}

static int grow(char **p, size_t *cap, size_t n) {
    if (*cap >= n)
        return 1;
    size_t c = n < 65536 ? 65536 : n;
    char *q = malloc(c);
    if (q == NULL)
        return 0;
    free(*p);
    *p = q;
    *cap = c;
    return 1;
}

void fanstore_scratch_free(struct fanstore_scratch *s) {
    free(s->stored);
    free(s->raw);
    memset(s, 0, sizeof(*s));
}

static int framed_range(uint64_t blob, uint64_t lo, uint64_t hi, int nowait,
                        struct fanstore_scratch *s, const char **out) {
    const struct fanstore_ftable *t;
    int r = fanstore_table_get(blob, nowait, &t);
    if (r != FANSTORE_BLOB_OK)
        return r;
    s->have = 0;
    uint32_t k0 = (uint32_t)(lo / t->frame_size), k1 = (uint32_t)((hi - 1) / t->frame_size);
    uint64_t rel = t->offsets[k0], n = t->offsets[k1 + 1] - rel;
    int raw = fanstore_frames_raw(t, k0, k1);
    uint64_t first_raw = (uint64_t)k0 * t->frame_size;
    if (!grow(&s->stored, &s->stored_cap, n) ||
        (!raw && !grow(&s->raw, &s->raw_cap, (size_t)(k1 - k0 + 1) * t->frame_size)))
        r = FANSTORE_BLOB_NOMEM;
    else if ((r = fanstore_blob_pread(blob, rel, n, s->stored, nowait)) == FANSTORE_BLOB_OK &&
             (r = fanstore_frames_decode(t, k0, k1, s->stored, raw ? NULL : s->raw)) ==
                 FANSTORE_BLOB_OK)
        *out = (raw ? s->stored : s->raw) + (lo - first_raw);
    fanstore_table_put(t);
    return r;
}

int fanstore_blob_range(uint64_t blob, uint64_t lo, uint64_t hi, int nowait,
                        struct fanstore_scratch *s, const char **out) {
    const struct fanstore_blobs *b = &fanstore_blobs;
    if (!fanstore_blob_held(blob))
        return FANSTORE_BLOB_NOT_HELD;
    if (lo >= hi || hi > b->raw[blob])
        return FANSTORE_BLOB_IO;
    if (b->codec[blob] == FANSTORE_CODEC_FRAMED)
        return framed_range(blob, lo, hi, nowait, s, out);
    uint32_t n = b->stored[blob];
    int raw = b->codec[blob] == FANSTORE_CODEC_RAW;
    if (s->have == blob + 1) { /* decoded and verified by this thread's previous read */
        *out = (raw ? s->stored : s->raw) + lo;
        return FANSTORE_BLOB_OK;
    }
    s->have = 0;
    if (!grow(&s->stored, &s->stored_cap, n) || (!raw && !grow(&s->raw, &s->raw_cap, b->raw[blob])))
        return FANSTORE_BLOB_NOMEM;
    int r = fanstore_blob_pread(blob, 0, n, s->stored, nowait);
    if (r == FANSTORE_BLOB_OK && (r = fanstore_blob_decode(blob, s->stored, raw ? s->stored : s->raw)) ==
                                     FANSTORE_BLOB_OK) {
        *out = (raw ? s->stored : s->raw) + lo;
        s->have = blob + 1;
    }
    return r;
}

/* ------------------------------------------------------------------ Python */

static void release_held(void) {
    memset(&fanstore_blobs, 0, sizeof(fanstore_blobs)); /* nothing held first */
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
    if (ddict != NULL)
        ZSTD_freeDDict(ddict);
    ddict = NULL;
    drop_tables();
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
    ddict = dd;
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
