#!/usr/bin/env python3
"""Mutation fuzzing of the HDF5 reader (stfs/formats/hdf5/) on files h5py and Keras 3 write, h5py the reference.

    python3 fuzz/fuzz_hdf5.py --seconds 600 --out /tmp/hdf5/fuzz
    python3 fuzz/fuzz_hdf5.py --replay /tmp/hdf5/fuzz/findings/*.h5

Seeds: h5py files of libver earliest and latest (superblocks 0 and 3, object headers v1 and v2), compact,
contiguous and chunked datasets (a version 1 B-tree, a fixed array, a version 2 B-tree), a group of dense links and
attributes, Keras 3's ``.weights.h5`` (bfloat16) and ``.keras``. Mutations, one to three a case: bit flips, bytes set
to extremes, a 2-, 4- or 8-byte field set to an extreme or nudged, truncations, inserted, deleted and repeated runs.

Each case runs in a worker process whose address space is capped (``RLIMIT_AS``: what it had after its imports plus
``--memory`` MiB), with a per-case ``--timeout``. stfs reads the header and every tensor's bytes: anything but an
``Hdf5Error`` (or another ``StfsError`` of one line) is a finding, and so are a hang and a worker killed by the cap.
Where stfs accepts the file, h5py reads it too: a dataset h5py reads with other bytes than stfs serves is a finding;
a file h5py refuses (or that crashes libhdf5, after stfs's verdict) is counted apart. Prints a summary whose last
line is ``findings: N``; exits 1 when N > 0.
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
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from fuzz.worker import Worker, serve  # noqa: E402 (after the checkout is on the path)

os.environ.setdefault("KERAS_BACKEND", "torch")

INTERESTING = [0, 1, 2, 3, 4, 7, 8, 15, 16, 255, 256, 2**15, 2**16 - 1, 2**31 - 1, 2**32 - 1, 2**63 - 1, 2**64 - 1]


def write_seeds(folder: str, keras: bool = True) -> list[str]:
    """The seed files (h5py's, and Keras' where ``keras``), written into ``folder``."""
    from tests.hdf5_files import WRITERS, many_links, write_keras

    base = Path(folder)
    paths = [WRITERS[kind](base / f"{kind}.h5") for kind in WRITERS]
    paths.append(many_links(base / "dense.h5", 12))
    paths.append(many_links(base / "dense-order.h5", 12, libver="earliest", track_order=True))
    if keras:
        paths += list(write_keras(base))
    return [str(path) for path in paths]


def mutate(rng: random.Random, data: bytes) -> tuple[bytes, str]:
    out = bytearray(data)
    hows = []
    for _ in range(rng.randint(1, 3)):
        kind = rng.choice(["flip", "byte", "field", "field", "nudge", "cut", "insert", "delete", "repeat"])
        at = rng.randrange(max(1, len(out)))
        if kind == "flip" and out:
            out[at] ^= 1 << rng.randrange(8)
        elif kind == "byte" and out:
            out[at] = rng.choice([0, 1, 0x7F, 0x80, 0xFF])
        elif kind in ("field", "nudge"):
            size = rng.choice([2, 4, 8])
            if at + size > len(out):
                continue
            if kind == "field":
                value = rng.choice(INTERESTING) % (1 << (8 * size))
            else:
                value = (int.from_bytes(out[at : at + size], "little") + rng.choice([-8, -1, 1, 8])) % (1 << (8 * size))
            out[at : at + size] = value.to_bytes(size, "little")
        elif kind == "cut":
            del out[rng.randrange(len(out) + 1) :]
        elif kind == "insert":
            out[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))
        elif kind == "delete":
            del out[at : at + rng.randint(1, 16)]
        elif kind == "repeat":
            out[at:at] = out[at : at + rng.randint(1, 64)]
        hows.append(f"{kind}@{at}")
    return bytes(out), " ".join(hows)


def stfs_tensors(data: bytes, path: str) -> dict[str, bytes]:
    """What stfs serves of the file ``data``: every tensor's bytes by name."""
    from stfs.formats import dtype, named, read_with

    def fetch(offset: int, size: int) -> bytes:
        return data[offset : offset + size]

    header = read_with(named("hdf5"), fetch, path=path, file_size=len(data))
    out = {}
    for entry in header.tensors:
        # what the seam checks of every format: a dtype of the table, bytes = shape x size, a range inside the file
        assert entry.size == entry.parameters * dtype(entry.dtype).element_bytes, (entry.name, "size")
        assert 0 <= entry.begin <= entry.end <= len(data), (entry.name, entry.begin, entry.end)
        if entry.scattered is not None:
            buffer = bytearray(entry.size)
            entry.scattered.read_into(lambda o, n, file=None, span=None: data[o : o + n], 0, memoryview(buffer))
            out[entry.name] = bytes(buffer)
        else:
            out[entry.name] = data[entry.begin : entry.end]
    return out


def h5py_view(data: bytes, scratch: str, keras: bool) -> dict[str, bytes] | str:
    """h5py's ``dataset[()]`` bytes of each dataset, or why h5py refuses the file."""
    import zipfile

    from tests.hdf5_files import h5py_tensors

    path = os.path.join(scratch, "case.h5")
    with open(path, "wb") as stream:
        stream.write(data)
    try:
        if keras:
            with zipfile.ZipFile(path) as archive:
                archive.extract("model.weights.h5", scratch)
            path = os.path.join(scratch, "model.weights.h5")
        return {name: raw for name, (_, _, raw) in h5py_tensors(Path(path)).items()}
    except Exception as exc:
        return f"h5py refuses: {type(exc).__name__}"


