/* READs of dataset files whose blob another rank holds, answered by the remote thread
 * (issue 11; the remote thread: _shim_remote.h).
 *
 * Patched into the FUSE table after _shim_read.c (fanstore_patch_remote): a READ this does not
 * take goes on to _shim_read.c's handler (held here: C; else pyfuse3's). It takes a READ when
 * the remote thread is ready, Python switched this on (remote_read_start, in the trio run) and
 * gave the owner of every blob (remote_owners), the handle is the inode of a dataset regular
 * file that _shim_read.c serves, the READ lies in one blob not held here, and:
 * - the blob is in the chunk cache (below), even if it reached the disk cache since; else it is
 *   not in the disk cache (its slot in DiskCache's index is 0: Python reads cached blobs), and
 * - the blob is at most WHOLE_MAX raw bytes, or the READ covers all of it: the whole blob
 *   travels, is verified, then is offered to the disk cache when there is one (CRemote.run);
 * - or the blob is larger (up to CHUNK_MAX) and the READ sequential (it starts where the last
 *   READ of the file ended, or at the chunk's start): the whole blob travels once into one of
 *   SLOTS slots, the chunk cache (READs arriving while it travels wait on it, later ones are
 *   answered from it on the FUSE thread), the file's next AHEAD chunks are fetched ahead
 *   (FANSTORE_CREMOTE_AHEAD: a pipeline), and the blob is offered to the disk cache, the slot's
 *   own block shared with the offer (no copy). Python's read-ahead asks remote_ahead first and
 *   leaves what this fetches; a READ Python answers takes a slot's bytes (remote_chunk): each
 *   chunk travels once, not once for C and once for Python;
 * - or the blob is framed and larger, the READ not sequential, and there is no disk cache:
 *   only the frames that cover the READ travel (FSR_OP_FRAMES, _shim_remote_range.c). With a
 *   disk cache such READs go to Python, which fetches the chunk once and caches it.
 * The call goes to the blob's primary owner; its reply (verified in C: nothing that failed a
 * check is ever sent) is answered with fuse_reply_buf. A time-out, an error reply or bad bytes
 * hand the READ to Python on a thread of its own (_cremote._ReadFallback: log, mark a silent
 * peer, read through Operations.read: replicas, DEST, EIO).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#define FUSE_USE_VERSION 35
#include <fuse_lowlevel.h>
#include <signal.h>

#include "_shim_dataset.h"
#include "_shim_ops.h"
#include "_shim_remote_int.h"

#define WHOLE_MAX (1u << 20)
#define SLOTS 8      /* whole chunks kept for sequential READs (8 x 4 MiB chunks: 32 MiB) */
#define CHUNK_MAX (16u << 20) /* larger blobs never go in a slot (8 x 16 MiB at most) */
#define SEQ_SLOTS 64 /* files whose last READ's end is remembered (hashed by inode) */
#define AHEAD 3      /* the file's next chunks fetched ahead of a sequential reader */
#define AHEAD_SPAN 4 /* looked at: up to AHEAD_SPAN x ahead chunks past the READ's */

typedef void (*read_op_t)(fuse_req_t, fuse_ino_t, size_t, off_t, struct fuse_file_info *);
typedef int (*reply_buf_t)(fuse_req_t, const char *, size_t);

static read_op_t next_read;
static reply_buf_t reply_buf;
static PyObject *fallback; /* _cremote._ReadFallback: (ino, off, size, owner, status, blob) -> bytes | errno */
static Py_buffer owners_buf, cache_buf;
static const uint16_t *owner;     /* primary owner per blob, once published */
static const uint64_t *cache_loc; /* DiskCache's index, or NULL */
static double timeout;
static int reading, chunks = 1; /* chunks: FANSTORE_CREMOTE_CHUNKS=0 turns the chunk cache off */
static int ahead = AHEAD;       /* FANSTORE_CREMOTE_AHEAD: chunks fetched ahead (0: none) */
static uint64_t span = AHEAD_SPAN; /* FANSTORE_CREMOTE_AHEAD_SPAN: 1, the next `ahead` only */

enum { WHOLE, RANGE, CHUNK }; /* how a READ is answered (the header comment) */

