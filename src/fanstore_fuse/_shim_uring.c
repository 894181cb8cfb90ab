/* FUSE requests taken over io_uring (FANSTORE_FUSE_URING=1; Linux 6.14+, the fuse module's
 * enable_uring; issue 11, small files).
 *
 * Over /dev/fuse, each request wakes a daemon thread that sleeps in read(2), often on the other
 * CPU, and on this VM a wake-up of a halted vCPU costs more than a C answer
 * (_shim_threads.c). FUSE over io_uring queues a request on the queue of the CPU its reader
 * runs on; the daemon serves each queue from a thread pinned to that CPU, so a reader that
 * blocks on its request hands its CPU to the thread that answers it, and the answer and the
 * fetch of the next request are one io_uring_enter. Measured with one minimal C server both
 * ways (bench/fuse_transport.py): 2.8x the warm files/s of one reader, a fifth of the server's
 * CPU per file (docs/performance.md, twenty-fourth session).
 *
 * How it fits the shim:
 * - requests: the threads of _shim_threads.c still read /dev/fuse (INIT, FORGET, INTERRUPT,
 *   and everything until every queue is registered). Here one thread per CPU ("fanstore-ring
 *   N") takes its queue's requests, lays each out as /dev/fuse would have (the header, the
 *   op's argument struct, the rest) and hands it to fanstore_threads_dispatch: answered in C
 *   there, or queued for pyfuse3, exactly as a request read from /dev/fuse.
 * - replies: every reply leaves through libfuse's fuse_send_msg, which with a custom io
 *   (fuse_session_custom_io, set by _shim_threads.c when this is on) calls fanstore_uring_writev.
 *   A reply to a request taken from a ring is copied into that entry's buffers and committed
 *   (COMMIT_AND_FETCH, which also asks for the entry's next request) by the queue's own thread,
 *   whichever thread answered (C, trio, a READ thread, the remote thread): see send_cmd.
 *   Everything else (requests read from /dev/fuse, notifications) goes to /dev/fuse by writev.
 * - INIT: the daemon's INIT reply (libfuse 3.14 cannot ask for it) gets FUSE_OVER_IO_URING when
 *   the kernel offered it; once that reply is written the ring threads start and register
 *   their entries.
 * - end: fanstore_uring_stop (from _shim_threads.c's stop, before libfuse closes /dev/fuse)
 *   wakes each ring thread through an eventfd it polls in its ring, joins it, closes the ring.
 *   A ring that the kernel ends (unmount: -ENOTCONN) ends its thread too.
 * - scheduling: each ring thread is pinned to its CPU and runs SCHED_IDLE (but see the end of
 *   this item; FANSTORE_FUSE_URING_IDLE=0: SCHED_OTHER). A reader's RELEASE is sent in the
 *   background and wakes its CPU's ring thread while the reader runs on; with two runnable
 *   tasks on that CPU the other, idle CPU pulled the reader over, and its next requests went to the other queue,
 *   each move a wake-up of a halted vCPU: one warm reader got 11-14k files/s at 17 us of ring
 *   CPU per file, 30k at 5 us with the reader pinned. An idle-class ring thread does not count
 *   as load there and runs once the reader blocks: 35-38k files/s at 3.4 us, unpinned. Unpinned
 *   ring threads: 10-11k (python /tmp scratch of bench._workload.read_rate, 2,000 warm files,
 *   twenty-fourth session). Beside a CPU hog pinned to the reader's CPU it still served 20k
 *   files/s (18.5-19k as SCHED_OTHER, 6.4k over /dev/fuse): the idle class did not starve it
 *   there; a CPU loaded with several busy tasks was not measured. An idle-class thread that
 *   must run to submit another thread's reply (a kick) is made SCHED_OTHER until it waits again
 *   (FANSTORE_FUSE_URING_BOOST=0: not): cold 4 readers 8,232 against 7,771 files/s; with
 *   SCHED_OTHER ring threads 10,614, which lose warm 1 reader instead (docs/performance.md).
 *   So by default (FANSTORE_FUSE_URING_IDLE unset or "auto"; "1": always the idle class) a
 *   ring thread that takes a request while another of its queue is still held (readers
 *   overlap: one reader never does) runs SCHED_OTHER until CONTENDED_NS pass without another
 *   overlap: it then waits with that timeout and goes back to the idle class
 *   (status c_uring_contended counts the switches).
 * - ring writes happen in order: an SQE is filled, then published (the tail moved) under the
 *   queue's lock; only the queue's own thread submits (with its next wait: one io_uring_enter
 *   per request answered there), other threads publish theirs and kick it (an eventfd polled
 *   in its ring).
 * No liburing: the three system calls and the ring layout of <linux/io_uring.h>.
 * - remote READs: the ring thread sends a small whole blob's request itself with its own reply
 *   bell (_shim_remote_tbell.c), as a C FUSE thread does, and polls that bell's fds in its ring
 *   (multishot, from its first such READ on); rung, it takes the reply and answers the READ,
 *   so the commit needs no kick. With calls in flight it waits at most FANSTORE_BELL_WAIT_NS
 *   and probes (a lost bell). While any thread is stuck inside MPI none sends (the remote
 *   thread does): a ring thread has no spare to take its queue meanwhile.
 *   FANSTORE_FUSE_URING_DIRECT=0: the remote thread sends and answers them all (as before).
 *   Measured (bench.cost, 2 ranks, one reader): 205 us of daemon CPU per remote file against
 *   251, the requester's remote thread 0.5 us per file (docs/performance.md).
 */
