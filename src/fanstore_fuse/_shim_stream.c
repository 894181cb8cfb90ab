/* This rank's local copies streamed into the page cache once reads find them cold (issue 11,
 * cold small files).
 *
 * A training epoch reads every file of the dataset, in random order. Read cold one by one, a
 * ~110 KB file is a random disk read: on the bench's disk 370-600 MB/s with no file system in
 * the way, against 1.2-2.0 GB/s read sequentially (`python -m bench.disk_rates`, eleventh
 * session). So when reads keep finding a local copy's bytes out of the page cache
 * (STREAM_TRIGGER cold blobs since the last stream: `fanstore_stream_cold`, called by the
 * nowait reads of _shim_blobs.c and by the serving path of _shim_remote_serve_map.c), one
 * thread reads this rank's local copies front to back into the page cache, the partition that
 * was found cold first: each window of STREAM_WINDOW bytes that `mincore` finds not wholly
 * resident is mapped (shared, read-only), advised MADV_HUGEPAGE (large folios where the file
 * system has them: later copies out of the page cache run at up to twice the speed, see
 * docs/performance.md, tenth session) and read in with MADV_POPULATE_READ, then unmapped: no
 * copy to user memory, and no page stays mapped (drop_caches and memory pressure can evict
 * all of it). Readers that need a page first read it themselves meanwhile, as before.
 *
 * Where MADV_HUGEPAGE takes, the window is also advised MADV_RANDOM: each fault then reads one
 * 2 MiB folio and the page cache's read-ahead (8 MiB on this disk) keeps nothing in flight
 * behind it, so a reader's O_DIRECT read of a missing blob waits behind at most one folio
 * (thirty-second session: p50 0.38 ms / p90 0.50 ms for a 112 KB O_DIRECT read meanwhile,
 * against 0.26-2.1 / 2.9-3.0 ms; cold 4-reader passes with FUSE over io_uring 11,993 against
 * 10,439 files/s, medians of 10 alternated rounds; on the /dev/fuse path inside the noise).
 * Only on Linux 5.18 or later: before it, a fault of a VM_HUGEPAGE file mapping does not read a
 * whole folio, and MADV_RANDOM would leave the stream one synchronous 4 KiB read per page.
 * FANSTORE_STREAM_RANDOM=0 leaves the read-ahead on.
 *
 * The disk cache of remote blobs (_shim_cache.c) is streamed the same way: its segment files
 * hold the second epoch's remote half, written in the first epoch's order and read in another
 * (a cold cache read calls fanstore_stream_cold with FANSTORE_STREAM_CACHE, and then the
 * segments go first). Each segment is streamed only while what it and the local copies lack
 * fits the budget (else counted in stream_cache_skipped); FANSTORE_STREAM_CACHE=0 leaves the
 * cache out. Measured: docs/performance.md, sixteenth session.
 *
 * Bounds: the bytes not yet resident must fit in FANSTORE_STREAM_IN (a fraction of
 * MemAvailable, default 0.5; 0 turns streaming off) when a stream starts, else nothing is
 * streamed (counter stream_refused; copies larger than MemTotal plus that share are refused
 * without looking at their pages, and after a refusal the next look is REFUSED_GAP_NS later);
 * a new stream starts at least STREAM_GAP_NS after the last one ended. The thread is started
 * on the first trigger and stopped (joined) by fanstore_stream_stop before _shim_blobs.c
 * closes the descriptors it reads.
 */
#define _GNU_SOURCE
#include <Python.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/utsname.h>
#include <time.h>

#include "_shim_blobs.h"
#include "_shim_cache.h"

#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22
#endif

#define STREAM_WINDOW (8u << 20)
#define STREAM_TRIGGER 16 /* cold blobs seen since the last stream */
#define STREAM_GAP_NS 250000000LL
#define REFUSED_GAP_NS 30000000000LL
#define CACHE_SEGMENTS 512 /* at most this many disk-cache segments per stream */

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t wake = PTHREAD_COND_INITIALIZER;
static pthread_t thread;
static int thread_up, stopping, pending, busy, knob_read;
static double fraction = 0.5;
static int with_cache = 1; /* FANSTORE_STREAM_CACHE=0: the local copies only */
static int one_folio = 1;  /* FANSTORE_STREAM_RANDOM=0: the kernel's read-ahead behind windows */
static uint32_t first_part;
static int64_t quiet_until; /* no cold read looks before this (INT64_MAX: streaming, or off) */
static unsigned cold_seen;
static unsigned long long runs, refused, windows, bytes_read, stream_ns, cold_total;
static unsigned long long cache_segments, cache_skipped; /* disk-cache segments streamed, not */

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000LL + t.tv_nsec;
}

