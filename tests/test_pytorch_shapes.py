"""The arguments each callable SPEC §12 understands really accepts, each shape read as torch.load(weights_only=True)
reads the same file: ``collections.OrderedDict`` (lists or tuples of pairs, a dict, nothing then SETITEMS, a BUILD
state, NEWOBJ), ``_rebuild_tensor``/``_v2``/``_v3`` and ``torch.Size``, ``_rebuild_parameter`` (and ``_with_state``,
``torch.nn.Parameter``), the storage classes and dtypes. Files are written by torch.save (an object whose
``__reduce__`` returns the shape; both layouts, protocol 2, as torch 1.x wrote them), or by hand with the opcodes
torch's loader reads where torch.save cannot write the shape. Names, dtypes, shapes and bytes must be torch's."""

from __future__ import annotations

import collections
import io
import struct
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from stfs.formats import pytorch
from stfs.formats.pytorch import rules as pytorch_rules
from tests import checkpoints as fz
from tests.test_pytorch_format import SAFETENSORS_DTYPES, random_tensor

LAYOUTS = ["zip", "legacy"]


class Reduced:
    """Pickled as ``func(*args)``, then BUILD ``state`` and SETITEMS ``items`` where given: the shape under test."""

    def __init__(self, func: Any, args: Any, state: Any = None, items: list[tuple[Any, Any]] | None = None) -> None:
        self.func, self.args, self.state, self.items = func, args, state, items

    def __reduce__(self) -> tuple[Any, ...]:
        return (self.func, self.args, self.state, None, None if self.items is None else iter(self.items))


def save(obj: Any, layout: str) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer, _use_new_zipfile_serialization=layout == "zip", pickle_protocol=2)
    return buffer.getvalue()


