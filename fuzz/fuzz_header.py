#!/usr/bin/env python3
"""Coverage-guided fuzzing of the header parser and the model resolver with atheris.

Any exception that is not an ``StfsError`` is a crash. Crashes do not stop the run: each distinct one
(exception type + innermost stfs frame) is written to ``--crash-dir`` with its
traceback, so one long run finds them all. Replay saved inputs with ``--replay``.

    python3 fuzz/fuzz_header.py -max_total_time=600 /work/rel-data/fuzz-corpus
    python3 fuzz/fuzz_header.py --replay /work/rel-data/fuzz-crashes/crash-*.bin

Each input's first byte picks a mode:

0. raw header bytes -> ``parse_header``
1. a whole file (length prefix + header + data) -> ``read_header``
2. a header built from the input: random names (odd unicode), dtypes, shapes, huge
   numbers, offsets right or slightly wrong -> ``parse_header`` then ``build_tree``
3. deep nesting at a point chosen by the input -> ``parse_header``
4. a sharded set: an index (built or raw) + shards written to a temp folder ->
   ``stfs.model.load`` on the index, or ``stfs.model.resolve`` on the folder (discovery, stray
   files as models of their own), then ``merged_header`` and ``build_tree``

Every tree built is also handed to ``stfs._native`` (where it is built): its tables must take it, and a C lookup
of every path must find the inode the tree has there.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import inspect
import json
import os
import shutil
import struct
import sys
import tempfile
import traceback
import types

import atheris

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's stfs

if {"--replay", "--line-coverage"} & set(sys.argv):  # plain bytecode, so line tracing sees the source as written
    from stfs import errors, model, tree, views
    from stfs.formats import safetensors as format
    from stfs.sources import LocalFiles
else:
    with atheris.instrument_imports(include=["stfs"]):
        from stfs import errors, model, tree, views
        from stfs.formats import safetensors as format
        from stfs.sources import LocalFiles

try:
    from stfs import _native  # type: ignore[attr-defined]
    from stfs.nodes import DirNode, FileNode, Range
except ImportError:  # not built: the Python trees alone
    _native = None

DTYPES = list(format.DTYPE_BITS)
ODD_NAMES = [
    "",
    ".",
    "..",
    "a..b",
    ".a",
    "a.",
    "/",
    "a/b",
    "%",
    "%25",
    "\x00",
    "a\x00b",
    "\ud800",
    "\udfff",
    "é",
    "e\u0301",
    "\u202e",
    "\ufeff",
    "🦀",
    "a.b",
    "a.b.c",
    "__metadata__",
    "x" * 300,
    "é" * 200,
    ".." * 200,
]
HUGE = [0, 1, 2**31, 2**32, 2**53 + 1, 2**63, 2**64 - 1, 2**64, 2**128, 10**400]


class Saver:
    """Keeps one input per distinct crash."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self.seen: set[tuple[str, str]] = set()
        self.crashes = 0

    def record(self, data: bytes, exc: BaseException) -> None:
        self.crashes += 1
        frames = [f for f in traceback.extract_tb(exc.__traceback__) if "/stfs/" in f.filename]
        where = f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "?"
        key = (type(exc).__name__, where)
        if key in self.seen:
            return
        self.seen.add(key)
        os.makedirs(self.folder, exist_ok=True)
        name = "crash-" + hashlib.sha1(data).hexdigest()[:16]
        with open(os.path.join(self.folder, name + ".bin"), "wb") as stream:
            stream.write(data)
        with open(os.path.join(self.folder, name + ".txt"), "w") as stream:
            stream.write("".join(traceback.format_exception(exc)))
        print(f"NEW CRASH {key[0]} at {where}: {exc!r:.200} -> {name}.bin", file=sys.stderr, flush=True)


def _name(fdp: atheris.FuzzedDataProvider) -> str:
    choice = fdp.ConsumeIntInRange(0, 3)
    if choice == 0:
        return fdp.PickValueInList(ODD_NAMES)
    if choice == 1:
        return fdp.ConsumeUnicode(fdp.ConsumeIntInRange(0, 40))
    if choice == 2:
        return ".".join(fdp.PickValueInList(ODD_NAMES) for _ in range(fdp.ConsumeIntInRange(1, 4)))
    return f"model.layers.{fdp.ConsumeIntInRange(0, 3)}.w"


