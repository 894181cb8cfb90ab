/* A minimal read-only FUSE server over a directory tree, for one measurement (bench/
 * fuse_transport.py): what the kernel's FUSE transport costs per request when requests come by
 * read(2) and replies go by writev(2) on /dev/fuse ("dev", one thread, as libfuse's loop) against
 * FUSE over io_uring ("uring", Linux 6.14+: one queue per CPU, served by a thread pinned to that
 * CPU; a reply and the fetch of the next request are one io_uring_enter), all else the same.
 *
 *   fuse_transport_server MODE SRC MNT      MODE: dev | uring
 *
 * At start it walks SRC (directories and regular files), keeps every file open, and mounts MNT
 * (root: mount(2) with fd=). It answers INIT, LOOKUP, GETATTR, OPEN, READ (pread of the file),
 * FLUSH, RELEASE, STATFS, FORGET; everything else ENOSYS. Entries, attributes and pages are
 * cached by the kernel (long timeouts, FOPEN_KEEP_CACHE), as fanstore-fuse asks. It exits when
 * the mount goes away (read of /dev/fuse gives ENODEV) or on SIGTERM, which prints how many
 * requests came each way. Needs root (mount(2)) and, for uring, the fuse module's enable_uring. */
#define _GNU_SOURCE
#include <dirent.h>
#include <stddef.h>
#include <errno.h>
#include <fcntl.h>
#include <linux/fuse.h>
#include <liburing.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/sysinfo.h>
#include <sys/uio.h>
#include <unistd.h>

#include "_fuse_uring_abi.h" /* src/fanstore_fuse/: the ABI, shared with the shim */

#define MAX_PAYLOAD (1u << 20)
#define BUF_SIZE (MAX_PAYLOAD + 8192)
#define DEPTH 8
#define TIMEOUT_S 86400

struct node {
    uint64_t parent;
    char *name;
    struct stat st;
    int fd;
};
static struct node *nodes; /* nodes[ino - 1]; ino 1 is the root */
static size_t nnodes, cap;
static int devfd;
static unsigned long long by_dev, by_ring;
#include <signal.h>
static void on_term(int sig) { (void)sig; fprintf(stderr, "fuse_transport_server: requests by /dev/fuse %llu, by io_uring %llu\n", by_dev, by_ring); _exit(0); }

static uint64_t add(uint64_t parent, const char *name, const struct stat *st, int fd) {
    if (nnodes == cap) {
        cap = cap ? cap * 2 : 1024;
        nodes = realloc(nodes, cap * sizeof(*nodes));
    }
    nodes[nnodes] = (struct node){parent, strdup(name), *st, fd};
    nodes[nnodes].st.st_ino = nnodes + 1;
    return ++nnodes;
}

static void walk(uint64_t ino, int dirfd) {
    DIR *d = fdopendir(dirfd);
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        if (e->d_name[0] == '.')
            continue;
        struct stat st;
        int fd = openat(dirfd, e->d_name, O_RDONLY | O_CLOEXEC);
        if (fd < 0 || fstat(fd, &st) != 0)
            continue;
        uint64_t child = add(ino, e->d_name, &st, S_ISDIR(st.st_mode) ? -1 : fd);
        if (S_ISDIR(st.st_mode))
            walk(child, fd);
    }
    closedir(d);
}

static uint64_t lookup(uint64_t parent, const char *name) {
    for (size_t i = 0; i < nnodes; i++)
        if (nodes[i].parent == parent && strcmp(nodes[i].name, name) == 0)
            return i + 1;
    return 0;
}

static void fill_attr(struct fuse_attr *a, uint64_t ino) {
    const struct stat *st = &nodes[ino - 1].st;
    memset(a, 0, sizeof(*a));
    a->ino = ino;
    a->size = st->st_size;
    a->blocks = st->st_blocks;
    a->mode = st->st_mode;
    a->nlink = st->st_nlink;
    a->mtime = st->st_mtim.tv_sec;
    a->atime = st->st_atim.tv_sec;
    a->ctime = st->st_ctim.tv_sec;
    a->blksize = 4096;
}