def torch_loads(data: bytes) -> list[tuple[str, torch.Tensor]]:
    """The tensors torch.load(weights_only=True) gives, named by their path of keys (dict keys, list positions)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        top = torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")

    def walk(value: Any, prefix: str | None) -> list[tuple[str, torch.Tensor]]:
        if isinstance(value, torch.Tensor):
            return [(prefix or "", value)]
        items = (
            value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list | tuple) else []
        )
        return [pair for key, item in items for pair in walk(item, str(key) if prefix is None else f"{prefix}.{key}")]

    return walk(top, None)


def raw(tensor: torch.Tensor) -> bytes:
    plain = torch.empty(tensor.shape, dtype=tensor.dtype).copy_(tensor.detach())
    return plain.reshape(-1).view(torch.uint8).numpy().tobytes() if plain.numel() else b""


def read(data: bytes) -> pytorch.Checkpoint:
    return pytorch.read_checkpoint(lambda offset, size: data[offset : offset + size], len(data), path="shape.pt")


def as_torch_loads(data: bytes, expected: list[tuple[str, torch.Tensor]] | None = None) -> pytorch.Checkpoint:
    """Read ``data``; assert its tensors are torch.load's (or ``expected``): the same names in the same order,
    dtypes, shapes, bytes."""
    checkpoint = read(data)
    expected = torch_loads(data) if expected is None else expected
    assert [t.name for t in checkpoint.tensors] == [name for name, _ in expected]
    for tensor, (name, want) in zip(checkpoint.tensors, expected, strict=True):
        assert tensor.dtype == pytorch.TORCH_DTYPES[str(want.dtype).removeprefix("torch.")][0], name
        assert tensor.shape == tuple(want.shape), name
        served = bytearray(tensor.nbytes)
        pytorch.gather_into(tensor, lambda offset, size: data[offset : offset + size], 0, memoryview(served))
        assert bytes(served) == raw(want), name
    return checkpoint


def tensors() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(38)
    base = torch.randn(3, 4, generator=generator)
    return base, torch.randn(5, generator=generator).to(torch.bfloat16), base.t()  # the last a view of the first


# -- collections.OrderedDict -------------------------------------------------------------------------------------

OD = collections.OrderedDict


def _ordered_dicts() -> dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor], Any]]:
    return {
        # lpips 0.1.4's weights: pairs as two-element lists, the module's _metadata as BUILD state
        "lists of pairs, _metadata as BUILD state": lambda a, b, c: Reduced(
            OD, ([["x.weight", a], ["x.bias", b], ["y", c]],), {"_metadata": OD([["", {"version": 1}]])}
        ),
        "a list of tuples": lambda a, b, c: Reduced(OD, ([("x.weight", a), ("x.bias", b), ("y", c)],)),
        "a tuple of tuples": lambda a, b, c: Reduced(OD, ((("x.weight", a), ("x.bias", b), ("y", c)),)),
        "an empty list, then SETITEMS": lambda a, b, c: Reduced(OD, ([],), None, [("x", a), ("y", b), ("z", c)]),
        "pairs, then SETITEMS": lambda a, b, c: Reduced(OD, ([["x", a]],), None, [("y", b), ("z", c)]),
        "nothing, then SETITEMS": lambda a, b, c: Reduced(OD, (), None, [("x", a), ("y", b), ("z", c)]),
        "a dict": lambda a, b, c: Reduced(OD, ({"x": a, "y": b, "z": c},)),
        "an OrderedDict of pairs": lambda a, b, c: Reduced(OD, (Reduced(OD, ([["x", a], ["y", b], ["z", c]],)),)),
        "a key twice: its first place, its last value": lambda a, b, c: Reduced(OD, ([["x", a], ["y", b], ["x", c]],)),
        "a two-character string as a pair": lambda a, b, c: Reduced(OD, (["kv", ["x", a], ("y", b), ["z", c]],)),
        "a tensor in the BUILD state: an attribute": lambda a, b, c: Reduced(OD, ([["x", a], ["y", b]],), {"z": c}),
        "inside a dict, inside a list": lambda a, b, c: {"model": [Reduced(OD, ([["x", a], ["y", b], ["z", c]],))]},
    }


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("shape", list(_ordered_dicts()))
def test_an_ordered_dicts_arguments_name_tensors_as_torch_does(shape: str, layout: str) -> None:
    checkpoint = as_torch_loads(save(_ordered_dicts()[shape](*tensors()), layout))
    assert checkpoint.tensors and all(not t.name.startswith("0.") for t in checkpoint.tensors)
    assert checkpoint.unsafe_globals == ()


STORAGES = {"0": struct.pack("<4f", 1, 2, 3, 4), "1": struct.pack("<4f", 5, 6, 7, 8)}
OD_GLOBAL = fz.p_global("collections", "OrderedDict")
PARAMETER = fz.p_global("torch.nn.parameter", "Parameter")


def p_tensor(key: str, shape: tuple[int, ...] | bytes, strides: tuple[int, ...], layout: str = "zip") -> bytes:
    """``_rebuild_tensor_v2`` of the 4 floats of storage ``key``, its persistent id as ``layout`` writes it (the
    older layout's has a sixth member, a view: None); ``shape`` a tuple, or pickled already."""
    pid = [fz.p_str("storage"), fz.p_global("torch", "FloatStorage"), fz.p_str(key), fz.p_str("cpu"), fz.p_int(4)]
    args = [fz.p_tuple(*pid, *([b"N"] if layout == "legacy" else [])) + b"Q", fz.p_int(0)]
    pickled_shape = shape if isinstance(shape, bytes) else fz.p_tuple(*map(fz.p_int, shape))
    args += [pickled_shape, fz.p_tuple(*map(fz.p_int, strides)), b"\x89", OD_GLOBAL + b")R"]
    return fz.p_global("torch._utils", "_rebuild_tensor_v2") + fz.p_tuple(*args) + b"R"


Body = Callable[[bytes, bytes], bytes]  # the pickle of a shape, given the pickles of two tensors


def by_hand(body: Body, layout: str) -> bytes:
    """A checkpoint in ``layout`` whose pickle is ``body`` of two tensors, on storages "0" (4,) and "1" (2, 2)."""
    pickled = fz.PROTO2 + body(p_tensor("0", (4,), (1,), layout), p_tensor("1", (2, 2), (2, 1), layout)) + fz.STOP
    if layout == "zip":
        return fz.checkpoint_zip(pickled, STORAGES)
    return fz.legacy_file(pickled, [(key, 4, data) for key, data in STORAGES.items() if fz.p_str(key) in pickled])


def pairs(*items: tuple[str, bytes]) -> bytes:
    return b"](" + b"".join(b"](" + fz.p_str(key) + value + b"e" for key, value in items) + b"e"


def top(*items: tuple[str, bytes]) -> bytes:
    return fz.p_dict([(fz.p_str(key), value) for key, value in items])


BY_HAND: dict[str, Body] = {
    "NEWOBJ of pairs: __new__ ignores them, empty": lambda t0, t1: top(
        ("dropped", OD_GLOBAL + fz.p_tuple(pairs(("x", t0))) + b"\x81"), ("kept", t1)
    ),
    "NEWOBJ of nothing, then SETITEMS": lambda t0, t1: top(
        ("m", OD_GLOBAL + b")\x81(" + fz.p_str("x") + t0 + fz.p_str("y") + t1 + b"u")
    ),
    "REDUCE with a list of arguments": lambda t0, t1: top(
        ("m", OD_GLOBAL + b"](" + pairs(("x", t0), ("y", t1)) + b"eR")
    ),
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("shape", list(BY_HAND))
def test_ordered_dicts_torch_save_cannot_write(shape: str, layout: str) -> None:
    as_torch_loads(by_hand(BY_HAND[shape], layout))


def test_ordered_dicts_torch_refuses_stay_opaque_calls_named_by_position() -> None:
    """Two arguments, a pair of three: torch.load raises; stfs walks the call's arguments as any opaque call's."""
    bodies: list[Body] = [
        lambda t0, t1: top(("m", OD_GLOBAL + fz.p_tuple(pairs(("x", t0)), b"]") + b"R")),
        lambda t0, t1: top(("m", OD_GLOBAL + fz.p_tuple(b"](](" + fz.p_str("x") + t0 + fz.p_str("y") + b"ee") + b"R")),
    ]
    for body in bodies:
        data = by_hand(body, "zip")
        with pytest.raises(Exception, match="expected at most 1 argument|too many values to unpack"):
            torch_loads(data)
        assert [t.name for t in read(data).tensors] == ["m.0.0.1"]


# -- parameters -------------------------------------------------------------------------------------------------


def _parameters() -> dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor], Any]]:
    def with_attribute(tensor: torch.Tensor) -> torch.nn.Parameter:
        parameter = torch.nn.Parameter(tensor.clone(), requires_grad=False)
        parameter.note = "kept"  # type: ignore[attr-defined]  # torch.save: _rebuild_parameter_with_state
        return parameter

    rebuild = torch._utils._rebuild_parameter
    with_state = torch._utils._rebuild_parameter_with_state
    return {
        "torch.save's Parameters (_rebuild_parameter, hooks an OrderedDict)": lambda a, b, c: {
            "p": torch.nn.Parameter(a),
            "q": torch.nn.Parameter(b.float(), requires_grad=False),
        },
        "_rebuild_parameter_with_state, an attribute in its state": lambda a, b, c: {"p": with_attribute(a)},
        "_rebuild_parameter, hooks None": lambda a, b, c: {"p": Reduced(rebuild, (a, True, None))},
        "_rebuild_parameter_with_state, data in its state": lambda a, b, c: {
            "p": Reduced(with_state, (a, False, OD(), {"data": c}))
        },
        "_rebuild_parameter_with_state, data in its slots": lambda a, b, c: {
            "p": Reduced(with_state, (a, False, OD(), (None, {"data": b})))
        },
        "torch.nn.Parameter(data)": lambda a, b, c: {"p": Reduced(torch.nn.Parameter, (a,))},
        "torch.nn.Parameter(data, requires_grad)": lambda a, b, c: {"p": Reduced(torch.nn.Parameter, (c, False))},
    }


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("shape", list(_parameters()))
def test_parameters_as_torch_loads_them(shape: str, layout: str) -> None:
    checkpoint = as_torch_loads(save(_parameters()[shape](*tensors()), layout))
    assert [t.name for t in checkpoint.tensors] == (["p", "q"] if "save's" in shape else ["p"])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_newobj_parameters_and_their_flags_as_build_state(layout: str) -> None:
    flags = fz.p_tuple(b"\x89", b"N", OD_GLOBAL + b")R")  # Parameter.__setstate__'s (requires_grad, _, hooks)

    def body(t0: bytes, t1: bytes) -> bytes:
        return top(
            ("p", PARAMETER + fz.p_tuple(t0, b"\x89") + b"\x81"),
            ("q", PARAMETER + fz.p_tuple(t1) + b"\x81" + flags + b"b"),
        )

    assert [t.name for t in as_torch_loads(by_hand(body, layout)).tensors] == ["p", "q"]


