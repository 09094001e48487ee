/* stfs._native: the FUSE requests that carry the load, answered in C.
 *
 * mfusepy builds the fuse_operations table and runs the session; before libfuse gets the table,
 * install() puts the C functions below in front of the Python ones it holds (getattr, readdir, open,
 * release, statfs, read_buf, and always opendir, whose handle names the folder to readdir; releasedir and
 * flush too where Python has them, which stfs does not: libfuse answers those itself) and keeps the
 * Python ones to call for
 * everything C does not answer: a read of a file that is not one Range of a local source (bytes in
 * memory, Decoded pieces, any other segment kind), a source whose descriptor C does not hold, any
 * short or failed transfer, a source that no longer matches its pin (Python logs it and answers EIO),
 * a folder whose names C could not encode. C calls down into Python, never the other way round. Those
 * reads go to Python's reader, not to a ctypes callback: it says what the reply holds and C makes the
 * fuse_bufvec ("Python's replies" below), so no C structure is packed in Python.
 *
 * The tables are built once, before the session starts (build(), with the GIL), from the Python tree,
 * and are read-only afterwards, so the callbacks run without the GIL. Nodes are indexed by inode
 * (the tree hands them out densely from 1). Lookups walk the path a component at a time through one
 * hash table keyed by (parent inode, name). The one thing a request changes is a source's state: its
 * drop-behind runs (under its mutex) and its changed flag (atomic; once set, for good).
 *
 * One mount per process (the daemon): the state is global.
 */
#define PY_SSIZE_T_CLEAN
#define FUSE_USE_VERSION 31
#define _GNU_SOURCE
#include <Python.h>
#include <structmember.h>

#include <errno.h>
#include <fcntl.h>
#include <fuse.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/uio.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#define PAGE 4096
#define SPLICE_MIN (2 * PAGE) /* fuse_lowlevel.c: replies under two pages are copied, not spliced */
#define PIPE_SIZE (2 << 20)   /* a 1 MiB reply at an unaligned offset spans 257 pages: a slot each */
#define DROP_CHUNK (2 << 20)
#define MAX_RUNS 8
#define SMALL_RUN (64 << 10)

enum { ABSENT = 0, DIR_NATIVE, DIR_PYTHON, FILE_NATIVE, FILE_PYTHON, FILE_PIECES };

typedef struct {
    int64_t mtime_ns;
    uint64_t size;   /* a file's size; a folder's entry count */
    uint64_t offset; /* a native file's offset in its source; a folder's first entry in children; pieces: first block */
    uint32_t parent;
    uint32_t name;   /* offset in names, NUL-terminated */
    uint32_t source; /* a native file's source; pieces: how many blocks */
    uint8_t kind;
    uint8_t name_len;
    uint16_t readahead_kb; /* a file's own kernel readahead (stfs/readahead.py), 0: the mount's */
} node_t;

typedef struct {
    int64_t start, end;
} run_t;

/* A file of pieces (FILE_PIECES: a tensor gathered from chunks, a strided view, --view safetensors' files) is blocks
 * one after another, each `rows` rows of `row_bytes`, a row the concatenation of its parts: part p is `length` bytes
 * of its source from `first + row * stride` (stfs.formats.Rows). A block of no parts is bytes held in `held`. */
typedef struct {
    uint64_t start;     /* its first byte's offset in the file */
    uint64_t rows, row_bytes;
    uint64_t first;     /* its first part in parts; held bytes: their offset in held */
    uint32_t count;     /* parts; 0: held bytes (one row) */
} block_t;

typedef struct {
    uint64_t first, length, stride;
    uint32_t source;
} part_t;

typedef struct {
    int fd; /* our dup of the descriptor the source holds; -1: Python reads it (or, remote, the block cache) */
    int changed;
    int64_t size, mtime_ns;
    pthread_mutex_t lock;
    int nruns;
    run_t runs[MAX_RUNS + 1];
    uint64_t extent;  /* the end of the last byte C's files read of it */
    uint32_t *blocks; /* remote: block -> its published slot + 1, 0 none ("remote blocks" below) */
    uint64_t block_count;
} source_t;

/* A slot of the remote block cache as C may read it: published bytes, and the replies that use them. */
typedef struct {
    uint64_t range; /* published bytes: offsets in the block, (lo << 32) | hi, one atomic word */
    uint64_t owner; /* (source << 32) | block it is published for; NO_OWNER none */
    int pins;       /* replies of C's using its pages (until their thread's next read) */
} remote_slot_t;
#define NO_OWNER UINT64_MAX
#define MAX_PINS 32

typedef struct {
    int (*getattr)(const char *, struct stat *, struct fuse_file_info *);
    int (*open)(const char *, struct fuse_file_info *);
    int (*statfs)(const char *, struct statvfs *);
    int (*flush)(const char *, struct fuse_file_info *);
    int (*release)(const char *, struct fuse_file_info *);
    int (*opendir)(const char *, struct fuse_file_info *);
    int (*readdir)(const char *, void *, fuse_fill_dir_t, off_t, struct fuse_file_info *, enum fuse_readdir_flags);
    int (*releasedir)(const char *, struct fuse_file_info *);
    int (*read_buf)(const char *, struct fuse_bufvec **, size_t, off_t, struct fuse_file_info *);
} python_ops_t;

/* calls counted when stats are on, by the names stfs.stats uses for the Python callbacks */
enum {
    C_GETATTR,
    C_READDIR,
    C_OPENDIR,
    C_RELEASEDIR,
    C_OPEN,
    C_FLUSH,
    C_RELEASE,
    C_STATFS,
    C_READ_BUF,
    C_READ_CACHED,
    C_COUNT
};
static const char *call_names[C_COUNT] = {"getattr_fuse_3", "readdir_fuse_3", "opendir", "releasedir", "open",
                                          "flush", "release", "statfs", "read_buf", "read_buf_cached"};
#define SIZE_SLOTS 256

static struct {
    node_t *nodes;
    uint32_t node_count; /* highest inode + 1 */
    uint32_t *children;
    uint32_t *slots; /* the lookup hash: node indices, 0 empty */
    uint32_t slot_mask;
    char *names;
    size_t names_len, names_cap;
    source_t *sources;
    uint32_t source_count;
    uid_t uid;
    gid_t gid;
    int64_t drop_lag; /* 0: keep the source's pages */
    struct statvfs statfs;
    python_ops_t py;
    int installed;
    int stats;
    uint64_t calls[C_COUNT];
    uint64_t read_bytes;
    pthread_mutex_t size_lock;
    uint64_t sizes[SIZE_SLOTS][2]; /* (requested size + 1, count) */
    int cache_fd;                  /* remote: our dup of the block cache's memfd, -1 none */
    uint64_t slot_size;
    uint32_t remote_slot_count;
    remote_slot_t *remote_slots;
    block_t *blocks; /* of the files of pieces, each file's in order */
    uint64_t block_count, block_cap;
    part_t *parts;
    uint64_t part_count, part_cap;
    char *held;
    uint64_t held_len, held_cap;
    int readahead_fd;           /* our dup of the mount's read_ahead_kb setting, -1 none (not root) */
    unsigned readahead_default; /* KiB */
    unsigned readahead_now;     /* what the setting holds: written only when an open wants another */
} g = {.size_lock = PTHREAD_MUTEX_INITIALIZER, .cache_fd = -1, .readahead_fd = -1};

static void count(int call) {
    if (g.stats) __atomic_fetch_add(&g.calls[call], 1, __ATOMIC_RELAXED);
}

static void count_read(size_t requested, size_t served) {
    if (!g.stats) return;
    __atomic_fetch_add(&g.calls[C_READ_BUF], 1, __ATOMIC_RELAXED);
    __atomic_fetch_add(&g.read_bytes, served, __ATOMIC_RELAXED);
    pthread_mutex_lock(&g.size_lock);
    uint64_t key = (uint64_t)requested + 1;
    for (unsigned i = 0, slot = (unsigned)(requested / PAGE) % SIZE_SLOTS; i < SIZE_SLOTS;
         i++, slot = (slot + 1) % SIZE_SLOTS) {
        if (g.sizes[slot][0] == key || g.sizes[slot][0] == 0) {
            g.sizes[slot][0] = key;
            g.sizes[slot][1]++;
            break;
        }
    }
    pthread_mutex_unlock(&g.size_lock);
}

/* -- lookup ------------------------------------------------------------------------------------------- */

static uint32_t hash_name(uint32_t parent, const char *name, size_t len) {
    uint64_t h = 1469598103934665603ULL ^ parent;
    for (size_t i = 0; i < len; i++) h = (h ^ (unsigned char)name[i]) * 1099511628211ULL;
    h ^= h >> 29;
    return (uint32_t)h;
}

static uint32_t child(uint32_t parent, const char *name, size_t len) {
    if (len > 255) return 0;
    for (uint32_t slot = hash_name(parent, name, len) & g.slot_mask;; slot = (slot + 1) & g.slot_mask) {
        uint32_t index = g.slots[slot];
        if (index == 0) return 0;
        node_t *node = &g.nodes[index];
        if (node->parent == parent && node->name_len == len && memcmp(g.names + node->name, name, len) == 0)
            return index;
    }
}

/* The inode at absolute path (0: none). */
static uint32_t lookup(const char *path) {
    if (path == NULL || path[0] != '/') return 0;
    uint32_t index = 1;
    const char *component = path + 1;
    while (*component) {
        node_t *node = &g.nodes[index];
        if (node->kind != DIR_NATIVE && node->kind != DIR_PYTHON) return 0;
        const char *end = strchrnul(component, '/');
        index = child(index, component, (size_t)(end - component));
        if (index == 0) return 0;
        component = *end ? end + 1 : end;
    }
    return index;
}

static int is_dir(const node_t *node) { return node->kind == DIR_NATIVE || node->kind == DIR_PYTHON; }

static void fill_stat(uint32_t index, struct stat *st) {
    const node_t *node = &g.nodes[index];
    memset(st, 0, sizeof *st);
    if (is_dir(node)) {
        st->st_mode = S_IFDIR | 0555;
        st->st_nlink = 2;
    } else {
        st->st_mode = S_IFREG | 0444;
        st->st_nlink = 1;
        st->st_size = (off_t)node->size;
        st->st_blocks = (blkcnt_t)((node->size + 511) / 512); /* 512-byte units whatever the block size */
    }
    st->st_ino = index;
    st->st_blksize = PAGE;
    st->st_uid = g.uid;
    st->st_gid = g.gid;
    st->st_mtim.tv_sec = st->st_ctim.tv_sec = st->st_atim.tv_sec = node->mtime_ns / 1000000000;
    st->st_mtim.tv_nsec = st->st_ctim.tv_nsec = st->st_atim.tv_nsec = node->mtime_ns % 1000000000;
}

/* -- metadata requests -------------------------------------------------------------------------------- */

