"""The C layouts stfs/_libfuse.py packs by hand, checked against a C program built with the installed libfuse3 headers.

As mfusepy's tests/test_struct_layout.py does for its ctypes structures: a wrong offset here would
hand libfuse garbage, so every size, offset and constant used is compared with what gcc says.
"""

from __future__ import annotations

import ctypes
import importlib
import shutil
import struct
import subprocess
from pathlib import Path

import mfusepy
import pytest

from stfs import _libfuse
from tests.helpers import IN_CI

# struct stat's members for STAT_FIELDS: the times are struct timespec st_mtim, st_ctim, st_atim
STAT_MEMBERS = tuple(name.removesuffix("e") if name.endswith("time") else name for name in _libfuse.STAT_FIELDS)
BUF_MEMBERS = ("size", "flags", "mem", "fd", "pos")

PROGRAM = """
#define FUSE_USE_VERSION 31
#include <fuse.h>
#include <stddef.h>
#include <stdio.h>
#include <sys/stat.h>
#define SHOW(type, member) printf(#type "." #member " %zu %zu\\n", offsetof(type, member), sizeof(((type *)0)->member))
int main(void) {
    printf("fuse_bufvec %zu\\n", sizeof(struct fuse_bufvec));
    SHOW(struct fuse_bufvec, count); SHOW(struct fuse_bufvec, idx); SHOW(struct fuse_bufvec, off);
    SHOW(struct fuse_bufvec, buf);
    printf("fuse_buf %zu\\n", sizeof(struct fuse_buf));
    BUF_MEMBERS
    printf("stat %zu\\n", sizeof(struct stat));
    STAT_MEMBERS
    printf("timespec.tv_sec %zu %zu\\n", offsetof(struct timespec, tv_sec), sizeof(((struct timespec *)0)->tv_sec));
    printf("timespec.tv_nsec %zu %zu\\n", offsetof(struct timespec, tv_nsec), sizeof(((struct timespec *)0)->tv_nsec));
    printf("FUSE_CAP_SPLICE_WRITE %d\\nFUSE_BUF_IS_FD %d\\nFUSE_FILL_DIR_PLUS %d\\n",
           FUSE_CAP_SPLICE_WRITE, FUSE_BUF_IS_FD, FUSE_FILL_DIR_PLUS);
    return 0;
}
"""


@pytest.fixture(scope="module")
def c_layout(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[int]]:
    """Every line the C program prints: name -> numbers."""
    flags = subprocess.run(["pkg-config", "--cflags", "fuse3"], capture_output=True, text=True)
    if shutil.which("gcc") is None or flags.returncode != 0:
        if IN_CI:
            pytest.fail("gcc or the libfuse3 headers (libfuse3-dev) are missing in CI")
        pytest.skip("gcc or libfuse3-dev is not installed")
    folder = Path(tmp_path_factory.mktemp("layout"))
    source = folder / "layout.c"
    source.write_text(
        PROGRAM.replace("BUF_MEMBERS", " ".join(f"SHOW(struct fuse_buf, {member});" for member in BUF_MEMBERS)).replace(
            "STAT_MEMBERS", " ".join(f"SHOW(struct stat, {member});" for member in STAT_MEMBERS)
        )
    )
    binary = folder / "layout"
    subprocess.run(["gcc", *flags.stdout.split(), str(source), "-o", str(binary)], check=True, timeout=60)
    output = subprocess.run([str(binary)], capture_output=True, text=True, check=True).stdout
    layout = {}
    for line in output.splitlines():  # "struct stat.st_ino 8 8": a name (with spaces), then numbers
        words = line.split()
        count = 2 if len(words) > 2 and words[-2].isdigit() else 1
        layout[" ".join(words[:-count])] = [int(word) for word in words[-count:]]
    return layout


def _offsets(layout: struct.Struct) -> list[int]:
    """Where each field of a native-aligned ``struct`` format starts."""
    mode, fmt = layout.format[0], layout.format[1:]
    # a field ends where the format up to it ends; it starts its own size before that (after any padding)
    return [struct.calcsize(mode + fmt[: index + 1]) - struct.calcsize(mode + fmt[index]) for index in range(len(fmt))]