struct rread {
    struct rread *next; /* CHUNK: the next READ waiting on the same slot */
    fuse_req_t req;
    uint64_t ino, off, blob, lo, hi;
    uint32_t size;
    int owner, status, mode;
};

/* ------------------------------------------------------------------ the chunk cache */

/* A chunk's block, shared by its slot and its offer to the disk cache (no copy: Python's
 * writer only reads it): freed by whichever lets go last. */
struct kept {
    int refs;
    void *mem;
};
enum { EMPTY, PENDING, READY };
struct slot {
    uint64_t blob;
    int state, refs;       /* refs: READs being answered from raw (READY) */
    const char *raw;       /* READY: the verified raw bytes, n of them, inside kept's block */
    struct kept *kept;
    size_t n;
    struct rread *waiting; /* PENDING: READs to answer when it arrives */
    uint64_t used;
};
static struct slot slots[SLOTS];
static struct { uint64_t ino, end; } seq[SEQ_SLOTS];
static uint64_t ticks;
static pthread_mutex_t slot_lock = PTHREAD_MUTEX_INITIALIZER;

static void kept_put(void *p) {
    struct kept *k = p;
    if (k != NULL && __atomic_sub_fetch(&k->refs, 1, __ATOMIC_ACQ_REL) == 0) {
        fanstore_data_free(k->mem);
        free(k);
    }
}

static int find_slot(uint64_t blob) { /* under slot_lock */
    for (int i = 0; i < SLOTS; i++)
        if (slots[i].state != EMPTY && slots[i].blob == blob)
            return i;
    return -1;
}

static int cached(uint64_t blob) { /* in the disk cache (Python reads it there) */
    return cache_loc != NULL && __atomic_load_n(&cache_loc[blob], __ATOMIC_RELAXED) != 0;
}

static int chunky(uint64_t blob) { /* a blob that may go in a slot */
    return chunks && fanstore_blobs.raw[blob] > WHOLE_MAX && fanstore_blobs.raw[blob] <= CHUNK_MAX;
}

/* Whether a READ of `blob` at `off` of `ino` goes through the chunk cache (off UINT64_MAX:
 * whether a slot has `blob`, pending or ready). */
static int chunk_wanted(uint64_t ino, uint64_t off, uint64_t blob) {
    pthread_mutex_lock(&slot_lock);
    int yes = find_slot(blob) >= 0 || (seq[ino % SEQ_SLOTS].ino == ino && seq[ino % SEQ_SLOTS].end == off);
    pthread_mutex_unlock(&slot_lock);
    return yes;
}

static int take(uint64_t ino, uint64_t fh, uint64_t off, uint64_t size, struct rread *r) {
    const uint16_t *own = __atomic_load_n(&owner, __ATOMIC_ACQUIRE);
    if (!reading || own == NULL || fh != ino || !fanstore_dataset_serves(FANSTORE_SERVE_READS, ino) ||
        !fanstore_remote_ready())
        return 0;
    uint64_t j = ino - 1, fsize = fanstore_ds.size[j], chunk = fanstore_blobs.chunk_size;
    if (fanstore_ds.kind[j] != FANSTORE_KIND_FILE || chunk == 0 || off >= fsize || size == 0)
        return 0;
    uint64_t end = off + size < fsize ? off + size : fsize, k = off / chunk;
    if ((end - 1) / chunk != k || k >= fanstore_ds.count[j])
        return 0;
    uint64_t b = fanstore_ds.first[j] + k, base = k * chunk, raw = fanstore_blobs.raw[b];
    if (fanstore_blob_held(b))
        return 0;
    int mode = WHOLE;
    if (chunky(b) && chunk_wanted(ino, UINT64_MAX, b)) /* in a slot: answered from it, even */
        mode = CHUNK;                                  /* once in the disk cache too */
    else if (cached(b) || fanstore_remote_suspect(own[b]))
        return 0;
    else if (raw > WHOLE_MAX && !(off == base && end - base == raw)) {
        if (chunky(b) && (off == base || chunk_wanted(ino, off, b)))
            mode = CHUNK;
        else if (cache_loc == NULL && fanstore_blobs.codec[b] == FANSTORE_CODEC_FRAMED)
            mode = RANGE;
        else
            return 0;
    }
    *r = (struct rread){.ino = ino, .off = off, .blob = b, .lo = off - base, .hi = end - base,
                        .size = (uint32_t)size, .owner = own[b], .mode = mode};
    return 1;
}

