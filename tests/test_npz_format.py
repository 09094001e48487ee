"""NumPy's .npz and .npy (docs/npz.md): files np.save and np.savez write, np.load the reference for their bytes and
their refusals; what stfs refuses beyond np.load (compressed members, object arrays, big-endian data, dtypes
safetensors lacks) in one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.helpers import MountFn, refusal, stfs_command

DTYPES = {
    np.float32: "F32",
    np.float16: "F16",
    np.float64: "F64",
    np.int8: "I8",
    np.uint8: "U8",
    np.int16: "I16",
    np.uint16: "U16",
    np.int32: "I32",
    np.uint32: "U32",
    np.int64: "I64",
    np.uint64: "U64",
    np.bool_: "BOOL",
    np.complex64: "C64",
}


def every_dtype() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    arrays = {f"c.{np.dtype(t).name}": (rng.standard_normal((3, 4)) * 100).astype(t) for t in DTYPES}
    arrays["f.matrix"] = np.asfortranarray(rng.standard_normal((5, 7)).astype(np.float32))
    arrays["f.cube"] = np.asfortranarray(np.arange(2 * 3 * 4, dtype=np.int16).reshape(2, 3, 4))
    arrays["f.column"] = np.asfortranarray(np.arange(4, dtype=np.float64).reshape(4, 1))  # C order too
    arrays["empty"] = np.zeros((0, 3), np.float32)
    arrays["scalar"] = np.array(2.5, np.float64)
    return arrays


def one_line(result: object, source: Path) -> str:
    stderr = result.stderr  # type: ignore[attr-defined]
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and str(source) in lines[0] and "Traceback" not in stderr, stderr
    return str(lines[0])


def test_every_member_is_a_tensor_file_of_the_bytes_np_load_gives(tmp_path: Path, mount: MountFn) -> None:
    source = tmp_path / "weights.npz"
    np.savez(source, **every_dtype())
    mnt = mount(str(source), options=["view=npy"])
    with np.load(source) as loaded:
        assert sorted(loaded.files) == sorted(every_dtype())
        for name in loaded.files:
            array = loaded[name]
            path = Path(mnt, "tensors", *name.split("."))
            assert path.read_bytes() == np.ascontiguousarray(array).tobytes(), name
            assert os.getxattr(path, "user.npz.dtype").decode() == DTYPES[array.dtype.type]
            assert json.loads(os.getxattr(path, "user.npz.shape")) == list(array.shape)
            assert os.getxattr(path, "user.npz.member").decode() == name + ".npy"
            view = np.load(Path(mnt, "npy", *name.split(".")).with_suffix(".npy"))
            assert view.dtype == array.dtype and np.array_equal(view, array), name
    header = json.loads(Path(mnt, "header.json").read_bytes())
    assert header.pop("__metadata__") == {"format": "np"}
    assert list(header) == list(every_dtype())  # the archive's order: np.savez's


def test_a_fortran_order_tensor_is_gathered_and_a_c_order_one_is_its_members_range(
    tmp_path: Path, mount: MountFn
) -> None:
    source = tmp_path / "weights.npz"
    arrays = every_dtype()
    np.savez(source, **arrays)
    mnt = mount(str(source))
    data = source.read_bytes()
    for name in ("c.float32", "f.matrix", "f.column"):
        path = Path(mnt, "tensors", *name.split("."))
        offset = int(os.getxattr(path, "user.npz.offset"))
        stored = data[offset : offset + arrays[name].nbytes]
        assert stored == arrays[name].tobytes(order="A")  # the member's data, in the array's own order
        assert path.read_bytes() == arrays[name].tobytes(order="C")


@pytest.mark.parametrize("fortran", [False, True])
def test_a_lone_npy_is_a_one_tensor_model_named_after_its_file(tmp_path: Path, mount: MountFn, fortran: bool) -> None:
    array = np.arange(24, dtype=np.float32).reshape(4, 6)
    source = tmp_path / "embedding.npy"
    np.save(source, np.asfortranarray(array) if fortran else array)
    mnt = mount(str(source))
    assert os.listdir(Path(mnt, "tensors")) == ["embedding"]
    assert Path(mnt, "tensors", "embedding").read_bytes() == np.load(source).tobytes(order="C")
    assert Path(mnt, "files", "embedding.npy").read_bytes() == source.read_bytes()
    info = stfs_command("info", "--json", str(source))
    [tensor] = json.loads(info.stdout)["models"][0]["tensors"]
    assert (tensor["name"], tensor["dtype"], tensor["shape"]) == ("embedding", "F32", [4, 6])


def test_a_npz_without_its_suffix_is_known_by_its_first_member(tmp_path: Path) -> None:
    np.savez(tmp_path / "blob.npz", w=np.ones(3, np.float32))
    source = tmp_path / "blob"
    (tmp_path / "blob.npz").rename(source)
    result = stfs_command("check", str(source))
    assert result.returncode == 0 and "ok (1 tensors)" in result.stdout, result.stdout + result.stderr


def test_view_safetensors_holds_the_npz_converted(tmp_path: Path, mount: MountFn) -> None:
    from safetensors.numpy import load_file

    source = tmp_path / "weights.npz"
    arrays = every_dtype()
    np.savez(source, **arrays)
    mnt = mount(str(tmp_path), options=["view=safetensors"])
    assert os.listdir(Path(mnt, "safetensors")) == ["weights.safetensors"]
    converted = load_file(str(Path(mnt, "safetensors", "weights.safetensors")))
    assert sorted(converted) == sorted(arrays)
    for name, array in arrays.items():
        assert converted[name].tobytes() == array.tobytes(order="C"), name


def refused(tmp_path: Path, source: Path) -> str:
    result = refusal(source, tmp_path)
    assert result.returncode == 1
    line = one_line(result, source)
    check = stfs_command("check", str(source))
    assert check.returncode == 1 and str(source) in check.stdout
    return line


def test_a_compressed_npz_is_refused_in_one_line(tmp_path: Path) -> None:
    source = tmp_path / "small.npz"
    np.savez_compressed(source, w=np.ones(100, np.float32))
    assert np.load(source)["w"].sum() == 100  # np.load reads it: its members are deflated, not stored
    line = refused(tmp_path, source)
    assert (
        f"{source}: entry 'w.npy' is compressed (method 8), as np.savez_compressed writes it: stfs cannot mount" in line
    )
    assert "this NumPy .npy/.npz file, by its rule 'stored members' (CompressedMember); " in line
    # the way out it names is a command that works: the file it writes mounts
    command = line.partition("python3 -c ")[2]
    assert command.startswith('"') and command.endswith('"')
    done = subprocess.run([sys.executable, "-c", command[1:-1]], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    info = stfs_command("info", "--json", str(tmp_path / "small-stored.npz"))
    assert info.returncode == 0 and json.loads(info.stdout)["models"][0]["tensors"][0]["name"] == "w", info.stderr


def test_an_object_array_is_refused_unread(tmp_path: Path) -> None:
    source = tmp_path / "objects.npy"
    np.save(source, np.array([{"a": 1}, None], dtype=object), allow_pickle=True)
    with pytest.raises(ValueError, match="allow_pickle"):
        np.load(source)  # np.load refuses it too, unless told to run its pickle
    line = refused(tmp_path, source)
    assert "this NumPy .npy/.npz file, by its rule 'no object arrays' (ObjectArray); its data is a pickle" in line


def test_big_endian_data_and_dtypes_safetensors_lacks_are_refused(tmp_path: Path) -> None:
    big = tmp_path / "big.npy"
    np.save(big, np.arange(4, dtype=">f4"))
    assert np.load(big).dtype == np.dtype(">f4")
    assert "by its rule 'little-endian data' (BigEndianArray); save it little-endian" in refused(tmp_path, big)
    for name, array in {"wide": np.ones(2, np.complex128), "text": np.array(["ab", "c"])}.items():
        source = tmp_path / f"{name}.npz"
        np.savez(source, x=array)
        line = refused(tmp_path, source)
        assert "by its rule 'a dtype safetensors has' (UnsupportedDtype); save it as one safetensors has" in line
        assert "'x.npy'" in line


@pytest.mark.parametrize("cut", [9, 40, -1])
def test_a_file_np_load_refuses_is_refused(tmp_path: Path, cut: int) -> None:
    whole = tmp_path / "whole.npy"
    np.save(whole, np.arange(10, dtype=np.float32))
    source = tmp_path / "cut.npy"
    source.write_bytes(whole.read_bytes()[:cut])
    with pytest.raises((ValueError, EOFError, OSError)):
        np.load(source)
    assert "stfs cannot mount this NumPy .npy/.npz file" in refused(tmp_path, source)


def test_a_compressed_npz_beside_a_model_is_left_in_files(tmp_path: Path, mount: MountFn) -> None:
    from safetensors.numpy import save_file

    save_file({"w": np.ones(2, np.float32)}, str(tmp_path / "model.safetensors"))
    np.savez_compressed(tmp_path / "data.npz", x=np.arange(5))
    mnt = mount(str(tmp_path))
    assert os.listdir(Path(mnt, "tensors")) == ["w"]
    assert Path(mnt, "files", "data.npz").read_bytes() == (tmp_path / "data.npz").read_bytes()
