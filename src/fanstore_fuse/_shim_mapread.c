/* Large READs of raw frames answered straight from a mapping of the local copy: one copy of
 * each byte in the daemon, not two (issue 11, fio seq 1M; twenty-first session).
 *
 * A READ answered from a buffer costs the daemon two copies of every byte: pread out of the
 * local copy's page cache into the buffer, then the reply's writev out of the buffer into the
 * FUSE file's page cache (or the O_DIRECT reader's memory). For a READ of at least
 * MAPREAD_MIN bytes (buffered: from the kernel's read-ahead, not O_DIRECT) inside one framed blob (codec 3) whose frames are all stored raw (large
 * files of incompressible data: images, shards of already compressed records, random
 * tensors), or of a whole raw blob that large, the bytes are checked where they lie and the
 * reply is written from there:
 *
 * - each local partition file is mapped once (read-only, shared), found by its (device, inode,
 *   size); the READ's pages are faulted in with MADV_POPULATE_READ, which returns an error for
 *   an I/O error instead of raising SIGBUS, and reads them from the disk when they are cold
 *   (what the pread did);
 * - every frame the READ touches is checked against its xxh3 on the mapping
 *   (fanstore_frames_decode with no output buffer: it only hashes);
 * - the reply's writev reads the same mapped pages: the kernel's only copy;
 * - then the range's page-table entries are dropped (MADV_DONTNEED: the pages stay in the page
 *   cache and are evictable again, and drop_caches can empty it, as for a pread).
 *
 * Nothing unchecked is sent: a frame that fails its check is CORRUPT and the READ goes the
 * usual way (the pread path, then Python's fallback, which logs it and gives EIO). Between the
 * check and the copy the pages stay mapped and were just touched, so reclaim does not take
 * them. The partition's size is checked before the mapping is touched (a truncated copy is
 * IO, as a short pread). A nowait READ (tried on the FUSE thread) is answered here only when
 * every page is already in the page cache (mincore); else AGAIN, as for a pread.
 *
 * The mappings live until the held blobs are let go of (fanstore_mapread_forget, from
 * _shim_blobs.c's release): READs use them under a read lock, the forget takes it for writing.
 * O_DIRECT READs are read with pread: a libaio reader's 16 READs at once, each mapped and
 * dropped on its own, cost about the same CPU and read 11% slower (median MiB/s of 8
 * alternated cold runs, 1,580 against 1,778: every drop of a range flushes the other CPU's TLB).
 * Smaller READs (a small file's whole blob) are read with pread: mapping, populating and
 * dropping 27 pages cost more than copying 110 KB (copy-cached cold passes of bench.cost's
 * tree: 7.5-8.2k files/s mapped against 8.2-8.8k, twenty-first session).
 * FANSTORE_MAPREAD=0 turns this off (every READ pread into a buffer, as before);
 * FANSTORE_MAPREAD_MIN sets the least READ (bytes), for measurements. Splicing the
 * file range into /dev/fuse instead of the writev costs the same CPU (measured) but needs a
 * pipe of 2 MiB for a 1 MiB READ: more than fs.pipe-max-size allows without CAP_SYS_RESOURCE. */
#define _GNU_SOURCE
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "_shim_blobs.h"
#include "_shim_mapread.h"
#include "_shim_ops.h"

#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22
#endif

#define PAGE 4096u
#define MAPS 256

static pthread_rwlock_t maps_lock = PTHREAD_RWLOCK_INITIALIZER;
static struct mapped {
    dev_t dev;
    ino_t ino;
    size_t len;
    char *base;
} maps[MAPS];
static int nmaps;
static int knob = -1; /* FANSTORE_MAPREAD: -1 not read yet */
static uint64_t least = MAPREAD_MIN; /* FANSTORE_MAPREAD_MIN (bytes), for measurements */
static unsigned long long answered, answered_bytes;

static int mapread_on(void) {
    int k = __atomic_load_n(&knob, __ATOMIC_RELAXED);
    if (k < 0) {
        const char *v = getenv("FANSTORE_MAPREAD");
        k = v == NULL || strcmp(v, "0") != 0;
        const char *m = getenv("FANSTORE_MAPREAD_MIN");
        if (m != NULL && *m != '\0')
            least = strtoull(m, NULL, 10);
        __atomic_store_n(&knob, k, __ATOMIC_RELAXED);
    }
    return k;
}

/* The mapping of the file `st` describes (open as `fd`): found, or made. Read lock held. */
static char *mapping(int fd, const struct stat *st) {
    for (int i = 0; i < __atomic_load_n(&nmaps, __ATOMIC_ACQUIRE); i++)
        if (maps[i].dev == st->st_dev && maps[i].ino == st->st_ino &&
            maps[i].len == (size_t)st->st_size)
            return maps[i].base;
    /* not mapped yet: made under a mutex (readers of the table only ever see whole entries) */
    static pthread_mutex_t make = PTHREAD_MUTEX_INITIALIZER;
    pthread_mutex_lock(&make);
    char *base = NULL;
    int n = nmaps;
    for (int i = 0; i < n && base == NULL; i++)
        if (maps[i].dev == st->st_dev && maps[i].ino == st->st_ino &&
            maps[i].len == (size_t)st->st_size)
            base = maps[i].base;
    if (base == NULL && n < MAPS && st->st_size > 0) {
        void *m = mmap(NULL, (size_t)st->st_size, PROT_READ, MAP_SHARED, fd, 0);
        if (m != MAP_FAILED) {
            base = m;
            maps[n] = (struct mapped){st->st_dev, st->st_ino, (size_t)st->st_size, base};
            __atomic_store_n(&nmaps, n + 1, __ATOMIC_RELEASE);
        }
    }
    pthread_mutex_unlock(&make);
    return base;
}

