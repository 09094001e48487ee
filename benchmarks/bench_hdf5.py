#!/usr/bin/env python3
"""Listing the tensors of a 1 GiB ``.weights.h5``: ``stfs info`` of it against ``stfs info`` of the same weights as
safetensors, and stfs's HDF5 reader against h5py opening the file and listing every dataset's shape and dtype, side
by side in one run (SPEC §17's targets: at most 1.2 x and 0.2 x; a remote ``info`` at most 1 MiB fetched).

    flock /work/notes/bench.lock python3 benchmarks/bench_hdf5.py [--data DIR] [--rounds 7] [--size-mib 1024]

Writes (once, kept in --data) the 195 F32 tensors of a 24-layer model's shapes (``benchlib.checkpoint_shapes``) of
--size-mib MiB with h5py as Keras 2 and ``tf_model.h5`` lay them out (a group per dot: ``model/layers/0/...``), and
the same tensors with safetensors. Then, alternating, each round:

  stfs info    a fresh ``python3 -m stfs info`` of each file (bytecode cached in --data, as an installed package has
               it): the .weights.h5 against the .safetensors.
  end to end   a fresh ``python3 -c`` that lists every dataset's name, shape and dtype: h5py (``File`` and
               ``visititems``) against stfs's reader (``formats.read_with`` over ``os.pread``).
  in process   the same two listings in this process, both imported already (warm page cache).

Prints the medians (and the best of the rounds, and the median CPU seconds: the machine may be shared, and CPU time
suffers less from it) and their ratios, and what stfs's reader
asked for, as it asks a remote file (a first read of 100,000 bytes, then its windows): requests and bytes.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from benchmarks.benchlib import MIB, CountedReads, bytecode_environment, checkpoint_shapes, warm  # noqa: E402
from stfs.formats import named, read_with  # noqa: E402

H5PY_LIST = """
import sys, h5py
def show(name, item):
    if isinstance(item, h5py.Dataset):
        print(name, item.dtype, list(item.shape))
with h5py.File(sys.argv[1], "r") as file:
    file.visititems(show)
"""

STFS_LIST = """
import os, sys
from stfs.formats import named, read_with
fd = os.open(sys.argv[1], os.O_RDONLY)
header = read_with(named("hdf5"), lambda o, n: os.pread(fd, n, o), path=sys.argv[1], file_size=os.fstat(fd).st_size)
for tensor in header.tensors:
    print(tensor.name, tensor.dtype, list(tensor.shape))
"""


def write_files(folder: str, size_mib: int) -> tuple[str, str]:
    """The .weights.h5 and the .safetensors of the same zeros, unless they exist."""
    import numpy as np

    h5 = os.path.join(folder, f"model-{size_mib}m.weights.h5")
    st = os.path.join(folder, f"model-{size_mib}m.safetensors")
    shapes = checkpoint_shapes(size_mib)
    if not os.path.exists(h5):
        import h5py

        with h5py.File(h5 + ".partial", "w") as file:
            file.attrs["keras_version"] = b"2.15.0"
            file.attrs["backend"] = b"tensorflow"
            for name, shape in shapes.items():
                file.create_dataset(name.replace(".", "/"), data=np.zeros(shape, np.float32))
        os.replace(h5 + ".partial", h5)
    if not os.path.exists(st):
        from safetensors.numpy import save_file

        save_file({name: np.zeros(shape, np.float32) for name, shape in shapes.items()}, st + ".partial")
        os.replace(st + ".partial", st)
    return h5, st


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def fresh(command: list[str], pycache: str) -> tuple[float, float, int]:
    """Wall and CPU seconds of a fresh process, and the lines it printed."""
    env = bytecode_environment(pycache)
    cpu = _children_cpu()
    started = time.perf_counter()
    out = subprocess.run(command, capture_output=True, text=True, check=True, cwd=REPO, env=env).stdout
    return time.perf_counter() - started, _children_cpu() - cpu, len(out.splitlines())


def in_process_h5py(path: str) -> tuple[float, float, int]:
    import h5py

    listing = []

    def show(name: str, item: object) -> None:
        if isinstance(item, h5py.Dataset):
            listing.append((name, item.dtype, list(item.shape)))

    cpu, started = time.process_time(), time.perf_counter()
    with h5py.File(path, "r") as file:
        file.visititems(show)
    elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
    assert listing
    return elapsed, cpu, len(listing)


class RemoteLike(CountedReads):
    """Reads counted as a remote source's are: ``many`` ranges at once, each a request."""

    def many(self, ranges: list[tuple[int, int]]) -> list[bytes]:
        return [self(offset, size) for offset, size in ranges]