def _number(fdp: atheris.FuzzedDataProvider) -> object:
    choice = fdp.ConsumeIntInRange(0, 5)
    if choice == 0:
        return fdp.PickValueInList(HUGE)
    if choice == 1:
        return -fdp.ConsumeIntInRange(0, 2**70)
    if choice == 2:
        return fdp.ConsumeFloat()
    if choice == 3:
        return fdp.PickValueInList([True, None, "1", [1], {"a": 1}])
    return fdp.ConsumeIntInRange(0, 64)


def _built_header(fdp: atheris.FuzzedDataProvider) -> tuple[bytes, int]:
    """A header dict with plausible tensors, mutated; returns (JSON bytes, data size)."""
    document: dict[str, object] = {}
    position = 0
    for _ in range(fdp.ConsumeIntInRange(0, 6)):
        dtype = fdp.PickValueInList(DTYPES) if fdp.ConsumeBool() else fdp.ConsumeUnicode(4)
        if fdp.ConsumeBool():
            shape: object = [fdp.ConsumeIntInRange(0, 5) for _ in range(fdp.ConsumeIntInRange(0, 3))]
        else:
            shape = [_number(fdp) for _ in range(fdp.ConsumeIntInRange(0, 4))]
        size = 0
        if isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape) and dtype in DTYPES:
            count = 1
            for dim in shape:
                count *= dim
            size = count * format.DTYPE_BITS[dtype] // 8
        begin, end = position, position + size
        if fdp.ConsumeIntInRange(0, 3) == 0:
            begin, end = _number(fdp), _number(fdp)
        elif fdp.ConsumeIntInRange(0, 3) == 0:
            end += fdp.ConsumeIntInRange(-2, 2)
        info: dict[str, object] = {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}
        if fdp.ConsumeIntInRange(0, 7) == 0:
            info = {key: info[key] for key in info if fdp.ConsumeBool()}
        if fdp.ConsumeIntInRange(0, 7) == 0:
            info["extra"] = _number(fdp)
        document[_name(fdp)] = info if fdp.ConsumeIntInRange(0, 15) else _number(fdp)
        position = end if type(end) is int and end >= 0 else position
    if fdp.ConsumeBool():
        document["__metadata__"] = {
            _name(fdp): (_name(fdp) if fdp.ConsumeIntInRange(0, 7) else _number(fdp))
            for _ in range(fdp.ConsumeIntInRange(0, 3))
        }
    raw = json.dumps(document, ensure_ascii=fdp.ConsumeBool()).encode("utf-8", "surrogatepass")
    raw += b" " * fdp.ConsumeIntInRange(0, 9)
    data_size = position + fdp.PickValueInList([0, 0, 0, 1, -1])
    return raw, max(0, data_size)


def _nested(fdp: atheris.FuzzedDataProvider) -> bytes:
    depth = fdp.ConsumeIntInRange(0, 200_000)
    opener, closer = (b"[", b"]") if fdp.ConsumeBool() else (b'{"a":', b"}")
    where = fdp.ConsumeIntInRange(0, 2)
    inner = opener * depth + b"1" + closer * depth
    if where == 0:
        return b'{"t":' + inner + b"}"
    if where == 1:
        return b'{"__metadata__":' + inner + b"}"
    return b'{"t":{"dtype":"F32","shape":' + inner + b',"data_offsets":[0,0]}}'


def _write(path: str, data: bytes) -> None:
    with open(path, "wb") as stream:
        stream.write(data)


def _write_safetensors(path: str, raw: bytes, data_size: int) -> None:
    """Length prefix, header, data; a large data section is a sparse hole (the parser never reads it)."""
    with open(path, "wb") as stream:
        stream.write(struct.pack("<Q", len(raw)) + raw)
        if data_size <= 1 << 16:
            stream.write(b"\x01" * data_size)
        else:
            try:
                stream.truncate(8 + len(raw) + data_size)
            except (OSError, OverflowError):
                stream.truncate(8 + len(raw) + (1 << 40))


