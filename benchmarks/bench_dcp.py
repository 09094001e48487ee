#!/usr/bin/env python3
"""PyTorch Distributed Checkpoints (SPEC §13): gathered tensors against the same tensors as one safetensors
range, medians of --rounds rounds whose runs are interleaved (the order turns round every round):

    flock /work/notes/bench.lock python3 benchmarks/bench_dcp.py [--data DIR] [--rounds 5] [--size-mib 512]

The checkpoint: two gloo ranks save (``torch.distributed.checkpoint.save``) two F32 DTensors of --size-mib / 2 each,
``rows`` sharded along its first dimension (each rank's chunk one run of the tensor) and ``columns`` along its
second (each row of the tensor half in one rank's file, half in the other's); ``same.safetensors`` holds the same
two tensors, each one range. Both written once into --data.

1. local: ``cat MNT/tensors/NAME`` of a fresh mount, the sources' pages in the page cache (read first), the mount's
   own cold: MB/s of each tensor gathered from the checkpoint and of the same tensor from the safetensors file, and
   the ratio; and ``cat MNT/safetensors/model.safetensors`` (``--view safetensors``: one file of both, gathered)
   against ``cat`` of the safetensors file through a mount.
2. remote (needs nginx: tests/servers.py's, on 127.0.0.1): the same over HTTP, fresh mounts: bytes nginx sent for
   each tensor ÷ its size, and MB/s against the same tensor of the safetensors file over the same server.
3. the checkpoint as one file, fresh processes: ``--view safetensors`` mounted and loaded by
   ``safetensors.torch.load_file`` (then unmounted), against ``dcp_to_torch_save`` and ``torch.load`` of its
   ``.pt``: wall seconds and the ratio.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks.benchlib import MIB, Mount, bytecode_environment, cat_seconds, log, stfs_command, warm  # noqa: E402

MOUNT_PREFIX = "/tmp/bench-dcp-mnt"
NAMES = ("rows", "columns")
LOAD_VIEW = (
    "import sys\nfrom safetensors.torch import load_file\n"
    "tensors = load_file(sys.argv[1])\nassert sorted(tensors) == ['columns', 'rows']"
)
TO_TORCH_SAVE = (
    "import sys, torch\nfrom torch.distributed.checkpoint.format_utils import dcp_to_torch_save\n"
    "dcp_to_torch_save(sys.argv[1], sys.argv[2])\ntensors = torch.load(sys.argv[2])\n"
    "assert sorted(tensors) == ['columns', 'rows']"
)


def _tensors(side: int) -> dict[str, object]:
    import torch

    generator = torch.Generator().manual_seed(0)
    return {name: torch.randn(side, side, generator=generator) for name in NAMES}


def _rank(rank: int, world: int, port: int, folder: str, side: int) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        whole = _tensors(side)
        state = {name: distribute_tensor(whole[name], mesh, [Shard(dim)]) for dim, name in enumerate(NAMES)}
        dcp.save(state, checkpoint_id=folder)
    finally:
        dist.destroy_process_group()


def prepare(data: Path, size_mib: int) -> tuple[Path, Path]:
    """The checkpoint's folder under ``data`` (written by two ranks if it is not there), and the safetensors file of
    the same tensors."""
    folder = data / f"checkpoint-{size_mib}m"
    side = int((size_mib * MIB // 2 // 4) ** 0.5)
    if not (folder / ".metadata").exists():
        import socket

        import torch.multiprocessing

        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        log(f"writing a {size_mib} MiB checkpoint from two ranks into {folder}")
        torch.multiprocessing.spawn(_rank, args=(2, port, str(folder), side), nprocs=2)
    same = data / f"same-{size_mib}m" / "same.safetensors"
    if not same.exists():
        from safetensors.torch import save_file

        same.parent.mkdir(exist_ok=True)
        save_file(_tensors(side), str(same))  # type: ignore[arg-type]
    return folder, same


def sources(folder: Path, same: Path) -> list[Path]:
    return [*folder.iterdir(), same]


def cat_rate(source: str, path: str, env: dict[str, str], label: str, *args: str) -> float:
    """A fresh mount of ``source`` (``stfs mount`` given ``args``), ``cat`` of ``path`` in it: MB/s."""
    with Mount(source, f"{MOUNT_PREFIX}-{label}", args, env=env) as m:
        target = Path(m.mountpoint, path)
        return target.stat().st_size / cat_seconds(target) / 1e6


def interleaved(
    rounds: int, runs: dict[str, Callable[[], float]], before: Callable[[], None]
) -> dict[str, list[float]]:
    """Each of ``runs`` once a round, in an order that turns round every round; ``before`` each run."""
    found: dict[str, list[float]] = {label: [] for label in runs}
    for round_number in range(rounds):
        order = list(runs) if round_number % 2 == 0 else list(reversed(runs))
        for label in order:
            before()
            found[label].append(runs[label]())
    return found


def local(folder: Path, same: Path, rounds: int, env: dict[str, str]) -> None:
    runs: dict[str, Callable[[], float]] = {}
    for name in NAMES:
        runs[f"dcp {name}"] = lambda name=name: cat_rate(str(folder), f"tensors/{name}", env, "dcp")  # type: ignore[misc]
        runs[f"safetensors {name}"] = lambda name=name: cat_rate(str(same), f"tensors/{name}", env, "st")  # type: ignore[misc]
    runs["dcp view"] = lambda: cat_rate(
        str(folder), "safetensors/model.safetensors", env, "view", "--view", "safetensors"
    )
    runs["safetensors file"] = lambda: cat_rate(str(same), "files/same.safetensors", env, "st")
    found = interleaved(rounds, runs, lambda: warm(*sources(folder, same)))
    print("1. local: cat of a fresh mount, sources in the page cache: MB/s (runs), gathered ÷ one range")
    pairs = [(f"dcp {name}", f"safetensors {name}", f"tensors/{name}") for name in NAMES]
    pairs.append(("dcp view", "safetensors file", "model.safetensors (--view) vs files/same.safetensors"))
    for ours, theirs, what in pairs:
        a, b = statistics.median(found[ours]), statistics.median(found[theirs])
        print(f"   {what:54} {a:6.0f} vs {b:6.0f}   {a / b:.2f}x   ({rates(found[ours])} / {rates(found[theirs])})")


def remote(folder: Path, same: Path, rounds: int, env: dict[str, str], data: Path) -> None:
    from tests.servers import Nginx, find_tool

    executable = find_tool("nginx")
    if executable is None:
        print("2. remote: skipped (no nginx)")
        return
    work = Path(tempfile.mkdtemp(prefix="nginx-", dir=data))
    server = Nginx(work, tls=None, executable=executable)
    server.start()
    try:
        for file in sources(folder, same):
            target = server.root / file.parent.name / file.name
            target.parent.mkdir(parents=True, exist_ok=True)
            os.link(file, target)
        checkpoint = f"{server.url}/{folder.name}/.metadata"
        plain = f"{server.url}/{same.parent.name}/{same.name}"
        fetched: dict[str, list[float]] = {}

        def read(url: str, name: str, label: str) -> float:
            with Mount(url, f"{MOUNT_PREFIX}-remote", env=env) as m:
                target = Path(m.mountpoint, "tensors", name)
                server.log.clear()
                rate = target.stat().st_size / cat_seconds(target) / 1e6
                fetched.setdefault(label, []).append(server.log.transfer().bytes / target.stat().st_size)
            return rate

        runs: dict[str, Callable[[], float]] = {}
        for name in NAMES:
            runs[f"dcp {name}"] = lambda name=name: read(checkpoint, name, f"dcp {name}")  # type: ignore[misc]
            runs[f"safetensors {name}"] = lambda name=name: read(plain, name, f"safetensors {name}")  # type: ignore[misc]
        found = interleaved(rounds, runs, lambda: None)
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    print("2. remote over nginx on 127.0.0.1, a fresh mount a tensor: bytes fetched ÷ bytes read; MB/s (runs)")
    for name in NAMES:
        ours, theirs = f"dcp {name}", f"safetensors {name}"
        a, b = statistics.median(found[ours]), statistics.median(found[theirs])
        print(
            f"   tensors/{name:8} fetched {max(fetched[ours]):.3f} vs {max(fetched[theirs]):.3f}   {a:6.0f} vs {b:6.0f}"
            f" MB/s   {a / b:.2f}x   ({rates(found[ours])} / {rates(found[theirs])})"
        )


def one_file(folder: Path, rounds: int, env: dict[str, str], data: Path) -> None:
    target = data / "converted.pt"

    def view() -> float:
        started = time.perf_counter()
        with Mount(folder, f"{MOUNT_PREFIX}-load", ["--view", "safetensors"], env=env) as m:
            model = Path(m.mountpoint, "safetensors", "model.safetensors")
            subprocess.run([sys.executable, "-c", LOAD_VIEW, str(model)], env=env, check=True)
        return time.perf_counter() - started

    def torch_side() -> float:
        target.unlink(missing_ok=True)
        started = time.perf_counter()
        subprocess.run([sys.executable, "-c", TO_TORCH_SAVE, str(folder), str(target)], env=env, check=True)
        return time.perf_counter() - started

    runs: dict[str, Callable[[], float]] = {"stfs": view, "torch": torch_side}
    found = interleaved(rounds, runs, lambda: warm(*folder.iterdir()))
    target.unlink(missing_ok=True)
    ours, theirs = statistics.median(found["stfs"]), statistics.median(found["torch"])
    print("3. the checkpoint as one file, fresh processes: wall seconds (runs)")
    print(f"   mount --view safetensors, load_file, unmount    {ours:6.2f} s  ({seconds_text(found['stfs'])})")
    print(f"   dcp_to_torch_save, torch.load                   {theirs:6.2f} s  ({seconds_text(found['torch'])})")
    print(f"   ratio stfs ÷ torch                              {ours / theirs:6.2f}x")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default="/tmp/stfs-bench-dcp")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--size-mib", type=int, default=512)
    parser.add_argument("--only", choices=["local", "remote", "one-file"], action="append")
    args = parser.parse_args()
    data = Path(args.data)
    data.mkdir(parents=True, exist_ok=True)
    folder, same = prepare(data, args.size_mib)
    env = bytecode_environment(str(data / "pycache"))
    subprocess.run(stfs_command("--version"), env=env, check=True, capture_output=True)  # bytecode compiled first
    load = os.getloadavg()[0]
    print(f"checkpoint: {folder} (two ranks, {args.size_mib} MiB), {args.rounds} rounds, load {load:.1f} at the start")
    chosen = args.only or ["local", "remote", "one-file"]
    if "local" in chosen:
        local(folder, same, args.rounds, env)
    if "remote" in chosen:
        remote(folder, same, args.rounds, env, data)
    if "one-file" in chosen:
        one_file(folder, args.rounds, env, data)
    print(f"load {os.getloadavg()[0]:.1f} at the end")
    return 0


def rates(values: list[float]) -> str:
    return " ".join(f"{value:.0f}" for value in values)


def seconds_text(values: list[float]) -> str:
    return " ".join(f"{value:.2f}" for value in values)


if __name__ == "__main__":
    sys.exit(main())
