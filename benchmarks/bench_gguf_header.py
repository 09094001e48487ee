#!/usr/bin/env python3
"""Reading a GGUF header with a Qwen-sized vocabulary: gguf-py's ``GGUFReader(path)`` against stfs's parser.

    flock /work/notes/bench.lock python3 benchmarks/bench_gguf_header.py [--vocab 151936] [--rounds 5]

Writes (with GGUFWriter) a GGUF holding a 151,936-token vocabulary as Qwen2's GGUFs carry it (tokens, scores,
token_type, merges), some model keys and a few small tensors; then, in one run, alternating, times
``GGUFReader(path)``, ``stfs.formats.gguf.read_header`` over ``os.pread`` (the requests it makes as it
grows its reads), and ``header_json`` on the result. Prints the medians side by side and the ratios
stfs / gguf-py (the SPEC §11 target for a mount's ready: at most 0.1).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gguf import GGUFReader  # noqa: E402

from benchmarks.benchlib import CountedReads, write_vocabulary_gguf  # noqa: E402
from stfs.formats import gguf as stfs_gguf  # noqa: E402


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
        path = os.path.join(work, "vocab.gguf")
        write_vocabulary_gguf(path, args.vocab)
        size = os.path.getsize(path)
        reference, parse, render = [], [], []
        requests = read_bytes = 0
        time_gguf_py(path)  # warm: the page cache and both imports
        time_stfs(path)
        for _ in range(args.rounds):
            reference.append(time_gguf_py(path))
            parsed, rendered, requests, read_bytes = time_stfs(path)
            parse.append(parsed)
            render.append(rendered)
        with open(path, "rb") as stream:
            head = stfs_gguf.read_header(lambda o, n: os.pread(stream.fileno(), n, o), size, path=path)
        ref, ours, json_s = statistics.median(reference), statistics.median(parse), statistics.median(render)
        print(f"file: {size} bytes, header {head.data_offset} bytes, vocabulary {args.vocab} tokens")
        print(f"{'gguf-py GGUFReader(path)':<36} {ref * 1000:9.1f} ms")
        print(f"{'stfs read_header':<36} {ours * 1000:9.1f} ms   ratio {ours / ref:.3f}")
        both = ours + json_s
        print(f"{'stfs read_header + header_json':<36} {both * 1000:9.1f} ms   ratio {both / ref:.3f}")
        bound = 2 * head.data_offset + (2 << 20)
        print(f"stfs reads: {requests} requests, {read_bytes} bytes (2 x header + 2 MiB = {bound})")
        print(f"medians of {args.rounds} rounds, alternating, warm page cache")


if __name__ == "__main__":
    main()
