"""What the benchmark scripts share: which checkout's stfs they mount, how they time a read, how they write a model.

One module that every script imports (bench.py, bench_remote.py and the others), so there is one ``STFS_REPO``
whichever script runs as ``__main__``, and no script imports another one back.
"""

from __future__ import annotations

import json
import os
import random
import re
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MIB = 1 << 20
PAGE = 4096

MOUNT_ARGS: list[str] = []  # --mount-arg: more `stfs mount` arguments for every mount
STFS_REPO = [REPO]  # the checkout whose stfs the mounts run (--stfs; the ab section switches it run by run)


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def environment() -> dict[str, str]:
    env = dict(os.environ, LC_ALL="C")
    env["PYTHONPATH"] = STFS_REPO[0] + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def stfs_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "stfs", *args]


def dd_seconds(path: str, skip: int = 0, count: int | None = None) -> float:
    """Seconds dd reports for copying the range to /dev/null with 1 MiB blocks."""
    command = ["dd", f"if={path}", "of=/dev/null", "bs=1M"]
    if skip or count is not None:
        command.append("iflag=skip_bytes,count_bytes")
        command.append(f"skip={skip}")
        if count is not None:
            command.append(f"count={count}")
    result = subprocess.run(command, capture_output=True, text=True, env=environment(), check=True)
    match = re.search(r"copied, ([0-9.e+-]+) s", result.stderr)
    if not match:
        raise RuntimeError(f"cannot parse dd output: {result.stderr!r}")
    return float(match.group(1))


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` so far."""
    with open(f"/proc/{pid}/stat") as stream:
        fields = stream.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def proc_fields(pid: int, name: str) -> dict[str, int]:
    """``kB`` fields of /proc/PID/status or smaps_rollup, in bytes."""
    values: dict[str, int] = {}
    with open(f"/proc/{pid}/{name}") as stream:
        for line in stream:
            parts = line.split()
            if len(parts) >= 3 and parts[2] == "kB":
                values[parts[0].rstrip(":")] = int(parts[1]) * 1024
    return values


def write_model(path: str, tensors: list[tuple[str, str, list[int], int]], fill: Callable[[Any, int], None]) -> int:
    """Write a safetensors file by hand; ``tensors`` are (name, dtype, shape, nbytes); return the header length."""
    header: dict[str, Any] = {}
    position = 0
    for name, dtype, shape, size in tensors:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [position, position + size]}
        position += size
    body = json.dumps(header, separators=(",", ":")).encode()
    body += b" " * (-len(body) % 8)
    temporary = path + ".tmp"
    with open(temporary, "wb") as stream:
        stream.write(struct.pack("<Q", len(body)))
        stream.write(body)
        fill(stream, position)
    os.replace(temporary, path)
    return len(body)


def random_fill(seed: int) -> Callable[[Any, int], None]:
    """A ``write_model`` fill of random bytes, quickly: a 16 MiB chunk, rotated so no page repeats."""

    def fill(stream: Any, total: int) -> None:
        chunk = random.Random(seed).randbytes(16 * MIB)
        written = 0
        while written < total:
            piece = chunk[: min(len(chunk), total - written)]
            stream.write(piece)
            written += len(piece)
            chunk = chunk[7:] + chunk[:7]  # not the same page twice

    return fill
