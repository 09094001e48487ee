"""Helpers the tests share: running real tools, whether FUSE is here, the mount function's type."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")

MountFn = Callable[..., str]


def fuse_available() -> bool:
    return os.path.exists("/dev/fuse") and shutil.which("fusermount3") is not None


def run(command: list[str], **kwargs: object) -> subprocess.CompletedProcess:
    """Run a real tool with a timeout; output as text unless ``text=False``."""
    kwargs.setdefault("capture_output", True)
    kwargs.setdefault("text", True)
    kwargs.setdefault("timeout", 60)
    return subprocess.run(command, **kwargs)  # type: ignore[call-overload]


def rss_anon(pid: int) -> int:
    """The anonymous memory of process ``pid``, in bytes (``RssAnon`` of /proc/PID/status)."""
    with open(f"/proc/{pid}/status") as stream:
        for line in stream:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon")
