/* FUSE requests read by C threads (issue 11, warm small files; FANSTORE_FUSE_THREADS).
 *
 * A warm small file costs the daemon an OPEN and a RELEASE, both answered in C (_shim_open.c).
 * On pyfuse3's one FUSE thread each also cost a ppoll of /dev/fuse and trio's wake-up sockets,
 * the GIL released and taken back, and a look at trio's run queue: 35 us of CPU per warm file
 * against squashfuse_ll's 15 (libfuse's loop: a blocking read(), the answer, a writev).
 *
 * With `fuse_threads(n)` (before pyfuse3.init), pyfuse3's call of fuse_session_fd (in init,
 * right after the mount) starts n threads ("fanstore-fuse0".."n-1") that read the session's
 * /dev/fuse descriptor themselves, as libfuse's multi-threaded loop does without clone_fd
 * (the kernel wakes one blocked reader per request; a reply goes to the descriptor the request
 * came from, here the same one). A thread answers what C answers without Python and without
 * the GIL (fanstore_answered(.., 0): LOOKUP, GETATTR, OPEN, RELEASE of the dataset, IOCTL's
 * ENOSYS), and queues every other request, in the order it read them, for the trio thread:
 * pyfuse3 is given an eventfd instead of /dev/fuse, readable while the queue holds a request,
 * and the interposed fuse_session_receive_buf (_shim_open.c) takes the next one from the queue
 * (fanstore_threads_pop). Every request is read once, by one thread, and either answered there
 * or queued once; the trio thread never reads /dev/fuse. READ stays on the trio thread
 * (_shim_read.c's inline path holds the GIL), where the request loop answers it in C as before.
 * One thread is the default: with 4, every request woke a sleeping thread (a context switch)
 * and they contended for the kernel's queue lock (10% of the samples in a spinlock slow path):
 * 18-26 us of the daemon's CPU per open+close against 11-17 with one (docs/performance.md);
 * squashfuse_ll, too, answered from one of its threads nearly always. A C answer never blocks,
 * so one thread is never busy for long; more only help if that changes.
 *
 * It does change with concurrent cold readers: their READs (a disk read, a copy, a hash each)
 * keep one thread busy while the others' requests wait. Two threads always reading took cold 4
 * readers ~20% further but cost one warm reader ~10-20% (a request then often wakes the thread
 * asleep in read() instead of the one polling). So FANSTORE_FUSE_OVERLAP_THREADS (default 1,
 * 0 on one CPU; none with FUSE over io_uring) more threads are started that sleep on their own
 * eventfd, out of /dev/fuse's wait queue, until two READs come from different senders (the pid
 * of fuse_in_header: a process or a thread) within OVERLAP_GAP_NS; they then read /dev/fuse as
 * the others do until OVERLAP_HOLD_NS pass without such a pair (and not while their own remote
 * calls are in flight). Only READs count: warm readers' OPENs and RELEASEs are quick, and an
 * extra thread reading them cost 4 warm readers ~6%. Measured in docs/performance.md
 * (twenty-seventh session); status c_fuse_overlap_threads, c_fuse_overlaps (quiet spells ended),
 * c_fuse_overlap_reads (requests the extra threads read).
 *
 * A remote READ's request may be sent by the thread that read it (FANSTORE_CREMOTE_DIRECT,
 * _shim_remote.c), inside MPI_Isend. That call can stay for good: the OFI netmod retries its
 * connection to a dead peer inside MPI_Isend (bind, connect, epoll, again), holding MPICH's
 * lock (docs/reliability.md). fanstore_threads_mpi brackets such a call. The remote thread's
 * reaper calls fanstore_threads_unstick every 200 ms, which starts one more thread for each
 * one inside MPI for SPARE_NS or more, so that the session's other requests are still read
 * (the stuck READ itself is answered by its call's deadline). While a thread is inside MPI for
 * FANSTORE_STUCK_NS or more, fanstore_threads_direct_ok says no to every thread: they queue
 * their requests for the remote thread, and the deadlines answer them.
 *
 * The threads run SCHED_BATCH (FANSTORE_FUSE_BATCH=0: SCHED_OTHER): a woken batch thread does
 * not preempt the task that woke it. A reader's RELEASE is sent in the background, so its
 * reader runs on and sends its next OPEN; a thread that preempts it at once answers the RELEASE,
 * finds nothing, sleeps, and is woken again by the OPEN. On this VM a sleep and wake-up cost
 * ~16 us, more than a whole C answer (~6 us): 4 warm readers cost the thread 0.84-0.95
 * switches per file against squashfuse_ll's 0.33-0.46, and 16-28 us of CPU per file against
 * 11-15. As a batch thread it takes 0.43 switches and 8.5-12 us per file, idle or beside two
 * CPU hogs (docs/performance.md, fifteenth session). Fairness (the thread's share) is the same;
 * a request that blocks its reader (OPEN, READ) frees that reader's CPU at once anyway.
 *
 * Pinned one per CPU (FANSTORE_FUSE_PIN: "auto", where there are no more CPUs than request
 * threads; "1" always; "overlap", the default, as "auto" but only while READs overlap; "0"
 * never): the first request thread and the overlap thread each keep one CPU of the process's
 * affinity set (from the node-local rank's offset:
 * MPI_LOCALRANKID, SLURM_LOCALID, OMPI_COMM_WORLD_LOCAL_RANK, so that local ranks do not
 * share theirs). Left to the scheduler on 2 CPUs, the two threads often ran on the same one,
 * and 4 readers blocked on them left the other idle: copy-cached 4-reader passes idled 19% of
 * the CPUs against 10% pinned, 11,708 against 13,622 files/s, and cold ones 9,780 / 9,778
 * against 10,355 / 11,095 (docs/performance.md, thirty-second session). But warm 4-reader
 * passes, where only the first thread works, ran 4-15% slower pinned (bench-quick's warm 4r
 * against squashfuse_ll fell to 0.95x), so "1" and "auto" are not the default. "overlap" (the
 * default where the variable is unset or empty) pins only while READs overlap: the first
 * overlap thread pins every request thread (those counted in `pinned` each time) when it
 * leaves park() to read, and gives them the whole set back before it parks again, so warm
 * passes (no overlapping READs) stay with the scheduler; measured in docs/performance.md,
 * thirty-third session.
 * With "auto" and more CPUs than threads the scheduler's spreading is left alone. Status:
 * c_fuse_pinned (threads pinned, each time).
 *
 * Before each blocking read a thread polls /dev/fuse for up to FANSTORE_FUSE_SPIN_US (default
 * SPIN_US_DEFAULT; 0: never), yielding the CPU to any task that wants it, but only while no CPU
 * is wanted by more tasks than it can run (the running count of /proc/loadavg). One reader's
 * file is a ping-pong of LOOKUP, OPEN, READ (cold) and RELEASE with the thread: between two
 * requests the reader works a few tens of microseconds, and a thread that sleeps meanwhile is
 * woken by an interrupt to a halted CPU, which on this VM (cpuidle none: an idle vCPU halts, a
 * VM exit) costs more than the answer; a bare-metal CPU in a deep C-state pays its exit
 * latency the same way. Polled, one reader's warm files/s went 1.8-2x and cold ~1.6x, for
 * ~22 us more of the daemon's CPU per warm file (the polling is CPU time, and counted so);
 * with 4 readers the gate leaves it off (docs/performance.md, seventeenth session). No poll
 * follows a request whose answer another thread sends (fanstore_reply_later: a remote fetch,
 * a READ thread, trio): its reader sends nothing until then, and polling cost the thread
 * ~110 us per remote file. Nor while requests queue up: after QUEUED_STREAK requests in a row
 * found waiting at the first look, the thread reads without polling until a read sleeps
 * (fio's 4 KiB libaio reads otherwise paid a poll per request). Counters: c_fuse_spins,
 * c_fuse_spin_hits (a request came within the window).
 *
 * A thread that reads an error other than EINTR/EAGAIN/ENOENT (ENODEV: unmounted) ends the
 * session as libfuse's loop would: the queue then says 0 (or -errno) to pyfuse3 forever. The
 * interposed fuse_session_unmount and fuse_session_destroy (_shim_push.c's) stop the threads first (cancelled in
 * their blocking read, the only point where cancellation is on, as libfuse's loop does, then
 * joined), before libfuse closes the descriptor; requests still queued are dropped with the
 * session (the kernel fails them when the connection goes). A thread still inside MPI is
 * joined for at most a second, then left behind (it is cancelled when it reaches its next
 * read; the process ends with it).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <time.h>
#include <unistd.h>

#include "_shim_ops.h"

#define MAX_THREADS 16
#define HEADER_MAX 4096              /* libfuse's FUSE_BUFFER_HEADER_SIZE */
#define COPY_MAX (128u << 10)        /* larger requests (WRITE) hand over the thread's buffer */

