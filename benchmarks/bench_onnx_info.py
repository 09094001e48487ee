#!/usr/bin/env python3
"""``stfs info`` of a small ONNX model against ``stfs info`` of the safetensors file of the same tensors (SPEC §13:
as fast; issue #43's item 8, where the ONNX one took 2.3-3.4 s, 1.9 s of it importing the onnx package).

    python3 benchmarks/bench_onnx_info.py [--data DIR] [--rounds 7] [--baseline CHECKOUT]

Writes (once, kept in --data) a ~2 MiB model of 51 F32 tensors (a small MLP's weights and biases, an embedding), its
weights in ``raw_data`` as exporters write them (``numpy_helper.from_array``), plus a ``Constant`` of int64 shape
values in ``int64_data`` (``helper.make_tensor``), and ``safetensors.numpy.save_file`` of the same tensors. Then,
alternating, each round runs a fresh ``python3 -m stfs info`` of each (bytecode cached in --data, as an installed
package has it; the page cache warm). ``--baseline`` times the ONNX model with another checkout's stfs too.

Prints the medians (and the best of the rounds: the machine may be shared) and the ratio ONNX / safetensors.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from benchmarks.benchlib import MIB, STFS_REPO, bytecode_environment, warm  # noqa: E402


def write_models(folder: str) -> tuple[str, str]:
    """The ONNX model and the safetensors file of the same tensors, written once."""
    onnx_path = os.path.join(folder, "model.onnx")
    safetensors_path = os.path.join(folder, "model.safetensors")
    if os.path.exists(onnx_path) and os.path.exists(safetensors_path):
        return onnx_path, safetensors_path
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    arrays = {"embed.weight": rng.standard_normal((2000, 128)).astype(np.float32)}
    for layer in range(25):
        arrays[f"layers.{layer}.weight"] = rng.standard_normal((96, 96)).astype(np.float32)
        arrays[f"layers.{layer}.bias"] = rng.standard_normal(96).astype(np.float32)
    shape = helper.make_tensor("shape", TensorProto.INT64, [2], [-1, 96])
    nodes = [helper.make_node("Constant", [], ["shape"], value=shape)]
    graph = helper.make_graph(nodes, "mlp", [], [], [numpy_helper.from_array(a, n) for n, a in arrays.items()])
    onnx.save_model(helper.make_model(graph, producer_name="bench_onnx_info"), onnx_path)
    save_file({**arrays, "shape": np.array([-1, 96], np.int64)}, safetensors_path)
    return onnx_path, safetensors_path


def info_seconds(path: str, pycache: str, checkout: str) -> float:
    """Wall seconds of a fresh ``python3 -m stfs info PATH`` of ``checkout`` (exit status 0)."""
    env = bytecode_environment(pycache)
    env["PYTHONPATH"] = checkout
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "stfs", "info", path], capture_output=True, check=True, cwd=checkout, env=env)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "stfs-bench-onnx"))
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--baseline", help="another checkout of stfs: its info of the ONNX model, timed too")
    args = parser.parse_args()
    os.makedirs(args.data, exist_ok=True)
    onnx_path, safetensors_path = write_models(args.data)
    warm(onnx_path, safetensors_path)
    pycache = os.path.join(args.data, "pycache")
    runs = {"onnx": (onnx_path, STFS_REPO[0]), "safetensors": (safetensors_path, STFS_REPO[0])}
    if args.baseline:
        runs["onnx, baseline"] = (onnx_path, os.path.abspath(args.baseline))
    for path, checkout in runs.values():
        info_seconds(path, pycache, checkout)  # bytecode compiled, imports' files in the page cache
    results: dict[str, list[float]] = {key: [] for key in runs}
    for _ in range(args.rounds):
        for key, (path, checkout) in runs.items():
            results[key].append(info_seconds(path, pycache, checkout))
    median = {key: statistics.median(values) for key, values in results.items()}
    best = {key: min(values) for key, values in results.items()}
    for key, (path, checkout) in runs.items():
        print(
            f"stfs info {os.path.basename(path):18} {os.path.getsize(path) / MIB:5.2f} MiB  "
            f"median {median[key] * 1000:7.1f} ms  best {best[key] * 1000:7.1f} ms  ({checkout})"
        )
    for kind, values in (("median", median), ("best", best)):
        print(f"onnx / safetensors, {kind}: {values['onnx'] / values['safetensors']:.2f}x")
    print(f"{args.rounds} rounds, alternating; load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
