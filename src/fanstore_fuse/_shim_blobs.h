/* The manifest's blob columns and this rank's local copies of the partitions, held once for
 * the shim's reads in C (_shim_blobs.c), and what can be done with one blob without Python
 * (decoding and frames: _shim_frames.c): whether it is held here, pread of its stored bytes,
 * decode + verify (codecs 0-3, xxh3 seeded as _format.checksum), and framed blobs (codec 3)
 * read in part: the frame table checked against the manifest and kept, frames k0..k1 decoded
 * and checked.
 *
 * Every function is thread-safe and needs no GIL: the columns are read-only once held, the
 * frame-table cache has its own lock, each thread has its own zstd context. Python hands the
 * columns over (hold_blobs) before the session serves and drops them (drop_blobs) only after
 * it ended: no call may run across a drop.
 *
 * Outcomes are FANSTORE_BLOB_* (0 or negative). Nothing returned as OK was unchecked: a
 * caller that gets anything else must not hand the bytes to a reader (the Python path then
 * decides: log, replicas, EIO).
 */
#ifndef FANSTORE_SHIM_BLOBS_H
#define FANSTORE_SHIM_BLOBS_H
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#define FANSTORE_CODEC_RAW 0       /* _format.CODEC_RAW */
#define FANSTORE_CODEC_ZSTD 1      /* one zstd frame */
#define FANSTORE_CODEC_ZSTD_DICT 2 /* one zstd frame with the manifest's zdict */
#define FANSTORE_CODEC_FRAMED 3    /* frame table + frames (docs/format.md "Framed blobs") */
#define FANSTORE_HASH_SEED UINT64_C(0x46414E53)
#define FANSTORE_ZSTD_BIT (UINT32_C(1) << 31) /* in a frame table word: a zstd frame */

enum {
    FANSTORE_BLOB_OK = 0,
    FANSTORE_BLOB_AGAIN = -1,    /* nowait: some bytes are not in the page cache */
    FANSTORE_BLOB_NOT_HELD = -2, /* not in this rank's local copies (or no blobs held) */
    FANSTORE_BLOB_IO = -3,       /* pread failed or came back short (truncated partition) */
    FANSTORE_BLOB_CORRUPT = -4,  /* checksum mismatch, undecodable, bad frame table */
    FANSTORE_BLOB_NOMEM = -5,
};

struct fanstore_blobs {
    uint64_t n; /* blobs; 0: none held (every lookup says NOT_HELD) */
    const uint32_t *part, *stored, *raw;
    const uint64_t *offset, *xxh3;
    const uint8_t *codec;
    uint64_t chunk_size; /* options.chunk_size: blob k of a file covers [k, k + 1) x this */
};

extern struct fanstore_blobs fanstore_blobs;

/* A verified frame table (codec 3): frame k's stored bytes are [offsets[k], offsets[k + 1])
 * relative to the blob's start; zstd[k] 1 for a zstd frame; digests[k] the xxh3 of its raw
 * bytes. Frame k's raw size: fanstore_frame_raw_size. */
struct fanstore_ftable {
    uint64_t blob;
    uint32_t frame_size, count;
    uint64_t raw_len;
    uint64_t *offsets; /* count + 1 */
    uint8_t *zstd;
    uint64_t *digests;
    int refs; /* the cache's reference and each fanstore_table_get's (under the cache lock) */
};

/* xxh3-64 with FANSTORE_HASH_SEED, the variant chosen at run time (_shim_xxh3.c): every hash
 * the shim computes goes through here or fanstore_xxh3. */
uint64_t fanstore_checksum(const void *p, size_t n);

/* Whether this rank holds `blob`'s stored bytes locally (its partition is here: whole, or a
 * dense copy listing the blob). */
int fanstore_blob_held(uint64_t blob);

/* Where `blob`'s stored bytes lie in this rank's local copy: the offset in *fd's file, or -1
 * when not held (for replies sent from a mapping: _shim_remote_serve_map.c). */
int64_t fanstore_blob_locate(uint64_t blob, int *fd);

/* Pages of the `len` bytes mapped at `p` (any alignment) that are not in the page cache
 * (`mincore`, which reads nothing in); all of them when it cannot tell. */
size_t fanstore_pages_missing(const void *p, size_t len);

