"""A model in an OCI registry: what `stfs info` and the first tensor cost against pulling the artifact.

A safetensors model (``--size-mib``, 16 F32 tensors) is pushed as ModelPack lays it out (one raw layer) to a real
registry (Debian's docker-registry, CNCF distribution 2.8) on 127.0.0.1. Each round, side by side:

* ``stfs info oci://…``: seconds, and requests and bytes as its ``--json`` reports them;
* the first tensor: ``stfs mount`` then ``cat`` of ``tensors/t00`` (seconds), and the bytes a first tensor's read
  fetches (the same source opened in this process, so its counts can be read);
* a pull: the manifest and every blob downloaded whole by ``curl`` (what ``oras pull``, ``docker model pull`` or
  ``ollama pull`` must transfer before the first tensor; the ``oras`` CLI is not packaged for Debian).

    python3 benchmarks/bench_oci.py [--size-mib 256] [--rounds 3]
    python3 benchmarks/bench_oci.py --capped [--size-mib 1024] [--rounds 1]   # benchmarks/bench_oci_capped.py

Prints each round and the medians with ratios (stfs ÷ pull).
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

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.benchlib import MIB, REPO, Mount, cat_seconds, environment, log, random_fill, write_model  # noqa: E402
from stfs.model import resolve  # noqa: E402
from stfs.sources import open_source  # noqa: E402
from tests.registry import Registry, modelpack, push  # noqa: E402

TENSORS = 16


def timed(command: list[str]) -> tuple[float, str]:
    started = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, env=environment(), cwd=REPO, check=True)
    return time.perf_counter() - started, result.stdout


def first_tensor_bytes(source_url: str) -> tuple[int, int, int]:
    """(requests, bytes fetched, the tensor's size) for opening the model and reading its first tensor whole."""
    source, key = open_source(source_url, mounting=True)
    try:
        (model,) = resolve(key, source)
        tensor = next(t for t in model.tensors if t.name == "t00")
        buffer = memoryview(bytearray(tensor.size))
        source.read_into(tensor.file, tensor.offset, buffer, (tensor.offset, tensor.offset + tensor.size))
        counts = source.transfer()  # type: ignore[attr-defined]
        return counts["requests"], counts["bytes"], tensor.size
    finally:
        source.close()


def pull(registry: Registry, repo: str, tag: str) -> tuple[float, int]:
    """Seconds and bytes to download the manifest and every blob of ``repo:tag`` with curl."""
    started = time.perf_counter()
    accept = "application/vnd.oci.image.manifest.v1+json"
    manifest = subprocess.run(
        ["curl", "-sf", "-H", f"Accept: {accept}", f"{registry.url}/v2/{repo}/manifests/{tag}"],
        capture_output=True,
        check=True,
    ).stdout
    total = len(manifest)
    document = json.loads(manifest)
    for blob in [document["config"], *document["layers"]]:
        out = subprocess.run(
            [
                "curl",
                "-sf",
                "-o",
                "/dev/null",
                "-w",
                "%{size_download}",
                f"{registry.url}/v2/{repo}/blobs/{blob['digest']}",
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        total += int(out)
    return time.perf_counter() - started, total


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mib", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--capped", action="store_true", help="issue #50's targets: skopeo copy through 50 MB/s")
    args = parser.parse_args()
    if args.capped:
        from benchmarks.bench_oci_capped import run

        return run(args.size_mib, args.rounds)
    with tempfile.TemporaryDirectory(prefix="stfs-bench-oci-") as scratch:
        work = Path(scratch)
        size = args.size_mib * MIB // TENSORS // 4 * 4
        model = work / "model.safetensors"
        write_model(str(model), [(f"t{i:02d}", "F32", [size // 4], size) for i in range(TENSORS)], random_fill(1))
        registry = Registry(work / "registry")
        registry.start()
        try:
            repo = registry.repo("bench")
            push(registry, repo, "v1", modelpack({"model.safetensors": model.read_bytes()}))
            url = f"oci://{registry.host}/{repo}:v1"
            rows = []
            for round_number in range(args.rounds):
                info_seconds, out = timed([sys.executable, "-m", "stfs", "info", url, "--json"])
                transfer = json.loads(out)["transfer"]
                requests, fetched, tensor_size = first_tensor_bytes(url)
                mountpoint = work / f"mnt{round_number}"
                started = time.perf_counter()
                with Mount(url, mountpoint):
                    cat_seconds(mountpoint / "tensors" / "t00")
                    first_seconds = time.perf_counter() - started
                pull_seconds, pull_bytes = pull(registry, repo, "v1")
                row = {
                    "info_s": info_seconds,
                    "info_requests": transfer["requests"],
                    "info_bytes": transfer["bytes"],
                    "first_tensor_s": first_seconds,
                    "first_tensor_requests": requests,
                    "first_tensor_bytes": fetched,
                    "tensor_size": tensor_size,
                    "pull_s": pull_seconds,
                    "pull_bytes": pull_bytes,
                }
                rows.append(row)
                log(json.dumps(row))
        finally:
            registry.stop()
    median = {key: statistics.median(row[key] for row in rows) for key in rows[0]}
    print(
        f"model: {args.size_mib} MiB, {TENSORS} tensors of {median['tensor_size'] / MIB:.0f} MiB, {args.rounds} rounds"
    )
    print(
        f"stfs info:          {median['info_s']:.3f} s, {median['info_requests']:.0f} requests, "
        f"{median['info_bytes']:,.0f} bytes = {median['info_bytes'] / median['pull_bytes']:.5f}x the pull's bytes, "
        f"{median['info_s'] / median['pull_s']:.3f}x its time"
    )
    print(
        f"mount + first tensor: {median['first_tensor_s']:.3f} s, {median['first_tensor_bytes']:,.0f} bytes fetched "
        f"({median['first_tensor_bytes'] / median['tensor_size']:.3f}x the tensor) = "
        f"{median['first_tensor_bytes'] / median['pull_bytes']:.4f}x the pull's bytes, "
        f"{median['first_tensor_s'] / median['pull_s']:.3f}x its time"
    )
    print(f"pull (curl, manifest + every blob): {median['pull_s']:.3f} s, {median['pull_bytes']:,.0f} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
