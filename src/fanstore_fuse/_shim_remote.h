/* Remote blob reads in C (issue 11): one thread per rank that serves other ranks' requests for
 * the stored bytes of blobs held here and sends this rank's own requests, over MPI on a
 * communicator of its own (a duplicate of the daemon's: Python's MPI thread never sees these
 * messages, and this thread never sees Python's). No GIL anywhere on the path.
 *
 * MPI is not linked: its functions are found at start in the libmpi that mpi4py already loaded
 * (dlopen RTLD_NOLOAD of the path Python gives), so the module builds without MPI headers and
 * a one-rank mount never loads MPI. Only MPICH's ABI (int handles, its MPI_Status layout) is
 * supported; Python checks the library before starting (`_cremote.py`).
 *
 * The wire format, in one place: every message is one fsr_header (host byte order: the ranks
 * of one job share the architecture), a request alone, a reply followed by the stored bytes
 * [lo, hi) of the blob (FSR_OP_FETCH), or, for FSR_OP_FRAMES (a request for the raw bytes
 * [lo, hi) of a framed blob), a reply whose lo, hi are the stored range of the frames that
 * cover them, followed by the blob's frame table and those frames (_shim_remote_range.c).
 * Requests travel with FSR_TAG_REQUEST, replies with FSR_TAG_REPLY and
 * the request's id; a reply with err != 0 carries no bytes. A request for all the stored
 * bytes of a large blob may be answered "bare" (version 3): those bytes alone, sent from a
 * mapping of the partition, tagged FSR_TAG_BARE + id % FSR_BARE_IDS (_shim_remote_serve_map.c). A request that does not decode is
 * answered EPROTO; a blob not held here ENOENT; a range outside the blob EINVAL; a failed read
 * EIO. The requester verifies (the manifest's xxh3, every frame's): bytes that fail it never
 * reach a reader, and the request goes back to Python (replicas, then DEST, then EIO).
 *
 * Sending: every send by the remote thread, handed over through an eventfd (the default).
 * FANSTORE_CREMOTE_DIRECT=1: a request is sent by the thread that makes the call (the FUSE
 * thread of a READ; MPI_THREAD_MULTIPLE), a reply read from the disk by the worker that read
 * it; each rings the peer's bell after its Isend. A rendezvous send (the receiver waits for the
 * sender's progress) is tested after 20 us, then at doubling intervals up to 1 ms: by the
 * worker for up to 2 ms, then by the remote thread. Off by default: with it, a reader hung
 * after a peer was SIGKILLed under CPU load (test_rendezvous's sigkill test, 2 of 2 runs with
 * 4 CPU hogs; it passed with it off): a FUSE thread must never wait inside MPI.
 *
 * Waiting: the thread sleeps in ppoll on a UDP socket (a doorbell: a sender rings it after
 * each Isend, addresses exchanged with an Iallgather on the new communicator, as
 * _doorbell.py) and an eventfd (local submissions). It polls instead, 20 us growing to 1 ms,
 * while a rendezvous send must progress or a bell announced a message not yet matched;
 * otherwise it sleeps up to FANSTORE_MPI_BELL_IDLE (50 ms), a tenth of it with calls in
 * flight: a lost bell costs one wait, never a hang (deadlines are enforced by the workers
 * too). A call unanswered after its timeout completes with ETIMEDOUT.
 */
#ifndef FANSTORE_SHIM_REMOTE_H
#define FANSTORE_SHIM_REMOTE_H
#include <stddef.h>
#include <stdint.h>

#define FSR_MAGIC 0x5246 /* "FR" */
#define FSR_VERSION 3 /* 2: FSR_OP_FRAMES; 3: bare replies */
#define FSR_TAG_REQUEST 200
#define FSR_TAG_REPLY 201
#define FSR_TAG_BARE 16384 /* + id % FSR_BARE_IDS: a bare reply (every tag <= 32767, MPI's least TAG_UB) */
#define FSR_BARE_IDS 16384
#define FSR_OP_FETCH 1  /* stored bytes [lo, hi) of blob */
#define FSR_OP_FRAMES 2 /* raw bytes [lo, hi) of a framed blob: its table and covering frames */

struct fsr_header {
    uint16_t magic;
    uint8_t version;
    uint8_t op;
    int32_t err; /* reply: 0, or the errno of the failure (no bytes follow); request: the UDP
                    port (network order) of the requesting thread's reply bell, or 0 (ring the
                    requester's rank: _shim_remote_tbell.c); older servers ignore it */
    uint64_t id; /* chosen by the requester, echoed in the reply */
    uint64_t blob;
    uint64_t lo, hi; /* stored bytes of the blob; the reply carries hi - lo of them */
};
_Static_assert(sizeof(struct fsr_header) == 40, "fsr_header is 40 bytes on the wire");

/* A call's outcome: status 0 and the blob's verified raw bytes lo..hi (whole-blob calls: all of
 * them), or a negative errno (-ETIMEDOUT, -EIO a corrupt or failed reply, the peer's error).
 * Called on the remote thread or one of its workers; `raw` is the callee's to free(). */
typedef void (*fanstore_remote_done)(void *ctx, int status, char *raw, size_t n);

/* Ask rank `owner` for the whole of `blob` (the manifest's blob columns must be held:
 * _shim_blobs.h); `done` is called exactly once. 0, or -EAGAIN when the remote thread is not
 * running (the caller serves the read another way). */
int fanstore_remote_fetch(int owner, uint64_t blob, double timeout, fanstore_remote_done done, void *ctx);

/* A range call's outcome: status 0 and the verified raw bytes asked for, valid only during
 * the call (the callee copies what it keeps), or a negative errno as above. */
