/*
 * A minimal C libfuse3 server for benchmarks/bench.py to compare stfs against on the same machine:
 * it serves one read-only file, /big, holding SIZE bytes of SOURCE at OFFSET, with the
 * high-level API's plain read callback (pread into libfuse's buffer, as a typical C server does).
 *
 *     cref SOURCE OFFSET SIZE MOUNTPOINT [libfuse options...]
 *
 * With SIZE 0 and SOURCE "list:FILE" it serves the tree FILE lists instead (to time `find` over the very
 * tree an stfs mount shows): one line per entry, "d\t0\tPATH" or "f\tSIZE\tPATH", folders before what they
 * hold and each folder's entries together (benchmarks/bench.py writes it from stfs's own tree). It answers as a
 * minimal C server of that tree would, the way stfs's C side does: getattr by a hash lookup of each path
 * component, readdir with offsets, folders as READDIRPLUS entries with their attributes (CREF_PLUS=all: files
 * too; CREF_PLUS=none: no entry, so each folder costs a LOOKUP).
 *
 * libfuse3's development headers are often missing, so the few declarations needed are
 * written out here for the libfuse 3.x ABI (struct fuse_operations has not changed order).
 * Build: gcc -O2 -o cref cref.c -l:libfuse3.so.3
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

typedef int (*fuse_fill_dir_t)(void *buf, const char *name, const struct stat *st, off_t off, int flags);
#define FUSE_FILL_DIR_PLUS (1 << 1)

struct fuse_file_info; /* only passed through */

/* the head of libfuse 3's struct fuse_config, as far as use_ino */
struct fuse_config_head {
    int set_gid;
    unsigned int gid;
    int set_uid;
    unsigned int uid;
    int set_mode;
    unsigned int umask;
    double entry_timeout, negative_timeout, attr_timeout;
    int intr, intr_signal, remember, hard_remove, use_ino;
};

struct fuse_operations {
    int (*getattr)(const char *, struct stat *, struct fuse_file_info *);
    void *readlink, *mknod, *mkdir, *unlink, *rmdir, *symlink, *rename, *link, *chmod, *chown, *truncate;
    int (*open)(const char *, struct fuse_file_info *);
    int (*read)(const char *, char *, size_t, off_t, struct fuse_file_info *);
    void *write, *statfs, *flush, *release, *fsync, *setxattr, *getxattr, *listxattr, *removexattr, *opendir;
    int (*readdir)(const char *, void *, fuse_fill_dir_t, off_t, struct fuse_file_info *, int);
    void *releasedir, *fsyncdir;
    void *(*init)(void *conn, struct fuse_config_head *cfg);
    void *destroy, *access, *create, *lock, *utimens, *bmap, *ioctl, *poll,
        *write_buf, *read_buf, *flock, *fallocate, *copy_file_range, *lseek;
};

int fuse_main_real(int argc, char *argv[], const struct fuse_operations *op, size_t op_size, void *private_data);

static int source_fd;
static off_t source_offset;
static off_t file_size;

/* list mode: entries in listing order, entry 0 the root; inode = index + 1 */
typedef struct {
    const char *name;
    uint32_t parent, first, count; /* a folder's entries: first .. first + count - 1 */
    uint16_t name_len;
    uint8_t is_dir;
    off_t size;
} entry_t;

static entry_t *entries;
static uint32_t entry_count;
static uint32_t *slots, slot_mask; /* (parent, name) -> index + 1 */
static int plus_mode = 1;          /* 0: none, 1: folders, 2: all */

static uint32_t hash_name(uint32_t parent, const char *name, size_t len) {
    uint64_t h = 1469598103934665603ULL ^ parent;
    for (size_t i = 0; i < len; i++)
        h = (h ^ (unsigned char)name[i]) * 1099511628211ULL;
    h ^= h >> 29;
    return (uint32_t)h;
}

static uint32_t find_child(uint32_t parent, const char *name, size_t len) { /* index + 1, 0: none */
    for (uint32_t slot = hash_name(parent, name, len) & slot_mask;; slot = (slot + 1) & slot_mask) {
        uint32_t found = slots[slot];
        if (found == 0)
            return 0;
        entry_t *e = &entries[found - 1];
        if (e->parent == parent && e->name_len == len && memcmp(e->name, name, len) == 0)
            return found;
    }
}

