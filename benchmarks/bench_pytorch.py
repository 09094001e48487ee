#!/usr/bin/env python3
"""PyTorch checkpoints (SPEC §12), side by side in one run, warm page cache, medians of --rounds rounds that
alternate each command and its reference (which goes first turns round every round):

    flock /work/notes/bench.lock python3 benchmarks/bench_pytorch.py [--data DIR] [--rounds 5] [--size-mib 1024]

1. info: ``python3 -m stfs info pytorch_model.bin`` of a 1 GiB checkpoint (bench_pytorch_info's 195 F32 tensors),
   a fresh process, against a fresh ``python3 -c`` running ``torch.load(path, mmap=True, weights_only=True)`` and
   printing each key's name, dtype and shape. Wall seconds; the ratio stfs / torch (target: at most 0.2x).
2. safetensors view: ``cat MNT/safetensors/model.safetensors`` of a mount of a folder holding only that
   ``pytorch_model.bin`` (``--view safetensors``) against ``cat MNT2/files/model.safetensors`` of a mount of the
   same tensors written by ``safetensors.torch.save_file``, the sources in the page cache; each round mounts
   both afresh and cats each twice: the first cat (the mount's page cache cold: the daemon serves every byte)
   and the warm one (the target's figure: the kernel serves it from the mount's page cache). MB/s; the ratio
   view / real file (target, warm: at least 0.9x); the daemons' CPU seconds a cat, and how many files each
   daemon serves in C and how many in Python (its log: C serves files of one byte range, so the view's
   safetensors file, a header then 195 ranges, is Python's); whether the two files are the same bytes (cmp),
   else the same tensors in another order (the view keeps the checkpoint's order, SPEC §12; save_file sorts).
3. info over HTTP: ``python3 -m stfs info URL --json`` of a 64 MiB checkpoint behind nginx on 127.0.0.1, zip
   layout and the older one (``_use_new_zipfile_serialization=False``): requests and body bytes in nginx's access
   log (target: at most 1 MiB); then the same through the tests' fault proxy adding 20 ms to every request (a
   link to a distant server): wall seconds, where the requests that do not depend on each other go out together.
4. hostile pickles: ``python3 -m stfs check FILE`` of each of the hostile checkpoints of tests/checkpoints.py (billion
   laughs, 100,000-deep nesting, strings longer than the file, ...) under ``/usr/bin/time``: wall seconds, peak
   RSS, exit status and the error line (target: refused, exit 1, one line, within 20 s and 400 MiB).

Data is written once into --data and kept between runs (shared with bench_pytorch_info.py's default).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import struct
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks.benchlib import (  # noqa: E402
    MIB,
    TORCH_LIST,
    Mount,
    bytecode_environment,
    cat_seconds,
    cpu_seconds,
    log,
    stfs_command,
    warm,
    write_checkpoint,
)
from tests.checkpoints import HOSTILE, hostile_checkpoint  # noqa: E402
from tests.servers import FaultProxy, Nginx, find_tool  # noqa: E402

MOUNT_PREFIX = "/tmp/bench-pytorch-mnt"
HOSTILE_SECONDS, HOSTILE_MIB = 20, 400
CACHES = {"fresh": "first cat of a fresh mount", "warm": "warm (after one cat)"}


@dataclass(frozen=True, slots=True)
class Files:
    """What the benchmark reads, all under --data."""

    checkpoint: Path  # the 1 GiB pytorch_model-<size>m.bin
    checkpoint_folder: Path  # holds only pytorch_model.bin, a hard link of ``checkpoint``
    safetensors_folder: Path  # holds only model.safetensors, the same tensors written by safetensors
    remote: dict[str, Path]  # layout -> a 64 MiB checkpoint
    hostile: dict[str, Path]  # tests.checkpoints.HOSTILE's name -> its checkpoint


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def prepare(data: Path, size_mib: int) -> Files:
    """Write what is missing under ``data``."""
    checkpoint = data / f"pytorch_model-{size_mib}m.bin"
    write_checkpoint(str(checkpoint), size_mib)
    checkpoint_folder = data / "checkpoint"
    checkpoint_folder.mkdir(exist_ok=True)
    if not (checkpoint_folder / "pytorch_model.bin").exists():
        os.link(checkpoint, checkpoint_folder / "pytorch_model.bin")
    safetensors_folder = data / "safetensors"
    safetensors_folder.mkdir(exist_ok=True)
    if not (safetensors_folder / "model.safetensors").exists():
        import torch
        from safetensors.torch import save_file

        log("writing model.safetensors")
        state = torch.load(checkpoint, mmap=True, weights_only=True)
        save_file(state, safetensors_folder / ".model.safetensors.partial", metadata={"format": "pt"})
        os.replace(safetensors_folder / ".model.safetensors.partial", safetensors_folder / "model.safetensors")
    remote = {"zip": data / "pytorch_model-64m.bin", "legacy": data / "pytorch_model-64m-legacy.bin"}
    for layout, path in remote.items():
        write_checkpoint(str(path), 64, legacy=layout == "legacy")
    hostile = {}
    (data / "hostile").mkdir(exist_ok=True)
    for name in HOSTILE:
        hostile[name] = data / "hostile" / f"{slug(name)}.pt"
        if not hostile[name].exists():
            hostile[name].write_bytes(hostile_checkpoint(name))
    return Files(checkpoint, checkpoint_folder, safetensors_folder, remote, hostile)


def child_environment(data: Path) -> dict[str, str]:
    """The worktree's stfs first on PYTHONPATH, bytecode cached (in --data) as an installed package has it, and no
    proxy between stfs and 127.0.0.1."""
    env = bytecode_environment(str(data / "pycache"))
    for name in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "all_proxy"):
        env.pop(name, None)
    env["NO_PROXY"] = env["no_proxy"] = "127.0.0.1,localhost"
    return env


def timed_run(command: list[str], env: dict[str, str]) -> tuple[float, str]:
    """Wall seconds of ``command`` to its end, and its output; it must succeed."""
    started = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO)
    seconds = time.perf_counter() - started
    if result.returncode != 0:
        raise RuntimeError(f"{command} exited {result.returncode}: {result.stderr.strip()}")
    return seconds, result.stdout


def alternate(commands: dict[str, list[str]], rounds: int, env: dict[str, str]) -> dict[str, list[float]]:
    """Each command once per round, the order turned round every other round; seconds of each run."""
    seconds: dict[str, list[float]] = {label: [] for label in commands}
    for round_number in range(rounds):
        order = list(commands) if round_number % 2 == 0 else list(reversed(commands))
        for label in order:
            seconds[label].append(timed_run(commands[label], env)[0])
    return seconds


def measure_info(files: Files, rounds: int, env: dict[str, str]) -> None:
    path = str(files.checkpoint)
    commands = {
        "torch.load": [sys.executable, "-c", TORCH_LIST, path],
        "stfs info": stfs_command("info", path),
    }
    listed = {label: timed_run(command, env)[1].splitlines() for label, command in commands.items()}  # and warms
    names = [line.split()[0] for line in listed["torch.load"]]
    assert names == [line.split()[0] for line in listed["stfs info"][2 : 2 + len(names)]], "not the same tensors"
    seconds = alternate(commands, rounds, env)
    ours, theirs = statistics.median(seconds["stfs info"]), statistics.median(seconds["torch.load"])
    print(f"1. info of {path} ({files.checkpoint.stat().st_size / MIB:.0f} MiB, {len(names)} tensors), fresh processes")
    print(f"   torch.load(mmap, weights_only) {theirs * 1000:7.1f} ms   (runs: {milliseconds(seconds['torch.load'])})")
    print(f"   stfs info                      {ours * 1000:7.1f} ms   (runs: {milliseconds(seconds['stfs info'])})")
    print(f"   ratio stfs / torch             {ours / theirs:7.3f}x   target <= 0.2x", flush=True)


def milliseconds(values: list[float]) -> str:
    return " ".join(f"{value * 1000:.0f}" for value in values)


def daemon_log(source: Path, name: str) -> Path:
    return source.parent / f"daemon-{name}.log"


def mount(source: Path, name: str, env: dict[str, str], *options: str) -> Mount:
    """``stfs mount SOURCE /tmp/bench-pytorch-mnt-NAME OPTIONS``, its log ``daemon_log(source, name)``."""
    daemon_log(source, name).unlink(missing_ok=True)
    return Mount(source, f"{MOUNT_PREFIX}-{name}", ["--log-file", str(daemon_log(source, name)), *options], env=env)


def served_from(daemon_log: Path) -> str:
    """What the daemon's log says C serves: ``N files in C, M by Python``."""
    match = re.search(r"reads of (\d+) files .*\((\d+) files read by Python\)", daemon_log.read_text())
    return f"{match.group(1)} files read in C, {match.group(2)} by Python" if match else "C tables not built"