def test_a_parameter_without_data_is_left_out_with_a_warning() -> None:
    """torch makes it an empty float32 tensor of no storage; stfs names it among the tensors left out."""
    for made in (b")R", b")\x81"):  # REDUCE, NEWOBJ
        data = by_hand(lambda t0, t1, made=made: top(("p", PARAMETER + made), ("q", t1)), "zip")
        assert [(name, tuple(t.shape)) for name, t in torch_loads(data)] == [("p", (0,)), ("q", (2, 2))]
        checkpoint = read(data)
        assert [t.name for t in checkpoint.tensors] == ["q"]
        assert [item.name for item in checkpoint.left_out] == ["p"] and "without data" in checkpoint.warnings[0]


def test_a_state_that_copies_values_into_a_tensor_is_refused() -> None:
    """``real`` in a Parameter's state: torch copies the values into its storage (and every view of it)."""
    rebuild = fz.p_global("torch._utils", "_rebuild_parameter_with_state")

    def body(t0: bytes, t1: bytes) -> bytes:
        state = fz.p_dict([(fz.p_str("real"), t0)])
        return top(("p", rebuild + fz.p_tuple(t0, b"\x89", OD_GLOBAL + b")R", state) + b"R"))

    data = by_hand(body, "zip")
    assert [name for name, _ in torch_loads(data)] == ["p"]
    with pytest.raises(pytorch_rules.InvalidTensorArgs, match="sets 'real'"):
        read(data)