#define _GNU_SOURCE
#include <Python.h>
#include <errno.h>
#include <linux/fuse.h>
#include <linux/io_uring.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#include "_fuse_uring_abi.h"
#include "_shim_ops.h"

#define MAX_DEPTH 16        /* entries per queue, at most */
#define MAX_QUEUES 1024     /* as the kernel, one per CPU the system is configured for */
#define RING_BUFFERS_MIB 256 /* the depth: 16, fewer where this many 1 MiB payloads would not do */
#define SQE_SIZE 128        /* IORING_SETUP_SQE128 */
#define STOP_TAG 1          /* user_data of the stop eventfd's poll */
#define KICK_TAG 2          /* user_data of the kick eventfd's (multishot) poll */
#define BELL_TAG 3          /* 3 and 4: the ring thread's reply bell's fds (multishot polls) */

struct ent {
    struct fuse_uring_header *hdr;
    char *payload;
    struct iovec iov[2];
    uint64_t unique;        /* the request it holds, 0: none (atomic) */
    uint64_t commit_id;
    int last_cmd;
    struct queue *q;
};

struct queue {
    int qid, fd, evfd, kickfd;
    int boosted;            /* SCHED_OTHER for a kick, until its thread waits again (atomic) */
    int held;               /* entries holding a request not yet answered (atomic) */
    int other;              /* its thread runs SCHED_OTHER now (its thread only) */
    int64_t contended_at;   /* when a request last came while another was held (its thread) */
    pthread_t tid;
    int up;
    pthread_mutex_t lock;   /* the submission side */
    unsigned *sq_head, *sq_tail, sq_mask, sq_entries, *sq_array;
    unsigned *cq_head, *cq_tail, cq_mask;
    char *sqes;
    struct io_uring_cqe *cqes;
    void *sq_ptr, *cq_ptr;
    size_t sq_len, cq_len, sqes_len;
    struct ent ents[MAX_DEPTH];
};

static int wanted = -1;     /* FANSTORE_FUSE_URING, read once: 1 asks for it */
/* FANSTORE_FUSE_URING_IDLE: ring threads SCHED_OTHER (0), SCHED_IDLE (1), or SCHED_IDLE until
 * requests overlap, then SCHED_OTHER for CONTENDED_NS after the last overlap (auto, the default) */
#define POLICY_OTHER 0
#define POLICY_IDLE 1
#define POLICY_AUTO 2
#define CONTENDED_NS 20000000LL
static int idle_policy = POLICY_AUTO;
static int boost = 1;       /* FANSTORE_FUSE_URING_BOOST: a kicked idle ring thread runs SCHED_OTHER */
static int direct = 1;      /* FANSTORE_FUSE_URING_DIRECT: ring threads send remote READs */
static int dev_fd = -1;
static size_t payload_len;
static int depth = MAX_DEPTH; /* entries per queue (start_rings; FANSTORE_FUSE_URING_DEPTH) */
static uint64_t init_unique;
static int init_offered;    /* the INIT request offered FUSE_OVER_IO_URING */
static int nq;
static struct queue *queues[MAX_QUEUES];
static int live;            /* rings started (atomic) */
static unsigned long long by_ring, commits_elsewhere, ring_errors, contended_switches;

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000LL + t.tv_nsec;
}

/* The ring thread's own class (from the thread itself). */
static void set_other(struct queue *q, int other) {
    struct sched_param sp = {0};
    (void)pthread_setschedparam(pthread_self(), other ? SCHED_OTHER : SCHED_IDLE, &sp);
    q->other = other;
}

