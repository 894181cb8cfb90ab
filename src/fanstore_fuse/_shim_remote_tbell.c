/* Reply bells of the C FUSE threads (issue 11: the remote path's wake-ups).
 *
 * A remote READ of a small whole blob used to wake three threads of the requesting rank: the
 * remote thread (poked to send the request), the remote thread again (rung by the server's
 * reply: it received the reply and answered the READ), and the FUSE thread that had gone to
 * sleep in read(2) (woken by the reader's next request). On this VM each wake-up of a halted
 * vCPU costs more CPU than the work it does.
 *
 * Now the FUSE thread that takes such a READ sends the request itself (MPI_THREAD_MULTIPLE,
 * bracketed as a direct send: fanstore_threads_mpi) and names its own reply bell in the
 * request's `err` field (otherwise 0 in a request): the port of a UDP socket it opened, and on
 * this host a local datagram socket bound to that port's abstract name (fsr_bell_name). The
 * server rings that bell instead of the rank's (fsr_ring_bell). The FUSE thread waits with
 * ppoll on /dev/fuse and its bell; rung, it probes for the reply of each of its calls by source
 * and tag (a bare reply's tag, twice after a bell, then FSR_TAG_REPLY) and hands it to its
 * call as the remote thread would (fsr_take_reply): the READ is answered from this thread. It
 * then reads /dev/fuse without polling first (polling there cost more CPU than the wake-up it
 * saves: _shim_threads.c). Measured: about two wake-ups of threads per remote file on the
 * requesting rank instead of about four (docs/performance.md, eighteenth session).
 *
 * Whoever receives a reply answers its call (the calls are found by id under the lock), so the
 * remote thread taking it instead is harmless. Lost or unanswerable bells are bounded: the
 * wait probes every WAIT_NS without one, a bell that cannot be rung (ECONNREFUSED: its thread
 * is gone) rings the rank's bell instead, the remote thread polls every 5 ms while calls are in
 * flight, and every call keeps its deadline. While a thread is stuck inside MPI (a dead peer's
 * netmod) no thread probes: the wait pokes the remote thread instead.
 * FANSTORE_CREMOTE_REPLY_BELL=0: off (the remote thread takes every reply, as before).
 * A ring thread of _shim_uring.c waits in its ring, not in ppoll: it polls the bell's fds there
 * (fanstore_remote_bell_fds) and calls fanstore_remote_take_own when one rang or its wait of
 * WAIT_NS ended with calls in flight.
 */
#define _GNU_SOURCE
#define FUSE_USE_VERSION 35
#include <fuse_lowlevel.h>
#include <poll.h>
#include <sys/socket.h>

#include "_shim_ops.h"
#include "_shim_remote_int.h"

#define TB_MAX 8          /* calls one thread follows at once; more go the remote thread's way */
#define WAIT_NS FANSTORE_BELL_WAIT_NS /* a probe at least this often while waiting (a lost bell) */

static int tbell_on = 1;

void fsr_tbell_knobs(void) {
    const char *k = getenv("FANSTORE_CREMOTE_REPLY_BELL");
    tbell_on = k == NULL || strcmp(k, "0") != 0;
}

struct tb_fds {
    int udp, local;
    uint16_t port; /* the UDP socket's, network order */
};
static pthread_key_t tb_key;
static pthread_once_t tb_once = PTHREAD_ONCE_INIT;
static __thread struct tb_fds *tb; /* this thread's bell, once opened */
static __thread int tb_failed;
static __thread struct {
    int owner;
    uint64_t id;
    double sent; /* fsr_now() when recorded, just before its request was sent */
} tb_calls[TB_MAX];
static __thread int tb_n;

static void tb_close(void *p) { /* at the thread's end (also when cancelled) */
    struct tb_fds *f = p;
    close(f->udp);
    if (f->local >= 0)
        close(f->local);
    free(f);
}

static void tb_make_key(void) { (void)pthread_key_create(&tb_key, tb_close); }

