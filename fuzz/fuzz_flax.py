#!/usr/bin/env python3
"""Mutation fuzzing of the Flax msgpack reader (stfs/formats/flax.py) on files flax.serialization.to_bytes writes,
checked against flax's own reader (``flax.serialization.msgpack_restore``).

    python3 fuzz/fuzz_flax.py --seconds 600 --out /tmp/fuzz-flax
    python3 fuzz/fuzz_flax.py --replay /tmp/fuzz-flax/findings/case-*.msgpack

Seeds: a nested state dict of several dtypes with a numpy scalar and plain values, a file of chunked arrays, a
transformers-style shard (flat keys holding ``/``), lists of plain values. Mutations, one to three a case, mostly
in the framing (every byte outside the arrays' bytes): bit flips, bytes set to msgpack's markers or extremes,
truncations, inserted, deleted and repeated byte runs.

Each case runs in a worker process whose address space is capped (``--memory`` MiB over what its imports took),
with a per-case ``--timeout``: the case goes through ``formats.read_with`` (the seam's checks included). A refusal
must be one ``FlaxError`` line naming the file; an accepted file must be one flax reads, with the same arrays (names,
dtypes, shapes) and each tensor's bytes, read as stfs serves them (a range, or its chunks gathered), equal to the
array's. Anything else (another exception, a hang, a worker killed by the cap, a disagreement) is a finding, written
to ``--out``/findings. Prints a summary whose last line is ``findings: N``; exits 1 when N > 0.
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import sys
import tempfile
import time
import traceback
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from fuzz.worker import Worker, serve  # noqa: E402 (after the checkout is on the path)

MARKERS = [0x00, 0x7F, 0x80, 0x8F, 0x90, 0x9F, 0xA0, 0xBF, 0xC0, 0xC1, 0xC4, 0xC6, 0xC7, 0xC9, 0xCB, 0xCF, 0xD3,
           0xD4, 0xD8, 0xD9, 0xDB, 0xDC, 0xDD, 0xDE, 0xDF, 0xE0, 0xFF]  # fmt: skip


def write_seeds() -> list[tuple[str, bytes]]:
    import numpy as np
    from flax import serialization

    rng = np.random.default_rng(0)
    state = {
        "params": {
            "dense": {"kernel": rng.standard_normal((4, 3)).astype(np.float32), "bias": np.ones(3, np.float16)},
            "norm": {"scale": np.arange(4, dtype=np.int8), "mask": np.array([True, False])},
            "empty": np.zeros((0, 2), np.float64),
        },
        "step": np.int32(7),
        "config": {"name": "tiny", "rate": 0.5, "sizes": [1, 2, 3], "none": None, "c": 1 + 2j},
    }
    seeds = [("state.msgpack", serialization.to_bytes(state))]
    shard = {"model/layers/0/kernel": np.arange(6, dtype=np.uint16).reshape(2, 3), "model/norm": np.ones(2, np.int64)}
    seeds.append(("shard.msgpack", serialization.to_bytes(shard)))
    saved = serialization.MAX_CHUNK_SIZE
    serialization.MAX_CHUNK_SIZE = 24  # flax chunks arrays over this many bytes
    try:
        chunked = {"big": {"w": np.arange(30, dtype=np.float32).reshape(5, 6)}, "small": np.arange(3, dtype=np.int16)}
        seeds.append(("chunked.msgpack", serialization.to_bytes(chunked)))
    finally:
        serialization.MAX_CHUNK_SIZE = saved
    return seeds


def framing(data: bytes) -> list[int]:
    """The offsets of a valid file's bytes that are not an array's bytes: where mutations mostly go."""
    from stfs.formats import flax

    header = flax.fetch_header(lambda offset, size: data[offset : offset + size], path="seed", file_size=len(data))
    inside = set()
    for entry in header.tensors:
        parts = entry.scattered.parts if entry.scattered is not None else [(entry.begin, entry.size)]
        for offset, size in parts:
            inside.update(range(offset, offset + size))
    return [i for i in range(len(data)) if i not in inside]


def mutate(rng: random.Random, data: bytes, places: list[int]) -> tuple[bytes, str]:
    out = bytearray(data)
    done = []
    for _ in range(rng.choice((1, 1, 1, 2, 2, 3))):
        if not out:
            break
        at = rng.choice(places) if places and rng.random() < 0.85 else rng.randrange(len(out))
        at = min(at, len(out) - 1)
        kind = rng.randrange(7)
        if kind <= 1:
            out[at] = rng.choice(MARKERS) if rng.random() < 0.7 else rng.randrange(256)
            done.append(f"byte@{at}")
        elif kind == 2:
            for _ in range(rng.randint(1, 4)):
                out[at] ^= 1 << rng.randrange(8)
            done.append(f"bits@{at}")
        elif kind == 3:
            del out[at:]
            done.append(f"truncate@{at}")
        elif kind == 4:
            out[at:at] = bytes(rng.randrange(256) for _ in range(rng.choice((1, 2, 4, 9))))
            done.append(f"insert@{at}")
        elif kind == 5:
            del out[at : at + rng.choice((1, 2, 4, 8))]
            done.append(f"delete@{at}")
        else:
            start = rng.randrange(len(out))
            out[at:at] = out[start : start + rng.choice((4, 8, 16, 32))]
            done.append(f"repeat@{start}->{at}")
    return bytes(out), ",".join(done) or "none"


def flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    """A restored state dict's leaves by name, as stfs names tensors (lists by index, ``/`` in a key as ``.``)."""
    items = tree.items() if isinstance(tree, dict) else enumerate(tree)
    leaves: dict[str, Any] = {}
    for key, value in items:
        name = prefix + str(key).replace("/", ".")
        if isinstance(value, dict | list):
            leaves |= flat(value, name + ".")
        else:
            leaves[name] = value
    return leaves