int fanstore_uring_wanted(void) {
    if (wanted < 0) {
        const char *v = getenv("FANSTORE_FUSE_URING");
        wanted = v != NULL && strcmp(v, "1") == 0;
    }
    return wanted;
}

/* --- the ring itself: setup, one SQE, submit, the completions --- */

static int ring_setup(struct queue *q) {
    struct io_uring_params p;
    memset(&p, 0, sizeof(p));
    p.flags = IORING_SETUP_SQE128 | IORING_SETUP_CQSIZE;
    p.cq_entries = 4 * (unsigned)depth + 8; /* the entries', and the stop, kick and bell polls' */
    q->fd = (int)syscall(__NR_io_uring_setup, (unsigned)depth + 4, &p);
    if (q->fd < 0)
        return -errno;
    q->sq_len = p.sq_off.array + p.sq_entries * sizeof(unsigned);
    q->cq_len = p.cq_off.cqes + p.cq_entries * sizeof(struct io_uring_cqe);
    int single = (p.features & IORING_FEAT_SINGLE_MMAP) != 0;
    if (single && q->cq_len > q->sq_len)
        q->sq_len = q->cq_len;
    q->sq_ptr = mmap(NULL, q->sq_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, q->fd,
                     IORING_OFF_SQ_RING);
    if (q->sq_ptr == MAP_FAILED)
        return -errno;
    q->cq_ptr = single ? q->sq_ptr
                       : mmap(NULL, q->cq_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE,
                              q->fd, IORING_OFF_CQ_RING);
    if (q->cq_ptr == MAP_FAILED)
        return -errno;
    q->sqes_len = (size_t)p.sq_entries * SQE_SIZE;
    q->sqes = mmap(NULL, q->sqes_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, q->fd,
                   IORING_OFF_SQES);
    if (q->sqes == MAP_FAILED)
        return -errno;
    char *sq = q->sq_ptr, *cq = q->cq_ptr;
    q->sq_head = (unsigned *)(sq + p.sq_off.head);
    q->sq_tail = (unsigned *)(sq + p.sq_off.tail);
    q->sq_mask = *(unsigned *)(sq + p.sq_off.ring_mask);
    q->sq_entries = p.sq_entries;
    q->sq_array = (unsigned *)(sq + p.sq_off.array);
    q->cq_head = (unsigned *)(cq + p.cq_off.head);
    q->cq_tail = (unsigned *)(cq + p.cq_off.tail);
    q->cq_mask = *(unsigned *)(cq + p.cq_off.ring_mask);
    q->cqes = (struct io_uring_cqe *)(cq + p.cq_off.cqes);
    int fds[1] = {dev_fd};
    if (syscall(__NR_io_uring_register, q->fd, IORING_REGISTER_FILES, fds, 1) != 0)
        return -errno;
    return 0;
}

/* The next free SQE, zeroed, or NULL when the ring is full (under q->lock). It is the kernel's
 * to take only once sqe_publish moved the tail past it: a wait of the ring thread submits
 * whatever is published, without the lock. */
static struct io_uring_sqe *sqe_get(struct queue *q) {
    unsigned tail = *q->sq_tail, head = __atomic_load_n(q->sq_head, __ATOMIC_ACQUIRE);
    if (tail - head >= q->sq_entries)
        return NULL;
    struct io_uring_sqe *sqe = (struct io_uring_sqe *)(q->sqes + (size_t)(tail & q->sq_mask) * SQE_SIZE);
    memset(sqe, 0, SQE_SIZE);
    q->sq_array[tail & q->sq_mask] = tail & q->sq_mask;
    return sqe;
}

static void sqe_publish(struct queue *q) {
    __atomic_store_n(q->sq_tail, *q->sq_tail + 1, __ATOMIC_RELEASE);
}

static void cmd_sqe(struct queue *q, struct ent *e, int cmd, struct io_uring_sqe *sqe) {
    sqe->opcode = IORING_OP_URING_CMD;
    sqe->flags = IOSQE_FIXED_FILE;
    sqe->fd = 0; /* the registered /dev/fuse */
    sqe->cmd_op = (uint32_t)cmd;
    sqe->user_data = (uint64_t)(uintptr_t)e;
    if (cmd == FUSE_URING_CMD_REGISTER) {
        sqe->addr = (uint64_t)(uintptr_t)e->iov;
        sqe->len = 2;
    }
    struct fuse_uring_cmd req = {.qid = (uint16_t)q->qid,
                               .commit_id = cmd == FUSE_URING_CMD_REGISTER ? 0 : e->commit_id};
    memcpy((char *)sqe + offsetof(struct io_uring_sqe, cmd), &req, sizeof(req));
    e->last_cmd = cmd;
}