static int tb_open(void) {
    struct tb_fds *f = malloc(sizeof(*f));
    struct sockaddr_in me = {.sin_family = AF_INET};
    socklen_t len = sizeof(me);
    int u = f != NULL ? socket(AF_INET, SOCK_DGRAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0) : -1;
    if (u < 0 || bind(u, (struct sockaddr *)&me, sizeof(me)) != 0 ||
        getsockname(u, (struct sockaddr *)&me, &len) != 0 || me.sin_port == 0) {
        if (u >= 0)
            close(u);
        free(f);
        return 0;
    }
    int x = -1;
    if (fsr_local_bells()) { /* a peer on this host rings it by name (cheaper than UDP) */
        struct sockaddr_un a;
        socklen_t n = fsr_bell_name(&a, me.sin_port);
        x = socket(AF_UNIX, SOCK_DGRAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
        if (x >= 0 && bind(x, (struct sockaddr *)&a, n) != 0) {
            close(x);
            x = -1; /* rung there, the server gets ECONNREFUSED and rings the rank's bell */
        }
    }
    *f = (struct tb_fds){u, x, me.sin_port};
    pthread_once(&tb_once, tb_make_key);
    (void)pthread_setspecific(tb_key, f);
    tb = f;
    return 1;
}

uint16_t fsr_thread_bell(void) {
    if (!tbell_on || !fanstore_c_thread || tb_failed || tb_n >= TB_MAX)
        return 0;
    if (tb == NULL && !tb_open()) {
        tb_failed = 1;
        return 0;
    }
    return tb->port;
}

void fsr_thread_call(int owner, uint64_t id) {
    if (tb_n < TB_MAX) {
        tb_calls[tb_n].owner = owner;
        tb_calls[tb_n].sent = fsr_now();
        tb_calls[tb_n++].id = id;
    }
}

int fanstore_remote_own_calls(void) { return tb_n; }

/* The calls this thread follows that are still in flight (the others were answered, by this
 * thread or another, or ended by their deadline): kept, and counted. */
static int tb_prune(void) {
    int k = 0;
    pthread_mutex_lock(&fsr_state.lock);
    for (int i = 0; i < tb_n; i++)
        for (struct call *c = fsr_state.inflight; c != NULL; c = c->next)
            if (c->id == tb_calls[i].id) {
                tb_calls[k++] = tb_calls[i];
                break;
            }
    pthread_mutex_unlock(&fsr_state.lock);
    return tb_n = k;
}

/* The replies of this thread's calls that have come (after a bell, a probe that finds nothing
 * is made once more: MPICH's first probe may only move the message where the second sees it,
 * as in fsr_receive). */
static void tb_receive(int rung, double woke) {
    if (!fanstore_threads_direct_ok() || !fsr_mpi_fresh()) {
        fsr_poke(fsr_state.wake_fd); /* a thread is stuck inside MPI: the remote thread's turn */
        return;
    }
    fanstore_threads_mpi(1);
    for (int i = 0; i < tb_n; i++) {
        /* most replies are bare: that tag first, again after a bell (the first probe's progress
         * is what moves the message in), then FSR_TAG_REPLY (a reply with a header) */
        int owner = tb_calls[i].owner, bare = FSR_TAG_BARE + (int)(tb_calls[i].id % FSR_BARE_IDS);
        int tags[3] = {bare, rung ? bare : FSR_TAG_REPLY, FSR_TAG_REPLY};
        for (int k = 0; k < (rung ? 3 : 2); k++) {
            int flag = 0, msg;
            struct mpi_status st;
            if (fsr_mpi.Improbe(owner, tags[k], fsr_state.comm, &flag, &msg, &st) != 0)
                break;
            if (flag) {
                if (fsr_take_reply(&msg, &st, 0) == 0) {
                    COUNT(thread_replies); /* where the time went: waiting, then taking it */
                    ADD(thread_wait_ns, (unsigned long long)((woke - tb_calls[i].sent) * 1e9));
                    ADD(thread_take_ns, (unsigned long long)((fsr_now() - woke) * 1e9));
                }
                break;
            }
        }
    }
    fanstore_threads_mpi(0);
}

void fanstore_remote_wait_own(int dev_fd) {
    while (tb_prune() > 0) {
        struct pollfd p[3] = {{dev_fd, POLLIN, 0}, {tb->udp, POLLIN, 0}, {tb->local, POLLIN, 0}};
        struct timespec ts = {0, WAIT_NS};
        int old;
        pthread_setcancelstate(PTHREAD_CANCEL_ENABLE, &old); /* unmounting cancels the thread here too */
        int r = ppoll(p, tb->local >= 0 ? 3 : 2, &ts, NULL);
        pthread_setcancelstate(old, NULL);
        if ((r < 0 && errno != EINTR) || (r > 0 && p[0].revents))
            return; /* a request first (the bell stays rung), or read(2) says what is wrong */
        if (p[1].revents)
            fsr_take_rings(tb->udp);
        if (tb->local >= 0 && p[2].revents)
            fsr_take_rings(tb->local);
        COUNT(thread_waits);
        tb_receive(r > 0, fsr_now());
    }
}

int fanstore_remote_bell_fds(int fds[2]) {
    if (tb == NULL)
        return 0;
    fds[0] = tb->udp;
    fds[1] = tb->local;
    return tb->local >= 0 ? 2 : 1;
}

void fanstore_remote_take_own(int fd) {
    if (fd >= 0)
        fsr_take_rings(fd);
    if (tb_prune() > 0) {
        COUNT(thread_waits);
        tb_receive(fd >= 0, fsr_now());
    }
}
