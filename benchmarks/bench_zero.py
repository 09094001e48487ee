#!/usr/bin/env python3
"""DeepSpeed ZeRO checkpoints (SPEC §16): a ZeRO-3 run of two ranks mounted as its model, against DeepSpeed's own
consolidation, medians of --rounds rounds whose runs are interleaved (the order turns round every round):

    python3 benchmarks/bench_zero.py [--data DIR] [--rounds 3] [--layers 16]

The checkpoint: two gloo ranks (DeepSpeed on CPU, ``DS_ACCELERATOR=cpu``) save a ZeRO-3 fp32 model of --layers
``Linear(4096, 4096)`` and one of odd sizes (16 layers: 1.0 GiB of float32 weights) with ``engine.save_checkpoint``
right after ``deepspeed.initialize``; written once into --data. ``same.safetensors`` holds the same tensors (made
from the mount's own view; tests/test_deepspeed.py checks that view against zero_to_fp32's).

1. ``stfs info`` of the run folder, a fresh process: wall seconds and peak resident memory (``/usr/bin/time``).
2. the run as one safetensors file, fresh processes, the rank files in the page cache: ``stfs mount --view
   safetensors`` and ``safetensors.torch.load_file`` of ``model.safetensors``, every tensor summed (then unmount),
   against DeepSpeed's ``zero_to_fp32.py RUN OUT --safe_serialization`` and the same of what it wrote: wall seconds
   and the peak memory of the processes of each side (stfs: the daemon's own and the loader's, added; DeepSpeed: the
   larger of converter and loader, one after the other), twice: resident (the loader's pages mapped from the file it
   loads included) and anonymous (what the kernel cannot drop and read back from a file).
3. ``cat`` of every tensor file of a fresh mount, sources in the page cache: MB/s of the consolidated tensors of
   the run against the same bytes as one safetensors file (its mount's ``tensors/``), and the ratio.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks.benchlib import (  # noqa: E402
    MIB,
    Mount,
    bytecode_environment,
    log,
    peak_rss_while,
    stfs_command,
    warm,
)  # noqa: E402

MOUNT_PREFIX = "/tmp/bench-zero-mnt"
LOAD = (  # every value read: load_file maps the file, and a loader that never touches a tensor reads none of it
    "import sys\nfrom safetensors.torch import load_file\ntensors = load_file(sys.argv[1])\n"
    "assert len(tensors) > 16 and all(t.float().sum().isfinite() for t in tensors.values())"
)


def _rank(folder: str, layers: int) -> None:
    """One rank of the run that writes the checkpoint (``--rank``), with torch.distributed's environment set."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import deepspeed.comm.torch  # noqa: F401
    import torch

    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None  # type: ignore[attr-defined]  # gloo, no JIT
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(4096, 4096) for _ in range(layers)), torch.nn.Linear(4096, 999))
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": 3},
        "zero_allow_untested_optimizer": True,
    }
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    engine.save_checkpoint(folder, tag="global_step0")


def prepare(data: Path, layers: int) -> Path:
    run = data / f"zero3-{layers}"
    if not (run / "latest").exists():
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        log(f"writing a ZeRO-3 checkpoint of {layers} layers from two ranks into {run}")
        processes = []
        for rank in range(2):
            env = dict(
                os.environ,
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE="2",
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                DS_ACCELERATOR="cpu",
            )
            command = [sys.executable, __file__, "--rank", str(run), "--layers", str(layers)]
            processes.append(subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL))
        if any(process.wait() for process in processes):
            raise SystemExit("the DeepSpeed run failed")
    return run


def same_file(run: Path, data: Path, env: dict[str, str]) -> Path:
    """The run's tensors as one safetensors file (the view's bytes, copied once)."""
    same = data / "same" / "same.safetensors"
    if not same.exists():
        same.parent.mkdir(exist_ok=True)
        with Mount(str(run), f"{MOUNT_PREFIX}-copy", ["--view", "safetensors"], env=env) as m:
            shutil.copyfile(Path(m.mountpoint, "safetensors", "model.safetensors"), same)
    return same


def timed(command: list[str], env: dict[str, str]) -> tuple[float, int, int]:
    """Wall seconds, peak resident bytes (the maximum resident set size, as ``/usr/bin/time`` gives it: pages mapped
    from files included) and peak anonymous bytes (``RssAnon`` + ``RssShmem`` sampled every 10 ms: what the
    kernel cannot drop and read again) of ``command``."""
    started = time.perf_counter()
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def finish() -> tuple[int, Any, bytes]:
        assert process.stderr is not None
        stderr = process.stderr.read()
        _, status, usage = os.wait4(process.pid, 0)
        process.returncode = os.waitstatus_to_exitcode(status)
        return process.returncode, usage, stderr

    (code, usage, stderr), anonymous = peak_rss_while(process.pid, finish, shared=True)
    if code:
        raise RuntimeError(stderr[-2000:].decode(errors="replace"))
    return time.perf_counter() - started, usage.ru_maxrss * 1024, anonymous


def info(run: Path, rounds: int, env: dict[str, str]) -> None:
    found = [timed(stfs_command("info", str(run)), env) for _ in range(rounds)]
    seconds = statistics.median(found[0] for found in found)
    peak = max(found[1] for found in found)
    print(f"1. stfs info of the run folder: {seconds:.2f} s (median), peak {peak / MIB:.0f} MiB resident")


Peaks = tuple[int, int]  # resident, anonymous


