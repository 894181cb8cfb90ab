/* Serving other ranks' requests (fsr_serve: a blob held here read with pread, or sent bare),
 * and whole large blobs sent from a mapping of the local partition, not a pread copy (issue
 * 11, seventh session). The data of a job is immutable, so a reply can be sent from the page
 * cache itself: the requester's MPI copies the bytes once (MPICH on shared memory: its
 * process_vm_readv reads the pages where they lie), not twice (pread into a buffer, then that
 * buffer), and the server spends no CPU on them.
 *
 * Each local partition file is mapped once (read-only, shared, on first use; kept while the
 * remote thread runs). A reply to a request for ALL the stored bytes of a blob of MAP_MIN
 * bytes or more (FSR_OP_FETCH of the whole blob; FSR_OP_FRAMES covering every frame) is then
 * "bare": the stored bytes alone, straight from the mapping, with the tag FSR_TAG_BARE plus
 * the request's id modulo FSR_BARE_IDS (a header would need a copy: one message is one
 * contiguous buffer, and MPICH packs a two-block datatype at half the speed, measured). The
 * requester finds its call by source and tag, and puts back the header the server would have
 * sent (fsr_answered_bare); then everything is checked as for any reply (the length, the
 * manifest's xxh3, each frame's), so a damaged partition, or a stale reply matching a newer
 * call's id bits, gives EIO and the Python fallback, never bad bytes.
 *
 * The remote thread sends bare only when every page is in the page cache (mincore: cheap on
 * pages the mapping already maps); otherwise a worker reads them in first (MADV_POPULATE_READ,
 * as it would pread). The file's size is checked against the blob before every reply (a short
 * partition is EIO, as a short pread): the requester never reads past the end of the file.
 * FANSTORE_CREMOTE_MAP=0: every reply read with pread and sent with its header.
 *
 * Pages a process maps are never evicted by `drop_caches` and count in its RSS, so the
 * mappings' page-table entries are dropped (MADV_DONTNEED: the pages stay in the page cache)
 * each time ZAP_BYTES of small replies (under ZAP_SMALL: whole files of a dataset) have been
 * sent bare, when a bare send completes, and when the remote thread found nothing to do for
 * a whole idle wait after small replies (fsr_maps_idle: the last pass's pages do not stay
 * pinned; with large folios, read in by _shim_stream.c, one mapped page pins 2 MiB) (counter
 * `map_zaps`); whole mappings, since a fault
 * also maps its neighbours' pages (fault-around). Large replies do not count: dropping after
 * each 4 MiB chunk cost 3.5x the server's CPU per GB when chunks were served again (every page
 * faulted back), so a stream of large chunks alone keeps them mapped. A send still in flight
 * is unharmed: its bytes are faulted back in from the page cache (or the disk) by whoever
 * reads them next, the eager copy or the peer's process_vm_readv; the partition is immutable. */
#define _GNU_SOURCE
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>

#include "_shim_remote_int.h"

#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22
#endif

static int map_on = -1; /* -1: the knob not read yet */
static size_t map_min = MAP_MIN;
static pthread_mutex_t maps_lock = PTHREAD_MUTEX_INITIALIZER;
static struct mapped {
    dev_t dev;
    ino_t ino;
    off_t size;
    char *base;
} maps[256]; /* entries are only added while the remote thread runs (fsr_maps_drop: after) */
static int nmaps;
#define ZAP_BYTES (4u << 20)
#define ZAP_SMALL (256u << 10) /* replies under this are let go of; larger stay mapped */
static uint64_t zap_bytes = ZAP_BYTES; /* FANSTORE_CREMOTE_MAP_ZAP (bytes; 0: never), for A/B */
static uint64_t bare_since_zap;        /* bytes of small replies sent bare since the last zap */

static int mapping_on(void) {
    int on = __atomic_load_n(&map_on, __ATOMIC_RELAXED);
    if (on < 0) {
        const char *knob = getenv("FANSTORE_CREMOTE_MAP");
        on = knob == NULL || strcmp(knob, "0") != 0;
        const char *least = getenv("FANSTORE_CREMOTE_MAP_MIN"); /* bytes; for measurements */
        if (least != NULL && *least != '\0')
            map_min = (size_t)strtoull(least, NULL, 10);
        const char *zap = getenv("FANSTORE_CREMOTE_MAP_ZAP");
        if (zap != NULL && *zap != '\0')
            zap_bytes = strtoull(zap, NULL, 10);
        __atomic_store_n(&map_on, on, __ATOMIC_RELAXED);
    }
    return on;
}