__thread int fanstore_c_thread; /* 1 on the threads below */
__thread int fanstore_reply_later; /* set by whoever leaves the answer to another thread */

typedef void (*process_t)(struct fuse_session *, const struct fuse_buf *);
typedef int (*session_fd_t)(struct fuse_session *);
typedef void (*session_void_t)(struct fuse_session *);

struct item {
    struct item *next;
    char *mem;
    size_t len;
};

static int wanted;                 /* fuse_threads(n) */
static int running;                /* threads started (0: pyfuse3 reads /dev/fuse itself) */
static pthread_t tids[MAX_THREADS];
static pid_t ktids[MAX_THREADS];       /* their kernel thread ids (0: not started or gone) */
static struct fuse_session *tse;   /* the session they serve */
static int dev_fd = -1, efd = -1;  /* /dev/fuse, and the eventfd pyfuse3 waits on */
static size_t bufsize;
static process_t real_process;
static pthread_mutex_t qlock = PTHREAD_MUTEX_INITIALIZER;
static struct item *head, *tail;
static int end_res = 1;            /* 1: running; else what receive_buf returns (0 or -errno) */
static unsigned long long answered, handed, spares;
static int batch = 1;               /* FANSTORE_FUSE_BATCH (0: SCHED_OTHER as before) */
static unsigned long long batched;  /* threads that run SCHED_BATCH */
static int pin_n;                   /* CPUs to pin request threads to (0: none) */
static int pin_dynamic;             /* FANSTORE_FUSE_PIN=overlap: only while READs overlap */
static int pinned_now;              /* the overlap thread 0 pinned them all (its own state) */
static cpu_set_t pin_all_cpus;      /* the affinity set before pinning */
static int pin_cpu[MAX_THREADS];    /* the k-th request thread's CPU: pin_cpu[k % pin_n] */
static unsigned long long pinned;   /* threads pinned */
static pthread_mutex_t tlock = PTHREAD_MUTEX_INITIALIZER; /* running, tids, replaced, stopping */
static int stopping;
static int64_t mpi_since[MAX_THREADS]; /* ns of CLOCK_MONOTONIC the thread is inside MPI since; 0: not */
static char replaced[MAX_THREADS];     /* a thread was started in its place */
static __thread int my_index = -1;
#define MAX_RINGS 1024                 /* as _shim_uring.c's MAX_QUEUES */
static int64_t ring_mpi_since[MAX_RINGS]; /* the same, for ring threads that send remote READs */
static __thread int my_ring = -1;      /* a ring thread's queue, when it may call MPI */
static int rings_seen;                 /* 1 + the highest such queue (atomic) */
#define SPARE_NS 500000000LL           /* inside MPI this long: another thread reads requests */

