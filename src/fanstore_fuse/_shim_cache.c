/* The disk cache of remote blobs (_diskcache.py) read in C (issue 11, part 3).
 *
 * A rank keeps the blobs it fetched from other ranks in LOCAL/cache/seg-NNNNNNNNNNNN.fsc:
 * append-only segment files of entries (the 8-byte little-endian xxh3, HASH_SEED, of the raw
 * bytes, then the raw bytes) and a numpy uint64 index with one slot per dataset blob
 * (segment << 40 | offset; 0 = absent), whose length is the manifest's raw length. Python's
 * writer thread publishes a slot only after the entry's pwritev returned, and never rewrites an
 * entry, so a slot seen here points at bytes already written; the xxh3 catches anything else.
 *
 * hold_cache(index, raw, directory) hands over the index and the raw-length column (buffers
 * held until drop_cache) and the cache directory. Segment files are opened here by name, O_RDONLY,
 * on first use (openat beneath the directory, O_NOFOLLOW) and kept open. Eviction is FIFO by
 * segment number: cache_evicted(number) says every segment up to `number` is gone, so their fds
 * are closed (by the last reader of a pinned one) and a slot naming one is stale, left to Python.
 *
 * fanstore_cache_read never hands out unverified bytes: a short read, an xxh3 mismatch, a
 * missing segment file or an evicted segment give FANSTORE_CACHE_FALLBACK and Python's
 * CachingBlobSource reads the blob (dropping the entry and fetching it again). The index is
 * only read here; Python alone changes it.
 */
#define _GNU_SOURCE
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>
#include <unistd.h>
#define XXH_INLINE_ALL
#include <xxhash.h>

#include "_shim_blobs.h"
#include "_shim_cache.h"

#define HASH_SEED UINT64_C(0x46414E53) /* _format.HASH_SEED */
#define OFF_BITS 40                    /* _diskcache._OFF_BITS */
#define OFF_MASK ((UINT64_C(1) << OFF_BITS) - 1)
#define ENTRY_HEADER 8
#define SLOTS 4096 /* open segment fds, by number % SLOTS */

struct seg {
    uint64_t number; /* 0: free */
    uint64_t gen;    /* the hold_cache it belongs to */
    int fd;
    int dfd; /* the same file with O_DIRECT, or -1; -2: not opened yet (seg_dfd) */
    int pins;
};

static struct {
    pthread_mutex_t lock; /* everything below */
    int on;
    uint64_t n;            /* blobs */
    const uint64_t *index; /* n slots */
    const uint32_t *raw;   /* n raw lengths */
    int dirfd;
    uint64_t gone; /* segments 1..gone are evicted */
    uint64_t gen;  /* bumped by every hold_cache and drop_cache */
    struct seg segs[SLOTS];
} cache = {PTHREAD_MUTEX_INITIALIZER, 0, 0, NULL, NULL, -1, 0, 1, {{0, 0, 0, -1, 0}}};

static Py_buffer index_buf, raw_buf; /* held while .obj != NULL (GIL) */
static unsigned long long hits, hit_bytes, fallbacks, direct_reads, gated;

/* Cold entries read around the page cache, as cold local blobs are (_shim_blobs.c): a buffered
 * read that misses, RWF_NOWAIT ones included, starts the read-ahead in small folios, and a 2 MiB
 * range of a segment holding any of them can no longer take one large folio when the stream
 * (_shim_stream.c) reads the segments in. So an entry of at most fanstore_direct_max() bytes
 * (the digest with it) is first looked up with cachestat: not wholly resident, a nowait read
 * gives AGAIN without any I/O, and the blocking read takes the entry's 4 KiB-aligned span with
 * O_DIRECT. FANSTORE_CACHE_DIRECT=0: buffered reads as before. Counters: `direct_reads`,
 * `gated` (nowait reads refused by the residency check). */
static int direct_knob = -1;

static int cache_direct(void) {
    return fanstore_knob_on("FANSTORE_CACHE_DIRECT", &direct_knob);
}


static void close_slot(struct seg *s) {
    close(s->fd);
    if (s->dfd >= 0)
        close(s->dfd);
    s->number = 0;
    s->fd = s->dfd = -1;
}

/* Whether `s` holds an fd no reader may take any more (evicted, or of an earlier cache). */
static int stale(const struct seg *s) { return s->gen != cache.gen || s->number <= cache.gone; }

/* Segment file `number` of the cache directory `dirfd`, read-only (`flags`: O_DIRECT or 0);
 * -1 when it is not there. */
static int open_segment(int dirfd, uint64_t number, int flags) {
    char name[40];
    snprintf(name, sizeof(name), "seg-%012llu.fsc", (unsigned long long)number);
    return openat(dirfd, name, O_RDONLY | O_NOFOLLOW | O_CLOEXEC | flags);
}