static int n_getattr(const char *path, struct stat *st, struct fuse_file_info *fi) {
    uint32_t index = path != NULL ? lookup(path) : (fi != NULL && fi->fh < g.node_count ? (uint32_t)fi->fh : 0);
    if (index == 0 || g.nodes[index].kind == ABSENT) return -ENOENT;
    count(C_GETATTR);
    fill_stat(index, st);
    return 0;
}

/* opendir keeps the folder's inode in the handle, which libfuse hands to readdir and releasedir: the one
 * lookup of the path a listing costs (unless Python opens folders itself, and so owns the handle). */
static int n_opendir(const char *path, struct fuse_file_info *fi) {
    uint32_t index = lookup(path);
    if (index == 0) return -ENOENT;
    if (!is_dir(&g.nodes[index])) return -ENOTDIR;
    if (g.py.opendir && g.nodes[index].kind == DIR_PYTHON) return g.py.opendir(path, fi);
    count(C_OPENDIR);
    fi->fh = index;
    return 0;
}

/* The folder a readdir or releasedir is about: by its handle where C opened it, else by its path (0: none). */
static uint32_t opened_folder(const char *path, const struct fuse_file_info *fi) {
    if (!g.py.opendir && fi != NULL && fi->fh > 0 && fi->fh < g.node_count && is_dir(&g.nodes[fi->fh]))
        return (uint32_t)fi->fh;
    return lookup(path);
}

static int n_releasedir(const char *path, struct fuse_file_info *fi) {
    if (g.py.releasedir) {
        uint32_t index = opened_folder(path, fi);
        if (index != 0 && g.nodes[index].kind == DIR_PYTHON) return g.py.releasedir(path, fi);
    }
    count(C_RELEASEDIR);
    return 0;
}

static int n_readdir(const char *path, void *buf, fuse_fill_dir_t filler, off_t offset, struct fuse_file_info *fi,
                     enum fuse_readdir_flags flags) {
    uint32_t index = opened_folder(path, fi);
    if (index == 0) return -ENOENT;
    const node_t *folder = &g.nodes[index];
    if (folder->kind == DIR_PYTHON) return g.py.readdir ? g.py.readdir(path, buf, filler, offset, fi, flags) : -EIO;
    if (!is_dir(folder)) return -ENOTDIR;
    count(C_READDIR);
    /* Entries carry offsets (the index + 1), so libfuse hands each to the kernel at once; a folder's entry is
     * flagged "plus" with its attributes, so walking into it costs no LOOKUP. "." and ".." are never looked up. */
    uint64_t total = folder->size + 2;
    struct stat st;
    for (uint64_t position = offset < 0 ? 0 : (uint64_t)offset; position < total; position++) {
        int full;
        if (position < 2) {
            uint32_t self = position == 0 ? index : folder->parent;
            memset(&st, 0, sizeof st);
            st.st_mode = S_IFDIR | 0555;
            st.st_ino = self;
            full = filler(buf, position == 0 ? "." : "..", &st, (off_t)position + 1, 0);
        } else {
            uint32_t entry = g.children[folder->offset + position - 2];
            const node_t *node = &g.nodes[entry];
            if (is_dir(node)) {
                fill_stat(entry, &st);
                full = filler(buf, g.names + node->name, &st, (off_t)position + 1, FUSE_FILL_DIR_PLUS);
            } else {
                memset(&st, 0, sizeof st);
                st.st_mode = S_IFREG | 0444;
                st.st_ino = entry;
                full = filler(buf, g.names + node->name, &st, (off_t)position + 1, 0);
            }
        }
        if (full) break;
    }
    return 0;
}

/* The kernel gives a file the mount's readahead as it stands when OPEN is answered: set the one this file
 * wants first (as stfs.readahead.Readahead.opened does). */
static void open_readahead(const node_t *node) {
    int fd = __atomic_load_n(&g.readahead_fd, __ATOMIC_ACQUIRE);
    if (fd < 0) return;
    unsigned fallback = __atomic_load_n(&g.readahead_default, __ATOMIC_RELAXED);
    unsigned want = node->readahead_kb && node->readahead_kb < fallback ? node->readahead_kb : fallback;
    if (__atomic_exchange_n(&g.readahead_now, want, __ATOMIC_ACQ_REL) == want) return;
    char text[16];
    int length = snprintf(text, sizeof text, "%u", want);
    if (pwrite(fd, text, (size_t)length, 0) < 0) return; /* a readahead not set is slower, never wrong */
}

static int n_open(const char *path, struct fuse_file_info *fi) {
    uint32_t index = lookup(path);
    if (index == 0) return -ENOENT;
    if ((fi->flags & O_ACCMODE) != O_RDONLY || (fi->flags & (O_TRUNC | O_APPEND))) return -EROFS;
    if (is_dir(&g.nodes[index])) return -EISDIR;
    open_readahead(&g.nodes[index]);
    count(C_OPEN);
    fi->fh = index; /* the inode, as the Python side answers */
    return 0;
}

static int n_flush(const char *path, struct fuse_file_info *fi) {
    (void)path;
    (void)fi;
    count(C_FLUSH);
    return 0;
}

static int n_release(const char *path, struct fuse_file_info *fi) {
    (void)path;
    (void)fi;
    count(C_RELEASE);
    return 0;
}

static int n_statfs(const char *path, struct statvfs *out) {
    (void)path;
    count(C_STATFS);
    *out = g.statfs;
    return 0;
}

/* -- reads -------------------------------------------------------------------------------------------- */

typedef struct {
    int read_fd, write_fd;
    size_t limit;
    int pinned_count;
    uint32_t pinned[MAX_PINS]; /* remote slots whose pages the last reply spliced from */
    char *scratch;             /* page-aligned, limit bytes: a reply of pieces copied here is lent to the pipe */
} pipe_t;

static pthread_key_t pipe_key;
static pthread_once_t pipe_once = PTHREAD_ONCE_INIT;

static void unpin(pipe_t *pipe);

static void pipe_free(void *value) {
    pipe_t *pipe = value;
    unpin(pipe);
    close(pipe->read_fd);
    close(pipe->write_fd);
    free(pipe->scratch);
    free(pipe);
}

static void pipe_key_make(void) { pthread_key_create(&pipe_key, pipe_free); }

static long pipe_max_size(void) {
    long size = 1 << 20;
    FILE *stream = fopen("/proc/sys/fs/pipe-max-size", "r");
    if (stream) {
        if (fscanf(stream, "%ld", &size) != 1) size = 1 << 20;
        fclose(stream);
    }
    return size;
}

/* This thread's pipe for splicing source pages to libfuse (NULL: none could be made). */
static pipe_t *thread_pipe(void) {
    pthread_once(&pipe_once, pipe_key_make);
    pipe_t *pipe = pthread_getspecific(pipe_key);
    if (pipe) return pipe;
    int fds[2];
    if (pipe2(fds, O_CLOEXEC | O_NONBLOCK) != 0) return NULL;
    if (fcntl(fds[1], F_SETPIPE_SZ, PIPE_SIZE) < 0) fcntl(fds[1], F_SETPIPE_SZ, (int)pipe_max_size());
    int capacity = fcntl(fds[1], F_GETPIPE_SZ);
    pipe = malloc(sizeof *pipe);
    if (!pipe || capacity < 0) {
        free(pipe);
        close(fds[0]);
        close(fds[1]);
        return NULL;
    }
    pipe->read_fd = fds[0];
    pipe->write_fd = fds[1];
    pipe->pinned_count = 0;
    pipe->scratch = NULL;
    /* splice takes a slot per page touched; libfuse's own pipe needs three pages and the header more */
    pipe->limit = capacity > 4 * PAGE ? (size_t)capacity - 4 * PAGE : 0;
    pthread_setspecific(pipe_key, pipe);
    pthread_setname_np(pthread_self(), "stfs-fuse"); /* a libfuse worker, as top -H and perf show it */
    return pipe;
}

static void pipe_drain(pipe_t *pipe) {
    char sink[1 << 14];
    while (read(pipe->read_fd, sink, sizeof sink) > 0) {
    }
}

static int pipe_empty(pipe_t *pipe) {
    int queued = 0;
    return ioctl(pipe->read_fd, FIONREAD, &queued) == 0 && queued == 0;
}

static void drop(int fd, int64_t start, int64_t end) {
    int64_t first = start - start % PAGE, last = (end + PAGE - 1) / PAGE * PAGE;
    posix_fadvise(fd, first, last - first, POSIX_FADV_DONTNEED); /* advice only */
}

/* stfs/sources/local.py LocalFiles._served, the same rule: [start, end) went to the mount's page cache; drop
 * the source's pages far enough behind each run of contiguous reads. Called with the source's lock held. */
static void served(source_t *source, int64_t start, int64_t end, int64_t lag) {
    run_t *runs = source->runs;
    for (int i = source->nruns - 1; i >= 0; i--) {
        if (runs[i].start - lag <= start && start <= runs[i].end) {
            if (start < runs[i].start) runs[i].start = start;
            if (end > runs[i].end) {
                runs[i].end = end;
                for (int j = 0; j < source->nruns;) { /* runs that now meet become one */
                    if (j != i && runs[j].start - lag <= runs[i].end && runs[i].start - lag <= runs[j].end) {
                        if (runs[j].start < runs[i].start) runs[i].start = runs[j].start;
                        if (runs[j].end > runs[i].end) runs[i].end = runs[j].end;
                        memmove(&runs[j], &runs[j + 1], (size_t)(source->nruns - j - 1) * sizeof *runs);
                        source->nruns--;
                        if (j < i) i--;
                    } else {
                        j++;
                    }
                }
            }
            int64_t cut = (runs[i].end - lag) / DROP_CHUNK * DROP_CHUNK;
            if (cut - runs[i].start >= DROP_CHUNK) {
                drop(source->fd, runs[i].start, cut);
                runs[i].start = cut;
            }
            return;
        }
    }
    if (end - start < SMALL_RUN) return;
    runs[source->nruns++] = (run_t){start, end};
    if (source->nruns > MAX_RUNS) {
        drop(source->fd, runs[0].start, runs[0].end);
        memmove(&runs[0], &runs[1], (size_t)(source->nruns - 1) * sizeof *runs);
        source->nruns--;
    }
}

static int reply(struct fuse_bufvec **bufp, size_t count, void *memory, int fd) {
    struct fuse_bufvec *vector = malloc(sizeof *vector);
    if (!vector) {
        free(memory);
        return -ENOMEM;
    }
    *vector = FUSE_BUFVEC_INIT(count);
    if (fd >= 0) {
        vector->buf[0].flags = FUSE_BUF_IS_FD;
        vector->buf[0].fd = fd;
    } else {
        vector->buf[0].mem = memory;
    }
    *bufp = vector; /* libfuse sends it, then frees it and any memory buffer (fuse.c fuse_free_buf) */
    return 0;
}