/* Threads woken while readers overlap (FANSTORE_FUSE_OVERLAP_THREADS, see thread_main): they
 * sleep on their own eventfd until a request comes from another process or thread than the one
 * before it within OVERLAP_GAP_NS, and read /dev/fuse as the others do until OVERLAP_HOLD_NS
 * pass without such a request. */
#define OVERLAP_GAP_NS 2000000LL
#define OVERLAP_HOLD_NS 20000000LL
static int extra_threads;              /* started after the `wanted` ones, index wanted.. */
static int park_fds[MAX_THREADS];      /* each extra thread's eventfd */
static int64_t overlap_until;          /* ns of CLOCK_MONOTONIC (atomic) */
static uint32_t last_pid;              /* the sender of the last request seen (atomic) */
static int64_t last_pid_ns;
static unsigned long long overlap_starts, extra_reads;
static __thread int my_extra = -1;     /* an extra thread's number, else -1 */

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static void *xmalloc(size_t n) { /* never drop a request: wait for memory */
    void *p;
    while ((p = malloc(n)) == NULL)
        nanosleep(&(struct timespec){0, 1000000}, NULL);
    return p;
}

static void bell(int on) { /* efd readable iff the queue holds a request or the session ended */
    uint64_t v = 1;
    if (on)
        (void)!write(efd, &v, sizeof(v));
    else
        (void)!read(efd, &v, sizeof(v));
}

static void push(char **mem, size_t len) {
    struct item *it = xmalloc(sizeof(*it));
    if (len <= COPY_MAX) {
        it->mem = xmalloc(len);
        memcpy(it->mem, *mem, len);
    } else { /* a big WRITE: the buffer itself, the thread takes a new one */
        it->mem = *mem;
        *mem = xmalloc(bufsize);
    }
    it->len = len;
    it->next = NULL;
    pthread_mutex_lock(&qlock);
    if (tail != NULL)
        tail->next = it;
    else {
        head = it;
        if (end_res == 1)
            bell(1);
    }
    tail = it;
    __atomic_add_fetch(&handed, 1, __ATOMIC_RELAXED);
    pthread_mutex_unlock(&qlock);
}

static void end_session(int res) {
    pthread_mutex_lock(&qlock);
    if (end_res == 1) {
        end_res = res;
        if (head == NULL)
            bell(1); /* stays readable: every pyfuse3 task waiting wakes and ends */
    }
    pthread_mutex_unlock(&qlock);
}

static void free_buffer(void *mem) { free(*(char **)mem); }

#define SPIN_US_DEFAULT 50
#define QUEUED_NS 5000 /* a read that took longer slept: requests no longer queue */
#define QUEUED_STREAK 8 /* one reader's RELEASE and next OPEN come as a pair: not a queue */
static long long spin_ns; /* FANSTORE_FUSE_SPIN_US (microseconds), 0: no spin */
static int ncpus, loadavg_fd = -1;
static unsigned long long spins, spin_hits, spin_ns_total;

