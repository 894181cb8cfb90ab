/* Internal to _shim_remote.c (calls, workers, the Python methods that start and stop the
 * thread), _shim_remote_py.c (Python's fetches), _shim_remote_serve_map.c (serving),
 * _shim_remote_range.c and _shim_remote_mpi.c (MPI, bells and the remote thread): their
 * shared state and functions. The design: _shim_remote.h. */
#ifndef FANSTORE_SHIM_REMOTE_INT_H
#define FANSTORE_SHIM_REMOTE_INT_H
#include <errno.h>
#include <netinet/in.h>
#include <sys/un.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "_shim_blobs.h"
#include "_shim_remote.h"

/* ------------------------------------------------------------------ MPICH, found at run time */

struct mpi_status { /* MPICH's MPI_Status */
    int count_lo, count_hi_and_cancelled, source, tag, error;
};
#define MPI_ANY_SOURCE_ (-2)
#define MPI_ANY_TAG_ (-1)
#define MPI_THREAD_MULTIPLE_ 3
#define MPI_STATUS_IGNORE_ ((struct mpi_status *)1)

struct fsr_mpi {
    int (*Isend)(const void *, int, int, int, int, int, int *);
    int (*Improbe)(int, int, int, int *, int *, struct mpi_status *);
    int (*Mrecv)(void *, int, int, int *, struct mpi_status *);
    int (*Imrecv)(void *, int, int, int *, int *);
    int (*Test)(int *, int *, struct mpi_status *);
    int (*Get_count)(const struct mpi_status *, int, int *);
    int (*Iallgather)(const void *, int, int, void *, int, int, int, int *);
    int (*Query_thread)(int *);
};
extern struct fsr_mpi fsr_mpi;

/* ------------------------------------------------------------------ state */

struct call { /* one request of this rank, in flight */
    struct call *next;
    uint64_t id, blob;
    int owner;
    double deadline;
    fanstore_remote_done done; /* FSR_OP_FETCH: the whole blob, or */
    fanstore_remote_view view; /* FSR_OP_FRAMES: raw bytes [lo, hi), or */
    fanstore_remote_kept kept; /* the same, kept: in `mem` */
    void *mem;
    void *ctx;
    int posted; /* its request was handed to MPI (under the lock) */
    int op;
    uint64_t lo, hi; /* the request's range (FETCH: stored, the whole blob; FRAMES: raw) */
    int python;      /* FETCH from Python's remote_fetch: verified by fsr_verify_py */
    uint16_t bell;   /* the requesting FUSE thread's reply bell (its UDP port, network order;
                        0: the rank's bell, the remote thread takes the reply) */
};

struct out { /* a message for the remote thread to send, or one sent already (`posted`: its
                request `req` for the remote thread to complete) */
    struct out *next;
    int dest, tag, req, posted;
    uint16_t bell; /* the bell rung at `dest` (0: its rank's) */
    char *buf;
    size_t n;
};

struct job { /* work for a worker: a disk read to serve, or a large reply to verify */
    struct job *next;
    int source;         /* serve: the requester */
    struct fsr_header h; /* serve: the request */
    struct call *call;  /* decode: the call answered, `buf` its reply of `n` bytes */
    char *buf;
    size_t n;
    double queued; /* fsr_now() when pushed */
};

struct sending {
    int req;
    char *buf;
};

struct receiving { /* a large reply matched and received without waiting (fsr_take_reply) */
    int req, source, tag;
    char *buf; /* its header's room first (pre bytes), then the message */
    size_t pre, n;
};

#define WORKERS 2
#define DECODE_INLINE (256u << 10) /* replies this small are verified on the remote thread */
#define RANGE_INLINE (1088u << 10) /* FSR_OP_FRAMES replies: up to a 1 MiB READ's and a table */
#define BELL_RECORD 72             /* 64 bytes of host name, IPv4 address, port, 2 spare */

struct fsr_state {
    int running, ready, stopping;
    int comm, byte, rank, size, dup_req, gather_req, gathered;
    pthread_t thread, workers[WORKERS];
    int wake_fd, done_fd, bell_fd;
    struct sockaddr_in *peers; /* size entries; port 0: no bell */
    int64_t *suspect_until;    /* size entries, ns of CLOCK_MONOTONIC: a rank that timed out or
                                  refused a send */
    char *bell_table, bell_mine[BELL_RECORD];
    pthread_mutex_t lock; /* inflight, outq, jobs, the Python done list */
    pthread_cond_t job_cond;
    struct out *outq;
    struct job *jobs;
    struct call *inflight; /* every call not finished (under the lock): deadlines are enforced
                              by the workers too, so a remote thread stuck in MPI (a peer's
                              netmod hanging on a dead node) never leaves a reader waiting */
    struct sending *sends;
    size_t nsends, capsends;
    struct receiving *recvs; /* the remote thread's only */
    size_t nrecvs, caprecvs;
    uint64_t next_id;
    int64_t mpi_since; /* ns: the remote thread is inside its MPI calls since then (0: not) */
};
extern struct fsr_state fsr_state;