/* Queue `e`'s command (a commit and fetch, or a register again) for the queue's own thread,
 * which submits it with its next wait; another thread kicks it awake. Only the ring thread ever
 * submits: io_uring cancels a command when the thread that submitted it ends, and a fetch
 * stays in flight until a request comes, so a commit submitted by a short-lived thread (a
 * Python worker answering a READ) lost its entry when that thread ended, and the queue with it
 * (the reader of the next request there hung). */
static int send_cmd(struct queue *q, struct ent *e, int cmd) {
    pthread_mutex_lock(&q->lock);
    struct io_uring_sqe *sqe = q->fd >= 0 ? sqe_get(q) : NULL;
    int r = q->fd >= 0 ? -EBUSY : -ENOTCONN; /* EBUSY cannot happen: an SQE per entry, two more */
    if (sqe != NULL) {
        cmd_sqe(q, e, cmd, sqe);
        sqe_publish(q);
        r = 0;
    }
    pthread_mutex_unlock(&q->lock);
    if (r != 0)
        __atomic_add_fetch(&ring_errors, 1, __ATOMIC_RELAXED);
    else if (!pthread_equal(pthread_self(), q->tid)) {
        uint64_t one = 1;
        if (idle_policy != POLICY_OTHER && boost && !__atomic_load_n(&q->other, __ATOMIC_RELAXED) &&
            !__atomic_exchange_n(&q->boosted, 1, __ATOMIC_ACQ_REL)) {
            struct sched_param sp = {0}; /* it must run to submit this reply: no waiting for */
            (void)pthread_setschedparam(q->tid, SCHED_OTHER, &sp); /* an idle CPU */
        }
        (void)!write(q->kickfd, &one, sizeof(one));
    }
    return r;
}

static void poll_sqe(struct queue *q, int fd, uint64_t tag, int multishot) { /* under q->lock */
    struct io_uring_sqe *sqe = sqe_get(q);
    if (sqe == NULL)
        return;
    sqe->opcode = IORING_OP_POLL_ADD;
    sqe->fd = fd;
    sqe->poll32_events = POLLIN;
    sqe->len = multishot ? IORING_POLL_ADD_MULTI : 0;
    sqe->user_data = tag;
    sqe_publish(q);
}

/* --- requests in --- */

static void take(struct queue *q, struct ent *e, char **mem) {
    struct fuse_in_header in;
    memcpy(&in, e->hdr->in_out, sizeof(in));
    uint32_t pay = e->hdr->ent.payload_sz;
    size_t op = in.len >= sizeof(in) + pay ? in.len - sizeof(in) - pay : SIZE_MAX;
    e->commit_id = e->hdr->ent.commit_id;
    if (op > sizeof(e->hdr->op_in) || pay > payload_len) { /* not what the ABI says: refuse */
        struct fuse_out_header oh = {sizeof(oh), -EIO, in.unique};
        memcpy(e->hdr->in_out, &oh, sizeof(oh));
        e->hdr->ent.payload_sz = 0;
        __atomic_add_fetch(&ring_errors, 1, __ATOMIC_RELAXED);
        send_cmd(q, e, FUSE_URING_CMD_COMMIT_AND_FETCH);
        return;
    }
    memcpy(*mem, &in, sizeof(in)); /* as /dev/fuse lays it out */
    memcpy(*mem + sizeof(in), e->hdr->op_in, op);
    memcpy(*mem + sizeof(in) + op, e->payload, pay);
    __atomic_store_n(&e->unique, in.unique, __ATOMIC_RELEASE);
    /* another request of this queue not answered yet: readers overlap here, and an idle-class
     * thread would wait for a CPU with nothing else to run (cold 4 readers); SCHED_OTHER for a
     * while. One reader never overlaps (its RELEASE is answered at once, inline). */
    if (__atomic_fetch_add(&q->held, 1, __ATOMIC_ACQ_REL) > 0 && idle_policy == POLICY_AUTO) {
        q->contended_at = now_ns();
        if (!q->other) {
            set_other(q, 1);
            __atomic_add_fetch(&contended_switches, 1, __ATOMIC_RELAXED);
        }
    }
    __atomic_add_fetch(&by_ring, 1, __ATOMIC_RELAXED);
    fanstore_threads_dispatch(mem, in.len);
}