int fanstore_remote_reading(void) {
    return reading && __atomic_load_n(&owner, __ATOMIC_ACQUIRE) != NULL;
}

int fanstore_remote_answered(uint64_t ino, const void *body, size_t left) {
    uint64_t fh, off;
    uint32_t size;
    struct rread r;
    /* taken on a C request thread (no GIL): a READ remote_read gives up on goes to next_read,
     * which must then be _shim_read.c's (it hands such READs to Python), not pyfuse3's */
    if (left < 20 || !fanstore_read_in_c_started())
        return 0;
    memcpy(&fh, body, 8); /* struct fuse_read_in: fh, offset, size, ... */
    memcpy(&off, (const char *)body + 8, 8);
    memcpy(&size, (const char *)body + 16, 4);
    int taken = take(ino, fh, off, size, &r);
    if (taken)
        fanstore_reply_later = 1; /* answered when its blob arrives (or from a slot at once) */
    return taken;
}

static void *fallback_main(void *arg) {
    struct rread *r = arg;
    COUNT(c_read_fallbacks);
    PyGILState_STATE g = PyGILState_Ensure();
    PyObject *res = PyObject_CallFunction(fallback, "KKIiiK", (unsigned long long)r->ino,
                                          (unsigned long long)r->off, r->size, r->owner, r->status,
                                          (unsigned long long)r->blob);
    fanstore_reply_from_python(r->req, res, fallback);
    PyGILState_Release(g);
    free(r);
    return NULL;
}

static void fall_back(struct rread *r, int status) {
    r->status = status ? status : -EIO;
    sigset_t all, old; /* signals stay with the Python threads */
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, &old);
    pthread_t t;
    int made = pthread_create(&t, NULL, fallback_main, r) == 0;
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (made)
        pthread_detach(t);
    else
        fallback_main(r); /* on this thread: the remote thread waits, the reader gets its bytes */
}

static void range_done(void *ctx, int status, const char *bytes, size_t n) {
    struct rread *r = ctx;
    if (status == 0 && n == r->hi - r->lo) {
        reply_buf(r->req, bytes, n);
        COUNT(c_reads);
        COUNT(c_range_reads);
        ADD(c_read_bytes, n);
        free(r);
        return;
    }
    fall_back(r, status);
}

static void read_done(void *ctx, int status, const char *raw, size_t n, void *mem) { /* WHOLE */
    struct rread *r = ctx;
    if (status == 0 && r->hi <= n) {
        reply_buf(r->req, raw + r->lo, r->hi - r->lo);
        COUNT(c_reads);
        ADD(c_read_bytes, r->hi - r->lo);
        if (cache_loc != NULL) {
            COUNT(cache_offers);
            fsr_offer(r->blob, raw, n, mem, NULL);
        } else {
            fanstore_data_free(mem);
        }
        free(r);
        return;
    }
    fanstore_data_free(mem);
    fall_back(r, status);
}

static void answer(struct rread *r, const char *raw, size_t n) { /* CHUNK: from a slot's bytes */
    if (r->hi > n) {
        fall_back(r, -EIO);
        return;
    }
    reply_buf(r->req, raw + r->lo, r->hi - r->lo);
    COUNT(c_reads);
    ADD(c_read_bytes, r->hi - r->lo);
    free(r);
}