/* Whether no CPU is wanted by more tasks than it can run: the running count of /proc/loadavg
 * (this thread included) at most the online CPUs. */
static int cpu_to_spare(void) {
    char b[128];
    if (loadavg_fd < 0)
        return 0;
    ssize_t n = pread(loadavg_fd, b, sizeof(b) - 1, 0);
    if (n <= 0)
        return 0;
    b[n] = 0;
    const char *f = b;
    for (int i = 0; i < 3 && f != NULL; i++) /* the fourth field: running/total */
        if ((f = strchr(f, ' ')) != NULL)
            f++;
    return f != NULL && atoi(f) <= ncpus;
}

/* Polls /dev/fuse for up to spin_ns, yielding to any other task that wants this CPU, and
 * stops as soon as more tasks want to run than there are CPUs. Returns 2 when a request was
 * already waiting at the first look, 1 when one came while polling, 0 when none came. */
static int spin_for_request(void) {
    struct pollfd p = {.fd = dev_fd, .events = POLLIN};
    if (poll(&p, 1, 0) > 0)
        return 2;
    if (!cpu_to_spare())
        return 0;
    __atomic_add_fetch(&spins, 1, __ATOMIC_RELAXED);
    int64_t start = now_ns(), until = start + spin_ns;
    int hit = 0;
    for (;;) {
        sched_yield();
        if (poll(&p, 1, 0) > 0) {
            __atomic_add_fetch(&spin_hits, 1, __ATOMIC_RELAXED);
            hit = 1;
            break;
        }
        if (now_ns() > until)
            break;
        if (!cpu_to_spare()) /* a task waits for a CPU, perhaps the other one: sleep, so that */
            break;           /* this one goes idle and takes it */
    }
    __atomic_add_fetch(&spin_ns_total, (unsigned long long)(now_ns() - start), __ATOMIC_RELAXED);
    return hit;
}

/* A READ read: does its sender overlap the last READ's? (Other requests, and the kernel's own,
 * pid 0, say nothing.) The first overlap after a quiet spell wakes the extra threads. */
static void note_sender(const char *mem) {
    uint32_t opcode, pid;
    memcpy(&opcode, mem + 4, sizeof(opcode)); /* fuse_in_header: len, opcode, unique, nodeid, */
    memcpy(&pid, mem + 32, sizeof(pid));      /* uid, gid, pid */
    if (pid == 0 || opcode != 15) /* READs only: warm readers' OPENs and RELEASEs are quick */
        return;
    int64_t t = now_ns();
    uint32_t was_pid = __atomic_exchange_n(&last_pid, pid, __ATOMIC_RELAXED);
    int64_t was_at = __atomic_exchange_n(&last_pid_ns, t, __ATOMIC_RELAXED);
    if (was_pid == 0 || was_pid == pid || t - was_at > OVERLAP_GAP_NS)
        return;
    if (__atomic_exchange_n(&overlap_until, t + OVERLAP_HOLD_NS, __ATOMIC_ACQ_REL) >= t)
        return; /* already overlapping: the extras are up */
    __atomic_add_fetch(&overlap_starts, 1, __ATOMIC_RELAXED);
    uint64_t v = 1;
    for (int k = 0; k < extra_threads; k++)
        (void)!write(park_fds[k], &v, sizeof(v));
}

static int overlapping(void) {
    return now_ns() < __atomic_load_n(&overlap_until, __ATOMIC_ACQUIRE);
}

/* FANSTORE_FUSE_PIN=overlap: the first overlap thread pins every request thread one per CPU
 * when it starts reading (READs overlap), and gives them their whole set back when it parks.
 * By kernel thread id (sched_setaffinity), not pthread_t: a thread that ended, even one joined
 * by stop() meanwhile, is then an ESRCH, never a freed handle. */
static void pin_all(int on) {
    for (int k = 0; k < wanted + extra_threads && k < MAX_THREADS; k++) {
        pid_t t = __atomic_load_n(&ktids[k], __ATOMIC_ACQUIRE);
        cpu_set_t one;
        CPU_ZERO(&one);
        CPU_SET(pin_cpu[k % pin_n], &one);
        if (t > 0 && sched_setaffinity(t, sizeof(cpu_set_t), on ? &one : &pin_all_cpus) == 0 && on)
            __atomic_add_fetch(&pinned, 1, __ATOMIC_RELAXED);
    }
}

/* An extra thread with nothing to do: sleeps on its eventfd until readers overlap again.
 * Returns 1 when it slept (or drained a stale wake-up), 0 when it should read now. */
