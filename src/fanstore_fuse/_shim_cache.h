/* Blobs of this rank's disk cache of remote blobs (_diskcache.py), read and verified in C
 * (_shim_cache.c), for the shim's READ path: a blob the rank does not hold may be in
 * LOCAL/cache/seg-*.fsc; the dispatcher asks here before any remote path (_shim_read.c:
 * blob_ok and serve; _shim_remote_read.c leaves a blob whose index slot is set to it).
 *
 * Every call is safe from any thread without the GIL. Results: */
#ifndef FANSTORE_SHIM_CACHE_H
#define FANSTORE_SHIM_CACHE_H
#include <stddef.h>
#include <stdint.h>

#define FANSTORE_CACHE_HIT 1       /* the verified bytes are in the caller's buffer */
#define FANSTORE_CACHE_MISS 0      /* not cached (or the C cache is off): try the next path */
#define FANSTORE_CACHE_FALLBACK -1 /* cached but unreadable, bad or evicted: let Python read it
                                      (it drops the entry and fetches the blob again) */
#define FANSTORE_CACHE_AGAIN -2    /* nowait: the entry is not all in the page cache */

/* Whether `blob` has an index slot (cheap: one load), with its raw length in *raw. */
int fanstore_cache_lookup(uint64_t blob, uint32_t *raw);

/* All raw bytes of `blob` into `buf` (`cap` >= its raw length), verified against the entry's
 * xxh3; *raw gets the length. nowait: only from the page cache (preadv2 RWF_NOWAIT).
 * FANSTORE_CACHE_HIT, _MISS, _FALLBACK or _AGAIN (buf undefined unless HIT). */
int fanstore_cache_read(uint64_t blob, char *buf, size_t cap, uint32_t *raw, int nowait);

/* Raw bytes lo..hi of `blob` (hi clipped to its raw length): the whole entry is read into the
 * caller's growable buffer *buf (*cap bytes; realloc'ed as needed, the caller frees it; e.g.
 * _shim_blobs.h's scratch `raw`/`raw_cap`) and verified; on HIT *out points at byte lo in it
 * and *n is the count. HIT, MISS, FALLBACK (also out of memory) or AGAIN. */
int fanstore_cache_range(uint64_t blob, uint64_t lo, uint64_t hi, int nowait, char **buf,
                         size_t *cap, const char **out, size_t *n);

/* The live segment files, oldest first, each opened afresh (O_RDONLY) for the streaming thread
 * (_shim_stream.c), which closes them: at most `max` descriptors into `fds`; the count (0 when
 * the C cache is off). */
int fanstore_cache_segment_fds(int *fds, int max);

/* For the READ dispatcher (_shim_read.c), beside _shim_blobs.h's functions: */
struct fanstore_scratch;

/* Whether `blob` is cached with a raw length of at most `whole_max` (read whole for a READ). */
int fanstore_cache_ok(uint64_t blob, uint32_t whole_max);

/* fanstore_blob_range for a blob held here, else raw bytes lo..hi from the disk cache into
 * the scratch's `raw` buffer: FANSTORE_BLOB_OK, _AGAIN, _NOT_HELD (not cached) or _CORRUPT
 * (cached but not verified: Python's fallback drops it and fetches the blob again). */
int fanstore_cache_blob_range(uint64_t blob, uint64_t lo, uint64_t hi, int nowait,
                              struct fanstore_scratch *s, const char **out);

#ifdef Py_PYTHON_H /* the module's functions, for _noflush.c's method table */
PyObject *fanstore_py_hold_cache(PyObject *self, PyObject *args);
PyObject *fanstore_py_cache_evicted(PyObject *self, PyObject *arg);
PyObject *fanstore_py_drop_cache(PyObject *self, PyObject *unused);
PyObject *fanstore_py_cache_counts(PyObject *self, PyObject *unused);
PyObject *fanstore_py_cache_read(PyObject *self, PyObject *args);

#define FANSTORE_CACHE_METHODS                                                                    \
    {"hold_cache", fanstore_py_hold_cache, METH_VARARGS,                                          \
     "hold_cache(index, raw, directory): read the disk cache's entries in C"},                   \
    {"cache_evicted", fanstore_py_cache_evicted, METH_O,                                          \
     "cache_evicted(number): segments up to `number` are gone (FIFO); close their fds"},          \
    {"drop_cache", fanstore_py_drop_cache, METH_NOARGS,                                           \
     "drop_cache(): C cache reads off, fds closed, buffers released"},                            \
    {"cache_counts", fanstore_py_cache_counts, METH_NOARGS,                                       \
     "cache_counts(): (hits, bytes, fallbacks, O_DIRECT reads, nowait reads gated) of C "       \
     "cache reads"},                                                                              \
    {"cache_read", fanstore_py_cache_read, METH_VARARGS,                                          \
     "cache_read(blob, lo=0, hi=2**64-1, nowait=False): bytes lo..hi, verified in C (tests), "    \
     "or 0 (not cached), -1 (Python must read it), -2 (nowait: not in the page cache)"},
#endif

#endif
