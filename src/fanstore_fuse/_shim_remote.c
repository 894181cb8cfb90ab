/* Remote blob reads in C: this rank's calls, the workers, the C API and the Python methods
 * that start and stop the thread. The design and the wire format: _shim_remote.h; MPI and
 * the remote thread: _shim_remote_mpi.c; serving other ranks' requests:
 * _shim_remote_serve_map.c; Python's fetches: _shim_remote_py.c. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <malloc.h>
#include <signal.h>
#include <sys/eventfd.h>
#include <sys/socket.h>

#include "_shim_ops.h"
#include "_shim_remote_int.h"

struct fsr_state fsr_state = {.lock = PTHREAD_MUTEX_INITIALIZER, .job_cond = PTHREAD_COND_INITIALIZER,
                              .wake_fd = -1, .done_fd = -1, .bell_fd = -1};
struct fsr_stats fsr_stats;

void fsr_push_job(struct job *j) {
    j->queued = fsr_now();
    pthread_mutex_lock(&fsr_state.lock);
    struct job **p = &fsr_state.jobs;
    while (*p)
        p = &(*p)->next;
    *p = j;
    pthread_cond_signal(&fsr_state.job_cond);
    pthread_mutex_unlock(&fsr_state.lock);
}

/* ------------------------------------------------------------------ calls */

void fsr_complete(struct call *c, int status, char *raw, size_t n) {
    __atomic_sub_fetch(&fsr_stats.open_calls, 1, __ATOMIC_RELAXED);
    if (c->kept != NULL)
        c->kept(c->ctx, status, raw, n, status == 0 ? c->mem : NULL);
    else if (c->view != NULL)
        c->view(c->ctx, status, raw, n);
    else
        c->done(c->ctx, status, raw, n);
    free(c);
}

static void fsr_verify(struct call *c, char *buf, size_t n) {
    if (c->op == FSR_OP_FRAMES) {
        fsr_verify_frames(c, buf, n);
        return;
    }
    if (c->python) {
        fsr_verify_py(c, buf, n);
        return;
    }
    const struct fsr_header *h = (const struct fsr_header *)buf;
    uint64_t b = c->blob;
    size_t raw_len = fanstore_blobs.raw[b];
    /* kept, stored raw: checked where it was received, no copy (the call keeps `buf`) */
    int in_place = c->kept != NULL && fanstore_blobs.codec[b] == FANSTORE_CODEC_RAW;
    char *raw = in_place ? buf + sizeof(*h) : malloc(raw_len ? raw_len : 1);
    int rc = raw == NULL ? FANSTORE_BLOB_NOMEM
             : n - sizeof(*h) != fanstore_blobs.stored[b] ? FANSTORE_BLOB_CORRUPT
                                                          : fanstore_blob_decode(b, h + 1, raw);
    if (rc == FANSTORE_BLOB_OK && c->kept != NULL)
        c->mem = in_place ? buf : raw;
    if (rc != FANSTORE_BLOB_OK || !in_place)
        free(buf);
    if (rc == FANSTORE_BLOB_OK) {
        COUNT(fetched);
        fsr_complete(c, 0, raw, raw_len);
    } else {
        COUNT(corrupt);
        if (!in_place)
            free(raw);
        fsr_complete(c, rc == FANSTORE_BLOB_NOMEM ? -ENOMEM : -EIO, NULL, 0);
    }
}

struct call *fsr_unlink_call(uint64_t id) {
    struct call *found = NULL;
    pthread_mutex_lock(&fsr_state.lock);
    for (struct call **p = &fsr_state.inflight; *p; p = &(*p)->next)
        if ((*p)->id == id) {
            found = *p;
            *p = found->next;
            break;
        }
    pthread_mutex_unlock(&fsr_state.lock);
    return found;
}

void fsr_reap(double t, int all) {
    struct call *done = NULL;
    pthread_mutex_lock(&fsr_state.lock);
    for (struct call **p = &fsr_state.inflight; *p;) {
        struct call *c = *p;
        if (all || c->deadline <= t) {
            *p = c->next;
            c->next = done;
            done = c;
        } else {
            p = &c->next;
        }
    }
    pthread_mutex_unlock(&fsr_state.lock);
    while (done != NULL) {
        struct call *next = done->next;
        if (!all) {
            COUNT(timeouts);
            fsr_suspect(done->owner);
        }
        fsr_finish(done, all ? -ECANCELED : -ETIMEDOUT);
        done = next;
    }
}