static void chunk_done(void *ctx, int status, const char *raw, size_t n, void *mem) {
    struct slot *s = &slots[(uintptr_t)ctx];
    int offer = status == 0 && cache_loc != NULL; /* the same block to the disk cache */
    struct kept *k = status == 0 ? malloc(sizeof(*k)) : NULL;
    if (k != NULL)
        *k = (struct kept){1 + offer, mem};
    else if (fanstore_data_free(mem), status == 0)
        status = -ENOMEM;
    pthread_mutex_lock(&slot_lock);
    struct rread *w = s->waiting;
    uint64_t blob = s->blob;
    s->waiting = NULL;
    if (status == 0)
        *s = (struct slot){blob, READY, 1, raw, k, n, NULL, ++ticks};
    else
        s->state = EMPTY;
    pthread_mutex_unlock(&slot_lock);
    if (status == 0 && offer) { /* Python's writer reads it while the slot may still answer */
        COUNT(cache_offers);
        fsr_offer(blob, raw, n, k, kept_put);
    }
    while (w != NULL) {
        struct rread *next = w->next;
        if (status == 0)
            answer(w, raw, n);
        else
            fall_back(w, status);
        w = next;
    }
    if (status == 0) {
        pthread_mutex_lock(&slot_lock);
        s->refs--;
        pthread_mutex_unlock(&slot_lock);
    }
}

/* Start fetching `blob` into a free slot (or the least used one nobody reads), with `r`
 * (NULL: a fetch ahead) waiting on it. 0, or -1 when no slot is free or the call failed
 * (`r` is then the caller's again). Under slot_lock, which it releases. */
static int chunk_fetch(uint64_t blob, int owner, struct rread *r) {
    int v = -1;
    for (int i = 0; i < SLOTS; i++)
        if (slots[i].state == EMPTY || (slots[i].state == READY && slots[i].refs == 0))
            if (v < 0 || slots[i].state == EMPTY || (slots[v].state != EMPTY && slots[i].used < slots[v].used))
                v = i;
    if (v < 0) {
        pthread_mutex_unlock(&slot_lock);
        return -1;
    }
    struct kept *old = slots[v].state == READY ? slots[v].kept : NULL;
    slots[v] = (struct slot){blob, PENDING, 0, NULL, NULL, 0, r, ++ticks};
    if (r != NULL)
        r->next = NULL;
    pthread_mutex_unlock(&slot_lock);
    kept_put(old);
    void *ctx = (void *)(uintptr_t)v;
    if (fanstore_remote_fetch_kept(owner, blob, 0, fanstore_blobs.raw[blob], timeout, chunk_done, ctx) == 0)
        return 0;
    pthread_mutex_lock(&slot_lock); /* nobody else joined: the READ came with the slot */
    struct rread *w = slots[v].waiting;
    slots[v].state = EMPTY;
    slots[v].waiting = NULL;
    pthread_mutex_unlock(&slot_lock);
    while (w != NULL && w != r) { /* READs that joined meanwhile */
        struct rread *next = w->next;
        fall_back(w, -EAGAIN);
        w = next;
    }
    return -1;
}

enum { AHEAD_HAS = 1, AHEAD_NOT_MINE = 0, AHEAD_BUSY = -1, AHEAD_NO_SLOT = -2 };

/* Fetch `blob` ahead into a slot: HAS (a slot has it, or it is fetched now), NOT_MINE (held
 * here, in the disk cache, not a chunk, a suspect owner), BUSY (ahead + 1 chunks pending: the
 * READ's own and `ahead`), NO_SLOT. */
static int ahead_one(uint64_t b, const uint16_t *own) {
    if (fanstore_blob_held(b) || !chunky(b))
        return AHEAD_NOT_MINE;
    pthread_mutex_lock(&slot_lock);
    int pending = 0, has = find_slot(b) >= 0;
    for (int i = 0; i < SLOTS; i++)
        pending += slots[i].state == PENDING;
    if (has || cached(b) || fanstore_remote_suspect(own[b]) || pending > ahead) {
        pthread_mutex_unlock(&slot_lock);
        return has ? AHEAD_HAS : pending > ahead ? AHEAD_BUSY : AHEAD_NOT_MINE;
    }
    if (chunk_fetch(b, own[b], NULL) != 0)
        return AHEAD_NO_SLOT;
    COUNT(c_fetch_ahead);
    return AHEAD_HAS;
}

