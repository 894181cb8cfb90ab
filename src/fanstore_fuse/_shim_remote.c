/* Remote blob reads in C: the remote thread, its workers, the Python methods. The design and
 * the wire format are in _shim_remote.h. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <arpa/inet.h>
#include <poll.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
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

static struct {
    int (*Isend)(const void *, int, int, int, int, int, int *);
    int (*Improbe)(int, int, int, int *, int *, struct mpi_status *);
    int (*Mrecv)(void *, int, int, int *, struct mpi_status *);
    int (*Test)(int *, int *, struct mpi_status *);
    int (*Get_count)(const struct mpi_status *, int, int *);
    int (*Iallgather)(const void *, int, int, void *, int, int, int, int *);
    int (*Query_thread)(int *);
} mpi;

static const char *find_mpi(const char *path) {
    void *lib = dlopen(path, RTLD_NOW | RTLD_NOLOAD);
    if (lib == NULL)
        return "libmpi is not loaded in this process";
#define FIND(name)                                                                                \
    if ((*(void **)&mpi.name = dlsym(lib, "MPI_" #name)) == NULL)                                 \
        return "MPI_" #name " not found in libmpi";
    FIND(Isend) FIND(Improbe) FIND(Mrecv) FIND(Test) FIND(Get_count) FIND(Iallgather)
    FIND(Query_thread)
#undef FIND
    return NULL;
}

/* ------------------------------------------------------------------ state */

struct call { /* one request of this rank, in flight */
    struct call *next;
    uint64_t id, blob;
    int owner;
    double deadline;
    fanstore_remote_done done;
    void *ctx;
};

struct out { /* a message for the remote thread to send (a worker's reply) */
    struct out *next;
    int dest, tag;
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
};

struct sending {
    int req;
    char *buf;
};

#define WORKERS 2
#define DECODE_INLINE (256u << 10) /* replies this small are verified on the remote thread */
#define BELL_RECORD 72             /* 64 bytes of host name, IPv4 address, port, 2 spare */

static struct {
    int running, ready, stopping;
    int comm, byte, rank, size, dup_req, gather_req, gathered;
    pthread_t thread, workers[WORKERS];
    int wake_fd, done_fd, bell_fd;
    struct sockaddr_in *peers; /* size entries; port 0: no bell */
    char *bell_table, bell_mine[BELL_RECORD];
    pthread_mutex_t lock; /* submitted, outq, jobs, done list */
    pthread_cond_t job_cond;
    struct call *submitted;
    struct out *outq;
    struct job *jobs;
    struct call *inflight; /* the remote thread's only */
    struct sending *sends;
    size_t nsends, capsends;
    uint64_t next_id;
} R = {.lock = PTHREAD_MUTEX_INITIALIZER, .job_cond = PTHREAD_COND_INITIALIZER, .wake_fd = -1,
       .done_fd = -1, .bell_fd = -1};

static struct {
    unsigned long long polls, bell_wakes, served, served_io, served_bytes, bad_requests,
        error_replies, fetched, fetched_bytes, corrupt, timeouts, peer_errors, send_errors,
        verified_by_worker, open_calls, peak_calls;
} S;

#define COUNT(x) __atomic_add_fetch(&S.x, 1, __ATOMIC_RELAXED)
#define ADD(x, n) __atomic_add_fetch(&S.x, (n), __ATOMIC_RELAXED)

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void poke(int fd) {
    uint64_t one = 1;
    ssize_t r = write(fd, &one, sizeof(one));
    (void)r; /* a full counter still wakes the reader */
}

static void drain(int fd) {
    char buf[256];
    while (read(fd, buf, sizeof(buf)) > 0) {
    }
}

/* ------------------------------------------------------------------ sending */

static void ring(int dest) {
    if (R.peers != NULL && dest >= 0 && dest < R.size && R.peers[dest].sin_port)
        (void)sendto(R.bell_fd, "", 1, MSG_DONTWAIT, (struct sockaddr *)&R.peers[dest],
                     sizeof(R.peers[dest]));
}

