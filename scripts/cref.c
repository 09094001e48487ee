/*
 * A minimal C libfuse3 server for scripts/bench.py to compare stfs against on the same machine:
 * it serves one read-only file, /big, holding SIZE bytes of SOURCE at OFFSET, with the
 * high-level API's plain read callback (pread into libfuse's buffer, as a typical C server does).
 *
 *     cref SOURCE OFFSET SIZE MOUNTPOINT [libfuse options...]
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

static int cref_getattr(const char *path, struct stat *st, struct fuse_file_info *fi) {
    (void)fi;
    memset(st, 0, sizeof(*st));
    if (strcmp(path, "/") == 0) {
        st->st_mode = S_IFDIR | 0555;
        st->st_nlink = 2;
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
    (void)path;
    (void)off;
    (void)fi;
    (void)flags;
    filler(buf, ".", NULL, 0, 0);
    filler(buf, "..", NULL, 0, 0);
    filler(buf, "big", NULL, 0, 0);
    return 0;
}

int main(int argc, char *argv[]) {
    if (argc < 5)
        return 2;
    source_fd = open(argv[1], O_RDONLY);
    if (source_fd < 0)
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