static int park(void) {
    int manager = pin_dynamic && pin_n > 0 && my_extra == 0;
    if (overlapping() || fanstore_remote_own_calls() > 0) {
        if (manager && !pinned_now && overlapping()) {
            pin_all(1);
            pinned_now = 1;
        }
        return 0; /* its own remote calls are answered by its wait below first */
    }
    uint64_t v;
    (void)!read(park_fds[my_extra], &v, sizeof(v)); /* non-blocking: a stale wake-up gone */
    if (overlapping())
        return 0;
    if (manager && pinned_now) {
        pin_all(0);
        pinned_now = 0;
    }
    struct pollfd p = {.fd = park_fds[my_extra], .events = POLLIN};
    pthread_setcancelstate(PTHREAD_CANCEL_ENABLE, NULL);
    (void)poll(&p, 1, -1); /* a cancellation point, as read() below */
    pthread_setcancelstate(PTHREAD_CANCEL_DISABLE, NULL);
    return 1;
}

static void *thread_main(void *arg) {
    my_index = (int)(intptr_t)arg;
    fanstore_c_thread = 1;
    if (my_index >= 0 && my_index < MAX_THREADS)
        __atomic_store_n(&ktids[my_index], (pid_t)gettid(), __ATOMIC_RELEASE);
    if (my_index >= wanted && my_index < wanted + extra_threads)
        my_extra = my_index - wanted;
    int queued = 0; /* requests found waiting at the first look, in a row (QUEUED_STREAK or
                     * more: read without polling) */
    pthread_setcancelstate(PTHREAD_CANCEL_DISABLE, NULL);
    char *mem = xmalloc(bufsize);
    if (batch) { /* see the top of the file */
        struct sched_param sp = {0};
        if (pthread_setschedparam(pthread_self(), SCHED_BATCH, &sp) == 0)
            __atomic_add_fetch(&batched, 1, __ATOMIC_RELAXED);
    }
    if (pin_n > 0 && !pin_dynamic && my_index >= 0 && my_index < wanted + extra_threads) {
        cpu_set_t one;
        CPU_ZERO(&one);
        CPU_SET(pin_cpu[my_index % pin_n], &one);
        if (pthread_setaffinity_np(pthread_self(), sizeof(one), &one) == 0)
            __atomic_add_fetch(&pinned, 1, __ATOMIC_RELAXED);
    }
    pthread_cleanup_push(free_buffer, &mem);
    for (;;) {
        if (my_extra >= 0 && park())
            continue;
        /* a reader whose request another thread answers (a remote fetch, a READ thread, trio)
         * sends nothing meanwhile: no poll then; nor while requests queue up (found waiting
         * QUEUED_STREAK times in a row, until a read sleeps), where a poll would only add a
         * system call to each (libaio 4 KiB reads: 8% fewer IOPS) */
        int64_t t_read = 0;
        if (fanstore_remote_own_calls() > 0) {
            /* its remote READs answered here (_shim_remote_tbell.c), then a read without a poll:
             * polling after such an answer cost more CPU than the wake-up it saved */
            fanstore_remote_wait_own(dev_fd);
        } else if (spin_ns > 0 && !fanstore_reply_later) {
            if (queued >= QUEUED_STREAK)
                t_read = now_ns();
            else
                queued = spin_for_request() == 2 ? queued + 1 : 0;
        }
        fanstore_reply_later = 0;
        pthread_setcancelstate(PTHREAD_CANCEL_ENABLE, NULL);
        ssize_t n = read(dev_fd, mem, bufsize);
        pthread_setcancelstate(PTHREAD_CANCEL_DISABLE, NULL);
        if (t_read != 0 && now_ns() - t_read > QUEUED_NS)
            queued = 0; /* it slept: the queue ran dry */
        if (n < 0 && (errno == EINTR || errno == EAGAIN || errno == ENOENT))
            continue; /* ENOENT: the request was interrupted before it was read */
        if (n < 0 || (size_t)n < 40) { /* ENODEV: unmounted; a short read: as libfuse, EIO */
            end_session(n < 0 && errno == ENODEV ? 0 : -(n < 0 ? errno : EIO));
            break;
        }
        if (extra_threads > 0) {
            note_sender(mem);
            if (my_extra >= 0)
                __atomic_add_fetch(&extra_reads, 1, __ATOMIC_RELAXED);
        }
        uint32_t opcode;
        memcpy(&opcode, mem + 4, sizeof(opcode)); /* fuse_in_header: len, opcode, ... */
        if (opcode == 26) /* FUSE_INIT: does the kernel offer FUSE over io_uring? */
            fanstore_uring_saw_init(mem, (size_t)n);
        fanstore_threads_dispatch(&mem, (size_t)n);
    }
    pthread_cleanup_pop(1);
    return NULL;
}

void fanstore_threads_dispatch(char **mem, size_t len) {
    struct fuse_buf fb = {.size = len, .mem = *mem};
    if (fanstore_answered(&fb, (int)len, 0)) {
        real_process(tse, &fb);
        __atomic_add_fetch(&answered, 1, __ATOMIC_RELAXED);
    } else {
        push(mem, len);
        fanstore_reply_later = 1;
    }
}