struct fsr_stats {
    unsigned long long polls, bell_wakes, served, served_io, served_bytes, bad_requests,
        error_replies, fetched, fetched_bytes, corrupt, timeouts, peer_errors, send_errors,
        verified_by_worker, open_calls, peak_calls, c_reads, c_read_bytes, c_read_fallbacks,
        cache_offers, c_range_reads, c_chunk_hits, c_fetch_ahead, send_waits, worker_sends,
        served_mapped, py_in_place, local_rings, map_zaps, probe_again, probe_found, direct_sends,
        verified_by_reaper, offer_pokes, thread_rings, thread_replies, thread_waits,
        thread_wait_ns, thread_take_ns, late_receives;
};
extern struct fsr_stats fsr_stats;

#define COUNT(x) __atomic_add_fetch(&fsr_stats.x, 1, __ATOMIC_RELAXED)
#define ADD(x, n) __atomic_add_fetch(&fsr_stats.x, (n), __ATOMIC_RELAXED)

static inline double fsr_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static inline void fsr_poke(int fd) {
    uint64_t one = 1;
    ssize_t r = write(fd, &one, sizeof(one));
    (void)r; /* a full counter still wakes the reader */
}

static inline void fsr_take_pokes(int fd) { /* an eventfd: one read resets its counter */
    uint64_t n;
    ssize_t r = read(fd, &n, sizeof(n));
    (void)r;
}

/* _shim_remote_serve_map.c: serving (fsr_error_reply, fsr_serve); _shim_remote.c: calls, workers */
char *fsr_error_reply(const struct fsr_header *req, int err, size_t *n);
/* *tag: the tag to send the reply with (FSR_TAG_REPLY, or a bare reply's) */
char *fsr_serve(const struct fsr_header *req, int nowait, size_t *n, int *again, int *tag);
void fsr_push_job(struct job *j);
void fsr_finish(struct call *c, int status);
void fsr_complete(struct call *c, int status, char *raw, size_t n); /* calls done or view */
int fsr_add_call(const struct call *proto, double timeout); /* fanstore_remote_fetch's core */
void fsr_answered(char *buf, size_t n);
void *fsr_worker(void *unused);
/* _shim_remote_py.c: Python's calls */
/* raw bytes for the disk cache, inside `mem` (taken over: release(mem) when Python is done with
 * them; NULL: free) */
void fsr_offer(uint64_t blob, const char *raw, size_t n, void *mem, void (*release)(void *));
void fsr_verify_py(struct call *c, char *buf, size_t n); /* a reply to Python's call (buf taken over) */
/* _shim_remote_range.c: FSR_OP_FRAMES */
char *fsr_serve_frames(const struct fsr_header *req, int nowait, size_t *n, int *again, int *tag);
void fsr_verify_frames(struct call *c, char *buf, size_t n);
/* _shim_remote_serve_map.c: bare replies (_shim_remote.h), for requests of all the `len`
 * stored bytes of a blob (MAP_MIN or more): a pointer into the partition's mapping (*n, *tag
 * set; counted as served), an error reply (a partition too short: EIO), or NULL: *again
 * (nowait, pages not in the page cache), else not sent bare (off, too small, no mapping):
 * the caller preads. Every send's buffer is released by fsr_free_out (free(), nothing for
 * a bare reply); fsr_maps_drop unmaps (the remote thread stopped). fsr_answered_bare: a bare
 * reply received into buf + sizeof(fsr_header) (`n` counts the header), its call found by
 * source and tag, the header put in front, then fsr_answered. */
#define MAP_MIN 0u /* every whole-blob reply is bare (FANSTORE_CREMOTE_MAP_MIN: bytes) */
char *fsr_serve_bare(const struct fsr_header *req, size_t len, int nowait, size_t *n, int *again, int *tag);
void fsr_free_out(void *buf);
/* The remote thread had nothing to do for a whole idle wait: drop the mappings' page-table
 * entries if small bare replies were sent since the last drop (_shim_remote_serve_map.c). */
void fsr_maps_idle(void);
/* Blobs offered to the disk cache and not yet announced to Python: announce them once the
 * oldest has waited 20 ms, or at once with `force`; the remote thread's loop (_shim_remote_py.c). */