def one_file(run: Path, rounds: int, env: dict[str, str], data: Path) -> None:
    out = data / "converted"
    script = run / "zero_to_fp32.py"
    parts: dict[str, list[tuple[int, Peaks, Peaks]]] = {"stfs": [], "deepspeed": []}  # (daemon, converter, loader)

    def stfs_side() -> tuple[float, Peaks]:
        started = time.perf_counter()
        with Mount(str(run), f"{MOUNT_PREFIX}-load", ["--view", "safetensors"], env=env) as m:
            model = str(Path(m.mountpoint, "safetensors", "model.safetensors"))
            (_, *loader), daemon = peak_rss_while(m.pid, lambda: timed([sys.executable, "-c", LOAD, model], env), True)
        parts["stfs"].append((daemon, (0, 0), (loader[0], loader[1])))
        return time.perf_counter() - started, (daemon + loader[0], daemon + loader[1])

    def deepspeed_side() -> tuple[float, Peaks]:
        shutil.rmtree(out, ignore_errors=True)
        convert = [sys.executable, str(script), str(run), str(out), "--safe_serialization"]
        seconds, *converter = timed(convert, dict(env, DS_ACCELERATOR="cpu"))
        more, *loader = timed([sys.executable, "-c", LOAD, str(out / "model.safetensors")], env)
        parts["deepspeed"].append((0, (converter[0], converter[1]), (loader[0], loader[1])))
        return seconds + more, (max(converter[0], loader[0]), max(converter[1], loader[1]))

    runs: dict[str, Callable[[], tuple[float, Peaks]]] = {"stfs": stfs_side, "deepspeed": deepspeed_side}
    found: dict[str, list[tuple[float, Peaks]]] = {label: [] for label in runs}
    for round_number in range(rounds):
        for label in list(runs) if round_number % 2 == 0 else list(reversed(runs)):
            warm(*(path for path in run.rglob("*") if path.is_file()))
            found[label].append(runs[label]())
    shutil.rmtree(out, ignore_errors=True)
    seconds = {label: statistics.median(s for s, _ in values) for label, values in found.items()}
    print("2. the run as one safetensors file, fresh processes: wall seconds (median), peak MiB (the largest round)")
    print(f"   stfs --view safetensors + load_file: {seconds['stfs']:.2f} s")
    print(f"   zero_to_fp32.py (to a file) + load_file: {seconds['deepspeed']:.2f} s")
    print(f"   ratio stfs ÷ deepspeed: {seconds['stfs'] / seconds['deepspeed']:.2f}x")
    for kind, what in enumerate(("resident (file pages mapped included)", "anonymous (RssAnon + RssShmem)")):
        peaks = {label: max(p[kind] for _, p in values) for label, values in found.items()}
        daemon = max(d for d, _, _ in parts["stfs"])
        mine = max(loader[kind] for _, _, loader in parts["stfs"])
        converter = max(c[kind] for _, c, _ in parts["deepspeed"])
        theirs = max(loader[kind] for _, _, loader in parts["deepspeed"])
        print(
            f"   peak {what}: stfs {peaks['stfs'] / MIB:.0f} MiB (daemon {daemon / MIB:.0f} + loader {mine / MIB:.0f})"
            f" ÷ deepspeed {peaks['deepspeed'] / MIB:.0f} MiB (converter {converter / MIB:.0f}, then loader"
            f" {theirs / MIB:.0f}) = {peaks['stfs'] / peaks['deepspeed']:.2f}x"
        )


def cat_all(source: str, label: str, env: dict[str, str]) -> float:
    """A fresh mount of ``source``, ``cat`` of every file of its ``tensors/``: MB/s."""
    with Mount(source, f"{MOUNT_PREFIX}-{label}", env=env) as m:
        files = sorted(str(path) for path in Path(m.mountpoint, "tensors").rglob("*") if path.is_file())
        size = sum(os.stat(file).st_size for file in files)
        started = time.perf_counter()
        subprocess.run(["cat", *files], stdout=subprocess.DEVNULL, check=True)
        return size / (time.perf_counter() - started) / 1e6


def throughput(run: Path, same: Path, rounds: int, env: dict[str, str]) -> None:
    runs = {"zero": lambda: cat_all(str(run), "zero", env), "safetensors": lambda: cat_all(str(same), "st", env)}
    found: dict[str, list[float]] = {label: [] for label in runs}
    for round_number in range(rounds):
        for label in list(runs) if round_number % 2 == 0 else list(reversed(runs)):
            warm(same, *(path for path in run.rglob("*") if path.is_file()))
            found[label].append(runs[label]())
    a, b = statistics.median(found["zero"]), statistics.median(found["safetensors"])
    text = " / ".join(" ".join(f"{value:.0f}" for value in found[label]) for label in runs)
    print(f"3. cat of every tensor, fresh mount, sources cached: {a:.0f} vs {b:.0f} MB/s  {a / b:.2f}x  ({text})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default="/tmp/stfs-bench-zero")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--rank", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank:
        _rank(args.rank, args.layers)
        return 0
    data = Path(args.data)
    data.mkdir(parents=True, exist_ok=True)
    run = prepare(data, args.layers)
    env = bytecode_environment(str(data / "pycache"))
    subprocess.run(stfs_command("--version"), env=env, check=True, capture_output=True)  # bytecode compiled first
    same = same_file(run, data, env)
    size = same.stat().st_size
    load = os.getloadavg()[0]
    print(f"run: {run} (ZeRO-3, two ranks, {size / MIB:.0f} MiB of weights), {args.rounds} rounds, load {load:.1f}")
    info(run, args.rounds, env)
    one_file(run, args.rounds, env, data)
    throughput(run, same, args.rounds, env)
    print(f"load {os.getloadavg()[0]:.1f} at the end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
