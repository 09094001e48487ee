from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Callable, Iterator

import pytest

from stfs.daemon import mounted

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def fuse_available() -> bool:
    return os.path.exists("/dev/fuse") and shutil.which("fusermount3") is not None


@pytest.fixture
def require_fuse() -> None:
    """Mount tests skip without /dev/fuse locally, but fail in CI."""
    if not fuse_available():
        if IN_CI:
            pytest.fail("/dev/fuse or fusermount3 is missing in CI")
        pytest.skip("FUSE is not available here")


MountFn = Callable[..., str]


@pytest.fixture
def mount(tmp_path_factory: pytest.TempPathFactory, require_fuse: None) -> Iterator[MountFn]:
    """``mount(source, layout=..., options=[...]) -> mountpoint``; every mount is undone at teardown."""
    with contextlib.ExitStack() as stack:

        def do_mount(source: str, layout: str = "nested", options: list[str] | None = None) -> str:
            mountpoint = str(tmp_path_factory.mktemp("mnt"))
            return stack.enter_context(mounted(source, mountpoint, layout=layout, options=options))

        yield do_mount


def run(command: list[str], **kwargs: object) -> subprocess.CompletedProcess:
    """Run a real tool with a timeout; output as text unless ``text=False``."""
    kwargs.setdefault("capture_output", True)
    kwargs.setdefault("text", True)
    kwargs.setdefault("timeout", 60)
    return subprocess.run(command, **kwargs)  # type: ignore[call-overload]
