/* Python's remote fetches (remote_fetch, remote_take: _cremote.CRemote.fetch and .run), and the
 * blobs READs in C fetched, handed to Python for the disk cache (fsr_offer).
 *
 * A blob Python fetches comes back as a `bytes` object laid where its reply was received (issue
 * 11, docs/performance.md, eighth session): the remote thread receives the reply into a buffer
 * of its own, a worker verifies it there (fsr_verify_py: the manifest's xxh3, or the frame
 * table's and every frame's) and, when the raw bytes are the received bytes (a raw blob, or a
 * framed blob of raw frames only: incompressible data), the object's header takes the place of
 * the verified header and frame table in front of them: no byte is copied after MPI's receive
 * (a 4 MiB copy into a fresh bytes object cost the workers more CPU than the xxh3). A blob with
 * zstd bytes is decoded into a new block laid out the same way; so is one whose buffer leaves
 * no room (an odd frame count misaligns the header; no byte spare for bytes' closing NUL).
 *
 * The object is a `RemoteBytes`, a subclass of bytes that adds nothing (isinstance(x, bytes);
 * CPython resizes in place only exact bytes): its dealloc frees the block it lies in, whose
 * start is stored in the 8 bytes in front of it. Nothing that failed a check is ever laid out:
 * the call completes with -EIO and Python takes its other path. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <malloc.h>
#include <stddef.h>

#include "_shim_remote_int.h"

#define OBJ_HEAD offsetof(PyBytesObject, ob_sval) /* a bytes object's header */
#define LEAD (sizeof(char *) + OBJ_HEAD)          /* the block's start, then the header */

struct finished { /* for remote_take: a Python call's outcome, or a blob for the disk cache */
    struct finished *next;
    PyObject *token; /* NULL: `raw` is blob `blob`, fetched for a READ in C, inside `mem` */
    uint64_t blob;
    int status;
    char *raw; /* a token's: the verified raw bytes, LEAD bytes into their block, a NUL after */
    size_t n;
    void *mem; /* a blob for the disk cache: the block `raw` lies in */
    void (*release)(void *); /* lets go of mem (NULL: free) */
};
static struct finished *finished_list;

static void remote_bytes_dealloc(PyObject *op) {
    char *block;
    memcpy(&block, (char *)op - sizeof(block), sizeof(block));
    fanstore_data_free(block);
}

static PyTypeObject remote_bytes = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "fanstore_fuse._noflush.RemoteBytes",
    .tp_doc = "bytes of a blob fetched from another rank, verified where they were received",
    .tp_itemsize = 1,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .tp_dealloc = remote_bytes_dealloc,
};

/* A blob a READ in C fetched, for the disk cache: its bytes exported where they lie, inside the
 * malloc'd block `mem` (remote_take hands Python a memoryview of it: no copy on the trio
 * thread). */
struct held_raw {
    PyObject_HEAD char *raw;
    Py_ssize_t n;
    void *mem;
    void (*release)(void *); /* NULL: free */
};

static void let_go(void *mem, void (*release)(void *)) {
    if (release != NULL)
        release(mem);
    else
        fanstore_data_free(mem);
}

static int held_raw_buffer(PyObject *self, Py_buffer *view, int flags) {
    struct held_raw *h = (struct held_raw *)self;
    return PyBuffer_FillInfo(view, self, h->raw, h->n, 1, flags);
}

static void held_raw_dealloc(PyObject *self) {
    struct held_raw *h = (struct held_raw *)self;
    let_go(h->mem, h->release);
    PyObject_Free(self);
}

static PyBufferProcs held_raw_procs = {.bf_getbuffer = held_raw_buffer};

static PyTypeObject held_raw = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "fanstore_fuse._noflush.HeldRaw",
    .tp_doc = "verified raw bytes of a blob a READ in C fetched (read-only buffer)",
    .tp_basicsize = sizeof(struct held_raw),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .tp_dealloc = held_raw_dealloc,
    .tp_as_buffer = &held_raw_procs,
};

/* A memoryview of `raw`, inside `mem` (taken over: let go with the view's last reference), or
 * NULL. */
static PyObject *view_of(char *raw, size_t n, void *mem, void (*release)(void *)) {
    struct held_raw *h = PyObject_New(struct held_raw, &held_raw);
    if (h == NULL) {
        let_go(mem, release);
        return NULL;
    }
    h->raw = raw;
    h->n = (Py_ssize_t)n;
    h->mem = mem;
    h->release = release;
    PyObject *view = PyMemoryView_FromObject((PyObject *)h);
    Py_DECREF(h);
    return view;
}

/* The raw bytes of blob b checked where they lie in its stored bytes `body` (*raw set), or
 * OK with *raw NULL when they must be decoded elsewhere (zstd), or CORRUPT. */
