"""``stfs diff`` and ``stfs check --values`` on 1 GiB BF16 models, side by side with what people run today.

Every figure is end to end (a new process, imports included) with the page cache warm, the median of ``--runs``
rounds that run each command and its reference in turn:

  identical   ``stfs diff A A2`` (two files with the same bytes) next to ``cmp A A2``          target <= 1.5x
  one value   ``stfs diff A B`` (B: A with one BF16 value changed) next to the script a user writes today:
              safetensors ``safe_open`` both, ``torch.equal`` each pair, ``(x - y).abs().max()`` where unequal
                                                                                          target <= 0.5x
  check       ``stfs check --values A`` next to the same kind of script with ``torch.isnan``/``torch.isinf``
                                                                                          target <= 0.3x
  memory      peak RSS (``/usr/bin/time -f %M``) of ``stfs diff`` of two 1.5 GiB models that differ in one value
              of every tensor                                                             target < 450 MiB
  remote      ``stfs diff`` of A and B both over HTTP (nginx on loopback, tests/servers.py), then of A local and B
              over HTTP: response body bytes in its access log / bytes compared (and time, peak RSS)
                                                                                          target <= 1.1
  hub         ``stfs diff`` of a local copy of A against the same file in a Hub repository (the tests' fake Hub on
              nginx): bytes its CDN sent (the header's first read only)                   target: no tensor bytes

    python3 benchmarks/bench_diff.py --data /tmp/stfs-bench-diff --runs 5

The models are made once into ``--data`` (5 GiB) and kept; ``--clean`` deletes them first.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from benchmarks.benchlib import MIB, bf16_fill, environment, log, stfs_command, warm, write_model  # noqa: E402
from tests.servers import FakeHub, Nginx, find_tool  # noqa: E402

TENSOR_SHAPE = [4096, 4096]  # BF16: 32 MiB a tensor
TENSOR_BYTES = 2 * TENSOR_SHAPE[0] * TENSOR_SHAPE[1]
TENSORS = 32  # 1 GiB
BIG_TENSORS = 48  # 1.5 GiB

DIFF_SCRIPT = """
import sys, torch
from safetensors import safe_open
with safe_open(sys.argv[1], "pt") as a, safe_open(sys.argv[2], "pt") as b:
    for name in a.keys():
        x, y = a.get_tensor(name), b.get_tensor(name)
        if not torch.equal(x, y):
            print(name, (x - y).abs().max().item())
"""

CHECK_SCRIPT = """
import sys, torch
from safetensors import safe_open
with safe_open(sys.argv[1], "pt") as f:
    for name in f.keys():
        x = f.get_tensor(name)
        nan, inf = int(torch.isnan(x).sum()), int(torch.isinf(x).sum())
        if nan or inf:
            print(name, nan, inf)