def _sharded(fdp: atheris.FuzzedDataProvider, folder: str, files: LocalFiles) -> None:
    shutil.rmtree(folder, ignore_errors=True)
    os.makedirs(folder)
    weight_map: dict[str, str] = {}
    shard_names = [f"model-{i:05d}.safetensors" for i in range(fdp.ConsumeIntInRange(0, 3))]
    if fdp.ConsumeIntInRange(0, 3) == 0:
        shard_names.append(
            fdp.PickValueInList(
                [
                    "../x.safetensors",
                    "/etc/passwd",
                    "",
                    ".",
                    "sub/../a.safetensors",
                    "a\x00b",
                    "./model-00000.safetensors",
                    "sub\\..\\x",
                    "model.safetensors.index.json",
                    "é.safetensors",
                ]
            )
        )
    for shard in shard_names:
        raw, size = _built_header(fdp)
        path = os.path.join(folder, shard)
        inside = shard and "\x00" not in shard and os.path.realpath(path).startswith(folder + "/")
        if inside and not os.path.exists(path):
            os.makedirs(os.path.dirname(path), exist_ok=True)
            if not os.path.isdir(path):
                _write_safetensors(path, raw, size)
        try:
            names = list(json.loads(raw))
        except ValueError:
            names = []
        for name in names:
            if name != "__metadata__" and fdp.ConsumeIntInRange(0, 7):
                weight_map[name] = shard
        if fdp.ConsumeIntInRange(0, 7) == 0:
            weight_map[_name(fdp)] = shard
    index: object = {"metadata": {"total_size": _number(fdp)}, "weight_map": weight_map}
    mode = fdp.ConsumeIntInRange(0, 7)
    if mode == 0:
        index = {"weight_map": _number(fdp)}
    elif mode == 1:
        index = {"metadata": _number(fdp), "weight_map": {k: _number(fdp) for k in weight_map}}
    index_path = os.path.join(folder, "model.safetensors.index.json")
    if mode == 2:
        _write(index_path, fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 200)))
    else:
        _write(index_path, json.dumps(index).encode("utf-8", "surrogatepass"))
    layout = fdp.PickValueInList(["nested", "flat"])
    if fdp.ConsumeBool():
        loaded = model.load(model.ModelSource(name="", path=index_path), files)
        views.merged_header(loaded)
        checked_in_c(views.build_tree([loaded], layout))
    else:  # the folder as a SOURCE: discovery, stray shards as models of their own, one folder per model
        if fdp.ConsumeBool():
            stray = os.path.join(folder, fdp.PickValueInList(["b.safetensors", "sub/c.safetensors", "x.index.json"]))
            with contextlib.suppress(OSError):  # "sub" may be a file
                os.makedirs(os.path.dirname(stray), exist_ok=True)
                _write(stray, fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 300)))
        models = model.resolve(folder, files)
        for loaded in models:
            if loaded.is_sharded:
                views.merged_header(loaded)
        checked_in_c(views.build_tree(models, layout))


def checked_in_c(built: tree.Tree) -> tree.Tree:
    """``built``, after checking that stfs._native's tables hold it: a C lookup of each path finds its inode."""
    if _native is None:
        return built
    _native.build(built.root, DirNode, FileNode, Range, built.inode_limit, True)
    try:
        pending: list[tuple[bytes, DirNode]] = [(b"", built.root)]
        while pending:
            path, folder = pending.pop()
            for name, node in folder.children.items():
                try:
                    full = path + b"/" + name.encode("utf-8", "surrogateescape")
                except UnicodeEncodeError:  # no path the kernel sends can name it
                    continue
                found = _native.lookup(full)
                if found != node.inode:
                    raise AssertionError(f"C lookup of {full!r}: inode {found}, the tree has {node.inode}")
                if isinstance(node, DirNode):
                    pending.append((full, node))
        if _native.lookup(b"/") != 1:
            raise AssertionError("C lookup of / is not the root")
    finally:
        _native.close()
    return built