def check_case(data: bytes, scratch: str, keras: bool) -> tuple[dict[str, Any], dict[str, bytes] | None]:
    from stfs.errors import StfsError

    path = "case.keras" if keras else "case.h5"
    try:
        ours = stfs_tensors(data, path)
    except StfsError as exc:
        message = str(exc)
        if "\n" in message or not message:
            return {"status": "finding", "why": f"a refusal of {len(message.splitlines())} lines"}, None
        return {"status": "refused", "rule": type(exc).__name__}, None
    except RecursionError:
        return {"status": "finding", "why": "RecursionError"}, None
    except Exception as exc:
        return {"status": "finding", "why": f"{type(exc).__name__}: {exc}"[:300], "trace": traceback.format_exc()}, None
    return {"status": "accepted", "tensors": len(ours)}, ours


def answers(case: bytes, scratch: str) -> Iterator[dict[str, Any]]:
    """A case (a flag byte, 1 for a Keras file, then the file): stfs's verdict, then, where stfs read it, h5py's
    comparison (a second answer: its keeper times h5py apart, and libhdf5 hanging or dying is not stfs's finding)."""
    keras, data = bool(case[0]), case[1:]
    result, ours = check_case(data, scratch, keras)
    yield result
    if ours is None:
        return
    theirs = h5py_view(data, scratch, keras)
    if isinstance(theirs, str):
        compared = theirs
    else:
        differ = sorted(name for name in ours if name in theirs and theirs[name] != ours[name])
        compared = f"differ: {differ[:3]}" if differ else ("same" if set(ours) <= set(theirs) else "h5py lacks some")
    yield {"h5py": compared}


def worker(memory_mib: int) -> None:
    """Answer cases from stdin (fuzz/worker.py), capped at ``memory_mib`` over the imports."""
    import h5py  # noqa: F401  (imported before the cap: what the cap adds to is the reader's own use)
    import numpy  # noqa: F401

    from stfs.formats import hdf5  # noqa: F401

    scratch = tempfile.mkdtemp(prefix="stfs-fuzz-hdf5-")
    serve(lambda case: answers(case, scratch), memory_mib)


class HdfWorker(Worker):
    """The keeper of this file's worker: stfs's verdict within ``timeout``, then h5py's within ``h5py_timeout``."""

    def compare(self, data: bytes, keras: bool, timeout: float, h5py_timeout: float) -> tuple[dict[str, Any], str]:
        if not self.send(bytes([keras]) + data):
            return self.restart("worker died before the case"), ""
        result = self.answer(timeout)
        if isinstance(result, str):
            return self.restart(result), ""
        if result["status"] != "accepted":
            return result, ""
        compared = self.answer(h5py_timeout)
        if isinstance(compared, str):  # libhdf5 hung or crashed on the file stfs read: h5py's, not a finding
            self.restart(compared)
            return result, "h5py crashed or hung"
        return result, str(compared["h5py"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=30.0, help="stop after this long")
    parser.add_argument("--cases", type=int, default=0, help="stop after this many cases (0: no limit)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="", help="folder for seeds and findings (default: a temporary one)")
    parser.add_argument("--memory", type=int, default=256, help="MiB a case may add to the worker's address space")
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds a case may take")
    parser.add_argument("--h5py-timeout", type=float, default=3.0, help="seconds h5py may take (then counted apart)")
    parser.add_argument("--no-keras", action="store_true", help="seeds from h5py alone (no Keras import)")
    parser.add_argument("--replay", nargs="*", default=None, help="run these files, once each")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.memory)
        return 0
    out = args.out or tempfile.mkdtemp(prefix="stfs-fuzz-hdf5-")
    os.makedirs(os.path.join(out, "findings"), exist_ok=True)
    seeds_dir = os.path.join(out, "seeds")
    os.makedirs(seeds_dir, exist_ok=True)
    if args.replay is not None:
        cases = [(path, Path(path).read_bytes(), "replay") for path in args.replay]
        seeds = []
    else:
        seeds = [
            (os.path.basename(path), Path(path).read_bytes()) for path in write_seeds(seeds_dir, not args.no_keras)
        ]
    rng = random.Random(args.seed)
    runner = HdfWorker(__file__, args.memory)
    tally: collections.Counter[str] = collections.Counter()
    refusals: collections.Counter[str] = collections.Counter()
    reference: collections.Counter[str] = collections.Counter()
    findings = 0
    started = time.monotonic()
    done = 0
    try:
        while True:
            if args.replay is not None:
                if done >= len(cases):
                    break
                name, data, how = cases[done]
            else:
                if time.monotonic() - started > args.seconds or (args.cases and done >= args.cases):
                    break
                name, seed = seeds[done] if done < len(seeds) else rng.choice(seeds)
                data, how = (seed, "seed") if done < len(seeds) else mutate(rng, seed)
            result, compared = runner.compare(data, name.endswith(".keras"), args.timeout, args.h5py_timeout)
            done += 1
            tally[result["status"]] += 1
            if result["status"] == "refused":
                refusals[result["rule"]] += 1
            if compared:
                reference[compared.split(":")[0]] += 1
            finding = (
                result["status"] == "finding" or compared.startswith("differ") or (how == "seed" and compared != "same")
            )
            if finding:
                findings += 1
                where = os.path.join(out, "findings", f"finding-{findings}-{name}")
                Path(where).write_bytes(data)
                print(f"FINDING {where} ({how}): {result.get('why', compared)}")
                if "trace" in result:
                    print(result["trace"])
    finally:
        runner.stop()
    print(f"cases: {done} in {time.monotonic() - started:.0f} s; {dict(tally)}")
    print(f"refusals: {dict(refusals.most_common())}")
    print(f"accepted, h5py: {dict(reference)}")
    print(f"findings: {findings}")
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