def safetensors_header(path: Path) -> dict[str, dict[str, Any]]:
    """The tensors of a safetensors file's header, each with ``data_offsets`` made absolute."""
    with open(path, "rb") as stream:
        (length,) = struct.unpack("<Q", stream.read(8))
        header = json.loads(stream.read(length))
    header.pop("__metadata__", None)
    for entry in header.values():
        entry["data_offsets"] = [8 + length + offset for offset in entry["data_offsets"]]
    return header


def same_tensors(first: Path, second: Path) -> bool:
    """Whether two safetensors files hold the same tensors (names, dtypes, shapes, bytes), in whatever order."""
    headers = safetensors_header(first), safetensors_header(second)
    described = [{name: (entry["dtype"], entry["shape"]) for name, entry in header.items()} for header in headers]
    if described[0] != described[1]:
        return False
    with open(first, "rb") as one, open(second, "rb") as other:
        for name, entry in headers[0].items():
            (begin, end), (other_begin, _) = entry["data_offsets"], headers[1][name]["data_offsets"]
            for at in range(0, end - begin, 64 * MIB):
                size = min(64 * MIB, end - begin - at)
                if os.pread(one.fileno(), size, begin + at) != os.pread(other.fileno(), size, other_begin + at):
                    return False
    return True


def measure_view(files: Files, rounds: int, env: dict[str, str]) -> None:
    sources = {"view": files.checkpoint, "real": files.safetensors_folder / "model.safetensors"}
    seconds: dict[tuple[str, str], list[float]] = {(label, cache): [] for label in sources for cache in CACHES}
    daemon_cpu: dict[tuple[str, str], list[float]] = {key: [] for key in seconds}
    size, identical, same, served = 0, False, False, {}  # found in the first round
    for round_number in range(rounds):
        warm(*sources.values())  # a mount drops the source's pages it has served (no --keep-source-cache)
        with (
            mount(files.checkpoint_folder, "view", env, "--view", "safetensors") as view,
            mount(files.safetensors_folder, "safetensors", env) as real,
        ):
            paths = {
                "view": Path(view.mountpoint) / "safetensors" / "model.safetensors",
                "real": Path(real.mountpoint) / "files" / "model.safetensors",
            }
            pids = {"view": view.pid, "real": real.pid}
            for cache in CACHES:
                for label in paths if round_number % 2 == 0 else reversed(paths):
                    cpu_before = cpu_seconds(pids[label])
                    seconds[label, cache].append(cat_seconds(paths[label]))
                    daemon_cpu[label, cache].append(cpu_seconds(pids[label]) - cpu_before)
            if round_number == 0:
                size = paths["view"].stat().st_size
                identical = subprocess.run(["cmp", "-s", *map(str, paths.values())]).returncode == 0
                same = identical or same_tensors(paths["view"], paths["real"])
                served = {
                    "view": served_from(daemon_log(files.checkpoint_folder, "view")),
                    "real": served_from(daemon_log(files.safetensors_folder, "safetensors")),
                }
    rate = {key: size / statistics.median(values) / 1e6 for key, values in seconds.items()}
    cpu = {key: statistics.median(values) for key, values in daemon_cpu.items()}
    print(
        f"2. cat of {size / MIB:.0f} MiB through a mount (source in the page cache); byte-identical (cmp): {identical}"
    )
    if not identical:
        print(f"   the same tensors (names, dtypes, shapes, bytes) in another order: {same}")
    print(f"   {'':36}" + "".join(f"{heading:>36}" for heading in CACHES.values()))
    for label, name in (("view", "safetensors/ of pytorch_model.bin"), ("real", "files/ of a real .safetensors")):
        figures = "".join(
            f"{f'{rate[label, cache]:.0f} MB/s, daemon CPU {cpu[label, cache]:.2f} s':>36}" for cache in CACHES
        )
        print(f"   {name:36}{figures}   {served[label]}")
        for cache in CACHES:
            print(f"      {cache} runs: {milliseconds(seconds[label, cache])} ms")
    fresh_ratio, warm_ratio = (rate["view", cache] / rate["real", cache] for cache in CACHES)
    print(
        f"   ratio view / real rate: fresh {fresh_ratio:.3f}x, warm {warm_ratio:.3f}x   target (warm) >= 0.9x",
        flush=True,
    )