void fsr_finish(struct call *c, int status) {
    fsr_complete(c, status, NULL, 0);
}

void fsr_answered(char *buf, size_t n) {
    const struct fsr_header *h = (const struct fsr_header *)buf;
    struct call *c = n >= sizeof(*h) ? fsr_unlink_call(h->id) : NULL;
    if (c == NULL) { /* timed out already, or garbage */
        free(buf);
        return;
    }
    if (h->magic != FSR_MAGIC || h->version != FSR_VERSION || h->op != c->op || h->blob != c->blob) {
        COUNT(corrupt);
        free(buf);
        fsr_finish(c, -EPROTO);
        return;
    }
    if (h->err != 0) {
        COUNT(error_replies);
        int err = h->err > 0 ? h->err : EIO;
        free(buf);
        fsr_finish(c, -err);
        return;
    }
    ADD(fetched_bytes, n - sizeof(*h));
    if (n - sizeof(*h) <= (c->op == FSR_OP_FRAMES ? RANGE_INLINE : DECODE_INLINE)) {
        fsr_verify(c, buf, n);
        return;
    }
    struct job *j = calloc(1, sizeof(*j));
    if (j == NULL) {
        free(buf);
        fsr_finish(c, -ENOMEM);
        return;
    }
    j->source = -1;
    j->call = c;
    j->buf = buf;
    j->n = n;
    fsr_push_job(j);
}

void *fsr_worker(void *unused) {
    (void)unused;
    for (;;) {
        pthread_mutex_lock(&fsr_state.lock);
        struct timespec until;
        clock_gettime(CLOCK_REALTIME, &until);
        until.tv_nsec += 200000000; /* every 200 ms: the deadlines of calls in flight */
        if (until.tv_nsec >= 1000000000) {
            until.tv_sec++;
            until.tv_nsec -= 1000000000;
        }
        int waited = 0;
        while (fsr_state.jobs == NULL && !fsr_state.stopping && !waited)
            waited = pthread_cond_timedwait(&fsr_state.job_cond, &fsr_state.lock, &until) != 0;
        struct job *j = fsr_state.jobs;
        if (j == NULL) {
            int stop = fsr_state.stopping;
            pthread_mutex_unlock(&fsr_state.lock);
            if (stop)
                return NULL;
            fsr_reap(fsr_now(), 0);
            continue;
        }
        fsr_state.jobs = j->next;
        pthread_mutex_unlock(&fsr_state.lock);
        if (j->call != NULL) {
            COUNT(verified_by_worker);
            fsr_verify(j->call, j->buf, j->n);
        } else {
            size_t n;
            int again, tag;
            char *reply = fsr_serve(&j->h, 0, &n, &again, &tag);
            COUNT(served_io);
            uint16_t bell = fsr_request_bell(&j->h);
            /* fsr_send frees a reply MPI refused (the peer times out): it is never queued then */
            if (reply != NULL && fsr_direct && fsr_mpi_fresh())
                fsr_send(j->source, bell, tag, reply, n, 2e-3); /* no hop to the remote thread */
            else if (reply != NULL && fsr_worker_sends(n)) {
                if (fsr_send(j->source, bell, tag, reply, n, 0) == 0)
                    COUNT(worker_sends); /* eager: complete at once */
            } else if (reply != NULL)
                fsr_queue_out(j->source, bell, tag, reply, n);
        }
        free(j);
    }
}

/* Deadlines of calls in flight, every REAP_NS, on a thread that never calls MPI: a worker that
 * sends its reply itself (fsr_worker_sends) may block inside MPI when a peer dies, and no reader
 * may wait on that. */
static pthread_t reaper;
static pthread_cond_t reap_cond = PTHREAD_COND_INITIALIZER;
#define REAP_NS 200000000

/* Replies to verify that waited REAP_NS or more in the queue, verified here: an answered
 * call has left `inflight`, so no deadline covers it, and both workers may be inside MPI
 * (their own sends; a dead peer's netmod holds MPICH's lock). Each job is taken out of the
 * queue under the lock, so it is verified once. */
