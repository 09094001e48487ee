"""Fixtures: FUSE availability, and a ``mount`` that undoes every mount at teardown."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest

from stfs.daemon import mounted
from tests.helpers import IN_CI, MountFn, fuse_available


@pytest.fixture
def require_fuse() -> None:
    """Mount tests skip without /dev/fuse locally, but fail in CI."""
    if not fuse_available():
        if IN_CI:
            pytest.fail("/dev/fuse or fusermount3 is missing in CI")
        pytest.skip("FUSE is not available here")


@pytest.fixture
def mount(tmp_path_factory: pytest.TempPathFactory, require_fuse: None) -> Iterator[MountFn]:
    """``mount(source, layout=..., options=[...]) -> mountpoint``; every mount is undone at teardown."""
    with contextlib.ExitStack() as stack:

        def do_mount(source: str, layout: str = "nested", options: list[str] | None = None) -> str:
            mountpoint = str(tmp_path_factory.mktemp("mnt"))
            return stack.enter_context(mounted(source, mountpoint, layout=layout, options=options))

        yield do_mount
