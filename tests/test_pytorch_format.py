"""The PyTorch checkpoint reader (stfs/formats/pytorch/, SPEC §12): checkpoints the real torch writes read
as torch reads them, without running them; hand-made zips and pickles for every refusal; hostile pickles
within bounds; the equivalent safetensors file loaded by the real safetensors; a bounded fuzz run."""

from __future__ import annotations

import io
import json
import os
import pickle
import struct
import subprocess
import sys
import tarfile
import warnings
import zipfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load as safetensors_load
from safetensors.torch import save as safetensors_save

from stfs import errors
from stfs.formats import pytorch
from stfs.formats.base import COALESCE_GAP
from stfs.formats.pytorch import rules as pytorch_rules
from tests import checkpoints as ck

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parent.parent
MIB = 1 << 20

# -- helpers ---------------------------------------------------------------------------------------------------


class Counted:
    """A range reader over bytes or a file that counts what it is asked for."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.calls = 0
        self.bytes = 0
        self.ranges: list[tuple[int, int]] = []

    def __call__(self, offset: int, size: int) -> bytes:
        self.calls += 1
        self.bytes += size
        self.ranges.append((offset, size))
        return self.data[offset : offset + size]


def save(obj: Any, **options: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer, **options)
    return buffer.getvalue()


def read(data: bytes, path: str = "ckpt.pt") -> pytorch.Checkpoint:
    return pytorch.read_checkpoint(Counted(data), len(data), path=path)


def raw(tensor: torch.Tensor) -> bytes:
    """A tensor's bytes in C order, as safetensors stores them."""
    if tensor.numel() == 0:
        return b""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def gathered(
    tensor: pytorch.Tensor, read: Callable[[int, int], bytes], begin: int = 0, end: int | None = None
) -> bytes:
    """Bytes ``begin`` to ``end`` of a tensor's elements in C order, as the mount serves them (``gather_into``)."""
    end = tensor.nbytes if end is None else min(end, tensor.nbytes)
    out = bytearray(max(end - begin, 0))
    pytorch.gather_into(tensor, read, begin, memoryview(out))
    return bytes(out)


def check_bytes(data: bytes, checkpoint: pytorch.Checkpoint, expected: dict[str, torch.Tensor]) -> None:
    """Every tensor read is the expected one: dtype, shape, and its bytes (a range or gathered) those of
    ``t.contiguous()``."""
    reader = Counted(data)
    assert [t.name for t in checkpoint.tensors] == list(expected)
    for tensor in checkpoint.tensors:
        want = expected[tensor.name]
        assert list(tensor.shape) == list(want.shape), tensor.name
        assert tensor.dtype == pytorch.TORCH_DTYPES[str(want.dtype).removeprefix("torch.")][0]
        assert tensor.contiguous == want.is_contiguous(), tensor.name
        assert gathered(tensor, reader) == raw(want), tensor.name
        if tensor.contiguous:
            offset, size = tensor.byte_range or (0, 0)
            assert data[offset : offset + size] == raw(want), tensor.name
            assert offset == tensor.offset
        else:
            assert tensor.byte_range is None


def names_of(checkpoint: pytorch.Checkpoint) -> list[str]:
    return [tensor.name for tensor in checkpoint.tensors]


# -- checkpoints the real torch writes ----------------------------------------------------------------------------


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(10, 4)
        self.layers = torch.nn.ModuleList([torch.nn.Linear(4, 4) for _ in range(2)])
        self.norm = torch.nn.LayerNorm(4)
        self.conv = torch.nn.Conv1d(4, 2, 3)
        self.register_buffer("steps", torch.tensor(7))


@pytest.mark.parametrize("layout", ["zip", "legacy"])
def test_a_modules_state_dict(layout: str) -> None:
    state = Tiny().state_dict()
    data = save(state, _use_new_zipfile_serialization=layout == "zip")
    checkpoint = read(data)
    assert checkpoint.layout == layout and checkpoint.model_key is None and checkpoint.left_out == ()
    check_bytes(data, checkpoint, dict(state))
    assert checkpoint.unsafe_globals == ()
    assert "torch._utils._rebuild_tensor_v2" in checkpoint.globals
    assert checkpoint.protocol == 2
    assert checkpoint.archive_name == ("archive" if layout == "zip" else None)


def test_the_top_folder_is_named_after_the_file(tmp_path: Path) -> None:
    path = tmp_path / "pytorch_model.bin"
    torch.save({"w": torch.ones(2)}, path)
    checkpoint = pytorch.read_checkpoint(Counted(path.read_bytes()), path.stat().st_size, path=str(path))
    assert checkpoint.archive_name == "pytorch_model"


SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "C64": torch.complex64,
    "U16": torch.uint16,
    "U32": torch.uint32,
    "U64": torch.uint64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E4M3FNUZ": torch.float8_e4m3fnuz,
    "F8_E5M2FNUZ": torch.float8_e5m2fnuz,
    "F8_E8M0": torch.float8_e8m0fnu,
}


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Random bytes viewed as ``dtype`` (bools as 0/1)."""
    generator = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=generator).bool()
    count = int(torch.tensor(shape).prod()) * dtype.itemsize
    return torch.randint(0, 256, (count,), dtype=torch.uint8, generator=generator).view(dtype).reshape(shape)


@pytest.mark.parametrize("layout", ["zip", "legacy"])
def test_every_dtype_safetensors_has(layout: str) -> None:
    tensors = {name: random_tensor(dtype, (3, 5), seed=i) for i, (name, dtype) in enumerate(SAFETENSORS_DTYPES.items())}
    tensors["F32.t"] = tensors["F32"].t()  # strided views of a typed and an untyped storage
    tensors["U16.col"] = tensors["U16"][:, 1]
    data = save(tensors, _use_new_zipfile_serialization=layout == "zip")
    checkpoint = read(data)
    check_bytes(data, checkpoint, tensors)
    assert {t.name: t.dtype for t in checkpoint.tensors if "." not in t.name} == {n: n for n in SAFETENSORS_DTYPES}
    assert checkpoint.unsafe_globals == ()


def quantized() -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quantized tensors are deprecated in torch 2.13; checkpoints still hold them
        return torch.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.qint8)


@pytest.mark.parametrize("layout", ["zip", "legacy"])
def test_dtypes_safetensors_lacks_are_left_out_with_a_warning(layout: str) -> None:
    tensors = {
        "keep": torch.ones(2),
        "c128": torch.tensor([1 + 2j], dtype=torch.complex128),
        "q": quantized(),
        "conj": torch.tensor([1 + 2j], dtype=torch.complex64).conj(),  # its bytes are not its values
        "also": torch.zeros(1),
    }
    data = save(tensors, _use_new_zipfile_serialization=layout == "zip")
    checkpoint = read(data, "x.pt")
    assert names_of(checkpoint) == ["keep", "also"]
    assert [item.name for item in checkpoint.left_out] == ["c128", "q", "conj"]
    assert "complex128" in checkpoint.left_out[0].reason and "quantized" in checkpoint.left_out[1].reason
    assert checkpoint.warnings[0].startswith("x.pt: tensor 'c128' left out: ")


@pytest.mark.parametrize("layout", ["zip", "legacy"])
def test_tied_weights_views_transposes_scalars_and_empty_tensors(layout: str) -> None:
    base = torch.arange(60, dtype=torch.float32).reshape(5, 12)
    cube = torch.arange(24, dtype=torch.int16).reshape(2, 3, 4)
    tensors = {
        "embed": base,
        "lm_head": base,  # tied: one storage, two names
        "rows": base[1:3],  # a storage offset
        "tail": base.reshape(-1)[7:],
        "t": base.t(),
        "column": base[:, 2],
        "every_other": base[:, ::2],
        "permuted": cube.permute(2, 0, 1),
        "expanded": torch.arange(3.0).expand(4, 3),  # stride 0
        "narrow_t": base.t()[3:7, 1:4],
        "scalar": torch.tensor(3.5),
        "scalar_view": base[2, 5],
        "empty": torch.empty(0),
        "empty_2d": torch.empty(3, 0),
        "empty_view": base[:, 12:],
        "one": torch.ones(1, 1, 1),
    }
    data = save(tensors, _use_new_zipfile_serialization=layout == "zip")
    checkpoint = read(data)
    check_bytes(data, checkpoint, tensors)
    by_name = {t.name: t for t in checkpoint.tensors}
    assert by_name["embed"].storage == by_name["lm_head"].storage == by_name["t"].storage
    assert by_name["embed"].byte_range == by_name["lm_head"].byte_range
    assert by_name["rows"].offset == by_name["embed"].offset + 12 * 4
    assert by_name["scalar"].shape == () and by_name["scalar"].nbytes == 4
    assert by_name["expanded"].strides == (0, 1) and not by_name["expanded"].contiguous


def test_gather_any_part_of_a_strided_tensor() -> None:
    base = torch.arange(2 * 3 * 5 * 7, dtype=torch.float64).reshape(2, 3, 5, 7)
    tensors = {"p": base.permute(3, 1, 0, 2), "s": base[:, 1:, ::2, 3:], "t": base[1].transpose(0, 2)}
    data = save(tensors)
    reader = Counted(data)
    for tensor in read(data).tensors:
        whole = raw(tensors[tensor.name])
        for begin, end in [(0, 8), (3, 100), (8, 16), (40, len(whole)), (len(whole) - 5, len(whole) + 9), (17, 17)]:
            assert gathered(tensor, reader, begin, end) == whole[begin:end], (tensor.name, begin, end)


@pytest.mark.parametrize("layout", ["zip", "legacy"])
def test_pickle_protocols_3_to_5_read_the_same_tensors(layout: str) -> None:
    tensors = {"a": torch.randn(3, 4), "b": torch.randn(4).to(torch.bfloat16), "c": torch.randn(4, 3).t()}
    for protocol in (3, 4, 5):
        data = save(tensors, pickle_protocol=protocol, _use_new_zipfile_serialization=layout == "zip")
        assert pytorch.detect(data[:512]) == layout
        checkpoint = read(data)
        assert checkpoint.protocol == protocol
        check_bytes(data, checkpoint, tensors)
    # torch's own weights_only loader refuses protocol 4 (FRAME): stfs reads it, and says nothing is unsafe
    with pytest.raises(pickle.UnpicklingError), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.load(io.BytesIO(save(tensors, pickle_protocol=4)), weights_only=True)
    assert read(save(tensors, pickle_protocol=4)).unsafe_globals == ()


def test_parameters_and_nested_containers_are_named_by_their_path() -> None:
    layer = torch.nn.Linear(3, 2)
    nested = {
        "params": layer.state_dict(keep_vars=True),  # nn.Parameter: _rebuild_parameter
        "list": [torch.ones(1), (torch.zeros(2), {"deep": torch.full((2,), 3.0)})],
        "n": 3,
        7: torch.arange(2),
    }
    data = save(nested)
    checkpoint = read(data)
    expected = {
        "params.weight": layer.weight,
        "params.bias": layer.bias,
        "list.0": nested["list"][0],
        "list.1.0": nested["list"][1][0],
        "list.1.1.deep": nested["list"][1][1]["deep"],
        "7": nested[7],
    }
    check_bytes(data, checkpoint, expected)
    assert checkpoint.unsafe_globals == ()


def test_a_top_level_tensor_and_a_whole_module() -> None:
    data = save(torch.arange(4))
    assert names_of(read(data)) == [""]
    module = torch.nn.Sequential(torch.nn.Linear(2, 3))
    checkpoint = read(save(module))  # the pickled object graph, through BUILD states: nothing is run
    assert names_of(checkpoint) == ["_modules.0._parameters.weight", "_modules.0._parameters.bias"]
    assert "torch.nn.modules.container.Sequential" in checkpoint.unsafe_globals
    assert "torch.nn.modules.linear.Linear" in checkpoint.unsafe_globals


class HParams:
    """A class of the test's own, as a training script's hyper-parameters (Lightning's AttributeDict)."""

    def __init__(self) -> None:
        self.lr = 0.1
        self.layers = [4, 4]


class AttributeDict(dict):  # type: ignore[type-arg]
    pass


@pytest.mark.parametrize("layout", ["zip", "legacy"])
def test_a_lightning_style_checkpoint_takes_its_state_dict(layout: str) -> None:
    model = Tiny()
    optimizer = torch.optim.Adam(model.parameters())
    for param in model.parameters():
        param.grad = torch.ones_like(param)
    optimizer.step()
    hyper = AttributeDict(lr=0.1)
    ckpt = {
        "epoch": 3,
        "global_step": 30,
        "pytorch-lightning_version": "2.5.0",
        "state_dict": model.state_dict(),
        "optimizer_states": [optimizer.state_dict()],
        "hyper_parameters": hyper,
        "hparams_obj": HParams(),
    }
    data = save(ckpt, _use_new_zipfile_serialization=layout == "zip")
    checkpoint = read(data)
    assert checkpoint.model_key == "state_dict"
    check_bytes(data, checkpoint, dict(ckpt["state_dict"]))  # the optimizer's tensors are not the model's
    own = {f"{cls.__module__}.{cls.__qualname__}" for cls in (HParams, AttributeDict)}
    assert own <= set(checkpoint.unsafe_globals)
    # torch's weights_only loader refuses the same file for the same reason
    with pytest.raises(pickle.UnpicklingError, match="HParams|AttributeDict"):
        torch.load(io.BytesIO(data), weights_only=True)


def test_a_state_dict_member_without_tensors_is_not_the_model() -> None:
    data = save({"state_dict": {"note": "none here"}, "w": torch.ones(2)})
    checkpoint = read(data)
    assert checkpoint.model_key is None and names_of(checkpoint) == ["w"]


class Payload:
    """Unpickling this calls ``call(*args)``: the code a pickle runs."""

    def __init__(self, call: Callable[..., Any], *args: Any) -> None:
        self.call, self.args = call, args

    def __reduce__(self) -> tuple[Any, ...]:
        return self.call, self.args


@pytest.mark.parametrize("layout", ["zip", "legacy"])
def test_a_reduce_payload_never_runs(tmp_path: Path, layout: str) -> None:
    target = tmp_path / "pwned"
    payloads = {
        "open": Payload(open, str(target), "w"),
        "system": Payload(os.system, f"touch {target}"),
        "eval": Payload(eval, f"open({str(target)!r}, 'w')"),
        "exec": Payload(exec, f"open({str(target)!r}, 'w').close()"),
    }
    for name, payload in payloads.items():
        data = save({"w": torch.ones(2), "x": payload}, _use_new_zipfile_serialization=layout == "zip")
        checkpoint = read(data)
        assert names_of(checkpoint) == ["w"]
        assert checkpoint.unsafe_globals, name
        assert not target.exists(), f"the {name} payload ran"
    globals_named = {g for p in payloads.values() for g in read(save({"x": p})).unsafe_globals}
    assert {"io.open", "posix.system", "builtins.eval", "builtins.exec"} <= globals_named


def test_the_payload_is_real(tmp_path: Path) -> None:
    """An unrestricted torch.load (in a child) of the same kind of file creates its file."""
    control = tmp_path / "control"
    blob = tmp_path / "control.pt"
    torch.save({"x": Payload(open, str(control), "w")}, blob)
    script = f"import torch; torch.load({str(blob)!r}, weights_only=False)"
    subprocess.run([sys.executable, "-c", script], check=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert control.exists()


def test_torchscript_is_refused() -> None:
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.jit is deprecated in torch 2.13; its archives are still about
        torch.jit.save(torch.jit.script(torch.nn.Linear(2, 3)), buffer)
    with pytest.raises(pytorch_rules.TorchScriptArchive, match="TorchScript"):
        read(buffer.getvalue())


def test_the_tar_format_of_torch_0x_is_refused_with_advice() -> None:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as archive:
        for name in ("sys_info", "pickle", "storages", "tensors"):
            info = tarfile.TarInfo(name)
            info.size = 4
            archive.addfile(info, io.BytesIO(b"\x80\x02N."))
    with pytest.raises(pytorch_rules.LegacyTarCheckpoint, match="re-save it with a current torch"):
        read(buffer.getvalue(), "old.pt")


def test_other_files_are_not_checkpoints() -> None:
    for data in (b"", b"hello", ck.write_zip([("a/readme.txt", b"hi")]), pickle.dumps({"a": 1}, protocol=2)):
        with pytest.raises(pytorch_rules.NotACheckpoint):
            read(data)


# -- the zip layout, by hand ---------------------------------------------------------------------------------------

ONE_TENSOR = ck.state_dict_pickle([("w", ck.p_tensor("0", 4, 0, (2, 2), (2, 1)))])
FOUR_FLOATS = struct.pack("<4f", 1, 2, 3, 4)


@pytest.mark.parametrize("options", [{}, {"zip64": True}, {"align": 0}, {"comment": b"a comment" * 100}])
def test_hand_made_zips_as_other_writers_make_them(options: dict[str, Any]) -> None:
    data = ck.checkpoint_zip(ONE_TENSOR, {"0": FOUR_FLOATS}, **options)
    assert torch.load(io.BytesIO(data), weights_only=True)["w"].tolist() == [[1, 2], [3, 4]]  # torch takes it too
    tensor = read(data).tensors[0]
    assert data[tensor.offset : tensor.offset + tensor.nbytes] == FOUR_FLOATS


def test_python_zipfile_rewrites_read_the_same() -> None:
    tensors = {"a": torch.randn(3, 3), "b": torch.randn(3, 3).t()}
    data = save(tensors)
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(data)) as source, zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as target:
        target.writestr("archive/", b"")  # a folder entry, as other zip writers make
        for info in source.infolist():
            target.writestr(info.filename, source.read(info))
    check_bytes(out.getvalue(), read(out.getvalue()), tensors)


@pytest.mark.parametrize(
    ("mutation", "error", "match"),
    [
        ({"byteorder": b"big"}, pytorch_rules.BigEndianCheckpoint, "big"),
        ({"deflate": ["archive/data/0"]}, pytorch_rules.CompressedEntry, "data/0"),
        ({"deflate": ["archive/data.pkl"]}, pytorch_rules.CompressedEntry, "data.pkl"),
        ({"extra": [("other/x", b"")]}, pytorch_rules.EntryOutsideArchive, "other/x"),
        ({"extra": [("archive/../x", b"")]}, pytorch_rules.EntryOutsideArchive, r"\.\./x"),
        ({"extra": [("archive/constants.pkl", b"")]}, pytorch_rules.TorchScriptArchive, "TorchScript"),
        ({"extra": [("archive/code/m.py", b"")]}, pytorch_rules.TorchScriptArchive, "TorchScript"),
        ({"extra": [("archive/data/0", b"")]}, pytorch_rules.InvalidZipArchive, "twice"),
        ({"storages": {}}, pytorch_rules.InvalidStorage, "no entry archive/data/0"),
        ({"storages": {"0": FOUR_FLOATS[:12]}}, pytorch_rules.InvalidStorage, "12 bytes"),
    ],
)
def test_zip_refusals(mutation: dict[str, Any], error: type[pytorch_rules.PytorchError], match: str) -> None:
    storages = mutation.pop("storages", {"0": FOUR_FLOATS})
    data = ck.checkpoint_zip(ONE_TENSOR, storages, **mutation)
    with pytest.raises(error, match=match) as caught:
        read(data, "m.bin")
    assert str(caught.value).startswith("m.bin: ") and "\n" not in str(caught.value)


def test_a_storage_entry_marked_a_directory_is_refused() -> None:
    """The fuzzer's find: a central directory entry whose external attributes carry MS-DOS's directory bit. torch's
    reader takes it for a folder, reads none of its bytes and loads the storage's uninitialised memory; stfs
    refuses the file rather than serve what torch would not."""
    data = bytearray(save({"w": torch.arange(5, dtype=torch.int64)}))
    entry = bytes(data).rindex(b"PK\x01\x02", 0, bytes(data).rindex(b"archive/data/0"))
    assert bytes(data[entry + 46 : entry + 46 + 14]) == b"archive/data/0"
    struct.pack_into("<L", data, entry + 38, 0x10)  # external attributes
    with pytest.raises(pytorch_rules.InvalidZipArchive, match="'archive/data/0' is marked a directory") as caught:
        read(bytes(data), "m.bin")
    assert str(caught.value).startswith("m.bin: ") and "\n" not in str(caught.value)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = torch.load(io.BytesIO(bytes(data)), weights_only=True)
    assert loaded["w"].shape == (5,)  # torch loads it, with bytes that are not the file's


def test_no_byteorder_record_means_little_endian() -> None:
    data = ck.checkpoint_zip(ONE_TENSOR, {"0": FOUR_FLOATS}, byteorder=None)
    assert names_of(read(data)) == ["w"]


def test_broken_zip_structures_are_refused() -> None:
    good = ck.checkpoint_zip(ONE_TENSOR, {"0": FOUR_FLOATS}, zip64=True)
    eocd = good.rfind(b"PK\x05\x06")
    locator = good.rfind(b"PK\x06\x07")
    central = good.find(b"PK\x01\x02")
    cases = {
        "no end record": good[:eocd],
        "a comment length that does not end the file": good[: eocd + 20] + b"\x05\x00",
        "a locator pointing nowhere": good[: locator + 8] + struct.pack("<Q", 3) + good[locator + 16 :],
        "a central entry without its signature": good[:central] + b"XX" + good[central + 2 :],
        "a local header that is not one": b"QQ" + good[2:],
    }
    for name, data in cases.items():
        with pytest.raises(pytorch_rules.PytorchError):
            read(data)
        assert name


def test_a_tensor_outside_its_storage_is_refused_by_name() -> None:
    cases = [
        ck.p_tensor("0", 4, 1, (2, 2), (2, 1)),  # offset 1: the last element is the fifth
        ck.p_tensor("0", 4, 0, (2, 3), (2, 1)),
        ck.p_tensor("0", 4, 0, (3, 2), (1, 2)),  # strided past the end
        ck.p_tensor("0", 4, 0, (2,), (4,)),
    ]
    for case in cases:
        data = ck.checkpoint_zip(ck.state_dict_pickle([("bad", case)]), {"0": FOUR_FLOATS})
        with pytest.raises(pytorch_rules.TensorOutOfStorage, match="tensor 'bad'"):
            read(data)
    # an empty tensor needs no bytes, wherever its offset points
    empty = ck.checkpoint_zip(ck.state_dict_pickle([("e", ck.p_tensor("0", 4, 9, (0, 5), (5, 1)))]), {"0": FOUR_FLOATS})
    assert read(empty).tensors[0].nbytes == 0


def test_malformed_tensor_descriptions_are_refused() -> None:
    cases = [
        ck.p_tensor("0", 4, 0, (2, 2), (1,)),  # strides of another length
        ck.p_global("torch._utils", "_rebuild_tensor_v2") + ck.p_tuple(ck.p_int(1), ck.p_int(0)) + b"R",
    ]
    for case in cases:
        data = ck.checkpoint_zip(ck.state_dict_pickle([("bad", case)]), {"0": FOUR_FLOATS})
        with pytest.raises((pytorch_rules.InvalidTensorArgs, pytorch_rules.InvalidPickle)):
            read(data)


# -- the legacy layout -----------------------------------------------------------------------------------------


def test_legacy_storages_follow_from_the_pickles() -> None:
    tensors = {"a": torch.randn(3, 2), "b": torch.arange(5), "a_t": None}
    tensors["a_t"] = tensors["a"].t()
    data = save(tensors, _use_new_zipfile_serialization=False)
    reader = Counted(data)
    checkpoint = pytorch.read_checkpoint(reader, len(data))
    assert checkpoint.layout == "legacy"
    check_bytes(data, checkpoint, tensors)  # type: ignore[arg-type]
    # the counts before each storage are checked against the pickle: a wrong one is refused
    storage = min(t.storage_start for t in checkpoint.tensors) - 8
    (count,) = struct.unpack_from("<q", data, storage)
    bad = data[:storage] + struct.pack("<q", count + 1) + data[storage + 8 :]
    with pytest.raises(pytorch_rules.InvalidStorage, match="elements"):
        read(bad)
    with pytest.raises(pytorch_rules.CheckpointTruncated):
        read(data[:-1])
    little = b"little_endianq\x02\x88"  # NEWTRUE in sys_info
    assert data.count(little) == 1
    with pytest.raises(pytorch_rules.BigEndianCheckpoint):
        read(data.replace(little, b"little_endianq\x02\x89"))


def test_a_legacy_file_as_python_2_torch_wrote_it() -> None:
    """Python 2 strings (SHORT_BINSTRING), 6-member persistent ids, a CUDA storage class and location, a storage
    view (0.4's view metadata), _rebuild_tensor (v1) and _rebuild_tensor_v2: as torch's own loader reads them."""

    def pid(key: str, storage: str, numel: int, view: bytes = b"N") -> bytes:
        return (
            ck.p_tuple(
                ck.p_binstring("storage"),
                ck.p_global("torch.cuda", storage),
                ck.p_binstring(key),
                ck.p_binstring("cuda:0"),
                ck.p_int(numel),
                view,
            )
            + b"Q"
        )

    def rebuild(
        function: str, storage_pid: bytes, offset: int, shape: tuple[int, ...], strides: tuple[int, ...]
    ) -> bytes:
        args = [storage_pid, ck.p_int(offset), ck.p_tuple(*map(ck.p_int, shape)), ck.p_tuple(*map(ck.p_int, strides))]
        if function == "_rebuild_tensor_v2":
            args += [b"\x89", ck.p_global("collections", "OrderedDict") + b")R"]
        return ck.p_global("torch._utils", function) + ck.p_tuple(*args) + b"R"

    floats = struct.pack("<6f", *range(6))
    longs = struct.pack("<3q", 7, 8, 9)
    view = ck.p_tuple(ck.p_binstring("140001"), ck.p_int(2), ck.p_int(4))  # elements 2..5 of the root
    body = ck.p_dict(
        [
            (ck.p_binstring("w"), rebuild("_rebuild_tensor_v2", pid("140000", "FloatStorage", 6), 0, (2, 3), (3, 1))),
            (ck.p_binstring("wt"), rebuild("_rebuild_tensor_v2", pid("140000", "FloatStorage", 6), 0, (3, 2), (1, 3))),
            (ck.p_binstring("v"), rebuild("_rebuild_tensor", pid("140000", "FloatStorage", 6, view), 1, (2,), (1,))),
            (ck.p_binstring("i"), rebuild("_rebuild_tensor_v2", pid("140002", "LongStorage", 3), 1, (2,), (1,))),
        ]
    )
    data = ck.legacy_file(ck.PROTO2 + body + ck.STOP, [("140000", 6, floats), ("140002", 3, longs)])
    checkpoint = read(data)
    assert checkpoint.layout == "legacy"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    assert expected["v"].tolist() == [3.0, 4.0]  # torch reads the view as we do: elements 1.. of elements 2..5
    check_bytes(data, checkpoint, expected)
    with pytest.raises(pytorch_rules.BigEndianCheckpoint):
        read(ck.legacy_file(ck.PROTO2 + body + ck.STOP, [("140000", 6, floats)], little_endian=False))
    with pytest.raises(pytorch_rules.InvalidStorage, match="140002"):  # a storage the keys do not list
        read(ck.legacy_file(ck.PROTO2 + body + ck.STOP, [("140000", 6, floats)]))


def test_legacy_reads_are_the_pickles_and_the_counts() -> None:
    tensors = {f"w{i}": torch.randn(256, 256) for i in range(8)}  # 256 KiB each
    data = save(tensors, _use_new_zipfile_serialization=False)
    reader = Counted(data)
    pytorch.read_checkpoint(reader, len(data))
    assert reader.bytes < 100_000 and reader.bytes < len(data) // 10


# -- reading by range: the directory and the pickle, never the data ---------------------------------------------


def test_a_64_mib_checkpoint_costs_under_1_mib_of_reads() -> None:
    state = {}
    for layer in range(30):  # 30 x (2 MiB + 4 KiB + ...) ~ 64 MiB
        state[f"model.layers.{layer}.mlp.weight"] = torch.zeros(512, 1024)
        state[f"model.layers.{layer}.mlp.bias"] = torch.zeros(1024)
        state[f"model.layers.{layer}.norm.weight"] = torch.ones(512)
    state["lm_head.weight"] = torch.zeros(1024, 2048)
    data = save(state)
    assert len(data) > 64 * MIB
    reader = Counted(data)
    checkpoint = pytorch.read_checkpoint(reader, len(data))
    assert len(checkpoint.tensors) == len(state)
    assert reader.bytes <= MIB, reader.bytes
    # and no read reaches into a large storage's bytes
    for tensor in checkpoint.tensors:
        if tensor.storage_size > 64 << 10:
            start, end = tensor.storage_start + COALESCE_GAP, tensor.storage_start + tensor.storage_size
            assert all(o + n <= start or o >= end for o, n in reader.ranges), tensor.name


def test_a_zip_costs_four_reads_and_a_legacy_file_two() -> None:
    """Past the head: the end records (the ZIP64 ones with them), the central directory, data.pkl with byteorder,
    the storages' local headers (one read here: they lie close); a legacy file's pickles (one window), then its
    counts (one read here)."""
    tensors = {f"w{i}": torch.ones(8) for i in range(5)}
    for layout, calls in (("zip", 4), ("legacy", 2)):
        data = save(tensors, _use_new_zipfile_serialization=layout == "zip")
        reader = Counted(data)
        pytorch.read_checkpoint(reader, len(data), head=data[:512])
        assert reader.calls == calls, (layout, reader.ranges)


@pytest.mark.parametrize("layout", ["zip", "legacy"])
def test_read_many_is_asked_for_every_storage_at_once(layout: str) -> None:
    """What a remote source can fetch concurrently: all the storages' local headers (or counts) in one call."""
    state = {f"w{i}": torch.zeros(64, 1024) for i in range(40)}  # 256 KiB apart: no two ranges coalesce
    data = save(state, _use_new_zipfile_serialization=layout == "zip")
    batches: list[int] = []

    def read_many(ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        batches.append(len(ranges))
        return [data[offset : offset + size] for offset, size in ranges]

    plain = pytorch.read_checkpoint(Counted(data), len(data))
    batched = pytorch.read_checkpoint(Counted(data), len(data), read_many=read_many)
    assert batched == plain
    assert max(batches) == 40


def test_a_given_head_saves_a_read() -> None:
    data = save({"w": torch.ones(3)})
    first, second = Counted(data), Counted(data)
    pytorch.read_checkpoint(first, len(data))
    pytorch.read_checkpoint(second, len(data), head=data[:4096])
    assert second.calls == first.calls - 1


def test_short_reads_are_a_truncated_file() -> None:
    data = save({"w": torch.ones(300)})
    with pytest.raises(pytorch_rules.CheckpointTruncated):
        pytorch.read_checkpoint(lambda o, n: data[o : o + n], len(data) + 100)


# -- the equivalent safetensors file -----------------------------------------------------------------------------


def safetensors_bytes(data: bytes, checkpoint: pytorch.Checkpoint) -> bytes:
    """The safetensors file as --view safetensors will serve it: the header, then each tensor's bytes."""
    made = pytorch.safetensors_file(checkpoint.tensors)
    out = bytearray(made.header)
    for tensor, offset in made.placements:
        assert offset == len(out)
        out += gathered(tensor, Counted(data))
    assert len(out) == made.size
    return bytes(out)


@pytest.mark.parametrize("layout", ["zip", "legacy"])
def test_the_safetensors_file_loads_in_safetensors(layout: str) -> None:
    tensors = {name: random_tensor(dtype, (4, 3), seed=i) for i, (name, dtype) in enumerate(SAFETENSORS_DTYPES.items())}
    del tensors["F8_E8M0"]  # safetensors.torch has no F8_E8M0 (its bytes are checked above)
    tensors["tied"] = tensors["F32"]
    tensors["transposed"] = tensors["BF16"].t()
    tensors["scalar"] = torch.tensor(1.5)
    tensors["empty"] = torch.empty(0, 2)
    tensors["odd.name/with é"] = torch.ones(1, dtype=torch.float16)
    data = save(tensors, _use_new_zipfile_serialization=layout == "zip")
    blob = safetensors_bytes(data, read(data))
    loaded = safetensors_load(blob)
    assert list(loaded) == sorted(tensors) or set(loaded) == set(tensors)
    for name, tensor in tensors.items():
        assert loaded[name].dtype == tensor.dtype and loaded[name].shape == tensor.shape
        assert raw(loaded[name]) == raw(tensor), name
    (length,) = struct.unpack_from("<Q", blob)
    header = blob[8 : 8 + length]
    assert length % 8 == 0 and header.rstrip(b" ").endswith(b"}")
    assert header.startswith(b'{"__metadata__":{"format":"pt"},"F64":')  # the checkpoint's order


def test_the_header_is_the_safetensors_writers_byte_for_byte() -> None:
    tensors = {"a.weight": torch.randn(3, 4), "b": torch.randn(5), "c.d": torch.randn(2, 2, 2).transpose(0, 2)}
    data = save(tensors)  # names sorted, one dtype: the order safetensors' writer chooses too
    packed = {name: tensor.contiguous() for name, tensor in tensors.items()}
    assert safetensors_bytes(data, read(data)) == safetensors_save(packed, metadata={"format": "pt"})


def test_tied_weights_appear_twice_in_the_safetensors_file() -> None:
    weight = torch.randn(4, 4)
    data = save({"embed": weight, "head": weight})
    made = pytorch.safetensors_file(read(data).tensors)
    (first, a), (second, b) = made.placements
    assert first.byte_range == second.byte_range and b == a + 64 and made.size == len(made.header) + 128


# -- the tables, held to the installed torch -----------------------------------------------------------------------


def test_the_allow_list_is_torchs() -> None:
    from torch import _utils
    from torch._weights_only_unpickler import _get_allowed_globals, _tensor_rebuild_functions

    assert set(_get_allowed_globals()) == pytorch.WEIGHTS_ONLY_GLOBALS
    assert {f"torch._utils.{f.__name__}" for f in _tensor_rebuild_functions()} <= pytorch.WEIGHTS_ONLY_GLOBALS
    assert dict(pytorch.IMPORT_MAPPING) == _utils.IMPORT_MAPPING
    assert dict(pytorch.NAME_MAPPING) == _utils.NAME_MAPPING


def test_the_dtype_tables_are_torchs() -> None:
    from safetensors.torch import _TYPES

    for name, (safetensors_name, itemsize) in pytorch.TORCH_DTYPES.items():
        dtype = getattr(torch, name)
        assert dtype.itemsize == itemsize, name
        if safetensors_name is not None and safetensors_name in _TYPES:
            assert _TYPES[safetensors_name] == dtype
    assert {v for k, v in _TYPES.items()} <= {getattr(torch, n) for n, (s, _) in pytorch.TORCH_DTYPES.items() if s}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TypedStorage is deprecated; checkpoints name its classes all the same
        for storage, dtype_name in pytorch.STORAGE_DTYPES.items():
            if storage != "UntypedStorage":
                assert getattr(torch, storage).dtype == getattr(torch, dtype_name), storage


def test_format_detection() -> None:
    assert pytorch.detect(save({"w": torch.ones(1)})[:512]) == "zip"
    assert pytorch.detect(save({"w": torch.ones(1)}, _use_new_zipfile_serialization=False)[:512]) == "legacy"
    assert pytorch.detect(pickle.dumps({"a": 1}, protocol=2)) is None
    assert pytorch.detect(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ") is None


# -- hostile input ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "error"),
    [
        ("billion laughs (40 levels of 10)", pytorch_rules.PickleLimitExceeded),
        ("billion laughs of strings", pytorch_rules.PickleLimitExceeded),
        ("100,000-deep lists", pytorch_rules.PickleTooDeep),
        ("100,000-deep tuples", pytorch_rules.PickleTooDeep),
        ("100,000-deep dicts", pytorch_rules.PickleTooDeep),
        ("100,000 open marks", pytorch_rules.PickleTooDeep),
        ("a string of 2^62 bytes", pytorch_rules.PickleStringTooLong),
        ("bytes of 2^64-1 bytes", pytorch_rules.PickleStringTooLong),
        ("a 2^31-byte integer", pytorch_rules.PickleStringTooLong),
        ("a 1 MiB GLOBAL line", pytorch_rules.PickleStringTooLong),
    ],
)
def test_hostile_pickles_are_refused_within_400_mib_and_20_s_of_cpu(
    tmp_path: Path, name: str, error: type[errors.StfsError]
) -> None:
    path = tmp_path / "hostile.pt"
    path.write_bytes(ck.hostile_checkpoint(name))
    result = ck.read_bounded(str(path), memory=400 << 20, seconds=20)  # the kernel holds the child to both
    assert result.outcome == f"refused {error.__name__}", (result.outcome, result.message)
    assert result.max_rss < 400 << 20


@pytest.mark.parametrize("name", ["2,000,010 opcodes", "1,000,010 memo entries"])
def test_the_opcode_and_memo_bounds(name: str) -> None:
    data = ck.hostile_checkpoint(name)
    with pytest.raises(pytorch_rules.PickleLimitExceeded):
        read(data)


def test_cycles_deep_keys_and_self_references_end() -> None:
    cycle = (
        ck.PROTO2 + b"}q\x00" + ck.p_str("me") + b"h\x00s" + ck.p_str("w") + ck.p_tensor("0", 4, 0, (4,), (1,)) + b"s."
    )
    key = ck.deep_nesting(100_000, "key")
    recursive_rebuild = (
        ck.PROTO2
        + ck.p_dict(
            [
                (
                    ck.p_str("w"),
                    ck.p_global("torch._tensor", "_rebuild_from_type_v2")
                    + b"q\x00"
                    + ck.p_tuple(b"h\x00", ck.p_global("torch", "Tensor"), b")", b"N")
                    + b"R",
                )
            ]
        )
        + b"."
    )
    for pickle_bytes in (cycle, key, recursive_rebuild):
        data = ck.checkpoint_zip(pickle_bytes, {"0": FOUR_FLOATS})
        try:
            checkpoint = read(data)
        except pytorch_rules.PytorchError:
            continue
        assert names_of(checkpoint) in ([], ["w"])


def test_nothing_is_imported_or_called() -> None:
    """The reader's module never imports torch and resolves no name: read a checkpoint naming modules that do not
    exist and ones that would run code, in a child, then look at what it imported."""
    payload = (
        ck.PROTO2
        + ck.p_dict(
            [
                (ck.p_str("a"), ck.p_global("no_such_module_xyz", "f") + b")R"),
                (ck.p_str("b"), ck.p_global("os", "system") + ck.p_tuple(ck.p_str("exit 3")) + b"R"),
                (ck.p_str("c"), b"\x8c\x08builtins\x8c\x04eval\x93" + ck.p_tuple(ck.p_str("1/0")) + b"R"),
                (ck.p_str("d"), ck.p_global("subprocess", "Popen") + b")\x81" + ck.p_dict([]) + b"b"),
            ]
        )
        + b"."
    )
    data = ck.checkpoint_zip(payload, {})
    script = (
        "import sys; from stfs.formats import pytorch\n"
        "data = sys.stdin.buffer.read()\n"
        "c = pytorch.read_checkpoint(lambda o, n: data[o:o + n], len(data))\n"
        "print(sorted(c.unsafe_globals)); print('torch' in sys.modules, 'no_such_module_xyz' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script],
        input=data,
        capture_output=True,
        check=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    ).stdout.decode()
    assert out.splitlines() == [
        "['builtins.eval', 'no_such_module_xyz.f', 'os.system', 'subprocess.Popen']",
        "False False",
    ]


# -- fuzzing ---------------------------------------------------------------------------------------------------


def test_a_bounded_fuzz_run_finds_nothing() -> None:
    command = [sys.executable, str(REPO / "fuzz" / "fuzz_pickle.py"), "--seed", "7", "--inputs", "1500"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=110, cwd=REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout)
    assert report["failures"] == {}
    assert report["verdicts"]["accepted"] > 50 and len(report["verdicts"]) > 5
