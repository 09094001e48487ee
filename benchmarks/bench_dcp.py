#!/usr/bin/env python3
"""PyTorch Distributed Checkpoints (SPEC §13), side by side in one run, the checkpoint in the page cache, medians of
--rounds rounds that alternate stfs and torch (which goes first turns round every round):

    flock /work/notes/bench.lock python3 benchmarks/bench_dcp.py [--data DIR] [--rounds 3] [--size-mib 512]

The checkpoint: two gloo ranks save (``torch.distributed.checkpoint.save``) two F32 DTensors of --size-mib / 2 each,
``rows`` sharded along its first dimension (each rank's chunk one run of the tensor) and ``columns`` along its
second (each row of the tensor half in one rank's file, half in the other's), written once into --data.

1. each tensor: ``cat MNT/tensors/NAME`` of a fresh mount (the daemon gathers the bytes from both ranks' .distcp
   files; the mount's page cache cold but for one byte of each file read first, which imports numpy), MB/s.
2. the whole checkpoint as one file: stfs's mount, ``cat`` of every tensor file and unmount, and the same with
   ``cat MNT/safetensors/model.safetensors`` (``--view safetensors``: one safetensors file of every tensor), against
   ``dcp_to_torch_save`` (torch's own way to one file: every chunk loaded, one ``.pt`` written) in a fresh
   ``python3``; wall seconds and the ratio stfs / torch.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks.benchlib import MIB, Mount, bytecode_environment, cat_seconds, log, warm  # noqa: E402

MOUNT_PREFIX = "/tmp/bench-dcp-mnt"
TO_TORCH_SAVE = (
    "import sys\nfrom torch.distributed.checkpoint.format_utils import dcp_to_torch_save\n"
    "dcp_to_torch_save(sys.argv[1], sys.argv[2])"
)


def _rank(rank: int, world: int, port: int, folder: str, side: int) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        generator = torch.Generator().manual_seed(0)
        state = {
            name: distribute_tensor(torch.randn(side, side, generator=generator), mesh, [Shard(dim)])
            for name, dim in (("rows", 0), ("columns", 1))
        }
        dcp.save(state, checkpoint_id=folder)
    finally:
        dist.destroy_process_group()


def prepare(data: Path, size_mib: int) -> Path:
    """The checkpoint's folder under ``data``, written by two ranks if it is not there."""
    folder = data / f"checkpoint-{size_mib}m"
    if not (folder / ".metadata").exists():
        import socket

        import torch.multiprocessing

        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        side = int((size_mib * MIB // 2 // 4) ** 0.5)
        log(f"writing a {size_mib} MiB checkpoint from two ranks into {folder}")
        torch.multiprocessing.spawn(_rank, args=(2, port, str(folder), side), nprocs=2)
    return folder


def tensor_bytes(folder: Path) -> int:
    return sum(file.stat().st_size for file in folder.iterdir() if file.suffix == ".distcp")


def stfs_seconds(folder: Path, env: dict[str, str], view: bool) -> tuple[float, dict[str, float]]:
    """A fresh mount, ``cat`` of every tensor (or, ``view``, of safetensors/model.safetensors), unmount: wall seconds
    in all, and each cat's."""
    started = time.perf_counter()
    args = ["--view", "safetensors"] if view else []
    with Mount(folder, f"{MOUNT_PREFIX}-{'view' if view else 'tensors'}", args, env=env) as m:
        root = Path(m.mountpoint)
        paths = [root / "safetensors" / "model.safetensors"] if view else sorted((root / "tensors").iterdir())
        for path in paths:  # the daemon's first gathered read imports numpy: not the figure of a tensor's cat
            with open(path, "rb") as stream:
                stream.read(1)
        each = {path.name: cat_seconds(path) for path in paths}
    return time.perf_counter() - started, each


def torch_seconds(folder: Path, target: Path, env: dict[str, str]) -> float:
    target.unlink(missing_ok=True)
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", TO_TORCH_SAVE, str(folder), str(target)], env=env, check=True)
    return time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default="/tmp/stfs-bench-dcp")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--size-mib", type=int, default=512)
    args = parser.parse_args()
    data = Path(args.data)
    data.mkdir(parents=True, exist_ok=True)
    folder = prepare(data, args.size_mib)
    env = bytecode_environment(str(data / "pycache"))
    size = tensor_bytes(folder)
    runs: dict[str, list[float]] = {"stfs tensors": [], "stfs view": [], "dcp_to_torch_save": []}
    cats: dict[str, list[float]] = {}
    for round_number in range(args.rounds):
        order = list(runs) if round_number % 2 == 0 else list(reversed(runs))
        for label in order:
            warm(*folder.iterdir())
            if label == "dcp_to_torch_save":
                runs[label].append(torch_seconds(folder, data / "converted.pt", env))
                continue
            seconds, each = stfs_seconds(folder, env, view=label == "stfs view")
            runs[label].append(seconds)
            for name, value in each.items():
                cats.setdefault(name, []).append(value)
    (data / "converted.pt").unlink(missing_ok=True)
    print(f"checkpoint: {folder} ({size / MIB:.0f} MiB in two ranks' .distcp files), {args.rounds} rounds")
    print("1. cat of a tensor file, fresh mount (gathered from both ranks' chunks by the daemon)")
    half = size / 2
    for name in ("rows", "columns"):
        print(
            f"   {name:8} {half / statistics.median(cats[name]) / 1e6:7.0f} MB/s   (runs: {seconds_text(cats[name])})"
        )
    if "model.safetensors" in cats:
        rate = size / statistics.median(cats["model.safetensors"]) / 1e6
        print(f"   safetensors/model.safetensors {rate:7.0f} MB/s   (runs: {seconds_text(cats['model.safetensors'])})")
    theirs = statistics.median(runs["dcp_to_torch_save"])
    print("2. the checkpoint as one file, fresh processes: wall seconds (runs), ratio stfs / torch")
    print(f"   {'dcp_to_torch_save':46} {theirs:6.2f} s  ({seconds_text(runs['dcp_to_torch_save'])})")
    for label, what in (
        ("stfs tensors", "mount, cat every tensor, unmount"),
        ("stfs view", "mount, cat model.safetensors, unmount"),
    ):
        ours = statistics.median(runs[label])
        print(f"   {'stfs: ' + what:46} {ours:6.2f} s  ({seconds_text(runs[label])})   {ours / theirs:.3f}x")
    return 0


def seconds_text(values: list[float]) -> str:
    return " ".join(f"{value:.2f}" for value in values)


if __name__ == "__main__":
    sys.exit(main())
