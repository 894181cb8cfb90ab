/* The FUSE-over-io_uring ABI (Linux 6.14+, FUSE kernel minor 42), which older system headers
 * (<linux/fuse.h> of Debian 12: minor 38) do not have: the INIT flag, the two commands, and the
 * layouts of an entry's header buffer and of a command's 80-byte area in a 128-byte SQE.
 * Shared by _shim_uring.c and bench/fuse_transport_server.c. */
#ifndef FANSTORE_FUSE_URING_ABI_H
#define FANSTORE_FUSE_URING_ABI_H

#include <stdint.h>

#define FUSE_URING_OVER_IO_URING_FLAG2 (1u << 9) /* FUSE_OVER_IO_URING: bit 41 of the flags */
#define FUSE_URING_INIT_EXT_FLAG (1u << 30)      /* FUSE_INIT_EXT: flags2 is read */
#define FUSE_URING_CMD_REGISTER 1                /* an entry's buffers given, a request asked */
#define FUSE_URING_CMD_COMMIT_AND_FETCH 2        /* a reply given, the next request asked */

struct fuse_uring_ent_io { /* the kernel's fuse_uring_ent_in_out */
    uint64_t flags, commit_id;
    uint32_t payload_sz, padding;
    uint64_t reserved;
};

struct fuse_uring_header { /* the kernel's fuse_uring_req_header: an entry's first buffer */
    char in_out[128]; /* fuse_in_header in, fuse_out_header out */
    char op_in[128];  /* the op's argument struct */
    struct fuse_uring_ent_io ent;
};

struct fuse_uring_cmd { /* the kernel's fuse_uring_cmd_req, in the SQE's command area */
    uint64_t flags, commit_id;
    uint16_t qid;
    uint8_t padding[6];
};

#endif