/* The file's next `ahead` chunks held elsewhere fetched ahead, so that several chunks travel
 * while the reader reads one. Chunks held here (or in the disk cache) are skipped, not
 * counted, up to AHEAD_SPAN * `ahead` chunks past the READ's: a reader that reads the local
 * chunks between two remote ones (or skips them) finds the next remote one travelling already.
 * Before the twenty-eighth session only the next `ahead` positions were looked at, so a remote
 * chunk after `ahead` local ones was fetched only when its first READ came (docs/performance.md,
 * twenty-eighth session). */
static void fetch_ahead(const struct rread *r) {
    const uint16_t *own = __atomic_load_n(&owner, __ATOMIC_ACQUIRE);
    uint64_t j = r->ino - 1, k0 = r->off / fanstore_blobs.chunk_size, end = k0 + (uint64_t)ahead * span;
    int found = 0;
    for (uint64_t k = k0 + 1; found < ahead && k <= end && k < fanstore_ds.count[j]; k++) {
        int got = ahead_one(fanstore_ds.first[j] + k, own);
        if (got < 0)
            return;
        found += got == AHEAD_HAS;
    }
}

/* CHUNK: answered from its slot, queued on it, or a new fetch; 0 when no slot was free. */
static int chunk_read(struct rread *r) {
    pthread_mutex_lock(&slot_lock);
    seq[r->ino % SEQ_SLOTS].ino = r->ino;
    seq[r->ino % SEQ_SLOTS].end = r->off + (r->hi - r->lo);
    int i = find_slot(r->blob);
    if (i < 0 && cached(r->blob)) { /* left its slot since take(): Python reads the disk cache */
        pthread_mutex_unlock(&slot_lock);
        return 0;
    }
    if (i >= 0 && slots[i].state == READY) {
        struct slot *s = &slots[i];
        s->refs++;
        s->used = ++ticks;
        pthread_mutex_unlock(&slot_lock);
        COUNT(c_chunk_hits);
        answer(r, s->raw, s->n);
        pthread_mutex_lock(&slot_lock);
        s->refs--;
        pthread_mutex_unlock(&slot_lock);
        return 1;
    }
    if (i >= 0) {
        r->next = slots[i].waiting;
        slots[i].waiting = r;
        pthread_mutex_unlock(&slot_lock);
        return 1;
    }
    return chunk_fetch(r->blob, r->owner, r) == 0;
}

static void remote_read(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off, struct fuse_file_info *fi) {
    struct rread r;
    if (off < 0 || !take(ino, fi->fh, (uint64_t)off, size, &r)) {
        next_read(req, ino, size, off, fi);
        return;
    }
    struct rread *p = malloc(sizeof(*p));
    if (p != NULL) {
        *p = r;
        p->req = req;
        if (p->mode == CHUNK) {
            struct rread copy = *p;
            if (chunk_read(p)) {
                fetch_ahead(&copy);
                return;
            }
        } else if ((p->mode == RANGE
                        ? fanstore_remote_fetch_range(p->owner, p->blob, p->lo, p->hi, timeout, range_done, p)
                        : fanstore_remote_fetch_kept(p->owner, p->blob, 0, fanstore_blobs.raw[p->blob], timeout,
                                                     read_done, p)) == 0) {
            /* p may be answered and freed by the remote thread by now: only the copy r is read */
            if (fanstore_blobs.raw[r.blob] > WHOLE_MAX) { /* RANGE: where this file's READ ended */
                pthread_mutex_lock(&slot_lock);
                seq[ino % SEQ_SLOTS].ino = ino;
                seq[ino % SEQ_SLOTS].end = r.off + (r.hi - r.lo);
                pthread_mutex_unlock(&slot_lock);
            }
            return;
        }
        free(p);
    }
    next_read(req, ino, size, off, fi);
}

/* remote_ahead(blob) -> bool, for Python's read-ahead (Node.read): True when READs in C will
 * find the blob in a slot (it has it or fetches it now; or chunks enough are on their way:
 * then the READ's own fetch), so Python leaves it; False: Python reads it ahead itself. */