typedef void (*fanstore_remote_view)(void *ctx, int status, const char *bytes, size_t n);

/* Ask rank `owner` for the raw bytes [lo, hi) of framed `blob` (FSR_OP_FRAMES: only the
 * frames covering them travel, with the table; each is checked here); `view` is called
 * exactly once. 0, -EAGAIN (no remote thread), or -EINVAL (not framed, bad range). */
int fanstore_remote_fetch_range(int owner, uint64_t blob, uint64_t lo, uint64_t hi, double timeout,
                                fanstore_remote_view view, void *ctx);

/* As fanstore_remote_fetch_range, but the bytes are kept: they lie inside `mem`, the callee's
 * to free() (NULL when status is not 0). Raw frames are checked where they were received:
 * no copy. A blob that is not framed may be asked for whole only (lo 0, hi its raw length):
 * an FSR_OP_FETCH, whose reply is checked where it was received when the blob is stored raw
 * (no copy either), else decoded into `mem`. */
typedef void (*fanstore_remote_kept)(void *ctx, int status, const char *bytes, size_t n, void *mem);
int fanstore_remote_fetch_kept(int owner, uint64_t blob, uint64_t lo, uint64_t hi, double timeout,
                               fanstore_remote_kept kept, void *ctx);

/* Whether `rank` timed out or refused a send in the last SUSPECT_SECONDS (READs in C then
 * leave its blobs to Python, which tries the other copies first). */
int fanstore_remote_suspect(int rank);

/* Whether the remote thread runs and every rank's thread joined the exchange of doorbell
 * addresses on the new communicator (so every rank serves requests: a rank that did not start
 * its thread keeps every other rank on the Python path). */
int fanstore_remote_ready(void);

/* READs of blobs held elsewhere answered through the remote thread (_shim_remote_read.c):
 * patched into the FUSE table after _shim_read.c's, whose handler gets every READ not taken. */
struct fuse_lowlevel_ops;
void fanstore_patch_remote(struct fuse_lowlevel_ops *ops);
/* Whether READs in C are on: remote_read_start ran and the owners are published. */
int fanstore_remote_reading(void);
/* Whether it takes this READ (its fuse_read_in `body`), for _shim_open.c's request loop. */
int fanstore_remote_answered(uint64_t ino, const void *body, size_t left);

#ifdef Py_PYTHON_H /* the module's functions, for _noflush.c's method table */
PyObject *fanstore_py_remote_read_start(PyObject *self, PyObject *args);
PyObject *fanstore_py_remote_owners(PyObject *self, PyObject *arr);
PyObject *fanstore_py_remote_ahead(PyObject *self, PyObject *arg);
PyObject *fanstore_py_remote_chunk(PyObject *self, PyObject *arg);
PyObject *fanstore_py_remote_start(PyObject *self, PyObject *args);
PyObject *fanstore_py_remote_stop(PyObject *self, PyObject *unused);
PyObject *fanstore_py_remote_fetch(PyObject *self, PyObject *args);
PyObject *fanstore_py_remote_take(PyObject *self, PyObject *unused);
PyObject *fanstore_py_remote_stats(PyObject *self, PyObject *unused);
PyObject *fanstore_py_remote_bench(PyObject *self, PyObject *args); /* _shim_remote_range.c */

#define FANSTORE_REMOTE_METHODS                                                                  \
    {"remote_start", fanstore_py_remote_start, METH_VARARGS,                                     \
     "remote_start(libmpi, comm, dup_request, byte, rank, size, serve_only): start the remote " \
     "thread on a duplicate communicator (mpi4py handles); returns the completion eventfd"},     \
    {"remote_stop", fanstore_py_remote_stop, METH_NOARGS,                                        \
     "remote_stop(): stop the remote thread (calls in flight complete with ECANCELED)"},         \
    {"remote_fetch", fanstore_py_remote_fetch, METH_VARARGS,                                     \
     "remote_fetch(owner, blob, token, timeout): ask `owner` for `blob`; the outcome comes "     \
     "back from remote_take() with `token`"},                                                    \
    {"remote_take", fanstore_py_remote_take, METH_NOARGS,                                        \
     "remote_take(): [(token, status, bytes or None)] of the calls finished since the last "     \
     "take (status 0 or a negative errno); clears the eventfd"},                                 \
    {"remote_stats", fanstore_py_remote_stats, METH_NOARGS,                                      \
     "remote_stats(): the remote thread's counters (dict)"},                                     \
    {"remote_bench", fanstore_py_remote_bench, METH_VARARGS,                                     \
     "remote_bench(owners, blobs, window, timeout): fetch these whole blobs as READs in C do "    \
     "(framed: kept, raw frames checked in place), `window` in flight, GIL released; returns "   \
     "(raw bytes verified, failures) (bench._transport_bw)"},                                    \
    {"remote_read_start", fanstore_py_remote_read_start, METH_VARARGS,                           \
     "remote_read_start(fallback, timeout, cache_index or None): READs of blobs held elsewhere " \
     "through the remote thread from now on (once remote_owners published the owners)"},        \
    {"remote_owners", fanstore_py_remote_owners, METH_O,                                         \
     "remote_owners(u16 array): the primary owner of every blob (published once)"},             \
    {"remote_ahead", fanstore_py_remote_ahead, METH_O,                                           \
     "remote_ahead(blob): whether READs in C fetch it ahead for Python's read-ahead (True: "     \
     "Python leaves it)"},                                                                       \
    {"remote_chunk", fanstore_py_remote_chunk, METH_O,                                           \
     "remote_chunk(blob): a copy of it from the chunk cache of READs in C, True while being "    \
     "fetched there, else None"},
#endif

#endif