/* The partitions, and the descriptor of partition `part`'s local copy (-1: not here). */
uint32_t fanstore_blob_parts(void);
int fanstore_blob_part_fd(uint32_t part);

/* Local copies streamed into the page cache (_shim_stream.c): `part`'s copy was found cold by
 * a read (cheap: a counter, and a signal to the streaming thread now and then); stop joins the
 * thread (before the descriptors close). */
void fanstore_stream_cold(uint32_t part);
#define FANSTORE_STREAM_CACHE UINT32_MAX /* `part` for the disk cache's segments (_shim_cache.c) */
void fanstore_stream_stop(void);  /* and none started until: */
void fanstore_stream_allow(void); /* (hold_blobs, once the new blobs are in place) */

/* `n` stored bytes of `blob` from `rel` bytes into them, into `buf` (the whole blob: rel 0,
 * n = stored[blob]). nowait: only from the page cache (preadv2 RWF_NOWAIT), AGAIN at once
 * otherwise. A whole blob of at most FANSTORE_DIRECT_MISS bytes (default 1 MiB) is looked up
 * with cachestat(2) first: not wholly resident, nowait gives AGAIN without any I/O and a blocking
 * read reads it with O_DIRECT (no page cache filled; see _shim_blobs.c). OK, AGAIN, NOT_HELD,
 * IO or NOMEM. */
int fanstore_blob_pread(uint64_t blob, uint64_t rel, size_t n, void *buf, int nowait);

/* Whether a cold whole read of `blob` goes around the page cache (O_DIRECT) here. */
int fanstore_blob_direct(uint64_t blob);

/* 1 when every page of [off, off + n) of `fd` is in the page cache, 0 when not, -1 without
 * cachestat(2) (Linux < 6.5): ~0.5 us, no mapping and no mmap lock, unlike mincore. */
int fanstore_range_resident(int fd, off_t off, size_t n);

/* [off, off + n) of the O_DIRECT descriptor `dfd`, read as its 4 KiB-aligned span into this
 * thread's bounce buffer: a pointer to byte `off` there (good until this thread's next call),
 * or NULL with *status FANSTORE_BLOB_IO (an error, or the file ends first), NOMEM, or AGAIN
 * (O_DIRECT refused by the file system: then never again, for every caller). */
const char *fanstore_direct_span(int dfd, off_t off, size_t n, int *status);
/* The most bytes a cold read takes around the page cache (FANSTORE_DIRECT_MISS; 0: none, and
 * none once cachestat or O_DIRECT was refused); fanstore_direct_refused() says it was. */
size_t fanstore_direct_max(void);
void fanstore_direct_refused(void);

/* Decode and verify `blob` from its complete stored bytes (`stored`, stored[blob] bytes: read
 * here, or received from a peer) into `out` (raw[blob] bytes). Every codec: 0 checked in
 * place and copied, 1 and 2 decoded with the output bounded by the raw size, 3 the table
 * checked against the manifest, then every frame decoded and checked. OK, CORRUPT or NOMEM. */
int fanstore_blob_decode(uint64_t blob, const void *stored, void *out);

/* The verified frame table of framed `blob` held here: from the cache, or read (one pread,
 * a second when the table is longer than 4 KiB), checked and cached (4,096 tables at most).
 * On OK, *t holds a reference: give it back with fanstore_table_put. OK, AGAIN (nowait),
 * NOT_HELD, IO, CORRUPT or NOMEM. */
int fanstore_table_get(uint64_t blob, int nowait, const struct fanstore_ftable **t);
void fanstore_table_put(const struct fanstore_ftable *t);

/* Parse and check a frame table at the start of `buf` (`len` bytes available) of a framed blob
 * of `stored_len` stored and `raw_len` raw bytes whose manifest xxh3 is `digest`, as
 * _blobcodec.parse_table. On OK, *t is a new table (refs 1) the caller frees with
 * fanstore_table_put. CORRUPT (also when `len` is too short) or NOMEM. */
int fanstore_table_parse(const void *buf, size_t len, uint64_t stored_len, uint64_t raw_len,
                         uint64_t digest, struct fanstore_ftable **t);

static inline uint32_t fanstore_frame_raw_size(const struct fanstore_ftable *t, uint32_t k) {
    uint64_t left = t->raw_len - (uint64_t)k * t->frame_size;
    return left < t->frame_size ? (uint32_t)left : t->frame_size;
}