static long list_lookup(const char *path) { /* index, -1: none */
    if (path[0] != '/')
        return -1;
    uint32_t index = 0;
    const char *component = path + 1;
    while (*component) {
        if (!entries[index].is_dir)
            return -1;
        const char *end = strchrnul(component, '/');
        uint32_t found = find_child(index, component, (size_t)(end - component));
        if (found == 0)
            return -1;
        index = found - 1;
        component = *end ? end + 1 : end;
    }
    return index;
}

static void list_stat(uint32_t index, struct stat *st) {
    memset(st, 0, sizeof(*st));
    entry_t *e = &entries[index];
    st->st_ino = index + 1;
    st->st_uid = getuid();
    st->st_gid = getgid();
    st->st_blksize = 4096;
    if (e->is_dir) {
        st->st_mode = S_IFDIR | 0555;
        st->st_nlink = 2;
    } else {
        st->st_mode = S_IFREG | 0444;
        st->st_nlink = 1;
        st->st_size = e->size;
        st->st_blocks = (e->size + 511) / 512;
    }
}

static int load_list(const char *file) {
    FILE *stream = fopen(file, "r");
    if (!stream)
        return -1;
    size_t cap = 1024;
    char **lines = malloc(cap * sizeof(char *));
    char *line = NULL;
    size_t line_cap = 0;
    ssize_t got;
    while ((got = getline(&line, &line_cap, stream)) > 0) {
        if (line[got - 1] == '\n')
            line[got - 1] = '\0';
        if (entry_count == cap)
            lines = realloc(lines, (cap *= 2) * sizeof(char *));
        lines[entry_count++] = strdup(line);
    }
    free(line);
    fclose(stream);
    if (entry_count == 0)
        return -1;
    for (slot_mask = 1; slot_mask < 2 * entry_count; slot_mask <<= 1) {
    }
    slots = calloc(slot_mask, sizeof(*slots));
    slot_mask--;
    entries = calloc(entry_count, sizeof(*entries));
    for (uint32_t index = 0; index < entry_count; index++) {
        char *size_text = strchr(lines[index], '\t'), *path = size_text ? strchr(size_text + 1, '\t') : NULL;
        if (!path || path[1] != '/')
            return -1;
        path++;
        entry_t *e = &entries[index];
        e->is_dir = lines[index][0] == 'd';
        e->size = strtoll(size_text + 1, NULL, 10);
        if (index == 0) { /* the root, "/" */
            e->name = "";
            continue;
        }
        char *slash = strrchr(path, '/');
        e->name = slash + 1;
        e->name_len = (uint16_t)strlen(e->name);
        *slash = '\0';
        long parent = list_lookup(slash == path ? "/" : path);
        *slash = '/';
        if (parent < 0 || !entries[parent].is_dir)
            return -1;
        entry_t *folder = &entries[parent];
        if (folder->count == 0)
            folder->first = index;
        else if (folder->first + folder->count != index)
            return -1; /* a folder's entries must come together */
        folder->count++;
        e->parent = (uint32_t)parent;
        uint32_t slot = hash_name((uint32_t)parent, e->name, e->name_len) & slot_mask;
        while (slots[slot])
            slot = (slot + 1) & slot_mask;
        slots[slot] = index + 1;
    }
    return 0;
}

static void *list_init(void *conn, struct fuse_config_head *cfg) {
    (void)conn;
    cfg->use_ino = 1; /* as stfs (mfusepy sets it in the config): inodes are the server's */
    return NULL;
}

static int cref_getattr(const char *path, struct stat *st, struct fuse_file_info *fi) {
    (void)fi;
    memset(st, 0, sizeof(*st));
    if (strcmp(path, "/") == 0 && !entries) {
        st->st_mode = S_IFDIR | 0555;
        st->st_nlink = 2;
        return 0;
    }
    if (entries) {
        long index = list_lookup(path);
        if (index < 0)
            return -ENOENT;
        list_stat((uint32_t)index, st);
        return 0;
    }
    if (strcmp(path, "/big") == 0) {
        st->st_mode = S_IFREG | 0444;
        st->st_nlink = 1;
        st->st_size = file_size;
        st->st_blocks = (file_size + 511) / 512;
        return 0;
    }
    return -ENOENT;
}

