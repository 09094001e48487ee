#!/usr/bin/env python3
"""`find MNT -type f | wc -l` over one tree served four ways, rounds shuffled, and the daemon's RssAnon.

    python3 benchmarks/bench_find.py --data DIR --tensors 100000 --runs 20 --budget 480 \\
        --stfs main=/work/main --stfs this=.   [--cref none] [--no-squashfuse] [--rss]

Each round mounts, in a shuffled order, every ``--stfs LABEL=CHECKOUT[,VAR=VALUE...]`` (fresh mounts of
benchlib's many_model of --tensors), benchmarks/cref.c serving the very tree stfs shows (benchlib.tree_listing;
``--cref all|none`` adds its variants) and squashfuse_ll over a squashfs image of it, and times one ``find``
on each. The machine's speed swings by several times within minutes, so next to the medians it prints the
median of the per-round ratios (each stfs against the C reference and squashfuse_ll of the same round).
``--rss``: each stfs daemon's RssAnon after its mount, instead of ``find``. No round starts after --budget s.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from benchmarks import benchlib  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default="/tmp/stfs-bench")
    parser.add_argument("--tensors", type=int, default=100_000)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--budget", type=float, default=480.0, help="start no round after this many seconds")
    parser.add_argument("--stfs", action="append", default=[], help="LABEL=CHECKOUT[,VAR=VALUE...]")
    parser.add_argument("--cref", action="append", default=[], choices=["all", "none"], help="more C variants")
    parser.add_argument("--no-squashfuse", action="store_true")
    parser.add_argument("--rss", action="store_true", help="the stfs daemons' RssAnon, no find")
    args = parser.parse_args()
    os.makedirs(args.data, exist_ok=True)
    source = benchlib.many_model(args.data, args.tensors)
    binary = None if args.rss else benchlib.c_reference(args.data)
    listing = None if args.rss else benchlib.tree_listing(source)
    image = None if args.rss or args.no_squashfuse or listing is None else benchlib.squashfs_image(listing)
    jobs = [("stfs", spec) for spec in args.stfs]
    if binary is not None:
        jobs += [("cref", plus) for plus in ["folders", *args.cref]]
    if image is not None:
        jobs.append(("squashfuse_ll", ""))
    seconds: dict[str, list[float]] = {}
    print(f"load {os.getloadavg()} at {time.strftime('%H:%M:%S')}", flush=True)
    began = time.monotonic()
    for run in range(args.runs):
        if time.monotonic() - began > args.budget:
            print(f"budget spent after {run} rounds")
            break
        random.Random(run).shuffle(jobs)
        for kind, spec in jobs:
            if kind == "stfs":
                label, _, rest = spec.partition("=")
                checkout, *settings = rest.split(",")
                saved = dict(os.environ)
                os.environ.update(dict(setting.split("=", 1) for setting in settings))
                benchlib.STFS_REPO[0] = os.path.abspath(checkout)
                try:
                    benchlib.warm(source)
                    with benchlib.Mount(source, os.path.join(args.data, "mnt")) as mount:
                        if args.rss:
                            value = benchlib.proc_fields(mount.pid, "status")["RssAnon"] / benchlib.MIB
                        else:
                            value = benchlib.find_seconds(mount.mountpoint)
                finally:
                    os.environ.clear()
                    os.environ.update(saved)
            elif kind == "cref":
                assert binary is not None
                label = f"cref-{spec}"
                mountpoint = os.path.join(args.data, "mnt-cref")
                with benchlib.CReference(binary, f"list:{listing}", 0, 0, mountpoint, plus=spec) as server:
                    value = benchlib.find_seconds(server.mountpoint)
            else:
                assert image is not None
                label = kind
                with benchlib.SquashFuse(image, os.path.join(args.data, "mnt-squashfuse")) as squash:
                    value = benchlib.find_seconds(squash.mountpoint)
            seconds.setdefault(label, []).append(value)
        print(run, {label: round(values[-1], 2) for label, values in seconds.items()}, flush=True)
    rounds = min(len(values) for values in seconds.values())
    unit = "MiB" if args.rss else "s"
    for label, values in seconds.items():
        line = f"{label:16s} median {statistics.median(values):7.2f} {unit}"
        for other in ("cref-folders", "squashfuse_ll"):
            if other in seconds and other != label:
                ratios = sorted(values[i] / seconds[other][i] for i in range(rounds))
                quartiles = f"{ratios[rounds // 4]:.2f}-{ratios[3 * rounds // 4]:.2f}"
                line += f"  {other} x{statistics.median(ratios):.3f} [{quartiles}]"
        print(line)
    print(f"load {os.getloadavg()} at {time.strftime('%H:%M:%S')}; {rounds} rounds")
    return 0


if __name__ == "__main__":
    sys.exit(main())