static void *ring_main(void *arg) {
    struct queue *q = arg;
    q->tid = pthread_self(); /* before its first answer: send_cmd tells its own thread by it */
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(q->qid, &set);
    (void)sched_setaffinity(0, sizeof(set), &set); /* a CPU we may not run on: served anyway */
    if (idle_policy != POLICY_OTHER) /* see the top of the file */
        set_other(q, 0);
    fanstore_threads_ring_thread(direct ? q->qid : -1);
    char *mem = malloc(payload_len + 4096);
    int bells = 0, bell_fd[2] = {-1, -1}; /* its reply bell's fds, polled in its ring */
    for (int go = mem != NULL; go;) {
        /* what this thread queued (its answers' commits) submitted, then wait for a request;
         * exactly the SQEs not yet taken (the kernel waits only when it took all it was told:
         * one another thread took meanwhile makes this call return at once, and the next wait) */
        int ready = __atomic_load_n(q->cq_tail, __ATOMIC_ACQUIRE) != *q->cq_head;
        int64_t left = 0; /* SCHED_OTHER for overlapping requests: this long yet */
        if (!ready && idle_policy != POLICY_OTHER) {
            /* kicked and served, or no overlap for CONTENDED_NS: idle class again */
            int boosted = __atomic_exchange_n(&q->boosted, 0, __ATOMIC_ACQ_REL);
            left = q->other ? q->contended_at + CONTENDED_NS - now_ns() : 0;
            if ((boosted || q->other) && left <= 0)
                set_other(q, 0);
        }
        pthread_mutex_lock(&q->lock);
        unsigned pending = *q->sq_tail - __atomic_load_n(q->sq_head, __ATOMIC_ACQUIRE);
        pthread_mutex_unlock(&q->lock);
        /* a SCHED_OTHER thread waits only until its overlap window ends (-ETIME), and goes back
         * to the idle class before it waits again; with remote READs of its own in flight, it
         * probes at least every FANSTORE_BELL_WAIT_NS (a lost bell), as a C FUSE thread's ppoll */
        int own = bells && fanstore_remote_own_calls() > 0;
        if (own && (left <= 0 || left > FANSTORE_BELL_WAIT_NS))
            left = FANSTORE_BELL_WAIT_NS;
        struct __kernel_timespec ts = {left / 1000000000LL, left % 1000000000LL};
        struct io_uring_getevents_arg ga = {.ts = (uint64_t)(uintptr_t)&ts};
        int timed = !ready && left > 0, rung = 0;
        long r = syscall(__NR_io_uring_enter, q->fd, pending, ready ? 0 : 1,
                         (ready ? 0 : IORING_ENTER_GETEVENTS) | (timed ? IORING_ENTER_EXT_ARG : 0),
                         timed ? (void *)&ga : NULL, timed ? sizeof(ga) : 0);
        if (r < 0 && errno != EINTR && errno != EAGAIN && errno != EBUSY && errno != ETIME)
            break;
        int timed_out = r < 0 && errno == ETIME;
        unsigned head = *q->cq_head, tail = __atomic_load_n(q->cq_tail, __ATOMIC_ACQUIRE);
        for (; head != tail && go; head++) {
            struct io_uring_cqe c = q->cqes[head & q->cq_mask];
            __atomic_store_n(q->cq_head, head + 1, __ATOMIC_RELEASE);
            if (c.user_data == STOP_TAG) {
                go = 0;
            } else if (c.user_data == KICK_TAG) { /* commits queued by other threads */
                uint64_t v;
                (void)!read(q->kickfd, &v, sizeof(v));
                if (!(c.flags & IORING_CQE_F_MORE)) { /* the multishot poll ended: again */
                    pthread_mutex_lock(&q->lock);
                    poll_sqe(q, q->kickfd, KICK_TAG, 1);
                    pthread_mutex_unlock(&q->lock);
                }
            } else if (c.user_data == BELL_TAG || c.user_data == BELL_TAG + 1) {
                /* a reply to one of its remote READs: taken and answered here (committed by
                 * this thread, no kick) */
                int fd = bell_fd[c.user_data - BELL_TAG];
                rung = 1;
                fanstore_remote_take_own(fd);
                if (!(c.flags & IORING_CQE_F_MORE) && c.res >= 0) {
                    pthread_mutex_lock(&q->lock);
                    poll_sqe(q, fd, c.user_data, 1);
                    pthread_mutex_unlock(&q->lock);
                }
            } else if (c.res == -EINTR || c.res == -EAGAIN) {
                struct ent *e = (struct ent *)(uintptr_t)c.user_data;
                send_cmd(q, e, e->last_cmd);
            } else if (c.res == -ENOTCONN || c.res == -ECANCELED || c.res == -ENODEV) {
                go = 0; /* the connection or the ring ended */
                if (__atomic_load_n(&live, __ATOMIC_ACQUIRE))
                    fprintf(stderr, "fanstore-fuse: io_uring queue %d ended: %s\n", q->qid,
                            strerror(-c.res));
            } else if (c.res != 0) {
                struct ent *e = (struct ent *)(uintptr_t)c.user_data;
                __atomic_add_fetch(&ring_errors, 1, __ATOMIC_RELAXED);
                fprintf(stderr, "fanstore-fuse: io_uring queue %d: command %d of an entry (commit "
                        "id %llu) failed: %s; the entry registered again\n", q->qid, e->last_cmd,
                        (unsigned long long)e->commit_id, strerror(-c.res));
                __atomic_store_n(&e->unique, 0, __ATOMIC_RELEASE);
                send_cmd(q, e, FUSE_URING_CMD_REGISTER);
            } else {
                take(q, (struct ent *)(uintptr_t)c.user_data, &mem);
            }
        }
        if (own && timed_out && !rung)
            fanstore_remote_take_own(-1); /* no bell within FANSTORE_BELL_WAIT_NS: probe */
        if (!bells && direct && (bells = fanstore_remote_bell_fds(bell_fd)) > 0) {
            /* its first remote READ opened its bell: polled in its ring from now on */
            pthread_mutex_lock(&q->lock);
            for (int k = 0; k < bells; k++)
                poll_sqe(q, bell_fd[k], BELL_TAG + (uint64_t)k, 1);
            pthread_mutex_unlock(&q->lock);
        }
    }
    free(mem);
    return NULL;
}