/* Whether the source still has the size and age it was pinned at; after the transfer, so a change before
 * or during the read fails it alike. */
static int unchanged(source_t *source) {
    struct stat st;
    if (fstat(source->fd, &st) != 0) return 0;
    int64_t mtime = (int64_t)st.st_mtim.tv_sec * 1000000000 + st.st_mtim.tv_nsec;
    if (st.st_size == source->size && mtime == source->mtime_ns) return 1;
    __atomic_store_n(&source->changed, 1, __ATOMIC_RELAXED); /* Python logs it, answers EIO, for good */
    return 0;
}

/* -- Python's replies --------------------------------------------------------------------------------- *
 * A read C does not answer goes to Python's reader (set by reader(), called with the GIL as
 * reader(path, fh, size, offset)), which answers with a negative errno or a list of the reply's pieces in
 * order: an int n, n bytes this thread's pipe holds (moved there by a source's splice_into into the pipe
 * pipe() names, or by lend()), or a bytes-like object, copied into the reply. C makes the fuse_bufvec:
 * Python never packs a C structure. */

static PyObject *py_reader; /* set before the session starts, read-only while it runs */

static void free_buffers(struct fuse_bufvec *vector, size_t used) {
    for (size_t i = 0; i < used; i++)
        if (!(vector->buf[i].flags & FUSE_BUF_IS_FD)) free(vector->buf[i].mem);
    free(vector);
}

/* The fuse_bufvec of pieces (a list, as above) in *bufp; 0, or a negative errno with nothing allocated. */
static int python_reply(PyObject *pieces, struct fuse_bufvec **bufp) {
    Py_ssize_t total = PyList_GET_SIZE(pieces);
    size_t count = 0;
    for (Py_ssize_t i = 0; i < total; i++) /* consecutive pipe pieces are one buffer */
        if (!PyLong_Check(PyList_GET_ITEM(pieces, i)) || i == 0 || !PyLong_Check(PyList_GET_ITEM(pieces, i - 1)))
            count++;
    struct fuse_bufvec *vector = calloc(1, sizeof *vector + (count ? count - 1 : 0) * sizeof(struct fuse_buf));
    if (!vector) return -ENOMEM;
    vector->count = count ? count : 1; /* an empty reply: one buffer of no bytes, as FUSE_BUFVEC_INIT(0) */
    vector->buf[0].fd = -1;
    pipe_t *pipe = NULL;
    size_t used = 0;
    for (Py_ssize_t i = 0; i < total; i++) {
        PyObject *piece = PyList_GET_ITEM(pieces, i);
        if (PyLong_Check(piece)) {
            Py_ssize_t size = PyLong_AsSsize_t(piece);
            if (size < 0 || (pipe == NULL && (pipe = thread_pipe()) == NULL)) goto fail;
            if (i > 0 && PyLong_Check(PyList_GET_ITEM(pieces, i - 1))) {
                vector->buf[used - 1].size += (size_t)size;
                continue;
            }
            vector->buf[used].flags = FUSE_BUF_IS_FD;
            vector->buf[used].fd = pipe->read_fd;
            vector->buf[used++].size = (size_t)size;
            continue;
        }
        Py_buffer view;
        if (PyObject_GetBuffer(piece, &view, PyBUF_SIMPLE) < 0) goto fail;
        void *memory = malloc(view.len ? (size_t)view.len : 1);
        if (memory) memcpy(memory, view.buf, (size_t)view.len);
        PyBuffer_Release(&view);
        if (!memory) {
            free_buffers(vector, used);
            return -ENOMEM;
        }
        vector->buf[used].mem = memory;
        vector->buf[used].fd = -1;
        vector->buf[used++].size = (size_t)view.len;
    }
    *bufp = vector; /* libfuse sends it, then frees it and every memory buffer (fuse.c fuse_free_buf) */
    return 0;
fail:
    if (PyErr_Occurred()) PyErr_WriteUnraisable(py_reader);
    free_buffers(vector, used);
    return -EIO;
}

/* A read answered by Python (the last resort of n_read_buf). */
static int python_read(const char *path, struct fuse_bufvec **bufp, size_t size, off_t offset,
                       struct fuse_file_info *fi) {
    if (py_reader == NULL) return -EIO;
    PyGILState_STATE gil = PyGILState_Ensure();
    int result = -EIO;
    PyObject *answer = PyObject_CallFunction(py_reader, "yKnL", path, (unsigned long long)(fi ? fi->fh : 0),
                                             (Py_ssize_t)size, (long long)offset);
    if (answer == NULL) {
        PyErr_WriteUnraisable(py_reader); /* the reader answers every Exception itself: SystemExit and the like */
    } else if (PyList_Check(answer)) {
        result = python_reply(answer, bufp);
    } else if (PyLong_Check(answer)) {
        long value = PyLong_AsLong(answer);
        result = value < 0 && value > -4096 ? (int)value : -EIO;
        PyErr_Clear();
    }
    Py_XDECREF(answer);
    PyGILState_Release(gil);
    if (result != 0) {
        pthread_once(&pipe_once, pipe_key_make);
        pipe_t *pipe = pthread_getspecific(pipe_key);
        if (pipe) pipe_drain(pipe); /* what a failed reply left there */
    }
    return result;
}

/* reader(callable or None): who answers the reads C does not; with one set, install() puts C's read_buf in the
 * table whether mfusepy has one or not. */
static PyObject *set_reader(PyObject *self, PyObject *reader) {
    (void)self;
    if (g.installed) {
        PyErr_SetString(PyExc_RuntimeError, "the session has started");
        return NULL;
    }
    if (reader != Py_None && !PyCallable_Check(reader)) {
        PyErr_SetString(PyExc_TypeError, "the reader must be callable");
        return NULL;
    }
    Py_XSETREF(py_reader, reader == Py_None ? NULL : Py_NewRef(reader));
    Py_RETURN_NONE;
}

/* pipe() -> (write_fd, limit): this thread's pipe, emptied, for a source's splice_into; limit: the most one reply
 * may put in it. */
static PyObject *py_pipe(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    pipe_t *pipe = thread_pipe();
    if (pipe == NULL) return PyErr_SetFromErrno(PyExc_OSError);
    if (!pipe_empty(pipe)) pipe_drain(pipe); /* left over from a reply that was not sent */
    return Py_BuildValue("(in)", pipe->write_fd, (Py_ssize_t)pipe->limit);
}

/* lend(buffer) -> count: vmsplice the buffer's bytes into this thread's pipe by reference (they must stay as they
 * are until the reply is sent); the count moved, -1 if the pipe is full. */
static PyObject *lend(PyObject *self, PyObject *buffer) {
    (void)self;
    pipe_t *pipe = thread_pipe();
    if (pipe == NULL) return PyErr_SetFromErrno(PyExc_OSError);
    Py_buffer view;
    if (PyObject_GetBuffer(buffer, &view, PyBUF_SIMPLE) < 0) return NULL;
    struct iovec iov = {.iov_base = view.buf, .iov_len = (size_t)view.len};
    ssize_t moved = vmsplice(pipe->write_fd, &iov, 1, 0);
    PyBuffer_Release(&view);
    return PyLong_FromSsize_t(moved);
}

/* -- remote blocks ------------------------------------------------------------------------------------ *
 * A remote source's fetched blocks sit in the slots of one memfd (stfs/sources/block_cache.py). Python
 * publishes a slot's filled bytes for its block once it has answered a read there itself, so its readahead
 * still sees the first read of every block (and of every tensor: what it publishes is clipped to the span it
 * read); C answers the reads inside published bytes by splicing from the memfd, as from a local file. Python
 * withdraws a slot before it reuses it, and reuses it only when no reply of C's pins it: a reply pins the slots
 * it spliced from until its thread's next read (libfuse has sent a thread's reply before it takes the thread's
 * next request; a pipe still holding pages then is emptied first). A reader pins, then looks again that the
 * block is still published there (Python withdraws, then looks at the pins: sequentially consistent, one of the
 * two sees the other). Bytes of a slot, once published, never change until it is withdrawn. */

static void unpin(pipe_t *pipe) {
    if (pipe->pinned_count == 0) return;
    if (g.remote_slots == NULL) { /* the tables are gone (a thread ending after the session): nothing to count */
        pipe->pinned_count = 0;
        return;
    }
    if (!pipe_empty(pipe)) pipe_drain(pipe); /* a reply libfuse gave up on still holds the pages */
    for (int i = 0; i < pipe->pinned_count; i++)
        __atomic_fetch_sub(&g.remote_slots[pipe->pinned[i]].pins, 1, __ATOMIC_SEQ_CST);
    pipe->pinned_count = 0;
}

/* The published slot holding byte position of source, pinned for this thread's reply, and the bytes published
 * there from position on (0: none; the caller unpins). */
static uint64_t pin_published(pipe_t *pipe, source_t *source, uint64_t position, loff_t *from) {
    uint64_t block = position / g.slot_size;
    if (block >= source->block_count) return 0;
    uint32_t entry = __atomic_load_n(&source->blocks[block], __ATOMIC_ACQUIRE);
    if (entry == 0 || entry > g.remote_slot_count) return 0;
    if (pipe->pinned_count == MAX_PINS) {
        int pinned = 0;
        for (int i = 0; i < pipe->pinned_count && !pinned; i++) pinned = pipe->pinned[i] == entry - 1;
        if (!pinned) return 0;
    }
    remote_slot_t *slot = &g.remote_slots[entry - 1];
    int pinned = 0; /* already, by an earlier part of this reply (a gathered tensor's rows) */
    for (int i = 0; i < pipe->pinned_count && !pinned; i++) pinned = pipe->pinned[i] == entry - 1;
    if (!pinned) {
        __atomic_fetch_add(&slot->pins, 1, __ATOMIC_SEQ_CST);
        pipe->pinned[pipe->pinned_count++] = entry - 1;
    }
    if (__atomic_load_n(&source->blocks[block], __ATOMIC_SEQ_CST) != entry) return 0; /* withdrawn meanwhile */
    uint64_t range = __atomic_load_n(&slot->range, __ATOMIC_ACQUIRE);
    uint64_t base = block * g.slot_size, lo = base + (range >> 32), hi = base + (range & 0xffffffffu);
    if (position < lo || position >= hi) return 0;
    *from = (loff_t)((uint64_t)(entry - 1) * g.slot_size + (position - base));
    return hi - position;
}

