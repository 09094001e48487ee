#!/usr/bin/env python3
"""Two stfs checkouts over the same nginx, alternated round by round: each figure ÷ curl of the same bytes.

    python3 benchmarks/bench_remote_ab.py --data DIR --checkout main=/work/main --checkout this=. \\
        [--rounds 4] [-o max_read=131072] [--https]

bench_remote's 1 GiB model (eight 128 MiB tensors) behind bench_remote's nginx; per round and checkout, each on
a fresh mount: ``dd`` of tensor ``t2``, ``dd`` of ``files/model.safetensors``, ``cat`` of every ``tensors/``
file, each followed by ``curl -r`` of as many bytes. ``--tensors N --tensor-mib M``: a model of N tensors of
M MiB instead (written once under DIR). The order of the checkouts flips every round. Prints each
ratio, then the daemon's CPU-seconds per GB of each read, and their medians. ``--cache-dir fresh``: every mount
keeps what it fetches in a new --cache-dir (what writing it costs); ``--cache-dir kept``: a mount first reads the
same into a new --cache-dir, and the one measured reads with what it kept. ``--https``: the same over nginx's
TLS port (a test CA, trusted through ``SSL_CERT_FILE``). ``--latency S``: through tests/servers.py's ``FaultProxy``
adding S seconds to every request (bench_remote's +20 ms case is ``--latency 0.02``). ``--hot``: instead,
``dd`` of ``t2`` four times on one mount, the page cache dropped before each (the first fetches, the rest find
every block in the block cache).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from benchmarks import bench_remote  # noqa: E402
from benchmarks.benchlib import (  # noqa: E402
    STFS_REPO,
    Mount,
    cat_seconds,
    cpu_seconds,
    dd_seconds,
    drop_from_page_cache,
)
from tests.servers import FaultProxy, Nginx, make_tls  # noqa: E402


def curl_seconds(url: str, size: int) -> float:
    trust = ["--cacert", os.environ["SSL_CERT_FILE"]] if url.startswith("https:") else []
    began = time.monotonic()
    subprocess.run(["curl", "-s", *trust, "-o", "/dev/null", "-r", f"0-{size - 1}", url], check=True)
    return time.monotonic() - began


def one_round(
    url: str, mnt: str, spans: dict[str, tuple[int, int]], options: list[str], cache_dir: str, data: str
) -> list[float]:
    """stfs ÷ curl for one tensor, files/ and the whole of tensors/, then the daemon's CPU-seconds per GB of each.
    ``cache_dir`` ``fresh``: each mount keeps what it fetches in a new, empty --cache-dir; ``kept``: a mount first
    reads the same into a new --cache-dir, and the mount measured reads with what it kept."""
    ratios, cpu = [], []
    for what in ("tensors/t2", f"files/{url.rpartition('/')[2]}", "cat"):
        folder = os.path.join(data, "cache-dir")
        shutil.rmtree(folder, ignore_errors=True)
        extra = options if cache_dir == "none" else [*options, "-o", f"cache_dir={folder}"]
        for measured in (False, True) if cache_dir == "kept" else (True,):
            with Mount(url, mnt, extra) as mount:
                before = cpu_seconds(mount.pid)
                seconds, size = read(mount.mountpoint, what, spans)
                cpu.append((cpu_seconds(mount.pid) - before) / (size / 1e9))
            if not measured:
                cpu.pop()
        ratios.append(curl_seconds(url, size) / seconds)
    return ratios + cpu


def read(mountpoint: str, what: str, spans: dict[str, tuple[int, int]]) -> tuple[float, int]:
    """Seconds to read ``what`` of a mount (``cat``: every tensors/ file in file order), and its bytes."""
    if what == "cat":
        in_file_order = sorted(spans, key=spans.get)
        paths = [os.path.join(mountpoint, "tensors", name) for name in in_file_order]
        return cat_seconds(*paths), sum(hi - lo for lo, hi in spans.values())
    path = os.path.join(mountpoint, what)
    return dd_seconds(path), os.path.getsize(path)


def hot(url: str, mnt: str, options: list[str]) -> list[float]:
    """GB/s of four reads of t2 on one mount, its page cache dropped before each."""
    speeds = []
    with Mount(url, mnt, options) as mount:
        path = os.path.join(mount.mountpoint, "tensors", "t2")
        for _ in range(4):
            drop_from_page_cache(path)
            speeds.append(os.path.getsize(path) / dd_seconds(path) / 1e9)
    return speeds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default="/tmp/stfs-bench")
    parser.add_argument("--checkout", action="append", default=[], help="LABEL=PATH (two or more)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("-o", dest="option", action="append", default=[], help="stfs mount -o options")
    parser.add_argument("--hot", action="store_true")
    parser.add_argument(
        "--cache-dir",
        choices=("none", "fresh", "kept"),
        default="none",
        help="fresh: each mount keeps what it fetches in a new --cache-dir; kept: reads what a mount before it kept",
    )
    parser.add_argument("--https", action="store_true", help="over nginx's TLS port")
    parser.add_argument("--latency", type=float, default=0.0, help="seconds added to every request by a proxy")
    parser.add_argument("--tensors", type=int, default=bench_remote.TENSORS, help="tensors of the model")
    parser.add_argument("--tensor-mib", type=int, default=bench_remote.TENSOR_BYTES >> 20, help="MiB of each")
    args = parser.parse_args()
    checkouts = [spec.partition("=")[::2] for spec in args.checkout] or [("this", REPO)]
    data = os.path.join(args.data, "remote")
    tls = make_tls(Path(data) / "tls") if args.https else None
    if tls is not None:
        os.environ["SSL_CERT_FILE"] = str(tls.bundle)  # the daemons and curl trust the test CA this way
    nginx = Nginx(Path(data) / "nginx", tls=tls)
    nginx.root.mkdir(parents=True, exist_ok=True)
    each = args.tensor_mib << 20
    standard = (args.tensors, each) == (bench_remote.TENSORS, bench_remote.TENSOR_BYTES)
    name = "model.safetensors" if standard else f"model-{args.tensors}x{args.tensor_mib}M.safetensors"
    model, spans = bench_remote.the_model(nginx.root, name, args.tensors, each)
    options = [item for option in args.option for item in ("-o", option)]
    nginx.start()
    proxy = FaultProxy(nginx.url).start() if args.latency else None
    if proxy is not None:
        proxy.set_latency(args.latency)
    base = proxy.url if proxy is not None else nginx.https_url if tls else nginx.url
    results: dict[str, list[list[float]]] = {label: [] for label, _ in checkouts}
    print(f"load {os.getloadavg()} at {time.strftime('%H:%M:%S')}", flush=True)
    try:
        for number in range(args.rounds):
            for label, path in checkouts if number % 2 == 0 else checkouts[::-1]:
                STFS_REPO[0] = os.path.abspath(path)
                url, mnt = f"{base}/{model}", os.path.join(data, "mnt")
                figures = (
                    hot(url, mnt, options) if args.hot else one_round(url, mnt, spans, options, args.cache_dir, data)
                )
                results[label].append(figures)
                unit = "GB/s" if args.hot else "x curl (one tensor, files/, cat tensors/), then CPU-s/GB of each"
                print(f"round {number} {label}: " + " ".join(f"{f:.2f}" for f in figures) + f" {unit}", flush=True)
    finally:
        if proxy is not None:
            proxy.stop()
        nginx.stop()
    for label, rows in results.items():
        medians = [statistics.median(row[i] for row in rows) for i in range(len(rows[0]))]
        print(f"{label} medians: " + " ".join(f"{m:.2f}" for m in medians))
    print(f"load {os.getloadavg()} at {time.strftime('%H:%M:%S')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