/* Whether a ring holds requests its thread has not taken yet (its completions not yet seen):
 * the READ path's "does another request wait?" (a cold READ then goes to a READ thread instead
 * of blocking this one on the disk). The thread moves past a completion before it takes it. */
int fanstore_uring_waiting(void) {
    if (!__atomic_load_n(&live, __ATOMIC_ACQUIRE))
        return 0;
    int n = __atomic_load_n(&nq, __ATOMIC_ACQUIRE);
    for (int k = 0; k < n; k++)
        if (__atomic_load_n(queues[k]->cq_tail, __ATOMIC_ACQUIRE) !=
            __atomic_load_n(queues[k]->cq_head, __ATOMIC_ACQUIRE))
            return 1;
    return 0;
}

/* --- replies out --- */

static struct ent *holding(uint64_t unique) {
    int n = __atomic_load_n(&nq, __ATOMIC_ACQUIRE); /* queues are never freed */
    for (int k = 0; k < n; k++)
        for (int i = 0; i < depth; i++)
            if (__atomic_load_n(&queues[k]->ents[i].unique, __ATOMIC_ACQUIRE) == unique)
                return &queues[k]->ents[i];
    return NULL;
}

static ssize_t commit(struct ent *e, const struct iovec *iov, int count) {
    struct fuse_out_header oh;
    memcpy(&oh, iov[0].iov_base, sizeof(oh));
    size_t len = 0;
    for (int i = 1; i < count; i++) {
        if (len + iov[i].iov_len > payload_len) {
            oh.error = -EIO; /* larger than the ring's buffers: cannot be, the reply is EIO */
            len = 0;
            break;
        }
        memcpy(e->payload + len, iov[i].iov_base, iov[i].iov_len);
        len += iov[i].iov_len;
    }
    oh.len = (uint32_t)(sizeof(oh) + len);
    memcpy(e->hdr->in_out, &oh, sizeof(oh));
    e->hdr->ent.payload_sz = (uint32_t)len;
    __atomic_store_n(&e->unique, 0, __ATOMIC_RELEASE);
    __atomic_sub_fetch(&e->q->held, 1, __ATOMIC_ACQ_REL);
    if (pthread_equal(pthread_self(), e->q->tid) == 0)
        __atomic_add_fetch(&commits_elsewhere, 1, __ATOMIC_RELAXED);
    int r = send_cmd(e->q, e, FUSE_URING_CMD_COMMIT_AND_FETCH);
    if (r != 0) {
        errno = -r;
        return -1;
    }
    return (ssize_t)oh.len;
}

static void start_rings(void);

