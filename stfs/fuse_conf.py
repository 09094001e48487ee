"""May this user mount with ``allow_other``? fusermount3 allows it to root, or to anyone when /etc/fuse.conf has a
line ``user_allow_other``; asked before the daemon starts, so the answer is one line instead of a failed mount."""

from __future__ import annotations

import os
from collections.abc import Iterable

from .errors import MountError

FUSE_CONF = "/etc/fuse.conf"
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
