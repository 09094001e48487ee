#!/usr/bin/env python3
"""Listing the tensors of a 1 GiB ``pytorch_model.bin``: stfs's reader against ``torch.load(mmap=True,
weights_only=True)``, side by side in one run (SPEC §12's target for ``stfs info``: at most 0.2 x torch).

    flock /work/notes/bench.lock python3 benchmarks/bench_pytorch_info.py [--data DIR] [--rounds 7] [--size-mib 1024]

Writes (once, kept in --data) a ``torch.save`` of a state_dict of ~200 F32 tensors (a 24-layer model's
shapes) of --size-mib MiB, and a 64 MiB one. Then, alternating, each round:

  end to end   a fresh ``python3 -c`` that lists every tensor's name, dtype and shape: torch imports torch
               and runs ``torch.load(path, mmap=True, weights_only=True)``; stfs imports
               ``stfs.formats.pytorch`` and runs ``read_checkpoint`` over ``os.pread``. Wall seconds, bytecode
               cached (in --data) as an installed package has it.
  in process   the same two calls in this process, both imported already (warm page cache).

Prints the medians (and the best of the rounds: the machine may be shared) side by side and their ratios
stfs / torch, and what stfs read (requests, bytes) for both files (the target for the 64 MiB one: at most
1 MiB).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from benchmarks.benchlib import MIB, TORCH_LIST, CountedReads, bytecode_environment, warm, write_checkpoint  # noqa: E402
from stfs.formats import pytorch  # noqa: E402

STFS_LIST = """
import os, sys
from stfs.formats import pytorch
fd = os.open(sys.argv[1], os.O_RDONLY)
checkpoint = pytorch.read_checkpoint(lambda o, n: os.pread(fd, n, o), os.fstat(fd).st_size, path=sys.argv[1])
for tensor in checkpoint.tensors:
    print(tensor.name, tensor.dtype, list(tensor.shape))
"""


def end_to_end(script: str, path: str, pycache: str) -> tuple[float, int]:
    env = bytecode_environment(pycache)
    started = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-c", script, path], capture_output=True, text=True, check=True, cwd=REPO, env=env
    ).stdout
    return time.perf_counter() - started, len(out.splitlines())


def in_process_torch(path: str) -> float:
    import torch

    started = time.perf_counter()
    state = torch.load(path, mmap=True, weights_only=True)
    listing = [(name, tensor.dtype, list(tensor.shape)) for name, tensor in state.items()]
    elapsed = time.perf_counter() - started
    assert listing
    return elapsed


def in_process_stfs(path: str) -> tuple[float, int, int]:
    """Seconds, requests, bytes."""
    fd = os.open(path, os.O_RDONLY)
    try:
        read = CountedReads(fd)
        started = time.perf_counter()
        checkpoint = pytorch.read_checkpoint(read, os.fstat(fd).st_size, path=path)
        listing = [(t.name, t.dtype, list(t.shape)) for t in checkpoint.tensors]
        elapsed = time.perf_counter() - started
    finally:
        os.close(fd)
    assert listing
    return elapsed, read.requests, read.bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "stfs-bench-pytorch"))
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--size-mib", type=int, default=1024)
    args = parser.parse_args()
    os.makedirs(args.data, exist_ok=True)
    big = os.path.join(args.data, f"pytorch_model-{args.size_mib}m.bin")
    small = os.path.join(args.data, "pytorch_model-64m.bin")
    write_checkpoint(big, args.size_mib)
    write_checkpoint(small, 64)
    warm(big)  # the page cache warm for both readers
    results: dict[str, list[float]] = {"torch e2e": [], "stfs e2e": [], "torch in": [], "stfs in": []}
    lines = {}
    pycache = os.path.join(args.data, "pycache")
    end_to_end(TORCH_LIST, big, pycache)
    end_to_end(STFS_LIST, big, pycache)
    in_process_torch(big)
    in_process_stfs(big)
    for _ in range(args.rounds):
        seconds, lines["torch"] = end_to_end(TORCH_LIST, big, pycache)
        results["torch e2e"].append(seconds)
        seconds, lines["stfs"] = end_to_end(STFS_LIST, big, pycache)
        results["stfs e2e"].append(seconds)
        results["torch in"].append(in_process_torch(big))
        results["stfs in"].append(in_process_stfs(big)[0])
    assert lines["torch"] == lines["stfs"], lines
    median = {key: statistics.median(values) for key, values in results.items()}
    best = {key: min(values) for key, values in results.items()}
    _, requests, read_bytes = in_process_stfs(big)
    _, small_requests, small_bytes = in_process_stfs(small)
    print(f"{big}: {os.path.getsize(big) / MIB:.0f} MiB, {lines['stfs']} tensors")
    print(f"{'':40} {'torch.load(mmap, weights_only)':>32} {'stfs read_checkpoint':>22} {'ratio':>7}")
    for label, key in (("end to end (fresh python3 -c)", "e2e"), ("in process (imported, warm)", "in")):
        for kind, values in (("median", median), ("best", best)):
            ours, theirs = values[f"stfs {key}"], values[f"torch {key}"]
            print(f"{label + ', ' + kind:40} {theirs * 1000:29.1f} ms {ours * 1000:19.1f} ms {ours / theirs:7.3f}")
    print(f"stfs reads, {os.path.getsize(big) / MIB:.0f} MiB file: {requests} requests, {read_bytes:,} bytes")
    print(f"stfs reads, {os.path.getsize(small) / MIB:.0f} MiB file: {small_requests} requests, {small_bytes:,} bytes")
    print(f"medians of {args.rounds} rounds, alternating; load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
