"""The optional C extension stfs._native (the FUSE requests that carry the load, answered in C).

Built against the libfuse3 headers (``pkg-config fuse3``; the package libfuse3-dev). Without a compiler or the
headers the extension is left out and stfs serves every request from Python (it says so, once, at mount).
Everything else about the package is in pyproject.toml.
"""

from __future__ import annotations

import shutil
import subprocess

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


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


flags = fuse3_cflags()
extensions = (
    []
    if flags is None
    else [
        Extension(
            "stfs._native",
            ["stfs/_native.c"],
            extra_compile_args=[*flags, "-O2", "-std=gnu11", "-Wall", "-Wextra", "-Wno-unused-parameter"],
        )
    ]
)
if flags is None:
    print("stfs: pkg-config fuse3 found no libfuse3 headers; the C extension is left out, the Python path will serve")
setup(ext_modules=extensions, cmdclass={"build_ext": OptionalBuildExt})
