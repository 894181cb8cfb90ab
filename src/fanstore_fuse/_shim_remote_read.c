/* READs of dataset files whose blob another rank holds, answered by the remote thread
 * (issue 11; the remote thread: _shim_remote.h).
 *
 * Patched into the FUSE table after _shim_read.c (fanstore_patch_remote): a READ this does not
 * take goes on to _shim_read.c's handler (held here: C; else pyfuse3's). It takes a READ when
 * the remote thread is ready and Python switched this on (remote_read_start, in the trio run)
 * and gave the owner of every blob (remote_owners, computed after mount), and:
 * - the handle is the inode of a dataset regular file that _shim_read.c serves;
 * - the READ lies in one blob, not held here, not in the disk cache (its slot in
 *   DiskCache's index is 0: a cached blob is read from the cache by Python);
 * - the blob is at most WHOLE_MAX raw bytes, or the READ covers all of it: the whole blob
 *   travels and is verified, then is offered to the disk cache when there is one (Python's
 *   CRemote.run puts it);
 * - or the blob is framed and larger, and there is no disk cache: only the frames that cover
 *   the READ travel, with the frame table (FSR_OP_FRAMES, _shim_remote_range.c), each checked
 *   here. With a disk cache such READs go to Python, whose blob cache serves the rest of a
 *   chunk from one fetch and puts the chunk in the disk cache.
 * The call goes to the blob's primary owner; its reply (verified in C: nothing that failed a
 * check is ever sent) is answered with fuse_reply_buf. A time-out, an error reply or bad bytes hand
 * the READ to Python on a thread of its own (the fallback: _cremote's, which logs, marks a
 * silent peer, and reads through Operations.read: replicas, DEST, EIO).
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

typedef void (*read_op_t)(fuse_req_t, fuse_ino_t, size_t, off_t, struct fuse_file_info *);
typedef int (*reply_buf_t)(fuse_req_t, const char *, size_t);

static read_op_t next_read;
static reply_buf_t reply_buf;
static PyObject *fallback; /* _cremote._ReadFallback: (ino, off, size, owner, status, blob) -> bytes | errno */
static Py_buffer owners_buf, cache_buf;
static const uint16_t *owner;     /* primary owner per blob, once published */
static const uint64_t *cache_loc; /* DiskCache's index, or NULL */
static double timeout;
static int reading;

struct rread {
    fuse_req_t req;
    uint64_t ino, off, blob, lo, hi;
    uint32_t size;
    int owner, status, range; /* range: FSR_OP_FRAMES for [lo, hi) */
};

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
    int range = raw > WHOLE_MAX && !(off == base && end - base == raw);
    if (fanstore_blob_held(b) || (cache_loc != NULL && cache_loc[b] != 0) ||
        (range && (cache_loc != NULL || fanstore_blobs.codec[b] != FANSTORE_CODEC_FRAMED)))
        return 0;
    if (fanstore_remote_suspect(own[b]))
        return 0;
    *r = (struct rread){.ino = ino, .off = off, .blob = b, .lo = off - base, .hi = end - base,
                        .size = (uint32_t)size, .owner = own[b], .range = range};
    return 1;
}

int fanstore_remote_answered(uint64_t ino, const void *body, size_t left) {
    uint64_t fh, off;
    uint32_t size;
    struct rread r;
    if (left < 20)
        return 0;
    memcpy(&fh, body, 8); /* struct fuse_read_in: fh, offset, size, ... */
    memcpy(&off, (const char *)body + 8, 8);
    memcpy(&size, (const char *)body + 16, 4);
    return take(ino, fh, off, size, &r);
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

static void read_done(void *ctx, int status, char *raw, size_t n) {
    struct rread *r = ctx;
    if (status == 0 && r->hi <= n) {
        reply_buf(r->req, raw + r->lo, r->hi - r->lo);
        COUNT(c_reads);
        ADD(c_read_bytes, r->hi - r->lo);
        if (cache_loc != NULL) {
            COUNT(cache_offers);
            fsr_offer(r->blob, raw, n);
        } else {
            free(raw);
        }
        free(r);
        return;
    }
    free(raw);
    fall_back(r, status);
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
        if ((p->range ? fanstore_remote_fetch_range(p->owner, p->blob, p->lo, p->hi, timeout, range_done, p)
                      : fanstore_remote_fetch(p->owner, p->blob, timeout, read_done, p)) == 0)
            return;
        free(p);
    }
    next_read(req, ino, size, off, fi);
}

void fanstore_patch_remote(struct fuse_lowlevel_ops *ops) {
    reply_buf = (reply_buf_t)fanstore_libfuse_symbol("fuse_reply_buf");
    if (ops->read == NULL || reply_buf == NULL)
        return;
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