LATENCY = 0.02  # seconds the fault proxy adds to each request


def measure_remote(files: Files, data: Path, env: dict[str, str]) -> None:
    executable = find_tool("nginx")
    if executable is None:
        print("3. info over HTTP: skipped, no nginx")
        return
    nginx = Nginx(data / "nginx", executable=executable)
    nginx.start()
    try:
        print("3. stfs info URL --json of a 64 MiB checkpoint behind nginx (its access log)")
        for layout, path in files.remote.items():
            served = nginx.root / path.name
            if not served.exists():
                os.link(path, served)
            nginx.log.clear()
            seconds, out = timed_run(stfs_command("info", f"{nginx.url}/{path.name}", "--json"), env)
            document = json.loads(out)
            transfer = nginx.log.transfer(at_least=document["transfer"]["requests"])
            tensors = sum(len(model["tensors"]) for model in document["models"])
            print(
                f"   {layout:6} {path.stat().st_size / MIB:.0f} MiB, {tensors} tensors: {transfer.requests} requests,"
                f" {transfer.bytes:,} bytes ({transfer.bytes / MIB:.3f} MiB; target <= 1 MiB) in {seconds:.2f} s",
                flush=True,
            )
        proxy = FaultProxy(nginx.url).start()
        try:
            proxy.set_latency(LATENCY)
            for layout, path in files.remote.items():
                seconds, _ = timed_run(stfs_command("info", f"{proxy.url}/{path.name}", "--json"), env)
                print(f"   {layout:6} with {LATENCY * 1000:.0f} ms a request: {seconds:.2f} s", flush=True)
        finally:
            proxy.stop()
    finally:
        nginx.stop()