# -- tensors ----------------------------------------------------------------------------------------------------


def _rebuilds() -> dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor], Any]]:
    utils = torch._utils

    def typed(tensor: torch.Tensor) -> Any:
        return tensor._typed_storage()

    def noted(tensor: torch.Tensor) -> torch.Tensor:
        copy = tensor.clone()
        copy.note = "kept"  # type: ignore[attr-defined]  # torch.save: _rebuild_from_type_v2 with a state
        return copy

    return {
        "_rebuild_tensor_v2, six arguments, shape and strides lists": lambda a, b, c: {
            "t": Reduced(utils._rebuild_tensor_v2, (typed(a), 1, [2, 5], [5, 1], False, None))
        },
        "_rebuild_tensor_v2, metadata {}, hooks a dict": lambda a, b, c: {
            "t": Reduced(utils._rebuild_tensor_v2, (typed(a), 0, (4, 3), (1, 4), False, {}, {}))
        },
        "_rebuild_tensor_v2, shape a torch.Size": lambda a, b, c: {
            "t": Reduced(utils._rebuild_tensor_v2, (typed(a), 2, torch.Size([2, 2]), (4, 1), False, OD()))
        },
        "_rebuild_tensor_v2, torch.Size() (a scalar)": lambda a, b, c: {
            "t": Reduced(utils._rebuild_tensor_v2, (typed(a), 7, torch.Size(), (), False, OD()))
        },
        "_rebuild_tensor (v1)": lambda a, b, c: {"t": Reduced(utils._rebuild_tensor, (typed(b), 1, (2, 2), (1, 2)))},
        "_rebuild_tensor_v3 of an UntypedStorage": lambda a, b, c: {
            "t": Reduced(utils._rebuild_tensor_v3, (a.untyped_storage(), 4, (6,), (1,), False, OD(), torch.uint16))
        },
        "_rebuild_tensor_v2 of an UntypedStorage: bytes": lambda a, b, c: {
            "t": Reduced(utils._rebuild_tensor_v2, (b.untyped_storage(), 3, (2, 3), (3, 1), False, OD()))
        },
        "_rebuild_from_type_v2, an attribute in its state": lambda a, b, c: {"t": noted(a), "u": noted(c)},
        "_rebuild_device_tensor_from_cpu_tensor, its own dtype": lambda a, b, c: {
            "t": Reduced(utils._rebuild_device_tensor_from_cpu_tensor, (b, torch.bfloat16, "cpu", False))
        },
    }