def in_process_stfs(path: str, first_read: int = 0) -> tuple[float, float, int, int]:
    """Wall and CPU seconds, requests, bytes; read as a remote file is where ``first_read`` is a remote one's."""
    fd = os.open(path, os.O_RDONLY)
    try:
        read = RemoteLike(fd) if first_read else CountedReads(fd)
        cpu, started = time.process_time(), time.perf_counter()
        header = read_with(named("hdf5"), read, path=path, file_size=os.fstat(fd).st_size, first_read=first_read)
        listing = [(t.name, t.dtype, list(t.shape)) for t in header.tensors]
        elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
    finally:
        os.close(fd)
    assert listing
    return elapsed, cpu, read.requests, read.bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "stfs-bench-hdf5"))
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--size-mib", type=int, default=1024)
    args = parser.parse_args()
    os.makedirs(args.data, exist_ok=True)
    h5, st = write_files(args.data, args.size_mib)
    warm(h5, st)
    pycache = os.path.join(args.data, "pycache")
    info = [sys.executable, "-m", "stfs", "info"]
    runs = {
        "info h5": lambda: fresh([*info, h5], pycache),
        "info st": lambda: fresh([*info, st], pycache),
        "h5py e2e": lambda: fresh([sys.executable, "-c", H5PY_LIST, h5], pycache),
        "stfs e2e": lambda: fresh([sys.executable, "-c", STFS_LIST, h5], pycache),
        "h5py in": lambda: in_process_h5py(h5),
        "stfs in": lambda: in_process_stfs(h5)[:2] + (0,),
    }
    results: dict[str, list[float]] = {key: [] for key in runs}
    cpu: dict[str, list[float]] = {key: [] for key in runs}
    lines: dict[str, int] = {}
    for run in runs.values():
        run()  # bytecode compiled, imports warm
    for _ in range(args.rounds):
        for key, run in runs.items():
            seconds, cpu_seconds, count = run()
            results[key].append(seconds)
            cpu[key].append(cpu_seconds)
            lines[key] = count
    assert lines["h5py e2e"] == lines["stfs e2e"], lines
    median = {key: statistics.median(values) for key, values in results.items()}
    best = {key: min(values) for key, values in results.items()}
    cpu_median = {key: statistics.median(values) for key, values in cpu.items()}
    _, _, requests, read_bytes = in_process_stfs(h5, first_read=100_000)
    print(f"{h5}: {os.path.getsize(h5) / MIB:.0f} MiB, {lines['stfs e2e']} datasets")
    rows = (
        ("stfs info (fresh process)", "info st", "info h5", "safetensors", ".weights.h5"),
        ("listing, end to end", "h5py e2e", "stfs e2e", "h5py", "stfs"),
        ("listing, in process", "h5py in", "stfs in", "h5py", "stfs"),
    )
    for label, theirs_key, ours_key, theirs_name, ours_name in rows:
        for kind, values in (("median", median), ("best", best), ("CPU, median", cpu_median)):
            ours, theirs = values[ours_key], values[theirs_key]
            print(
                f"{label + ', ' + kind:34} {theirs_name:>12} {theirs * 1000:8.1f} ms   {ours_name:>12} "
                f"{ours * 1000:8.1f} ms   ratio {ours / theirs:6.3f}"
            )
    print(f"stfs reads as from a remote file: {requests} requests, {read_bytes:,} bytes")
    print(f"medians of {args.rounds} rounds, alternating; load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
