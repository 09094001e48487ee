#!/usr/bin/env python3
"""Soak test: many concurrent readers over a mounted sharded model, every byte checked against the source.

    python3 benchmarks/soak.py --duration 600 --workdir /work/rel-data/soak

Makes a sharded model (``--shards`` files of about ``--shard-mb`` MB, big and tiny tensors),
mounts it with the background ``stfs mount`` of this checkout, then runs ``--threads`` reader threads and
``--processes`` reader processes until ``--duration`` seconds have passed. Each reader mixes:

* ``pread`` at random offsets and sizes (including reads past the end),
* a sequential read of a whole tensor in 256 KiB chunks,
* ``mmap`` of a tensor and page faults at random pages (hashed, so the GIL is released).

Before a sequential read or a mapping the reader drops the tensor's cached pages
(``posix_fadvise(DONTNEED)``), so the daemon keeps serving reads instead of the page
cache answering everything after the first pass. Every byte read is compared with
the same range read straight from the source file.

Prints, and writes as JSON to ``--json``: reads, bytes, errors (must be 0), and the daemon's
memory (VmRSS, RssAnon, VmHWM) at mount, after ``--warmup`` seconds and at the end.
Exit status 1 if any read failed or returned wrong bytes, or RSS grew more than 5% after warm-up.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import mmap
import multiprocessing
import os
import random
import shutil
import sys
import threading
import time
from dataclasses import asdict, dataclass, field

import numpy as np
from safetensors.numpy import save_file

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.benchlib import Mount  # noqa: E402

CHUNK = 256 * 1024
PAGE = mmap.PAGESIZE


@dataclass
class Target:
    path: str  # in the mount
    source: str
    offset: int  # absolute, in the source
    size: int


@dataclass
class Stats:
    reads: int = 0
    bytes: int = 0
    preads: int = 0
    sequential: int = 0
    page_faults: int = 0
    errors: int = 0
    messages: list[str] = field(default_factory=list)

    def add(self, other: Stats) -> None:
        for name in ("reads", "bytes", "preads", "sequential", "page_faults", "errors"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.messages.extend(other.messages[: max(0, 20 - len(self.messages))])


def make_model(folder: str, shards: int, shard_mb: int, seed: int = 7) -> str:
    """A sharded set of random tensors: a few multi-MB ones per shard and many small, odd-sized ones."""
    rng = np.random.default_rng(seed)
    os.makedirs(folder, exist_ok=True)
    weight_map: dict[str, str] = {}
    total = 0
    for shard_index in range(shards):
        name = f"model-{shard_index + 1:05d}-of-{shards:05d}.safetensors"
        arrays: dict[str, np.ndarray] = {}
        budget = shard_mb * 1_000_000
        layer = 0
        while budget > 0:
            big = min(budget, int(rng.integers(2, 9)) * 1_000_000)
            arrays[f"model.layers.{shard_index}.{layer}.mlp.weight"] = rng.integers(0, 256, big, dtype=np.uint8)
            for small in range(8):
                count = int(rng.integers(0, 5000))
                arrays[f"model.layers.{shard_index}.{layer}.norm{small}.bias"] = rng.standard_normal(count).astype(
                    [np.float16, np.float32, np.float64, np.int8][small % 4]
                )
            budget -= big
            layer += 1
        save_file(arrays, os.path.join(folder, name), metadata={"shard": str(shard_index)})
        for tensor, array in arrays.items():
            weight_map[tensor] = name
            total += array.nbytes
    index = os.path.join(folder, "model.safetensors.index.json")
    with open(index, "w") as stream:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, stream)
    return index


def targets_of(mountpoint: str) -> list[Target]:
    """Every tensor file of the mount, with where its bytes live (from its xattrs)."""
    found = []
    for folder, _, names in os.walk(os.path.join(mountpoint, "tensors")):
        for name in names:
            path = os.path.join(folder, name)
            found.append(
                Target(
                    path=path,
                    source=os.getxattr(path, "user.safetensors.file").decode(),
                    offset=int(os.getxattr(path, "user.safetensors.offset")),
                    size=os.stat(path).st_size,
                )
            )
    return sorted(found, key=lambda t: t.path)


def memory(pid: int) -> dict[str, int]:
    """VmRSS, RssAnon, VmHWM of ``pid`` in KiB, its thread count and CPU seconds (it is serving when they grow)."""
    values = {}
    with open(f"/proc/{pid}/status") as stream:
        for line in stream:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "RssAnon", "VmHWM", "Threads"):
                values[key] = int(rest.split()[0])
    with open(f"/proc/{pid}/stat") as stream:
        fields = stream.read().rsplit(")", 1)[1].split()
    values["cpu_s"] = round((int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"), 1)  # utime + stime
    return values


class Reader:
    def __init__(self, targets: list[Target], deadline: float, seed: int) -> None:
        self.targets = targets
        self.deadline = deadline
        self.random = random.Random(seed)
        self.stats = Stats()
        self.sources: dict[str, int] = {}

    def expected(self, target: Target, offset: int, size: int) -> bytes:
        fd = self.sources.get(target.source)
        if fd is None:
            fd = self.sources[target.source] = os.open(target.source, os.O_RDONLY)
        size = max(0, min(size, target.size - offset))
        return os.pread(fd, size, target.offset + offset)

    def fail(self, message: str) -> None:
        self.stats.errors += 1
        if len(self.stats.messages) < 20:
            self.stats.messages.append(message)

    def run(self) -> Stats:
        while time.monotonic() < self.deadline:
            target = self.random.choice(self.targets)
            choice = self.random.random()
            try:
                if choice < 0.5:
                    self.pread(target)
                elif choice < 0.75:
                    self.sequential(target)
                else:
                    self.page_faults(target)
            except OSError as exc:
                self.fail(f"{target.path}: {exc!r}")
        for fd in self.sources.values():
            os.close(fd)
        return self.stats

    def pread(self, target: Target) -> None:
        fd = os.open(target.path, os.O_RDONLY)
        try:
            for _ in range(16):
                offset = self.random.randrange(0, target.size + 2)
                size = self.random.choice([1, 7, PAGE, 65536, 131072 + 3, 1 << 20])
                data = os.pread(fd, size, offset)
                self.check(target, offset, data, size)
                self.stats.preads += 1
        finally:
            os.close(fd)

    def sequential(self, target: Target) -> None:
        fd = os.open(target.path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            offset = 0
            while True:
                data = os.read(fd, CHUNK)
                self.check(target, offset, data, CHUNK)
                if not data:
                    break
                offset += len(data)
            self.stats.sequential += 1
        finally:
            os.close(fd)

    def page_faults(self, target: Target) -> None:
        if target.size == 0:
            return
        fd = os.open(target.path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            with mmap.mmap(fd, target.size, prot=mmap.PROT_READ) as mapping:
                view = memoryview(mapping)
                try:
                    for _ in range(32):
                        offset = self.random.randrange(0, target.size)
                        size = min(self.random.choice([1, PAGE, 3 * PAGE + 5, 64 * 1024]), target.size - offset)
                        # hashlib releases the GIL for buffers over 2 KiB: faults run in parallel across threads
                        got = hashlib.blake2b(view[offset : offset + size]).digest()
                        want = hashlib.blake2b(self.expected(target, offset, size)).digest()
                        self.stats.reads += 1
                        self.stats.bytes += size
                        self.stats.page_faults += 1
                        if got != want:
                            self.fail(f"{target.path}: mmap bytes [{offset}, {offset + size}) differ from the source")
                finally:
                    view.release()
        finally:
            os.close(fd)

    def check(self, target: Target, offset: int, data: bytes, size: int) -> None:
        self.stats.reads += 1
        self.stats.bytes += len(data)
        want = self.expected(target, offset, size)
        if data != want:
            self.fail(f"{target.path}: {len(data)} bytes at {offset} differ from the source ({len(want)} expected)")


def _process_reader(targets: list[Target], deadline: float, seed: int, queue: multiprocessing.Queue) -> None:
    queue.put(asdict(Reader(targets, deadline, seed).run()))


def soak(args: argparse.Namespace) -> dict:
    workdir = os.path.abspath(args.workdir)
    model_dir = os.path.join(workdir, "model")
    mountpoint = os.path.join(workdir, "mnt")
    os.makedirs(mountpoint, exist_ok=True)
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if not os.path.exists(index):
        make_model(model_dir, args.shards, args.shard_mb)
    model_bytes = sum(os.path.getsize(os.path.join(model_dir, n)) for n in os.listdir(model_dir))
    with Mount(index, mountpoint, ["--log-file", os.path.join(workdir, "daemon.log")]) as mount:
        pid = mount.pid
        report: dict = {"daemon_pid": pid, "model_bytes": model_bytes, "memory_at_mount": memory(pid)}
        targets = targets_of(mountpoint)
        report["tensors"] = len(targets)
        start = time.monotonic()
        deadline = start + args.duration
        # processes first: fork before this process has any thread
        context = multiprocessing.get_context("fork")
        queue: multiprocessing.Queue = context.Queue()
        processes = [
            context.Process(target=_process_reader, args=(targets, deadline, 1000 + i, queue))
            for i in range(args.processes)
        ]
        for process in processes:
            process.start()
        readers = [Reader(targets, deadline, i) for i in range(args.threads)]
        threads = [threading.Thread(target=reader.run) for reader in readers]
        for thread in threads:
            thread.start()
        timeline = []
        warm = None
        while time.monotonic() < deadline:
            time.sleep(min(10.0, max(0.0, deadline - time.monotonic())))
            sample = {"t": round(time.monotonic() - start), **memory(pid)}
            timeline.append(sample)
            if warm is None and time.monotonic() - start >= args.warmup:
                warm = sample
            print(f"t={sample['t']}s daemon {sample}", flush=True)
        totals = Stats()
        for thread, reader in zip(threads, readers, strict=True):
            thread.join()
            totals.add(reader.stats)
        for _ in processes:
            totals.add(Stats(**queue.get(timeout=120)))
        for process in processes:
            process.join(timeout=60)
        report.update(
            {
                "duration_s": round(time.monotonic() - start, 1),
                "readers": {"threads": args.threads, "processes": args.processes},
                "reads": totals.reads,
                "bytes": totals.bytes,
                "preads": totals.preads,
                "sequential_reads": totals.sequential,
                "mmap_page_fault_reads": totals.page_faults,
                "errors": totals.errors,
                "error_messages": totals.messages,
                "memory_after_warmup": warm or timeline[0],
                "memory_at_end": memory(pid),
                "timeline": timeline,
                "mounted_at_end": os.path.ismount(mountpoint),
            }
        )
        base = report["memory_after_warmup"]["VmRSS"]
        report["rss_growth_after_warmup"] = round(report["memory_at_end"]["VmRSS"] / base - 1, 4)
        at_mount = report["memory_at_mount"]["VmRSS"]
        report["rss_growth_from_mount"] = round(report["memory_at_end"]["VmRSS"] / at_mount - 1, 4)
        return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=60, help="seconds of reading (default 60)")
    parser.add_argument("--warmup", type=float, default=60, help="RSS baseline taken after this many seconds")
    parser.add_argument("--workdir", default="/work/rel-data/soak")
    parser.add_argument("--shards", type=int, default=3)
    parser.add_argument("--shard-mb", type=int, default=40)
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--processes", type=int, default=8)
    parser.add_argument("--json", help="write the report here")
    parser.add_argument("--clean", action="store_true", help="delete the generated model afterwards")
    args = parser.parse_args()
    report = soak(args)
    if args.clean:
        shutil.rmtree(os.path.join(args.workdir, "model"), ignore_errors=True)
    summary = {k: v for k, v in report.items() if k != "timeline"}
    print(json.dumps(summary, indent=2))
    if args.json:
        with open(args.json, "w") as stream:
            json.dump(report, stream, indent=2)
    ok = report["errors"] == 0 and report["rss_growth_after_warmup"] <= 0.05 and report["mounted_at_end"]
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
