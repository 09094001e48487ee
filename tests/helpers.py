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
