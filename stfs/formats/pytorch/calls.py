"""What a call (``REDUCE``, ``NEWOBJ``) or a persistent id means, for the names torch's own loader rebuilds
tensors with: a tensor description, a storage, a dict; any other call an opaque record of the name and its
arguments. Nothing is called."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .allowed import STORAGE_DTYPES, TORCH_DTYPES
from .rules import InvalidPickle, InvalidStorage, InvalidTensorArgs
from .values import Global, Object, StorageRef, TensorRef, Unsupported, describe, dict_key

MAX_REBUILD_NESTING = 8  # _rebuild_from_type_v2 wrapping itself

_UNSUPPORTED_REBUILDS: Mapping[str, str] = {
    "torch._utils._rebuild_qtensor": "a quantized tensor, which safetensors cannot hold",
    "torch._utils._rebuild_sparse_tensor": "a sparse tensor, which safetensors cannot hold",
    "torch._utils._rebuild_nested_tensor": "a nested tensor, which safetensors cannot hold",
    "torch._utils._rebuild_meta_tensor_no_storage": "a meta tensor: it has no data",
    "torch._utils._rebuild_wrapper_subclass": "a tensor subclass without a storage",
    "torch._utils._rebuild_device_tensor_from_numpy": "a tensor pickled as a numpy array",
}


def persistent(pid: Any, storages: dict[str, StorageRef], path: str) -> Any:
    """The value of a persistent id: a storage (``('storage', type, key, location, numel[, view])``), recorded in
    ``storages`` by its key; a legacy ``('module', ...)`` its class; anything else opaque."""
    if not isinstance(pid, tuple) or not pid:
        return Object(Global("persistent_load", "id"), (pid,))
    kind = pid[0].decode("ascii", "replace") if isinstance(pid[0], bytes) else pid[0]
    if kind == "module" and len(pid) >= 2:  # legacy torch.save(module): the class, by name
        return pid[1]
    if kind != "storage":
        return Object(Global("persistent_load", "id"), pid)
    if len(pid) not in (5, 6):
        raise InvalidPickle(path, f"a storage's persistent id has {len(pid)} members, not 5 or 6")
    storage_type, key, numel = pid[1], pid[2], pid[4]
    if isinstance(key, bytes):
        key = key.decode("ascii", "replace")
    if not isinstance(storage_type, Global) or type(key) is not str or type(numel) is not int or numel < 0:
        raise InvalidPickle(path, f"a storage's persistent id is not (type, key, location, numel): {describe(pid)}")
    dtype = STORAGE_DTYPES.get(storage_type.name)
    view = None
    if len(pid) == 6 and pid[5] is not None:
        meta = pid[5]
        if not (isinstance(meta, tuple) and len(meta) == 3 and all(type(x) is int and x >= 0 for x in meta[1:])):
            raise InvalidPickle(path, f"storage {key!r}: its view is not (key, offset, size): {describe(meta)}")
        view = (meta[1], meta[2])
    ref = StorageRef(key, dtype, numel, view)
    known = storages.setdefault(key, ref)
    if (known.dtype, known.numel) != (ref.dtype, ref.numel):
        raise InvalidStorage(
            path,
            f"storage {key!r} is named as {known.numel} x {known.dtype} and as {ref.numel} x {ref.dtype}",
        )
    return ref


def call(callee: Any, args: Any, path: str, depth: int = 0) -> Any:
    """The value of ``callee(*args)`` as stfs understands it; anything else an opaque record of the call."""
    if not isinstance(callee, Global) or not isinstance(args, tuple):
        return Object(callee, args)
    full = callee.full
    if full in (
        "torch._utils._rebuild_tensor_v2",
        "torch._utils._rebuild_tensor",
        "torch._utils._rebuild_tensor_v3",
    ):
        return _rebuild_tensor(full, args, path)
    if full == "torch._utils._rebuild_parameter":  # (data, requires_grad, backward_hooks)
        return args[0] if args and isinstance(args[0], (TensorRef, Unsupported)) else Object(callee, args)
    if full == "torch._utils._rebuild_parameter_with_state":  # (data, requires_grad, backward_hooks, state)
        if args and isinstance(args[0], (TensorRef, Unsupported)):
            return _with_state(args[0], args[3] if len(args) > 3 else None, full, path)
        return Object(callee, args)
    if full == "torch.nn.parameter.Parameter":  # Parameter(data=None, requires_grad=True)
        return _parameter(callee, args)
    if full == "torch._utils._rebuild_device_tensor_from_cpu_tensor":  # (data, dtype, device, requires_grad)
        if args and isinstance(args[0], TensorRef) and len(args) > 1:
            dtype = args[1]
            if not (isinstance(dtype, Global) and dtype.module == "torch" and dtype.name == args[0].dtype):
                return Unsupported(f"converted to {describe(dtype)} when loaded: its values are not its stored bytes")
        return args[0] if args and isinstance(args[0], (TensorRef, Unsupported)) else Object(callee, args)
    if full == "torch._tensor._rebuild_from_type_v2":  # (func, new_type, args, state): a tensor subclass
        if len(args) == 4 and isinstance(args[2], tuple) and depth < MAX_REBUILD_NESTING:
            inner = call(args[0], args[2], path, depth + 1)
            if isinstance(inner, (TensorRef, Unsupported)):
                return _with_state(inner, args[3], full, path)
        return Object(callee, args)
    if full in _UNSUPPORTED_REBUILDS:
        return Unsupported(_UNSUPPORTED_REBUILDS[full])
    if full == "collections.OrderedDict":
        made = _ordered_dict(args)
        return made if made is not None else Object(callee, args)
    if full == "torch.Size" and (args == () or len(args) == 1 and isinstance(args[0], (tuple, list))):
        return tuple(args[0]) if args else ()
    if full == "_codecs.encode" and len(args) == 2 and type(args[0]) is str and args[1] in ("latin1", "latin-1"):
        try:  # how a protocol-2 pickle made by Python 3 holds bytes
            return args[0].encode("latin-1")
        except UnicodeError:
            return Object(callee, args)
    return Object(callee, args)


def _rebuild_tensor(full: str, args: tuple[Any, ...], path: str) -> Any:
    v3 = full.endswith("_v3")
    if len(args) < (7 if v3 else 4):
        raise InvalidPickle(path, f"{full} takes at least {7 if v3 else 4} arguments, given {len(args)}")
    storage, offset, shape, strides = args[:4]
    if not isinstance(storage, StorageRef):
        raise InvalidPickle(path, f"{full}: the storage is {describe(storage)}, not a persistent id of a storage")
    shape = _int_tuple(shape)
    strides = _int_tuple(strides)
    if shape is None or strides is None or len(shape) != len(strides):
        raise InvalidTensorArgs(
            path, f"{full}: shape {describe(args[2])} and strides {describe(args[3])} of one length"
        )
    if type(offset) is not int or not 0 <= offset < 2**63:
        raise InvalidTensorArgs(path, f"{full}: storage offset {describe(offset)}")
    if v3:
        dtype_name = args[6]
        if not (isinstance(dtype_name, Global) and dtype_name.module == "torch"):
            raise InvalidPickle(path, f"{full}: the dtype is {describe(dtype_name)}, not a torch dtype")
        dtype = dtype_name.name
    else:
        if storage.dtype is None:
            return Unsupported("its storage class is not one torch writes")
        dtype = storage.dtype
    metadata = args[7] if v3 and len(args) > 7 else args[6] if not v3 and len(args) > 6 else None
    if isinstance(metadata, dict):
        flags = [flag for flag in ("conj", "neg") if metadata.get(flag) is True]
        if flags:
            return Unsupported(f"a {' and '.join(flags)} view: its values are not its stored bytes")
    if dtype not in TORCH_DTYPES:
        return Unsupported(f"dtype torch.{dtype}, which stfs does not know")
    return TensorRef(storage, offset, shape, strides, dtype)


def new(cls: Any, args: Any) -> Any:
    """The value of ``NEWOBJ`` as torch's loader makes it, ``torch.nn.Parameter(*args)`` for a Parameter and
    ``cls.__new__(cls, *args)`` otherwise, as stfs understands it; else an opaque record."""
    if isinstance(cls, Global) and isinstance(args, (tuple, list)):
        if cls.full == "torch.nn.parameter.Parameter":
            return _parameter(cls, tuple(args))
        if cls.full == "collections.OrderedDict":  # __new__ takes its arguments and ignores them: empty
            return {}
    return Object(cls, args)


def build_tensor(state: Any, path: str) -> None:
    """Check ``BUILD`` on a tensor: torch's loader calls ``Tensor.set_(*state)`` on a tensor and
    ``Parameter.__setstate__(state)`` on a Parameter (torch 0.3's forms), which put it on other storage, shape or
    strides (or other data) unless the state is a Parameter's ``(requires_grad, _, backward_hooks)``. torch.save
    never writes one; any other is refused, as stfs cannot follow the change to every reference of the tensor."""
    if not (type(state) is tuple and len(state) == 3 and type(state[0]) is bool):
        raise InvalidTensorArgs(
            path,
            f"BUILD on a tensor with state {describe(state)}: it would change the tensor, which stfs does not follow",
        )


def _parameter(callee: Global, args: tuple[Any, ...]) -> Any:
    """``torch.nn.Parameter(data=None, requires_grad=True)``: the tensor ``data`` is."""
    if not args or args[0] is None:
        return Unsupported("a Parameter made without data (torch makes it an empty tensor of no storage)")
    return args[0] if isinstance(args[0], (TensorRef, Unsupported)) else Object(callee, args)


def _with_state(tensor: Any, state: Any, full: str, path: str) -> Any:
    """``tensor`` after torch's ``_set_obj_state(tensor, state)``: ``setattr`` of each key of the state (a dict, or a
    pair of a dict and a dict of slots). ``data`` puts the tensor on that tensor; ``real`` and ``imag`` would copy
    values into its storage (and every view of it), which stfs does not follow: refused. Any other attribute leaves
    its values as they are."""
    parts = state if type(state) is tuple and len(state) == 2 else (state,)
    for part in parts:
        if type(part) is not dict:
            continue
        for name in ("real", "imag"):
            if name in part:
                raise InvalidTensorArgs(
                    path,
                    f"{full}: its state sets {name!r}, copying values into its storage, which stfs does not follow",
                )
        if isinstance(part.get("data"), (TensorRef, Unsupported)):
            tensor = part["data"]
    return tensor


def _ordered_dict(args: tuple[Any, ...]) -> dict[Any, Any] | None:
    """``collections.OrderedDict(*args)`` as CPython makes it: nothing, a dict (its items), or a list or tuple of
    pairs, each a list or tuple of two (or a string or bytes of two, as it iterates them); a key named twice keeps
    its first place and its last value. None for anything else (torch's loader refuses those)."""
    if not args:
        return {}
    if len(args) != 1:
        return None
    source = args[0]
    if type(source) is dict:
        return dict(source)
    if type(source) not in (list, tuple):
        return None
    made: dict[Any, Any] = {}
    for pair in source:
        if type(pair) not in (list, tuple, str, bytes) or len(pair) != 2:
            return None
        made[dict_key(pair[0])] = pair[1]
    return made


def _int_tuple(value: Any) -> tuple[int, ...] | None:
    if not isinstance(value, (tuple, list)) or len(value) > 64:
        return None
    if not all(type(x) is int and 0 <= x < 2**63 for x in value):
        return None
    return tuple(value)