def check_case(data: bytes) -> dict[str, Any]:
    import numpy as np
    from flax import serialization

    from stfs import errors, formats
    from stfs.formats import flax

    def read(offset: int, size: int, file: str | None = None, span: tuple[int, int] | None = None) -> bytes:
        return data[offset : offset + size]

    try:
        header = formats.read_with(formats.named("flax"), read, path="case.msgpack", file_size=len(data))
    except flax.FlaxError as exc:
        if "\n" in exc.message or not exc.message.startswith("case.msgpack: "):
            return {"status": "finding", "why": f"refusal not one line naming the file: {exc.message!r}"}
        return {"status": "refused", "error": type(exc).__name__}
    except errors.FormatBug as exc:
        return {"status": "finding", "why": f"the seam caught the reader: {exc.message}"}
    except Exception:
        return {"status": "finding", "why": traceback.format_exc()}
    try:
        theirs = serialization.msgpack_restore(data)
    except Exception as exc:
        return {"status": "finding", "why": f"accepted, but flax refuses it: {type(exc).__name__}: {exc}"[:300]}
    arrays = {
        name: np.asarray(leaf) for name, leaf in flat(theirs).items() if isinstance(leaf, np.ndarray | np.generic)
    }
    ours = {entry.name: entry for entry in header.tensors}
    if set(arrays) != set(ours):
        return {"status": "finding", "why": f"tensors differ: ours {sorted(ours)}, flax's {sorted(arrays)}"[:400]}
    for name, array in arrays.items():
        entry = ours[name]
        expected = flax.DTYPES.get(array.dtype.name, ("?", 0))[0]
        if entry.dtype != expected or entry.shape != array.shape:
            return {"status": "finding", "why": f"{name}: ours {entry.dtype}{entry.shape}, {array.dtype}{array.shape}"}
        if entry.scattered is not None:
            buffer = bytearray(entry.size)
            entry.scattered.read_into(read, 0, memoryview(buffer))
            served = bytes(buffer)
        else:
            served = data[entry.begin : entry.end]
        if served != array.tobytes():
            return {"status": "finding", "why": f"{name}: its bytes differ from flax's"}
    return {"status": "accepted"}


def worker(memory_mib: int) -> None:
    """Answer cases from stdin, one JSON line each (fuzz/worker.py), capped at ``memory_mib`` over the imports."""
    import flax.serialization  # noqa: F401  (imported before the cap: what the cap adds to is the reader's own use)

    from stfs.formats import flax as ours  # noqa: F401

    serve(check_case, memory_mib)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=30.0, help="stop after this long")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="", help="folder for findings (default: a temporary one)")
    parser.add_argument("--memory", type=int, default=256, help="MiB a case may add to the worker's address space")
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds a case may take")
    parser.add_argument("--replay", nargs="*", default=None, help="run these files, once each")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.memory)
        return 0
    out = args.out or tempfile.mkdtemp(prefix="stfs-fuzz-flax-")
    os.makedirs(os.path.join(out, "findings"), exist_ok=True)
    if args.replay is not None:
        cases = []
        for path in args.replay:
            with open(path, "rb") as stream:
                cases.append((path, stream.read(), "replay"))
    seeds = [(name, data, framing(data)) for name, data in write_seeds()]
    rng = random.Random(args.seed)
    runner = Worker(__file__, args.memory)
    tally: collections.Counter[str] = collections.Counter()
    findings = done = 0
    started = time.monotonic()
    try:
        while True:
            if args.replay is not None:
                if done >= len(cases):
                    break
                name, data, how = cases[done]
            elif time.monotonic() - started > args.seconds:
                break
            elif done < len(seeds):
                name, data, _ = seeds[done]
                how = "seed"
            else:
                name, seed, places = rng.choice(seeds)
                data, how = mutate(rng, seed, places)
            result = runner.run(data, args.timeout)
            done += 1
            tally[result["status"] + (f" ({result['error']})" if "error" in result else "")] += 1
            if result["status"] == "finding":
                findings += 1
                stem = os.path.join(out, "findings", f"case-{done:07d}")
                with open(stem + ".msgpack", "wb") as stream:
                    stream.write(data)
                with open(stem + ".txt", "w") as stream:
                    stream.write(f"from {name} by {how}\n{result['why']}\n")
                print(f"finding {stem}: {result['why'].strip().splitlines()[-1]}", flush=True)
    finally:
        runner.stop()
    elapsed = time.monotonic() - started
    print(f"cases: {done} in {elapsed:.1f} s ({done / max(elapsed, 1e-9):.0f}/s)")
    for status, count in sorted(tally.items()):
        print(f"  {status}: {count}")
    print(f"findings: {findings}")
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