/* Frames k0..k1 (inclusive) from `span`, their stored bytes back to back (stored offsets
 * offsets[k0] .. offsets[k1 + 1]): each decoded (zstd) into `out` at its raw position
 * ((k - k0) x frame_size) and checked against its xxh3, raw frames checked and copied. `out`
 * NULL: the frames must all be raw; they are checked in place (the raw bytes are then `span`
 * itself). OK, CORRUPT or NOMEM. */
int fanstore_frames_decode(const struct fanstore_ftable *t, uint32_t k0, uint32_t k1,
                           const void *span, void *out);

/* Whether frames k0..k1 are all stored raw. */
int fanstore_frames_raw(const struct fanstore_ftable *t, uint32_t k0, uint32_t k1);

/* A verified frame kept by the frame cache (_shim_fcache.c), a decoded zstd frame or a raw
 * sub-block: frame k of `blob`,
 * `len` raw bytes from `at` bytes into the blob. Reference-counted: whoever got it from
 * fanstore_fcache_get/_add gives it back with fanstore_fcache_put. */
struct fanstore_frame {
    uint64_t blob, at;
    uint32_t k, len, cap; /* cap: bytes allocated for data (an entry may be reused) */
    int refs, cached;     /* under the cache's lock */
    int used;             /* a hit since it last came to the front of the list (its lock) */
    struct fanstore_frame *hnext, *prev, *next;
    char data[];
};

/* The budget in bytes (0: off, every entry dropped; counters reset); -1 without memory. */
int fanstore_fcache_set(size_t bytes);
int fanstore_fcache_on(void);
void fanstore_fcache_clear(void); /* every entry dropped, the budget kept (blobs dropped) */
/* Frame k of blob with a reference, counted as a hit; NULL when not kept. A miss is counted
 * by fanstore_fcache_miss once the frame's bytes were read (a nowait try that gives up is
 * not one). */
struct fanstore_frame *fanstore_fcache_get(uint64_t blob, uint32_t k);
void fanstore_fcache_miss(void);
/* Whether raw sub-blocks read in part are kept too (O_DIRECT readers: their other pages then
 * skip the pread and the xxh3); on by default. */
int fanstore_fcache_subblocks(void);
void fanstore_fcache_set_subblocks(int on);
/* A new entry (refs 1, not kept) for the caller to fill and verify; NULL without memory. */
struct fanstore_frame *fanstore_fcache_new(uint64_t blob, uint32_t k, uint64_t at, uint32_t len);
/* Keep a filled and VERIFIED entry; returns the entry to use, with the caller's reference
 * (`f`, or the one another thread kept first, `f` then released). Not kept (off, larger than
 * the budget): `f` itself, still the caller's alone. */
struct fanstore_frame *fanstore_fcache_add(struct fanstore_frame *f);
void fanstore_fcache_put(struct fanstore_frame *f); /* NULL: nothing */
/* `f` (held by the caller) no longer kept: the kernel's page cache has it now. */
void fanstore_fcache_forget(struct fanstore_frame *f);
/* hits, misses, evictions, bytes kept, entries, budget */
void fanstore_fcache_counts(unsigned long long out[6]);

/* A thread's buffers for fanstore_blob_range (grown as needed; free with
 * fanstore_scratch_free; zero-initialized). The last non-framed blob decoded stays there, so
 * many small reads of one blob (O_DIRECT) decode and verify it once. `frame`: the cached frame
 * the last range came from, or with `want_frame` a copy of the raw frame (sub-block) it came
 * from (a reference, released by the next fanstore_blob_range or fanstore_scratch_release), or
 * NULL. */
struct fanstore_scratch {
    char *stored, *raw;
    size_t stored_cap, raw_cap;
    uint64_t have; /* 1 + the blob whose verified raw bytes the buffers hold; 0: none */
    struct fanstore_frame *frame;
    int want_frame; /* set by the caller: a raw frame read in part comes as s->frame too */
};
void fanstore_scratch_free(struct fanstore_scratch *s);

/* `n` bytes (at least 1) on a 64-byte boundary (2 MiB or more: 2 MiB, advised MADV_HUGEPAGE),
 * for blob bytes; free() them. Prep puts blob data on 64-byte boundaries too
 * (`_format.DATA_ALIGN`): on AMD EPYC a `rep movsb` copy (glibc's memcpy of 2 KiB..~1 MiB, every
 * kernel copy to or from user memory) whose destination lies 8..24 bytes past its source modulo
 * 4096 runs at a third of the speed; two 64-aligned addresses are never that close
 * (`python -m bench.copy_align`, docs/performance.md). */