def _untyped_in_the_older_layout(shape: str, layout: str) -> bool:
    """torch.load refuses an UntypedStorage in the older layout (see test_every_storage_class_and_dtype_...)."""
    return "UntypedStorage" in shape and layout == "legacy"


@pytest.mark.parametrize(
    ("shape", "layout"),
    [(s, layout) for s in _rebuilds() for layout in LAYOUTS if not _untyped_in_the_older_layout(s, layout)],
)
def test_tensor_rebuilds_as_torch_loads_them(shape: str, layout: str) -> None:
    assert as_torch_loads(save(_rebuilds()[shape](*tensors()), layout)).tensors


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_shape_of_torch_size_called_with_nothing_is_a_scalar(layout: str) -> None:
    scalar = p_tensor("1", fz.p_global("torch", "Size") + b")R", (), layout)
    as_torch_loads(by_hand(lambda t0, t1: top(("s", scalar), ("t", t0)), layout))


def test_a_tensor_converted_to_another_dtype_when_loaded_is_left_out() -> None:
    a, b, _ = tensors()
    convert = torch._utils._rebuild_device_tensor_from_cpu_tensor
    data = save({"t": Reduced(convert, (a, torch.float64, "cpu", False)), "u": b}, "zip")
    assert [(name, t.dtype) for name, t in torch_loads(data)] == [("t", torch.float64), ("u", torch.bfloat16)]
    checkpoint = read(data)
    assert [t.name for t in checkpoint.tensors] == ["u"]
    assert [item.name for item in checkpoint.left_out] == ["t"] and "torch.float64" in checkpoint.warnings[0]


def test_build_on_a_tensor_that_would_change_it_is_refused() -> None:
    """torch's loader calls Tensor.set_(*state) (torch 0.3's form): torch.save never writes it; stfs refuses."""
    pid = fz.p_tuple(fz.p_str("storage"), fz.p_global("torch", "FloatStorage"), fz.p_str("1"), fz.p_str("cpu"))
    state = fz.p_tuple(pid[:-1] + fz.p_int(4) + b"tQ", fz.p_int(1), fz.p_tuple(fz.p_int(2)), fz.p_tuple(fz.p_int(1)))
    data = by_hand(lambda t0, t1: top(("t", t0 + state + b"b")), "zip")
    assert [raw(t) for _, t in torch_loads(data)] == [struct.pack("<2f", 6, 7)]
    with pytest.raises(pytorch_rules.InvalidTensorArgs, match="BUILD on a tensor"):
        read(data)


# -- storage classes and dtypes -----------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", list(SAFETENSORS_DTYPES.values()), ids=list(SAFETENSORS_DTYPES))
def test_every_storage_class_and_dtype_torch_save_writes(dtype: torch.dtype, layout: str) -> None:
    """The typed storage classes (_rebuild_tensor_v2) and UntypedStorage with a dtype (_rebuild_tensor_v3)."""
    tensor = random_tensor(dtype, (3, 4), seed=5)
    tensors = {"t": tensor, "v": tensor[1:, ::2], "p": torch.nn.Parameter(tensor, requires_grad=False)}
    data = save(tensors, layout)
    if layout == "legacy" and b"UntypedStorage" in data:
        # torch.load refuses torch.save's own older layout of an UntypedStorage (it asks the class for a dtype):
        # stfs reads the tensors torch.save was given.
        with pytest.raises(AttributeError, match="dtype"):
            torch_loads(data)
        as_torch_loads(data, list(tensors.items()))
    else:
        as_torch_loads(data)


