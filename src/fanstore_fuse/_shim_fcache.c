/* Decoded zstd frames kept in C (issue 11, compressed random reads): a READ that asks for part
 * of one zstd frame decodes the whole frame (128 KiB by default) to check its xxh3; without a
 * cache the next 4 KiB of that frame decodes it again. fanstore_blob_range (_shim_frames.c)
 * keeps such frames here once decoded AND verified, and looks them up first. Raw sub-blocks
 * (16 KiB, incompressible data) read in part are kept the same way (fanstore_fcache_subblocks):
 * an O_DIRECT reader's 4 KiB READs reach the daemon one by one, and the other pages of a kept
 * sub-block then cost a lookup instead of a pread of 16 KiB and its xxh3.
 *
 * - bounded in bytes allocated (frame_cache(budget), from the daemon's FANSTORE_CACHE_BYTES;
 *   0: off); a frame larger than the budget is never kept. Least recently used frames go first.
 * - entries are reference-counted: a reader (or the page-cache push, _shim_push.c) holds one
 *   while it uses the bytes, so an eviction never frees bytes in use (the last put does).
 *   A frame pushed to the kernel's page cache is forgotten here once stored (no second copy;
 *   kept until then, so READs of it that come before the store find it).
 * - one mutex for the table and the LRU list: a lookup is a hash probe and a mark (`used`),
 *   the list is put in order only when evicting (an entry used since it came to the front
 *   goes back there once, "second chance"): moving it on every hit touched its two neighbours,
 *   cache and TLB misses among 16,384 sub-blocks of 16 KiB (4% of the daemon's samples under
 *   O_DIRECT 4 KiB reads). Decoding and copying happen outside the lock.
 * - evicted entries are kept as spares (up to SPARES) for the next frames: a 128 KiB malloc is
 *   an mmap, 32 page faults and zeroed pages each time (a tenth of a miss's CPU, measured).
 * - only fanstore_frames_decode's verified output is ever added: an entry is built by the
 *   caller, checked, then published (fanstore_fcache_add); a frame that fails its check is
 *   freed and never seen by another reader.
 */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "_shim_blobs.h"

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static struct fanstore_frame **buckets;
static size_t nbuckets; /* a power of two, or 0 (off) */
static size_t budget, used, entries;
static struct fanstore_frame lru = {.prev = &lru, .next = &lru}; /* next: most recent */
static unsigned long long hits, misses, evictions;
#define SPARES 32
static struct fanstore_frame *spares; /* freed entries (hnext-linked), each `cap` bytes */
static unsigned nspares;

static size_t slot(uint64_t blob, uint32_t k) {
    uint64_t h = (blob * UINT64_C(0x9E3779B97F4A7C15)) ^ ((uint64_t)k * UINT64_C(0xC2B2AE3D27D4EB4F));
    return (size_t)(h ^ (h >> 29)) & (nbuckets - 1);
}

static void lru_unlink(struct fanstore_frame *f) {
    f->prev->next = f->next;
    f->next->prev = f->prev;
}

static void lru_front(struct fanstore_frame *f) {
    f->next = lru.next;
    f->prev = &lru;
    lru.next->prev = f;
    lru.next = f;
}

/* The last reference to `f` is gone (lock held): a spare, or freed. */
static void release_locked(struct fanstore_frame *f) {
    if (nspares < SPARES && nbuckets != 0) {
        f->hnext = spares;
        spares = f;
        nspares++;
    } else {
        free(f);
    }
}

/* Take `f` out of the table and the list (lock held); released now if nobody holds it. */
static void remove_locked(struct fanstore_frame *f) {
    struct fanstore_frame **p = &buckets[slot(f->blob, f->k)];
    while (*p != f)
        p = &(*p)->hnext;
    *p = f->hnext;
    lru_unlink(f);
    f->cached = 0;
    used -= f->cap;
    entries--;
    if (--f->refs == 0)
        release_locked(f);
}

struct fanstore_frame *fanstore_fcache_new(uint64_t blob, uint32_t k, uint64_t at, uint32_t len) {
    struct fanstore_frame *f = NULL;
    pthread_mutex_lock(&lock);
    if (spares != NULL) {
        f = spares;
        spares = f->hnext;
        nspares--;
    }
    pthread_mutex_unlock(&lock);
    if (f != NULL && (f->cap < len || f->cap / 2 >= len)) { /* another size: not to block
                                                               the list, nor to waste memory */
        free(f);
        f = NULL;
    }
    uint32_t cap = f != NULL ? f->cap : len;
    if (f == NULL && (f = malloc(sizeof(*f) + len)) == NULL)
        return NULL;
    memset(f, 0, sizeof(*f));
    f->blob = blob;
    f->k = k;
    f->at = at;
    f->len = len;
    f->cap = cap;
    f->refs = 1;
    return f;
}