void fanstore_threads_ring_thread(int qid) {
    fanstore_c_thread = 1;
    my_index = -1; /* no spare thread reads requests in its place */
    my_ring = qid >= 0 && qid < MAX_RINGS ? qid : -1;
    for (int seen = __atomic_load_n(&rings_seen, __ATOMIC_ACQUIRE); my_ring >= seen;)
        if (__atomic_compare_exchange_n(&rings_seen, &seen, my_ring + 1, 0, __ATOMIC_ACQ_REL,
                                        __ATOMIC_ACQUIRE))
            break;
}

int fanstore_threads_spawn(pthread_t *tid, void *(*fn)(void *), void *arg, const char *name, int n) {
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, &old); /* signals stay with the Python threads */
    int r = pthread_create(tid, NULL, fn, arg);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (r == 0) {
        char label[16];
        snprintf(label, sizeof(label), "%s%d", name, n);
        pthread_setname_np(*tid, label);
    }
    return r;
}

/* This process's node-local rank, where a launcher says it (0 otherwise). */
static int local_rank(void) {
    static const char *const names[] = {"MPI_LOCALRANKID", "SLURM_LOCALID",
                                        "OMPI_COMM_WORLD_LOCAL_RANK"};
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
        const char *v = getenv(names[i]);
        if (v != NULL && *v >= '0' && *v <= '9')
            return atoi(v);
    }
    return 0;
}

/* pin_n and pin_cpu for `threads` request threads (see the top of the file). */
static void plan_pinning(int threads) {
    pin_n = 0;
    const char *k = getenv("FANSTORE_FUSE_PIN");
    if (k == NULL || *k == '\0')
        k = "overlap"; /* the default */
    int always = strcmp(k, "1") == 0;
    pin_dynamic = strcmp(k, "overlap") == 0;
    pinned_now = 0;
    int never = strcmp(k, "auto") != 0 && !always && !pin_dynamic;
    cpu_set_t set;
    if (never || threads < 1 || sched_getaffinity(0, sizeof(set), &set) != 0)
        return;
    pin_all_cpus = set;
    int cpus[MAX_THREADS], n = 0;
    for (int c = 0; c < CPU_SETSIZE && n < MAX_THREADS; c++)
        if (CPU_ISSET(c, &set))
            cpus[n++] = c;
    if (n < 2 || (!always && CPU_COUNT(&set) > threads))
        return;
    int base = local_rank(); /* local ranks start on different CPUs */
    for (int i = 0; i < n; i++)
        pin_cpu[i] = cpus[(base + i) % n];
    pin_n = n;
}

static int spawn(int k) { /* thread k started (under tlock) */
    return fanstore_threads_spawn(&tids[k], thread_main, (void *)(intptr_t)k, "fanstore-fuse", k) == 0;
}

static int start(struct fuse_session *se, int fd) {
    real_process = (process_t)fanstore_libfuse_symbol("fuse_session_process_buf");
    if (real_process == NULL)
        return 0;
    efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (efd < 0)
        return 0;
    tse = se;
    dev_fd = fd;
    bufsize = (size_t)256 * (size_t)sysconf(_SC_PAGESIZE) + HEADER_MAX; /* libfuse's bufsize */
    const char *b = getenv("FANSTORE_FUSE_BATCH");
    batch = b == NULL || strcmp(b, "0") != 0;
    const char *sp = getenv("FANSTORE_FUSE_SPIN_US");
    spin_ns = (sp != NULL ? atoll(sp) : SPIN_US_DEFAULT) * 1000LL;
    int rings = 0;
    if (fanstore_uring_wanted()) {
        /* every libfuse reply through _shim_uring.c's writev (rings or /dev/fuse); the requests
         * the rings take do not come here, so these threads see few and need no poll */
        typedef int (*custom_io_t)(struct fuse_session *, const struct fuse_custom_io *, int);
        custom_io_t set_io = (custom_io_t)fanstore_libfuse_symbol("fuse_session_custom_io");
        static const struct fuse_custom_io io = {.writev = fanstore_uring_writev,
                                                 .read = fanstore_uring_read};
        if (set_io != NULL && set_io(se, &io, fd) == 0) {
            fanstore_uring_setup(fd, bufsize);
            spin_ns = 0;
            rings = 1;
        }
    }
    ncpus = (int)sysconf(_SC_NPROCESSORS_ONLN);
    const char *ot = getenv("FANSTORE_FUSE_OVERLAP_THREADS");
    extra_threads = ot != NULL && *ot != '\0' ? atoi(ot) : (ncpus > 1 ? 1 : 0);
    if (rings || extra_threads < 0 || wanted <= 0)
        extra_threads = 0; /* with rings, the requests come from them */
    if (extra_threads > MAX_THREADS / 2 - wanted)
        extra_threads = MAX_THREADS / 2 - wanted > 0 ? MAX_THREADS / 2 - wanted : 0;
    for (int k = 0; k < extra_threads; k++)
        if ((park_fds[k] = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)) < 0) {
            for (int j = 0; j < k; j++)
                close(park_fds[j]);
            extra_threads = 0;
        }
    plan_pinning(wanted + extra_threads);
    __atomic_store_n(&overlap_until, 0, __ATOMIC_RELEASE);
    __atomic_store_n(&last_pid, 0, __ATOMIC_RELAXED);
    if (spin_ns > 0 && loadavg_fd < 0)
        loadavg_fd = open("/proc/loadavg", O_RDONLY | O_CLOEXEC);
    end_res = 1;
    pthread_mutex_lock(&tlock);
    stopping = 0;
    memset(mpi_since, 0, sizeof(mpi_since));
    memset(replaced, 0, sizeof(replaced));
    for (running = 0; running < wanted + extra_threads; running++)
        if (!spawn(running))
            break;
    pthread_mutex_unlock(&tlock);
    if (running == 0) {
        close(efd);
        efd = -1;
        return 0;
    }
    return 1;
}