def measure_hostile(files: Files, env: dict[str, str]) -> None:
    limits = f"{HOSTILE_SECONDS} s and {HOSTILE_MIB} MiB"
    print(f"4. stfs check of hostile pickles, fresh processes (target: exit 1, one line, within {limits})")
    for name, path in files.hostile.items():
        command = ["/usr/bin/time", "-q", "-f", "%e %M", *stfs_command("check", str(path))]
        try:
            result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
        except subprocess.TimeoutExpired:
            print(f"   {name:34} did not end within 120 s")
            continue
        *said, timing = result.stderr.strip().splitlines()
        wall, peak_kib = timing.split()
        lines = result.stdout.strip().splitlines() + said
        message = lines[0] if lines else ""
        within = float(wall) <= HOSTILE_SECONDS and int(peak_kib) <= HOSTILE_MIB * 1024
        refused = result.returncode == 1 and len(lines) == 1
        print(
            f"   {name:34} {float(wall):5.2f} s {int(peak_kib) / 1024:6.1f} MiB exit {result.returncode}"
            f" {len(lines)} line{'s' if len(lines) != 1 else ''} {'ok' if within and refused else 'MISSED'}:"
            f" {message.replace(str(path), 'FILE')}",
            flush=True,
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default="/tmp/stfs-bench-pytorch")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--size-mib", type=int, default=1024)
    args = parser.parse_args()
    data = Path(args.data)
    data.mkdir(parents=True, exist_ok=True)
    files = prepare(data, args.size_mib)
    env = child_environment(data)
    warm(files.checkpoint, files.safetensors_folder / "model.safetensors")
    print(f"stfs from {REPO}; load average {os.getloadavg()} at {time.strftime('%H:%M:%S')}", flush=True)
    measure_info(files, args.rounds, env)
    measure_view(files, args.rounds, env)
    measure_remote(files, data, env)
    measure_hostile(files, env)
    print(f"medians of {args.rounds} rounds; load average {os.getloadavg()} at {time.strftime('%H:%M:%S')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