/* The mapping of the file open as `fd` (of `st`), made on first use; NULL if it cannot be. */
static char *mapping(int fd, const struct stat *st) {
    char *base = NULL;
    pthread_mutex_lock(&maps_lock);
    for (int i = 0; i < nmaps && base == NULL; i++)
        if (maps[i].dev == st->st_dev && maps[i].ino == st->st_ino && maps[i].size == st->st_size)
            base = maps[i].base;
    if (base == NULL && nmaps < (int)(sizeof(maps) / sizeof(maps[0])) && st->st_size > 0) {
        base = mmap(NULL, (size_t)st->st_size, PROT_READ, MAP_SHARED, fd, 0);
        if (base == MAP_FAILED)
            base = NULL;
        else {
            /* no read-around by faults (the device's read_ahead_kb: 8 MiB on this VM, 128 KiB
             * on most): a cold blob is read in with readahead(2) of exactly its bytes */
            madvise(base, (size_t)st->st_size, MADV_RANDOM);
            maps[nmaps] = (struct mapped){st->st_dev, st->st_ino, st->st_size, base};
            __atomic_store_n(&nmaps, nmaps + 1, __ATOMIC_RELEASE); /* fsr_free_out reads it */
        }
    }
    pthread_mutex_unlock(&maps_lock);
    return base;
}

/* Drop every mapping's page-table entries once ZAP_BYTES were sent bare since the last time. */
static void maybe_zap(void) {
    if (zap_bytes == 0 || __atomic_load_n(&bare_since_zap, __ATOMIC_RELAXED) < zap_bytes)
        return;
    pthread_mutex_lock(&maps_lock);
    if (__atomic_exchange_n(&bare_since_zap, 0, __ATOMIC_RELAXED) >= zap_bytes) {
        for (int i = 0; i < nmaps; i++) /* whole mappings: faults map neighbours' pages too */
            madvise(maps[i].base, (size_t)maps[i].size, MADV_DONTNEED);
        COUNT(map_zaps);
    }
    pthread_mutex_unlock(&maps_lock);
}

void fsr_maps_idle(void) {
    if (__atomic_load_n(&bare_since_zap, __ATOMIC_RELAXED) == 0)
        return;
    pthread_mutex_lock(&maps_lock);
    if (__atomic_exchange_n(&bare_since_zap, 0, __ATOMIC_RELAXED) > 0) {
        for (int i = 0; i < nmaps; i++)
            madvise(maps[i].base, (size_t)maps[i].size, MADV_DONTNEED);
        COUNT(map_zaps);
    }
    pthread_mutex_unlock(&maps_lock);
}

void fsr_free_out(void *buf) {
    int n = __atomic_load_n(&nmaps, __ATOMIC_ACQUIRE);
    for (int i = 0; i < n; i++)
        if ((char *)buf >= maps[i].base && (char *)buf < maps[i].base + maps[i].size) {
            maybe_zap(); /* a bare reply: its bytes are the mapping's */
            return;
        }
    free(buf);
}

void fsr_maps_drop(void) {
    pthread_mutex_lock(&maps_lock);
    for (int i = 0; i < nmaps; i++)
        munmap(maps[i].base, (size_t)maps[i].size);
    __atomic_store_n(&nmaps, 0, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&maps_lock);
}

/* ------------------------------------------------------------------ serving */

char *fsr_error_reply(const struct fsr_header *req, int err, size_t *n) {
    struct fsr_header *h = malloc(sizeof(*h));
    if (h != NULL) {
        *h = *req;
        h->magic = FSR_MAGIC;
        h->version = FSR_VERSION;
        h->err = err;
        h->lo = h->hi = 0;
    }
    *n = sizeof(*h);
    return (char *)h;
}

/* The reply to `req`: bytes read (nowait: only from the page cache; NULL and *again set when
 * the disk must be read), or an error reply. */