static int check_in_place(uint64_t b, const char *body, const char **raw) {
    const struct fanstore_blobs *bl = &fanstore_blobs;
    uint32_t n = bl->stored[b];
    *raw = NULL;
    if (bl->codec[b] == FANSTORE_CODEC_RAW) {
        if (n != bl->raw[b] || fanstore_checksum(body, n) != bl->xxh3[b])
            return FANSTORE_BLOB_CORRUPT;
        *raw = body;
        return FANSTORE_BLOB_OK;
    }
    if (bl->codec[b] != FANSTORE_CODEC_FRAMED)
        return FANSTORE_BLOB_OK;
    struct fanstore_ftable *t;
    int rc = fanstore_table_parse(body, n, n, bl->raw[b], bl->xxh3[b], &t);
    if (rc != FANSTORE_BLOB_OK)
        return rc;
    if (t->count == 0 || fanstore_frames_raw(t, 0, t->count - 1)) {
        const char *frames = body + t->offsets[0];
        if (t->count > 0)
            rc = fanstore_frames_decode(t, 0, t->count - 1, frames, NULL); /* checks each frame */
        if (rc == FANSTORE_BLOB_OK)
            *raw = frames;
    }
    fanstore_table_put(t);
    return rc;
}

/* Verify the reply `buf` (`n` bytes, header checked by fsr_answered) to Python's FETCH call `c`
 * and complete it: the raw bytes laid out for remote_take (the file's comment), or an errno. */
void fsr_verify_py(struct call *c, char *buf, size_t n) {
    uint64_t b = c->blob;
    size_t raw_len = fanstore_blobs.raw[b];
    const char *body = buf + sizeof(struct fsr_header), *at = NULL;
    char *block = NULL, *raw = NULL;
    int rc = n - sizeof(struct fsr_header) != fanstore_blobs.stored[b] ? FANSTORE_BLOB_CORRUPT
                                                                      : check_in_place(b, body, &at);
    if (rc == FANSTORE_BLOB_OK && at != NULL && at - buf >= (ptrdiff_t)LEAD &&
        (uintptr_t)(at - OBJ_HEAD) % sizeof(char *) == 0 &&
        at + raw_len == buf + n && malloc_usable_size(buf) > n) {
        block = buf; /* the bytes stay where MPI put them */
        COUNT(py_in_place);
        raw = (char *)at;
    } else if (rc == FANSTORE_BLOB_OK) {
        block = malloc(LEAD + raw_len + 1);
        raw = block + LEAD;
        if (block == NULL)
            rc = FANSTORE_BLOB_NOMEM;
        else if (at != NULL) /* checked, but no room where it lies */
            memcpy(raw, at, raw_len);
        else
            rc = fanstore_blob_decode(b, body, raw);
    }
    if (block != buf)
        fanstore_data_free(buf);
    if (rc != FANSTORE_BLOB_OK) {
        free(block);
        COUNT(corrupt);
        fsr_complete(c, rc == FANSTORE_BLOB_NOMEM ? -ENOMEM : -EIO, NULL, 0);
        return;
    }
    memcpy(raw - LEAD, &block, sizeof(block));
    raw[raw_len] = '\0';
    COUNT(fetched);
    fsr_complete(c, 0, raw, raw_len);
}

/* Blobs offered to the disk cache wait in the list, unannounced, until 16 of them
 * (FANSTORE_OFFER_BATCH) or OFFER_BYTES are there, a Python call's outcome is pushed, or the
 * oldest has waited OFFER_WAIT_S (fsr_offers_flush, from the remote thread's loop): one
 * wake-up of trio (and of the cache's writer thread) per batch instead of two per blob. FANSTORE_OFFER_BATCH=1: every offer announced at once. */
#define OFFER_BYTES (8u << 20)
static int poked;           /* announced: Python takes the list soon (fsr_state.lock) */
static unsigned held, held_max; /* offers in the list not announced; the batch (0: unread) */
static size_t held_bytes;
static int64_t held_since; /* when the oldest unannounced offer came, ns (0: none) */
#define OFFER_WAIT_S 0.02

static void push_finished(struct finished *f) {
    int offer = f->token == NULL;
    pthread_mutex_lock(&fsr_state.lock);
    if (held_max == 0) { /* the knob, read once */
        const char *k = getenv("FANSTORE_OFFER_BATCH");
        int v = k != NULL && *k ? atoi(k) : 16;
        held_max = v > 0 ? (unsigned)v : 1;
    }
    f->next = finished_list;
    finished_list = f;
    if (offer) {
        if (held++ == 0)
            __atomic_store_n(&held_since, (int64_t)(fsr_now() * 1e9) | 1, __ATOMIC_RELAXED);
        held_bytes += f->n;
    }
    int poke = !poked && (!offer || held >= held_max || held_bytes >= OFFER_BYTES);
    poked |= poke;
    pthread_mutex_unlock(&fsr_state.lock);
    if (poke && offer)
        COUNT(offer_pokes);
    if (poke)
        fsr_poke(fsr_state.done_fd);
}