/* A read of a remote file answered from published slots: 0 with the reply in *bufp, 1 where Python answers. */
static int remote_read(source_t *source, uint64_t position, size_t length, size_t size, struct fuse_bufvec **bufp) {
    pipe_t *pipe = thread_pipe();
    if (pipe == NULL || length > pipe->limit) return 1;
    if (!pipe_empty(pipe)) pipe_drain(pipe);
    char *memory = length < SPLICE_MIN ? malloc(length) : NULL; /* libfuse copies replies this small anyway */
    if (length < SPLICE_MIN && memory == NULL) return 1;
    size_t done = 0;
    while (done < length) {
        loff_t from;
        uint64_t available = pin_published(pipe, source, position + done, &from);
        if (available == 0) break;
        size_t want = length - done < available ? length - done : (size_t)available, moved = 0;
        while (moved < want) {
            ssize_t got = memory ? pread(g.cache_fd, memory + done + moved, want - moved, from + (off_t)moved)
                                 : splice(g.cache_fd, &(loff_t){from + (loff_t)moved}, pipe->write_fd, NULL,
                                          want - moved, 0);
            if (got > 0)
                moved += (size_t)got;
            else if (!(got < 0 && errno == EINTR))
                break;
        }
        done += moved;
        if (moved < want) break;
    }
    if (done < length) {
        free(memory);
        unpin(pipe);
        return 1;
    }
    count_read(size, length);
    count(C_READ_CACHED); /* of those, the reads answered from the block cache */
    if (memory) {
        unpin(pipe); /* copied: nothing of the slot's is in the reply */
        return reply(bufp, length, memory, -1);
    }
    return reply(bufp, length, NULL, pipe->read_fd);
}

/* -- files of pieces ---------------------------------------------------------------------------------- *
 * A read of a file of pieces walks its blocks from the one holding the read's first byte, and moves each run of a
 * source's bytes (a part's row, or what of it the read wants) as a one-range file's are moved: spliced from the
 * source's descriptor (or, remote, from published slots of the block cache's memfd) into this thread's pipe, where
 * the runs are long; where they are short (a tensor sharded by narrow columns: a run per row and chunk), preadv'd
 * into this thread's scratch pages, which are lent to the pipe (vmsplice): one copy, with no interpreter held. A
 * source C does not read, not published, changed or short: Python answers the whole read. */

#define MAX_TOUCHED 64
#define SPLICE_RUN_DEFAULT (32 << 10) /* parts shorter than this are copied, not spliced (a pipe slot per page) */
static uint64_t splice_run = SPLICE_RUN_DEFAULT;

typedef struct {
    source_t *source;
    int64_t low, high; /* the bytes of it this reply read */
} touched_t;

/* The block of a file of pieces (its blocks from first, count of them) holding byte position. */
static const block_t *find_block(uint64_t first, uint32_t count, uint64_t position) {
    uint64_t lo = first, hi = first + count;
    while (hi - lo > 1) {
        uint64_t mid = lo + (hi - lo) / 2;
        if (g.blocks[mid].start <= position)
            lo = mid;
        else
            hi = mid;
    }
    return &g.blocks[lo];
}

/* Move length bytes of source index from position: spliced into the pipe, or (memory) copied there. 1: all moved;
 * 0: not (a source C does not read, changed, not published, short; a full pipe). */
static int move_run(pipe_t *pipe, uint32_t index, uint64_t position, size_t length, char *memory) {
    source_t *source = &g.sources[index];
    if (__atomic_load_n(&source->changed, __ATOMIC_RELAXED) || (source->fd < 0 && source->blocks == NULL)) return 0;
    size_t done = 0;
    while (done < length) {
        int fd = source->fd;
        loff_t from = (loff_t)(position + done);
        size_t want = length - done;
        if (source->blocks != NULL) {
            uint64_t available = pin_published(pipe, source, position + done, &from);
            if (available == 0) return 0;
            if (want > available) want = (size_t)available;
            fd = g.cache_fd;
        }
        ssize_t got = memory ? pread(fd, memory + done, want, from) : splice(fd, &from, pipe->write_fd, NULL, want, 0);
        if (got > 0)
            done += (size_t)got;
        else if (!(got < 0 && errno == EINTR))
            return 0;
    }
    return 1;
}

/* Held bytes into the pipe (or memory). */
static int move_held(pipe_t *pipe, const char *bytes, size_t length, char *memory) {
    if (memory) {
        memcpy(memory, bytes, length);
        return 1;
    }
    size_t done = 0;
    while (done < length) {
        ssize_t got = write(pipe->write_fd, bytes + done, length - done);
        if (got > 0)
            done += (size_t)got;
        else if (!(got < 0 && errno == EINTR))
            return 0;
    }
    return 1;
}

/* Whether a read of count bytes from block on is spliced: its parts are long (the rest of the read's blocks are
 * taken alike), and few enough for the pipe, where a run takes a slot per page it touches, one more than its length
 * in pages when it starts inside a page. */
static int splices(const block_t *block, size_t count, const pipe_t *pipe) {
    uint64_t shortest = UINT64_MAX;
    for (uint32_t i = 0; i < block->count; i++)
        if (g.parts[block->first + i].length < shortest) shortest = g.parts[block->first + i].length;
    if (shortest < splice_run) return 0;
    if (splice_run <= 1) return 1; /* STFS_SPLICE_RUN=1 (the tests): every read spliced, the full pipe's fallback too */
    uint64_t runs = block->count ? count / shortest + 2 : 2;
    return (count + PAGE - 1) / PAGE + runs <= pipe->limit / PAGE + 4; /* limit: the pipe less four pages */
}

/* Copies of a reply's runs of local sources, gathered: the runs of one source that follow one another there (a
 * chunk's rows, each beside another chunk's in the reply) are one preadv, an iovec a run. */
#define BATCH_SOURCES 8
#define BATCH_RUNS 128
typedef struct {
    int fd;
    uint64_t start, next;
    int count;
    size_t bytes;
    struct iovec iov[BATCH_RUNS];
} batch_t;

static int batch_flush(batch_t *batch) {
    if (batch->count == 0) return 1;
    size_t done = 0;
    int first = 0;
    while (done < batch->bytes) { /* short only at the end of the file (a truncated source) or on a signal */
        ssize_t got = preadv(batch->fd, batch->iov + first, batch->count - first, (off_t)(batch->start + done));
        if (got <= 0) {
            if (got < 0 && errno == EINTR) continue;
            return 0;
        }
        done += (size_t)got;
        while (first < batch->count && (size_t)got >= batch->iov[first].iov_len)
            got -= (ssize_t)batch->iov[first++].iov_len;
        if (first < batch->count) {
            batch->iov[first].iov_base = (char *)batch->iov[first].iov_base + got;
            batch->iov[first].iov_len -= (size_t)got;
        }
    }
    batch->count = 0;
    batch->bytes = 0;
    return 1;
}

/* Copy length bytes of the local source at fd from position to memory, as part of batches. */
static int batch_add(batch_t *batches, int *nbatches, int fd, uint64_t position, size_t length, char *memory) {
    batch_t *batch = NULL;
    for (int i = 0; i < *nbatches && batch == NULL; i++)
        if (batches[i].fd == fd) batch = &batches[i];
    if (batch == NULL) {
        if (*nbatches == BATCH_SOURCES) {
            for (int i = 0; i < *nbatches; i++)
                if (!batch_flush(&batches[i])) return 0;
            *nbatches = 0;
        }
        batch = &batches[(*nbatches)++];
        batch->fd = fd;
        batch->count = 0;
        batch->bytes = 0;
    }
    if (batch->count && (batch->next != position || batch->count == BATCH_RUNS) && !batch_flush(batch)) return 0;
    if (batch->count == 0) batch->start = batch->next = position;
    batch->iov[batch->count++] = (struct iovec){.iov_base = memory, .iov_len = length};
    batch->bytes += length;
    batch->next += length;
    return 1;
}

/* count bytes of a file of pieces from offset into *bufp (memory: copied there; else spliced into the pipe). 1: the
 * reply is made; 0: not (its runs are left in the pipe or memory for the caller to drop). */
static int pieces_move(pipe_t *pipe, const node_t *node, uint64_t offset, size_t count, char *memory) {
    touched_t touched[MAX_TOUCHED];
    int ntouched = 0;
    batch_t batches[BATCH_SOURCES];
    int nbatches = 0;
    const block_t *block = find_block(node->offset, node->source, offset);
    uint64_t within = offset - block->start, row = 0;
    uint32_t part = 0;
    if (block->count) {
        row = within / block->row_bytes;
        within -= row * block->row_bytes;
        while (within >= g.parts[block->first + part].length) within -= g.parts[block->first + part++].length;
    }
    size_t done = 0;
    while (done < count) {
        size_t take = count - done;
        if (block->count == 0) {
            if (take > block->row_bytes - within) take = (size_t)(block->row_bytes - within);
            if (!move_held(pipe, g.held + block->first + within, take, memory ? memory + done : NULL)) return 0;
            within += take;
            if (within == block->row_bytes) {
                block++;
                within = 0;
            }
        } else {
            const part_t *p = &g.parts[block->first + part];
            if (take > p->length - within) take = (size_t)(p->length - within);
            uint64_t at = p->first + row * p->stride + within;
            source_t *source = &g.sources[p->source];
            if (memory && source->fd >= 0 && !__atomic_load_n(&source->changed, __ATOMIC_RELAXED)) {
                if (!batch_add(batches, &nbatches, source->fd, at, take, memory + done)) return 0;
            } else if (!move_run(pipe, p->source, at, take, memory ? memory + done : NULL)) {
                return 0;
            }
            if (source->fd >= 0) { /* local: checked against its pin, and its pages dropped behind, once a reply */
                int i = 0;
                while (i < ntouched && touched[i].source != source) i++;
                if (i == ntouched) {
                    if (ntouched == MAX_TOUCHED) return 0;
                    touched[ntouched++] = (touched_t){source, (int64_t)at, (int64_t)(at + take)};
                } else {
                    if ((int64_t)at < touched[i].low) touched[i].low = (int64_t)at;
                    if ((int64_t)(at + take) > touched[i].high) touched[i].high = (int64_t)(at + take);
                }
            }
            within += take;
            if (within == p->length) {
                within = 0;
                if (++part == block->count) {
                    part = 0;
                    if (++row == block->rows) {
                        row = 0;
                        block++;
                    }
                }
            }
        }
        done += take;
    }
    for (int i = 0; i < nbatches; i++)
        if (!batch_flush(&batches[i])) return 0;
    for (int i = 0; i < ntouched; i++)
        if (!unchanged(touched[i].source)) return 0;
    if (g.drop_lag)
        for (int i = 0; i < ntouched; i++) {
            if (touched[i].high - touched[i].low < SMALL_RUN) continue;
            pthread_mutex_lock(&touched[i].source->lock);
            served(touched[i].source, touched[i].low, touched[i].high, g.drop_lag);
            pthread_mutex_unlock(&touched[i].source->lock);
        }
    return 1;
}

/* Counted: a read of a file of pieces answered, and of those from the block cache (its first block's first part is
 * remote: a mount's sources are all local or all remote). */
static void count_pieces(const node_t *node, size_t size, size_t served) {
    count_read(size, served);
    const block_t *block = &g.blocks[node->offset];
    if (block->count && g.sources[g.parts[block->first].source].blocks != NULL) count(C_READ_CACHED);
}

