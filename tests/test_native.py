"""stfs._native, the C in front of the Python callbacks: that it serves, that it answers exactly as the Python
path does (attributes, listings, bytes at every boundary, errors), that it hands Python what it must (a changed or
truncated source: EIO and one log line), and that an install without it, or STFS_NATIVE=0, serves from Python."""

from __future__ import annotations

import errno
import importlib.util
import json
import os
import shutil
import sys
import sysconfig
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest

from stfs.daemon import mounted
from tests.helpers import IN_CI, read_cold, run, served_by, tensor_path
from tests.models import write_numpy

pytestmark = pytest.mark.timeout(120)

BUILT = importlib.util.find_spec("stfs._native") is not None
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def require_native(require_fuse: None) -> None:
    if not BUILT:
        if IN_CI:
            pytest.fail("stfs._native is not built in CI (libfuse3-dev and gcc are installed there)")
        pytest.skip("stfs._native is not built here (python3 setup.py build_ext --inplace)")


def native_environment() -> dict[str, str]:
    """This process's environment without STFS_NATIVE (a run of the whole suite with STFS_NATIVE=0 sets it)."""
    return {name: value for name, value in os.environ.items() if name != "STFS_NATIVE"}


def model(folder: Path) -> str:
    """Tensors of many sizes (empty, under a page, unaligned, several MiB) and names the tree must escape."""
    rng = np.random.default_rng(7)
    arrays = {
        "empty": np.zeros(0, dtype=np.float32),
        "tiny": np.arange(3, dtype=np.uint8),
        "page": rng.integers(0, 256, 4096, dtype=np.uint8),
        "odd": rng.integers(0, 256, 12345, dtype=np.uint8),
        "layers.0.big": rng.standard_normal((3 << 20) // 4).astype(np.float32),
        "layers.0.half": rng.standard_normal(5000).astype(np.float16),
        "layers.1.weight": rng.standard_normal(70000).astype(np.float32),
        "layers.1": rng.standard_normal(10).astype(np.float32),  # a folder and a file: the file is layers/1/%
        "naïve-名前 %/x": np.ones(5, dtype=np.int8),
        "l" * 300: np.ones(2, dtype=np.int16),  # shortened with a hash
    }
    return write_numpy(str(folder / "m.safetensors"), arrays, metadata={"note": "x" * 5000})


def walk(mnt: str) -> list[tuple[object, ...]]:
    """Every entry in listing order with its attributes and (read cold) bytes: what a mount answers."""
    found: list[tuple[object, ...]] = []
    pending = [""]
    while pending:
        relative = pending.pop()
        folder = os.path.join(mnt, relative)
        with os.scandir(folder) as entries:
            names = [(entry.name, entry.inode(), entry.is_dir(follow_symlinks=False)) for entry in entries]
        found.append(("dir", relative, tuple(names)))
        for name, _, is_dir in names:
            path = os.path.join(relative, name)
            info = os.lstat(os.path.join(mnt, path))
            attributes = (
                info.st_mode,
                info.st_ino,
                info.st_nlink,
                info.st_size,
                info.st_blocks,
                info.st_blksize,
                info.st_uid,
                info.st_gid,
                info.st_mtime_ns,
                info.st_ctime_ns,
            )
            if is_dir:
                pending.append(path)
                found.append(("folder", path, attributes))
            else:
                found.append(("file", path, attributes, read_cold(os.path.join(mnt, path))))
    return found


def test_both_paths_answer_alike(tmp_path: Path, require_native: None, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "models"
    folder.mkdir()
    model(folder)
    # files/ mirrors the folder: names that are not UTF-8, and non-ASCII ones, reach C as the kernel spells them
    with open(os.path.join(os.fsencode(folder), b"config-\xff\xfe.json"), "wb") as stream:
        stream.write(b"{}" * 5000)
    (folder / "tokenizer-名前.txt").write_bytes(os.urandom(9000))
    source = str(folder)
    (tmp_path / "c").mkdir()
    (tmp_path / "py").mkdir()
    options = ["view=npy,view=f32"]
    with mounted(source, str(tmp_path / "c"), options=options) as mnt:
        native = walk(mnt)
        native_statfs = os.statvfs(mnt)
    monkeypatch.setenv("STFS_NATIVE", "0")
    with mounted(source, str(tmp_path / "py"), options=options) as mnt:
        python = walk(mnt)
        python_statfs = os.statvfs(mnt)
    assert native == python
    assert len(native) > 30
    assert native_statfs == python_statfs


def test_reads_at_every_boundary(mount: object, tmp_path: Path, require_native: None) -> None:
    source = model(tmp_path)
    mnt = mount(source)  # type: ignore[operator]
    path = tensor_path(mnt, "layers.0.big")
    with open(source, "rb") as stream:
        header = int.from_bytes(stream.read(8), "little")
        stream.seek(0)
        whole = stream.read()
    start = 8 + header + json.loads(whole[8 : 8 + header])["layers.0.big"]["data_offsets"][0]
    expected = whole[start : start + os.path.getsize(path)]
    size = len(expected)
    cases = [(0, 0), (0, 1), (1, 4095), (0, 4096), (4095, 2), (100, 8191), (0, 8192), (12345, 1 << 20)]
    cases += [(size - 1, 10), (size - 5000, 9000), (size, 4096), (size + 4096, 4096), (7, size)]
    for offset, count in cases:
        assert read_cold(path, offset, count) == expected[offset : offset + count], (offset, count)


def background(source: str, mnt: Path, log_file: Path, *more: str, env: dict[str, str] | None = None) -> None:
    mnt.mkdir(exist_ok=True)
    result = run(["stfs", "mount", source, str(mnt), "--log-file", str(log_file), *more], env=env)
    assert result.returncode == 0, result.stderr


def unmount(mnt: Path, env: dict[str, str] | None = None) -> None:
    assert run(["stfs", "unmount", str(mnt)], env=env).returncode == 0


def test_the_c_path_serves_and_is_counted(tmp_path: Path, require_native: None) -> None:
    source = model(tmp_path)
    mnt, log_file, stats = tmp_path / "mnt", tmp_path / "log", tmp_path / "stats.json"
    background(source, mnt, log_file, env=dict(native_environment(), STFS_STATS=str(stats)))
    try:
        data = read_cold(tensor_path(str(mnt), "layers.0.big"))
        assert len(data) == 3 << 20
        os.listdir(mnt / "tensors" / "layers")
    finally:
        unmount(mnt)
    lines = log_file.read_text().splitlines()
    answered = [line for line in lines if "answered in C" in line]
    # every tensor (its Range made from its shard's data), header.json and files/m.safetensors; metadata/note is
    # bytes held in memory
    assert answered and "reads of 12 files from 1 of 1 sources (1 files read by Python)" in answered[0], lines
    assert not [line for line in lines if "served from Python" in line]
    counted = json.loads(stats.read_text())
    assert counted["read_bytes"] >= len(data)  # the C reads are in the daemon's counters
    assert counted["calls"]["readdir_fuse_3"] >= 1


def test_stfs_native_0_serves_from_python(tmp_path: Path, require_fuse: None) -> None:
    source = model(tmp_path)
    mnt, log_file, stats = tmp_path / "mnt", tmp_path / "log", tmp_path / "stats.json"
    background(source, mnt, log_file, env=dict(os.environ, STFS_NATIVE="0", STFS_STATS=str(stats)))
    try:
        assert read_cold(tensor_path(str(mnt), "tiny")) == bytes([0, 1, 2])
        assert len(os.listdir(mnt / "tensors")) > 3
    finally:
        unmount(mnt)
    lines = log_file.read_text().splitlines()
    assert len([line for line in lines if "served from Python (STFS_NATIVE=0)" in line]) == 1, lines
    assert not [line for line in lines if "answered in C" in line]
    calls = json.loads(stats.read_text())["calls"]  # mfusepy's plain callbacks, counted by their names
    assert calls["read"] >= 1 and calls["getattr"] >= 1 and calls["readdir"] >= 1, calls
    assert "read_buf" not in calls and "getattr_fuse_3" not in calls, calls


def test_an_install_without_the_extension_serves_from_python(tmp_path: Path, require_fuse: None) -> None:
    """The package as a build without a compiler leaves it: no stfs/_native*.so. One line says so."""
    package = tmp_path / "site"
    shutil.copytree(REPO / "stfs", package / "stfs", ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    # -S: site-packages by path, without its .pth files: an editable install of the checkout (CI's) puts a finder
    # there that would find the checkout's extension for the copied package too
    site_packages = sysconfig.get_paths()["purelib"]
    env = dict(native_environment(), PYTHONPATH=os.pathsep.join([str(package), site_packages]))
    python = [sys.executable, "-S"]
    probe = run(
        [*python, "-c", "import stfs, importlib.util as u; print(u.find_spec('stfs._native'))"],
        env=env,
        cwd=tmp_path,  # not the checkout, whose stfs/ has the extension
    )
    assert probe.stdout.strip() == "None", probe
    source = model(tmp_path)
    mnt, log_file = tmp_path / "mnt", tmp_path / "log"
    mnt.mkdir()
    result = run([*python, "-m", "stfs", "mount", source, str(mnt), "--log-file", str(log_file)], env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    try:
        assert read_cold(tensor_path(str(mnt), "odd"))[:3] == read_cold(tensor_path(str(mnt), "odd"), 0, 3)
        assert len(os.listdir(mnt / "tensors")) > 3
    finally:
        assert run([*python, "-m", "stfs", "unmount", str(mnt)], env=env, cwd=tmp_path).returncode == 0
    lines = log_file.read_text().splitlines()
    missing = [line for line in lines if "stfs._native is not built" in line]
    assert len(missing) == 1 and " WARNING " in missing[0], lines


@pytest.mark.parametrize("how", ["truncate", "touch"])
def test_a_changed_source_is_eio_with_one_line_and_the_daemon_serves_on(
    tmp_path: Path, require_native: None, how: str
) -> None:
    source = model(tmp_path)
    other = write_numpy(str(tmp_path / "other.safetensors"), {"w": np.arange(50000, dtype=np.float32)})
    folder = tmp_path / "models"
    folder.mkdir()
    os.rename(source, folder / "m.safetensors")
    os.rename(other, folder / "other.safetensors")
    source = str(folder / "m.safetensors")
    mnt, log_file = tmp_path / "mnt", tmp_path / "log"
    background(str(folder), mnt, log_file)
    try:
        big = tensor_path(str(mnt / "m"), "layers.0.big")
        size = os.path.getsize(big)
        if how == "truncate":
            os.truncate(source, os.path.getsize(source) - size // 2)
        else:
            os.utime(source, ns=(1, 1))
        for offset, count in [(0, 4096), (size - 8192, 8192), (0, 1 << 20), (size // 2, 4096)] * 2:
            with pytest.raises(OSError) as caught:
                read_cold(big, offset, count)  # the pread (one page) and the splice (more) paths alike
            assert caught.value.errno == errno.EIO
        assert read_cold(tensor_path(str(mnt / "other"), "w")) == np.arange(50000, dtype=np.float32).tobytes()
        assert "m.safetensors" in json.dumps(json.loads(os.getxattr(mnt, "user.stfs.changed")))
    finally:
        unmount(mnt)
    errors = [line for line in log_file.read_text().splitlines() if " ERROR " in line]
    assert len(errors) == 1 and "m.safetensors" in errors[0], errors


def test_threads_read_the_right_bytes(mount: object, tmp_path: Path, require_native: None) -> None:
    source = model(tmp_path)
    mnt = mount(source, options=["threads"])  # type: ignore[operator]
    path = tensor_path(mnt, "layers.0.big")
    expected = read_cold(path)
    wrong: list[tuple[int, int]] = []

    def reader(seed: int) -> None:
        rng = np.random.default_rng(seed)
        for _ in range(200):
            offset = int(rng.integers(0, len(expected)))
            count = int(rng.choice([1, 4096, 8192, 65536, 1 << 20]))
            if read_cold(path, offset, count) != expected[offset : offset + count]:
                wrong.append((offset, count))

    threads = [threading.Thread(target=reader, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert wrong == []


def test_a_long_folder_is_listed_by_its_handle(tmp_path: Path, require_native: None) -> None:
    """C's opendir keeps the folder in the handle libfuse hands each readdir: a folder of 3,000 names, listed in
    a dozen-odd requests at their offsets, and listed again on the same open handle, says what Python says."""
    arrays = {f"blocks.{index:04d}.attention.weight": np.full(1, index, dtype=np.int16) for index in range(3000)}
    source = write_numpy(str(tmp_path / "wide.safetensors"), arrays)
    listings = {}
    for how, environment in [("c", native_environment()), ("py", dict(os.environ, STFS_NATIVE="0"))]:
        mnt, stats = tmp_path / how, tmp_path / f"{how}.json"
        background(
            source, mnt, tmp_path / f"{how}.log", "--layout", "flat", env=dict(environment, STFS_STATS=str(stats))
        )
        try:
            folder = os.open(mnt / "tensors", os.O_RDONLY | os.O_DIRECTORY)
            try:
                first = [(entry.name, entry.inode(), entry.is_dir()) for entry in os.scandir(folder)]
                again = os.listdir(folder)  # the same open folder, read from its start again
            finally:
                os.close(folder)
            assert [name for name, _, _ in first] == again
            listings[how] = (first, sorted(os.listdir(mnt)))
        finally:
            unmount(mnt)
        listings[f"{how} calls"] = json.loads(stats.read_text())["calls"]
    assert listings["c"] == listings["py"]
    assert len(listings["c"][0]) == 3000
    calls = listings["c calls"]
    # C opened tensors/ once (the listings after it share the open handle) and the root once, and listed both
    assert calls["opendir"] == 2 and calls["readdir_fuse_3"] >= 8, calls  # tensors/ in several requests
    assert "readdir" not in calls, calls  # and Python listed none


LONG_NAME_SERVER = textwrap.dedent("""
    import sys
    from stfs._libfuse import request_size, serve
    from stfs.fs import StfsOperations
    from stfs.model import resolve
    from stfs.sources import LocalFiles
    from stfs.views import VIEWS, build_tree

    model, mountpoint, long_name = sys.argv[1:4]

    def odd(tree, model, base, layout):  # a view whose folder holds a name C's tables cannot keep (over 255 bytes)
        tree.add_file([*base, "odd", "short"], model.mtime_ns, (b"short",))
        tree.add_file([*base, "odd", long_name], model.mtime_ns, (b"long",))
        tree.add_file([*base, "odd", "inner", "deep"], model.mtime_ns, (b"deep",))

    tree = build_tree(resolve(model), views=(*VIEWS, odd))
    serve(StfsOperations(tree, LocalFiles()), mountpoint, foreground=True, ro=True, nothreads=True,
          max_read=request_size(), use_ino=True)
""")


def test_a_folder_holding_a_name_c_cannot_keep_is_listed_by_python(tmp_path: Path, require_native: None) -> None:
    """C's tables keep names of 1 to 255 bytes (all the kernel can look up); a folder holding any other is listed
    by Python, through the same mount, and everything else in it is still C's."""
    model_path = write_numpy(str(tmp_path / "m.safetensors"), {"w": np.arange(4, dtype=np.int32)})
    long_name = "n" * 300
    mnt, stats = tmp_path / "mnt", tmp_path / "stats.json"
    mnt.mkdir()
    command = [sys.executable, "-c", LONG_NAME_SERVER, model_path, str(mnt), long_name]
    with served_by(command, mnt, tmp_path / "server.log", env=dict(native_environment(), STFS_STATS=str(stats))):
        assert os.listdir(mnt / "odd") == ["short", long_name, "inner"]
        found = run(["find", str(mnt / "odd")]).stdout.splitlines()
        assert sorted(found) == sorted(
            str(mnt / "odd" / name) for name in ["", "short", long_name, "inner", "inner/deep"]
        )
        assert (mnt / "odd" / "short").read_bytes() == b"short"
        assert (mnt / "odd" / "inner" / "deep").read_bytes() == b"deep"
        assert (
            os.stat(mnt / "odd" / "inner").st_ino
            == [e.inode() for e in os.scandir(mnt / "odd") if e.name == "inner"][0]
        )
        assert os.listdir(mnt / "odd" / "inner") == ["deep"]
        assert read_cold(tensor_path(str(mnt), "w")) == np.arange(4, dtype=np.int32).tobytes()
    calls = json.loads(stats.read_text())["calls"]
    assert calls["readdir"] >= 1, calls  # Python's readdir listed odd/
    assert calls["readdir_fuse_3"] >= 1 and calls["opendir"] >= 2, calls  # C listed odd/inner/ and the rest
