#!/usr/bin/env python3
"""GGUF sources, side by side in one run (warm page cache):

    flock /work/notes/bench.lock python3 benchmarks/bench_gguf.py [--data DIR] [--rounds 3]

* ready: ``stfs mount`` of a GGUF holding a 151,936-token vocabulary (benchlib's Qwen-shaped file, as in
  bench_gguf_header.py)
  until it returns, against gguf-py's ``GGUFReader(path)`` of the same file (target: at most 0.1x);
* f32: ``cat`` of the ``f32/`` file of a 4096 x 4096 Q4_K tensor (random blocks) on a fresh mount, against
  ``gguf.quants.dequantize`` of the same bytes in one process (target: at most 1.25x);
* tensors/: ``dd bs=1M`` of that tensor's ``tensors/`` file on a fresh mount, against ``dd`` of the same bytes
  straight from the file (the source in the page cache), and whether stfs._native answered the reads;
* info over HTTP: requests and bytes of ``stfs info URL --json`` of the vocabulary file behind nginx, against
  its header's size (target: at most 4 requests and twice the header plus 2 MiB).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter, quants  # noqa: E402
from gguf.constants import GGML_QUANT_SIZES  # noqa: E402

from benchmarks.benchlib import (  # noqa: E402
    Mount,
    cat_seconds,
    dd_seconds,
    environment,
    stfs_command,
    warm,
    write_vocabulary_gguf,
)
from stfs.formats import gguf  # noqa: E402
from tests.servers import Nginx  # noqa: E402

SIDE = 4096


def write_q4k(path: str) -> tuple[int, int]:
    """A GGUF of one 4096 x 4096 Q4_K tensor of random blocks; its (offset, size) in the file."""
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType.Q4_K]
    blocks = np.random.default_rng(0).integers(0, 256, size=(SIDE, SIDE // block * size), dtype=np.uint8)
    blocks.reshape(-1, size)[:, :4] = np.frombuffer(np.array([0.01, 0.001], dtype="<f2").tobytes(), dtype=np.uint8)
    writer = GGUFWriter(path, "llama")
    writer.add_tensor("blk.0.ffn_up.weight", blocks, raw_dtype=GGMLQuantizationType.Q4_K)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    [tensor] = GGUFReader(path).tensors
    return int(tensor.data_offset), int(tensor.n_bytes)


def timed(work: object) -> float:
    began = time.perf_counter()
    work()  # type: ignore[operator]
    return time.perf_counter() - began


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default=os.path.join(tempfile.gettempdir(), "stfs-bench-gguf"))
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    data = Path(args.data)
    data.mkdir(parents=True, exist_ok=True)
    vocabulary, q4k = str(data / "qwen-vocab.gguf"), str(data / "q4k.gguf")
    if not os.path.exists(vocabulary):
        write_vocabulary_gguf(vocabulary, 151_936)
    offset, size = write_q4k(q4k) if not os.path.exists(q4k) else (0, 0)
    if not size:
        [tensor] = GGUFReader(q4k).tensors
        offset, size = int(tensor.data_offset), int(tensor.n_bytes)
    warm(vocabulary, q4k)
    mnt = str(data / "mnt")
    rows: dict[str, list[float]] = {name: [] for name in ("ready", "reader", "f32", "dequantize", "dd", "plain")}
    native = []
    print(f"load {os.getloadavg()} at {time.strftime('%H:%M:%S')}", flush=True)
    for _ in range(args.rounds):
        with Mount(vocabulary, mnt) as mount:
            rows["ready"].append(mount.seconds)
        rows["reader"].append(timed(lambda: GGUFReader(vocabulary)))

        with Mount(q4k, mnt, ["--view", "f32", "--log-file", str(data / "daemon.log")]):
            rows["f32"].append(cat_seconds(f"{mnt}/f32/blk/0/ffn_up/weight"))

        def dequantize() -> None:
            with open(q4k, "rb") as stream:
                stream.seek(offset)
                raw = np.frombuffer(stream.read(size), dtype=np.uint8).reshape(SIDE, -1)
            with np.errstate(all="ignore"):
                quants.dequantize(raw, GGMLQuantizationType.Q4_K)

        rows["dequantize"].append(timed(dequantize))

        (data / "daemon.log").unlink(missing_ok=True)
        with Mount(q4k, mnt, ["--log-file", str(data / "daemon.log")]):
            rows["dd"].append(dd_seconds(f"{mnt}/tensors/blk/0/ffn_up/weight"))
        native.append("answered in C" in (data / "daemon.log").read_text())
        rows["plain"].append(dd_seconds(q4k, skip=offset, count=size))
        print({k: round(v[-1], 4) for k, v in rows.items()}, flush=True)
    median = {name: statistics.median(values) for name, values in rows.items()}

    nginx = Nginx(data / "nginx")
    nginx.root.mkdir(parents=True, exist_ok=True)
    nginx.start()
    url = nginx.put("qwen-vocab.gguf", Path(vocabulary).read_bytes())
    try:
        result = subprocess.run(stfs_command("info", url, "--json"), capture_output=True, text=True, env=environment())
        transfer = json.loads(result.stdout)["transfer"]
    finally:
        nginx.stop()
    with open(vocabulary, "rb") as stream:
        whole = stream.read()
    header = gguf.read_header(lambda o, n: whole[o : o + n], len(whole), path=vocabulary)

    m = median
    mib = 1 << 20
    print(f"ready: stfs mount {m['ready']:.3f} s, GGUFReader {m['reader']:.3f} s: {m['ready'] / m['reader']:.3f}x")
    ratio, rate = m["f32"] / m["dequantize"], m["plain"] / m["dd"]
    print(f"f32/ of 4096x4096 Q4_K: cat {m['f32']:.3f} s, dequantize {m['dequantize']:.3f} s: {ratio:.2f}x")
    print(f"tensors/ of it ({size / mib:.0f} MiB): {rate:.2f}x plain dd's rate; answered in C: {all(native)}")
    print(f"info over HTTP: {transfer['requests']} requests, {transfer['bytes'] / mib:.2f} MiB")
    print(f"  for a {header.header_size / mib:.2f} MiB header (bound {2 * header.header_size / mib + 2:.2f} MiB)")
    print(f"load {os.getloadavg()} at {time.strftime('%H:%M:%S')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