/* A read of a file of pieces: 0 with the reply in *bufp, 1 where Python answers. */
static int pieces_read(const node_t *node, uint64_t offset, size_t count, size_t size, struct fuse_bufvec **bufp) {
    pipe_t *pipe = thread_pipe();
    if (pipe == NULL || count > pipe->limit) return 1;
    if (!pipe_empty(pipe)) pipe_drain(pipe);
    int spliced = count >= SPLICE_MIN && splices(find_block(node->offset, node->source, offset), count, pipe);
    if (spliced) {
        if (pieces_move(pipe, node, offset, count, NULL)) {
            count_pieces(node, size, count);
            return reply(bufp, count, NULL, pipe->read_fd);
        }
        pipe_drain(pipe); /* a full pipe (short runs take a slot a page), or a failure: copied, or Python's */
        unpin(pipe);
    }
    if (count < SPLICE_MIN) {
        char *memory = malloc(count);
        if (memory == NULL) return 1;
        int moved = pieces_move(pipe, node, offset, count, memory);
        unpin(pipe); /* copied: nothing of a slot's is in the reply */
        if (!moved) {
            free(memory);
            return 1;
        }
        count_pieces(node, size, count);
        return reply(bufp, count, memory, -1);
    }
    if (pipe->scratch == NULL && (pipe->scratch = aligned_alloc(PAGE, (pipe->limit + PAGE - 1) / PAGE * PAGE)) == NULL)
        return 1;
    int moved = pieces_move(pipe, node, offset, count, pipe->scratch);
    unpin(pipe);
    if (!moved) return 1;
    /* lent: libfuse has sent a thread's reply before it takes the thread's next request, which may write here */
    size_t lent = 0;
    while (lent < count) {
        struct iovec iov = {.iov_base = pipe->scratch + lent, .iov_len = count - lent};
        ssize_t got = vmsplice(pipe->write_fd, &iov, 1, 0);
        if (got > 0)
            lent += (size_t)got;
        else if (!(got < 0 && errno == EINTR)) {
            pipe_drain(pipe);
            return 1;
        }
    }
    count_pieces(node, size, count);
    return reply(bufp, count, NULL, pipe->read_fd);
}

static int n_read_buf(const char *path, struct fuse_bufvec **bufp, size_t size, off_t offset,
                      struct fuse_file_info *fi) {
    uint64_t index = fi != NULL ? fi->fh : 0;
    const node_t *node = index > 0 && index < g.node_count ? &g.nodes[index] : NULL;
    source_t *source = node != NULL && node->kind == FILE_NATIVE ? &g.sources[node->source] : NULL;
    if (g.remote_slots != NULL) { /* the last reply of this thread's has been sent: its pages are free */
        pthread_once(&pipe_once, pipe_key_make);
        pipe_t *own = pthread_getspecific(pipe_key);
        if (own != NULL) unpin(own);
    }
    if (node != NULL && node->kind == FILE_PIECES && offset >= 0) {
        size_t count = (uint64_t)offset >= node->size ? 0 : node->size - (uint64_t)offset;
        if (count > size) count = size;
        if (count == 0) {
            count_read(size, 0);
            return reply(bufp, 0, NULL, -1);
        }
        if (pieces_read(node, (uint64_t)offset, count, size, bufp) == 0) return 0;
        goto python;
    }
    if (source == NULL || __atomic_load_n(&source->changed, __ATOMIC_RELAXED) || offset < 0) goto python;
    if (source->fd < 0 && source->blocks == NULL) goto python;
    size_t count = (uint64_t)offset >= node->size ? 0 : node->size - (uint64_t)offset;
    if (count > size) count = size;
    if (count == 0) {
        count_read(size, 0);
        return reply(bufp, 0, NULL, -1);
    }
    if (source->blocks != NULL) {
        if (remote_read(source, node->offset + (uint64_t)offset, count, size, bufp) == 0) return 0;
        goto python;
    }
    off_t position = (off_t)(node->offset + (uint64_t)offset);
    pipe_t *pipe = count >= SPLICE_MIN ? thread_pipe() : NULL;
    if (pipe != NULL && count <= pipe->limit) {
        if (!pipe_empty(pipe)) pipe_drain(pipe); /* left over from a reply libfuse gave up on */
        size_t done = 0;
        while (done < count) {
            loff_t from = position + (off_t)done;
            ssize_t moved = splice(source->fd, &from, pipe->write_fd, NULL, count - done, 0);
            if (moved > 0) {
                done += (size_t)moved;
            } else if (moved < 0 && errno == EINTR) {
                continue;
            } else {
                break; /* full pipe, end of file (truncated), error: Python reads it and says why */
            }
        }
        if (done == count && unchanged(source)) {
            if (g.drop_lag) {
                pthread_mutex_lock(&source->lock);
                served(source, position, position + (off_t)count, g.drop_lag);
                pthread_mutex_unlock(&source->lock);
            }
            count_read(size, count);
            return reply(bufp, count, NULL, pipe->read_fd);
        }
        pipe_drain(pipe);
        goto python;
    }
    char *memory = malloc(count);
    if (memory == NULL) return -ENOMEM;
    size_t done = 0;
    while (done < count) {
        ssize_t got = pread(source->fd, memory + done, count - done, position + (off_t)done);
        if (got > 0) {
            done += (size_t)got;
        } else if (got < 0 && errno == EINTR) {
            continue;
        } else {
            break;
        }
    }
    if (done == count && unchanged(source)) {
        if (g.drop_lag && count >= SMALL_RUN) { /* shorter reads never start a run: skip the lock */
            pthread_mutex_lock(&source->lock);
            served(source, position, position + (off_t)count, g.drop_lag);
            pthread_mutex_unlock(&source->lock);
        }
        count_read(size, count);
        return reply(bufp, count, memory, -1);
    }
    free(memory);
python:
    return python_read(path, bufp, size, offset, fi);
}

/* -- the Python side ---------------------------------------------------------------------------------- */

static void release_tables(void) {
    for (uint32_t i = 0; i < g.source_count; i++) {
        source_t *source = &g.sources[i];
        if (source->fd >= 0) {
            for (int r = 0; r < source->nruns; r++) drop(source->fd, source->runs[r].start, source->runs[r].end);
            close(source->fd);
        }
        pthread_mutex_destroy(&source->lock);
        free(source->blocks);
    }
    free(g.remote_slots);
    g.remote_slots = NULL;
    g.remote_slot_count = 0;
    if (g.cache_fd >= 0) close(g.cache_fd);
    g.cache_fd = -1;
    free(g.blocks);
    free(g.parts);
    free(g.held);
    g.blocks = NULL;
    g.parts = NULL;
    g.held = NULL;
    g.block_count = g.block_cap = g.part_count = g.part_cap = g.held_len = g.held_cap = 0;
    free(g.nodes);
    free(g.children);
    free(g.slots);
    free(g.names);
    free(g.sources);
    g.nodes = NULL;
    g.children = g.slots = NULL;
    g.names = NULL;
    g.sources = NULL;
    g.node_count = g.source_count = 0;
    g.names_len = g.names_cap = 0;
}

static int add_name(const char *name, size_t len) {
    if (g.names_len + len + 1 > g.names_cap) {
        size_t capacity = g.names_cap ? g.names_cap * 2 : 1 << 16;
        while (capacity < g.names_len + len + 1) capacity *= 2;
        char *grown = realloc(g.names, capacity);
        if (!grown) return -1;
        g.names = grown;
        g.names_cap = capacity;
    }
    memcpy(g.names + g.names_len, name, len);
    g.names[g.names_len + len] = '\0';
    return 0;
}

/* Where the __slots__ member name of type keeps its value in an instance (-1: not a plain slot). The tree's
 * classes are slotted: reading the slot at its offset is a tenth of PyObject_GetAttr, and build() reads five
 * for each of hundreds of thousands of nodes. */
static Py_ssize_t slot_offset(PyObject *type, PyObject *name) {
    PyObject *descriptor = PyObject_GetAttr(type, name);
    Py_ssize_t offset = -1;
    if (descriptor == NULL) {
        PyErr_Clear();
        return -1;
    }
    if (Py_IS_TYPE(descriptor, &PyMemberDescr_Type)) {
        PyMemberDef *member = ((PyMemberDescrObject *)descriptor)->d_member;
        if (member->type == T_OBJECT_EX && !(member->flags & READONLY)) offset = member->offset;
    }
    Py_DECREF(descriptor);
    return offset;
}

/* A new reference to object.name: from its slot at offset, or by attribute lookup. */
static PyObject *get(PyObject *object, Py_ssize_t offset, PyObject *name) {
    if (offset < 0) return PyObject_GetAttr(object, name);
    PyObject *value = *(PyObject **)((char *)object + offset);
    if (value == NULL) {
        PyErr_Format(PyExc_AttributeError, "%S has no value for %S", Py_TYPE(object), name);
        return NULL;
    }
    Py_INCREF(value);
    return value;
}

static int get_int64(PyObject *object, Py_ssize_t offset, PyObject *name, int64_t *out) {
    PyObject *value = get(object, offset, name);
    if (!value) return -1;
    long long number = PyLong_AsLongLong(value);
    Py_DECREF(value);
    if (number == -1 && PyErr_Occurred()) return -1;
    *out = number;
    return 0;
}

/* The index of the source key in keys (added, and to key_index, if new); -1 with an exception. */
static long source_index(PyObject *key, PyObject *keys, PyObject *key_index) {
    if (!PyUnicode_Check(key)) {
        PyErr_SetString(PyExc_TypeError, "a source key is not a str");
        return -1;
    }
    PyObject *known = PyDict_GetItemWithError(key_index, key);
    if (known) return PyLong_AsLong(known);
    if (PyErr_Occurred()) return -1;
    PyObject *number = PyLong_FromSsize_t(PyList_GET_SIZE(keys));
    int ok = number && PyDict_SetItem(key_index, key, number) == 0 && PyList_Append(keys, key) == 0;
    Py_XDECREF(number);
    return ok ? (long)(PyList_GET_SIZE(keys) - 1) : -1;
}

static int grow(void **array, uint64_t *cap, uint64_t need, size_t item) {
    if (need <= *cap) return 0;
    uint64_t capacity = *cap ? *cap : 1024;
    while (capacity < need) capacity *= 2;
    void *grown = realloc(*array, capacity * item);
    if (!grown) {
        PyErr_NoMemory();
        return -1;
    }
    *array = grown;
    *cap = capacity;
    return 0;
}

/* The blocks lower(file) gave (a sequence of bytes, or of (rows, parts), parts a tuple of (source key, first,
 * length, stride)) into the tables, the node then a file of pieces: 1; 0 if they do not hold its size (Python reads
 * it); -1 with an exception. */