static void verify_left(double t) {
    for (;;) {
        pthread_mutex_lock(&fsr_state.lock);
        struct job **p = &fsr_state.jobs, *j = NULL;
        for (; *p != NULL; p = &(*p)->next)
            if ((*p)->call != NULL && t - (*p)->queued >= REAP_NS * 1e-9) {
                j = *p;
                *p = j->next;
                break;
            }
        pthread_mutex_unlock(&fsr_state.lock);
        if (j == NULL)
            return;
        COUNT(verified_by_reaper);
        fsr_verify(j->call, j->buf, j->n);
        free(j);
    }
}

static void *fsr_reaper(void *unused) {
    (void)unused;
    pthread_mutex_lock(&fsr_state.lock);
    while (!fsr_state.stopping) {
        struct timespec until;
        clock_gettime(CLOCK_REALTIME, &until);
        until.tv_nsec += REAP_NS;
        if (until.tv_nsec >= 1000000000) {
            until.tv_sec++;
            until.tv_nsec -= 1000000000;
        }
        pthread_cond_timedwait(&reap_cond, &fsr_state.lock, &until);
        if (fsr_state.stopping)
            break;
        pthread_mutex_unlock(&fsr_state.lock);
        fsr_reap(fsr_now(), 0);
        fanstore_threads_unstick(); /* a FUSE thread stuck in a direct send: another reads */
        verify_left(fsr_now());
        pthread_mutex_lock(&fsr_state.lock);
    }
    pthread_mutex_unlock(&fsr_state.lock);
    return NULL;
}

/* ------------------------------------------------------------------ the C API */

int fanstore_remote_ready(void) {
    /* every rank's thread joined the bell exchange: every rank serves */
    return __atomic_load_n(&fsr_state.gathered, __ATOMIC_ACQUIRE) == 1 &&
           !__atomic_load_n(&fsr_state.stopping, __ATOMIC_ACQUIRE);
}

int fsr_add_call(const struct call *proto, double timeout) {
    if (!fanstore_remote_ready() || proto->owner < 0 || proto->owner >= fsr_state.size ||
        proto->owner == fsr_state.rank || proto->blob >= fanstore_blobs.n)
        return -EAGAIN;
    /* direct: only a C FUSE thread, which another takes over if it stays inside MPI; one that
     * waits for a small whole blob on its own reply bell sends its request itself too (it
     * calls MPI for the reply anyway), so no thread is woken on this rank for the call */
    uint16_t bell = proto->op == FSR_OP_FETCH && !proto->python && proto->hi - proto->lo <= DECODE_INLINE
                        ? fsr_thread_bell() : 0;
    int direct = (fsr_direct || bell) && fanstore_threads_direct_ok() && fsr_mpi_fresh();
    if (!direct)
        bell = 0;
    struct call *c = malloc(sizeof(*c));
    struct fsr_header *h = direct ? malloc(sizeof(*h)) : NULL;
    if (c == NULL || (direct && h == NULL)) {
        free(c);
        free(h);
        return -EAGAIN;
    }
    *c = *proto;
    c->posted = direct;
    c->bell = bell;
    pthread_mutex_lock(&fsr_state.lock);
    if (fsr_state.stopping) { /* remote_stop sets it under the lock: nobody would finish it */
        pthread_mutex_unlock(&fsr_state.lock);
        free(c);
        free(h);
        return -EAGAIN;
    }
    uint64_t id = ++fsr_state.next_id;
    c->next = fsr_state.inflight;
    c->id = id;
    c->deadline = fsr_now() + timeout;
    fsr_state.inflight = c;
    unsigned long long open = __atomic_add_fetch(&fsr_stats.open_calls, 1, __ATOMIC_RELAXED);
    if (open > fsr_stats.peak_calls)
        fsr_stats.peak_calls = open;
    pthread_mutex_unlock(&fsr_state.lock);
    if (!direct) {
        fsr_poke(fsr_state.wake_fd); /* the remote thread sends the request */
        return 0;
    }
    if (bell)
        fsr_thread_call(proto->owner, id); /* before the send: the reply may come at once */
    COUNT(direct_sends);
    fanstore_threads_mpi(1);
    fsr_send_request(proto, id, bell, h);
    fanstore_threads_mpi(0);
    return 0;
}