/* The pinned segment `number`, opened if need be; NULL when evicted or unopenable. Locked. */
static struct seg *pin(uint64_t number) {
    if (number <= cache.gone || cache.dirfd < 0)
        return NULL;
    struct seg *s = &cache.segs[number % SLOTS];
    if (s->number != number || s->gen != cache.gen) {
        if (s->number != 0) {
            if (s->pins) /* another live segment in this slot, being read: let Python read */
                return NULL;
            close_slot(s);
        }
        int fd = open_segment(cache.dirfd, number, 0);
        if (fd < 0)
            return NULL;
        s->number = number;
        s->gen = cache.gen;
        s->fd = fd;
        s->dfd = -2;
        s->pins = 0;
    }
    s->pins++;
    return s;
}

static void unpin(struct seg *s) {
    pthread_mutex_lock(&cache.lock);
    if (--s->pins == 0 && stale(s))
        close_slot(s);
    pthread_mutex_unlock(&cache.lock);
}

static inline uint64_t slot_of(uint64_t blob) {
    return __atomic_load_n(&cache.index[blob], __ATOMIC_ACQUIRE);
}

int fanstore_cache_lookup(uint64_t blob, uint32_t *raw) {
    int found = 0;
    pthread_mutex_lock(&cache.lock);
    if (cache.on && blob < cache.n && slot_of(blob)) {
        *raw = cache.raw[blob];
        found = 1;
    }
    pthread_mutex_unlock(&cache.lock);
    return found;
}

/* The pinned segment's O_DIRECT descriptor, opened on its first cold small entry (segments of
 * large entries never need one); -1 where O_DIRECT cannot be had. */
static int seg_dfd(struct seg *s) {
    pthread_mutex_lock(&cache.lock);
    if (s->dfd == -2)
        s->dfd = open_segment(cache.dirfd, s->number, O_DIRECT);
    int dfd = s->dfd;
    pthread_mutex_unlock(&cache.lock);
    return dfd;
}

/* An entry's digest: its first 8 bytes, little-endian. */
static uint64_t digest_of(const char *p) {
    uint64_t want = 0;
    for (int k = ENTRY_HEADER - 1; k >= 0; k--)
        want = want << 8 | (unsigned char)p[k];
    return want;
}

/* HIT when the `len` bytes at `from` have the digest `want` (then copied to `buf` when `copy`),
 * else FALLBACK: nothing unverified is handed out. */
static int check(uint64_t want, const char *from, char *buf, uint32_t len, int copy) {
    if (fanstore_checksum(from, len) != want) {
        __atomic_add_fetch(&fallbacks, 1, __ATOMIC_RELAXED);
        return FANSTORE_CACHE_FALLBACK;
    }
    if (copy)
        memcpy(buf, from, len);
    __atomic_add_fetch(&hits, 1, __ATOMIC_RELAXED);
    __atomic_add_fetch(&hit_bytes, len, __ATOMIC_RELAXED);
    return FANSTORE_CACHE_HIT;
}

int fanstore_cache_read(uint64_t blob, char *buf, size_t cap, uint32_t *raw, int nowait) {
    pthread_mutex_lock(&cache.lock);
    uint64_t loc = cache.on && blob < cache.n ? slot_of(blob) : 0;
    if (!loc) {
        pthread_mutex_unlock(&cache.lock);
        return FANSTORE_CACHE_MISS;
    }
    uint32_t len = *raw = cache.raw[blob];
    struct seg *s = len <= cap ? pin(loc >> OFF_BITS) : NULL;
    pthread_mutex_unlock(&cache.lock);
    if (s == NULL) {
        __atomic_add_fetch(&fallbacks, 1, __ATOMIC_RELAXED);
        return FANSTORE_CACHE_FALLBACK;
    }
    unsigned char digest[ENTRY_HEADER];
    off_t at = (off_t)(loc & OFF_MASK);
    size_t whole = ENTRY_HEADER + (size_t)len;
    int resident = 1, dfd = -1;
    if (whole <= fanstore_direct_max() && cache_direct() &&
        (resident = fanstore_range_resident(s->fd, at, whole)) == 0 && (dfd = seg_dfd(s)) >= 0) {
        if (nowait) { /* no buffered read: it would start the read-ahead in small folios */
            unpin(s);
            __atomic_add_fetch(&gated, 1, __ATOMIC_RELAXED);
            fanstore_stream_cold(FANSTORE_STREAM_CACHE);
            return FANSTORE_CACHE_AGAIN;
        }
        int status;
        const char *p = fanstore_direct_span(dfd, at, whole, &status);
        unpin(s);
        if (p != NULL) {
            __atomic_add_fetch(&direct_reads, 1, __ATOMIC_RELAXED);
            return check(digest_of(p), p + ENTRY_HEADER, buf, len, 1);
        }
        if (status != FANSTORE_BLOB_AGAIN) {
            __atomic_add_fetch(&fallbacks, 1, __ATOMIC_RELAXED);
            return FANSTORE_CACHE_FALLBACK; /* Python reads it */
        }
        return fanstore_cache_read(blob, buf, cap, raw, nowait); /* O_DIRECT refused: buffered */
    }
    if (resident < 0)
        fanstore_direct_refused(); /* no cachestat here: buffered reads from now on */
    struct iovec iov[2] = {{digest, ENTRY_HEADER}, {buf, len}};
    ssize_t got = preadv2(s->fd, iov, 2, at, nowait ? RWF_NOWAIT : 0);
    int again = got < 0 && (errno == EAGAIN || errno == EOPNOTSUPP); /* or no RWF_NOWAIT here */
    int cold = got >= 0 || errno == EAGAIN;
    unpin(s);
    if (nowait && (again || (got > 0 && got < (ssize_t)len + ENTRY_HEADER))) {
        if (cold) /* (not where RWF_NOWAIT is unsupported) */
            fanstore_stream_cold(FANSTORE_STREAM_CACHE);
        return FANSTORE_CACHE_AGAIN; /* (partly) not in the page cache: the disk is needed */
    }
    if (got != (ssize_t)len + ENTRY_HEADER) {
        __atomic_add_fetch(&fallbacks, 1, __ATOMIC_RELAXED);
        return FANSTORE_CACHE_FALLBACK;
    }
    return check(digest_of((const char *)digest), buf, buf, len, 0);
}