/* Answer one request: the reply's payload into `out` (room MAX_PAYLOAD); its length, or -errno,
 * or INT32_MIN for no reply (FORGET). `op` is the op's argument struct, `name` a LOOKUP's. */
static int32_t handle(const struct fuse_in_header *in, const void *op, const char *name, char *out) {
    uint64_t ino = in->nodeid;
    if (in->opcode == FUSE_FORGET || in->opcode == FUSE_BATCH_FORGET)
        return INT32_MIN;
    if (ino == 0 || ino > nnodes)
        return -ENOENT;
    switch (in->opcode) {
    case FUSE_LOOKUP: {
        uint64_t child = lookup(ino, name);
        if (child == 0)
            return -ENOENT;
        struct fuse_entry_out *e = (void *)out;
        memset(e, 0, sizeof(*e));
        e->nodeid = child;
        e->generation = 1;
        e->entry_valid = e->attr_valid = TIMEOUT_S;
        fill_attr(&e->attr, child);
        return sizeof(*e);
    }
    case FUSE_GETATTR: {
        struct fuse_attr_out *a = (void *)out;
        memset(a, 0, sizeof(*a));
        a->attr_valid = TIMEOUT_S;
        fill_attr(&a->attr, ino);
        return sizeof(*a);
    }
    case FUSE_OPEN: {
        struct fuse_open_out *o = (void *)out;
        memset(o, 0, sizeof(*o));
        o->fh = ino;
        o->open_flags = FOPEN_KEEP_CACHE | FOPEN_NOFLUSH;
        return sizeof(*o);
    }
    case FUSE_READ: {
        const struct fuse_read_in *r = op;
        if (nodes[ino - 1].fd < 0)
            return -EISDIR;
        size_t len = r->size < MAX_PAYLOAD ? r->size : MAX_PAYLOAD;
        ssize_t n = pread(nodes[ino - 1].fd, out, len, (off_t)r->offset);
        return n < 0 ? -errno : (int32_t)n;
    }
    case FUSE_FLUSH:
    case FUSE_RELEASE:
    case FUSE_RELEASEDIR:
        return 0;
    case FUSE_OPENDIR: {
        struct fuse_open_out *o = (void *)out;
        memset(o, 0, sizeof(*o));
        return sizeof(*o);
    }
    case FUSE_READDIR: {
        const struct fuse_read_in *r = op;
        size_t used = 0, room = r->size < MAX_PAYLOAD ? r->size : MAX_PAYLOAD;
        uint64_t k = 0;
        for (size_t i = 0; i < nnodes; i++) {
            if (nodes[i].parent != ino || i == 0)
                continue;
            if (++k <= r->offset)
                continue;
            size_t namelen = strlen(nodes[i].name);
            size_t size = FUSE_DIRENT_ALIGN(FUSE_NAME_OFFSET + namelen);
            if (used + size > room)
                break;
            struct fuse_dirent *d = (void *)(out + used);
            memset(d, 0, size);
            d->ino = i + 1;
            d->off = k;
            d->namelen = (uint32_t)namelen;
            d->type = (nodes[i].st.st_mode & S_IFMT) >> 12;
            memcpy(d->name, nodes[i].name, namelen);
            used += size;
        }
        return (int32_t)used;
    }
    case FUSE_STATFS: {
        struct fuse_statfs_out *s = (void *)out;
        memset(s, 0, sizeof(*s));
        s->st.bsize = s->st.frsize = 4096;
        s->st.namelen = 255;
        return sizeof(*s);
    }
    default:
        return -ENOSYS;
    }
}

static void reply_dev(uint64_t unique, int32_t res, char *payload) {
    if (res == INT32_MIN)
        return;
    struct fuse_out_header h = {sizeof(h) + (res > 0 ? res : 0), res > 0 ? 0 : res, unique};
    struct iovec iov[2] = {{&h, sizeof(h)}, {payload, res > 0 ? (size_t)res : 0}};
    if (writev(devfd, iov, res > 0 ? 2 : 1) < 0 && errno != ENOENT)
        perror("writev");
}