/* ------------------------------------------------------------------ Python */

PyObject *fanstore_py_remote_start(PyObject *self, PyObject *args) {
    (void)self;
    const char *libmpi;
    unsigned int comm, dup_req, byte; /* MPICH's handles: 32 bits, the top one often set */
    int rank, size;
    if (!PyArg_ParseTuple(args, "sIIIii", &libmpi, &comm, &dup_req, &byte, &rank, &size))
        return NULL;
    if (fsr_state.running) {
        PyErr_SetString(PyExc_RuntimeError, "the remote thread already runs");
        return NULL;
    }
    const char *why = fsr_find_mpi(libmpi);
    int level = 0;
    if (why == NULL && (fsr_mpi.Query_thread(&level) != 0 || level < MPI_THREAD_MULTIPLE_))
        why = "MPI is not initialized with MPI_THREAD_MULTIPLE";
    if (why != NULL) {
        PyErr_SetString(PyExc_OSError, why);
        return NULL;
    }
    fsr_state.bell_fd = socket(AF_INET, SOCK_DGRAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    fsr_state.wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    fsr_state.done_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    struct sockaddr_in any = {.sin_family = AF_INET};
    if (fsr_state.bell_fd < 0 || fsr_state.wake_fd < 0 || fsr_state.done_fd < 0 ||
        bind(fsr_state.bell_fd, (struct sockaddr *)&any, sizeof(any)) != 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        return NULL;
    }
    fsr_state.comm = (int)comm;
    fsr_state.dup_req = (int)dup_req;
    fsr_state.byte = (int)byte;
    fsr_state.rank = rank;
    fsr_state.size = size;
    fsr_state.stopping = fsr_state.ready = fsr_state.gathered = 0;
    fsr_read_knobs();
    fsr_tbell_knobs();
    memset(&fsr_stats, 0, sizeof(fsr_stats));
    if (fsr_state.suspect_until == NULL)
        fsr_state.suspect_until = calloc((size_t)size, sizeof(int64_t)); /* NULL: nobody suspect */
    /* Large transfers (replies of MiBs, their receive and decode buffers) reuse freed heap
     * memory instead of fresh mmaps, whose every page is a fault and a zeroing: as much CPU as
     * the copy itself (docs/performance.md, sixth session). Memory kept: the heap's free top,
     * up to LARGE_KEEP per malloc arena. */
    mallopt(M_MMAP_THRESHOLD, LARGE_MMAP);
    mallopt(M_TRIM_THRESHOLD, LARGE_KEEP);
    sigset_t all, old; /* signals stay with the Python threads */
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, &old);
    int ok = pthread_create(&fsr_state.thread, NULL, fsr_thread, NULL) == 0;
    if (ok)
        pthread_setname_np(fsr_state.thread, "fsr-remote"); /* for top -H, /proc/PID/task */
    for (int i = 0; ok && i < WORKERS; i++) {
        if (pthread_create(&fsr_state.workers[i], NULL, fsr_worker, NULL) != 0)
            abort(); /* the remote thread runs: it needs its workers */
        pthread_setname_np(fsr_state.workers[i], "fsr-worker");
    }
    if (ok && pthread_create(&reaper, NULL, fsr_reaper, NULL) != 0)
        abort(); /* calls would have no deadline */
    if (ok)
        pthread_setname_np(reaper, "fsr-reaper");
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (!ok) {
        PyErr_SetString(PyExc_OSError, "cannot start the remote thread");
        return NULL;
    }
    fsr_state.running = 1;
    return PyLong_FromLong(fsr_state.done_fd);
}