void fsr_offers_flush(int force) {
    int64_t since = __atomic_load_n(&held_since, __ATOMIC_RELAXED); /* one load when none */
    if (since == 0 || (!force && fsr_now() * 1e9 - (double)since < OFFER_WAIT_S * 1e9))
        return;
    pthread_mutex_lock(&fsr_state.lock);
    int poke = !poked && finished_list != NULL;
    poked |= poke;
    pthread_mutex_unlock(&fsr_state.lock);
    if (poke) {
        COUNT(offer_pokes);
        fsr_poke(fsr_state.done_fd);
    }
}

/* ctx: the call's `finished` record, made by remote_fetch with its token */
static void py_done(void *ctx, int status, char *raw, size_t n) {
    struct finished *f = ctx;
    f->status = status;
    f->raw = status == 0 ? raw : NULL;
    f->n = n;
    push_finished(f);
}

void fsr_offer(uint64_t blob, const char *raw, size_t n, void *mem, void (*release)(void *)) {
    struct finished *f = malloc(sizeof(*f));
    if (f == NULL) {
        let_go(mem, release); /* not cached: nothing else is lost */
        return;
    }
    *f = (struct finished){NULL, NULL, blob, 1, (char *)raw, n, mem, release};
    push_finished(f);
}

static int types_ready(void) { /* once, under the GIL */
    if (remote_bytes.tp_base == NULL) {
        remote_bytes.tp_base = &PyBytes_Type;
        if (PyType_Ready(&remote_bytes) != 0 || PyType_Ready(&held_raw) != 0) {
            remote_bytes.tp_base = NULL;
            return 0;
        }
    }
    return 1;
}

PyObject *fanstore_py_remote_fetch(PyObject *self, PyObject *args) {
    (void)self;
    int owner;
    unsigned long long blob;
    PyObject *token;
    double timeout;
    if (!PyArg_ParseTuple(args, "iKOd", &owner, &blob, &token, &timeout))
        return NULL;
    if (blob >= fanstore_blobs.n)
        Py_RETURN_FALSE;
    if (!types_ready())
        return NULL;
    struct finished *f = calloc(1, sizeof(*f));
    if (f == NULL)
        return PyErr_NoMemory();
    Py_INCREF(token);
    f->token = token;
    struct call proto = {.blob = blob, .owner = owner, .op = FSR_OP_FETCH, .hi = fanstore_blobs.stored[blob],
                         .done = py_done, .ctx = f, .python = 1};
    int rc = fsr_add_call(&proto, timeout);
    if (rc != 0) {
        Py_DECREF(token);
        free(f);
    }
    return PyBool_FromLong(rc == 0);
}

/* The bytes object laid out in front of `raw` (fsr_verify_py): a new reference. */
static PyObject *lay_out(char *raw, size_t n) {
    PyVarObject *op = (PyVarObject *)(raw - OBJ_HEAD);
    PyObject_InitVar(op, &remote_bytes, (Py_ssize_t)n);
    _Pragma("GCC diagnostic push") _Pragma("GCC diagnostic ignored \"-Wdeprecated-declarations\"")
    ((PyBytesObject *)op)->ob_shash = -1; /* not hashed yet */
    _Pragma("GCC diagnostic pop") return (PyObject *)op;
}

PyObject *fanstore_py_remote_take(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    if (!types_ready())
        return NULL;
    if (fsr_state.done_fd >= 0)
        fsr_take_pokes(fsr_state.done_fd);
    pthread_mutex_lock(&fsr_state.lock);
    struct finished *f = finished_list;
    finished_list = NULL;
    poked = 0;
    held = 0;
    held_bytes = 0;
    __atomic_store_n(&held_since, 0, __ATOMIC_RELAXED);
    pthread_mutex_unlock(&fsr_state.lock);
    PyObject *out = PyList_New(0);
    while (f != NULL) {
        struct finished *next = f->next;
        PyObject *data, *token;
        if (f->token != NULL) { /* (token, status, bytes or None) */
            token = f->token;
            data = f->status == 0 ? lay_out(f->raw, f->n) : Py_NewRef(Py_None);
        } else {
            data = view_of(f->raw, f->n, f->mem, f->release);
            token = PyLong_FromUnsignedLongLong(f->blob);
        }
        PyObject *item = data && out && token ? Py_BuildValue("(NiN)", token, f->status, data) : NULL;
        if (item == NULL || PyList_Append(out, item) != 0)
            abort(); /* out of memory with readers waiting */
        Py_DECREF(item);
        free(f);
        f = next;
    }
    return out;
}