STORAGE_CLASSES = [
    ("torch.cuda", "FloatStorage", "cuda:0", struct.pack("<4f", 1, 2, 3, 4)),
    ("torch", "FloatStorage", "cuda:0", struct.pack("<4f", 1, 2, 3, 4)),  # lpips 0.1.4's weights
    ("torch.cuda", "HalfStorage", "cuda:1", struct.pack("<4e", 1, 2, 3, 4)),
    ("torch.cuda", "LongStorage", "cuda:0", struct.pack("<4q", 1, 2, 3, 4)),
    ("torch.storage", "UntypedStorage", "cpu", bytes(range(4))),
]


@pytest.mark.parametrize(
    ("module", "storage", "location", "packed", "layout"),
    [
        (*case, layout)
        for case in STORAGE_CLASSES
        for layout in LAYOUTS
        if not _untyped_in_the_older_layout(case[1], layout)
    ],
    ids=lambda value: value if isinstance(value, str) else "",
)
def test_storage_classes_of_any_module_and_location(
    module: str, storage: str, location: str, packed: bytes, layout: str
) -> None:
    itemsize = len(packed) // 4
    pid = [fz.p_str("storage"), fz.p_global(module, storage), fz.p_str("9"), fz.p_str(location), fz.p_int(4)]
    pid = fz.p_tuple(*pid, *([b"N"] if layout == "legacy" else [])) + b"Q"
    args = [pid, fz.p_int(1), fz.p_tuple(fz.p_int(3)), fz.p_tuple(fz.p_int(1)), b"\x89", OD_GLOBAL + b")R"]
    body = top(("t", fz.p_global("torch._utils", "_rebuild_tensor_v2") + fz.p_tuple(*args) + b"R"))
    pickled = fz.PROTO2 + body + fz.STOP
    data = fz.checkpoint_zip(pickled, {"9": packed}) if layout == "zip" else fz.legacy_file(pickled, [("9", 4, packed)])
    assert as_torch_loads(data).tensors[0].nbytes == 3 * itemsize


# -- bounds -------------------------------------------------------------------------------------------------------


def _called_again_and_again(callee: tuple[str, str], argument: bytes) -> bytes:
    """``callee(argument)`` (memoized once) called until the opcode bound, every result kept in a list."""
    head = fz.PROTO2 + b"]" + fz.p_global(*callee) + b"q\x000" + argument + b"q\x010"
    return fz.checkpoint_zip(head + b"h\x00h\x01Ra" * 300_000 + fz.STOP, {})


@pytest.mark.parametrize(
    "name",
    ["torch.Size of a 1,000,000-element list", "OrderedDict of 1,000,000 pairs", "_codecs.encode of a 1 MiB string"],
)
def test_a_call_copying_a_large_value_again_and_again_is_bounded(tmp_path: Path, name: str) -> None:
    """Each call copies its argument: the copied elements count as opcodes, so time and memory stay bounded."""
    if name.startswith("torch.Size"):
        data = _called_again_and_again(("torch", "Size"), b"](" + b"K\x01" * 1_000_000 + b"e\x85")
    elif name.startswith("OrderedDict"):
        pair = b"](" + fz.p_str("k") + b"Neq\x02"
        data = _called_again_and_again(("collections", "OrderedDict"), b"](" + pair + b"h\x02" * 999_999 + b"e\x85")
    else:
        text = fz.p_str("x" * (1 << 20))
        data = _called_again_and_again(("_codecs", "encode"), fz.p_tuple(text, fz.p_str("latin1")))
    path = tmp_path / "hostile.pt"
    path.write_bytes(data)
    result = fz.read_bounded(str(path), memory=400 << 20, seconds=20)
    assert result.outcome == "refused PickleLimitExceeded", (result.outcome, result.message)
    assert result.max_rss < 400 << 20
