/* Decoding and checking blobs in C (issue 11): zstd (a context per thread, the manifest's
 * dictionary for codec 2), framed blobs (codec 3: tables checked against the manifest and kept
 * in a direct-mapped cache, frames decoded and checked), whole blobs and byte ranges of held
 * blobs. The interface and its rules are in _shim_blobs.h; the held columns and the local
 * copies are _shim_blobs.c's.
 */
#include <malloc.h>
#include <sys/mman.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#define ZSTD_STATIC_LINKING_ONLY /* ZSTD_getFrameContentSize's constants */
#include <zstd.h>

#include "_shim_blobs.h"

#define TABLE_PROBE 4096 /* first read of a frame table (_blobstore._TABLE_PROBE) */
#define TABLE_SLOTS 4096 /* verified tables kept (_blobstore.MAX_TABLES), direct-mapped */
#define MIN_FRAME 4096   /* _blobcodec.MIN_FRAME */
#define HEAD 8           /* u32 frame_size, u32 count */
#define ENTRY 12         /* u32 word, u64 xxh3 */

extern ZSTD_DDict *fanstore_ddict; /* _shim_blobs.c: codec 2's, or NULL */

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
    if (with_dict && fanstore_ddict == NULL)
        return FANSTORE_BLOB_CORRUPT;
    ZSTD_DCtx *d = thread_dctx();
    if (d == NULL)
        return FANSTORE_BLOB_NOMEM;
    size_t r = with_dict ? ZSTD_decompress_usingDDict(d, dst, raw, src, n, fanstore_ddict)
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

