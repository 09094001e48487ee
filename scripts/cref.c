/*
 * A minimal C libfuse3 server for scripts/bench.py to compare stfs against on the same machine:
 * it serves one read-only file, /big, holding SIZE bytes of SOURCE at OFFSET, with the
 * high-level API's plain read callback (pread into libfuse's buffer, as a typical C server does).
 *
 *     cref SOURCE OFFSET SIZE MOUNTPOINT [libfuse options...]
 *
 * With SIZE 0 and SOURCE "tree:N" it serves N folders /0 .. /N-1 holding one empty file "w" each
 * instead (a tree to time `find` over).
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

struct fuse_file_info; /* only passed through */

struct fuse_operations {
    int (*getattr)(const char *, struct stat *, struct fuse_file_info *);
    void *readlink, *mknod, *mkdir, *unlink, *rmdir, *symlink, *rename, *link, *chmod, *chown, *truncate;
    int (*open)(const char *, struct fuse_file_info *);
    int (*read)(const char *, char *, size_t, off_t, struct fuse_file_info *);
    void *write, *statfs, *flush, *release, *fsync, *setxattr, *getxattr, *listxattr, *removexattr, *opendir;
    int (*readdir)(const char *, void *, fuse_fill_dir_t, off_t, struct fuse_file_info *, int);
    void *releasedir, *fsyncdir, *init, *destroy, *access, *create, *lock, *utimens, *bmap, *ioctl, *poll,
        *write_buf, *read_buf, *flock, *fallocate, *copy_file_range, *lseek;
};

int fuse_main_real(int argc, char *argv[], const struct fuse_operations *op, size_t op_size, void *private_data);

static int source_fd;
static off_t source_offset;
static off_t file_size;
static long tree_folders = -1; /* >= 0: the tree of folders instead of /big */

/* For "/K" or "/K/w" in tree mode: K, and whether the path names the file; -1 for anything else. */
static long tree_index(const char *path, int *is_file) {
    char *end;
    if (path[0] != '/' || path[1] < '0' || path[1] > '9')
        return -1;
    long k = strtol(path + 1, &end, 10);
    if (k < 0 || k >= tree_folders)
        return -1;
    *is_file = 0;
    if (*end == '\0')
        return k;
    if (strcmp(end, "/w") == 0) {
        *is_file = 1;
        return k;
    }
    return -1;
}

static int cref_getattr(const char *path, struct stat *st, struct fuse_file_info *fi) {
    (void)fi;
    memset(st, 0, sizeof(*st));
    if (strcmp(path, "/") == 0) {
        st->st_mode = S_IFDIR | 0555;
        st->st_nlink = 2;
        return 0;
    }
    if (tree_folders >= 0) {
        int is_file;
        long k = tree_index(path, &is_file);
        if (k < 0)
            return -ENOENT;
        st->st_ino = 2 + 2 * k + is_file;
        st->st_mode = is_file ? (S_IFREG | 0444) : (S_IFDIR | 0555);
        st->st_nlink = is_file ? 1 : 2;
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

static int cref_readdir(const char *path, void *buf, fuse_fill_dir_t filler, off_t off, struct fuse_file_info *fi,
                        int flags) {
    (void)off;
    (void)fi;
    (void)flags;
    struct stat st;
    memset(&st, 0, sizeof(st));
    st.st_mode = S_IFDIR;
    filler(buf, ".", &st, 0, 0);
    filler(buf, "..", &st, 0, 0);
    if (tree_folders < 0) {
        st.st_mode = S_IFREG;
        filler(buf, "big", &st, 0, 0);
        return 0;
    }
    if (strcmp(path, "/") == 0) {
        char name[32];
        for (long k = 0; k < tree_folders; k++) {
            snprintf(name, sizeof(name), "%ld", k);
            if (filler(buf, name, &st, 0, 0))
                break;
        }
        return 0;
    }
    st.st_mode = S_IFREG;
    filler(buf, "w", &st, 0, 0);
    return 0;
}

int main(int argc, char *argv[]) {
    if (argc < 5)
        return 2;
    if (strncmp(argv[1], "tree:", 5) == 0)
        tree_folders = strtol(argv[1] + 5, NULL, 10);
    else if ((source_fd = open(argv[1], O_RDONLY)) < 0)
        return 1;
    source_offset = strtoll(argv[2], NULL, 10);
    file_size = strtoll(argv[3], NULL, 10);
    struct fuse_operations ops;
    memset(&ops, 0, sizeof(ops));
    ops.getattr = cref_getattr;
    ops.open = cref_open;
    ops.read = cref_read;
    ops.readdir = cref_readdir;
    char **args = calloc(argc, sizeof(char *));
    args[0] = argv[0];
    args[1] = argv[4];
    for (int i = 5; i < argc; i++)
        args[i - 3] = argv[i];
    return fuse_main_real(argc - 3, args, &ops, sizeof(ops), NULL);
}