static void stop(void) {
    pthread_mutex_lock(&tlock);
    int n = running;
    stopping = 1;
    pthread_mutex_unlock(&tlock);
    fanstore_uring_stop(); /* no-op when no ring runs */
    if (n == 0)
        return;
    for (int k = 0; k < n; k++)
        pthread_cancel(tids[k]);
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_sec += 1; /* one inside MPI (a dead peer) is left behind */
    for (int k = 0; k < n; k++)
        if (__atomic_load_n(&mpi_since[k], __ATOMIC_ACQUIRE) == 0)
            pthread_join(tids[k], NULL);
        else if (pthread_timedjoin_np(tids[k], NULL, &until) != 0)
            pthread_detach(tids[k]);
    __atomic_store_n(&running, 0, __ATOMIC_RELEASE);
    for (int k = 0; k < MAX_THREADS; k++)
        __atomic_store_n(&ktids[k], 0, __ATOMIC_RELEASE);
    for (int k = 0; k < extra_threads; k++)
        close(park_fds[k]);
    extra_threads = 0;
    pthread_mutex_lock(&qlock);
    while (head != NULL) { /* never to be answered: the session goes */
        struct item *it = head;
        head = it->next;
        free(it->mem);
        free(it);
    }
    tail = NULL;
    pthread_mutex_unlock(&qlock);
}

int fanstore_threads_on(struct fuse_session *se) { return running > 0 && se == tse; }

void fanstore_threads_mpi(int inside) {
    if (my_index >= 0)
        __atomic_store_n(&mpi_since[my_index], inside ? now_ns() : 0, __ATOMIC_RELEASE);
    else if (my_ring >= 0)
        __atomic_store_n(&ring_mpi_since[my_ring], inside ? now_ns() : 0, __ATOMIC_RELEASE);
}

static int stuck_in(const int64_t *since, int n, int64_t t) {
    for (int k = 0; k < n; k++) {
        int64_t s = __atomic_load_n(&since[k], __ATOMIC_ACQUIRE);
        if (s != 0 && t - s >= FANSTORE_STUCK_NS)
            return 1;
    }
    return 0;
}

int fanstore_threads_direct_ok(void) {
    if (!fanstore_c_thread || (my_index < 0 && my_ring < 0))
        return 0; /* the trio thread, or a worker: nobody would read requests in its place */
    int n = __atomic_load_n(&running, __ATOMIC_ACQUIRE);
    if (my_index >= 0 && n >= MAX_THREADS)
        return 0; /* no room for a spare */
    /* a ring thread has no spare: while any thread is stuck inside MPI (a dead peer's netmod),
     * none sends, and the remote thread takes the calls */
    int64_t t = now_ns();
    return !stuck_in(mpi_since, n, t) &&
           !stuck_in(ring_mpi_since, __atomic_load_n(&rings_seen, __ATOMIC_ACQUIRE), t);
}

int fanstore_threads_unstick(void) {
    int made = 0;
    pthread_mutex_lock(&tlock);
    int64_t t = now_ns();
    for (int k = 0, n = running; k < n && !stopping && running > 0 && running < MAX_THREADS; k++) {
        int64_t since = __atomic_load_n(&mpi_since[k], __ATOMIC_ACQUIRE);
        if (since == 0 || t - since < SPARE_NS || replaced[k])
            continue;
        if (!spawn(running))
            break;
        replaced[k] = 1;
        __atomic_add_fetch(&running, 1, __ATOMIC_RELEASE);
        __atomic_add_fetch(&spares, 1, __ATOMIC_RELAXED);
        made++;
    }
    pthread_mutex_unlock(&tlock);
    return made;
}

