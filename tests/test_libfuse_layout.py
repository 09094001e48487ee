"""Where stfs writes into C structures it did not compile, checked against the installed libfuse3 headers.

stfs packs no C structure by hand: stfs._native is compiled against the headers, and every other structure
is one of mfusepy's ctypes ones. Two places still meet mfusepy's layouts, and a wrong offset there would hand
libfuse garbage: ``StfsFUSE.init_fuse_3`` sets ``max_read`` and ``want`` in mfusepy's ``fuse_conn_info``, and
``stfs._native.install`` writes its callbacks into mfusepy's ``fuse_operations`` by the header's offsets. As
mfusepy's tests/test_struct_layout.py does for all its structures, a C program built with the headers says
where those fields are.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import mfusepy
import numpy as np
import pytest

from stfs import _libfuse
from tests.helpers import IN_CI, REPO, run, stfs_command

CONN_MEMBERS = ("capable", "want", "max_read")
OPERATIONS = ("getattr", "open", "statfs", "flush", "release", "opendir", "readdir", "releasedir", "read_buf")

PROGRAM = """
#define FUSE_USE_VERSION 31
#include <fuse.h>
#include <stddef.h>
#include <stdio.h>
#define SHOW(type, member) printf(#type "." #member " %zu %zu\\n", offsetof(type, member), sizeof(((type *)0)->member))
int main(void) {
    SHOW(struct fuse_conn_info, capable); SHOW(struct fuse_conn_info, want); SHOW(struct fuse_conn_info, max_read);
    printf("FUSE_CAP_SPLICE_WRITE %d\\n", FUSE_CAP_SPLICE_WRITE);
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
    source.write_text(PROGRAM)
    binary = folder / "layout"
    subprocess.run(["gcc", *flags.stdout.split(), str(source), "-o", str(binary)], check=True, timeout=60)
    output = subprocess.run([str(binary)], capture_output=True, text=True, check=True).stdout
    layout = {}
    for line in output.splitlines():  # "struct fuse_conn_info.want 4 4": a name (with spaces), then numbers
        words = line.split()
        count = 2 if len(words) > 2 and words[-2].isdigit() else 1
        layout[" ".join(words[:-count])] = [int(word) for word in words[-count:]]
    return layout


def test_the_fields_init_sets(c_layout: dict[str, list[int]]) -> None:
    for member in CONN_MEMBERS:
        field = getattr(mfusepy.fuse_conn_info, member)
        assert (field.offset, field.size) == tuple(c_layout[f"struct fuse_conn_info.{member}"]), member
    assert c_layout["FUSE_CAP_SPLICE_WRITE"][0] == _libfuse.FUSE_CAP_SPLICE_WRITE


def test_native_writes_where_mfusepy_put_the_callbacks() -> None:
    """stfs._native replaces callbacks in mfusepy's ctypes ``fuse_operations`` by the C header's offsets: the two
    layouts must agree on every field it writes, and on the size (libfuse copies that many bytes)."""
    native = importlib.import_module("stfs._native") if IN_CI else pytest.importorskip("stfs._native")  # CI builds it
    layout = native.layout()
    for name in OPERATIONS:
        field = getattr(mfusepy.fuse_operations, name)
        assert (field.offset, field.size) == tuple(layout[name]), name
    assert ctypes.sizeof(mfusepy.fuse_operations) == layout["fuse_operations"][1]


# -- which libfuse, whatever is imported first ------------------------------------------------------------------------

LIBFUSE2 = ctypes.util.find_library("fuse")  # libfuse2, where installed beside libfuse3 (.ci/run installs it)


def without_library_name() -> dict[str, str]:
    return {name: value for name, value in os.environ.items() if name not in ("FUSE_LIBRARY_NAME", "FUSE_LIBRARY_PATH")}


@pytest.mark.parametrize(
    "imports",
    [
        "import mfusepy; import stfs; from stfs import _libfuse",  # mfusepy first: stfs._libfuse reloads it
        "import stfs; import mfusepy",  # after stfs: import stfs named fuse3 for it
        "from stfs import errors; import mfusepy; from stfs import _libfuse",  # as tests/conftest.py, then a test
    ],
    ids=["mfusepy-first", "stfs-first", "conftest-order"],
)
def test_libfuse3_is_loaded_whichever_is_imported_first(imports: str) -> None:
    """Where libfuse2 is installed beside libfuse3 (Ubuntu desktops), mfusepy imported with no FUSE_LIBRARY_NAME
    takes libfuse2: in any order of imports, the mfusepy stfs uses (and everyone's, one module) has libfuse3."""
    if LIBFUSE2 is None and IN_CI:
        pytest.fail("libfuse2 is missing in CI (.ci/run installs it): the import order would not matter")
    code = f"{imports}; import mfusepy as m, sys; print(m.fuse_version_major, m._libfuse_path); sys.stdout.flush()"
    result = run([sys.executable, "-c", code], cwd=REPO, env=without_library_name())
    assert result.returncode == 0, result.stderr
    major, path = result.stdout.split()
    assert major == "3" and "fuse3" in path, result.stdout


@pytest.mark.skipif(LIBFUSE2 is None, reason="libfuse2 is not installed")
def test_a_libfuse2_the_environment_names_is_refused_in_one_line(tmp_path: Path) -> None:
    from safetensors.numpy import save_file

    save_file({"w": np.ones(3, np.float32)}, str(tmp_path / "model.safetensors"))
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    result = stfs_command(
        "mount",
        str(tmp_path / "model.safetensors"),
        str(mnt),
        env={**without_library_name(), "FUSE_LIBRARY_NAME": "fuse"},
    )
    assert not os.path.ismount(mnt)
    assert result.returncode == 1
    (line,) = result.stderr.splitlines()
    assert "libfuse.so.2" in line and "needs libfuse3" in line, line