def one_input(data: bytes, scratch: str) -> None:
    if not data:
        return
    mode, rest = data[0] % 5, data[1:]
    fdp = atheris.FuzzedDataProvider(rest)
    path = os.path.join(scratch, "x.safetensors")
    files = LocalFiles()
    try:
        if mode == 0:
            format.parse_header(rest, path=path, file_size=8 + len(rest) + (data[0] // 5))
        elif mode == 1:
            _write(path, rest)
            model.read_header(path, files)
        elif mode == 2:
            raw, size = _built_header(fdp)
            header = format.parse_header(raw, path=path, file_size=8 + len(raw) + size)
            _write_safetensors(path, raw, size)
            checked_in_c(views.build_tree(model.resolve(path, files), fdp.PickValueInList(["nested", "flat"])))
            assert header.tensors is not None
        elif mode == 3:
            raw = _nested(fdp)
            format.parse_header(raw, path=path, file_size=8 + len(raw))
        else:
            _sharded(fdp, os.path.join(scratch, "sharded"), files)
    except errors.StfsError:
        pass
    finally:
        files.close()  # a source holds its files open until closed (the snapshot rule): 20,000 inputs hit EMFILE


def seed_corpus(folder: str) -> None:
    """Valid headers written by the real safetensors package, for every mode."""
    import numpy as np
    from safetensors.numpy import save

    os.makedirs(folder, exist_ok=True)
    arrays = {
        "model.embed.weight": np.zeros((4, 3), np.float32),
        "model.layers.0.w": np.ones(5, np.float16),
        "a.b": np.zeros(2, np.int8),
        "a.b.c": np.zeros(0, np.int64),
        "s": np.array(1.0, np.float64),
    }
    blob = save(arrays, metadata={"format": "pt", "k": "v"})
    (length,) = struct.unpack("<Q", blob[:8])
    seeds = {
        "valid-raw": b"\x00" + blob[8 : 8 + length],
        "valid-file": b"\x01" + blob,
        "valid-sharded": b"\x04" + os.urandom(64),
        "built": b"\x02" + os.urandom(64),
        "nested": b"\x03" + os.urandom(16),
    }
    for name, seed in seeds.items():
        _write(os.path.join(folder, name), seed)


def _body_lines(filename: str) -> set[int]:
    """Lines inside function bodies (module and class bodies run at import, before any input)."""
    with open(filename) as stream:
        code = compile(stream.read(), filename, "exec")
    lines: set[int] = set()
    stack = [code]
    while stack:
        current = stack.pop()
        if current is not code and current.co_flags & inspect.CO_NEWLOCALS:
            first = current.co_firstlineno
            lines.update(line for _, _, line in current.co_lines() if line is not None and line != first)
        stack.extend(const for const in current.co_consts if isinstance(const, types.CodeType))
    return lines


def line_coverage(corpora: list[str], scratch: str) -> None:
    """Replay a corpus under ``trace`` and print, per stfs module, the function-body lines it ran."""
    import trace

    inputs = sorted(os.path.join(c, n) for c in corpora for n in os.listdir(c))
    tracer = trace.Trace(count=1, trace=0)
    raised: dict[str, int] = {}
    for path in inputs:
        with open(path, "rb") as stream:
            data = stream.read()
        try:
            tracer.runfunc(one_input, data, scratch)
        except Exception as exc:
            key = f"{type(exc).__name__}: {exc}"[:100]
            raised[key] = raised.get(key, 0) + 1
    counts = tracer.results().counts
    print(f"{len(inputs)} inputs replayed; raised other than StfsError: {raised or 'none'}")
    for module in (format, model, tree, views):
        filename = module.__file__
        assert filename is not None
        executable = _body_lines(filename)
        ran = {line for (name, line) in counts if name == filename} & executable
        share = 100 * len(ran) / len(executable)
        print(
            f"{os.path.relpath(filename)}: {len(ran)}/{len(executable)} function lines ({share:.0f}%); "
            f"not run: {sorted(executable - ran)}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], add_help=True)
    parser.add_argument("--crash-dir", default="/work/rel-data/fuzz-crashes")
    parser.add_argument(
        "--scratch",
        default=os.path.join(tempfile.gettempdir(), f"stfs-fuzz-{os.getuid()}"),
        help="folder for the files each input writes (emptied at start)",
    )
    parser.add_argument("--replay", nargs="+", metavar="INPUT", help="run saved inputs once, raising on a crash")
    parser.add_argument(
        "--line-coverage",
        nargs="+",
        metavar="CORPUS",
        help="replay every input of the corpus folders and report the stfs lines they run",
    )
    args, libfuzzer_args = parser.parse_known_args()
    sys.setrecursionlimit(1000)
    # libFuzzer ends the process with exit(), so no `finally` runs: one fixed folder, emptied at each start
    scratch = args.scratch
    shutil.rmtree(scratch, ignore_errors=True)
    os.makedirs(scratch)
    try:
        if args.replay:
            for path in args.replay:
                with open(path, "rb") as stream:
                    one_input(stream.read(), scratch)
                print(f"{path}: no crash")
            return
        if args.line_coverage:
            line_coverage(args.line_coverage, scratch)
            return
        for corpus in [a for a in libfuzzer_args if not a.startswith("-")]:
            if not os.path.isdir(corpus) or not os.listdir(corpus):
                seed_corpus(corpus)
        saver = Saver(args.crash_dir)

        def target(data: bytes) -> None:
            try:
                one_input(data, scratch)
            except Exception as exc:  # anything but StfsError is a crash
                saver.record(data, exc)

        atheris.Setup([sys.argv[0], *libfuzzer_args], target)
        try:
            atheris.Fuzz()
        finally:
            print(f"crashes: {saver.crashes} inputs, {len(saver.seen)} distinct", file=sys.stderr)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
