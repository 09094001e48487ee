#!/usr/bin/env python3
"""Benchmark ``--view stats`` and ``--view png`` (SPEC §9) against a dd of the tensor on the same mount.

    python3 benchmarks/bench_inspect.py [--data DIR] [--runs 5] [--size-mib 256] [--out FILE.json]

A BF16 tensor of --size-mib (shape 16384 x 8192 at 256 MiB: a 1024 x 1024 heatmap of 16 x 8 values a pixel),
normal values, in --data (default /tmp/stfs-bench-inspect). Each run, in turn, each on a fresh mount (nothing
cached in the daemon or the mount's page cache) with the source read just before (its page cache warm: a
mount drops the source's pages it has read, so the one before would leave it cold):

  dd       dd bs=1M of tensors/w: the seconds dd reports
  stats    open stats/w.json and read its first byte: the seconds (the whole tensor is read and summed)
  png      the same for png/w.png (the heatmap made and encoded)
  rss      the daemon's RssAnon growth over the first read (peak, sampled every 5 ms)

and, in-process (no mount), what each costs per MB of tensor: NumPy's part (stats: np.bincount of the codes;
png: the pixel sums) and the PNG encoders (the standard library's zlib at level 0, and Pillow's at
compress_level=0 when Pillow is installed) for the finished 1024 x 1024 image.

Prints medians, and the medians of each run's ratios stats/dd (target <= 3) and png/dd (target <= 4), with
uptime; --out writes JSON.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import subprocess
import sys
import time
from functools import partial
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from benchmarks.benchlib import (  # noqa: E402
    MIB,
    Mount,
    bf16_fill,
    dd_seconds,
    environment,
    log,
    peak_rss_while,
    warm,
    write_model,
)

TARGETS = {"stats_vs_dd": 3.0, "png_vs_dd": 4.0}


def write_tensor(path: str, size_mib: int) -> tuple[int, int]:
    """A one-tensor BF16 model of ``size_mib`` MiB (normal values), written once; its (rows, columns)."""
    columns = 8192
    rows = size_mib * MIB // 2 // columns
    if not os.path.exists(path):
        write_model(path, [("w", "BF16", [rows, columns], 2 * rows * columns)], bf16_fill(0))
    return rows, columns


def first_byte_seconds(path: str) -> float:
    started = time.perf_counter()
    with open(path, "rb") as stream:
        stream.read(1)
    return time.perf_counter() - started


def one_run(source: str, mountpoint: str) -> dict[str, float]:
    found: dict[str, float] = {}
    for what, name in (("dd", "tensors/w"), ("stats", "stats/w.json"), ("png", "png/w.png")):
        warm(source)
        with Mount(source, mountpoint, options=["view=stats,view=png"]) as mount:
            path = os.path.join(mountpoint, name)
            before = peak_rss_while(mount.pid, lambda: 0.0)[1]
            measure = dd_seconds if what == "dd" else first_byte_seconds
            seconds, peak = peak_rss_while(mount.pid, partial(measure, path))
            found[what] = seconds
            found[f"{what}_rss_growth_mib"] = (peak - before) / MIB
    return found


def in_process(source: str, size_mib: int) -> dict[str, float]:
    """Seconds per MB of tensor of each part, in this process, from the warm source file."""
    import zlib

    import numpy as np

    from stfs.chunks import TensorBytes
    from stfs.heatmap import colour_scale, colours, encode, pixel_means, pixel_sums
    from stfs.tensor_stats import summarize

    with open(source, "rb") as stream:
        length = int.from_bytes(stream.read(8), "little")
        header = json.loads(stream.read(length))
    info = header["w"]
    begin, end = info["data_offsets"]
    fd = os.open(source, os.O_RDONLY)

    def read(key: str, offset: int, view: memoryview, span: tuple[int, int]) -> int:
        return os.preadv(fd, [view], offset)

    tensor = TensorBytes(source, 8 + length + begin, end - begin, info["dtype"], tuple(info["shape"]), read)
    megabytes = tensor.size / 1e6
    found: dict[str, float] = {}
    try:
        started = time.perf_counter()
        for _ in tensor.chunks():
            pass
        found["read_s_per_mb"] = (time.perf_counter() - started) / megabytes
        started = time.perf_counter()
        summarize(tensor)
        found["stats_s_per_mb"] = (time.perf_counter() - started) / megabytes
        started = time.perf_counter()
        sums, finite, _ = pixel_sums(tensor)
        found["pixel_sums_s_per_mb"] = (time.perf_counter() - started) / megabytes
    finally:
        os.close(fd)
    means = pixel_means(sums, finite)
    scale, m = colour_scale(means[finite > 0])
    rgb = colours(means, finite, m)
    started = time.perf_counter()
    for _ in range(5):
        encode(rgb, scale, m)
    found["zlib_level0_encode_s"] = (time.perf_counter() - started) / 5
    found["zlib_level0_bytes"] = len(encode(rgb, scale, m))
    found["zlib_level6_bytes"] = len(zlib.compress(np.ascontiguousarray(rgb).tobytes(), 6))
    try:
        from PIL import Image
    except ImportError:
        return found
    image = Image.fromarray(rgb)
    started = time.perf_counter()
    for _ in range(5):
        stream = io.BytesIO()
        image.save(stream, format="PNG", compress_level=0)
    found["pillow_level0_encode_s"] = (time.perf_counter() - started) / 5
    found["pillow_level0_bytes"] = len(stream.getvalue())
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", default="/tmp/stfs-bench-inspect")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--size-mib", type=int, default=256)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    os.makedirs(args.data, exist_ok=True)
    source = os.path.join(args.data, f"bf16-{args.size_mib}m.safetensors")
    rows, columns = write_tensor(source, args.size_mib)
    mountpoint = os.path.join(args.data, "mnt")
    runs = []
    for index in range(args.runs):
        runs.append(one_run(source, mountpoint))
        run = runs[-1]
        shown = ", ".join(f"{key} {value:.3f}" for key, value in run.items())
        log(f"run {index + 1}: {shown}; stats/dd {run['stats'] / run['dd']:.2f}, png/dd {run['png'] / run['dd']:.2f}")
    medians = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
    ratios = {f"{what}_vs_dd": statistics.median(run[what] / run["dd"] for run in runs) for what in ("stats", "png")}
    warm(source)
    parts = in_process(source, args.size_mib)
    uptime = subprocess.run(["uptime"], capture_output=True, text=True, check=False, env=environment()).stdout
    results: dict[str, Any] = {
        "tensor": {"dtype": "BF16", "shape": [rows, columns], "mib": args.size_mib},
        "runs": runs,
        "medians": medians,
        "ratios": ratios,
        "per_mb": parts,
        "uptime": uptime.strip(),
    }
    print(f"BF16 [{rows}, {columns}] ({args.size_mib} MiB), median of {args.runs} runs, fresh mounts, source warm")
    print(f"  dd tensors/w          {medians['dd']:.3f} s")
    for what in ("stats", "png"):
        target = TARGETS[f"{what}_vs_dd"]
        ratio = ratios[f"{what}_vs_dd"]
        verdict = "ok" if ratio <= target else "MISSED"
        print(
            f"  first byte of {what:5s}   {medians[what]:.3f} s, {ratio:.2f} x dd (target <= {target:g}: {verdict})"
            f"   RssAnon +{medians[f'{what}_rss_growth_mib']:.1f} MiB"
        )
    print("  per MB of tensor, in process:")
    for key, value in parts.items():
        shown = f"{value * 1e3:.3f} ms" if key.endswith("_s") or key.endswith("_s_per_mb") else f"{value:,}"
        print(f"    {key:26s} {shown}")
    print(f"  uptime: {uptime.strip()}")
    if args.out:
        with open(args.out, "w") as stream:
            json.dump(results, stream, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
