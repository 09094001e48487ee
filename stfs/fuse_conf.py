"""May this user mount with ``allow_other``? fusermount3 allows it to root, or to anyone when /etc/fuse.conf has a
line ``user_allow_other``. And may it open /dev/fuse at all? Both asked before the daemon starts, so the answer is
one line saying what to do instead of a failed mount."""

from __future__ import annotations

import errno
import grp
import os
import stat
from collections.abc import Iterable

from .errors import MountError

FUSE_CONF = "/etc/fuse.conf"
FUSE_DEVICE = "/dev/fuse"
NEED_USER_ALLOW_OTHER = ("allow_other", "allow_root")


def fuse_conf_path() -> str:
    """/etc/fuse.conf, or ``$STFS_FUSE_CONF`` (for the tests, which cannot change the real one)."""
    return os.environ.get("STFS_FUSE_CONF") or FUSE_CONF


def allows_other(conf_text: str) -> bool:
    """Whether fuse.conf text has ``user_allow_other`` on a line of its own (``#`` starts a comment)."""
    return any(line.partition("#")[0].strip() == "user_allow_other" for line in conf_text.splitlines())


def check_allow_other(fuse_options: Iterable[str], uid: int, conf_path: str) -> None:
    """Raise ``MountError`` if ``fuse_options`` has allow_other (or allow_root) that fusermount3 would refuse."""
    wanted = [item for item in fuse_options if item.partition("=")[0] in NEED_USER_ALLOW_OTHER]
    if not wanted or uid == 0:
        return
    try:
        with open(conf_path, encoding="utf-8", errors="replace") as stream:
            allowed = allows_other(stream.read())
    except FileNotFoundError:
        allowed = False
    except OSError:
        return  # unreadable to this user: fusermount3, setuid root, reads it and decides
    if not allowed:
        raise MountError(f"-o {wanted[0]}: only root may use it unless {conf_path} has a line user_allow_other")


def check_fuse_device(path: str = FUSE_DEVICE) -> None:
    """Raise ``MountError`` saying what to do if this user may not open /dev/fuse, as libfuse does first (its own
    words, "fuse: failed to open /dev/fuse: Permission denied", came after every header was read). A device that is
    missing, or anything else, libfuse reports."""
    try:
        os.close(os.open(path, os.O_RDWR | os.O_CLOEXEC))
    except PermissionError as exc:
        if exc.errno == errno.EPERM:  # a container not given the device
            raise MountError(
                f"{path}: operation not permitted; a container needs the device (docker run --device /dev/fuse "
                "--cap-add SYS_ADMIN), or mount outside it"
            ) from None
        raise MountError(
            f"{path}: permission denied: mounting needs read and write access to it; {_access(path)}"
        ) from None
    except OSError:
        return


def _access(path: str) -> str:
    """How to get read and write access to the device ``path``: its group where the group may, else root."""
    try:
        info = os.stat(path)
        group = grp.getgrgid(info.st_gid).gr_name if info.st_gid else ""
    except (OSError, KeyError):
        group = ""
    if group and info.st_mode & (stat.S_IRGRP | stat.S_IWGRP) == stat.S_IRGRP | stat.S_IWGRP:
        return f"add this user to group {group} (usermod -aG {group} USER, then log in again), or mount as root"
    return "mount as root, or have it opened to users (most systems make it crw-rw-rw-)"
