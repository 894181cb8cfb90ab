/* Remote blob reads in C: MPICH's functions found at run time, sending, and the remote thread
 * (doorbells, receiving, time-outs, sleeping). The design: _shim_remote.h. */
#define _GNU_SOURCE /* ppoll */
#include <arpa/inet.h>
#include <dlfcn.h>
#include <netdb.h>
#include <poll.h>
#include <stddef.h>
#include <stdio.h>
#include <sys/socket.h>
#include <sys/un.h>

#include "_shim_remote_int.h"

struct fsr_mpi fsr_mpi;
double fsr_idle = 0.05;
int fsr_direct = 0;
static int probe_again = 1; /* FANSTORE_CREMOTE_PROBE_AGAIN=0: one probe after a bell, for A/B */
static int worker_send = 0;
static int late_recv = 1; /* FANSTORE_CREMOTE_LATE_RECV=0: large replies with a blocking Mrecv, for A/B */

const char *fsr_find_mpi(const char *path) {
    void *lib = dlopen(path, RTLD_NOW | RTLD_NOLOAD);
    if (lib == NULL)
        return "libmpi is not loaded in this process";
#define FIND(name)                                                                                \
    if ((*(void **)&fsr_mpi.name = dlsym(lib, "MPI_" #name)) == NULL)                                 \
        return "MPI_" #name " not found in libmpi";
    FIND(Isend) FIND(Improbe) FIND(Mrecv) FIND(Imrecv) FIND(Test) FIND(Get_count) FIND(Iallgather)
    FIND(Query_thread)
#undef FIND
    return NULL;
}

/* ------------------------------------------------------------------ bells of one host */

/* A peer on this host (the same host name in the bell exchange) is rung on a local datagram
 * socket, bound to an abstract name made of its UDP bell's port, not through the UDP/IP stack
 * of loopback: measured cheaper per ring (docs/performance.md, eighth session). A peer whose
 * name does not answer (no such socket: ECONNREFUSED) is rung by UDP from then on.
 * FANSTORE_CREMOTE_LOCAL_BELL=0: UDP only. */
static int ubell_fd = -1;
static struct sockaddr_un *upeers; /* per rank, with ulen[rank] its length (0: use UDP) */
static socklen_t *ulen;

socklen_t fsr_bell_name(struct sockaddr_un *a, uint16_t port) { /* port: network order */
    memset(a, 0, sizeof(*a));
    a->sun_family = AF_UNIX; /* sun_path[0] 0: abstract, gone with the socket */
    int k = snprintf(a->sun_path + 1, sizeof(a->sun_path) - 1, "fanstore-bell-%u", (unsigned)ntohs(port));
    return (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + (size_t)k);
}

static void local_bell_open(uint16_t port) {
    if (port == 0 || !fsr_local_bells())
        return;
    struct sockaddr_un me;
    socklen_t n = fsr_bell_name(&me, port);
    int fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd >= 0 && bind(fd, (struct sockaddr *)&me, n) != 0) {
        close(fd);
        fd = -1;
    }
    ubell_fd = fd;
}

int fsr_local_bells(void) {
    const char *knob = getenv("FANSTORE_CREMOTE_LOCAL_BELL");
    return knob == NULL || strcmp(knob, "0") != 0;
}

/* `rank`'s host name in the bell exchange is ours (after fsr_take_bells) */
static int fsr_host_of(int rank) {
    return fsr_state.bell_table != NULL && rank >= 0 && rank < fsr_state.size &&
           memcmp(fsr_state.bell_table + (size_t)rank * BELL_RECORD, fsr_state.bell_mine, 64) == 0;
}

static void local_bell_peers(void) { /* after fsr_take_bells */
    if (ubell_fd < 0 || (upeers = calloc((size_t)fsr_state.size, sizeof(*upeers))) == NULL ||
        (ulen = calloc((size_t)fsr_state.size, sizeof(*ulen))) == NULL)
        return;
    for (int r = 0; r < fsr_state.size; r++)
        if (r != fsr_state.rank && fsr_state.peers[r].sin_port && fsr_host_of(r))
            ulen[r] = fsr_bell_name(&upeers[r], fsr_state.peers[r].sin_port);
}

void fsr_bells_close(void) {
    if (ubell_fd >= 0)
        close(ubell_fd);
    ubell_fd = -1;
    free(upeers);
    free(ulen);
    upeers = NULL;
    ulen = NULL;
}

/* ------------------------------------------------------------------ sending */

static void fsr_ring(int dest) {
    if (fsr_state.peers == NULL || dest < 0 || dest >= fsr_state.size || !fsr_state.peers[dest].sin_port)
        return;
    socklen_t n = ulen != NULL ? __atomic_load_n(&ulen[dest], __ATOMIC_RELAXED) : 0;
    if (n != 0) {
        if (sendto(ubell_fd, "", 1, MSG_DONTWAIT, (struct sockaddr *)&upeers[dest], n) == 1 || errno == EAGAIN) {
            COUNT(local_rings); /* EAGAIN: its queue is full of bells already */
            return;
        }
        __atomic_store_n(&ulen[dest], 0, __ATOMIC_RELAXED); /* nobody there: UDP from now on */
    }
    (void)sendto(fsr_state.bell_fd, "", 1, MSG_DONTWAIT, (struct sockaddr *)&fsr_state.peers[dest],
                 sizeof(fsr_state.peers[dest]));
}

/* Ring `bell` (a requester thread's reply bell, by its UDP port) at rank `dest`: by its local
 * name on this host, else by UDP to that port of the rank's address; 0, or a bell that cannot
 * be rung (its thread gone: ECONNREFUSED): the rank's own bell, whose remote thread then takes
 * the reply. A UDP ring to a closed port is lost: the calls' 5 ms polls take the reply then. */
static void fsr_ring_bell(int dest, uint16_t bell) {
    if (bell == 0 || fsr_state.peers == NULL || dest < 0 || dest >= fsr_state.size || !fsr_state.peers[dest].sin_port) {
        fsr_ring(dest);
        return;
    }
    socklen_t n = ulen != NULL ? __atomic_load_n(&ulen[dest], __ATOMIC_RELAXED) : 0;
    ssize_t sent;
    if (n != 0) {
        struct sockaddr_un a;
        socklen_t k = fsr_bell_name(&a, bell);
        sent = sendto(ubell_fd, "", 1, MSG_DONTWAIT, (struct sockaddr *)&a, k);
    } else {
        struct sockaddr_in a = fsr_state.peers[dest];
        a.sin_port = bell;
        sent = sendto(fsr_state.bell_fd, "", 1, MSG_DONTWAIT, (struct sockaddr *)&a, sizeof(a));
    }
    if (sent == 1 || errno == EAGAIN) /* EAGAIN: its queue is full of bells already */
        COUNT(thread_rings);
    else
        fsr_ring(dest);
}

static void fsr_track(int req, char *buf) {
    if (fsr_state.nsends == fsr_state.capsends) {
        size_t cap = fsr_state.capsends ? 2 * fsr_state.capsends : 16;
        struct sending *s = realloc(fsr_state.sends, cap * sizeof(*s));
        if (s == NULL)
            abort(); /* the send is posted; its buffer must outlive it */
        fsr_state.sends = s;
        fsr_state.capsends = cap;
    }
    fsr_state.sends[fsr_state.nsends++] = (struct sending){req, buf};
}

/* Send `buf` (malloc'd, taken over) to `dest` from the remote thread: 0, or -1 if MPI refused
 * (buf freed). */
static int fsr_post(int dest, uint16_t bell, int tag, char *buf, size_t n) {
    int req, flag = 0;
    if (fsr_mpi.Isend(buf, (int)n, fsr_state.byte, dest, tag, fsr_state.comm, &req) != 0) {
        COUNT(send_errors);
        fsr_free_out(buf);
        return -1;
    }
    int done = fsr_mpi.Test(&req, &flag, MPI_STATUS_IGNORE_) == 0 && flag; /* progress first */
    fsr_ring_bell(dest, bell);
    if (done)
        fsr_free_out(buf); /* eager: complete at once */
    else
        fsr_track(req, buf);
    return 0;
}

int fsr_mpi_fresh(void) {
    int64_t since = __atomic_load_n(&fsr_state.mpi_since, __ATOMIC_RELAXED);
    return since == 0 || (int64_t)(fsr_now() * 1e9) - since < STUCK_NS;
}

int fsr_send(int dest, uint16_t bell, int tag, char *buf, size_t n, double linger) {
    int req, flag = 0;
    if (fsr_mpi.Isend(buf, (int)n, fsr_state.byte, dest, tag, fsr_state.comm, &req) != 0) {
        COUNT(send_errors);
        fsr_free_out(buf);
        return -1;
    }
    int rung = 0; /* rung after the first test: that progress may be what puts it on its way */
    /* a rendezvous send needs the sender's progress to finish (the receiver waits for it):
     * tested after 20 us, then at doubling intervals (a later first test, or longer ones,
     * measured costlier in CPU on both sides: docs/performance.md) */
    for (double wait = 20e-6, waited = 0;; wait = wait * 2 < 1e-3 ? wait * 2 : 1e-3) {
        int done = fsr_mpi.Test(&req, &flag, MPI_STATUS_IGNORE_) != 0 || flag;
        if (!rung++)
            fsr_ring_bell(dest, bell);
        if (done) {
            fsr_free_out(buf);
            return 0;
        }
        if (waited >= linger)
            break;
        COUNT(send_waits);
        struct timespec ts = {0, (long)(wait * 1e9)};
        nanosleep(&ts, NULL);
        waited += wait;
    }
    struct out *o = malloc(sizeof(*o)); /* the remote thread completes it */
    if (o == NULL)
        abort(); /* the send is posted; its buffer must outlive it */
    *o = (struct out){NULL, dest, tag, req, 1, bell, buf, n};
    pthread_mutex_lock(&fsr_state.lock);
    o->next = fsr_state.outq;
    fsr_state.outq = o;
    pthread_mutex_unlock(&fsr_state.lock);
    fsr_poke(fsr_state.wake_fd);
    return 0;
}

void fsr_send_request(const struct call *proto, uint64_t id, uint16_t bell, struct fsr_header *h) {
    /* sent from this thread (MPI_THREAD_MULTIPLE): no wake-up of the remote thread, which
     * may already have the reply (and freed the call) when fsr_send returns */
    int owner = proto->owner;
    /* err: the reply bell (a request's err is otherwise 0) */
    *h = (struct fsr_header){FSR_MAGIC, FSR_VERSION, (uint8_t)proto->op, bell, id, proto->blob, proto->lo, proto->hi};
    if (fsr_send(owner, 0, FSR_TAG_REQUEST, (char *)h, sizeof(*h), 0) != 0) {
        COUNT(peer_errors);
        fsr_suspect(owner);
        struct call *c = fsr_unlink_call(id);
        if (c != NULL)
            fsr_finish(c, -EIO);
    }
}

void fsr_read_knobs(void) {
    const char *direct = getenv("FANSTORE_CREMOTE_DIRECT"); /* 1: sends by their own thread */
    fsr_direct = direct != NULL && strcmp(direct, "1") == 0;
    const char *idle = getenv("FANSTORE_MPI_BELL_IDLE"); /* as the Python MPI thread's */
    fsr_idle = idle != NULL && atof(idle) > 0 ? atof(idle) : 0.05;
    const char *again = getenv("FANSTORE_CREMOTE_PROBE_AGAIN");
    probe_again = again == NULL || strcmp(again, "0") != 0;
    const char *ws = getenv("FANSTORE_CREMOTE_WORKER_SEND"); /* 0: workers queue every reply */
    worker_send = ws == NULL || strcmp(ws, "0") != 0;
    const char *lr = getenv("FANSTORE_CREMOTE_LATE_RECV");
    late_recv = lr == NULL || strcmp(lr, "0") != 0;
}

int fsr_worker_sends(size_t n) {
    /* eager below this between ranks of one host (_transport.mpich_shm_defaults): the send is
     * complete when posted, so the worker neither waits nor wakes the remote thread; a send not
     * complete at its first test is handed to the remote thread (fsr_send, linger 0) */
    return worker_send && n <= FSR_EAGER_MAX && fsr_mpi_fresh();
}

static int fsr_progress_sends(void) {
    int moved = 0;
    for (size_t i = 0; i < fsr_state.nsends;) {
        int flag = 0;
        if (fsr_mpi.Test(&fsr_state.sends[i].req, &flag, MPI_STATUS_IGNORE_) != 0 || flag) {
            fsr_free_out(fsr_state.sends[i].buf);
            fsr_state.sends[i] = fsr_state.sends[--fsr_state.nsends];
            moved = 1;
        } else {
            i++;
            COUNT(send_waits);
        }
    }
    return moved;
}

void fsr_queue_out(int dest, uint16_t bell, int tag, char *buf, size_t n) {
    struct out *o = malloc(sizeof(*o));
    if (o == NULL) {
        fsr_free_out(buf);
        return; /* the requester times out and reads another way */
    }
    *o = (struct out){NULL, dest, tag, 0, 0, bell, buf, n};
    pthread_mutex_lock(&fsr_state.lock);
    struct out **p = &fsr_state.outq;
    while (*p)
        p = &(*p)->next;
    *p = o;
    pthread_mutex_unlock(&fsr_state.lock);
    fsr_poke(fsr_state.wake_fd);
}

/* ------------------------------------------------------------------ the remote thread */

static void fsr_take_bells(void) {
    fsr_state.peers = calloc((size_t)fsr_state.size, sizeof(*fsr_state.peers));
    if (fsr_state.peers == NULL)
        return;
    for (int r = 0; r < fsr_state.size; r++) {
        const char *rec = fsr_state.bell_table + (size_t)r * BELL_RECORD;
        uint16_t port;
        memcpy(&port, rec + 68, 2);
        fsr_state.peers[r].sin_family = AF_INET;
        fsr_state.peers[r].sin_port = port;
        if (memcmp(rec, fsr_state.bell_mine, 64) == 0)
            fsr_state.peers[r].sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        else
            memcpy(&fsr_state.peers[r].sin_addr, rec + 64, 4);
    }
}

static void fsr_post_gather(void) {
    memset(fsr_state.bell_mine, 0, sizeof(fsr_state.bell_mine));
    gethostname(fsr_state.bell_mine, 63);
    struct sockaddr_in me;
    socklen_t len = sizeof(me);
    uint32_t ip = htonl(INADDR_LOOPBACK);
    struct hostent *he = gethostbyname(fsr_state.bell_mine); /* before any thread but ours uses it */
    if (he != NULL && he->h_addrtype == AF_INET && he->h_addr_list[0] != NULL)
        memcpy(&ip, he->h_addr_list[0], 4);
    memcpy(fsr_state.bell_mine + 64, &ip, 4);
    if (getsockname(fsr_state.bell_fd, (struct sockaddr *)&me, &len) == 0) {
        memcpy(fsr_state.bell_mine + 68, &me.sin_port, 2);
        local_bell_open(me.sin_port);
    }
    fsr_state.bell_table = calloc((size_t)fsr_state.size, BELL_RECORD);
    if (fsr_state.bell_table == NULL ||
        fsr_mpi.Iallgather(fsr_state.bell_mine, BELL_RECORD, fsr_state.byte, fsr_state.bell_table, BELL_RECORD, fsr_state.byte, fsr_state.comm,
                       &fsr_state.gather_req) != 0)
        fsr_state.gathered = -1; /* no bells: poll */
}

static int fsr_start_calls(void) {
    struct fsr_header *todo[64];
    uint16_t bells[64];
    int n = 0;
    pthread_mutex_lock(&fsr_state.lock);
    for (struct call *c = fsr_state.inflight; c != NULL && n < 64; c = c->next) {
        if (c->posted || (todo[n] = malloc(sizeof(struct fsr_header))) == NULL)
            continue; /* no memory: its deadline ends it */
        c->posted = 1;
        bells[n] = c->bell;
        *todo[n++] = (struct fsr_header){FSR_MAGIC, FSR_VERSION, (uint8_t)c->op, c->owner, c->id, c->blob,
                                         c->lo, c->hi};
    }
    struct out *o = fsr_state.outq;
    fsr_state.outq = NULL;
    pthread_mutex_unlock(&fsr_state.lock);
    for (int i = 0; i < n; i++) {
        int owner = todo[i]->err; /* carried here until sent: a request's err is its reply bell */
        uint64_t id = todo[i]->id;
        todo[i]->err = bells[i];
        if (fsr_post(owner, 0, FSR_TAG_REQUEST, (char *)todo[i], sizeof(struct fsr_header)) != 0) {
            COUNT(peer_errors);
            fsr_suspect(owner);
            struct call *c = fsr_unlink_call(id);
            if (c != NULL)
                fsr_finish(c, -EIO);
        }
    }
    int moved = n > 0 || o != NULL;
    while (o != NULL) {
        struct out *next = o->next;
        if (o->posted)
            fsr_track(o->req, o->buf);
        else
            fsr_post(o->dest, o->bell, o->tag, o->buf, o->n);
        free(o);
        o = next;
    }
    return moved;
}

static void fsr_deliver(char *buf, size_t pre, size_t n, int source, int tag) {
    if (pre)
        fsr_answered_bare(buf, pre + n, source, tag);
    else
        fsr_answered(buf, n);
}

/* A rank on this host (the same host name in the bell exchange, once it is done): MPICH moves
 * its messages through shared memory, where the bytes of a matched message are all there to
 * copy (CMA), so a blocking receive of it waits for no network. */
static int fsr_same_host(int rank) {
    return fsr_state.gathered == 1 && fsr_host_of(rank);
}

int fsr_take_reply(int *msg, const struct mpi_status *st, int later) {
    int count = 0;
    fsr_mpi.Get_count(st, fsr_state.byte, &count);
    size_t pre = st->tag >= FSR_TAG_BARE ? sizeof(struct fsr_header) : 0; /* its header: ours */
    size_t n = count > 0 ? (size_t)count : 0;
    char *buf = fanstore_data_alloc(pre + (n ? n : 1));
    if (buf == NULL)
        abort(); /* a matched message must be received */
    if (later && late_recv && n > FSR_EAGER_MAX && !fsr_same_host(st->source)) {
        int req;
        if (fsr_state.nrecvs == fsr_state.caprecvs) {
            size_t cap = fsr_state.caprecvs ? 2 * fsr_state.caprecvs : 16;
            struct receiving *r = realloc(fsr_state.recvs, cap * sizeof(*r));
            if (r == NULL)
                abort(); /* a matched message must be received */
            fsr_state.recvs = r;
            fsr_state.caprecvs = cap;
        }
        if (fsr_mpi.Imrecv(buf + pre, count, fsr_state.byte, msg, &req) != 0) {
            COUNT(peer_errors);
            free(buf);
            return -1;
        }
        COUNT(late_receives);
        fsr_state.recvs[fsr_state.nrecvs++] = (struct receiving){req, st->source, st->tag, buf, pre, n};
        return 0;
    }
    if (fsr_mpi.Mrecv(buf + pre, count, fsr_state.byte, msg, MPI_STATUS_IGNORE_) != 0) {
        COUNT(peer_errors);
        free(buf);
        return -1;
    }
    fsr_deliver(buf, pre, n, st->source, st->tag);
    return 0;
}

/* The large replies being received (fsr_take_reply's `later`): those complete handed over. */
static int fsr_progress_recvs(void) {
    int moved = 0;
    for (size_t i = 0; i < fsr_state.nrecvs;) {
        int flag = 0;
        struct receiving r = fsr_state.recvs[i];
        int rc = fsr_mpi.Test(&fsr_state.recvs[i].req, &flag, MPI_STATUS_IGNORE_);
        if (rc == 0 && !flag) {
            i++;
            continue;
        }
        fsr_state.recvs[i] = fsr_state.recvs[--fsr_state.nrecvs];
        moved = 1;
        if (rc != 0) {
            COUNT(peer_errors); /* its call times out, then reads another way */
            free(r.buf);
        } else {
            fsr_deliver(r.buf, r.pre, r.n, r.source, r.tag);
        }
    }
    return moved;
}

/* Every message waiting, received and handled; `rung`: a bell rang, so a message is on its
 * way. MPICH's Improbe looks at what has arrived and only then runs progress once, which moves
 * a message that just came in (shared memory: out of the cell queue) to where the next probe
 * finds it: so after a bell a probe that finds nothing is made once more at once. Without that
 * second probe every bell cost a 20 us timed wait and one more wake-up on both sides
 * (`strace` of both remote threads, twelfth session). */
static int fsr_receive(int rung) {
    int moved = 0;
    for (int k = 0; k < 64; k++) {
        int flag = 0, msg, count = 0;
        struct mpi_status st;
        if (fsr_mpi.Improbe(MPI_ANY_SOURCE_, MPI_ANY_TAG_, fsr_state.comm, &flag, &msg, &st) != 0)
            break;
        if (!flag && rung && probe_again && k == 0) {
            COUNT(probe_again);
            if (fsr_mpi.Improbe(MPI_ANY_SOURCE_, MPI_ANY_TAG_, fsr_state.comm, &flag, &msg, &st) != 0)
                break;
            if (flag)
                COUNT(probe_found);
        }
        if (!flag)
            break;
        moved = 1;
        if (st.tag >= FSR_TAG_BARE || st.tag == FSR_TAG_REPLY) {
            fsr_take_reply(&msg, &st, 1);
            continue;
        }
        fsr_mpi.Get_count(&st, fsr_state.byte, &count);
        char *buf = malloc(count > 0 ? (size_t)count : 1);
        if (buf == NULL)
            abort(); /* a matched message must be received */
        if (fsr_mpi.Mrecv(buf, count, fsr_state.byte, &msg, MPI_STATUS_IGNORE_) != 0) {
            COUNT(peer_errors);
            free(buf);
            continue;
        }
        size_t n = (size_t)count;
        if (st.tag != FSR_TAG_REQUEST || n != sizeof(struct fsr_header)) {
            COUNT(bad_requests);
            if (n >= sizeof(struct fsr_header) && st.tag == FSR_TAG_REQUEST) {
                size_t m;
                char *err = fsr_error_reply((struct fsr_header *)buf, EPROTO, &m);
                if (err != NULL) /* NULL: no memory; the peer times out */
                    fsr_post(st.source, fsr_request_bell((struct fsr_header *)buf), FSR_TAG_REPLY, err, m);
            }
            free(buf);
            continue;
        }
        size_t m;
        int again, tag;
        char *reply = fsr_serve((struct fsr_header *)buf, 1, &m, &again, &tag);
        if (reply != NULL) {
            fsr_post(st.source, fsr_request_bell((struct fsr_header *)buf), tag, reply, m);
        } else {
            struct job *j = calloc(1, sizeof(*j));
            if (j != NULL) {
                j->source = st.source;
                memcpy(&j->h, buf, sizeof(j->h));
                fsr_push_job(j);
            }
        }
        free(buf);
    }
    return moved;
}

void fsr_suspect(int rank) {
    if (fsr_state.suspect_until != NULL && rank >= 0 && rank < fsr_state.size)
        __atomic_store_n(&fsr_state.suspect_until[rank], (int64_t)((fsr_now() + SUSPECT_SECONDS) * 1e9),
                         __ATOMIC_RELAXED);
}

int fanstore_remote_suspect(int rank) {
    int64_t *s = fsr_state.suspect_until;
    return s != NULL && rank >= 0 && rank < fsr_state.size &&
           __atomic_load_n(&s[rank], __ATOMIC_RELAXED) > (int64_t)(fsr_now() * 1e9);
}

/* The bells that rang, in one recvmmsg (a drain loop's last read, the one that finds none, was
 * one more syscall per wake-up); ppoll wakes again at once for any left. */
void fsr_take_rings(int fd) {
    char bufs[16][8];
    struct iovec iov[16];
    struct mmsghdr m[16];
    memset(m, 0, sizeof(m));
    for (int i = 0; i < 16; i++) {
        iov[i] = (struct iovec){bufs[i], sizeof(bufs[i])};
        m[i].msg_hdr.msg_iov = &iov[i];
        m[i].msg_hdr.msg_iovlen = 1;
    }
    (void)recvmmsg(fd, m, 16, MSG_DONTWAIT, NULL);
}

void *fsr_thread(void *unused) {
    (void)unused;
    double due = 0; /* the current poll interval while polling */
    int chase = 0;  /* a bell rang: its message may still be on its way */
    while (!__atomic_load_n(&fsr_state.stopping, __ATOMIC_ACQUIRE)) {
        COUNT(polls);
        int moved = 0;
        if (!fsr_state.ready) {
            int flag = 0;
            if (fsr_mpi.Test(&fsr_state.dup_req, &flag, MPI_STATUS_IGNORE_) == 0 && flag) {
                fsr_post_gather();
                __atomic_store_n(&fsr_state.ready, 1, __ATOMIC_RELEASE);
                moved = 1;
            }
        } else {
            if (fsr_state.gathered == 0) {
                int flag = 0;
                if (fsr_mpi.Test(&fsr_state.gather_req, &flag, MPI_STATUS_IGNORE_) != 0)
                    fsr_state.gathered = -1;
                else if (flag) {
                    fsr_take_bells();
                    if (fsr_state.peers != NULL)
                        local_bell_peers();
                    __atomic_store_n(&fsr_state.gathered, 1, __ATOMIC_RELEASE);
                }
            }
            __atomic_store_n(&fsr_state.mpi_since, (int64_t)(fsr_now() * 1e9), __ATOMIC_RELAXED);
            moved |= fsr_start_calls();
            moved |= fsr_receive(chase);
            if (fsr_state.nsends)
                moved |= fsr_progress_sends();
            if (fsr_state.nrecvs)
                moved |= fsr_progress_recvs();
            __atomic_store_n(&fsr_state.mpi_since, 0, __ATOMIC_RELAXED);
            if (fsr_state.inflight)
                fsr_reap(fsr_now(), 0);
        }
        if (moved) {
            due = 0;
            chase = 0;
            continue;
        }
        fsr_offers_flush(0); /* blobs for the disk cache held back 20 ms at most */
        double timeout;
        int idle = 0; /* a whole idle wait: nothing in flight, nothing being chased */
        if (fsr_state.gathered != 1) {
            timeout = 5e-3; /* waiting for the other ranks' threads: nothing to serve yet */
        } else if (fsr_state.nsends || fsr_state.nrecvs || chase) {
            due = due ? (due * 2 < 1e-3 ? due * 2 : 1e-3) : 20e-6;
            chase = chase && due < 1e-3;
            timeout = due;
        } else {
            /* bells announce every message: these waits only bound what a lost bell costs
             * (deadlines are also enforced by the workers); every wake-up is CPU */
            timeout = fsr_state.inflight ? fsr_idle / 10 : fsr_idle;
            idle = !fsr_state.inflight;
        }
        struct pollfd fds[3] = {{fsr_state.bell_fd, POLLIN, 0}, {fsr_state.wake_fd, POLLIN, 0}, {ubell_fd, POLLIN, 0}};
        struct timespec ts = {(time_t)timeout, (long)((timeout - (double)(time_t)timeout) * 1e9)};
        if (ppoll(fds, 3, &ts, NULL) > 0) {
            if (fds[0].revents || fds[2].revents) {
                if (fds[0].revents)
                    fsr_take_rings(fsr_state.bell_fd);
                if (fds[2].revents)
                    fsr_take_rings(ubell_fd);
                COUNT(bell_wakes);
                chase = 1;
                due = 0;
            }
            if (fds[1].revents)
                fsr_take_pokes(fsr_state.wake_fd);
        } else if (idle) {
            fsr_maps_idle();
            fsr_offers_flush(1);
        }
    }
    /* stopping: what is in flight will not be answered */
    fsr_reap(0, 1);
    double end = fsr_now() + 1.0; /* let replies already posted reach their requesters */
    while ((fsr_state.nsends || fsr_state.nrecvs) && fsr_now() < end) {
        fsr_progress_sends();
        fsr_progress_recvs(); /* calls reaped: each reply freed; one not done is left to MPI */
        usleep(1000);
    }
    return NULL;
}