static int add_pieces(node_t *node, PyObject *lowered, PyObject *keys, PyObject *key_index) {
    PyObject *sequence = PySequence_Fast(lowered, "lower() gives a sequence of blocks");
    if (!sequence) return -1;
    uint64_t blocks_before = g.block_count, parts_before = g.part_count, held_before = g.held_len, total = 0;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(sequence);
    int result = 1;
    for (Py_ssize_t i = 0; i < n && result == 1; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(sequence, i);
        block_t block = {.start = total};
        if (PyBytes_Check(item)) {
            uint64_t length = (uint64_t)PyBytes_GET_SIZE(item);
            if (length == 0) continue;
            if (grow((void **)&g.held, &g.held_cap, g.held_len + length, 1) < 0) goto fail;
            memcpy(g.held + g.held_len, PyBytes_AS_STRING(item), length);
            block.first = g.held_len;
            block.rows = 1;
            block.row_bytes = length;
            g.held_len += length;
        } else {
            unsigned long long rows;
            PyObject *parts;
            if (!PyArg_ParseTuple(item, "KO!", &rows, &PyTuple_Type, &parts)) goto fail;
            Py_ssize_t count = PyTuple_GET_SIZE(parts);
            if (count == 0 || count > UINT32_MAX || rows == 0) {
                result = 0;
                break;
            }
            if (grow((void **)&g.parts, &g.part_cap, g.part_count + (uint64_t)count, sizeof *g.parts) < 0) goto fail;
            block.first = g.part_count;
            block.count = (uint32_t)count;
            block.rows = rows;
            for (Py_ssize_t j = 0; j < count; j++) {
                PyObject *key;
                unsigned long long first, length, stride;
                if (!PyArg_ParseTuple(PyTuple_GET_ITEM(parts, j), "OKKK", &key, &first, &length, &stride)) goto fail;
                long index = source_index(key, keys, key_index);
                if (index < 0) goto fail;
                if (length == 0) {
                    result = 0;
                    break;
                }
                g.parts[g.part_count++] = (part_t){.first = first, .length = length, .stride = stride,
                                                   .source = (uint32_t)index};
                block.row_bytes += length;
            }
        }
        if (grow((void **)&g.blocks, &g.block_cap, g.block_count + 1, sizeof *g.blocks) < 0) goto fail;
        g.blocks[g.block_count++] = block;
        total += block.rows * block.row_bytes;
    }
    Py_DECREF(sequence);
    if (result == 1 && total == node->size && total > 0 && g.block_count - blocks_before <= UINT32_MAX) {
        node->offset = blocks_before;
        node->source = (uint32_t)(g.block_count - blocks_before);
        node->kind = FILE_PIECES;
        return 1;
    }
    g.block_count = blocks_before;
    g.part_count = parts_before;
    g.held_len = held_before;
    return 0;
fail:
    Py_DECREF(sequence);
    g.block_count = blocks_before;
    g.part_count = parts_before;
    g.held_len = held_before;
    return -1;
}

static PyObject *s_inode, *s_mtime_ns, *s_size, *s_children, *s_stored, *s_key, *s_offset, *s_start, *s_tensor,
    *s_begin;

/* build(root, dir_type, file_type, range_type, inodes, spliceable[, shard_type[, lower]]) -> ([source key, ...],
 * C's files, Python's)
 *
 * The tables for the tree under root (inodes: the highest inode + 1). A file of one segment of exactly
 * range_type, or given a shard_type (its tensor's Range made from it), with spliceable true, is C's (its source
 * gets an index, in the returned list's order); so is a file of other segments that lower(file) gives as blocks of
 * pieces (add_pieces); every other file is Python's. */
static PyObject *build(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *root, *dir_type, *file_type, *range_type, *shard_type = Py_None, *lower = Py_None;
    unsigned long long inodes;
    int spliceable;
    if (!PyArg_ParseTuple(args, "OOOOKp|OO", &root, &dir_type, &file_type, &range_type, &inodes, &spliceable,
                          &shard_type, &lower))
        return NULL;
    const char *run = getenv("STFS_SPLICE_RUN"); /* parts shorter than this are copied (benchmarks compare) */
    splice_run = run && *run ? strtoull(run, NULL, 10) : SPLICE_RUN_DEFAULT;
    if (g.installed) {
        PyErr_SetString(PyExc_RuntimeError, "the tables are in use by a session");
        return NULL;
    }
    release_tables();
    if (inodes < 2 || inodes > UINT32_MAX / 4) {
        PyErr_SetString(PyExc_ValueError, "inode count out of range");
        return NULL;
    }
    PyObject *keys = PyList_New(0), *key_index = PyDict_New(), *queue = PyList_New(0), *name_offsets = PyDict_New();
    if (!keys || !key_index || !queue || !name_offsets) goto fail;
    g.node_count = (uint32_t)inodes;
    g.nodes = calloc(inodes, sizeof *g.nodes);
    g.children = calloc(inodes, sizeof *g.children);
    uint32_t slots = 1024;
    while (slots < inodes * 2) slots *= 2;
    g.slots = calloc(slots, sizeof *g.slots);
    g.slot_mask = slots - 1;
    if (!g.nodes || !g.children || !g.slots || add_name("", 0) < 0) {
        PyErr_NoMemory();
        goto fail;
    }
    g.names_len = 1;
    Py_ssize_t dir_inode = slot_offset(dir_type, s_inode), dir_mtime = slot_offset(dir_type, s_mtime_ns),
               dir_children = slot_offset(dir_type, s_children), file_inode = slot_offset(file_type, s_inode),
               file_mtime = slot_offset(file_type, s_mtime_ns), file_size = slot_offset(file_type, s_size),
               file_stored = slot_offset(file_type, s_stored), file_tensor = slot_offset(file_type, s_tensor),
               range_key = slot_offset(range_type, s_key), range_offset = slot_offset(range_type, s_offset),
               shard_key = shard_type == Py_None ? -1 : slot_offset(shard_type, s_key),
               shard_start = shard_type == Py_None ? -1 : slot_offset(shard_type, s_start), tensor_begin = -2;
    if ((PyObject *)Py_TYPE(root) != dir_type) {
        PyErr_SetString(PyExc_TypeError, "the root is not a folder");
        goto fail;
    }
    int64_t value;
    if (get_int64(root, dir_inode, s_inode, &value) < 0) goto fail;
    if (value != 1) {
        PyErr_SetString(PyExc_ValueError, "the root is not inode 1");
        goto fail;
    }
    if (get_int64(root, dir_mtime, s_mtime_ns, &g.nodes[1].mtime_ns) < 0) goto fail;
    g.nodes[1].parent = 1;
    g.nodes[1].kind = DIR_NATIVE;
    if (PyList_Append(queue, root) < 0) goto fail;
    uint64_t filled = 0; /* entries of children used */
    unsigned long long native_files = 0, python_files = 0;
    for (Py_ssize_t next = 0; next < PyList_GET_SIZE(queue); next++) {
        PyObject *folder = PyList_GET_ITEM(queue, next);
        int64_t folder_inode;
        if (get_int64(folder, dir_inode, s_inode, &folder_inode) < 0) goto fail;
        node_t *parent = &g.nodes[folder_inode];
        PyObject *entries = get(folder, dir_children, s_children);
        if (!entries) goto fail;
        if (!PyDict_Check(entries)) {
            Py_DECREF(entries);
            PyErr_SetString(PyExc_TypeError, "a folder's children are not a dict");
            goto fail;
        }
        parent->offset = filled;
        parent->size = (uint64_t)PyDict_GET_SIZE(entries);
        if (filled + parent->size > inodes) {
            Py_DECREF(entries);
            PyErr_SetString(PyExc_ValueError, "more entries than inodes");
            goto fail;
        }
        Py_ssize_t position = 0;
        PyObject *name, *entry;
        while (PyDict_Next(entries, &position, &name, &entry)) {
            int is_folder = (PyObject *)Py_TYPE(entry) == dir_type;
            if (!is_folder && (PyObject *)Py_TYPE(entry) != file_type) {
                Py_DECREF(entries);
                PyErr_SetString(PyExc_TypeError, "an entry is neither a folder nor a file");
                goto fail;
            }
            int64_t inode;
            if (get_int64(entry, is_folder ? dir_inode : file_inode, s_inode, &inode) < 0) {
                Py_DECREF(entries);
                goto fail;
            }
            if (inode < 2 || (uint64_t)inode >= inodes || g.nodes[inode].kind != ABSENT) {
                Py_DECREF(entries);
                PyErr_Format(PyExc_ValueError, "inode %lld is out of range or in two places", (long long)inode);
                goto fail;
            }
            node_t *node = &g.nodes[inode];
            g.children[filled++] = (uint32_t)inode;
            node->parent = (uint32_t)folder_inode;
            if (get_int64(entry, is_folder ? dir_mtime : file_mtime, s_mtime_ns, &node->mtime_ns) < 0) {
                Py_DECREF(entries);
                goto fail;
            }
            PyObject *encoded = NULL; /* names kept as str are encoded as mfusepy decodes paths */
            const char *bytes = NULL;
            Py_ssize_t len = 0;
            if (PyUnicode_Check(name) && PyUnicode_IS_COMPACT_ASCII(name)) {
                bytes = PyUnicode_DATA(name); /* ASCII is its own UTF-8 */
                len = PyUnicode_GET_LENGTH(name);
            } else if (PyUnicode_Check(name) &&
                       (encoded = PyUnicode_AsEncodedString(name, "utf-8", "surrogateescape")) != NULL) {
                bytes = PyBytes_AS_STRING(encoded);
                len = PyBytes_GET_SIZE(encoded);
            }
            if (bytes && len > 0 && len <= 255 && !memchr(bytes, '/', (size_t)len) && !memchr(bytes, '\0', (size_t)len)) {
                node->name_len = (uint8_t)len;
                /* each name once: "weight" or "12" stand in many folders (one interned str) */
                PyObject *known = PyDict_GetItemWithError(name_offsets, name);
                if (known) {
                    node->name = (uint32_t)PyLong_AsUnsignedLong(known);
                } else {
                    PyObject *offset = PyErr_Occurred() ? NULL : PyLong_FromSize_t(g.names_len);
                    if (!offset || PyDict_SetItem(name_offsets, name, offset) < 0) {
                        Py_XDECREF(offset);
                        Py_XDECREF(encoded);
                        Py_DECREF(entries);
                        goto fail;
                    }
                    Py_DECREF(offset);
                    node->name = (uint32_t)g.names_len;
                    if (g.names_len + (size_t)len + 1 > UINT32_MAX || add_name(bytes, (size_t)len) < 0) {
                        Py_XDECREF(encoded);
                        Py_DECREF(entries);
                        PyErr_NoMemory();
                        goto fail;
                    }
                    g.names_len += (size_t)len + 1;
                }
                uint32_t slot = hash_name((uint32_t)folder_inode, bytes, (size_t)len) & g.slot_mask;
                while (g.slots[slot]) slot = (slot + 1) & g.slot_mask;
                g.slots[slot] = (uint32_t)inode;
            } else { /* a name the kernel can never ask for: Python lists this folder, as it always has */
                PyErr_Clear();
                parent->kind = DIR_PYTHON;
                node->name = 0;
                node->name_len = 0;
            }
            Py_XDECREF(encoded);
            if (is_folder) {
                if (node->kind == ABSENT) node->kind = DIR_NATIVE; /* not if it lists a name C cannot keep */
                if (PyList_Append(queue, entry) < 0) {
                    Py_DECREF(entries);
                    goto fail;
                }
                continue;
            }
            int64_t size;
            if (get_int64(entry, file_size, s_size, &size) < 0) {
                Py_DECREF(entries);
                goto fail;
            }
            node->size = (uint64_t)size;
            node->kind = FILE_PYTHON;
            /* the one Range of a local source C reads: a tensor's file given its shard's data (its Range made
             * from the shard's start and its tensor's begin, as its segments property does), or a file of one
             * Range segment */
            PyObject *segments = get(entry, file_stored, s_stored);
            if (!segments) {
                Py_DECREF(entries);
                goto fail;
            }
            PyObject *key = NULL;
            int64_t offset = -1;
            int candidate = 0;
            if (spliceable && shard_type != Py_None && (PyObject *)Py_TYPE(segments) == shard_type) {
                int64_t start, begin;
                PyObject *tensor = get(entry, file_tensor, s_tensor);
                if (tensor != NULL && tensor_begin == -2) tensor_begin = slot_offset((PyObject *)Py_TYPE(tensor), s_begin);
                candidate = tensor != NULL && get_int64(segments, shard_start, s_start, &start) == 0 &&
                            get_int64(tensor, tensor_begin, s_begin, &begin) == 0 &&
                            (key = get(segments, shard_key, s_key)) != NULL;
                if (candidate) offset = start + begin;
                Py_XDECREF(tensor);
            } else if (spliceable && PyTuple_Check(segments) && PyTuple_GET_SIZE(segments) == 1 &&
                       (PyObject *)Py_TYPE(PyTuple_GET_ITEM(segments, 0)) == range_type) {
                PyObject *segment = PyTuple_GET_ITEM(segments, 0);
                candidate = (key = get(segment, range_key, s_key)) != NULL &&
                            get_int64(segment, range_offset, s_offset, &offset) == 0;
            }
            if (candidate) {
                int ok = PyUnicode_Check(key) && offset >= 0;
                if (ok) {
                    PyObject *known = PyDict_GetItemWithError(key_index, key);
                    if (known) {
                        node->source = (uint32_t)PyLong_AsUnsignedLong(known);
                    } else if (!PyErr_Occurred()) {
                        PyObject *number = PyLong_FromSsize_t(PyList_GET_SIZE(keys));
                        ok = number && PyDict_SetItem(key_index, key, number) == 0 && PyList_Append(keys, key) == 0;
                        node->source = (uint32_t)(PyList_GET_SIZE(keys) - 1);
                        Py_XDECREF(number);
                    } else {
                        ok = 0;
                    }
                }
                if (ok) {
                    node->offset = (uint64_t)offset;
                    node->kind = FILE_NATIVE;
                }
            }
            Py_XDECREF(key);
            if (!PyErr_Occurred() && !candidate && spliceable && lower != Py_None && PyTuple_Check(segments) &&
                size > 0) {
                PyObject *lowered = PyObject_CallOneArg(lower, entry);
                if (lowered != NULL && lowered != Py_None) add_pieces(node, lowered, keys, key_index);
                Py_XDECREF(lowered);
            }
            if (PyErr_Occurred()) {
                Py_DECREF(segments);
                Py_DECREF(entries);
                goto fail;
            }
            Py_DECREF(segments);
            if (node->kind == FILE_NATIVE || node->kind == FILE_PIECES)
                native_files++;
            else
                python_files++;
        }
        Py_DECREF(entries);
    }
    g.source_count = (uint32_t)PyList_GET_SIZE(keys);
    g.sources = calloc(g.source_count ? g.source_count : 1, sizeof *g.sources);
    if (!g.sources) {
        PyErr_NoMemory();
        goto fail;
    }
    for (uint32_t i = 0; i < g.source_count; i++) {
        g.sources[i].fd = -1;
        pthread_mutex_init(&g.sources[i].lock, NULL);
    }
    for (uint32_t i = 1; i < g.node_count; i++) { /* how far C's files read into each source */
        const node_t *node = &g.nodes[i];
        if (node->kind == FILE_NATIVE && node->offset + node->size > g.sources[node->source].extent)
            g.sources[node->source].extent = node->offset + node->size;
    }
    for (uint64_t b = 0; b < g.block_count; b++) {
        const block_t *block = &g.blocks[b];
        for (uint32_t j = 0; j < block->count; j++) {
            const part_t *part = &g.parts[block->first + j];
            uint64_t end = part->first + (block->rows - 1) * part->stride + part->length;
            if (end > g.sources[part->source].extent) g.sources[part->source].extent = end;
        }
    }
    Py_DECREF(key_index);
    Py_DECREF(queue);
    Py_DECREF(name_offsets);
    return Py_BuildValue("(NKK)", keys, native_files, python_files);
fail:
    Py_XDECREF(keys);
    Py_XDECREF(key_index);
    Py_XDECREF(queue);
    Py_XDECREF(name_offsets);
    release_tables();
    return NULL;
}

