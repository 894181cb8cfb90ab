/* Directory listings answered with plain READDIR where the kernel allows (issue 14).
 *
 * pyfuse3 3.5 registers only readdirplus and clears FUSE_CAP_READDIRPLUS_AUTO in its init, so
 * every listing chunk is a READDIRPLUS: the kernel instantiates an inode and a dentry for every
 * entry, which `find` (it needs only d_type) pays for in system time. This patch
 *
 * - wraps init: pyfuse3's runs first, then READDIRPLUS_AUTO is wanted again (when the kernel
 *   offers it). The kernel then asks READDIRPLUS for the first chunk of a listing and for a
 *   chunk after a lookup in that directory, plain READDIR otherwise (fs/fuse/readdir.c,
 *   fuse_use_readdirplus);
 * - answers READDIR with pyfuse3's readdirplus handler, the file handle it hands to Python
 *   marked with PLAIN_FH_BIT: Python's readdir strips the bit and calls plain_entries(True)
 *   around the (synchronous) readdir_reply calls of such a request;
 * - interposes fuse_add_direntry_plus (pyfuse3's readdir_reply calls it; the shim is in the
 *   global symbol scope before pyfuse3 is imported, see _noflush.c): while plain entries are on,
 *   it writes a plain record (inode and type from the attributes) with fuse_add_direntry, so
 *   sizes and offsets stay what the kernel expects of a READDIR reply.
 *
 * The kernel counts no lookups for plain entries; the daemon keeps no lookup counts (inode
 * numbers are stable, forget does nothing), so nothing else changes. All of this runs on the one
 * thread that serves requests.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "_shim_ops.h"

#define PLAIN_FH_BIT (UINT64_C(1) << 63)

typedef void (*init_t)(void *, struct fuse_conn_info *);
typedef void (*readdir_t)(fuse_req_t, fuse_ino_t, size_t, off_t, struct fuse_file_info *);
typedef size_t (*add_plus_t)(fuse_req_t, char *, size_t, const char *,
                             const struct fuse_entry_param *, off_t);
typedef size_t (*add_plain_t)(fuse_req_t, char *, size_t, const char *, const struct stat *,
                              off_t);

static init_t py_init;
static readdir_t py_readdirplus;
static int plain_on;
static int auto_granted;
static unsigned long long plain_requests;
static unsigned long long plain_entries;

static void init_auto(void *userdata, struct fuse_conn_info *conn) {
    py_init(userdata, conn);
    if (conn->capable & FUSE_CAP_READDIRPLUS_AUTO) {
        conn->want |= FUSE_CAP_READDIRPLUS_AUTO;
        auto_granted = 1;
    }
}

static void readdir_plain(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off,
                          struct fuse_file_info *fi) {
    struct fuse_file_info copy = *fi;
    copy.fh |= PLAIN_FH_BIT;
    plain_requests++;
    py_readdirplus(req, ino, size, off, &copy);
}

void fanstore_patch_readdir(struct fuse_lowlevel_ops *ops) {
    const char *off = getenv("FANSTORE_READDIRPLUS");
    if (off != NULL && strcmp(off, "always") == 0)
        return; /* every chunk READDIRPLUS, as pyfuse3 has it (for comparisons) */
    if (ops->readdirplus == NULL || ops->readdir != NULL || ops->init == NULL)
        return; /* not pyfuse3's table as we know it */
    if (fanstore_libfuse_symbol("fuse_add_direntry") == NULL ||
        fanstore_libfuse_symbol("fuse_add_direntry_plus") == NULL)
        return;
    py_init = ops->init;
    py_readdirplus = ops->readdirplus;
    ops->init = init_auto;
    ops->readdir = readdir_plain;
}

size_t fuse_add_direntry_plus(fuse_req_t req, char *buf, size_t bufsize, const char *name,
                              const struct fuse_entry_param *e, off_t off) {
    static add_plus_t real_plus;
    static add_plain_t real_plain;
    if (plain_on) {
        if (real_plain == NULL)
            real_plain = (add_plain_t)fanstore_libfuse_symbol("fuse_add_direntry");
        size_t n = real_plain(req, buf, bufsize, name, &e->attr, off);
        if (n <= bufsize)
            plain_entries++;
        return n;
    }
    if (real_plus == NULL)
        real_plus = (add_plus_t)fanstore_libfuse_symbol("fuse_add_direntry_plus");
    return real_plus(req, buf, bufsize, name, e, off);
}

/* Python's side (_noflush's methods, _fastclose.py). */
void fanstore_plain_entries(int on) { plain_on = on; }
int fanstore_readdir_auto(void) { return auto_granted; }
unsigned long long fanstore_plain_requests(void) { return plain_requests; }
unsigned long long fanstore_plain_entry_count(void) { return plain_entries; }