void fanstore_tables_drop(void) {
    fanstore_fcache_clear(); /* frames are keyed by blob id: another dataset may come */
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

/* Large blocks come back through fanstore_data_free into a small pool, taken again before any
 * new one: a block of MiBs malloc hands out afresh is often fresh pages (a thread's arena lets
 * a heap that empties go back to the kernel), and the first write of each page is a fault and a
 * zeroing, 15% of the remote thread's time when a 4 MiB reply is received into it (`perf`,
 * twentieth session). At most POOL_SLOTS blocks, POOL_BYTES in all, are kept. */
#define POOL_MIN (1u << 20)
#define POOL_SLOTS 8
#define POOL_BYTES (40u << 20)
static pthread_mutex_t pool_lock = PTHREAD_MUTEX_INITIALIZER;
static void *pool[POOL_SLOTS];
static int npool;
static size_t pooled; /* usable bytes of the blocks in the pool */
static int pool_slots = -1; /* FANSTORE_DATA_POOL: blocks kept (0: none), for A/B */

static int slots(void) {
    int n = __atomic_load_n(&pool_slots, __ATOMIC_RELAXED);
    if (n < 0) {
        const char *knob = getenv("FANSTORE_DATA_POOL");
        n = knob != NULL && *knob != '\0' ? atoi(knob) : POOL_SLOTS;
        n = n < 0 ? 0 : n > POOL_SLOTS ? POOL_SLOTS : n;
        __atomic_store_n(&pool_slots, n, __ATOMIC_RELAXED);
    }
    return n;
}

/* A new block of 2 MiB or more is 2 MiB aligned and its whole 2 MiB pages advised MADV_HUGEPAGE
 * (THP in "madvise" mode, as on these VMs): its first writes then fault 2 MiB at a time instead
 * of 4 KiB. On a fresh mount every 4 MiB reply the remote thread receives lands in such a block
 * until the pool holds POOL_SLOTS of them: 1,024 faults of 4 KiB each were 39% of the remote
 * thread's samples over the first 100 MB read on the Slurm cluster (`perf`, twenty-ninth
 * session). FANSTORE_DATA_HUGE=0 turns it off, for A/B. */
#define HUGE_PAGE (2u << 20)
static int huge_knob = -1;
static unsigned long long data_fresh, data_huge, data_pooled; /* data_counts() */

int fanstore_knob_on(const char *name, int *cached) {
    int on = __atomic_load_n(cached, __ATOMIC_RELAXED);
    if (on < 0) {
        const char *knob = getenv(name);
        on = !(knob != NULL && strcmp(knob, "0") == 0);
        __atomic_store_n(cached, on, __ATOMIC_RELAXED);
    }
    return on;
}

static int huge_blocks(void) {
    return fanstore_knob_on("FANSTORE_DATA_HUGE", &huge_knob);
}

void *fanstore_data_alloc(size_t n) {
    if (n >= POOL_MIN) {
        void *p = NULL;
        pthread_mutex_lock(&pool_lock);
        for (int i = npool - 1; i >= 0 && p == NULL; i--) /* the last one kept: cache-warm */
            if (malloc_usable_size(pool[i]) >= n) {
                p = pool[i];
                pooled -= malloc_usable_size(p);
                pool[i] = pool[--npool];
            }
        pthread_mutex_unlock(&pool_lock);
        if (p != NULL) {
            __atomic_add_fetch(&data_pooled, 1, __ATOMIC_RELAXED);
            return p;
        }
        __atomic_add_fetch(&data_fresh, 1, __ATOMIC_RELAXED);
    }
    void *p = NULL;
    if (n >= HUGE_PAGE && huge_blocks()) {
        if (posix_memalign(&p, HUGE_PAGE, n) != 0)
            return NULL;
        if (madvise(p, n & ~(size_t)(HUGE_PAGE - 1), MADV_HUGEPAGE) == 0) /* EINVAL: no THP */
            __atomic_add_fetch(&data_huge, 1, __ATOMIC_RELAXED);
        return p;
    }
    return posix_memalign(&p, 64, n ? n : 1) == 0 ? p : NULL;
}

void fanstore_data_free(void *p) {
    size_t n = p != NULL ? malloc_usable_size(p) : 0;
    if ((uintptr_t)p % 64 == 0 && n >= POOL_MIN) {
        pthread_mutex_lock(&pool_lock);
        int kept = npool < slots() && pooled + n <= POOL_BYTES;
        if (kept) {
            pool[npool++] = p;
            pooled += n;
        }
        pthread_mutex_unlock(&pool_lock);
        if (kept)
            return;
    }
    free(p);
}

static int grow(char **p, size_t *cap, size_t n) {
    if (*cap >= n)
        return 1;
    size_t c = n < 65536 ? 65536 : n;
    char *q = fanstore_data_alloc(c);
    if (q == NULL)
        return 0;
    free(*p);
    *p = q;
    *cap = c;
    return 1;
}

void fanstore_scratch_release(struct fanstore_scratch *s) {
    fanstore_fcache_put(s->frame);
    s->frame = NULL;
}

void fanstore_scratch_free(struct fanstore_scratch *s) {
    fanstore_scratch_release(s);
    free(s->stored);
    free(s->raw);
    memset(s, 0, sizeof(*s));
}

/* Bytes lo..hi of frame k (not all of it) through the frame cache: a kept frame, or the frame
 * read, decoded (zstd) or taken as it is (a raw sub-block: read straight into the entry),
 * checked and kept (s->frame holds it either way). A zstd frame is not decoded under
 * FANSTORE_CHEAP; a raw one is read there from the page cache only (nowait). */
static int cached_frame(uint64_t blob, const struct fanstore_ftable *t, uint32_t k, uint64_t lo,
                        int nowait, struct fanstore_scratch *s, const char **out) {
    uint64_t at = (uint64_t)k * t->frame_size;
    struct fanstore_frame *f = fanstore_fcache_get(blob, k);
    if (f == NULL) {
        int z = t->zstd[k];
        if (z && nowait == FANSTORE_CHEAP)
            return FANSTORE_BLOB_AGAIN;
        uint64_t rel = t->offsets[k], n = t->offsets[k + 1] - rel;
        if (z && !grow(&s->stored, &s->stored_cap, n))
            return FANSTORE_BLOB_NOMEM;
        if ((f = fanstore_fcache_new(blob, k, at, fanstore_frame_raw_size(t, k))) == NULL)
            return FANSTORE_BLOB_NOMEM;
        char *src = z ? s->stored : f->data; /* a raw frame is checked where it lands */
        int r = fanstore_blob_pread(blob, rel, n, src, nowait);
        if (r == FANSTORE_BLOB_OK) {
            fanstore_fcache_miss();
            r = fanstore_frames_decode(t, k, k, src, z ? f->data : NULL);
        }
        if (r != FANSTORE_BLOB_OK) {
            fanstore_fcache_put(f); /* never kept, never seen */
            return r;
        }
        f = fanstore_fcache_add(f);
    }
    s->frame = f;
    *out = f->data + (lo - at);
    return FANSTORE_BLOB_OK;
}

/* A frame object (not kept) holding a copy of `n` checked raw bytes; NULL without memory. */
static struct fanstore_frame *frame_copy(uint64_t blob, uint32_t k, uint64_t at, const char *src,
                                         uint32_t n) {
    struct fanstore_frame *f = fanstore_fcache_new(blob, k, at, n);
    if (f != NULL)
        memcpy(f->data, src, n);
    return f;
}

static int framed_range(uint64_t blob, uint64_t lo, uint64_t hi, int nowait,
                        struct fanstore_scratch *s, const char **out) {
    const struct fanstore_ftable *t;
    int r = fanstore_table_get(blob, nowait, &t);
    if (r != FANSTORE_BLOB_OK)
        return r;
    s->have = 0;
    uint32_t k0 = (uint32_t)(lo / t->frame_size), k1 = (uint32_t)((hi - 1) / t->frame_size);
    uint64_t first_raw = (uint64_t)k0 * t->frame_size;
    int part = k0 == k1 && hi - lo < fanstore_frame_raw_size(t, k0);
    if (part && fanstore_fcache_on() && (t->zstd[k0] || fanstore_fcache_subblocks())) {
        r = cached_frame(blob, t, k0, lo, nowait, s, out);
        fanstore_table_put(t);
        return r;
    }
    uint64_t rel = t->offsets[k0], n = t->offsets[k1 + 1] - rel;
    int raw = fanstore_frames_raw(t, k0, k1);
    if (!raw && nowait == FANSTORE_CHEAP)
        r = FANSTORE_BLOB_AGAIN; /* frames to decode: not on the FUSE thread when others wait */
    else if (!grow(&s->stored, &s->stored_cap, n) ||
        (!raw && !grow(&s->raw, &s->raw_cap, (size_t)(k1 - k0 + 1) * t->frame_size)))
        r = FANSTORE_BLOB_NOMEM;
    else if ((r = fanstore_blob_pread(blob, rel, n, s->stored, nowait)) == FANSTORE_BLOB_OK &&
             (r = fanstore_frames_decode(t, k0, k1, s->stored, raw ? NULL : s->raw)) ==
                 FANSTORE_BLOB_OK) {
        *out = (raw ? s->stored : s->raw) + (lo - first_raw);
        if (part && raw && s->want_frame) /* the checked sub-block, for the page cache */
            s->frame = frame_copy(blob, k0, first_raw, s->stored, fanstore_frame_raw_size(t, k0));
    }
    fanstore_table_put(t);
    return r;
}

int fanstore_blob_range(uint64_t blob, uint64_t lo, uint64_t hi, int nowait,
                        struct fanstore_scratch *s, const char **out) {
    const struct fanstore_blobs *b = &fanstore_blobs;
    fanstore_scratch_release(s);
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

/* (large blocks allocated afresh, of them advised MADV_HUGEPAGE, taken from the pool) */
void fanstore_data_counts(unsigned long long out[3]) {
    out[0] = __atomic_load_n(&data_fresh, __ATOMIC_RELAXED);
    out[1] = __atomic_load_n(&data_huge, __ATOMIC_RELAXED);
    out[2] = __atomic_load_n(&data_pooled, __ATOMIC_RELAXED);
}
