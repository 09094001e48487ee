#!/usr/bin/env python3
"""Mutation fuzzing of the GGUF reader (stfs/formats/gguf/) on files gguf-py's GGUFWriter writes.

    python3 fuzz/fuzz_gguf.py --seconds 600 --out /work/wt-gguf-scratch/fuzz
    python3 fuzz/fuzz_gguf.py --replay /work/wt-gguf-scratch/fuzz/findings/crash-*.gguf

Seeds: a model with every key/value type and several GGML types, a vocabulary, a custom alignment with trailing
bytes, a split, a file without tensors. Mutations, one to three a case, mostly in the header: bit flips, bytes
set to extremes, a length/count/type/dimension/offset field (found by walking the seed) set to an extreme or
nudged, truncations, inserted, deleted and repeated byte runs.

Each case runs in a worker process whose address space is capped (``RLIMIT_AS``: what it had after its imports
plus ``--memory`` MiB), with a per-case ``--timeout``: anything but a ``GgufError`` (or success) is a finding, and
so are a hang, a worker killed by the cap, and, for an accepted file, a broken invariant (tensors inside the
file and packed as llama.cpp requires, header.json valid JSON, the reads within 4 requests and 2 x header +
2 MiB). An accepted file gguf-py's GGUFReader refuses or reads otherwise is counted apart (gguf-py is laxer:
that would be ours accepting too much); findings are written to ``--out``/findings. Prints a summary whose
last line is ``findings: N``; exits 1 when N > 0.

``--reference PROGRAM`` adds ggml's own verdict on every case (a file llama.cpp refuses must be refused, one it
loads accepted; a disagreement is a finding). PROGRAM reads paths on stdin and prints ``ok`` or ``refused``
for each: ten lines of C over ggml's ``libggml-base.a`` (ggml's ``src/`` without the backends, built with
``-DGGML_CPU=OFF -DBUILD_SHARED_LIBS=OFF``) calling ``gguf_init_from_file(path, {.no_alloc = true})``, then
checking each tensor's ``gguf_get_data_offset + gguf_get_tensor_offset + gguf_get_tensor_size`` against the
file's size, as llama.cpp's model loader does.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import struct
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from fuzz.worker import MIB, Worker, serve  # noqa: E402 (after the checkout is on the path)

INTERESTING = [0, 1, 2, 3, 4, 7, 8, 12, 13, 32, 63, 64, 255, 256, 2**15, 2**16 - 1, 2**30, 2**30 + 1, 2**31 - 1,
               2**31, 2**32 - 1, 2**32, 2**62, 2**63 - 1, 2**63, 2**64 - 1]  # fmt: skip


# -- seeds -------------------------------------------------------------------------------------------------------


def write_seeds(folder: str) -> list[str]:
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType, GGUFWriter

    def finish(writer: GGUFWriter) -> None:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()

    def blocks(kind: GGMLQuantizationType, rows: int, count: int) -> np.ndarray:
        return np.arange(rows * count * GGML_QUANT_SIZES[kind][1], dtype=np.uint32).astype(np.uint8).reshape(rows, -1)

    paths = []
    path = os.path.join(folder, "model.gguf")
    writer = GGUFWriter(path, "llama")
    writer.add_uint8("a.u8", 7)
    writer.add_int8("a.i8", -7)
    writer.add_uint16("a.u16", 700)
    writer.add_int16("a.i16", -700)
    writer.add_uint32("a.u32", 70000)
    writer.add_int32("a.i32", -70000)
    writer.add_float32("a.f32", 1e-5)
    writer.add_bool("a.bool", True)
    writer.add_string("a.str", "héllo")
    writer.add_uint64("a.u64", 2**40)
    writer.add_int64("a.i64", -(2**40))
    writer.add_float64("a.f64", 0.1)
    writer.add_array("a.strs", ["x", "yé", "zz"])
    writer.add_array("a.ints", [1, 2, 3])
    writer.add_key_value("a.f64s", [0.5, 2.0], GGUFValueType.ARRAY, sub_type=GGUFValueType.FLOAT64)
    writer.add_tensor("token_embd.weight", np.arange(32, dtype=np.float32).reshape(4, 8))
    writer.add_tensor("blk.0.attn_norm.weight", np.ones(8, dtype=np.float16))
    for kind in (GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q8_0, GGMLQuantizationType.IQ2_XXS):
        writer.add_tensor(f"blk.0.{kind.name}.weight", blocks(kind, 2, 1), raw_dtype=kind)
    writer.add_tensor("blk.0.ids", np.arange(6, dtype=np.int32).reshape(2, 3))
    finish(writer)
    paths.append(path)

    path = os.path.join(folder, "vocab.gguf")
    writer = GGUFWriter(path, "qwen2")
    tokens = [f"tok{i}" + "Ġ" * (i % 3) for i in range(300)]
    writer.add_token_list(tokens)
    writer.add_token_scores([float(-i) for i in range(300)])
    writer.add_token_types([1 + i % 3 for i in range(300)])
    writer.add_token_merges([f"{a} {b}" for a, b in zip(tokens, tokens[1:], strict=False)][:100])
    writer.add_tensor("output.weight", np.ones((2, 32), dtype=np.float32))
    finish(writer)
    paths.append(path)

    path = os.path.join(folder, "aligned.gguf")
    writer = GGUFWriter(path, "llama")
    writer.add_custom_alignment(64)
    writer.add_tensor("a", np.ones(3, dtype=np.float32))
    writer.add_tensor("b", np.zeros((0, 4), dtype=np.float32))
    writer.add_tensor("c", np.ones(5, dtype=np.int8))
    finish(writer)
    with open(path, "ab") as stream:
        stream.write(b"trailing bytes")
    paths.append(path)

    writer = GGUFWriter(os.path.join(folder, "split.gguf"), "llama", split_max_tensors=1)
    writer.add_tensor("x", np.ones(4, dtype=np.float32))
    writer.add_tensor("y", np.ones(4, dtype=np.float32))
    finish(writer)
    paths.append(os.path.join(folder, "split-00001-of-00002.gguf"))

    path = os.path.join(folder, "empty.gguf")
    writer = GGUFWriter(path, "llama")
    writer.add_string("general.name", "no tensors")
    finish(writer)
    paths.append(path)
    return paths


def field_offsets(data: bytes) -> list[tuple[int, int]]:
    """(offset, width) of every length, count, type, dimension and offset field of a valid GGUF (the seeds')."""
    fields = [(4, 4), (8, 8), (16, 8)]
    n_tensors, n_kv = struct.unpack_from("<QQ", data, 8)
    pos = 24

    def string() -> None:
        nonlocal pos
        fields.append((pos, 8))
        pos += 8 + struct.unpack_from("<Q", data, pos)[0]

    sizes = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
    for _ in range(n_kv):
        string()
        fields.append((pos, 4))
        (kind,) = struct.unpack_from("<I", data, pos)
        pos += 4
        if kind == 9:
            fields.append((pos, 4))
            fields.append((pos + 4, 8))
            item, count = struct.unpack_from("<IQ", data, pos)
            pos += 12
            for _ in range(count):
                if item == 8:
                    string()
                else:
                    fields.append((pos, sizes[item]))
                    pos += sizes[item]
        elif kind == 8:
            string()
        else:
            fields.append((pos, sizes[kind]))
            pos += sizes[kind]
    for _ in range(n_tensors):
        string()
        fields.append((pos, 4))
        (n_dims,) = struct.unpack_from("<I", data, pos)
        pos += 4
        for _ in range(n_dims):
            fields.append((pos, 8))
            pos += 8
        fields.append((pos, 4))
        fields.append((pos + 4, 8))
        pos += 12
    return fields


# -- mutations ---------------------------------------------------------------------------------------------------


def mutate(rng: random.Random, data: bytes, fields: list[tuple[int, int]], header_end: int) -> tuple[bytes, str]:
    out = bytearray(data)
    done = []
    for _ in range(rng.choice((1, 1, 1, 2, 2, 3))):
        if not out:
            break
        limit = max(1, min(len(out), header_end + 64))
        kind = rng.randrange(9)
        if kind <= 2 and fields:  # a structural field set to an extreme, or nudged
            offset, width = rng.choice(fields)
            if offset + width > len(out):
                continue
            old = int.from_bytes(out[offset : offset + width], "little")
            if rng.random() < 0.6:
                value = rng.choice(INTERESTING)
            else:
                value = old + rng.choice((-64, -32, -8, -1, 1, 8, 32, 64))
            value %= 1 << (8 * width)
            out[offset : offset + width] = value.to_bytes(width, "little")
            done.append(f"field@{offset}/{width}={value}")
        elif kind == 3:
            for _ in range(rng.randint(1, 8)):
                bit = rng.randrange(limit * 8)
                out[bit // 8] ^= 1 << (bit % 8)
            done.append("bitflips")
        elif kind == 4:
            offset = rng.randrange(limit)
            out[offset] = rng.choice((0, 0xFF, 0x7F, 0x80, 0x01))
            done.append(f"byte@{offset}")
        elif kind == 5:
            cut = rng.randrange(len(out) + 1) if rng.random() < 0.3 else rng.randrange(limit + 1)
            del out[cut:]
            done.append(f"truncate@{cut}")
        elif kind == 6:
            offset = rng.randrange(limit + 1)
            out[offset:offset] = bytes(rng.randrange(256) for _ in range(rng.choice((1, 4, 8, 13))))
            done.append(f"insert@{offset}")
        elif kind == 7:
            offset = rng.randrange(limit)
            del out[offset : offset + rng.choice((1, 4, 8, 16))]
            done.append(f"delete@{offset}")
        else:
            start = rng.randrange(limit)
            run = bytes(out[start : start + rng.choice((8, 16, 32, 64))])
            offset = rng.randrange(limit + 1)
            out[offset:offset] = run
            done.append(f"repeat@{start}->{offset}")
    return bytes(out), ",".join(done) or "none"


# -- the worker --------------------------------------------------------------------------------------------------


def check_case(data: bytes, scratch: str) -> dict[str, Any]:
    """Run the reader on ``data``; what happened, as a JSON-able dict."""
    from stfs.formats import gguf
    from stfs.formats.gguf import rules as gguf_rules

    counts = {"requests": 0, "bytes": 0}

    def read(offset: int, size: int) -> bytes:
        counts["requests"] += 1
        counts["bytes"] += size
        return data[offset : offset + size]

    try:
        header = gguf.read_header(read, len(data), path="case.gguf")
    except gguf_rules.GgufError as exc:
        message = exc.message
        if "\n" in message or not message.startswith("case.gguf: "):
            return {"status": "finding", "why": f"refusal message not one line naming the file: {message!r}"}
        return {"status": "refused", "error": type(exc).__name__}
    except Exception:
        return {"status": "finding", "why": traceback.format_exc()}
    try:
        problem = invariants(header, data, counts)
    except Exception:
        return {"status": "finding", "why": "checking an accepted file: " + traceback.format_exc()}
    if problem:
        return {"status": "finding", "why": problem}
    return {"status": "accepted", "gguf_py": against_gguf_py(header, data, scratch)}


def invariants(header: Any, data: bytes, counts: dict[str, int]) -> str | None:
    from stfs.formats import gguf

    expected = 0
    for tensor in header.tensors:
        if tensor.offset != expected or tensor.file_offset + tensor.nbytes > len(data):
            return f"tensor {tensor.name!r} misplaced: offset {tensor.offset}, expected {expected}"
        expected += -(-tensor.nbytes // header.alignment) * header.alignment
    if header.alignment & (header.alignment - 1) or header.data_offset > len(data):
        return "bad alignment or data offset"
    if counts["requests"] > 4 or counts["bytes"] > 2 * header.data_offset + 2 * MIB:
        return f"reads: {counts}, header {header.data_offset}"
    document = json.loads(gguf.header_json(header))
    if len(document) != len({t.name for t in header.tensors} | {"__metadata__"}):
        return "header.json lost a tensor"
    for kv in header.metadata.values():
        content = gguf.metadata_file(kv)
        if not content.endswith(b"\n"):
            return f"metadata/{kv.key} without its newline"
    return None


def against_gguf_py(header: Any, data: bytes, scratch: str) -> str:
    """``same`` when GGUFReader reads the accepted file as we do; else a short reason."""
    from gguf import GGUFReader

    path = os.path.join(scratch, "case.gguf")
    with open(path, "wb") as stream:
        stream.write(data)
    try:
        reader = GGUFReader(path)
    except UnicodeDecodeError:
        return "gguf-py: names not UTF-8"  # kept as surrogate escapes here
    except Exception as exc:
        return f"gguf-py refuses: {type(exc).__name__}"
    theirs = [(t.name, t.tensor_type.name, tuple(int(d) for d in t.shape), t.data_offset) for t in reader.tensors]
    ours = [(t.name, t.dtype, t.dims, t.file_offset) for t in header.tensors]
    return "same" if theirs == ours else "gguf-py reads other tensors"


def worker(memory_mib: int) -> None:
    """Answer cases from stdin, one JSON line each (fuzz/worker.py), capped at ``memory_mib`` over the imports."""
    import numpy  # noqa: F401  (imported before the cap: what the cap adds to is the reader's own use)
    from gguf import GGUFReader  # noqa: F401

    from stfs.formats import gguf  # noqa: F401

    scratch = tempfile.mkdtemp(prefix="stfs-fuzz-gguf-")
    serve(lambda data: check_case(data, scratch), memory_mib)


class Reference:
    """ggml's own verdict (``--reference``): a program that reads paths on stdin and answers ``ok`` or ``refused``
    for each, as ``gguf_init_from_file`` with ``no_alloc`` and then llama.cpp's model loader's bound on each
    tensor's bytes judge it. A program that dies on a file (a GGML_ASSERT) answers ``abort``."""

    def __init__(self, program: str, scratch: str) -> None:
        self.program = program
        self.path = os.path.join(scratch, "reference-case.gguf")
        self.process = self._start()

    def _start(self) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [self.program], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
        )

    def verdict(self, data: bytes) -> str:
        with open(self.path, "wb") as stream:
            stream.write(data)
        assert self.process.stdin is not None and self.process.stdout is not None
        try:
            self.process.stdin.write(self.path + "\n")
            self.process.stdin.flush()
            answer = self.process.stdout.readline().strip()
        except BrokenPipeError:
            answer = ""
        if not answer:
            self.process.wait()
            self.process = self._start()
            return "abort"
        return answer

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()


# -- the run -----------------------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=30.0, help="stop after this long")
    parser.add_argument("--cases", type=int, default=0, help="stop after this many cases (0: no limit)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="", help="folder for seeds and findings (default: a temporary one)")
    parser.add_argument("--memory", type=int, default=256, help="MiB a case may add to the worker's address space")
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds a case may take")
    parser.add_argument("--replay", nargs="*", default=None, help="run these files, once each")
    parser.add_argument("--reference", default="", help="a program giving ggml's verdict (see Reference)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.memory)
        return 0
    out = args.out or tempfile.mkdtemp(prefix="stfs-fuzz-gguf-")
    os.makedirs(os.path.join(out, "findings"), exist_ok=True)
    seeds_dir = os.path.join(out, "seeds")
    os.makedirs(seeds_dir, exist_ok=True)
    cases = []
    for path in args.replay or []:
        with open(path, "rb") as stream:
            cases.append((path, stream.read(), "replay"))
    seeds = []
    for path in write_seeds(seeds_dir):
        with open(path, "rb") as stream:
            data = stream.read()
        from stfs.formats import gguf

        header = gguf.parse_header(data, file_size=len(data), path=path)
        seeds.append((os.path.basename(path), data, field_offsets(data), header.header_size))
    rng = random.Random(args.seed)
    runner = Worker(__file__, args.memory)
    reference = Reference(args.reference, out) if args.reference else None
    verdicts: collections.Counter[str] = collections.Counter()
    tally: collections.Counter[str] = collections.Counter()
    refusals: collections.Counter[str] = collections.Counter()
    gguf_py: collections.Counter[str] = collections.Counter()
    findings = 0
    started = time.monotonic()
    slowest = 0.0
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
                name, seed, fields, header_end = seeds[done % len(seeds)] if done < len(seeds) else rng.choice(seeds)
                data, how = (seed, "seed") if done < len(seeds) else mutate(rng, seed, fields, header_end)
            began = time.monotonic()
            result = runner.run(data, args.timeout)
            slowest = max(slowest, time.monotonic() - began)
            done += 1
            tally[result["status"]] += 1
            if reference is not None and result["status"] in ("accepted", "refused"):
                theirs = reference.verdict(data)
                verdicts[f"{result['status']}/{theirs}"] += 1
                if result.get("error") == "GgufOverflow" and theirs == "ok":
                    # ggml computes sizes in int64/size_t, and a product that wraps to 0 or below skips its own
                    # overflow check (undefined behaviour in C); the SPEC refuses any overflow, so stfs does.
                    tally["known: ggml's sizes wrap"] += 1
                elif result.get("error") == "UnknownGgmlType" and theirs == "ok":
                    # A type newer than gguf 0.19 (Q2_0, 42): the SPEC takes the package's table, not ggml's.
                    tally["known: a type newer than gguf 0.19"] += 1
                elif (result["status"] == "accepted") != (theirs == "ok"):
                    detail = result.get("error", "accepted")
                    result = {"status": "finding", "why": f"ggml says {theirs}, stfs {result['status']} ({detail})"}
                    tally["disagreements"] += 1
            if result["status"] == "refused":
                refusals[result["error"]] += 1
            elif result["status"] == "accepted":
                gguf_py[result["gguf_py"]] += 1
            else:
                findings += 1
                stem = os.path.join(out, "findings", f"case-{done:07d}")
                with open(stem + ".gguf", "wb") as stream:
                    stream.write(data)
                with open(stem + ".txt", "w") as stream:
                    stream.write(f"from {name} by {how}\n{result['why']}\n")
                print(f"finding {stem}: {result['why'].strip().splitlines()[-1]}", flush=True)
    finally:
        runner.stop()
        if reference is not None:
            reference.stop()
    elapsed = time.monotonic() - started
    print(f"cases: {done} in {elapsed:.1f} s ({done / max(elapsed, 1e-9):.0f}/s), slowest {slowest * 1000:.0f} ms")
    print(f"accepted: {tally['accepted']}, refused: {tally['refused']}")
    if reference is not None:
        wrap, newer = tally["known: ggml's sizes wrap"], tally["known: a type newer than gguf 0.19"]
        print(f"disagreements with ggml: {tally['disagreements']}; known, where stfs refuses what ggml loads:")
        print(f"  ggml's size products wrap: {wrap}; a type newer than gguf 0.19: {newer}")
    print("refusals: " + ", ".join(f"{k} {v}" for k, v in refusals.most_common()))
    print("accepted files, gguf-py's reading: " + ", ".join(f"{k} {v}" for k, v in gguf_py.most_common()))
    if reference is not None:
        print("stfs/ggml verdicts: " + ", ".join(f"{k} {v}" for k, v in sorted(verdicts.items())))
    print(f"findings: {findings}")
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