"""


def make_model(path: Path, tensors: int, seed: int) -> int:
    """A BF16 model of ``tensors`` 32 MiB tensors; the offset of its data."""
    layout = [(f"model.layers.{i}.weight", "BF16", TENSOR_SHAPE, TENSOR_BYTES) for i in range(tensors)]
    return 8 + write_model(str(path), layout, bf16_fill(seed, 0.02))


def change_values(path: Path, data_start: int, offsets: list[int]) -> None:
    """Flip the lowest mantissa bit of the BF16 values at these data offsets (one value each: another value)."""
    with open(path, "r+b") as stream:
        for offset in offsets:
            stream.seek(data_start + offset)
            low = stream.read(1)[0]
            stream.seek(data_start + offset)
            stream.write(bytes([low ^ 1]))


def models(data: Path) -> dict[str, Path]:
    """The models, made if missing: a, a2 (a's bytes), one (a with one value changed), big_a and big_b (1.5 GiB)."""
    data.mkdir(parents=True, exist_ok=True)
    paths = {name: data / f"{name}.safetensors" for name in ("a", "a2", "one", "big_a", "big_b")}
    if not paths["a"].exists():
        log("writing a 1 GiB BF16 model")
        start = make_model(paths["a"], TENSORS, seed=1)
        shutil.copyfile(paths["a"], paths["a2"])
        shutil.copyfile(paths["a"], paths["one"])
        change_values(paths["one"], start, [TENSORS // 2 * TENSOR_BYTES + TENSOR_BYTES // 2 + 1234])
    if not paths["big_a"].exists():
        log("writing two 1.5 GiB BF16 models")
        start = make_model(paths["big_a"], BIG_TENSORS, seed=2)
        shutil.copyfile(paths["big_a"], paths["big_b"])
        change_values(
            paths["big_b"], start, [i * TENSOR_BYTES + (i * 7919 % TENSOR_BYTES) // 2 * 2 for i in range(BIG_TENSORS)]
        )
    return paths


def side_by_side(commands: dict[str, tuple[list[str], int]], runs: int) -> dict[str, float]:
    """The median wall time of each command (name -> (command, the exit code it must give)) over ``runs`` rounds,
    each round running every command once in turn: a machine whose load drifts weighs on both sides alike."""
    times: dict[str, list[float]] = {name: [] for name in commands}
    for _ in range(runs):
        for name, (command, expect) in commands.items():
            started = time.perf_counter()
            result = subprocess.run(command, capture_output=True, text=True, env=environment())
            times[name].append(time.perf_counter() - started)
            if result.returncode != expect:
                raise RuntimeError(f"{command}: exit {result.returncode}: {result.stderr.strip()}")
    return {name: statistics.median(found) for name, found in times.items()}


def peak_rss(command: list[str]) -> int:
    """The peak RSS of ``command``, in bytes (GNU time's %M)."""
    result = subprocess.run(["/usr/bin/time", "-f", "%M", *command], capture_output=True, text=True, env=environment())
    return int(result.stderr.strip().splitlines()[-1]) * 1024


@contextlib.contextmanager
def serving(data: Path) -> Iterator[Nginx]:
    executable = find_tool("nginx")
    if executable is None:
        raise RuntimeError("nginx is not installed (Debian package nginx-light)")
    workdir = data / "nginx"
    shutil.rmtree(workdir, ignore_errors=True)
    server = Nginx(workdir, executable=executable)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def timed(command: list[str], env: dict[str, str], expect: int) -> tuple[float, int]:
    """Wall time and peak RSS (bytes) of one run of ``command``."""
    started = time.perf_counter()
    result = subprocess.run(["/usr/bin/time", "-f", "%M", *command], capture_output=True, text=True, env=env)
    elapsed = time.perf_counter() - started
    if result.returncode != expect:
        raise RuntimeError(f"{command}: exit {result.returncode}: {result.stderr.strip()}")
    return elapsed, int(result.stderr.strip().splitlines()[-1]) * 1024


def remote_figures(data: Path, paths: dict[str, Path]) -> dict[str, float]:
    """Over HTTP (both sides, then one): bytes fetched / compared, time and peak RSS; a local copy against the Hub:
    what its CDN sent."""
    figures: dict[str, float] = {}
    with serving(data) as nginx:
        for name in ("a", "one"):
            os.link(paths[name], nginx.root / f"{name}.safetensors")
        for label, sides, compared in (
            ("remote", (f"{nginx.url}/a.safetensors", f"{nginx.url}/one.safetensors"), 2),
            ("one_remote", (str(paths["a"]), f"{nginx.url}/one.safetensors"), 1),
        ):
            nginx.log.clear()
            seconds_taken, rss = timed(stfs_command("diff", *sides), environment(), expect=1)
            fetched = sum(entry.body_bytes for entry in nginx.log.entries())
            figures[f"{label}_seconds"], figures[f"{label}_rss"] = seconds_taken, rss
            figures[f"{label}_fetched_ratio"] = fetched / (compared * TENSORS * TENSOR_BYTES)
        hub = FakeHub(nginx)
        hub.publish_repo("org", "model", {"model.safetensors": paths["a"].read_bytes()})
        hub.cdn_log.clear()
        local = data / "download"
        local.mkdir(exist_ok=True)
        with contextlib.suppress(FileExistsError):
            os.link(paths["a"], local / "model.safetensors")
        env = dict(environment(), HF_ENDPOINT=hub.endpoint, HF_HOME=str(data / "hf_home"), HF_HUB_DISABLE_XET="1")
        env.pop("HF_TOKEN", None)
        figures["hub_seconds"], _ = timed(stfs_command("diff", str(local), "hf://org/model"), env, expect=0)
        figures["hub_cdn_bytes"] = sum(entry.body_bytes for entry in hub.cdn_log.entries())
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default="/tmp/stfs-bench-diff", help="where the models are kept")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", help="write the figures as JSON here")
    parser.add_argument("--clean", action="store_true", help="make the models again")
    parser.add_argument("--no-remote", action="store_true", help="skip the remote figures (needs nginx)")
    args = parser.parse_args()
    data = Path(args.data)
    if args.clean:
        shutil.rmtree(data, ignore_errors=True)
    paths = models(data)
    a, a2, one = (str(paths[name]) for name in ("a", "a2", "one"))
    python = sys.executable
    figures: dict[str, float] = {}

    log("identical: stfs diff and cmp")
    warm(paths["a"], paths["a2"])
    figures |= side_by_side({"cmp": (["cmp", a, a2], 0), "diff_identical": (stfs_command("diff", a, a2), 0)}, args.runs)

    log("one value: stfs diff and the torch script")
    warm(paths["a"], paths["one"])
    one_value = {"torch_diff": ([python, "-c", DIFF_SCRIPT, a, one], 0), "diff_one": (stfs_command("diff", a, one), 1)}
    figures |= side_by_side(one_value, args.runs)

    log("check --values and the torch script")
    check = {
        "torch_check": ([python, "-c", CHECK_SCRIPT, a], 0),
        "check_values": (stfs_command("check", "--values", a), 0),
    }
    figures |= side_by_side(check, args.runs)

    log("memory: two 1.5 GiB models")
    warm(paths["big_a"], paths["big_b"])
    figures["peak_rss"] = peak_rss(stfs_command("diff", str(paths["big_a"]), str(paths["big_b"])))
    figures["python_rss"] = peak_rss([python, "-c", "import numpy, stfs.diff"])

    if not args.no_remote:
        log("remote: both sides over HTTP; a local copy against the Hub")
        figures |= remote_figures(data, paths)

    rows = [
        (
            "stfs diff, identical models",
            f"{figures['diff_identical']:.2f} s",
            f"cmp {figures['cmp']:.2f} s",
            figures["diff_identical"] / figures["cmp"],
            "<= 1.5x",
        ),
        (
            "stfs diff, one value differs",
            f"{figures['diff_one']:.2f} s",
            f"torch script {figures['torch_diff']:.2f} s",
            figures["diff_one"] / figures["torch_diff"],
            "<= 0.5x",
        ),
        (
            "stfs check --values",
            f"{figures['check_values']:.2f} s",
            f"torch script {figures['torch_check']:.2f} s",
            figures["check_values"] / figures["torch_check"],
            "<= 0.3x",
        ),
    ]
    print(f"{'figure':32} {'stfs':>10} {'reference':>24} {'ratio':>7}  target")
    for name, ours, theirs, ratio, target in rows:
        print(f"{name:32} {ours:>10} {theirs:>24} {ratio:>6.2f}x  {target}")
    print(
        f"{'peak RSS, two 1.5 GiB models':32} {figures['peak_rss'] / MIB:>8.0f} MiB "
        f"{'python + numpy: ' + format(figures['python_rss'] / MIB, '.0f') + ' MiB':>24} {'':>7}  < 450 MiB"
    )
    if not args.no_remote:
        for label, name in (("remote", "both"), ("one_remote", "one")):
            how = f"in {figures[label + '_seconds']:.2f} s, {figures[label + '_rss'] / MIB:.0f} MiB"
            ratio = figures[label + "_fetched_ratio"]
            print(f"{'remote, ' + name + ': fetched / compared':32} {ratio:>10.3f} {how:>24}          <= 1.1")
        print(
            f"{'hub: CDN bytes, local copy':32} {figures['hub_cdn_bytes']:>10.0f} "
            f"{'in ' + format(figures['hub_seconds'], '.2f') + ' s':>24} {'':>7}  no tensor bytes"
        )
    if args.out:
        Path(args.out).write_text(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