/* /dev/fuse: read a request, answer it, until the mount goes away. */
static void *dev_loop(void *arg) {
    (void)arg;
    char *buf = malloc(BUF_SIZE), *out = malloc(MAX_PAYLOAD);
    for (;;) {
        ssize_t n = read(devfd, buf, BUF_SIZE);
        if (n < 0) {
            if (errno == EINTR || errno == EAGAIN || errno == ENOENT)
                continue;
            exit(0); /* ENODEV: unmounted */
        }
        __atomic_add_fetch(&by_dev, 1, __ATOMIC_RELAXED);
        const struct fuse_in_header *in = (void *)buf;
        const char *args = buf + sizeof(*in);
        reply_dev(in->unique, handle(in, args, args, out), out);
    }
    return NULL;
}

struct entry {
    struct fuse_uring_header *hdr;
    char *payload;
    struct iovec iov[2];
};

static void prep(struct io_uring *ring, struct entry *e, int qid, uint32_t cmd, uint64_t commit) {
    struct io_uring_sqe *sqe = io_uring_get_sqe(ring);
    if (sqe == NULL) { /* as many SQEs as entries: cannot happen */
        fprintf(stderr, "no free SQE\n");
        exit(6);
    }
    memset(sqe, 0, sizeof(*sqe));
    sqe->opcode = IORING_OP_URING_CMD;
    sqe->flags = IOSQE_FIXED_FILE;
    sqe->fd = 0;
    sqe->cmd_op = cmd;
    if (cmd == FUSE_URING_CMD_REGISTER) {
        sqe->addr = (uint64_t)(uintptr_t)e->iov;
        sqe->len = 2;
    }
    io_uring_sqe_set_data(sqe, e);
    /* the command area: 80 bytes from sqe->cmd (an SQE128 ring) */
    struct fuse_uring_cmd req = {.qid = (uint16_t)qid, .commit_id = commit};
    char area[80] = {0};
    memcpy(area, &req, sizeof(req));
    memcpy((char *)(uintptr_t)sqe + offsetof(struct io_uring_sqe, cmd), area, sizeof(area));
}

/* One queue: pinned to CPU `qid`, DEPTH entries registered, then fetch / answer / commit. */
static void *uring_loop(void *arg) {
    int qid = (int)(intptr_t)arg;
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(qid, &set);
    sched_setaffinity(0, sizeof(set), &set);
    struct io_uring ring;
    struct io_uring_params p = {.flags = IORING_SETUP_SQE128 | IORING_SETUP_CQSIZE,
                                .cq_entries = DEPTH * 2};
    int rc = io_uring_queue_init_params(DEPTH, &ring, &p);
    if (rc != 0 || io_uring_register_files(&ring, &devfd, 1) != 0) {
        fprintf(stderr, "queue %d: io_uring setup failed: %s\n", qid, strerror(-rc));
        exit(3);
    }
    struct entry ents[DEPTH];
    for (int i = 0; i < DEPTH; i++) {
        ents[i].hdr = aligned_alloc(4096, 4096);
        ents[i].payload = aligned_alloc(4096, BUF_SIZE);
        memset(ents[i].hdr, 0, 4096);
        ents[i].iov[0] = (struct iovec){ents[i].hdr, sizeof(struct fuse_uring_header)};
        ents[i].iov[1] = (struct iovec){ents[i].payload, BUF_SIZE};
        prep(&ring, &ents[i], qid, FUSE_URING_CMD_REGISTER, 0);
    }
    for (;;) {
        rc = io_uring_submit_and_wait(&ring, 1);
        if (rc < 0 && rc != -EINTR) {
            fprintf(stderr, "queue %d: submit: %s\n", qid, strerror(-rc));
            exit(4);
        }
        struct io_uring_cqe *cqe;
        unsigned head, seen = 0;
        io_uring_for_each_cqe(&ring, head, cqe) {
            seen++;
            struct entry *e = io_uring_cqe_get_data(cqe);
            if (cqe->res != 0) {
                if (cqe->res == -ENOTCONN || cqe->res == -ENODEV)
                    exit(0);
                fprintf(stderr, "queue %d: cqe %d\n", qid, cqe->res);
                exit(5);
            }
            __atomic_add_fetch(&by_ring, 1, __ATOMIC_RELAXED);
            struct fuse_in_header in;
            memcpy(&in, e->hdr->in_out, sizeof(in));
            uint64_t commit = e->hdr->ent.commit_id;
            /* a LOOKUP's name is its payload (its op header is empty) */
            int32_t res = handle(&in, e->hdr->op_in, e->payload, e->payload);
            struct fuse_out_header h = {sizeof(h) + (res > 0 ? res : 0), res > 0 ? 0 : res,
                                        in.unique};
            memcpy(e->hdr->in_out, &h, sizeof(h));
            e->hdr->ent.payload_sz = res > 0 ? (uint32_t)res : 0;
            prep(&ring, e, qid, FUSE_URING_CMD_COMMIT_AND_FETCH, commit);
        }
        io_uring_cq_advance(&ring, seen);
    }
    return NULL;
}