/* MemAvailable and MemTotal, in bytes. */
static void meminfo(uint64_t *avail, uint64_t *total) {
    FILE *f = fopen("/proc/meminfo", "r");
    char line[256];
    unsigned long long kb;
    *avail = *total = 0;
    while (f != NULL && fgets(line, sizeof(line), f) != NULL) {
        if (sscanf(line, "MemAvailable: %llu kB", &kb) == 1)
            *avail = (uint64_t)kb << 10;
        else if (sscanf(line, "MemTotal: %llu kB", &kb) == 1)
            *total = (uint64_t)kb << 10;
    }
    if (f != NULL)
        fclose(f);
}

/* Bytes of the file `fd` (size `size`) not in the page cache, or (measure 0) read them in. */
static uint64_t walk(int fd, uint64_t size, int measure) {
    uint64_t left = 0;
    for (uint64_t at = 0; at < size; at += STREAM_WINDOW) {
        pthread_mutex_lock(&lock);
        int stop = stopping;
        pthread_mutex_unlock(&lock);
        if (stop)
            break;
        size_t len = size - at < STREAM_WINDOW ? (size_t)(size - at) : STREAM_WINDOW;
        char *p = mmap(NULL, len, PROT_READ, MAP_SHARED, fd, (off_t)at);
        if (p == MAP_FAILED)
            break;
        size_t missing = fanstore_pages_missing(p, len);
        left += (uint64_t)missing * 4096;
        if (!measure && missing > 0) {
            /* EINVAL where there are no large folios: fine. With them, each fault of a window
             * advised MADV_RANDOM reads one 2 MiB folio and nothing ahead of it */
            if (madvise(p, len, MADV_HUGEPAGE) == 0 && one_folio)
                madvise(p, len, MADV_RANDOM);
            if (madvise(p, len, MADV_POPULATE_READ) == 0) {
                __atomic_add_fetch(&windows, 1, __ATOMIC_RELAXED);
                __atomic_add_fetch(&bytes_read, (unsigned long long)missing * 4096, __ATOMIC_RELAXED);
            } else if (errno == EINVAL) { /* before Linux 5.14: the kernel's read-ahead */
                readahead(fd, (off64_t)at, len);
            }
        }
        munmap(p, len);
    }
    return left;
}

/* The disk cache's segments (_shim_cache.c), after the local copies (or before them, when the
 * cache was found cold first), each only while what it and the copies lack fits the budget. */
static void stream_cache(double budget, uint64_t local_want) {
    int fds[CACHE_SEGMENTS];
    int n = with_cache ? fanstore_cache_segment_fds(fds, CACHE_SEGMENTS) : 0, streamed = 0;
    uint64_t want = local_want;
    for (int k = 0; k < n; k++) {
        struct stat st;
        uint64_t size = fstat(fds[k], &st) == 0 ? (uint64_t)st.st_size : 0;
        uint64_t lacks = size ? walk(fds[k], size, 1) : 0;
        if (lacks > 0 && (double)(want + lacks) <= budget) {
            want += lacks;
            walk(fds[k], size, 0);
            streamed++;
        } else if (lacks > 0) {
            __atomic_add_fetch(&cache_skipped, 1, __ATOMIC_RELAXED);
        }
        close(fds[k]);
    }
    __atomic_add_fetch(&cache_segments, (unsigned long long)streamed, __ATOMIC_RELAXED);
}

/* One stream; 0 when it was refused (too large for the page cache it may use). */
static int stream_once(uint32_t first) {
    uint32_t n = fanstore_blob_parts();
    uint64_t sizes[n ? n : 1], all = 0, want = 0, avail, total;
    for (uint32_t k = 0; k < n; k++) {
        int fd = fanstore_blob_part_fd(k);
        struct stat st;
        sizes[k] = fd >= 0 && fstat(fd, &st) == 0 ? (uint64_t)st.st_size : 0;
        all += sizes[k];
    }
    meminfo(&avail, &total);
    double budget = fraction * (double)avail;
    /* at most MemTotal of it can be resident: a copy that large is refused without a look */
    if ((double)all > (double)total + budget) {
        __atomic_add_fetch(&refused, 1, __ATOMIC_RELAXED);
        return 0;
    }
    for (uint32_t k = 0; k < n; k++)
        if (sizes[k] > 0)
            want += walk(fanstore_blob_part_fd(k), sizes[k], 1);
    if ((double)want > budget) {
        __atomic_add_fetch(&refused, 1, __ATOMIC_RELAXED);
        return 0;
    }
    /* the disk cache's segments, before the copies when a cache read was found cold first */
    int cache_first = first == FANSTORE_STREAM_CACHE;
    if (cache_first)
        stream_cache(budget, want);
    if (want > 0) {
        __atomic_add_fetch(&runs, 1, __ATOMIC_RELAXED);
        for (uint32_t i = 0; i < n; i++) {
            uint32_t k = (cache_first ? i : first + i) % n;
            if (sizes[k] > 0)
                walk(fanstore_blob_part_fd(k), sizes[k], 0);
        }
    }
    if (!cache_first)
        stream_cache(budget, want);
    return 1;
}