int fanstore_cache_range(uint64_t blob, uint64_t lo, uint64_t hi, int nowait, char **buf,
                         size_t *cap, const char **out, size_t *n) {
    uint32_t raw;
    if (!fanstore_cache_lookup(blob, &raw))
        return FANSTORE_CACHE_MISS;
    if (*cap < raw || *buf == NULL) {
        char *grown = fanstore_data_alloc(raw); /* nothing to keep: read afresh below */
        if (grown == NULL)
            return FANSTORE_CACHE_FALLBACK;
        free(*buf);
        *buf = grown;
        *cap = raw ? raw : 1;
    }
    int r = fanstore_cache_read(blob, *buf, *cap, &raw, nowait);
    if (r == FANSTORE_CACHE_HIT) {
        hi = hi < raw ? hi : raw;
        lo = lo < hi ? lo : hi;
        *out = *buf + lo;
        *n = (size_t)(hi - lo);
    }
    return r;
}

int fanstore_cache_ok(uint64_t blob, uint32_t whole_max) {
    uint32_t raw;
    return fanstore_cache_lookup(blob, &raw) && raw <= whole_max;
}

int fanstore_cache_blob_range(uint64_t blob, uint64_t lo, uint64_t hi, int nowait,
                              struct fanstore_scratch *s, const char **out) {
    if (fanstore_blob_held(blob))
        return fanstore_blob_range(blob, lo, hi, nowait, s, out);
    s->have = 0; /* s->raw is about to hold this entry: no longer the blob `have` names */
    fanstore_scratch_release(s);
    size_t n;
    switch (fanstore_cache_range(blob, lo, hi, nowait, &s->raw, &s->raw_cap, out, &n)) {
    case FANSTORE_CACHE_HIT:
        return n == hi - lo ? FANSTORE_BLOB_OK : FANSTORE_BLOB_CORRUPT;
    case FANSTORE_CACHE_AGAIN:
        return FANSTORE_BLOB_AGAIN;
    case FANSTORE_CACHE_MISS:
        return FANSTORE_BLOB_NOT_HELD;
    default:
        return FANSTORE_BLOB_CORRUPT;
    }
}

int fanstore_cache_segment_fds(int *fds, int max) {
    pthread_mutex_lock(&cache.lock);
    int dirfd = cache.on && cache.dirfd >= 0 ? fcntl(cache.dirfd, F_DUPFD_CLOEXEC, 0) : -1;
    uint64_t number = cache.gone + 1;
    pthread_mutex_unlock(&cache.lock);
    if (dirfd < 0)
        return 0;
    int n = 0, misses = 0;
    /* the oldest may be unlinked before Python says so (cache_evicted): look a little further */
    for (; n < max && misses < 64; number++) {
        int fd = open_segment(dirfd, number, 0);
        if (fd >= 0)
            fds[n++] = fd;
        else if (n > 0)
            break; /* past the newest */
        else
            misses++;
    }
    close(dirfd);
    return n;
}