int main(int argc, char **argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: fuse_transport_server dev|uring SRC MNT\n");
        return 2;
    }
    int uring = strcmp(argv[1], "uring") == 0;
    struct stat st;
    int root = open(argv[2], O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (root < 0 || fstat(root, &st) != 0) {
        perror(argv[2]);
        return 2;
    }
    signal(SIGTERM, on_term);
    add(0, "", &st, -1);
    walk(1, root);
    devfd = open("/dev/fuse", O_RDWR | O_CLOEXEC);
    char opts[128];
    snprintf(opts, sizeof(opts), "fd=%d,rootmode=40000,user_id=0,group_id=0,allow_other", devfd);
    if (devfd < 0 || mount("fanstore-bench", argv[3], "fuse.fanstore-bench", MS_NOSUID | MS_NODEV | MS_RDONLY, opts)) {
        perror("mount");
        return 2;
    }
    /* INIT comes by /dev/fuse in both modes; the rings may register only after its reply. */
    char *buf = malloc(BUF_SIZE);
    ssize_t n = read(devfd, buf, BUF_SIZE);
    const struct fuse_in_header *in = (void *)buf;
    const struct fuse_init_in *ii = (void *)(buf + sizeof(*in));
    if (n < (ssize_t)sizeof(*in) || in->opcode != FUSE_INIT) {
        fprintf(stderr, "no INIT\n");
        return 3;
    }
    struct fuse_init_out io = {.major = 7, .minor = ii->minor < 38 ? ii->minor : 38,
                               .max_readahead = ii->max_readahead,
                               .flags = (FUSE_ASYNC_READ | FUSE_MAX_PAGES | FUSE_INIT_EXT) & ii->flags,
                               .max_background = 12, .congestion_threshold = 9,
                               .max_write = MAX_PAYLOAD, .time_gran = 1, .max_pages = 256};
    if (uring) {
        if (!(ii->flags2 & FUSE_URING_OVER_IO_URING_FLAG2)) {
            fprintf(stderr, "the kernel does not offer FUSE over io_uring "
                            "(/sys/module/fuse/parameters/enable_uring)\n");
            return 3;
        }
        io.flags2 = FUSE_URING_OVER_IO_URING_FLAG2;
    }
    reply_dev(in->unique, sizeof(io), (char *)&io);
    fprintf(stderr, "fuse_transport_server: %s, %zu nodes, kernel 7.%u\n", argv[1], nnodes, ii->minor);
    if (uring) {
        int cpus = get_nprocs_conf();
        for (int q = 0; q < cpus; q++) {
            pthread_t t;
            pthread_create(&t, NULL, uring_loop, (void *)(intptr_t)q);
        }
    }
    dev_loop(NULL); /* FORGETs (and everything before the rings are ready) come this way */
    return 0;
}
