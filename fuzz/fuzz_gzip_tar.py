#!/usr/bin/env python3
"""Mutation fuzzing of gzip'd tar layers read at random (stfs/sources/gzip_layer.py) against Python's tarfile + gzip.

    python3 fuzz/fuzz_gzip_tar.py --seconds 600 --out /tmp/images/fuzz
    python3 fuzz/fuzz_gzip_tar.py --replay /tmp/images/fuzz/findings/crash-*.tgz

Seeds: tars Python's tarfile writes (ustar, GNU and PAX: long names, folders, links, empty and larger files),
gzip'd whole or as several gzip members. A case mutates either the gzip bytes (bit flips, bytes set, truncations,
inserted, deleted and repeated runs: broken deflate streams, CRCs, lengths) or the tar before it is gzip'd (the same
on its headers: a valid stream of a hostile archive).

Each case runs in a worker process whose address space is capped (``RLIMIT_AS``: what it had after its imports plus
``--memory`` MiB), with a per-case ``--timeout``. stfs must either refuse the layer with one line (a
``TarIndexError``) or list the same regular members with the same bytes as ``gzip.decompress`` + ``tarfile``
(which must then read it too). Anything else is a finding: another exception, a refusal of several lines, other
members or bytes, accepting what the reference refuses, a hang, a worker killed by the cap. Findings are written
to ``--out``/findings; the last line printed is ``findings: N``; exit 1 when N > 0.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import os
import random
import sys
import tarfile
import time
import traceback
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from fuzz.worker import MIB, Worker, serve  # noqa: E402 (after the checkout is on the path)
from tests.images import layer_tar  # noqa: E402  (the tests' own layers: the same tar writer)

READ_CAP = 4 * MIB  # bytes of members the reference reads at most (a bomb the bound catches is not compared)


# -- seeds ---------------------------------------------------------------------------------------------------------


def seed_tars(rng: random.Random) -> list[bytes]:
    weights = bytes(rng.getrandbits(8) for _ in range(100_000))
    members = [
        ("models", None),
        ("models/config.json", b'{"model_type": "toy"}'),
        ("models/model.safetensors", weights),
        ("models/empty", b""),
        ("models/" + "long" * 40 + ".json", b"a long name"),
        ("models/link", ("link", "models/config.json")),
        ("models/sym", ("symlink", "config.json")),
        ("models/.wh.gone", b""),
    ]
    return [
        layer_tar(members, tarfile.PAX_FORMAT),
        layer_tar(members[:4], tarfile.USTAR_FORMAT),
        layer_tar(members, tarfile.GNU_FORMAT),
        layer_tar([("a", b"x" * 5000), ("b", bytes(70_000))], tarfile.USTAR_FORMAT),
    ]


def gzipped(tar: bytes, rng: random.Random) -> bytes:
    """``tar`` gzip'd whole, or in two gzip members (as a concatenation of ``gzip`` outputs)."""
    if rng.random() < 0.25 and len(tar) > 1024:
        cut = rng.randrange(512, len(tar))
        return gzip.compress(tar[:cut], mtime=0) + gzip.compress(tar[cut:], mtime=0)
    return gzip.compress(tar, compresslevel=rng.choice([1, 6, 9]), mtime=0)


# -- mutations -----------------------------------------------------------------------------------------------------


def mutate(rng: random.Random, data: bytes, header_end: int) -> tuple[bytes, str]:
    """One to three mutations of ``data``, mostly in its first ``header_end`` bytes; and their names."""
    out = bytearray(data)
    names = []
    for _ in range(rng.randint(1, 3)):
        if not out:
            break
        end = len(out) if rng.random() < 0.3 else max(1, min(len(out), header_end))
        at = rng.randrange(end)
        kind = rng.choice(["flip", "set", "truncate", "insert", "delete", "repeat", "digits"])
        names.append(kind)
        if kind == "flip":
            out[at] ^= 1 << rng.randrange(8)
        elif kind == "set":
            out[at] = rng.choice([0, 0xFF, 0x7F, 0x80, 0x30, 0x37, 0x20])
        elif kind == "truncate":
            del out[rng.randrange(len(out)) :]
        elif kind == "insert":
            out[at:at] = bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 64)))
        elif kind == "delete":
            del out[at : at + rng.randint(1, 64)]
        elif kind == "repeat":
            run = out[at : at + rng.randint(1, 512)]
            out[at:at] = run * rng.randint(1, 8)
        else:  # an octal size or offset field: digits that say much more
            out[at : at + 11] = rng.choice([b"77777777777", b"00000001000", b"10000000000"])[: len(out) - at]
    return bytes(out), "+".join(names)


# -- one case ------------------------------------------------------------------------------------------------------


