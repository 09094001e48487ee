"""``stfs mount`` of a local model of N tensors (default 300), checkouts alternated: the fixed cost of a mount.

    python3 benchmarks/bench_mount_start.py --rounds 15 BEFORE_CHECKOUT AFTER_CHECKOUT

Each round mounts the same model once with each checkout (``PYTHONPATH`` pointing at it, run from it), in turn,
timing ``python3 -m stfs mount MODEL MNT`` from start until it returns (the daemon answers), then unmounts. The order
within a round alternates, so neither checkout always goes first. Prints the median per checkout and the
paired ratios (each checkout against the first), and how often each was slower.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

import numpy as np
from safetensors.numpy import save_file

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.benchlib import STFS_REPO, Mount  # noqa: E402


def mount_seconds(checkout: str, model: str, mountpoint: str) -> float:
    STFS_REPO[0] = checkout
    with Mount(model, mountpoint) as mount:
        pythonpath = mount.environ()["PYTHONPATH"]
    assert pythonpath.split(os.pathsep)[0] == checkout, pythonpath  # the daemon ran the checkout asked for
    return mount.seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkouts", nargs="+", help="folders of stfs checkouts; the first is the baseline")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--tensors", type=int, default=300)
    args = parser.parse_args()
    checkouts = [os.path.abspath(c) for c in args.checkouts]
    with tempfile.TemporaryDirectory(prefix="stfs-mount-start-", dir=os.environ.get("TMPDIR")) as work:
        model = os.path.join(work, "m.safetensors")
        save_file(
            {f"model.layers.{i}.mlp.up_proj.weight": np.zeros(64, np.float32) for i in range(args.tensors)}, model
        )
        mountpoint = os.path.join(work, "mnt")
        os.mkdir(mountpoint)
        for checkout in checkouts:  # warm up: the model and the interpreter in the page cache
            mount_seconds(checkout, model, mountpoint)
        times: dict[str, list[float]] = {c: [] for c in checkouts}
        for number in range(args.rounds):
            order = checkouts if number % 2 == 0 else checkouts[::-1]
            for checkout in order:
                times[checkout].append(mount_seconds(checkout, model, mountpoint))
    base = times[checkouts[0]]
    print(f"stfs mount of {args.tensors} tensors, {args.rounds} alternated rounds; uptime: {os.getloadavg()}")
    for checkout in checkouts:
        ratios = [t / b for t, b in zip(times[checkout], base, strict=True)]
        slower = sum(r > 1 for r in ratios)
        print(
            f"{checkout}: median {statistics.median(times[checkout]):.4f} s "
            f"[{min(times[checkout]):.4f}-{max(times[checkout]):.4f}], paired ratio median "
            f"{statistics.median(ratios):.3f}, slower than the first in {slower} of {args.rounds}"
        )


if __name__ == "__main__":
    main()