static void *stream_main(void *unused) {
    (void)unused;
    pthread_mutex_lock(&lock);
    for (;;) {
        while (!stopping && !pending)
            pthread_cond_wait(&wake, &lock);
        if (stopping)
            break;
        pending = 0;
        busy = 1;
        uint32_t first = first_part;
        pthread_mutex_unlock(&lock);
        int64_t t0 = now_ns();
        int done = stream_once(first);
        __atomic_add_fetch(&stream_ns, (unsigned long long)(now_ns() - t0), __ATOMIC_RELAXED);
        pthread_mutex_lock(&lock);
        busy = 0;
        cold_seen = 0;
        /* after a refusal, look again only after REFUSED_GAP_NS: the copy will not shrink */
        __atomic_store_n(&quiet_until, now_ns() + (done ? STREAM_GAP_NS : REFUSED_GAP_NS),
                         __ATOMIC_RELAXED);
    }
    pthread_mutex_unlock(&lock);
    return NULL;
}

/* Whether the running kernel is at least major.minor. */
static int kernel_at_least(int major, int minor) {
    struct utsname u;
    int a = 0, b = 0;
    if (uname(&u) != 0 || sscanf(u.release, "%d.%d", &a, &b) != 2)
        return 0;
    return a > major || (a == major && b >= minor);
}

static void read_knob(void) {
    const char *k = getenv("FANSTORE_STREAM_IN");
    if (k != NULL && *k != '\0') {
        char *end;
        double f = strtod(k, &end);
        fraction = end != k && f >= 0 ? f : 0.5;
    }
    const char *c = getenv("FANSTORE_STREAM_CACHE");
    with_cache = !(c != NULL && strcmp(c, "0") == 0);
    const char *r = getenv("FANSTORE_STREAM_RANDOM");
    one_folio = !(r != NULL && strcmp(r, "0") == 0) && kernel_at_least(5, 18);
    knob_read = 1;
    if (fraction <= 0)
        __atomic_store_n(&quiet_until, INT64_MAX, __ATOMIC_RELAXED); /* off for good */
}

void fanstore_stream_cold(uint32_t part) {
    /* on every cold read: no lock while a stream runs, within the gap, or when off */
    __atomic_add_fetch(&cold_total, 1, __ATOMIC_RELAXED);
    if (__atomic_add_fetch(&cold_seen, 1, __ATOMIC_RELAXED) < STREAM_TRIGGER ||
        now_ns() < __atomic_load_n(&quiet_until, __ATOMIC_RELAXED))
        return;
    pthread_mutex_lock(&lock);
    if (!knob_read)
        read_knob();
    if (fraction > 0 && !stopping && !busy && !pending &&
        now_ns() >= __atomic_load_n(&quiet_until, __ATOMIC_RELAXED)) {
        if (!thread_up) {
            sigset_t all, old;
            sigfillset(&all);
            pthread_sigmask(SIG_SETMASK, &all, &old); /* signals stay with the main thread */
            thread_up = pthread_create(&thread, NULL, stream_main, NULL) == 0;
            if (thread_up)
                pthread_setname_np(thread, "fsr-stream"); /* for top -H, /proc/PID/task */
            pthread_sigmask(SIG_SETMASK, &old, NULL);
        }
        if (thread_up) {
            first_part = part;
            pending = 1;
            __atomic_store_n(&quiet_until, INT64_MAX, __ATOMIC_RELAXED);
            pthread_cond_signal(&wake);
        }
    }
    pthread_mutex_unlock(&lock);
}

void fanstore_stream_stop(void) {
    pthread_mutex_lock(&lock);
    int up = thread_up;
    stopping = 1;
    pthread_cond_signal(&wake);
    pthread_mutex_unlock(&lock);
    if (up)
        pthread_join(thread, NULL);
    pthread_mutex_lock(&lock);
    thread_up = pending = busy = 0; /* stopping stays: no stream until fanstore_stream_allow */
    cold_seen = 0;
    pthread_mutex_unlock(&lock);
}

void fanstore_stream_allow(void) {
    pthread_mutex_lock(&lock);
    stopping = 0;
    __atomic_store_n(&quiet_until, knob_read && fraction <= 0 ? INT64_MAX : 0, __ATOMIC_RELAXED);
    pthread_mutex_unlock(&lock);
}

PyObject *fanstore_py_stream_counts(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    pthread_mutex_lock(&lock);
    unsigned long long in_flight = (unsigned long long)(pending || busy);
    pthread_mutex_unlock(&lock);
    return Py_BuildValue("(KKKKKKKKK)", __atomic_load_n(&runs, __ATOMIC_RELAXED),
                         __atomic_load_n(&refused, __ATOMIC_RELAXED),
                         __atomic_load_n(&windows, __ATOMIC_RELAXED),
                         __atomic_load_n(&bytes_read, __ATOMIC_RELAXED),
                         __atomic_load_n(&stream_ns, __ATOMIC_RELAXED),
                         __atomic_load_n(&cold_total, __ATOMIC_RELAXED),
                         __atomic_load_n(&cache_segments, __ATOMIC_RELAXED),
                         __atomic_load_n(&cache_skipped, __ATOMIC_RELAXED), in_flight);
}