struct fanstore_frame *fanstore_fcache_get(uint64_t blob, uint32_t k) {
    pthread_mutex_lock(&lock);
    struct fanstore_frame *f = NULL;
    if (nbuckets != 0) {
        for (f = buckets[slot(blob, k)]; f != NULL; f = f->hnext)
            if (f->blob == blob && f->k == k)
                break;
        if (f != NULL) {
            f->refs++;
            f->used = 1; /* not moved: the list is put in order when evicting (below) */
            hits++;
        }
    }
    pthread_mutex_unlock(&lock);
    return f;
}

struct fanstore_frame *fanstore_fcache_add(struct fanstore_frame *f) {
    pthread_mutex_lock(&lock);
    if (nbuckets == 0 || f->cap > budget) {
        pthread_mutex_unlock(&lock);
        return f; /* not kept: the caller's reference is the only one */
    }
    size_t s = slot(f->blob, f->k);
    for (struct fanstore_frame *g = buckets[s]; g != NULL; g = g->hnext)
        if (g->blob == f->blob && g->k == f->k) { /* another thread decoded it meanwhile */
            g->refs++;
            pthread_mutex_unlock(&lock);
            fanstore_fcache_put(f);
            return g;
        }
    while (used + f->cap > budget && lru.prev != &lru) {
        struct fanstore_frame *old = lru.prev;
        if (old->used) { /* used since it last came to the front: a second chance */
            old->used = 0;
            lru_unlink(old);
            lru_front(old);
            continue;
        }
        remove_locked(old);
        evictions++;
    }
    f->hnext = buckets[s];
    buckets[s] = f;
    lru_front(f);
    f->cached = 1;
    f->refs++; /* the cache's */
    used += f->cap;
    entries++;
    pthread_mutex_unlock(&lock);
    return f;
}

void fanstore_fcache_miss(void) { __atomic_add_fetch(&misses, 1, __ATOMIC_RELAXED); }

void fanstore_fcache_put(struct fanstore_frame *f) {
    if (f == NULL)
        return;
    pthread_mutex_lock(&lock);
    if (--f->refs == 0)
        release_locked(f);
    pthread_mutex_unlock(&lock);
}

void fanstore_fcache_forget(struct fanstore_frame *f) {
    pthread_mutex_lock(&lock);
    if (f->cached)
        remove_locked(f);
    pthread_mutex_unlock(&lock);
}

int fanstore_fcache_on(void) { return __atomic_load_n(&nbuckets, __ATOMIC_RELAXED) != 0; }

static int subblocks = 1;
int fanstore_fcache_subblocks(void) { return __atomic_load_n(&subblocks, __ATOMIC_RELAXED); }
void fanstore_fcache_set_subblocks(int on) { __atomic_store_n(&subblocks, on, __ATOMIC_RELAXED); }

/* Every entry dropped (those held are released by their last put), the spares freed. Lock
 * held. */
static void clear_locked(void) {
    while (lru.prev != &lru)
        remove_locked(lru.prev);
    while (spares != NULL) {
        struct fanstore_frame *f = spares;
        spares = f->hnext;
        free(f);
    }
    nspares = 0;
}

void fanstore_fcache_clear(void) {
    pthread_mutex_lock(&lock);
    clear_locked();
    pthread_mutex_unlock(&lock);
}

int fanstore_fcache_set(size_t bytes) {
    size_t n = 0;
    if (bytes > 0) { /* about one bucket per 8 KiB of budget (sub-blocks: 16 KiB), 64 .. 2^21 */
        n = 64;
        while (n < (1u << 21) && n * 8192 < bytes)
            n <<= 1;
    }
    struct fanstore_frame **b = n ? calloc(n, sizeof(*b)) : NULL;
    if (n && b == NULL)
        return -1;
    pthread_mutex_lock(&lock);
    clear_locked();
    struct fanstore_frame **old = buckets;
    buckets = b;
    nbuckets = n;
    budget = bytes;
    hits = misses = evictions = 0;
    pthread_mutex_unlock(&lock);
    free(old);
    return 0;
}

void fanstore_fcache_counts(unsigned long long out[6]) {
    pthread_mutex_lock(&lock);
    out[0] = hits;
    out[1] = __atomic_load_n(&misses, __ATOMIC_RELAXED);
    out[2] = evictions;
    out[3] = used;
    out[4] = entries;
    out[5] = budget;
    pthread_mutex_unlock(&lock);
}