def test_bufvec_head_and_buffers(c_layout: dict[str, list[int]]) -> None:
    assert _libfuse.BUFVEC_HEAD.size == c_layout["struct fuse_bufvec.buf"][0]  # buf[] follows count, idx, off
    assert _offsets(_libfuse.BUFVEC_HEAD) == [c_layout[f"struct fuse_bufvec.{m}"][0] for m in ("count", "idx", "off")]
    # Consecutive buffers sit BUF.size apart: the C array's stride is sizeof(struct fuse_buf).
    assert _libfuse.BUF.size == c_layout["fuse_buf"][0]
    assert _offsets(_libfuse.BUF) == [c_layout[f"struct fuse_buf.{member}"][0] for member in BUF_MEMBERS]
    widths = [struct.calcsize("@" + char) for char in _libfuse.BUF.format[1:]]
    assert widths == [c_layout[f"struct fuse_buf.{member}"][1] for member in BUF_MEMBERS]


def test_constants(c_layout: dict[str, list[int]]) -> None:
    assert c_layout["FUSE_CAP_SPLICE_WRITE"][0] == _libfuse.FUSE_CAP_SPLICE_WRITE
    assert c_layout["FUSE_BUF_IS_FD"][0] == _libfuse.FUSE_BUF_IS_FD
    assert c_layout["FUSE_FILL_DIR_PLUS"][0] == _libfuse.FUSE_FILL_DIR_PLUS


def test_struct_stat(c_layout: dict[str, list[int]]) -> None:
    assert _libfuse.STAT.size == c_layout["stat"][0]
    for member in STAT_MEMBERS:
        name = member.replace("tim", "timespec") if member.endswith("tim") else member
        field = getattr(mfusepy.c_stat, name)
        assert (field.offset, field.size) == tuple(c_layout[f"struct stat.{member}"]), member
    assert mfusepy.c_timespec.tv_sec.offset == c_layout["timespec.tv_sec"][0]
    assert mfusepy.c_timespec.tv_nsec.offset == c_layout["timespec.tv_nsec"][0]


def test_packed_stat_reads_back_in_c_places(c_layout: dict[str, list[int]]) -> None:
    values = (0o100444, 12345, 1, 1 << 40, 3, 4096, 1000, 1001, 1_700_000_000_123_456_789, 5_000_000_001, 7)
    packed = _libfuse.pack_stat(values)
    for member, value in zip(STAT_MEMBERS[:8], values[:8], strict=True):
        offset, size = c_layout[f"struct stat.{member}"]
        assert int.from_bytes(packed[offset : offset + size], "little", signed=True) == value, member
    for member, value in zip(STAT_MEMBERS[8:], values[8:], strict=True):
        offset = c_layout[f"struct stat.{member}"][0]
        seconds = int.from_bytes(packed[offset : offset + 8], "little", signed=True)
        nanoseconds = int.from_bytes(packed[offset + 8 : offset + 16], "little", signed=True)
        assert seconds * 1_000_000_000 + nanoseconds == value, member


def test_native_writes_where_mfusepy_put_the_callbacks() -> None:
    """stfs._native replaces callbacks in mfusepy's ctypes ``fuse_operations`` by the C header's offsets: the two
    layouts must agree on every field it writes, and on the size (libfuse copies that many bytes)."""
    native = importlib.import_module("stfs._native") if IN_CI else pytest.importorskip("stfs._native")  # CI builds it
    layout = native.layout()
    for name in ("getattr", "open", "statfs", "flush", "release", "opendir", "readdir", "releasedir", "read_buf"):
        field = getattr(mfusepy.fuse_operations, name)
        assert (field.offset, field.size) == tuple(layout[name]), name
    assert ctypes.sizeof(mfusepy.fuse_operations) == layout["fuse_operations"][1]
    assert mfusepy.fuse_file_info.fh.offset == layout["fuse_file_info.fh"][0]
    assert ctypes.sizeof(mfusepy.c_stat) == layout["stat"][1]