int fanstore_threads_fd(void) { return efd; }

int fanstore_threads_queued(void) {
    return running > 0 && __atomic_load_n(&head, __ATOMIC_RELAXED) != NULL;
}

int fanstore_threads_dev_waiting(void) {
    int fd = __atomic_load_n(&dev_fd, __ATOMIC_RELAXED);
    struct pollfd p = {.fd = fd, .events = POLLIN};
    if (running > 0 && fanstore_uring_waiting())
        return 1; /* a request taken from a ring, not yet answered or handed on */
    return running > 0 && fd >= 0 && poll(&p, 1, 0) > 0 && (p.revents & POLLIN);
}

int fanstore_threads_pop(struct fuse_buf *buf) {
    pthread_mutex_lock(&qlock);
    struct item *it = head;
    int res = end_res;
    if (it != NULL) {
        head = it->next;
        if (head == NULL) {
            tail = NULL;
            if (end_res == 1)
                bell(0);
        }
    }
    pthread_mutex_unlock(&qlock);
    if (it == NULL) {
        session_void_t exit_ = (session_void_t)fanstore_libfuse_symbol("fuse_session_exit");
        if (res == 0 && exit_ != NULL)
            exit_(tse); /* as libfuse does on ENODEV: pyfuse3's loop ends */
        return res == 1 ? -EINTR : res;
    }
    free(buf->mem); /* pyfuse3's buffer of the previous request (malloc'd here or by libfuse) */
    buf->mem = it->mem;
    buf->size = it->len;
    buf->flags = 0;
    buf->pos = 0;
    int len = (int)it->len;
    free(it);
    return len;
}

int fuse_session_fd(struct fuse_session *se) {
    static session_fd_t real; /* looked up once: the READ path asks on every READ */
    if (real == NULL)
        real = (session_fd_t)fanstore_libfuse_symbol("fuse_session_fd");
    if (real == NULL || real == fuse_session_fd)
        return -1;
    int fd = real(se);
    if (fanstore_threads_on(se))
        return efd;
    if (wanted <= 0 || fd < 0 || running > 0 || se != fanstore_session || !start(se, fd))
        return fd;
    return efd;
}

void fuse_session_unmount(struct fuse_session *se) {
    session_void_t real = (session_void_t)fanstore_libfuse_symbol("fuse_session_unmount");
    if (se == tse)
        stop(); /* before libfuse closes the descriptor they read */
    if (real != NULL && real != fuse_session_unmount)
        real(se);
}

/* Called first by _shim_push.c's fuse_session_destroy (the one interposed there). */
void fanstore_threads_destroy(struct fuse_session *se) {
    if (se != tse)
        return;
    stop();
    tse = NULL;
    if (efd >= 0)
        close(efd);
    efd = -1;
    dev_fd = -1;
}

/* fuse_threads(n): the next session's requests read by n C threads (0: by pyfuse3). */
PyObject *fanstore_py_fuse_threads(PyObject *self, PyObject *args) {
    (void)self;
    int n;
    if (!PyArg_ParseTuple(args, "i", &n))
        return NULL;
    if (n < 0 || n > MAX_THREADS) {
        PyErr_Format(PyExc_ValueError, "fuse_threads: 0..%d threads", MAX_THREADS);
        return NULL;
    }
    wanted = n;
    Py_RETURN_NONE;
}

unsigned long long fanstore_threads_spares(void) { return __atomic_load_n(&spares, __ATOMIC_RELAXED); }

/* fuse_thread_counts(): (threads running, requests answered on them, handed to trio, threads
 * started SCHED_BATCH, spins before a read, spins that found a request, ns spent in spins,
 * extra threads, times readers began to overlap, requests the extra threads read, threads
 * pinned to a CPU) */
PyObject *fanstore_py_fuse_thread_counts(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    return Py_BuildValue("(iKKKKKKiKKK)", running - extra_threads,
                         __atomic_load_n(&answered, __ATOMIC_RELAXED),
                         __atomic_load_n(&handed, __ATOMIC_RELAXED),
                         __atomic_load_n(&batched, __ATOMIC_RELAXED),
                         __atomic_load_n(&spins, __ATOMIC_RELAXED),
                         __atomic_load_n(&spin_hits, __ATOMIC_RELAXED),
                         __atomic_load_n(&spin_ns_total, __ATOMIC_RELAXED), extra_threads,
                         __atomic_load_n(&overlap_starts, __ATOMIC_RELAXED),
                         __atomic_load_n(&extra_reads, __ATOMIC_RELAXED),
                         __atomic_load_n(&pinned, __ATOMIC_RELAXED));
}

/* fuse_queued(): whether a request waits in the queue for pyfuse3 (_fusequeue.waiting). */
PyObject *fanstore_py_fuse_queued(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    return PyBool_FromLong(fanstore_threads_queued());
}
