/* The C API of calls (fanstore_remote_fetch and the range variants), and remote reads of part
 * of a framed blob (FSR_OP_FRAMES, issue 11): the server sends the
 * blob's frame table and the stored frames that cover a raw byte range; the requester checks
 * the table against the manifest's xxh3 and every frame against its own, and hands out only
 * the bytes asked for. A READ of 128 KiB inside a remote 4 MiB chunk then moves 128 KiB and a
 * table (3 KiB for 256 frames of 16 KiB), not the chunk. The wire format: _shim_remote.h.
 * remote_bench: whole blobs fetched as READs in C fetch them, for bench._transport_bw. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "_shim_remote_int.h"

/* The reply to a FRAMES request for blob `req->blob`'s raw bytes [req->lo, req->hi): as
 * fsr_serve (nowait: page cache only, NULL and *again when the disk must be read). */
char *fsr_serve_frames(const struct fsr_header *req, int nowait, size_t *n, int *again, int *tag) {
    const struct fanstore_blobs *bl = &fanstore_blobs;
    uint64_t b = req->blob;
    if (b >= bl->n || !fanstore_blob_held(b))
        return fsr_error_reply(req, ENOENT, n);
    if (bl->codec[b] != FANSTORE_CODEC_FRAMED || req->lo >= req->hi || req->hi > bl->raw[b])
        return fsr_error_reply(req, EINVAL, n);
    const struct fanstore_ftable *t;
    int rc = fanstore_table_get(b, nowait, &t);
    if (rc == FANSTORE_BLOB_AGAIN) {
        *again = 1;
        return NULL;
    }
    if (rc != FANSTORE_BLOB_OK)
        return fsr_error_reply(req, rc == FANSTORE_BLOB_NOT_HELD ? ENOENT : EIO, n);
    uint32_t k0 = (uint32_t)(req->lo / t->frame_size), k1 = (uint32_t)((req->hi - 1) / t->frame_size);
    uint64_t tlen = t->offsets[0], flo = t->offsets[k0], fhi = t->offsets[k1 + 1];
    fanstore_table_put(t);
    size_t len = (size_t)(tlen + fhi - flo);
    if (flo == tlen && fhi == bl->stored[b]) { /* every stored byte: sent bare */
        char *bare = fsr_serve_bare(req, len, nowait, n, again, tag);
        if (bare != NULL || *again)
            return bare;
    }
    char *buf = malloc(sizeof(struct fsr_header) + len);
    if (buf == NULL)
        return fsr_error_reply(req, ENOMEM, n);
    char *body = buf + sizeof(struct fsr_header);
    rc = fanstore_blob_pread(b, 0, (size_t)tlen, body, nowait);
    if (rc == FANSTORE_BLOB_OK)
        rc = fanstore_blob_pread(b, flo, (size_t)(fhi - flo), body + tlen, nowait);
    if (rc != FANSTORE_BLOB_OK) {
        free(buf);
        if (rc == FANSTORE_BLOB_AGAIN) {
            *again = 1;
            return NULL;
        }
        return fsr_error_reply(req, rc == FANSTORE_BLOB_NOT_HELD ? ENOENT : EIO, n);
    }
    struct fsr_header *h = (struct fsr_header *)buf;
    *h = *req;
    h->err = 0;
    h->lo = flo;
    h->hi = fhi;
    *n = sizeof(*h) + len;
    COUNT(served);
    ADD(served_bytes, len);
    return buf;
}

/* Check the reply `buf` (`n` bytes, header checked by fsr_answered) to FRAMES call `c` and
 * complete it: the raw bytes [c->lo, c->hi), or -EIO when anything fails a check. Frees buf. */
void fsr_verify_frames(struct call *c, char *buf, size_t n) {
    const struct fsr_header *h = (const struct fsr_header *)buf;
    const char *body = buf + sizeof(*h), *raw = NULL;
    size_t len = n - sizeof(*h);
    uint64_t b = c->blob;
    struct fanstore_ftable *t;
    char *out = NULL;
    int rc = fanstore_table_parse(body, len, fanstore_blobs.stored[b], fanstore_blobs.raw[b],
                                  fanstore_blobs.xxh3[b], &t);
    if (rc == FANSTORE_BLOB_OK) {
        uint32_t k0 = (uint32_t)(c->lo / t->frame_size), k1 = (uint32_t)((c->hi - 1) / t->frame_size);
        uint64_t tlen = t->offsets[0];
        /* a bare reply's header (lo 0: every stored byte from the blob's start) is this
         * rank's own, from the call: the same layout, table then frames */
        uint64_t flo = h->lo == 0 && k0 == 0 ? tlen : h->lo;
        if (k1 >= t->count || flo != t->offsets[k0] || h->hi != t->offsets[k1 + 1] ||
            len != tlen + h->hi - flo)
            rc = FANSTORE_BLOB_CORRUPT;
        else if (!fanstore_frames_raw(t, k0, k1) &&
                 (out = malloc((size_t)(k1 - k0 + 1) * t->frame_size)) == NULL)
            rc = FANSTORE_BLOB_NOMEM;
        else if ((rc = fanstore_frames_decode(t, k0, k1, body + tlen, out)) == FANSTORE_BLOB_OK)
            raw = (out != NULL ? out : body + tlen) + (c->lo - (uint64_t)k0 * t->frame_size);
        fanstore_table_put(t);
    }
    if (rc == FANSTORE_BLOB_OK && c->kept != NULL) { /* the bytes go with the call */
        c->mem = out != NULL ? out : buf;
        if (out != NULL)
            free(buf);
        out = buf = NULL;
    }
    if (rc == FANSTORE_BLOB_OK) {
        COUNT(fetched);
        fsr_complete(c, 0, (char *)raw, (size_t)(c->hi - c->lo)); /* a view: freed below */
    } else {
        COUNT(corrupt);
        fsr_complete(c, rc == FANSTORE_BLOB_NOMEM ? -ENOMEM : -EIO, NULL, 0);
    }
    free(out);
    free(buf);
}