PyObject *fanstore_py_remote_ahead(PyObject *self, PyObject *arg) {
    (void)self;
    unsigned long long b = PyLong_AsUnsignedLongLong(arg);
    if (b == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    const uint16_t *own = __atomic_load_n(&owner, __ATOMIC_ACQUIRE);
    int r = reading && own != NULL && b < fanstore_blobs.n && fanstore_remote_ready() ? ahead_one(b, own) : 0;
    return PyBool_FromLong(r == AHEAD_HAS || r == AHEAD_BUSY);
}

/* remote_chunk(blob): a copy of the verified raw bytes a slot holds, True while one fetches
 * them, else None (a READ Python answers takes what READs in C fetched: no second fetch). */
PyObject *fanstore_py_remote_chunk(PyObject *self, PyObject *arg) {
    (void)self;
    unsigned long long b = PyLong_AsUnsignedLongLong(arg);
    if (b == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    pthread_mutex_lock(&slot_lock);
    int i = find_slot(b);
    if (i < 0 || slots[i].state != READY) {
        pthread_mutex_unlock(&slot_lock);
        return Py_NewRef(i < 0 ? Py_None : Py_True);
    }
    struct slot *s = &slots[i];
    s->refs++;
    s->used = ++ticks;
    pthread_mutex_unlock(&slot_lock);
    PyObject *out = PyBytes_FromStringAndSize(s->raw, (Py_ssize_t)s->n);
    pthread_mutex_lock(&slot_lock);
    s->refs--;
    pthread_mutex_unlock(&slot_lock);
    return out;
}

void fanstore_patch_remote(struct fuse_lowlevel_ops *ops) {
    if (ops->read == NULL || fanstore_libfuse_symbol("fuse_reply_buf") == NULL)
        return;
    reply_buf = fanstore_gated_reply_buf; /* answered on the remote thread, a worker, a fallback */
    next_read = ops->read;
    ops->read = remote_read;
}

/* remote_read_start(fallback, timeout, cache_index or None) */
PyObject *fanstore_py_remote_read_start(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *fb, *cache;
    double t;
    if (!PyArg_ParseTuple(args, "OdO", &fb, &t, &cache))
        return NULL;
    if (next_read == NULL || reading) {
        PyErr_SetString(PyExc_ValueError, next_read ? "remote reads already started"
                                                    : "READ not patched (no FUSE session yet)");
        return NULL;
    }
    if (cache != Py_None) {
        if (PyObject_GetBuffer(cache, &cache_buf, PyBUF_C_CONTIGUOUS) != 0)
            return NULL;
        if ((uint64_t)cache_buf.len != 8 * fanstore_blobs.n) {
            PyBuffer_Release(&cache_buf);
            PyErr_SetString(PyExc_ValueError, "the cache index has not one u64 per blob");
            return NULL;
        }
        cache_loc = cache_buf.buf;
    }
    const char *knob = getenv("FANSTORE_CREMOTE_CHUNKS");
    chunks = knob == NULL || strcmp(knob, "0") != 0;
    knob = getenv("FANSTORE_CREMOTE_AHEAD");
    ahead = knob == NULL ? AHEAD : atoi(knob) < 0 ? 0 : atoi(knob) > SLOTS / 2 ? SLOTS / 2 : atoi(knob);
    knob = getenv("FANSTORE_CREMOTE_AHEAD_SPAN");
    span = knob == NULL || atoi(knob) < 1 ? AHEAD_SPAN : (uint64_t)atoi(knob);
    Py_INCREF(fb);
    fallback = fb;
    timeout = t;
    reading = 1;
    Py_RETURN_NONE;
}

/* remote_owners(array of u16, one per blob): who to ask for each blob; held for good */
PyObject *fanstore_py_remote_owners(PyObject *self, PyObject *arr) {
    (void)self;
    if (owner != NULL)
        Py_RETURN_NONE; /* published once: READs in flight may read it */
    if (PyObject_GetBuffer(arr, &owners_buf, PyBUF_C_CONTIGUOUS) != 0)
        return NULL;
    if ((uint64_t)owners_buf.len != 2 * fanstore_blobs.n) {
        PyBuffer_Release(&owners_buf);
        PyErr_SetString(PyExc_ValueError, "the owners array has not one u16 per blob");
        return NULL;
    }
    __atomic_store_n(&owner, (const uint16_t *)owners_buf.buf, __ATOMIC_RELEASE);
    Py_RETURN_NONE;
}