char *fsr_serve(const struct fsr_header *req, int nowait, size_t *n, int *again, int *tag) {
    *again = 0;
    *tag = FSR_TAG_REPLY;
    if (req->magic != FSR_MAGIC || req->version != FSR_VERSION ||
        (req->op != FSR_OP_FETCH && req->op != FSR_OP_FRAMES)) {
        COUNT(bad_requests);
        return fsr_error_reply(req, EPROTO, n);
    }
    if (req->op == FSR_OP_FRAMES)
        return fsr_serve_frames(req, nowait, n, again, tag);
    uint64_t b = req->blob;
    if (b >= fanstore_blobs.n || !fanstore_blob_held(b))
        return fsr_error_reply(req, ENOENT, n);
    if (req->lo > req->hi || req->hi > fanstore_blobs.stored[b])
        return fsr_error_reply(req, EINVAL, n);
    size_t len = (size_t)(req->hi - req->lo);
    char *bare = len == fanstore_blobs.stored[b] ? fsr_serve_bare(req, len, nowait, n, again, tag) : NULL;
    if (bare != NULL || *again)
        return bare;
    char *buf = malloc(sizeof(struct fsr_header) + len);
    if (buf == NULL)
        return fsr_error_reply(req, ENOMEM, n);
    int rc = fanstore_blob_pread(b, req->lo, len, buf + sizeof(struct fsr_header), nowait);
    if (rc == FANSTORE_BLOB_AGAIN) {
        free(buf);
        *again = 1;
        return NULL;
    }
    if (rc != FANSTORE_BLOB_OK) {
        free(buf);
        return fsr_error_reply(req, rc == FANSTORE_BLOB_NOT_HELD ? ENOENT : EIO, n);
    }
    struct fsr_header *h = (struct fsr_header *)buf;
    *h = *req;
    h->err = 0;
    *n = sizeof(*h) + len;
    COUNT(served);
    ADD(served_bytes, len);
    return buf;
}

/* ------------------------------------------------------------------ bare replies */

char *fsr_serve_bare(const struct fsr_header *req, size_t len, int nowait, size_t *n, int *again, int *tag) {
    *again = 0;
    int fd;
    int64_t at = fanstore_blob_locate(req->blob, &fd);
    struct stat st;
    if (!mapping_on() || at < 0 || len < map_min || fstat(fd, &st) != 0)
        return NULL;
    if (st.st_size < at + (off_t)len)
        return fsr_error_reply(req, EIO, n); /* as a short pread: never past the end */
    char *base = mapping(fd, &st);
    if (base == NULL)
        return NULL; /* pread then */
    char *p = base + at;
    int in_cache = fanstore_range_resident(fd, (off_t)at, len); /* else mincore: */
    if (in_cache == 0 || (in_cache < 0 && fanstore_pages_missing(p, len) != 0)) {
        if (nowait) {
            fanstore_stream_cold(fanstore_blobs.part[req->blob]);
            *again = 1;
            return NULL;
        }
        if (fanstore_blob_direct(req->blob))
            return NULL; /* the pread path: O_DIRECT, the stream's large folios kept */
        readahead(fd, (off64_t)at, len); /* exactly its bytes, in one request (MADV_RANDOM) */
        uintptr_t a = (uintptr_t)p & ~(uintptr_t)4095; /* read in here, as a pread would */
        if (madvise((void *)a, len + ((uintptr_t)p - a), MADV_POPULATE_READ) != 0)
            return errno == EINVAL ? NULL : fsr_error_reply(req, EIO, n);
    }
    *n = len;
    *tag = FSR_TAG_BARE + (int)(req->id % FSR_BARE_IDS);
    COUNT(served);
    COUNT(served_mapped);
    ADD(served_bytes, len);
    if (len < ZAP_SMALL)
        __atomic_add_fetch(&bare_since_zap, len, __ATOMIC_RELAXED);
    return p;
}

void fsr_answered_bare(char *buf, size_t n, int source, int tag) {
    uint64_t low = (uint64_t)(tag - FSR_TAG_BARE);
    struct fsr_header h = {FSR_MAGIC, FSR_VERSION, 0, 0, 0, 0, 0, 0};
    pthread_mutex_lock(&fsr_state.lock);
    for (struct call *c = fsr_state.inflight; c != NULL; c = c->next)
        if (c->owner == source && c->id % FSR_BARE_IDS == low) {
            h.op = (uint8_t)c->op;
            h.id = c->id;
            h.blob = c->blob;
            h.lo = c->op == FSR_OP_FETCH ? c->lo : 0; /* FRAMES: lo 0 = from the blob's start */
            h.hi = c->op == FSR_OP_FETCH ? c->hi : fanstore_blobs.stored[c->blob];
            break;
        }
    pthread_mutex_unlock(&fsr_state.lock);
    if (h.id == 0) { /* timed out already: nobody waits */
        free(buf);
        return;
    }
    memcpy(buf, &h, sizeof(h));
    fsr_answered(buf, n);
}