void fanstore_mapread_forget(void) {
    pthread_rwlock_wrlock(&maps_lock); /* waits for READs using a mapping */
    for (int i = 0; i < nmaps; i++)
        munmap(maps[i].base, maps[i].len);
    __atomic_store_n(&nmaps, 0, __ATOMIC_RELEASE);
    pthread_rwlock_unlock(&maps_lock);
}

int fanstore_mapread_range(fuse_req_t req, uint64_t blob, uint64_t lo, uint64_t hi, int nowait,
                           int (*reply)(fuse_req_t, const char *, size_t)) {
    if (!mapread_on() || hi - lo < least)
        return FANSTORE_MAPREAD_NO;
    const struct fanstore_blobs *b = &fanstore_blobs;
    if (!fanstore_blob_held(blob))
        return FANSTORE_MAPREAD_NO;
    int codec = b->codec[blob];
    const struct fanstore_ftable *t = NULL;
    uint32_t k0 = 0, k1 = 0;
    uint64_t rel = 0, n, first_raw = 0;
    int r;
    if (codec == FANSTORE_CODEC_FRAMED) {
        if ((r = fanstore_table_get(blob, nowait, &t)) != FANSTORE_BLOB_OK)
            return r;
        k0 = (uint32_t)(lo / t->frame_size);
        k1 = (uint32_t)((hi - 1) / t->frame_size);
        if (!fanstore_frames_raw(t, k0, k1)) {
            fanstore_table_put(t);
            return FANSTORE_MAPREAD_NO;
        }
        rel = t->offsets[k0];
        n = t->offsets[k1 + 1] - rel;
        first_raw = (uint64_t)k0 * t->frame_size;
    } else if (codec == FANSTORE_CODEC_RAW && lo == 0 && hi == b->raw[blob]) {
        n = b->stored[blob]; /* a whole raw blob (its one xxh3 covers all of it) */
    } else {
        return FANSTORE_MAPREAD_NO;
    }
    int fd;
    int64_t at = fanstore_blob_locate(blob, &fd);
    /* raw frames lie back to back, byte for byte: lo's place in the file */
    uint64_t pos = (uint64_t)at + rel + (lo - first_raw);
    struct stat st;
    char *base = NULL;
    if (at < 0 || fstat(fd, &st) != 0)
        r = FANSTORE_MAPREAD_NO;
    else if ((uint64_t)st.st_size < (uint64_t)at + rel + n)
        r = FANSTORE_BLOB_IO; /* a truncated partition, as a short pread */
    else
        r = FANSTORE_BLOB_OK;
    if (r == FANSTORE_BLOB_OK) {
        pthread_rwlock_rdlock(&maps_lock);
        if ((base = mapping(fd, &st)) == NULL) {
            pthread_rwlock_unlock(&maps_lock);
            r = FANSTORE_MAPREAD_NO;
        }
    }
    if (base != NULL) {
        char *span = base + at + rel;
        char *page = (char *)((uintptr_t)span & ~(uintptr_t)(PAGE - 1));
        size_t len = (size_t)(span + n - page);
        if (nowait && fanstore_pages_missing(page, len) > 0)
            r = FANSTORE_BLOB_AGAIN;
        else if (madvise(page, len, MADV_POPULATE_READ) != 0)
            r = errno == EINVAL ? FANSTORE_MAPREAD_NO : FANSTORE_BLOB_IO; /* EINVAL: < 5.14 */
        else if (t != NULL)
            r = fanstore_frames_decode(t, k0, k1, span, NULL);
        else
            r = fanstore_blob_decode(blob, span, span); /* checks in place: no copy */
        if (r == FANSTORE_BLOB_OK) {
            reply(req, base + pos, hi - lo);
            __atomic_add_fetch(&answered, 1, __ATOMIC_RELAXED);
            __atomic_add_fetch(&answered_bytes, hi - lo, __ATOMIC_RELAXED);
        }
        if (r != FANSTORE_BLOB_AGAIN)
            madvise(page, len, MADV_DONTNEED); /* the page cache keeps them, evictable again */
        pthread_rwlock_unlock(&maps_lock);
    }
    if (t != NULL)
        fanstore_table_put(t);
    return r;
}

PyObject *fanstore_py_mapread_counts(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    return Py_BuildValue("(KK)", __atomic_load_n(&answered, __ATOMIC_RELAXED),
                         __atomic_load_n(&answered_bytes, __ATOMIC_RELAXED));
}