/* Send `buf` (malloc'd, taken over) to `dest`: 0, or -1 if MPI refused (buf freed). */
static int post(int dest, int tag, char *buf, size_t n) {
    int req, flag = 0;
    if (mpi.Isend(buf, (int)n, R.byte, dest, tag, R.comm, &req) != 0) {
        COUNT(send_errors);
        free(buf);
        return -1;
    }
    ring(dest);
    if (mpi.Test(&req, &flag, MPI_STATUS_IGNORE_) == 0 && flag) {
        free(buf); /* eager: complete at once */
        return 0;
    }
    if (R.nsends == R.capsends) {
        size_t cap = R.capsends ? 2 * R.capsends : 16;
        struct sending *s = realloc(R.sends, cap * sizeof(*s));
        if (s == NULL)
            abort(); /* the send is posted; its buffer must outlive it */
        R.sends = s;
        R.capsends = cap;
    }
    R.sends[R.nsends++] = (struct sending){req, buf};
    return 0;
}

static int progress_sends(void) {
    int moved = 0;
    for (size_t i = 0; i < R.nsends;) {
        int flag = 0;
        if (mpi.Test(&R.sends[i].req, &flag, MPI_STATUS_IGNORE_) != 0 || flag) {
            free(R.sends[i].buf);
            R.sends[i] = R.sends[--R.nsends];
            moved = 1;
        } else {
            i++;
        }
    }
    return moved;
}

static void queue_out(int dest, int tag, char *buf, size_t n) {
    struct out *o = malloc(sizeof(*o));
    if (o == NULL) {
        free(buf);
        return; /* the requester times out and reads another way */
    }
    *o = (struct out){NULL, dest, tag, buf, n};
    pthread_mutex_lock(&R.lock);
    struct out **p = &R.outq;
    while (*p)
        p = &(*p)->next;
    *p = o;
    pthread_mutex_unlock(&R.lock);
    poke(R.wake_fd);
}

/* ------------------------------------------------------------------ serving */

