"""Gathered tensors served as a range is (issue #44): a tensor whose bytes are not one range of a file (a DCP tensor
sharded across ranks, a strided view in a ``torch.save``) is lowered at mount into blocks of runs
(``Scattered.layout``, ``nodes.lower``) that stfs._native walks. The one gather routine (``Assembled.read_into``,
``gather_into``, which ``fuzz_pickle.py`` compares with torch) is the reference: the layouts of random grids and views
against it; then checkpoints written by ``torch.distributed.checkpoint.save`` from four gloo ranks (a 2x2 mesh:
rows, columns and grids of chunks) read over random ranges through real mounts, with C and with ``STFS_NATIVE=0``;
threads and processes reading one tensor and mapping it at once; and the one log line where C leaves a tensor to
Python (a transpose)."""

from __future__ import annotations

import contextlib
import importlib.util
import mmap
import multiprocessing
import os
import random
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.checkpoints import walked
from tests.helpers import IN_CI, read_cold, stfs_command
from tests.test_dcp_format import free_port, grid_pieces

torch = pytest.importorskip("torch")
pytest.importorskip("torch.distributed.checkpoint")

pytestmark = pytest.mark.timeout(300)


def test_the_layout_of_any_grid_of_chunks_is_what_the_gather_routine_gives(tmp_path: Path) -> None:
    """Tensors of 0 to 4 dimensions cut into random grids of chunks in three files: the runs the layout names,
    walked, are the reference's bytes; a layout past its limit says why instead."""
    from stfs.formats.dcp import assemble

    rng = random.Random(11)
    for trial in range(150):
        shape = tuple(rng.randint(1, 7) for _ in range(rng.randint(0, 4)))
        size = rng.choice([1, 2, 4, 8])
        whole = np.frombuffer(rng.randbytes(int(np.prod(shape)) * size), dtype=f"V{size}").reshape(shape)
        files = {f"f{k}": bytearray(rng.randbytes(rng.randint(0, 40))) for k in range(3)}
        strided = trial % 10 == 0  # chunks stored as transposes are: not runs
        pieces, cuts = grid_pieces(rng, whole, files, most=3, transposed=1.0 if strided else 0.0)

        def read(
            offset: int,
            length: int,
            file: str | None = None,
            span: tuple[int, int] | None = None,
            files: dict[str, bytearray] = files,
        ) -> bytes:
            assert span is None or span[0] <= offset and offset + length <= span[1]  # a read within its chunk
            return bytes(files[str(file)][offset : offset + length])

        gathered = assemble.Assembled(shape, size, tuple(sorted(pieces, key=lambda part: part.first)))
        expected = bytearray(whole.nbytes)
        gathered.read_into(read, 0, memoryview(expected))
        assert bytes(expected) == whole.tobytes()
        layout = gathered.layout(1 << 16)
        if any(not part.tensor.contiguous for part in pieces):
            assert layout == "a chunk is stored strided", (trial, shape, cuts)
            continue
        assert not isinstance(layout, str), (trial, shape, cuts)
        assert walked(layout, read) == bytes(expected), (trial, shape, cuts)
        runs = sum(len(block.parts) for block in layout if not isinstance(block, bytes))
        if runs > 1:
            assert isinstance(gathered.layout(runs // 2 - 1 if runs > 3 else 0), str)


def test_the_layout_of_a_strided_view_is_what_the_gather_routine_gives() -> None:
    """Views torch.save stores strided (slices with steps, narrow columns, dimensions moved but the last): their
    layouts walked are ``gather_into``'s bytes; a view whose last dimension is strided (a transpose) is not laid
    out."""
    from stfs.formats.pytorch import Tensor, gather_into, strided_layout

    rng = random.Random(4)
    base = torch.arange(4 * 6 * 10 * 3, dtype=torch.int16).reshape(4, 6, 10, 3)
    views = [
        base[:, :, ::2],
        base[:, 1:4],
        base[::2, :, 3:7, :],
        base[1],
        base.permute(1, 0, 2, 3),
        base[:, :, :, :2],
        base[:, 2, :, 1:],
        base.expand(2, 4, 6, 10, 3)[:, 1:],
        base[..., 0],
        base.transpose(2, 3),
        base.reshape(24, 30).t(),
    ]
    storage = base.numpy().tobytes()
    for view in views:
        tensor = Tensor(
            "", "I16", tuple(view.shape), tuple(view.stride()), 2, "0", view.storage_offset(), 100, len(storage)
        )

        def read(offset: int, length: int, file: str | None = None, span: tuple[int, int] | None = None) -> bytes:
            return storage[offset - 100 : offset - 100 + length]

        expected = bytearray(tensor.nbytes)
        gather_into(tensor, read, 0, memoryview(expected))
        assert bytes(expected) == view.contiguous().numpy().tobytes()
        layout = strided_layout(tensor, 1 << 16)
        if view.stride()[-1] != 1:
            assert isinstance(layout, str) and "last dimension" in layout
            continue
        assert not isinstance(layout, str), view.shape
        assert walked(layout, read) == bytes(expected), (view.shape, view.stride())
    assert rng  # the views are fixed: torch's own strides


# -- through real mounts -----------------------------------------------------------------------------------------

PLACEMENTS = {  # name: (shape, dtype, the placement on each mesh dimension of a 2x2 mesh)
    "grid": ((1024, 768), "float32", ("S0", "S1")),  # four chunks, each rows and columns
    "columns": ((512, 1536), "float32", ("S1", "S1")),  # four column chunks: a run per row and chunk
    "narrow": ((3000, 6), "bfloat16", ("S1", "S1")),  # columns of 1 or 2 elements: short runs
    "rows": ((2050, 513), "float16", ("S0", "S0")),  # four uneven row chunks: runs of whole chunks
    "cube": ((5, 300, 200), "float32", ("S1", "S2")),  # a grid in the last two of three dimensions
    "deep": ((6, 7, 80, 90), "int64", ("S2", "S0")),
    "half": ((700, 900), "float32", ("R", "S1")),  # two column chunks, each held by two ranks
    "vector": ((100003,), "int32", ("S0", "R")),
    "small": ((3, 5), "int8", ("S0", "S1")),
}


def full(name: str, table: dict[str, Any] = PLACEMENTS) -> Any:
    shape, dtype, _ = table[name]
    generator = torch.Generator().manual_seed(sum(map(ord, name)))
    values = torch.randn(shape, generator=generator) * 100
    return values.to(getattr(torch, dtype))


def _rank(rank: int, world: int, port: int, folder: str, remote: bool) -> None:
    """One rank of a gloo group saving the tensors of ``REMOTE`` (a mesh of ``world``) or of ``PLACEMENTS`` (2x2)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor, init_device_mesh

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        table = REMOTE if remote else PLACEMENTS
        mesh = init_device_mesh("cpu", (world,) if remote else (2, 2))
        state = {}
        for name, (_, _, placements) in table.items():
            chosen = [Replicate() if p == "R" else Shard(int(p[1])) for p in placements]
            state[name] = distribute_tensor(full(name, table), mesh, chosen)
        dcp.save(state, checkpoint_id=folder)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("grid") / "checkpoint"
    torch.multiprocessing.spawn(_rank, args=(4, free_port(), str(folder), False), nprocs=4)
    return folder


def raw(tensor: Any) -> bytes:
    return bytes(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())


BUILT = importlib.util.find_spec("stfs._native") is not None


def need_native(native: str | None = "1") -> None:
    if native != "0" and not BUILT:
        if IN_CI:
            pytest.fail("stfs._native is not built in CI")
        pytest.skip("stfs._native is not built here (python3 setup.py build_ext --inplace)")


@contextlib.contextmanager
def background(source: Path, tmp_path: Path, *args: str, native: str | None = None) -> Iterator[tuple[str, Path]]:
    """``stfs mount SOURCE MNT --log-file LOG ARGS`` in the background: C's path where ``native`` is "1", Python's
    where it is "0", C splicing every run however short (into a pipe that fills up first) where it is "splice", as
    the environment says (``STFS_NATIVE``) where it is ``None``; the mountpoint and the log; always unmounted."""
    env = dict(os.environ)
    if native is not None:
        env.pop("STFS_NATIVE", None)
        env.pop("STFS_SPLICE_RUN", None)
    if native == "0":
        env["STFS_NATIVE"] = "0"
    elif native == "splice":
        env["STFS_SPLICE_RUN"] = "1"
    mnt, log_file = tmp_path / "mnt", tmp_path / "log"
    mnt.mkdir()
    result = stfs_command("mount", str(source), str(mnt), "--log-file", str(log_file), *args, env=env)
    assert result.returncode == 0, result.stderr
    try:
        yield str(mnt), log_file
    finally:
        assert stfs_command("unmount", str(mnt), env=env).returncode == 0


def ranges(rng: random.Random, size: int, count: int) -> list[tuple[int, int]]:
    """Random reads of a file of ``size`` bytes: anywhere, of any length up to 3 MiB (two requests and more), some
    on its boundaries."""
    found = [(0, size), (size - 1, 10), (0, 1), (max(0, size - 4097), 8193)]
    for _ in range(count):
        begin = rng.randrange(size)
        found.append((begin, rng.choice([1, 7, 4096, 8191, 65536, 1 << 20, 3 << 20, rng.randrange(1, 300000)])))
    return found


@pytest.mark.parametrize("native", ["1", "splice", "0"])
def test_random_ranges_of_gathered_tensors_are_their_bytes(
    checkpoint: Path, tmp_path: Path, native: str, require_fuse: None
) -> None:
    """Every tensor of the 2x2 mesh's checkpoint, read cold (the daemon answers) over random ranges, and through
    ``--view safetensors`` loaded by safetensors: the bytes of the tensor it was saved from; with C, every tensor's
    file is C's (no line says a gathered file is left to Python)."""
    from safetensors.torch import load_file

    need_native(native)
    rng = random.Random(native)
    with background(checkpoint, tmp_path, "--view", "safetensors", native=native) as (mnt, log_file):
        for name in PLACEMENTS:
            expected = raw(full(name))
            path = os.path.join(mnt, "tensors", name)
            assert os.path.getsize(path) == len(expected)
            for begin, count in ranges(rng, len(expected), 12):
                assert read_cold(path, begin, count) == expected[begin : begin + count], (name, begin, count)
        loaded = load_file(os.path.join(mnt, "safetensors", "model.safetensors"))
        for name in PLACEMENTS:
            assert raw(loaded[name]) == raw(full(name)), name
        del loaded  # its tensors map the file: the mount is busy while they live
    lines = log_file.read_text()
    assert "read by Python, not C" not in lines
    if native != "0":
        assert "answered in C" in lines


def _read_process(path: str, expected_path: str, seed: int, queue: Any) -> None:
    with open(expected_path, "rb") as stream:
        expected = stream.read()
    rng = random.Random(seed)
    bad = []
    fd = os.open(path, os.O_RDONLY)
    try:
        for begin, count in ranges(rng, len(expected), 60):
            if rng.random() < 0.3:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            if os.pread(fd, count, begin) != expected[begin : begin + count]:
                bad.append((begin, count))
    finally:
        os.close(fd)
    queue.put(bad)


def test_threads_processes_and_a_mapping_read_a_gathered_tensor_at_once(
    checkpoint: Path, tmp_path: Path, require_fuse: None
) -> None:
    """Four threads and three processes reading random ranges of one column-sharded tensor (the page cache dropped
    now and then, so the daemon answers) while a fifth thread maps it and reads it through the mapping: every byte
    is the tensor's (with C, or with Python where the environment says STFS_NATIVE=0)."""
    expected = raw(full("columns"))
    expected_path = tmp_path / "columns.bin"
    expected_path.write_bytes(expected)
    with background(checkpoint, tmp_path) as (mnt, _):
        path = os.path.join(mnt, "tensors", "columns")
        failures: list[Any] = []

        def threaded(seed: int) -> None:
            queue: Any = _Collect()
            _read_process(path, str(expected_path), seed, queue)
            failures.extend(queue.items)

        def mapped() -> None:
            with open(path, "rb") as stream, mmap.mmap(stream.fileno(), 0, prot=mmap.PROT_READ) as mapping:
                for _ in range(3):
                    if mapping[:] != expected:
                        failures.append("mmap")
                    mapping.madvise(mmap.MADV_DONTNEED)

        context = multiprocessing.get_context("spawn")
        queue = context.Queue()
        processes = [
            context.Process(target=_read_process, args=(path, str(expected_path), 100 + k, queue)) for k in range(3)
        ]
        threads = [threading.Thread(target=threaded, args=(k,)) for k in range(4)]
        threads.append(threading.Thread(target=mapped))
        for worker in [*processes, *threads]:
            worker.start()
        for thread in threads:
            thread.join()
        for _ in processes:
            failures.extend(queue.get(timeout=240))
        for process in processes:
            process.join()
            assert process.exitcode == 0
        assert failures == []


class _Collect:
    def __init__(self) -> None:
        self.items: list[Any] = []

    def put(self, items: list[Any]) -> None:
        self.items.extend(items)


def test_a_tensor_c_cannot_walk_is_read_by_python_and_one_line_says_so(tmp_path: Path, require_fuse: None) -> None:
    """A checkpoint of views: a slice of columns and one with a step are C's; a transpose (each element a run of its
    own) is Python's, and the daemon's log says so once, naming it; every byte is the view's either way."""
    need_native()
    base = torch.arange(600 * 500, dtype=torch.float32).reshape(600, 500)
    state = {"columns": base[:, 100:300], "step": base[::3], "transposed": base.t(), "other": base[:2].t()}
    source = tmp_path / "views.pt"
    torch.save(state, source)
    with background(source, tmp_path, native="1") as (mnt, log_file):
        for name, view in state.items():
            expected = raw(view)
            path = os.path.join(mnt, "tensors", name)
            assert read_cold(path) == expected, name
            assert read_cold(path, 4093, 70000) == expected[4093 : 4093 + 70000], name
    lines = [line for line in log_file.read_text().splitlines() if "read by Python, not C" in line]
    assert len(lines) == 1, lines
    assert "2 gathered files" in lines[0] and "'transposed'" in lines[0] and "last dimension" in lines[0], lines
    answered = [line for line in log_file.read_text().splitlines() if "answered in C" in line]
    # C: files/views.pt and the two views it walks; Python: the transposes, header.json and metadata/format
    assert answered and "reads of 3 files from 1 of 1 sources (4 files read by Python)" in answered[0], answered


# -- remote: a gathered tensor costs its bytes ---------------------------------------------------------------------

REMOTE = {  # name: (shape, dtype, placement over two ranks); each rank's file holds its chunk of each, in this order
    "columns": ((1024, 1024), "float32", ("S1",)),  # 4 MiB: two 2 MiB chunks, a run per row in each
    "rows": ((1024, 1024), "float32", ("S0",)),
    "after": ((512, 1024), "float32", ("S1",)),  # a tensor after them in each file: not fetched with them
}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("two") / "checkpoint"
    torch.multiprocessing.spawn(_rank, args=(2, free_port(), str(folder), True), nprocs=2)
    return folder


@pytest.mark.parametrize("server", ["http", "hub", "s3"])
def test_a_remote_gathered_tensor_costs_its_bytes(
    server: str, two_ranks: Path, request: pytest.FixtureRequest, mount: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A two-rank checkpoint over HTTP (nginx), in a Hub repository and on S3 (moto, through a counting proxy):
    reading a whole 4 MiB tensor sharded by columns (or rows, or a 2 MiB one after them in each file) fetches at
    most 1.1 times its bytes (SPEC §7): a fetch stops at its chunk's end, and reading ahead follows the chunks, not
    the file on past them; read again, nothing is fetched (C answers from the block cache). So does reading every
    tensor."""
    files = {file.name: file.read_bytes() for file in two_ranks.iterdir()}
    if server == "http":
        nginx = request.getfixturevalue("nginx")
        source = [nginx.put(f"two/{name}", data) for name, data in files.items() if name == ".metadata"][0]
        for name, data in files.items():
            nginx.put(f"two/{name}", data)

        def fetched() -> int:
            return int(nginx.log.transfer().bytes)

        def clear() -> None:
            nginx.log.clear()

    elif server == "hub":
        hub = request.getfixturevalue("hub")
        hub.publish_repo("org", "two", files)
        source = "hf://org/two"

        def fetched() -> int:
            return int(hub.cdn_log.transfer().bytes)

        def clear() -> None:
            hub.cdn_log.clear()

    else:
        s3 = request.getfixturevalue("s3")
        s3.create_bucket("bucket")
        for name, data in files.items():
            s3.put_object("bucket", f"two/{name}", data)
        proxy = request.getfixturevalue("fault_proxy")(s3.endpoint)
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        source = "s3://bucket/two/"
        seen = [0]

        def fetched() -> int:
            return sum(entry.body_bytes for entry in proxy.requests()[seen[0] :])

        def clear() -> None:
            seen[0] = len(proxy.requests())

    for name in REMOTE:  # one tensor alone, a fresh mount each
        mnt = mount(source)
        expected = raw(full(name, REMOTE))
        path = os.path.join(mnt, "tensors", name)
        clear()
        assert read_cold(path) == expected, name
        cost = fetched()  # (what of it the first read of each file at mount holds is not fetched again)
        assert cost <= 1.1 * len(expected), (name, cost)
        clear()
        assert read_cold(path) == expected, name
        assert fetched() == 0, name
    mnt = mount(source)  # the whole checkpoint, tensor after tensor
    clear()
    for name in REMOTE:
        assert read_cold(os.path.join(mnt, "tensors", name)) == raw(full(name, REMOTE)), name
    total = sum(len(raw(full(name, REMOTE))) for name in REMOTE)
    assert fetched() <= 1.1 * total, (fetched(), total)
