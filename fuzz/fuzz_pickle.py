#!/usr/bin/env python3
"""Fuzzing the PyTorch checkpoint reader (stfs/formats/pytorch.py) with mutations of real torch.save files.

Seeds are checkpoints the real torch writes (zip and legacy layouts, protocols 2 and 4, a Lightning-style dict,
views, tied weights, a whole module). Each input is one seed mutated: bytes of its pickle flipped, overwritten
with boundary integers, cut, repeated or spliced with hostile snippets (then wrapped in a valid zip again, so the
interpreter is what is tested), or the file itself mutated (end records, central directory, local headers, the
legacy counts). A failure is

- an exception from the reader that is not an ``StfsError``;
- an accepted file whose tensors do not lie inside their storages and the file, or whose safetensors header
  cannot be made;
- with ``--torch``: a file ``torch.load(weights_only=True)`` and stfs both accept whose tensors differ (names,
  dtypes, shapes, bytes), for the plain dicts of tensors torch returns.

    python3 fuzz/fuzz_pickle.py --inputs 2000 --seed 1          # what tests/test_pytorch_format.py runs, less
    python3 fuzz/fuzz_pickle.py --seconds 600 --torch
    python3 fuzz/fuzz_pickle.py --hostile                        # time and memory of the hostile pickles

The zip writer, the pickle assembler and the hostile pickles are the tests' own (tests/checkpoints.py).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import struct
import sys
import time
import traceback
import zipfile
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from stfs import errors
from stfs.formats import pytorch
from tests.checkpoints import (
    HOSTILE,
    hostile_checkpoint,
    p_global,
    p_str,
    p_tensor,
    read_bounded,
    walked,
    write_zip,
)

# -- seeds: real torch.save files ---------------------------------------------------------------------------------


def make_seeds() -> list[tuple[str, bytes]]:
    """Checkpoints the real torch writes, small enough to mutate fast."""
    import torch

    torch.manual_seed(0)
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    plain = {
        "w": base,
        "t": base.t(),
        "col": base[:, 2],
        "tail": base[1:],
        "tied": base,
        "h": torch.ones(3, dtype=torch.float16),
        "i": torch.arange(5, dtype=torch.int64),
        "u": torch.tensor([1, 2, 3]).to(torch.uint16),
        "s": torch.tensor(2.5),
        "e": torch.empty(0, 3),
    }
    module = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4))
    lightning = {
        "epoch": 3,
        "global_step": 10,
        "state_dict": module.state_dict(),
        "optimizer_states": [{"state": {0: {"step": torch.tensor(1.0)}}, "param_groups": [{"lr": 0.1}]}],
        "hyper_parameters": {"lr": 0.1, "name": "x", "sizes": [1, 2, 3]},
    }
    seeds = []
    for kind, obj, options in (
        ("zip", plain, {}),
        ("zip-protocol4", plain, {"pickle_protocol": 4}),
        ("legacy", plain, {"_use_new_zipfile_serialization": False}),
        ("lightning", lightning, {}),
        ("legacy-lightning", lightning, {"_use_new_zipfile_serialization": False}),
        ("module", module, {}),
        ("list", [base, [base.t(), (torch.zeros(2),)]], {}),
    ):
        buffer = io.BytesIO()
        torch.save(obj, buffer, **options)
        seeds.append((kind, buffer.getvalue()))
    return seeds


# -- mutations ---------------------------------------------------------------------------------------------------

BOUNDARIES = [0, 1, 0x7F, 0x80, 0xFF, 0xFFFF, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF, 2**63 - 1, 2**64 - 1]
SNIPPETS = [
    b"(",
    b"t",
    b"0",
    b"1",
    b"2",
    b"R",
    b"b",
    b"s",
    b"u",
    b"a",
    b"e",
    b"Q",
    b"\x81",
    b"\x93",
    b"\x94",
    b"h\x00",
    b"h\xff",
    b"q\x00",
    b"j\xff\xff\xff\xff",
    b"r\xff\xff\xff\xff",
    b"\x8d" + struct.pack("<Q", 1 << 40),
    b"\x8e" + struct.pack("<Q", 1 << 40),
    b"X\xff\xff\xff\x7f",
    p_global("posix", "system"),
    p_global("builtins", "eval"),
    p_global("torch._utils", "_rebuild_tensor_v2"),
    p_global("torch._utils", "_rebuild_tensor_v3"),
    p_global("torch._tensor", "_rebuild_from_type_v2"),
    p_global("torch", "FloatStorage"),
    p_global("torch", "complex128"),
    p_str("storage"),
    p_tensor("0", 1 << 40, 0, (1 << 40,), (1,)),
    p_tensor("0", 6, 5, (2, 2), (2**62, 1)),
    b"]" * 50 + b"a" * 49,
    b"(" * 50,
    b"\x95" + struct.pack("<Q", 1 << 50),
    b"\x97",
    b"\x82\x01",
]


def _zip_parts(data: bytes) -> list[tuple[str, bytes]]:
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        return [(info.filename, archive.read(info)) for info in archive.infolist()]


def _pickle_of(parts: list[tuple[str, bytes]]) -> int:
    return next(i for i, (name, _) in enumerate(parts) if name.endswith("/data.pkl"))


def _mutate_bytes(rng: random.Random, blob: bytes) -> tuple[str, bytes]:
    data = bytearray(blob)
    choice = rng.randrange(7)
    where = rng.randrange(max(1, len(data)))
    if choice == 0:
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        return "flip", bytes(data)
    if choice == 1:
        width = rng.choice([1, 2, 4, 8])
        value = rng.choice(BOUNDARIES) & ((1 << (8 * width)) - 1)
        data[where : where + width] = value.to_bytes(width, "little")
        return "boundary", bytes(data)
    if choice == 2:
        return "truncate", bytes(data[:where])
    if choice == 3:
        end = min(len(data), where + rng.randint(1, 64))
        return "delete", bytes(data[:where] + data[end:])
    if choice == 4:
        end = min(len(data), where + rng.randint(1, 64))
        return "repeat", bytes(data[:end] + data[where:end] * rng.randint(1, 4) + data[end:])
    if choice == 5:
        return "snippet", bytes(data[:where] + rng.choice(SNIPPETS) + data[where:])
    other = rng.randrange(max(1, len(data)))
    size = rng.randint(1, 32)
    data[where : where + size] = blob[other : other + size]
    return "splice", bytes(data)


def mutate(rng: random.Random, kind: str, data: bytes) -> tuple[str, bytes]:
    """One mutation of a seed: of its pickle (rewrapped in a valid zip) or of the file itself."""
    if kind.startswith("legacy") or rng.random() < 0.25:
        mutation, mutated = _mutate_bytes(rng, data)
        return f"file {mutation}", mutated
    parts = _zip_parts(data)
    at = _pickle_of(parts)
    mutation, pickle_bytes = _mutate_bytes(rng, parts[at][1])
    parts[at] = (parts[at][0], pickle_bytes)
    if rng.random() < 0.1:  # a storage's size changed as well
        stores = [i for i, (name, _) in enumerate(parts) if "/data/" in name]
        if stores:
            i = rng.choice(stores)
            parts[i] = (parts[i][0], parts[i][1][: rng.randrange(len(parts[i][1]) + 1)])
            mutation += " + storage size"
    return f"pickle {mutation}", write_zip(parts, zip64=rng.random() < 0.3)


# -- judging one input -------------------------------------------------------------------------------------------


@dataclass
class Outcome:
    verdict: str  # "accepted", the StfsError's class name, or "crash"
    signature: str | None = None  # a failure: what went wrong, short
    detail: str = ""


def judge(data: bytes, compare_torch: bool = False) -> Outcome:
    def read(offset: int, size: int) -> bytes:
        return data[offset : offset + size]

    try:
        checkpoint = pytorch.read_checkpoint(read, len(data), path="input")
    except errors.StfsError as exc:
        if compare_torch and _torch_loads(data) is not None:
            return Outcome(f"{type(exc).__name__} (torch.load(weights_only=True) accepts)", detail=str(exc))
        return Outcome(type(exc).__name__)
    except Exception as exc:  # noqa: BLE001 (a crash is what the fuzzer looks for)
        frame = traceback.extract_tb(exc.__traceback__)[-1]
        return Outcome("crash", f"{type(exc).__name__} at {frame.name}:{frame.lineno}", traceback.format_exc())
    for tensor in checkpoint.tensors:
        start, size = tensor.span
        if size == 0:  # no element: no byte to lie anywhere (torch accepts any offset for it too)
            continue
        if start < tensor.storage_start or start + size > tensor.storage_start + tensor.storage_size:
            return Outcome("accepted", "tensor outside its storage", tensor.name)
        if tensor.storage_start + tensor.storage_size > len(data):
            return Outcome("accepted", "storage outside the file", tensor.name)
        if tensor.nbytes <= 1 << 16:
            pytorch.gather_into(tensor, read, 0, memoryview(bytearray(tensor.nbytes)))
    try:
        pytorch.safetensors_file(checkpoint.tensors)
    except Exception as exc:  # noqa: BLE001
        return Outcome("accepted", f"no safetensors header: {type(exc).__name__}", str(exc))
    if compare_torch:
        difference = _compare_with_torch(data, checkpoint, read)
        if difference:
            return Outcome("accepted", "differs from torch.load", difference)
    return Outcome("accepted")


def _torch_loads(data: bytes) -> Any:
    """What torch.load(weights_only=True) makes of ``data``, None where it refuses."""
    import warnings

    import torch

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    except Exception:  # noqa: BLE001 (torch refuses)
        return None


def _compare_with_torch(data: bytes, checkpoint: pytorch.Checkpoint, read: Callable[[int, int], bytes]) -> str:
    import torch

    loaded = _torch_loads(data)
    if not isinstance(loaded, dict) or not all(isinstance(v, torch.Tensor) for v in loaded.values()):
        return ""
    if not all(type(k) is str for k in loaded):  # a tensor as a key: stfs names its value by a description of it
        return ""
    expected = {
        str(k): v for k, v in loaded.items() if pytorch.TORCH_DTYPES.get(str(v.dtype)[6:], (None,))[0] is not None
    }
    got = {t.name: t for t in checkpoint.tensors}
    if set(expected) != set(got):
        return f"names: torch {sorted(expected)[:5]}, stfs {sorted(got)[:5]}"
    for name, tensor in expected.items():
        mine = got[name]
        if list(tensor.shape) != list(mine.shape):
            return f"{name}: shape {list(tensor.shape)} vs {list(mine.shape)}"
        # Copied into a fresh tensor: contiguous() keeps a mutated stride on a dimension of size 1, which view()
        # then refuses.
        plain = torch.empty(tensor.shape, dtype=tensor.dtype).copy_(tensor)
        raw = plain.reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b""
        served = bytearray(mine.nbytes)
        pytorch.gather_into(mine, read, 0, memoryview(served))
        if raw != served:
            return f"{name}: bytes differ"
        layout = pytorch.strided_layout(mine, 1 << 16) if not mine.contiguous else ""
        if not isinstance(layout, str) and walked(layout, lambda offset, length, _: read(offset, length)) != raw:
            return f"{name}: the runs stfs._native walks differ"
    return ""


@dataclass
class Report:
    inputs: int = 0
    verdicts: Counter[str] = field(default_factory=Counter)
    by_mutation: Counter[str] = field(default_factory=Counter)
    failures: dict[str, str] = field(default_factory=dict)  # signature -> detail (first seen)
    examples: dict[str, str] = field(default_factory=dict)  # a refusal torch.load accepts -> the first one
    slowest: float = 0.0

    def summary(self) -> dict[str, Any]:
        return {
            "inputs": self.inputs,
            "verdicts": dict(self.verdicts.most_common()),
            "mutations": dict(self.by_mutation.most_common()),
            "failures": self.failures,
            "stricter_than_torch": self.examples,
            "slowest_input_seconds": round(self.slowest, 4),
        }


def run(seed: int = 1, inputs: int | None = 2000, seconds: float | None = None, compare_torch: bool = False) -> Report:
    """Fuzz ``inputs`` inputs, or for ``seconds``."""
    rng = random.Random(seed)
    seeds = make_seeds()
    report = Report()
    started = time.monotonic()
    while (inputs is None or report.inputs < inputs) and (seconds is None or time.monotonic() - started < seconds):
        kind, data = rng.choice(seeds)
        mutation, mutated = mutate(rng, kind, data)
        began = time.monotonic()
        outcome = judge(mutated, compare_torch)
        report.slowest = max(report.slowest, time.monotonic() - began)
        report.inputs += 1
        report.verdicts[outcome.verdict] += 1
        if "torch.load" in outcome.verdict and outcome.verdict not in report.examples:
            report.examples[outcome.verdict] = f"{kind}, {mutation}: {outcome.detail}"[:500]
        report.by_mutation[mutation.split(" + ")[0]] += 1
        if outcome.signature is not None and outcome.signature not in report.failures:
            report.failures[outcome.signature] = f"{kind}, {mutation}: {outcome.detail}"[:4000]
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--inputs", type=int)
    parser.add_argument("--seconds", type=float)
    parser.add_argument("--torch", action="store_true", help="compare accepted files with torch.load(weights_only)")
    parser.add_argument("--hostile", action="store_true", help="time and memory of each hostile pickle, in a child")
    args = parser.parse_args(argv)
    if args.hostile:
        import tempfile

        with tempfile.TemporaryDirectory(prefix="stfs-hostile-") as folder:
            for name in HOSTILE:
                path = os.path.join(folder, "hostile.pt")
                with open(path, "wb") as stream:
                    stream.write(hostile_checkpoint(name))
                result = read_bounded(path)
                print(
                    f"{name:34} {os.path.getsize(path):>10,} B  {result.outcome:36} "
                    f"{result.seconds:6.2f} s  peak RSS {result.max_rss / 2**20:6.1f} MiB"
                )
        return 0
    inputs = args.inputs if args.inputs is not None or args.seconds is not None else 2000
    report = run(seed=args.seed, inputs=inputs, seconds=args.seconds, compare_torch=args.torch)
    print(json.dumps(report.summary(), indent=2))
    return 1 if report.failures else 0


if __name__ == "__main__":
    sys.exit(main())
