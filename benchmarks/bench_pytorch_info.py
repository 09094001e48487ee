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

from stfs.formats import pytorch  # noqa: E402

MIB = 1 << 20

TORCH_LIST = """
import sys, torch
state = torch.load(sys.argv[1], mmap=True, weights_only=True)
for name, tensor in state.items():
    print(name, tensor.dtype, list(tensor.shape))
"""

STFS_LIST = """
import os, sys
from stfs.formats import pytorch
fd = os.open(sys.argv[1], os.O_RDONLY)
checkpoint = pytorch.read_checkpoint(lambda o, n: os.pread(fd, n, o), os.fstat(fd).st_size, path=sys.argv[1])
for tensor in checkpoint.tensors:
    print(tensor.name, tensor.dtype, list(tensor.shape))
"""


def shapes(size_mib: int) -> dict[str, tuple[int, ...]]:
    """A 24-layer decoder's state_dict (8 tensors a layer, embeddings, a norm, the head): 195 F32 tensors, the
    hidden size a multiple of 64 and the vocabulary chosen so that they add up to ``size_mib`` MiB within 1%."""
    layers, target = 24, size_mib * MIB // 4

    def per_layer(hidden: int) -> int:
        return 4 * hidden * hidden + 3 * hidden * 4 * hidden + hidden

    hidden = 64
    while layers * per_layer(hidden + 64) + 2 * 1024 * (hidden + 64) < target:
        hidden += 64
    vocab = (target - layers * per_layer(hidden) - hidden) // (2 * hidden)
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden)}
    for layer in range(layers):
        prefix = f"model.layers.{layer}"
        for proj in ("q", "k", "v", "o"):
            out[f"{prefix}.self_attn.{proj}_proj.weight"] = (hidden, hidden)
        out[f"{prefix}.mlp.gate_proj.weight"] = (4 * hidden, hidden)
        out[f"{prefix}.mlp.up_proj.weight"] = (4 * hidden, hidden)
        out[f"{prefix}.mlp.down_proj.weight"] = (hidden, 4 * hidden)
        out[f"{prefix}.input_layernorm.weight"] = (hidden,)
    out["model.norm.weight"] = (hidden,)
    out["lm_head.weight"] = (vocab, hidden)
    return out


def write_checkpoint(path: str, size_mib: int, legacy: bool = False) -> None:
    """``torch.save`` of ``shapes(size_mib)``'s zeros at ``path`` unless it exists (``legacy``: the layout before
    PyTorch 1.6, ``_use_new_zipfile_serialization=False``)."""
    import torch

    if os.path.exists(path):
        return
    state = {name: torch.zeros(shape) for name, shape in shapes(size_mib).items()}
    partial = os.path.join(os.path.dirname(path), ".partial")
    os.makedirs(partial, exist_ok=True)
    # Saved as its own name in a folder of its own: the archive's top folder is the file's stem.
    torch.save(state, os.path.join(partial, os.path.basename(path)), _use_new_zipfile_serialization=not legacy)
    os.replace(os.path.join(partial, os.path.basename(path)), path)


def end_to_end(script: str, path: str, pycache: str) -> tuple[float, int]:
    # Bytecode cached as an installed package has it (torch's is, in site-packages); where the environment says
    # PYTHONDONTWRITEBYTECODE, every fresh process would compile stfs's modules again.
    env = {**os.environ, "PYTHONPATH": REPO, "PYTHONPYCACHEPREFIX": pycache}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
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
    counts = [0, 0]
    fd = os.open(path, os.O_RDONLY)
    try:

        def read(offset: int, size: int) -> bytes:
            counts[0] += 1
            counts[1] += size
            return os.pread(fd, size, offset)

        started = time.perf_counter()
        checkpoint = pytorch.read_checkpoint(read, os.fstat(fd).st_size, path=path)
        listing = [(t.name, t.dtype, list(t.shape)) for t in checkpoint.tensors]
        elapsed = time.perf_counter() - started
    finally:
        os.close(fd)
    assert listing
    return elapsed, counts[0], counts[1]


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
    with open(big, "rb") as stream:  # the page cache warm for both readers
        while stream.read(64 * MIB):
            pass
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