/* set_source(index, fd, size, mtime_ns): C reads source index from its own duplicate of fd, pinned there. */
static PyObject *set_source(PyObject *self, PyObject *args) {
    (void)self;
    unsigned int index;
    int fd;
    long long size, mtime_ns;
    if (!PyArg_ParseTuple(args, "IiLL", &index, &fd, &size, &mtime_ns)) return NULL;
    if (index >= g.source_count || g.installed) {
        PyErr_SetString(PyExc_ValueError, "no such source, or the session has started");
        return NULL;
    }
    int copy = fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (copy < 0) return PyErr_SetFromErrno(PyExc_OSError);
    source_t *source = &g.sources[index];
    if (source->fd >= 0) close(source->fd);
    source->fd = copy;
    source->size = size;
    source->mtime_ns = mtime_ns;
    source->changed = 0;
    Py_RETURN_NONE;
}

/* blocks(fd, slot_size, slot_count): the sources C does not read from a descriptor are remote, their fetched
 * blocks in slot_count slots of slot_size bytes of the memfd fd; C answers reads of what Python publishes there. */
static PyObject *share_blocks(PyObject *self, PyObject *args) {
    (void)self;
    int fd;
    unsigned long long slot_size;
    unsigned int slot_count;
    if (!PyArg_ParseTuple(args, "iKI", &fd, &slot_size, &slot_count)) return NULL;
    if (g.installed || g.nodes == NULL || g.remote_slots != NULL || slot_size < PAGE || slot_size > UINT32_MAX ||
        slot_count == 0) {
        PyErr_SetString(PyExc_ValueError, "build() first, once, before the session, with a slot size of 32 bits");
        return NULL;
    }
    g.remote_slots = calloc(slot_count, sizeof *g.remote_slots);
    if (g.remote_slots == NULL) return PyErr_NoMemory();
    for (uint32_t i = 0; i < slot_count; i++) g.remote_slots[i].owner = NO_OWNER;
    g.remote_slot_count = slot_count;
    g.slot_size = slot_size;
    for (uint32_t i = 0; i < g.source_count; i++) {
        source_t *source = &g.sources[i];
        if (source->fd >= 0) continue;
        source->block_count = (source->extent + slot_size - 1) / slot_size;
        source->blocks = calloc(source->block_count ? source->block_count : 1, sizeof *source->blocks);
        if (source->blocks == NULL) return PyErr_NoMemory(); /* close() frees what was made */
    }
    g.cache_fd = fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (g.cache_fd < 0) return PyErr_SetFromErrno(PyExc_OSError);
    Py_RETURN_NONE;
}

/* publish(slot, source, block, lo, hi): the slot's bytes [lo, hi) of the source (file offsets, in the block)
 * hold the source's bytes and will not change until withdraw(slot); C may answer reads of them. */
static PyObject *publish(PyObject *self, PyObject *args) {
    (void)self;
    unsigned int slot, index;
    unsigned long long block, lo, hi;
    if (!PyArg_ParseTuple(args, "IIKKK", &slot, &index, &block, &lo, &hi)) return NULL;
    if (slot >= g.remote_slot_count || index >= g.source_count || g.sources[index].blocks == NULL ||
        block >= g.sources[index].block_count)
        Py_RETURN_NONE; /* a block past what C's files read: Python answers it */
    uint64_t base = block * g.slot_size;
    if (lo < base || hi > base + g.slot_size || lo >= hi) {
        PyErr_SetString(PyExc_ValueError, "the range is not in the block");
        return NULL;
    }
    remote_slot_t *target = &g.remote_slots[slot];
    uint64_t owner = ((uint64_t)index << 32) | block;
    uint64_t previous = __atomic_load_n(&target->owner, __ATOMIC_RELAXED);
    if (previous != owner && previous != NO_OWNER) {
        PyErr_SetString(PyExc_ValueError, "the slot is published for another block: withdraw it first");
        return NULL;
    }
    __atomic_store_n(&target->owner, owner, __ATOMIC_RELAXED);
    __atomic_store_n(&target->range, ((lo - base) << 32) | (hi - base), __ATOMIC_RELEASE);
    __atomic_store_n(&g.sources[index].blocks[block], slot + 1, __ATOMIC_SEQ_CST);
    Py_RETURN_NONE;
}

/* withdraw(slot) -> whether it is free: C answers no more reads from it, and no reply of C's holds its pages
 * (if one does, it stays withdrawn: ask again later). */
static PyObject *withdraw(PyObject *self, PyObject *args) {
    (void)self;
    unsigned int slot;
    if (!PyArg_ParseTuple(args, "I", &slot)) return NULL;
    if (slot >= g.remote_slot_count) Py_RETURN_TRUE;
    remote_slot_t *target = &g.remote_slots[slot];
    uint64_t owner = __atomic_load_n(&target->owner, __ATOMIC_RELAXED);
    if (owner != NO_OWNER) {
        uint32_t expected = slot + 1;
        source_t *source = &g.sources[owner >> 32];
        __atomic_compare_exchange_n(&source->blocks[owner & 0xffffffffu], &expected, 0, 0, __ATOMIC_SEQ_CST,
                                    __ATOMIC_SEQ_CST);
        __atomic_store_n(&target->owner, NO_OWNER, __ATOMIC_RELAXED);
    }
    return PyBool_FromLong(__atomic_load_n(&target->pins, __ATOMIC_SEQ_CST) == 0);
}