ssize_t fanstore_uring_writev(int fd, struct iovec *iov, int count, void *userdata) {
    (void)userdata;
    struct fuse_out_header *oh = iov[0].iov_base;
    if (count >= 1 && iov[0].iov_len >= sizeof(*oh) && oh->unique != 0) {
        if (__atomic_load_n(&live, __ATOMIC_ACQUIRE)) {
            struct ent *e = holding(oh->unique);
            if (e != NULL)
                return commit(e, iov, count);
        } else if (init_offered && oh->unique == init_unique && oh->error == 0 && count >= 2 &&
                   iov[1].iov_len >= offsetof(struct fuse_init_out, flags2) + 4) {
            struct fuse_init_out *io = iov[1].iov_base;
            io->flags |= FUSE_URING_INIT_EXT_FLAG;
            io->flags2 |= FUSE_URING_OVER_IO_URING_FLAG2;
            ssize_t n = writev(fd, iov, count);
            if (n >= 0)
                start_rings();
            return n;
        }
    }
    return writev(fd, iov, count);
}

ssize_t fanstore_uring_read(int fd, void *buf, size_t len, void *userdata) {
    (void)userdata;
    return read(fd, buf, len);
}

/* An INIT request read from /dev/fuse (by _shim_threads.c): whether the kernel offers it. */
void fanstore_uring_saw_init(const char *mem, size_t n) {
    const struct fuse_in_header *in = (const void *)mem;
    if (!fanstore_uring_wanted() || n < sizeof(*in) + offsetof(struct fuse_init_in, flags2) + 4)
        return;
    const struct fuse_init_in *ii = (const void *)(mem + sizeof(*in));
    init_unique = in->unique;
    init_offered = (ii->flags & FUSE_URING_INIT_EXT_FLAG) && (ii->flags2 & FUSE_URING_OVER_IO_URING_FLAG2);
    if (!init_offered)
        fprintf(stderr, "fanstore-fuse: FANSTORE_FUSE_URING=1 but the kernel does not offer FUSE "
                        "over io_uring (Linux 6.14+, /sys/module/fuse/parameters/enable_uring): "
                        "/dev/fuse it is\n");
}

/* --- start and stop --- */

static void *alloc_pages(size_t len) {
    void *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    return p == MAP_FAILED ? NULL : p;
}

static struct queue *queue_new(int qid) {
    struct queue *q = calloc(1, sizeof(*q));
    if (q == NULL)
        return NULL;
    q->qid = qid;
    q->fd = q->evfd = q->kickfd = -1;
    pthread_mutex_init(&q->lock, NULL);
    if (ring_setup(q) != 0 || (q->evfd = eventfd(0, EFD_CLOEXEC)) < 0 ||
        (q->kickfd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)) < 0)
        return q; /* q->up stays 0: closed by the caller */
    for (int i = 0; i < depth; i++) {
        struct ent *e = &q->ents[i];
        e->q = q;
        e->hdr = alloc_pages(4096);
        e->payload = alloc_pages(payload_len);
        if (e->hdr == NULL || e->payload == NULL)
            return q;
        e->iov[0] = (struct iovec){e->hdr, sizeof(*e->hdr)};
        e->iov[1] = (struct iovec){e->payload, payload_len};
        cmd_sqe(q, e, FUSE_URING_CMD_REGISTER, sqe_get(q));
        sqe_publish(q);
    }
    poll_sqe(q, q->evfd, STOP_TAG, 0);
    poll_sqe(q, q->kickfd, KICK_TAG, 1);
    q->up = 1; /* all submitted by its thread's first wait */
    return q;
}

static void queue_free(struct queue *q) {
    if (q->fd >= 0)
        close(q->fd); /* the kernel cancels the entries still registered */
    if (q->evfd >= 0)
        close(q->evfd);
    if (q->kickfd >= 0)
        close(q->kickfd);
    if (q->sqes != NULL && q->sqes != MAP_FAILED)
        munmap(q->sqes, q->sqes_len);
    if (q->cq_ptr != NULL && q->cq_ptr != MAP_FAILED && q->cq_ptr != q->sq_ptr)
        munmap(q->cq_ptr, q->cq_len);
    if (q->sq_ptr != NULL && q->sq_ptr != MAP_FAILED)
        munmap(q->sq_ptr, q->sq_len);
    for (int i = 0; i < depth; i++) {
        if (q->ents[i].hdr != NULL)
            munmap(q->ents[i].hdr, 4096);
        if (q->ents[i].payload != NULL)
            munmap(q->ents[i].payload, payload_len);
    }
    pthread_mutex_destroy(&q->lock);
    free(q);
}

