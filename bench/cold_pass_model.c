/* A cold small-file pass modelled without FUSE: one thread streams a file into the page cache
 * front to back (as _shim_stream.c: windows mapped, MADV_HUGEPAGE, MADV_POPULATE_READ) while
 * readers take 2,000 "files" (FILE cut in 2,000 pieces of whole 4 KiB pages: ~108 KiB of
 * bench.cost's 220 MB data.tar) in a shuffled order; a file the stream has not passed
 * yet is read with O_DIRECT (a cold miss), and every file then costs THINK_US of CPU (the FUSE
 * round trips of a file whose bytes are cached: ~150 us for one reader here). Prints the pass
 * time, the stream's, and the files done meanwhile (twenty-eighth session, docs/performance.md).
 *
 *   cc -O2 -o /tmp/cold_pass_model bench/cold_pass_model.c -lpthread
 *   /tmp/cold_pass_model FILE WINDOW_KIB HUGE GATE READERS THINK_US [ADVICE]   (root: drops caches)
 *
 * WINDOW_KIB 0: no stream at all. GATE 1: the stream starts no window while a reader waits for
 * the disk. ADVICE: an madvise(2) advice for each window after MADV_HUGEPAGE (1, MADV_RANDOM:
 * each fault reads one 2 MiB folio and nothing ahead; thirty-second session). FILE must hold
 * 2,000 x 64 KiB at least. */
#define _GNU_SOURCE
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22
#endif
#define FILES 2000

static const char *path;
static size_t window;
static int huge, gate, readers, advice;
static off_t size, slot; /* slot: one file's bytes */
static double think, t0, stream_s;
static atomic_int stream_done, waiting, next_file;
static atomic_long streamed;
static atomic_long during, direct;
static int order[FILES];

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static void *stream(void *arg) {
    (void)arg;
    int fd = open(path, O_RDONLY);
    for (off_t at = 0; at < size; at += (off_t)window) {
        while (gate && atomic_load(&waiting) > 0)
            nanosleep(&(struct timespec){0, 10000}, NULL);
        size_t len = size - at < (off_t)window ? (size_t)(size - at) : window;
        void *p = mmap(NULL, len, PROT_READ, MAP_SHARED, fd, at);
        if (p != MAP_FAILED) {
            if (huge)
                madvise(p, len, MADV_HUGEPAGE);
            if (advice)
                madvise(p, len, advice);
            madvise(p, len, MADV_POPULATE_READ);
            munmap(p, len);
        }
        atomic_store(&streamed, (long)(at + (off_t)len));
    }
    stream_s = now() - t0;
    atomic_store(&stream_done, 1);
    close(fd);
    return NULL;
}

static void *reader(void *arg) {
    (void)arg;
    int fd = open(path, O_RDONLY | O_DIRECT);
    void *buf = NULL;
    if (fd < 0 || posix_memalign(&buf, 4096, (size_t)slot) != 0)
        return NULL;
    int i;
    while ((i = atomic_fetch_add(&next_file, 1)) < FILES) {
        off_t off = (off_t)order[i] * slot;
        if (window == 0 || atomic_load(&streamed) < off + slot) {
            atomic_fetch_add(&waiting, 1);
            if (pread(fd, buf, (size_t)slot, off) < 0)
                perror("pread");
            atomic_fetch_sub(&waiting, 1);
            atomic_fetch_add(&direct, 1);
        }
        for (double end = now() + think; now() < end;)
            ;
        if (window != 0 && !atomic_load(&stream_done))
            atomic_fetch_add(&during, 1);
    }
    free(buf);
    close(fd);
    return NULL;
}

int main(int argc, char **argv) {
    if (argc != 7 && argc != 8) {
        fprintf(stderr, "usage: %s FILE WINDOW_KIB HUGE GATE READERS THINK_US [ADVICE]\n", argv[0]);
        return 2;
    }
    path = argv[1];
    window = (size_t)atoi(argv[2]) << 10;
    huge = atoi(argv[3]);
    gate = atoi(argv[4]);
    readers = atoi(argv[5]) < 1 ? 1 : atoi(argv[5]) > 16 ? 16 : atoi(argv[5]);
    think = atof(argv[6]) * 1e-6;
    advice = argc == 8 ? atoi(argv[7]) : 0;
    struct stat st;
    if (stat(path, &st) != 0 || st.st_size < (off_t)FILES * 65536) {
        fprintf(stderr, "%s: needs %d bytes\n", path, FILES * 65536);
        return 2;
    }
    slot = st.st_size / FILES / 4096 * 4096;
    size = (off_t)FILES * slot;
    for (int i = 0; i < FILES; i++)
        order[i] = i;
    srand(7);
    for (int i = FILES - 1; i > 0; i--) {
        int j = rand() % (i + 1), t = order[i];
        order[i] = order[j];
        order[j] = t;
    }
    sync();
    int d = open("/proc/sys/vm/drop_caches", O_WRONLY);
    if (d < 0 || write(d, "3", 1) != 1) {
        perror("drop_caches");
        return 1;
    }
    close(d);
    pthread_t s, r[16];
    t0 = now();
    if (window != 0)
        pthread_create(&s, NULL, stream, NULL);
    for (int i = 0; i < readers; i++)
        pthread_create(&r[i], NULL, reader, NULL);
    for (int i = 0; i < readers; i++)
        pthread_join(r[i], NULL);
    double pass = now() - t0;
    if (window != 0)
        pthread_join(s, NULL);
    printf("window %zu KiB huge %d advice %d gate %d readers %d think %.0f us: pass %.0f ms "
           "(%.0f files/s), "
           "stream %.0f ms, files during the stream %ld, read from the disk %ld\n",
           window >> 10, huge, advice, gate, readers, think * 1e6, pass * 1e3, FILES / pass, stream_s * 1e3,
           atomic_load(&during), atomic_load(&direct));
    return 0;
}