static int frames_call(struct call *proto, double timeout) {
    uint64_t b = proto->blob;
    if (b >= fanstore_blobs.n || fanstore_blobs.codec[b] != FANSTORE_CODEC_FRAMED || proto->lo >= proto->hi ||
        proto->hi > fanstore_blobs.raw[b])
        return -EINVAL;
    proto->op = FSR_OP_FRAMES;
    return fsr_add_call(proto, timeout);
}

int fanstore_remote_fetch(int owner, uint64_t blob, double timeout, fanstore_remote_done done, void *ctx) {
    struct call proto = {.blob = blob, .owner = owner, .op = FSR_OP_FETCH, .done = done, .ctx = ctx};
    if (blob < fanstore_blobs.n)
        proto.hi = fanstore_blobs.stored[blob];
    return fsr_add_call(&proto, timeout);
}

int fanstore_remote_fetch_range(int owner, uint64_t blob, uint64_t lo, uint64_t hi, double timeout,
                                fanstore_remote_view view, void *ctx) {
    struct call proto = {.blob = blob, .owner = owner, .lo = lo, .hi = hi, .view = view, .ctx = ctx};
    return frames_call(&proto, timeout);
}

int fanstore_remote_fetch_kept(int owner, uint64_t blob, uint64_t lo, uint64_t hi, double timeout,
                               fanstore_remote_kept kept, void *ctx) {
    struct call proto = {.blob = blob, .owner = owner, .lo = lo, .hi = hi, .kept = kept, .ctx = ctx};
    if (blob < fanstore_blobs.n && fanstore_blobs.codec[blob] != FANSTORE_CODEC_FRAMED && lo == 0 &&
        hi == fanstore_blobs.raw[blob]) { /* the whole blob (stored raw: checked in place) */
        proto.op = FSR_OP_FETCH;
        proto.hi = fanstore_blobs.stored[blob];
        return fsr_add_call(&proto, timeout);
    }
    return frames_call(&proto, timeout);
}

/* ------------------------------------------------------------------ remote_bench */

static struct {
    pthread_mutex_t lock;
    pthread_cond_t cond;
    int open, failed;
    uint64_t bytes;
} bench = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, 0, 0};

static void bench_done(int status, size_t n) {
    pthread_mutex_lock(&bench.lock);
    bench.open--;
    if (status == 0)
        bench.bytes += n;
    else
        bench.failed++;
    pthread_cond_signal(&bench.cond);
    pthread_mutex_unlock(&bench.lock);
}

static void bench_kept(void *ctx, int status, const char *bytes, size_t n, void *mem) {
    (void)ctx;
    (void)bytes;
    free(mem);
    bench_done(status, n);
}

/* remote_bench(owners, blobs, window, timeout): the whole blobs fetched as the chunk cache of
 * _shim_remote_read.c fetches them (no Python per blob, no copy after the check), `window`
 * calls in flight: the transport alone, for bench._transport_bw. */
PyObject *fanstore_py_remote_bench(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer own, ids;
    int window;
    double timeout;
    if (!PyArg_ParseTuple(args, "y*y*id", &own, &ids, &window, &timeout))
        return NULL;
    size_t n = (size_t)ids.len / 8;
    const int32_t *o = own.buf;
    const uint64_t *b = ids.buf;
    if ((size_t)own.len != 4 * n || window < 1) {
        PyBuffer_Release(&own);
        PyBuffer_Release(&ids);
        PyErr_SetString(PyExc_ValueError, "owners: one i32 per u64 blob id; window >= 1");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS;
    bench.open = bench.failed = 0;
    bench.bytes = 0;
    for (size_t i = 0; i < n; i++) {
        pthread_mutex_lock(&bench.lock);
        while (bench.open >= window)
            pthread_cond_wait(&bench.cond, &bench.lock);
        bench.open++;
        pthread_mutex_unlock(&bench.lock);
        int rc = b[i] >= fanstore_blobs.n
                     ? -EINVAL
                     : fanstore_remote_fetch_kept(o[i], b[i], 0, fanstore_blobs.raw[b[i]], timeout, bench_kept, NULL);
        if (rc != 0)
            bench_done(rc, 0);
    }
    pthread_mutex_lock(&bench.lock);
    while (bench.open > 0)
        pthread_cond_wait(&bench.cond, &bench.lock);
    pthread_mutex_unlock(&bench.lock);
    Py_END_ALLOW_THREADS;
    PyBuffer_Release(&own);
    PyBuffer_Release(&ids);
    return Py_BuildValue("(Ki)", (unsigned long long)bench.bytes, bench.failed);
}
