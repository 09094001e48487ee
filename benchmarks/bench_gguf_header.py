#!/usr/bin/env python3
"""Reading a GGUF header with a Qwen-sized vocabulary: gguf-py's ``GGUFReader(path)`` against stfs's parser.

    flock /work/notes/bench.lock python3 benchmarks/bench_gguf_header.py [--vocab 151936] [--rounds 5]

Writes (with GGUFWriter) a GGUF holding a 151,936-token vocabulary as Qwen2's GGUFs carry it (tokens, scores,
token_type, merges), some model keys and a few small tensors; then, in one run, alternating, times
``GGUFReader(path)``, ``stfs.formats.gguf.read_header`` over ``os.pread`` (the requests it makes as it
grows its reads), ``header_json`` on the result, and ``stfs mount`` of the file until it returns (the mount
ready, the wall clock of the command as a user runs it: ``python3 -m stfs mount FILE MNT``, this checkout's
stfs), with the same for a GGUF of one small tensor (the floor: a mount's own start). Prints the medians side by
side and the ratios stfs / gguf-py (the target for a mount's ready: at most 0.1).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gguf import GGUFReader, GGUFWriter  # noqa: E402

from benchmarks.benchlib import CountedReads, environment, stfs_command, write_vocabulary_gguf  # noqa: E402
from stfs.formats import gguf as stfs_gguf  # noqa: E402


def write_tiny(path: str) -> None:
    writer = GGUFWriter(path, "qwen2")
    writer.add_tensor("blk.0.attn_norm.weight", np.ones(896, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def time_mount(path: str, mountpoint: str) -> float:
    """Seconds from ``stfs mount`` starting until it returns (the mount answers); then unmounted, its daemon gone."""
    started = time.perf_counter()
    subprocess.run(stfs_command("mount", path, mountpoint), check=True, env=environment())
    elapsed = time.perf_counter() - started
    pid = int(os.getxattr(mountpoint, "user.stfs.pid"))
    subprocess.run(["fusermount3", "-u", mountpoint], check=True)
    while os.path.exists(f"/proc/{pid}"):
        with open(f"/proc/{pid}/stat") as stream:
            if stream.read().rpartition(")")[2].split()[0] == "Z":
                break
        time.sleep(0.01)
    return elapsed


def time_gguf_py(path: str) -> float:
    started = time.perf_counter()
    reader = GGUFReader(path)
    elapsed = time.perf_counter() - started
    assert len(reader.tensors) == 8
    return elapsed


def time_stfs(path: str) -> tuple[float, float, int, int]:
    """Seconds to read the header, seconds to make header.json from it, requests and bytes read."""
    fd = os.open(path, os.O_RDONLY)
    try:
        read = CountedReads(fd)
        started = time.perf_counter()
        header = stfs_gguf.read_header(read, os.fstat(fd).st_size, path=path)
        parsed = time.perf_counter() - started
        started = time.perf_counter()
        text = stfs_gguf.header_json(header)
        rendered = time.perf_counter() - started
    finally:
        os.close(fd)
    assert len(header.tensors) == 8 and text.startswith(b'{"__metadata__"')
    return parsed, rendered, read.requests, read.bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="stfs-bench-gguf-", dir=os.environ.get("TMPDIR")) as work:
        path, tiny, mountpoint = (os.path.join(work, name) for name in ("vocab.gguf", "tiny.gguf", "mnt"))
        write_vocabulary_gguf(path, args.vocab)
        write_tiny(tiny)
        os.mkdir(mountpoint)
        size = os.path.getsize(path)
        reference, parse, render, mount, floor = [], [], [], [], []
        requests = read_bytes = 0
        time_gguf_py(path)  # warm: the page cache and both imports
        time_stfs(path)
        time_mount(path, mountpoint)
        for _ in range(args.rounds):
            reference.append(time_gguf_py(path))
            parsed, rendered, requests, read_bytes = time_stfs(path)
            parse.append(parsed)
            render.append(rendered)
            mount.append(time_mount(path, mountpoint))
            floor.append(time_mount(tiny, mountpoint))
        with open(path, "rb") as stream:
            head = stfs_gguf.read_header(lambda o, n: os.pread(stream.fileno(), n, o), size, path=path)
        ref, ours, json_s = statistics.median(reference), statistics.median(parse), statistics.median(render)
        print(f"file: {size} bytes, header {head.data_offset} bytes, vocabulary {args.vocab} tokens")
        print(f"{'gguf-py GGUFReader(path)':<36} {ref * 1000:9.1f} ms")
        print(f"{'stfs read_header':<36} {ours * 1000:9.1f} ms   ratio {ours / ref:.3f}")
        both = ours + json_s
        print(f"{'stfs read_header + header_json':<36} {both * 1000:9.1f} ms   ratio {both / ref:.3f}")
        ready, least = statistics.median(mount), statistics.median(floor)
        print(f"{'stfs mount, until it returns':<36} {ready * 1000:9.1f} ms   ratio {ready / ref:.3f}")
        print(f"{'  the floor: stfs mount of one tensor':<36} {least * 1000:9.1f} ms   ratio {least / ref:.3f}")
        bound = 2 * head.data_offset + (2 << 20)
        print(f"stfs reads: {requests} requests, {read_bytes} bytes (2 x header + 2 MiB = {bound})")
        print(f"medians of {args.rounds} rounds, alternating, warm page cache; load {os.getloadavg()}")


if __name__ == "__main__":
    main()
