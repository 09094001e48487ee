"""The optional C extensions: stfs._native (the FUSE requests that carry the load, answered in C), stfs._tls
(HTTPS bodies read without the GIL) and stfs.formats.hdf5._scan (the HDF5 walk's loops over each object); and the
man page stfs(1), written by argparse-manpage from stfs.cli's parser as the package is built and installed in
share/man/man1 (pyproject.toml, [tool.build_manpages]).

stfs._native is built against the libfuse3 headers (``pkg-config fuse3``; the package libfuse3-dev), the others
against Python's alone (stfs._tls finds OpenSSL in the library Python's ssl loaded). Without a compiler or the
headers an extension is left out and stfs serves from Python instead (it says so, once, at mount). Everything else
about the package is in pyproject.toml.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

from build_manpages import build_manpages, get_build_py_cmd, get_install_cmd
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

# The man page is made by importing stfs.cli from this tree (setuptools' isolated build does not put it on the path).
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def fuse3_cflags() -> list[str] | None:
    """The compiler flags of the libfuse3 headers, or None where pkg-config does not know them."""
    if shutil.which("pkg-config") is None:
        return None
    result = subprocess.run(["pkg-config", "--cflags", "fuse3"], capture_output=True, text=True)
    return result.stdout.split() if result.returncode == 0 else None


class OptionalBuildExt(build_ext):
    """build_ext that leaves the extension out, with one line, when it cannot be compiled."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:  # no compiler: distutils raises its own error types
            print(f"stfs: C extension not built ({exc}); the Python path will serve")

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except Exception as exc:
            print(f"stfs: C extension {ext.name} not built ({exc}); the Python path will serve")


WARNINGS = ["-O2", "-std=gnu11", "-Wall", "-Wextra", "-Wno-unused-parameter"]
flags = fuse3_cflags()
extensions = [
    Extension("stfs._tls", ["stfs/_tls.c"], extra_compile_args=WARNINGS),
    Extension("stfs.formats.hdf5._scan", ["stfs/formats/hdf5/_scan.c"], extra_compile_args=WARNINGS),
]
if flags is not None:
    extensions.append(Extension("stfs._native", ["stfs/_native.c"], extra_compile_args=[*flags, *WARNINGS]))
else:
    print("stfs: pkg-config fuse3 found no libfuse3 headers; stfs._native is left out, the Python path will serve")
setup(
    ext_modules=extensions,
    cmdclass={
        "build_ext": OptionalBuildExt,
        "build_manpages": build_manpages,
        "build_py": get_build_py_cmd(),  # builds the man page before the Python files
        "install": get_install_cmd(),  # installs it in share/man/man1 (a wheel's .data/data/share/man/man1)
    },
)
