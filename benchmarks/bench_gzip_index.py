"""The candidates for reading a gzip layer at random (docs/choices.md): indexed_gzip and rapidgzip, side by side.

A tar of ``--size-mib`` of random F16 weights, gzip'd (level 6), read from memory through a Python file object (as
stfs reads a blob: by ranges of a source): the pass that indexes it every 4 MiB, the index's size exported, the
blob reads the pass makes, the cost of importing the index, and random 1 MiB reads after it (checked). rapidgzip
is measured only where it is installed (``pip install rapidgzip``: not a dependency of stfs).

    python3 benchmarks/bench_gzip_index.py [--size-mib 128] [--reads 50]
"""

from __future__ import annotations

import argparse
import gzip
import io
import os
import random
import sys
import tarfile
import time
from typing import Any

import numpy as np

SPACING = 4 << 20
MIB = 1 << 20


class Counted(io.RawIOBase):
    """A file over bytes in memory that counts its reads and the bytes they bring."""

    def __init__(self, data: bytes) -> None:
        self._stream = io.BytesIO(data)
        self.reads = 0
        self.bytes = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        return self._stream.seek(offset, whence)

    def tell(self) -> int:
        return self._stream.tell()

    def readinto(self, buffer: Any) -> int:
        got = self._stream.readinto(buffer)
        self.reads += 1
        self.bytes += got
        return got


def layer(size: int) -> tuple[bytes, bytes]:
    weights = np.random.default_rng(0).standard_normal(size // 2).astype(np.float16).tobytes()
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as archive:
        info = tarfile.TarInfo("models/model.safetensors")
        info.size = len(weights)
        archive.addfile(info, io.BytesIO(weights))
    tar = out.getvalue()
    return tar, gzip.compress(tar, 6, mtime=0)


def measure(name: str, open_file: Any, tar: bytes, data: bytes, reads: int) -> None:
    source = Counted(data)
    started = time.perf_counter()
    file, export = open_file(source)
    seconds = time.perf_counter() - started
    index = io.BytesIO()
    export(file, index)
    size = len(index.getvalue())
    picks = random.Random(1)
    source.bytes = 0
    started = time.perf_counter()
    for _ in range(reads):
        offset = picks.randrange(len(tar) - MIB)
        file.seek(offset)
        assert file.read(MIB) == tar[offset : offset + MIB]
    read_ms = (time.perf_counter() - started) / reads * 1000
    print(
        f"{name:13} pass {seconds:.2f} s, {source.reads} reads of the blob; index {size:,} B "
        f"({100 * size / len(data):.2f}% of the layer); random 1 MiB read {read_ms:.1f} ms, "
        f"{source.bytes / reads / MIB:.1f} MiB of the blob each"
    )
    file.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mib", type=int, default=128)
    parser.add_argument("--reads", type=int, default=50)
    args = parser.parse_args()
    tar, data = layer(args.size_mib * MIB)
    print(f"a tar of {len(tar) / MIB:.0f} MiB, {len(data) / MIB:.0f} MiB gzip'd; load {os.getloadavg()[0]:.1f}")
    import indexed_gzip

    def zran(source: Counted) -> tuple[Any, Any]:
        file = indexed_gzip._IndexedGzipFile(fileobj=source, spacing=SPACING, readbuf_size=MIB)
        file.build_full_index()
        return file, lambda file, out: file.export_index(fileobj=out)

    measure("indexed_gzip", zran, tar, data, args.reads)
    try:
        import rapidgzip
    except ImportError:
        print("rapidgzip     not installed")
        return 0

    def parallel(source: Counted) -> tuple[Any, Any]:
        file = rapidgzip.RapidgzipFile(source, parallelization=1, chunk_size=SPACING)
        file.seek(0, io.SEEK_END)
        return file, lambda file, out: file.export_index(out)

    measure("rapidgzip", parallel, tar, data, args.reads)
    return 0


if __name__ == "__main__":
    sys.exit(main())