static char *error_reply(const struct fsr_header *req, int err, size_t *n) {
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
static char *serve(const struct fsr_header *req, int nowait, size_t *n, int *again) {
    *again = 0;
    if (req->magic != FSR_MAGIC || req->version != FSR_VERSION || req->op != FSR_OP_FETCH) {
        COUNT(bad_requests);
        return error_reply(req, EPROTO, n);
    }
    uint64_t b = req->blob;
    if (b >= fanstore_blobs.n || !fanstore_blob_held(b))
        return error_reply(req, ENOENT, n);
    if (req->lo > req->hi || req->hi > fanstore_blobs.stored[b])
        return error_reply(req, EINVAL, n);
    size_t len = (size_t)(req->hi - req->lo);
    char *buf = malloc(sizeof(struct fsr_header) + len);
    if (buf == NULL)
        return error_reply(req, ENOMEM, n);
    int rc = fanstore_blob_pread(b, req->lo, len, buf + sizeof(struct fsr_header), nowait);
    if (rc == FANSTORE_BLOB_AGAIN) {
        free(buf);
        *again = 1;
        return NULL;
    }
    if (rc != FANSTORE_BLOB_OK) {
        free(buf);
        return error_reply(req, rc == FANSTORE_BLOB_NOT_HELD ? ENOENT : EIO, n);
    }
    struct fsr_header *h = (struct fsr_header *)buf;
    *h = *req;
    h->err = 0;
    *n = sizeof(*h) + len;
    COUNT(served);
    ADD(served_bytes, len);
    return buf;
}

static void push_job(struct job *j) {
    pthread_mutex_lock(&R.lock);
    struct job **p = &R.jobs;
    while (*p)
        p = &(*p)->next;
    *p = j;
    pthread_cond_signal(&R.job_cond);
    pthread_mutex_unlock(&R.lock);
}

/* ------------------------------------------------------------------ calls */

static void complete(struct call *c, int status, char *raw, size_t n) {
    __atomic_sub_fetch(&S.open_calls, 1, __ATOMIC_RELAXED);
    c->done(c->ctx, status, raw, n);
    free(c);
}

static void verify(struct call *c, char *buf, size_t n) {
    const struct fsr_header *h = (const struct fsr_header *)buf;
    uint64_t b = c->blob;
    size_t raw_len = fanstore_blobs.raw[b];
    char *raw = malloc(raw_len ? raw_len : 1);
    int rc = raw == NULL ? FANSTORE_BLOB_NOMEM
             : n - sizeof(*h) != fanstore_blobs.stored[b] ? FANSTORE_BLOB_CORRUPT
                                                          : fanstore_blob_decode(b, h + 1, raw);
    free(buf);
    if (rc == FANSTORE_BLOB_OK) {
        COUNT(fetched);
        complete(c, 0, raw, raw_len);
    } else {
        COUNT(corrupt);
        free(raw);
        complete(c, rc == FANSTORE_BLOB_NOMEM ? -ENOMEM : -EIO, NULL, 0);
    }
}

static struct call *unlink_call(uint64_t id) {
    for (struct call **p = &R.inflight; *p; p = &(*p)->next)
        if ((*p)->id == id) {
            struct call *c = *p;
            *p = c->next;
            return c;
        }
    return NULL;
}

static void finish(struct call *c, int status) {
    complete(c, status, NULL, 0);
}

static void answered(char *buf, size_t n) {
    const struct fsr_header *h = (const struct fsr_header *)buf;
    struct call *c = n >= sizeof(*h) ? unlink_call(h->id) : NULL;
    if (c == NULL) { /* timed out already, or garbage */
        free(buf);
        return;
    }
    if (h->magic != FSR_MAGIC || h->version != FSR_VERSION || h->blob != c->blob) {
        COUNT(corrupt);
        free(buf);
        finish(c, -EPROTO);
        return;
    }
    if (h->err != 0) {
        COUNT(error_replies);
        int err = h->err > 0 ? h->err : EIO;
        free(buf);
        finish(c, -err);
        return;
    }
    ADD(fetched_bytes, n - sizeof(*h));
    if (n - sizeof(*h) <= DECODE_INLINE) {
        verify(c, buf, n);
        return;
    }
    struct job *j = calloc(1, sizeof(*j));
    if (j == NULL) {
        free(buf);
        finish(c, -ENOMEM);
        return;
    }
    j->source = -1;
    j->call = c;
    j->buf = buf;
    j->n = n;
    push_job(j);
}

static void *worker(void *unused) {
    (void)unused;
    for (;;) {
        pthread_mutex_lock(&R.lock);
        while (R.jobs == NULL && !R.stopping)
            pthread_cond_wait(&R.job_cond, &R.lock);
        struct job *j = R.jobs;
        if (j == NULL) {
            pthread_mutex_unlock(&R.lock);
            return NULL;
        }
        R.jobs = j->next;
        pthread_mutex_unlock(&R.lock);
        if (j->call != NULL) {
            COUNT(verified_by_worker);
            verify(j->call, j->buf, j->n);
        } else {
            size_t n;
            int again;
            char *reply = serve(&j->h, 0, &n, &again);
            COUNT(served_io);
            if (reply != NULL)
                queue_out(j->source, FSR_TAG_REPLY, reply, n);
        }
        free(j);
    }
}

/* ------------------------------------------------------------------ the remote thread */

static void take_bells(void) {
    R.peers = calloc((size_t)R.size, sizeof(*R.peers));
    if (R.peers == NULL)
        return;
    for (int r = 0; r < R.size; r++) {
        const char *rec = R.bell_table + (size_t)r * BELL_RECORD;
        uint16_t port;
        memcpy(&port, rec + 68, 2);
        R.peers[r].sin_family = AF_INET;
        R.peers[r].sin_port = port;
        if (memcmp(rec, R.bell_mine, 64) == 0)
            R.peers[r].sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        else
            memcpy(&R.peers[r].sin_addr, rec + 64, 4);
    }
}

static void post_gather(void) {
    memset(R.bell_mine, 0, sizeof(R.bell_mine));
    gethostname(R.bell_mine, 63);
    struct sockaddr_in me;
    socklen_t len = sizeof(me);
    uint32_t ip = htonl(INADDR_LOOPBACK);
    struct hostent *he = gethostbyname(R.bell_mine); /* before any thread but ours uses it */
    if (he != NULL && he->h_addrtype == AF_INET && he->h_addr_list[0] != NULL)
        memcpy(&ip, he->h_addr_list[0], 4);
    memcpy(R.bell_mine + 64, &ip, 4);
    if (getsockname(R.bell_fd, (struct sockaddr *)&me, &len) == 0)
        memcpy(R.bell_mine + 68, &me.sin_port, 2);
    R.bell_table = calloc((size_t)R.size, BELL_RECORD);
    if (R.bell_table == NULL ||
        mpi.Iallgather(R.bell_mine, BELL_RECORD, R.byte, R.bell_table, BELL_RECORD, R.byte, R.comm,
                       &R.gather_req) != 0)
        R.gathered = -1; /* no bells: poll */
}

static int start_calls(void) {
    pthread_mutex_lock(&R.lock);
    struct call *c = R.submitted;
    R.submitted = NULL;
    struct out *o = R.outq;
    R.outq = NULL;
    pthread_mutex_unlock(&R.lock);
    int moved = c != NULL || o != NULL;
    while (c != NULL) {
        struct call *next = c->next;
        struct fsr_header *h = malloc(sizeof(*h));
        if (h == NULL) {
            finish(c, -ENOMEM);
        } else {
            *h = (struct fsr_header){FSR_MAGIC, FSR_VERSION, FSR_OP_FETCH, 0, c->id, c->blob, 0,
                                     fanstore_blobs.stored[c->blob]};
            if (post(c->owner, FSR_TAG_REQUEST, (char *)h, sizeof(*h)) != 0) {
                COUNT(peer_errors);
                finish(c, -EIO);
            } else {
                c->next = R.inflight;
                R.inflight = c;
            }
        }
        c = next;
    }
    while (o != NULL) {
        struct out *next = o->next;
        post(o->dest, o->tag, o->buf, o->n);
        free(o);
        o = next;
    }
    return moved;
}

static int receive(void) {
    int moved = 0;
    for (int k = 0; k < 64; k++) {
        int flag = 0, msg, count = 0;
        struct mpi_status st;
        if (mpi.Improbe(MPI_ANY_SOURCE_, MPI_ANY_TAG_, R.comm, &flag, &msg, &st) != 0 || !flag)
            break;
        moved = 1;
        mpi.Get_count(&st, R.byte, &count);
        char *buf = malloc(count > 0 ? (size_t)count : 1);
        if (buf == NULL)
            abort(); /* a matched message must be received */
        if (mpi.Mrecv(buf, count, R.byte, &msg, MPI_STATUS_IGNORE_) != 0) {
            COUNT(peer_errors);
            free(buf);
            continue;
        }
        size_t n = (size_t)count;
        if (st.tag == FSR_TAG_REPLY) {
            answered(buf, n);
            continue;
        }
        if (st.tag != FSR_TAG_REQUEST || n != sizeof(struct fsr_header)) {
            COUNT(bad_requests);
            if (n >= sizeof(struct fsr_header) && st.tag == FSR_TAG_REQUEST) {
                size_t m;
                post(st.source, FSR_TAG_REPLY, error_reply((struct fsr_header *)buf, EPROTO, &m), m);
            }
            free(buf);
            continue;
        }
        size_t m;
        int again;
        char *reply = serve((struct fsr_header *)buf, 1, &m, &again);
        if (reply != NULL) {
            post(st.source, FSR_TAG_REPLY, reply, m);
        } else {
            struct job *j = calloc(1, sizeof(*j));
            if (j != NULL) {
                j->source = st.source;
                memcpy(&j->h, buf, sizeof(j->h));
                push_job(j);
            }
        }
        free(buf);
    }
    return moved;
}

static void expire(double t) {
    for (struct call **p = &R.inflight; *p;) {
        struct call *c = *p;
        if (c->deadline <= t) {
            *p = c->next;
            COUNT(timeouts);
            finish(c, -ETIMEDOUT);
        } else {
            p = &c->next;
        }
    }
}

static void *remote_thread(void *unused) {
    (void)unused;
    double due = 0; /* the current poll interval while polling */
    int chase = 0;  /* a bell rang: its message may still be on its way */
    while (!__atomic_load_n(&R.stopping, __ATOMIC_ACQUIRE)) {
        COUNT(polls);
        int moved = 0;
        if (!R.ready) {
            int flag = 0;
            if (mpi.Test(&R.dup_req, &flag, MPI_STATUS_IGNORE_) == 0 && flag) {
                post_gather();
                __atomic_store_n(&R.ready, 1, __ATOMIC_RELEASE);
                moved = 1;
            }
        } else {
            if (R.gathered == 0) {
                int flag = 0;
                if (mpi.Test(&R.gather_req, &flag, MPI_STATUS_IGNORE_) != 0)
                    R.gathered = -1;
                else if (flag) {
                    take_bells();
                    __atomic_store_n(&R.gathered, 1, __ATOMIC_RELEASE);
                }
            }
            moved |= start_calls();
            moved |= receive();
            if (R.nsends)
                moved |= progress_sends();
            if (R.inflight)
                expire(now());
        }
        if (moved) {
            due = 0;
            chase = 0;
            continue;
        }
        double timeout;
        if (R.gathered != 1) {
            timeout = 5e-3; /* waiting for the other ranks' threads: nothing to serve yet */
        } else if (R.nsends || chase) {
            due = due ? (due * 2 < 1e-3 ? due * 2 : 1e-3) : 20e-6;
            chase = chase && due < 1e-3;
            timeout = due;
        } else {
            timeout = R.inflight ? 1e-3 : 5e-3;
        }
        struct pollfd fds[2] = {{R.bell_fd, POLLIN, 0}, {R.wake_fd, POLLIN, 0}};
        struct timespec ts = {(time_t)timeout, (long)((timeout - (double)(time_t)timeout) * 1e9)};
        if (ppoll(fds, 2, &ts, NULL) > 0) {
            if (fds[0].revents) {
                drain(R.bell_fd);
                COUNT(bell_wakes);
                chase = 1;
                due = 0;
            }
            if (fds[1].revents)
                drain(R.wake_fd);
        }
    }
    /* stopping: what is in flight will not be answered */
    start_calls();
    while (R.inflight) {
        struct call *c = R.inflight;
        R.inflight = c->next;
        finish(c, -ECANCELED);
    }
    double end = now() + 1.0; /* let replies already posted reach their requesters */
    while (R.nsends && now() < end) {
        progress_sends();
        usleep(1000);
    }
    return NULL;
}

/* ------------------------------------------------------------------ the C API */

int fanstore_remote_ready(void) {
    /* every rank's thread joined the bell exchange: every rank serves */
    return __atomic_load_n(&R.gathered, __ATOMIC_ACQUIRE) == 1 &&
           !__atomic_load_n(&R.stopping, __ATOMIC_ACQUIRE);
}

int fanstore_remote_fetch(int owner, uint64_t blob, double timeout, fanstore_remote_done done, void *ctx) {
    if (!fanstore_remote_ready() || owner < 0 || owner >= R.size || owner == R.rank ||
        blob >= fanstore_blobs.n)
        return -EAGAIN;
    struct call *c = malloc(sizeof(*c));
    if (c == NULL)
        return -EAGAIN;
    pthread_mutex_lock(&R.lock);
    *c = (struct call){R.submitted, ++R.next_id, blob, owner, now() + timeout, done, ctx};
    R.submitted = c;
    unsigned long long open = __atomic_add_fetch(&S.open_calls, 1, __ATOMIC_RELAXED);
    if (open > S.peak_calls)
        S.peak_calls = open;
    pthread_mutex_unlock(&R.lock);
    poke(R.wake_fd);
    return 0;
}

/* ------------------------------------------------------------------ Python */

struct finished {
    struct finished *next;
    PyObject *token;
    int status;
    char *raw;
    size_t n;
};
static struct finished *finished_list;

static void py_done(void *ctx, int status, char *raw, size_t n) {
    struct finished *f = malloc(sizeof(*f));
    if (f == NULL)
        abort(); /* a token would be lost: its reader would wait forever */
    *f = (struct finished){NULL, (PyObject *)ctx, status, raw, n};
    pthread_mutex_lock(&R.lock);
    f->next = finished_list;
    finished_list = f;
    pthread_mutex_unlock(&R.lock);
    poke(R.done_fd);
}

PyObject *fanstore_py_remote_start(PyObject *self, PyObject *args) {
    (void)self;
    const char *libmpi;
    unsigned int comm, dup_req, byte; /* MPICH's handles: 32 bits, the top one often set */
    int rank, size;
    if (!PyArg_ParseTuple(args, "sIIIii", &libmpi, &comm, &dup_req, &byte, &rank, &size))
        return NULL;
    if (R.running) {
        PyErr_SetString(PyExc_RuntimeError, "the remote thread already runs");
        return NULL;
    }
    const char *why = find_mpi(libmpi);
    int level = 0;
    if (why == NULL && (mpi.Query_thread(&level) != 0 || level < MPI_THREAD_MULTIPLE_))
        why = "MPI is not initialized with MPI_THREAD_MULTIPLE";
    if (why != NULL) {
        PyErr_SetString(PyExc_OSError, why);
        return NULL;
    }
    R.bell_fd = socket(AF_INET, SOCK_DGRAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    R.wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    R.done_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    struct sockaddr_in any = {.sin_family = AF_INET};
    if (R.bell_fd < 0 || R.wake_fd < 0 || R.done_fd < 0 ||
        bind(R.bell_fd, (struct sockaddr *)&any, sizeof(any)) != 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        return NULL;
    }
    R.comm = (int)comm;
    R.dup_req = (int)dup_req;
    R.byte = (int)byte;
    R.rank = rank;
    R.size = size;
    R.stopping = R.ready = R.gathered = 0;
    memset(&S, 0, sizeof(S));
    if (pthread_create(&R.thread, NULL, remote_thread, NULL) != 0) {
        PyErr_SetString(PyExc_OSError, "cannot start the remote thread");
        return NULL;
    }
    for (int i = 0; i < WORKERS; i++)
        if (pthread_create(&R.workers[i], NULL, worker, NULL) != 0)
            abort();
    R.running = 1;
    return PyLong_FromLong(R.done_fd);
}

PyObject *fanstore_py_remote_stop(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    if (!R.running)
        Py_RETURN_NONE;
    Py_BEGIN_ALLOW_THREADS;
    pthread_mutex_lock(&R.lock);
    __atomic_store_n(&R.stopping, 1, __ATOMIC_RELEASE);
    pthread_cond_broadcast(&R.job_cond);
    pthread_mutex_unlock(&R.lock);
    poke(R.wake_fd);
    pthread_join(R.thread, NULL);
    for (int i = 0; i < WORKERS; i++)
        pthread_join(R.workers[i], NULL);
    Py_END_ALLOW_THREADS;
    R.running = R.ready = 0;
    close(R.bell_fd);
    close(R.wake_fd);
    R.bell_fd = R.wake_fd = -1;
    /* done_fd stays open: Python may still take the cancelled calls */
    Py_RETURN_NONE;
}

PyObject *fanstore_py_remote_fetch(PyObject *self, PyObject *args) {
    (void)self;
    int owner;
    unsigned long long blob;
    PyObject *token;
    double timeout;
    if (!PyArg_ParseTuple(args, "iKOd", &owner, &blob, &token, &timeout))
        return NULL;
    Py_INCREF(token);
    int rc = fanstore_remote_fetch(owner, blob, timeout, py_done, token);
    if (rc != 0)
        Py_DECREF(token);
    return PyBool_FromLong(rc == 0);
}

PyObject *fanstore_py_remote_take(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    if (R.done_fd >= 0)
        drain(R.done_fd);
    pthread_mutex_lock(&R.lock);
    struct finished *f = finished_list;
    finished_list = NULL;
    pthread_mutex_unlock(&R.lock);
    PyObject *out = PyList_New(0);
    while (f != NULL) {
        struct finished *next = f->next;
        PyObject *data = f->raw ? PyBytes_FromStringAndSize(f->raw, (Py_ssize_t)f->n) : Py_None;
        if (f->raw == NULL)
            Py_INCREF(Py_None);
        PyObject *item = data && out ? Py_BuildValue("(NiN)", f->token, f->status, data) : NULL;
        if (item == NULL || PyList_Append(out, item) != 0)
            abort(); /* out of memory with readers waiting */
        Py_DECREF(item);
        free(f->raw);
        free(f);
        f = next;
    }
    return out;
}

PyObject *fanstore_py_remote_stats(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    return Py_BuildValue(
        "{sisisKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsK}", "ready", fanstore_remote_ready(), "bells",
        R.gathered == 1, "polls", S.polls, "bell_wakes", S.bell_wakes, "served", S.served,
        "served_io", S.served_io, "served_bytes", S.served_bytes, "bad_requests", S.bad_requests,
        "error_replies", S.error_replies, "fetched", S.fetched, "fetched_bytes", S.fetched_bytes,
        "corrupt", S.corrupt, "timeouts", S.timeouts, "peer_errors", S.peer_errors, "send_errors",
        S.send_errors, "verified_by_worker", S.verified_by_worker, "in_flight", S.open_calls,
        "peak_in_flight", S.peak_calls);
}