void *fanstore_data_alloc(size_t n);
/* Lets go of a block from fanstore_data_alloc (or malloc): large 64-aligned ones are kept for
 * the next fanstore_data_alloc (a few), others freed. */
void fanstore_data_free(void *p);
/* (large blocks allocated afresh, of them advised MADV_HUGEPAGE, taken from the pool) */
void fanstore_data_counts(unsigned long long out[3]);
/* An on/off knob from the environment, read once into *cached (start it at -1): off only when
 * `name` is "0". */
int fanstore_knob_on(const char *name, int *cached);
void fanstore_scratch_release(struct fanstore_scratch *s); /* the frame reference, if any */

/* Raw bytes lo..hi (hi <= raw[blob]) of `blob`, held here, verified: a framed blob reads only
 * the frames covering them (one pread; raw frames checked in place; a range inside one frame
 * but not all of it comes from the frame cache, the frame read, decoded when zstd, checked and
 * kept there on a miss: s->frame), any other reads and decodes the whole blob. On OK, *out points
 * at the hi - lo bytes, inside `s` or s->frame (valid until its next use). nowait
 * (FANSTORE_NOWAIT): from the page cache only, AGAIN at once otherwise; FANSTORE_CHEAP also
 * AGAIN for a zstd frame to decode (cached frames, raw frames and other blobs go on). OK,
 * AGAIN, NOT_HELD, IO, CORRUPT or NOMEM. */
#define FANSTORE_NOWAIT 1
#define FANSTORE_CHEAP 2
int fanstore_blob_range(uint64_t blob, uint64_t lo, uint64_t hi, int nowait,
                        struct fanstore_scratch *s, const char **out);

void fanstore_tables_drop(void); /* every frame table and cached frame released (drop_blobs) */

/* _shim_push.c: store a cached frame of dataset inode `ino`, at file offset `off`, in the
 * kernel's page cache from the push thread; takes over the caller's reference to `f`. */
void fanstore_push(uint64_t ino, uint64_t off, struct fanstore_frame *f);
int fanstore_push_on(void);

#ifdef Py_PYTHON_H /* the module's functions, for _noflush.c's method table */
#include "_shim_xxh3.h"
PyObject *fanstore_py_hold_blobs(PyObject *self, PyObject *args);
PyObject *fanstore_py_drop_blobs(PyObject *self, PyObject *unused);
PyObject *fanstore_py_blob_read(PyObject *self, PyObject *args);
PyObject *fanstore_py_frame_cache(PyObject *self, PyObject *args);   /* _shim_push.c */
PyObject *fanstore_py_frame_counts(PyObject *self, PyObject *unused); /* _shim_push.c */

#define FANSTORE_BLOBS_METHODS                                                                   \
    {"hold_blobs", fanstore_py_hold_blobs, METH_VARARGS,                                         \
     "hold_blobs((part, offset, stored, raw, codec, xxh3), n, chunk_size, zdict, fds, dense, "   \
     "dense_ids, dense_offs): hold the blob columns and this rank's local copies for C reads"},  \
    {"drop_blobs", fanstore_py_drop_blobs, METH_NOARGS,                                          \
     "drop_blobs(): release the blob columns, close the local copies (no read in flight)"},      \
    {"blob_read", fanstore_py_blob_read, METH_VARARGS,                                           \
     "blob_read(blob, lo, hi): bytes lo..hi of a held blob, verified in C (tests; raises "       \
     "OSError with the outcome)"},                                                             \
    {"frame_cache", fanstore_py_frame_cache, METH_VARARGS,                                       \
     "frame_cache(budget, push, subblocks=True): decoded zstd frames (and raw sub-blocks) kept " \
     "in C up to budget bytes (0: off); push: partly read frames stored in the page cache"},    \
    {"frame_counts", fanstore_py_frame_counts, METH_NOARGS,                                      \
     "frame_counts(): (hits, misses, evictions, bytes, entries, budget, pushes, pushed bytes, "  \
     "failed pushes, dropped pushes)"},                                                      \
        FANSTORE_XXH3_METHODS
#endif

#endif
