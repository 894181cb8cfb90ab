/* _shim_mapread.c: large READs of raw frames checked and answered from a mapping of the local
 * copy (its header comment). */
#ifndef FANSTORE_SHIM_MAPREAD_H
#define FANSTORE_SHIM_MAPREAD_H
#include <stdint.h>

#include "_shim_ops.h"

#define MAPREAD_MIN (256u << 10) /* smaller READs: a pread copy costs about what mapping does */
#define FANSTORE_MAPREAD_NO 1    /* not answered this way (off, small, compressed, not held) */

/* Answer the READ of raw bytes [lo, hi) of one `blob` from the mapping, through `reply`:
 * FANSTORE_BLOB_OK (replied), FANSTORE_MAPREAD_NO (nothing done: read it as usual), or an
 * outcome with nothing replied (AGAIN when nowait and a page is not in the page cache, IO,
 * CORRUPT, NOMEM). */
int fanstore_mapread_range(fuse_req_t req, uint64_t blob, uint64_t lo, uint64_t hi, int nowait,
                           int (*reply)(fuse_req_t, const char *, size_t));
void fanstore_mapread_forget(void);                     /* before the partitions close */
#endif