/* After the INIT reply that asked for it: a queue and its thread per CPU. */
static void start_rings(void) {
    /* one queue per CPU the system is configured for, as the kernel counts them (it uses the
     * rings only once every one of them registered); each entry has a 1 MiB payload buffer,
     * touched as far as replies fill it: 16 entries per queue, fewer on many CPUs, so that all
     * of them stay within RING_BUFFERS_MIB (at least 2 per queue) */
    int cpus = (int)sysconf(_SC_NPROCESSORS_CONF);
    if (cpus > MAX_QUEUES) {
        fprintf(stderr, "fanstore-fuse: %d CPUs, more than the %d io_uring queues this build "
                        "sets up; requests stay on /dev/fuse\n", cpus, MAX_QUEUES);
        return;
    }
    size_t mib = payload_len >> 20 > 0 ? payload_len >> 20 : 1;
    long want = RING_BUFFERS_MIB / ((long)cpus * (long)mib);
    const char *d = getenv("FANSTORE_FUSE_URING_DEPTH");
    if (d != NULL && *d != '\0')
        want = strtol(d, NULL, 10);
    depth = want < 2 ? 2 : want > MAX_DEPTH ? MAX_DEPTH : (int)want;
    for (int k = 0; k < cpus; k++) {
        struct queue *q = queue_new(k);
        if (q == NULL || !q->up) {
            if (q != NULL)
                queue_free(q);
            fprintf(stderr, "fanstore-fuse: io_uring queue %d could not be set up; requests stay "
                            "on /dev/fuse\n", k);
            return; /* the kernel uses the rings only once every queue has registered */
        }
        queues[k] = q;
        __atomic_store_n(&nq, k + 1, __ATOMIC_RELEASE);
        int r = fanstore_threads_spawn(&q->tid, ring_main, q, "fanstore-ring", k);
        if (r != 0) {
            fprintf(stderr, "fanstore-fuse: io_uring queue %d did not start (%s)\n", k, strerror(r));
            return;
        }
        q->up = 2; /* its thread runs */
    }
    __atomic_store_n(&live, 1, __ATOMIC_RELEASE);
}

void fanstore_uring_setup(int fd, size_t bufsize) {
    const char *idle = getenv("FANSTORE_FUSE_URING_IDLE");
    idle_policy = idle == NULL || *idle == '\0' || strcmp(idle, "auto") == 0 ? POLICY_AUTO
                  : strcmp(idle, "0") == 0                                   ? POLICY_OTHER
                                                                             : POLICY_IDLE;
    const char *b = getenv("FANSTORE_FUSE_URING_BOOST");
    boost = b == NULL || strcmp(b, "0") != 0;
    const char *d = getenv("FANSTORE_FUSE_URING_DIRECT");
    direct = d == NULL || strcmp(d, "0") != 0;
    dev_fd = fd;
    payload_len = bufsize;
    init_offered = 0;
    init_unique = 0;
}

/* Stop the ring threads and close the rings (before /dev/fuse is closed). The queues' memory
 * stays: a reply being committed from another thread meanwhile finds no ring live and goes to
 * /dev/fuse, where the kernel no longer knows it. */
void fanstore_uring_stop(void) {
    __atomic_store_n(&live, 0, __ATOMIC_RELEASE);
    int n = __atomic_load_n(&nq, __ATOMIC_ACQUIRE);
    for (int k = 0; k < n; k++) {
        struct queue *q = queues[k];
        uint64_t one = 1;
        if (q->up == 2) {
            (void)!write(q->evfd, &one, sizeof(one));
            pthread_join(q->tid, NULL);
            q->up = 1;
        }
        pthread_mutex_lock(&q->lock);
        if (q->fd >= 0)
            close(q->fd); /* the kernel cancels the entries still registered */
        q->fd = -1;
        pthread_mutex_unlock(&q->lock);
    }
    dev_fd = -1;
}

/* fuse_uring_counts(): (queues live, requests taken from rings, replies committed by another
 * thread than the queue's, ring errors, ring threads made SCHED_OTHER by overlapping requests,
 * entries per queue) */
PyObject *fanstore_py_fuse_uring_counts(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    return Py_BuildValue("(iKKKKi)", __atomic_load_n(&live, __ATOMIC_ACQUIRE) ? nq : 0,
                         __atomic_load_n(&by_ring, __ATOMIC_RELAXED),
                         __atomic_load_n(&commits_elsewhere, __ATOMIC_RELAXED),
                         __atomic_load_n(&ring_errors, __ATOMIC_RELAXED),
                         __atomic_load_n(&contended_switches, __ATOMIC_RELAXED), depth);
}