PyObject *fanstore_py_remote_stop(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    if (!fsr_state.running)
        Py_RETURN_NONE;
    int stuck = 0;
    Py_BEGIN_ALLOW_THREADS;
    pthread_mutex_lock(&fsr_state.lock);
    __atomic_store_n(&fsr_state.stopping, 1, __ATOMIC_RELEASE);
    pthread_cond_broadcast(&fsr_state.job_cond);
    pthread_cond_broadcast(&reap_cond);
    pthread_mutex_unlock(&fsr_state.lock);
    fsr_poke(fsr_state.wake_fd);
    pthread_join(reaper, NULL);
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_sec += 3; /* a thread stuck in MPI (a dead peer's netmod) is left behind; workers
                          call MPI too when they send their replies */
    for (int i = 0; i < WORKERS; i++)
        if (pthread_timedjoin_np(fsr_state.workers[i], NULL, &until) != 0)
            stuck = 1;
    if (pthread_timedjoin_np(fsr_state.thread, NULL, &until) != 0)
        stuck = 1;
    Py_END_ALLOW_THREADS;
    if (stuck) {
        fsr_reap(0, 1); /* its calls end here: nobody waits for them */
        if (PyErr_WarnEx(PyExc_RuntimeWarning, "the C remote thread did not stop (stuck in MPI)", 1) != 0)
            return NULL;
        Py_RETURN_NONE; /* its descriptors stay open: it may still use them */
    }
    fsr_state.running = fsr_state.ready = 0;
    pthread_mutex_lock(&fsr_state.lock); /* jobs pushed after the workers ended */
    struct job *left = fsr_state.jobs;
    fsr_state.jobs = NULL;
    pthread_mutex_unlock(&fsr_state.lock);
    while (left != NULL) {
        struct job *j = left;
        left = j->next;
        if (j->call != NULL) {
            free(j->buf);
            fsr_finish(j->call, -ECANCELED);
        }
        free(j);
    }
    close(fsr_state.bell_fd);
    fsr_bells_close();
    close(fsr_state.wake_fd);
    fsr_state.bell_fd = fsr_state.wake_fd = -1;
    if (fsr_state.nsends == 0) /* no peer may still read a bare reply's pages */
        fsr_maps_drop();
    /* done_fd stays open: Python may still take the cancelled calls */
    Py_RETURN_NONE;
}

PyObject *fanstore_py_remote_stats(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    return Py_BuildValue(
        "{sisisisKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsK}", "ready", fanstore_remote_ready(), "reading", fanstore_remote_reading(), "bells",
        fsr_state.gathered == 1, "polls", fsr_stats.polls, "bell_wakes", fsr_stats.bell_wakes, "served", fsr_stats.served,
        "served_io", fsr_stats.served_io, "served_bytes", fsr_stats.served_bytes, "bad_requests", fsr_stats.bad_requests,
        "error_replies", fsr_stats.error_replies, "fetched", fsr_stats.fetched, "fetched_bytes", fsr_stats.fetched_bytes,
        "corrupt", fsr_stats.corrupt, "timeouts", fsr_stats.timeouts, "peer_errors", fsr_stats.peer_errors, "send_errors",
        fsr_stats.send_errors, "verified_by_worker", fsr_stats.verified_by_worker, "in_flight", fsr_stats.open_calls,
        "peak_in_flight", fsr_stats.peak_calls, "c_reads", fsr_stats.c_reads, "c_read_bytes",
        fsr_stats.c_read_bytes, "c_read_fallbacks", fsr_stats.c_read_fallbacks, "cache_offers",
        fsr_stats.cache_offers, "c_range_reads", fsr_stats.c_range_reads, "c_chunk_hits",
        fsr_stats.c_chunk_hits, "c_fetch_ahead", fsr_stats.c_fetch_ahead, "send_waits", fsr_stats.send_waits,
        "worker_sends", fsr_stats.worker_sends, "served_mapped", fsr_stats.served_mapped,
        "py_in_place", fsr_stats.py_in_place, "local_rings", fsr_stats.local_rings, "map_zaps", fsr_stats.map_zaps,
        "probe_again", fsr_stats.probe_again, "probe_found", fsr_stats.probe_found, "direct_sends",
        fsr_stats.direct_sends, "verified_by_reaper", fsr_stats.verified_by_reaper, "offer_pokes", fsr_stats.offer_pokes,
        "thread_rings", fsr_stats.thread_rings, "thread_replies", fsr_stats.thread_replies, "thread_waits",
        fsr_stats.thread_waits, "thread_wait_ns", fsr_stats.thread_wait_ns, "thread_take_ns", fsr_stats.thread_take_ns,
        "late_receives", fsr_stats.late_receives,
        "fuse_spares", fanstore_threads_spares());
}