/* changed(source): the source no longer holds its pinned version: C answers none of its reads (Python: EIO). */
static PyObject *mark_changed(PyObject *self, PyObject *args) {
    (void)self;
    unsigned int index;
    if (!PyArg_ParseTuple(args, "I", &index)) return NULL;
    if (index < g.source_count) __atomic_store_n(&g.sources[index].changed, 1, __ATOMIC_SEQ_CST);
    Py_RETURN_NONE;
}

/* configure(uid, gid, drop_lag, (f_bsize, f_frsize, f_blocks, f_files, f_namemax), stats) */
static PyObject *configure(PyObject *self, PyObject *args) {
    (void)self;
    unsigned int uid, gid;
    long long drop_lag;
    unsigned long bsize, frsize, namemax;
    unsigned long long blocks, files;
    int stats;
    if (!PyArg_ParseTuple(args, "IIL(kkKKk)p", &uid, &gid, &drop_lag, &bsize, &frsize, &blocks, &files, &namemax,
                          &stats))
        return NULL;
    g.uid = uid;
    g.gid = gid;
    g.drop_lag = drop_lag;
    memset(&g.statfs, 0, sizeof g.statfs);
    g.statfs.f_bsize = bsize;
    g.statfs.f_frsize = frsize;
    g.statfs.f_blocks = blocks;
    g.statfs.f_files = files;
    g.statfs.f_namemax = namemax;
    g.stats = stats;
    Py_RETURN_NONE;
}

#define OPS_FIELDS(X) X(getattr) X(open) X(statfs) X(flush) X(release) X(opendir) X(readdir) X(releasedir) X(read_buf)

/* install(address, size): put the C callbacks in the struct fuse_operations at address (mfusepy's, before it
 * calls fuse_main_real), keeping the Python ones it holds to call for the rest. */
static PyObject *install(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long address;
    Py_ssize_t size;
    if (!PyArg_ParseTuple(args, "Kn", &address, &size)) return NULL;
    if (g.nodes == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "build() first");
        return NULL;
    }
    if (address == 0 || (size_t)size < offsetof(struct fuse_operations, read_buf) + sizeof(void *)) {
        PyErr_SetString(PyExc_ValueError, "not a struct fuse_operations this module knows");
        return NULL;
    }
    struct fuse_operations *ops = (struct fuse_operations *)(uintptr_t)address;
#define SAVE(name) g.py.name = ops->name;
    OPS_FIELDS(SAVE)
#undef SAVE
    /* Only where Python answers today: libfuse answers a missing releasedir itself, and a missing flush once
     * (ENOSYS), after which the kernel sends no more; opendir is C's whatever Python has (below). */
#define REPLACE(name)                                                                                               \
    if (ops->name) ops->name = n_##name;
    OPS_FIELDS(REPLACE)
#undef REPLACE
    if (py_reader) ops->read_buf = n_read_buf; /* Python's reads come back through python_read */
    ops->opendir = n_opendir;                  /* always: the handle it sets spares readdir a lookup */
    g.installed = 1;
    Py_RETURN_NONE;
}

/* windows({inode: KiB}): files with a kernel readahead of their own, set as each is opened */
static PyObject *set_windows(PyObject *self, PyObject *windows) {
    (void)self;
    PyObject *key, *value;
    Py_ssize_t position = 0;
    if (g.nodes == NULL || !PyDict_Check(windows)) {
        PyErr_SetString(PyExc_RuntimeError, "build() first, then a dict");
        return NULL;
    }
    while (PyDict_Next(windows, &position, &key, &value)) {
        unsigned long inode = PyLong_AsUnsignedLong(key), kb = PyLong_AsUnsignedLong(value);
        if (PyErr_Occurred()) return NULL;
        if (inode < g.node_count && !is_dir(&g.nodes[inode])) g.nodes[inode].readahead_kb = kb > 0xffff ? 0 : kb;
    }
    Py_RETURN_NONE;
}

/* set_readahead(fd, default_kb): the mount's read_ahead_kb setting, open for writing, and the mount's value */
static PyObject *set_readahead(PyObject *self, PyObject *args) {
    (void)self;
    int fd;
    unsigned int fallback;
    if (!PyArg_ParseTuple(args, "iI", &fd, &fallback)) return NULL;
    int own = fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (own < 0) return PyErr_SetFromErrno(PyExc_OSError);
    __atomic_store_n(&g.readahead_default, fallback, __ATOMIC_RELAXED);
    __atomic_store_n(&g.readahead_now, fallback, __ATOMIC_RELAXED);
    int old = __atomic_exchange_n(&g.readahead_fd, own, __ATOMIC_ACQ_REL);
    if (old >= 0) close(old);
    Py_RETURN_NONE;
}

/* close(): after the session, close the duplicates (dropping what drop-behind still follows), free the tables. */
static PyObject *close_tables(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    g.installed = 0;
    int readahead = __atomic_exchange_n(&g.readahead_fd, -1, __ATOMIC_ACQ_REL);
    if (readahead >= 0) close(readahead);
    release_tables();
    memset(&g.py, 0, sizeof g.py);
    Py_RETURN_NONE;
}

/* counts() -> (calls, read_sizes, read_bytes): what the C callbacks answered (counted with stats on). */
static PyObject *counts(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    PyObject *calls = PyDict_New(), *sizes = PyDict_New();
    if (!calls || !sizes) goto fail;
    for (int i = 0; i < C_COUNT; i++) {
        uint64_t number = __atomic_load_n(&g.calls[i], __ATOMIC_RELAXED);
        if (number == 0) continue;
        PyObject *value = PyLong_FromUnsignedLongLong(number);
        if (!value || PyDict_SetItemString(calls, call_names[i], value) < 0) {
            Py_XDECREF(value);
            goto fail;
        }
        Py_DECREF(value);
    }
    pthread_mutex_lock(&g.size_lock);
    for (int slot = 0; slot < SIZE_SLOTS; slot++) {
        if (g.sizes[slot][0] == 0) continue;
        PyObject *key = PyLong_FromUnsignedLongLong(g.sizes[slot][0] - 1);
        PyObject *value = PyLong_FromUnsignedLongLong(g.sizes[slot][1]);
        int failed = !key || !value || PyDict_SetItem(sizes, key, value) < 0;
        Py_XDECREF(key);
        Py_XDECREF(value);
        if (failed) {
            pthread_mutex_unlock(&g.size_lock);
            goto fail;
        }
    }
    pthread_mutex_unlock(&g.size_lock);
    return Py_BuildValue("(NNK)", calls, sizes, (unsigned long long)__atomic_load_n(&g.read_bytes, __ATOMIC_RELAXED));
fail:
    Py_XDECREF(calls);
    Py_XDECREF(sizes);
    return NULL;
}

/* lookup(path bytes) -> inode or 0 (for the tests) */
static PyObject *py_lookup(PyObject *self, PyObject *args) {
    (void)self;
    const char *path;
    if (!PyArg_ParseTuple(args, "y", &path)) return NULL;
    if (g.nodes == NULL) return PyLong_FromLong(0);
    return PyLong_FromUnsignedLong(lookup(path));
}

/* layout() -> {name: (offset, size)}: where this module writes in struct fuse_operations and what it packs, for
 * tests/test_libfuse_layout.py to compare with mfusepy's ctypes structures. */
static PyObject *layout(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    return Py_BuildValue(
        "{s(nn)s(nn)s(nn)s(nn)s(nn)s(nn)s(nn)s(nn)s(nn)s(nn)s(nn)s(nn)}", "getattr",
        offsetof(struct fuse_operations, getattr), sizeof(void *), "open", offsetof(struct fuse_operations, open),
        sizeof(void *), "statfs", offsetof(struct fuse_operations, statfs), sizeof(void *), "flush",
        offsetof(struct fuse_operations, flush), sizeof(void *), "release",
        offsetof(struct fuse_operations, release), sizeof(void *), "opendir",
        offsetof(struct fuse_operations, opendir), sizeof(void *), "readdir",
        offsetof(struct fuse_operations, readdir), sizeof(void *), "releasedir",
        offsetof(struct fuse_operations, releasedir), sizeof(void *), "read_buf",
        offsetof(struct fuse_operations, read_buf), sizeof(void *), "fuse_operations",
        (Py_ssize_t)0, sizeof(struct fuse_operations), "fuse_file_info.fh", offsetof(struct fuse_file_info, fh),
        sizeof(((struct fuse_file_info *)0)->fh), "stat", (Py_ssize_t)0, sizeof(struct stat));
}

static PyMethodDef methods[] = {
    {"build", build, METH_VARARGS,
     "build(root, dir_type, file_type, range_type, inodes, spliceable[, shard_type[, lower]]) -> source keys"},
    {"set_source", set_source, METH_VARARGS, "set_source(index, fd, size, mtime_ns): C reads it from a dup of fd"},
    {"configure", configure, METH_VARARGS, "configure(uid, gid, drop_lag, statfs, stats)"},
    {"share_blocks", share_blocks, METH_VARARGS, "share_blocks(fd, slot_size, slot_count): remote blocks in a memfd"},
    {"publish", publish, METH_VARARGS, "publish(slot, source, block, lo, hi): C may answer reads of those bytes"},
    {"withdraw", withdraw, METH_VARARGS, "withdraw(slot) -> free: C reads the slot no more; no reply holds it"},
    {"changed", mark_changed, METH_VARARGS, "changed(source): C answers none of its reads"},
    {"windows", set_windows, METH_O, "windows({inode: KiB}): files with a readahead of their own"},
    {"set_readahead", set_readahead, METH_VARARGS, "set_readahead(fd, default_kb): C sets it as files open"},
    {"install", install, METH_VARARGS, "install(address, size): C callbacks into a struct fuse_operations"},
    {"close", close_tables, METH_NOARGS, "close(): after the session, close descriptors and free the tables"},
    {"counts", counts, METH_NOARGS, "counts() -> (calls, read_sizes, read_bytes) answered in C"},
    {"lookup", py_lookup, METH_VARARGS, "lookup(path) -> inode, 0 if none"},
    {"layout", layout, METH_NOARGS, "layout() -> {name: (offset, size)} of what this module writes"},
    {"reader", set_reader, METH_O, "reader(callable or None): answers the reads C does not, in pieces"},
    {"pipe", py_pipe, METH_NOARGS, "pipe() -> (write_fd, limit): this thread's pipe, empty, for splice_into"},
    {"lend", lend, METH_O, "lend(buffer) -> count: vmsplice the buffer into this thread's pipe"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "stfs._native", "FUSE requests answered in C.", -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__native(void) {
#define INTERN(name)                                                                                                \
    if (!(s_##name = PyUnicode_InternFromString(#name))) return NULL;
    INTERN(inode) INTERN(mtime_ns) INTERN(size) INTERN(children) INTERN(stored) INTERN(key) INTERN(offset) INTERN(start)
        INTERN(tensor) INTERN(begin)
#undef INTERN
    return PyModule_Create(&module);
}