/* Every fd closed, reads off, buffers released. Under the GIL. */
static void drop(void) {
    pthread_mutex_lock(&cache.lock);
    cache.on = 0;
    cache.n = 0;
    cache.index = NULL;
    cache.raw = NULL;
    cache.gen++; /* a pinned segment is closed by its reader (stale) */
    for (int k = 0; k < SLOTS; k++)
        if (cache.segs[k].number && !cache.segs[k].pins)
            close_slot(&cache.segs[k]);
    if (cache.dirfd >= 0)
        close(cache.dirfd);
    cache.dirfd = -1;
    pthread_mutex_unlock(&cache.lock);
    if (index_buf.obj != NULL)
        PyBuffer_Release(&index_buf);
    if (raw_buf.obj != NULL)
        PyBuffer_Release(&raw_buf);
}

/* hold_cache(index, raw, directory): `index` a C-contiguous buffer of n native uint64 slots,
 * `raw` one of n native uint32 lengths, `directory` the cache's (str or bytes path). */
PyObject *fanstore_py_hold_cache(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *index, *raw, *path;
    if (!PyArg_ParseTuple(args, "OOO&", &index, &raw, PyUnicode_FSConverter, &path))
        return NULL;
    Py_buffer ib, rb;
    if (PyObject_GetBuffer(index, &ib, PyBUF_C_CONTIGUOUS) < 0) {
        Py_DECREF(path);
        return NULL;
    }
    if (PyObject_GetBuffer(raw, &rb, PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&ib);
        Py_DECREF(path);
        return NULL;
    }
    uint64_t n = (uint64_t)ib.len / 8;
    const char *why = NULL;
    if (ib.itemsize != 8 || rb.itemsize != 4 || (uint64_t)rb.len != n * 4)
        why = "hold_cache: index must hold uint64 slots and raw as many uint32 lengths";
    else if (((uintptr_t)ib.buf & 7) || ((uintptr_t)rb.buf & 3))
        why = "hold_cache: misaligned buffers";
    int dirfd = -1;
    if (why == NULL) {
        dirfd = open(PyBytes_AS_STRING(path), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
        if (dirfd < 0) {
            PyErr_SetFromErrnoWithFilenameObject(PyExc_OSError, path);
            why = "";
        }
    }
    Py_DECREF(path);
    if (why != NULL) {
        if (*why)
            PyErr_SetString(PyExc_ValueError, why);
        PyBuffer_Release(&ib);
        PyBuffer_Release(&rb);
        return NULL;
    }
    drop();
    index_buf = ib;
    raw_buf = rb;
    pthread_mutex_lock(&cache.lock);
    cache.index = ib.buf;
    cache.raw = rb.buf;
    cache.n = n;
    cache.dirfd = dirfd;
    cache.gone = 0;
    cache.on = 1;
    pthread_mutex_unlock(&cache.lock);
    Py_RETURN_NONE;
}

PyObject *fanstore_py_cache_evicted(PyObject *self, PyObject *arg) {
    (void)self;
    unsigned long long number = PyLong_AsUnsignedLongLong(arg);
    if (number == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    pthread_mutex_lock(&cache.lock);
    if (number > cache.gone) {
        for (int k = 0; k < SLOTS; k++) { /* pinned ones are closed by their reader */
            struct seg *s = &cache.segs[k];
            if (s->number && s->number <= number && s->gen == cache.gen && !s->pins)
                close_slot(s);
        }
        cache.gone = number;
    }
    pthread_mutex_unlock(&cache.lock);
    Py_RETURN_NONE;
}

PyObject *fanstore_py_drop_cache(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    drop();
    Py_RETURN_NONE;
}

PyObject *fanstore_py_cache_counts(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    return Py_BuildValue("(KKKKK)", __atomic_load_n(&hits, __ATOMIC_RELAXED),
                         __atomic_load_n(&hit_bytes, __ATOMIC_RELAXED),
                         __atomic_load_n(&fallbacks, __ATOMIC_RELAXED),
                         __atomic_load_n(&direct_reads, __ATOMIC_RELAXED),
                         __atomic_load_n(&gated, __ATOMIC_RELAXED));
}

/* cache_read(blob, lo=0, hi=2**64-1, nowait=False): what the READ path gets, for tests:
 * the bytes, or FANSTORE_CACHE_MISS / _FALLBACK / _AGAIN. */
PyObject *fanstore_py_cache_read(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long blob, lo = 0, hi = UINT64_MAX;
    int nowait = 0;
    if (!PyArg_ParseTuple(args, "K|KKp", &blob, &lo, &hi, &nowait))
        return NULL;
    char *buf = NULL;
    size_t cap = 0, n = 0;
    const char *out = NULL;
    int r;
    Py_BEGIN_ALLOW_THREADS
    r = fanstore_cache_range(blob, lo, hi, nowait, &buf, &cap, &out, &n);
    Py_END_ALLOW_THREADS
    PyObject *res = r == FANSTORE_CACHE_HIT ? PyBytes_FromStringAndSize(out, (Py_ssize_t)n)
                                            : PyLong_FromLong(r);
    free(buf);
    return res;
}