def reference(data: bytes) -> dict[str, bytes] | str:
    """The regular members Python's gzip + tarfile read (later ones replacing earlier of the same name), or why
    they refuse it."""
    try:
        raw = gzip.GzipFile(fileobj=io.BytesIO(data)).read()  # several members, zero padding: as gzip(1) reads
        found: dict[str, bytes] = {}
        with tarfile.open(fileobj=io.BytesIO(raw), mode="r:") as archive:
            for info in archive:
                if info.isreg() and info.sparse is None:
                    stream = archive.extractfile(info)
                    assert stream is not None
                    found[info.name] = stream.read(READ_CAP)
        return found
    except Exception as exc:  # noqa: BLE001 - the reference's verdict, whatever it raises
        return f"{type(exc).__name__}: {exc}"


def check_case(data: bytes) -> dict[str, Any]:
    from stfs.sources.gzip_layer import GzipLayer
    from stfs.sources.tar_index import TarIndexError

    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    layer = GzipLayer(lambda key, offset, count: data[offset : offset + count], "blob", len(data), digest, None)
    try:
        found = layer.scan()
    except TarIndexError as exc:
        text = str(exc)
        if "\n" in text or not text:
            return {"verdict": "finding", "why": f"a refusal of {text.count(chr(10)) + 1} lines: {text!r}"}
        return {"verdict": "refused"}
    except Exception:  # noqa: BLE001 - anything else is what the fuzzer looks for
        return {"verdict": "finding", "why": "crash", "traceback": traceback.format_exc()}
    try:
        files = {
            entry.path: layer.read_at(entry.offset, min(entry.size, READ_CAP))
            for entry in found
            if entry.kind == "file"
        }
    except Exception:  # noqa: BLE001
        return {"verdict": "finding", "why": "a read of an accepted layer failed", "traceback": traceback.format_exc()}
    finally:
        layer.close()
    expected = reference(data)
    if isinstance(expected, str):
        return {"verdict": "finding", "why": f"accepted what gzip + tarfile refuse ({expected})"}
    if files != expected:
        differ = sorted(set(files) ^ set(expected)) or [n for n in files if files[n] != expected.get(n)]
        return {"verdict": "finding", "why": f"other members or bytes than tarfile's: {differ[:5]}"}
    return {"verdict": "accepted"}


# -- the worker and its keeper -------------------------------------------------------------------------------------


def worker(memory_mib: int) -> None:
    """Answer cases from stdin, one JSON line each (fuzz/worker.py), capped at ``memory_mib`` over the imports."""
    import indexed_gzip  # noqa: F401 - imported before the cap

    import stfs.sources.gzip_layer  # noqa: F401

    serve(check_case, memory_mib, key="verdict")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="fuzz-gzip-out")
    parser.add_argument("--memory", type=int, default=256, help="MiB a worker may add to what its imports take")
    parser.add_argument("--timeout", type=float, default=10.0)
    parser.add_argument("--replay", nargs="*")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.memory)
        return 0
    if args.replay is not None:
        for path in args.replay:
            with open(path, "rb") as stream:
                print(path, check_case(stream.read()))
        return 0
    rng = random.Random(args.seed)
    tars = seed_tars(rng)
    findings_folder = os.path.join(args.out, "findings")
    counts: dict[str, int] = {}
    findings = 0
    runner = Worker(__file__, args.memory, key="verdict", quiet=True)
    deadline = time.monotonic() + args.seconds
    cases = 0
    try:
        while time.monotonic() < deadline:
            tar = rng.choice(tars)
            if rng.random() < 0.5:
                data, how = mutate(rng, gzipped(tar, rng), 64)
                how = "gzip:" + how
            else:
                mutated, how = mutate(rng, tar, 3 * 512)
                data, how = gzipped(mutated, rng), "tar:" + how
            result = runner.run(data, args.timeout)
            cases += 1
            counts[result["verdict"]] = counts.get(result["verdict"], 0) + 1
            if result["verdict"] == "finding":
                findings += 1
                os.makedirs(findings_folder, exist_ok=True)
                name = os.path.join(findings_folder, f"finding-{hashlib.sha256(data).hexdigest()[:12]}.tgz")
                with open(name, "wb") as stream:
                    stream.write(data)
                with open(name + ".txt", "w") as stream:
                    stream.write(f"{how}\n{result.get('why')}\n{result.get('traceback', '')}")
                print(f"finding ({how}): {result.get('why')} -> {name}", flush=True)
    finally:
        runner.stop()
    print(f"cases: {cases} " + " ".join(f"{k}: {v}" for k, v in sorted(counts.items())))
    print(f"findings: {findings}")
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