void fsr_offers_flush(int force);
void fsr_maps_drop(void);
void fsr_answered_bare(char *buf, size_t n, int source, int tag);
/* _shim_remote_mpi.c: MPI and the remote thread */
const char *fsr_find_mpi(const char *path);
/* `bell`: the bell to ring at `dest` after sending, a requester thread's (fsr_request_bell), or
 * 0: its rank's remote thread */
void fsr_queue_out(int dest, uint16_t bell, int tag, char *buf, size_t n);
/* Send from any thread (`buf` taken over): 0, or -1 if MPI refused (buf freed). A send not
 * complete at once is tested by this thread for up to `linger` seconds (sleeping between tests,
 * the first after the usual completion time), then handed to the remote thread. */
int fsr_send(int dest, uint16_t bell, int tag, char *buf, size_t n, double linger);
/* Send call `id`'s request (`h`, taken over) from this thread, naming reply bell `bell` (0:
 * the rank's); a refusal ends the call (EIO). */
void fsr_send_request(const struct call *proto, uint64_t id, uint16_t bell, struct fsr_header *h);
void fsr_bells_close(void); /* the local bell socket (remote_stop, the threads joined) */
/* The abstract name of the local bell of UDP port `port` (network order): a rank's, or a FUSE
 * thread's reply bell (_shim_remote_tbell.c) */
socklen_t fsr_bell_name(struct sockaddr_un *a, uint16_t port);
int fsr_local_bells(void); /* local bells in use (FANSTORE_CREMOTE_LOCAL_BELL) */
void fsr_take_rings(int fd); /* the bells rung on `fd`, taken in one recvmmsg (up to 16) */
/* The reply bell a request names: its `err` field, a requester thread's UDP port (network
 * order), or 0 (ring the requester's rank) */
static inline uint16_t fsr_request_bell(const struct fsr_header *h) {
    return h->err > 0 && h->err <= 0xffff ? (uint16_t)h->err : 0;
}
/* One reply matched by Improbe (`msg`, `st`): received and handed to its call (fsr_answered,
 * fsr_answered_bare); 0, or -1 if MPI failed to receive it. `later` (the remote thread only): a
 * reply over FSR_EAGER_MAX from a rank on another host is received with Imrecv and handed over
 * when a later test finds it complete (fsr_state.recvs), so the thread never waits inside MPI
 * while a large one comes over the network (FANSTORE_CREMOTE_LATE_RECV=0: it does, for A/B). */
int fsr_take_reply(int *msg, const struct mpi_status *st, int later);
/* _shim_remote_tbell.c: the reply bells of the C FUSE threads. On a C FUSE thread, the port
 * of its reply bell (opened on first use), or 0 (not such a thread, off, no socket, or as many
 * of its calls in flight as it follows); fsr_thread_call records a call made with it. */
uint16_t fsr_thread_bell(void);
void fsr_thread_call(int owner, uint64_t id);
void fsr_tbell_knobs(void); /* FANSTORE_CREMOTE_REPLY_BELL (remote_start) */
void fsr_read_knobs(void); /* FANSTORE_CREMOTE_DIRECT, FANSTORE_MPI_BELL_IDLE (remote_start) */
/* Whether a worker sends its reply of n bytes itself (FANSTORE_CREMOTE_WORKER_SEND, on by
 * default): only a reply that is likely eager, and only while the remote thread is not stuck in
 * MPI. Deadlines are enforced by a reaper thread that never calls MPI. */
int fsr_worker_sends(size_t n);
#define FSR_EAGER_MAX (256u << 10) /* as _transport.EAGER_BYTES */
extern int fsr_direct; /* requests and workers' replies sent by their own thread (else: queued) */
/* Whether the remote thread is not stuck inside MPI (in it for STUCK_NS or more, as on a dead
 * node's netmod): only then do other threads call MPI themselves (a READ's FUSE thread must
 * never block there; without direct sends the workers' deadlines answer every call). */
int fsr_mpi_fresh(void);
#define STUCK_NS 50000000
extern double fsr_idle; /* longest sleep with bells (FANSTORE_MPI_BELL_IDLE); a tenth of it with
                          calls in flight */
void *fsr_thread(void *unused);
void fsr_suspect(int rank); /* skipped by READs in C for SUSPECT_SECONDS */
void fsr_reap(double t, int all); /* finish calls past their deadline (all: every call) */
struct call *fsr_unlink_call(uint64_t id); /* the call of this id, taken out of inflight */
#define SUSPECT_SECONDS 30.0 /* as _cluster.SUSPECT_SECONDS */
#define LARGE_MMAP (32 << 20) /* malloc: blocks below this come from the heap, not mmap */
#define LARGE_KEEP (64 << 20) /* malloc: free heap top kept, not returned to the kernel */

#endif