static int cref_open(const char *path, struct fuse_file_info *fi) {
    (void)fi;
    return strcmp(path, "/big") == 0 ? 0 : -ENOENT;
}

static int cref_read(const char *path, char *buf, size_t size, off_t offset, struct fuse_file_info *fi) {
    (void)path;
    (void)fi;
    if (offset >= file_size)
        return 0;
    if ((off_t)size > file_size - offset)
        size = file_size - offset;
    size_t done = 0;
    while (done < size) {
        ssize_t count = pread(source_fd, buf + done, size - done, source_offset + offset + done);
        if (count <= 0)
            return -EIO;
        done += count;
    }
    return done;
}

static int list_readdir(const char *path, void *buf, fuse_fill_dir_t filler, off_t off) {
    long index = list_lookup(path);
    if (index < 0)
        return -ENOENT;
    entry_t *folder = &entries[index];
    if (!folder->is_dir)
        return -ENOTDIR;
    struct stat st;
    /* entries carry offsets (position + 1): libfuse hands each to the kernel as it comes */
    for (off_t position = off; position < (off_t)folder->count + 2; position++) {
        int full;
        if (position < 2) {
            memset(&st, 0, sizeof(st));
            st.st_mode = S_IFDIR;
            st.st_ino = position == 0 ? (uint32_t)index + 1 : folder->parent + 1;
            full = filler(buf, position == 0 ? "." : "..", &st, position + 1, 0);
        } else {
            uint32_t child = folder->first + (uint32_t)(position - 2);
            entry_t *e = &entries[child];
            int plus = plus_mode == 2 || (plus_mode == 1 && e->is_dir);
            if (plus) {
                list_stat(child, &st);
            } else {
                memset(&st, 0, sizeof(st));
                st.st_mode = e->is_dir ? S_IFDIR : S_IFREG;
                st.st_ino = child + 1;
            }
            full = filler(buf, e->name, &st, position + 1, plus ? FUSE_FILL_DIR_PLUS : 0);
        }
        if (full)
            break;
    }
    return 0;
}

static int cref_readdir(const char *path, void *buf, fuse_fill_dir_t filler, off_t off, struct fuse_file_info *fi,
                        int flags) {
    (void)fi;
    (void)flags;
    if (entries)
        return list_readdir(path, buf, filler, off);
    struct stat st;
    memset(&st, 0, sizeof(st));
    st.st_mode = S_IFDIR;
    filler(buf, ".", &st, 0, 0);
    filler(buf, "..", &st, 0, 0);
    st.st_mode = S_IFREG;
    filler(buf, "big", &st, 0, 0);
    return 0;
}

int main(int argc, char *argv[]) {
    if (argc < 5)
        return 2;
    if (strncmp(argv[1], "list:", 5) == 0) {
        const char *plus = getenv("CREF_PLUS");
        plus_mode = plus == NULL ? 1 : strcmp(plus, "all") == 0 ? 2 : strcmp(plus, "none") == 0 ? 0 : 1;
        if (load_list(argv[1] + 5) != 0)
            return 1;
    } else if ((source_fd = open(argv[1], O_RDONLY)) < 0)
        return 1;
    source_offset = strtoll(argv[2], NULL, 10);
    file_size = strtoll(argv[3], NULL, 10);
    struct fuse_operations ops;
    memset(&ops, 0, sizeof(ops));
    ops.getattr = cref_getattr;
    ops.open = cref_open;
    ops.read = cref_read;
    ops.readdir = cref_readdir;
    if (entries)
        ops.init = list_init;
    char **args = calloc(argc, sizeof(char *));
    args[0] = argv[0];
    args[1] = argv[4];
    for (int i = 5; i < argc; i++)
        args[i - 3] = argv[i];
    return fuse_main_real(argc - 3, args, &ops, sizeof(ops), NULL);
}
