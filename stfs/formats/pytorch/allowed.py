"""What torch knows by name: its dtypes and storage classes, the globals ``torch.load(weights_only=True)`` allows,
and the Python 2 names a protocol-2 pickle may hold. Data only."""

from __future__ import annotations

from collections.abc import Mapping

# torch dtype name -> (safetensors dtype, itemsize); None where safetensors has no such type (left out).
TORCH_DTYPES: Mapping[str, tuple[str | None, int]] = {
    "float64": ("F64", 8),
    "float32": ("F32", 4),
    "float16": ("F16", 2),
    "bfloat16": ("BF16", 2),
    "int64": ("I64", 8),
    "int32": ("I32", 4),
    "int16": ("I16", 2),
    "int8": ("I8", 1),
    "uint8": ("U8", 1),
    "bool": ("BOOL", 1),
    "complex64": ("C64", 8),
    "uint16": ("U16", 2),
    "uint32": ("U32", 4),
    "uint64": ("U64", 8),
    "float8_e4m3fn": ("F8_E4M3", 1),
    "float8_e5m2": ("F8_E5M2", 1),
    "float8_e4m3fnuz": ("F8_E4M3FNUZ", 1),
    "float8_e5m2fnuz": ("F8_E5M2FNUZ", 1),
    "float8_e8m0fnu": ("F8_E8M0", 1),
    "complex128": (None, 16),
    "complex32": (None, 4),
    "qint8": (None, 1),
    "quint8": (None, 1),
    "qint32": (None, 4),
    "quint4x2": (None, 1),
    "quint2x4": (None, 1),
    "float4_e2m1fn_x2": (None, 1),  # two values a byte: safetensors' F4 counts values, torch counts bytes
    "bits1x8": (None, 1),
    "bits2x4": (None, 1),
    "bits4x2": (None, 1),
    "bits8": (None, 1),
    "bits16": (None, 2),
    **{f"uint{n}": (None, 1) for n in range(1, 8)},
    **{f"int{n}": (None, 1) for n in range(1, 8)},
}

# Storage classes (any module, as torch's loaders take them by name) -> torch dtype name.
STORAGE_DTYPES: Mapping[str, str] = {
    "DoubleStorage": "float64",
    "FloatStorage": "float32",
    "HalfStorage": "float16",
    "BFloat16Storage": "bfloat16",
    "LongStorage": "int64",
    "IntStorage": "int32",
    "ShortStorage": "int16",
    "CharStorage": "int8",
    "ByteStorage": "uint8",
    "BoolStorage": "bool",
    "ComplexFloatStorage": "complex64",
    "ComplexDoubleStorage": "complex128",
    "QInt8Storage": "qint8",
    "QUInt8Storage": "quint8",
    "QInt32Storage": "qint32",
    "QUInt4x2Storage": "quint4x2",
    "QUInt2x4Storage": "quint2x4",
    "UntypedStorage": "uint8",  # numel in bytes; the tensor's dtype comes from _rebuild_tensor_v3
}

# What torch.load(weights_only=True) allows: torch 2.13's _get_allowed_globals() (its
# _tensor_rebuild_functions() included), as data. tests/test_pytorch_format.py holds it to the installed torch.
_ALLOWED_BY_MODULE: Mapping[str, str] = {
    "_codecs": "encode",
    "builtins": "bytearray complex set",
    "collections": "Counter OrderedDict",
    "torch": (
        "BFloat16Storage BFloat16Tensor BoolStorage BoolTensor ByteStorage ByteTensor CharStorage CharTensor "
        "ComplexDoubleStorage ComplexFloatStorage DoubleStorage DoubleTensor FloatStorage FloatTensor HalfStorage "
        "HalfTensor IntStorage IntTensor LongStorage LongTensor QInt32Storage QInt8Storage QUInt2x4Storage "
        "QUInt4x2Storage QUInt8Storage ShortStorage ShortTensor Size Tensor "
        "bfloat16 bits16 bits1x8 bits2x4 bits4x2 bits8 bool complex128 complex32 complex64 device "
        "float16 float32 float4_e2m1fn_x2 float64 float8_e4m3fn float8_e4m3fnuz float8_e5m2 float8_e5m2fnuz "
        "float8_e8m0fnu int1 int16 int2 int3 int32 int4 int5 int6 int64 int7 int8 "
        "per_channel_affine per_channel_affine_float_qparams per_channel_symmetric per_tensor_affine "
        "per_tensor_symmetric qint32 qint8 quint2x4 quint4x2 quint8 "
        "uint1 uint16 uint2 uint3 uint32 uint4 uint5 uint6 uint64 uint7 uint8"
    ),
    "torch._tensor": "_rebuild_from_type_v2",
    "torch._utils": (
        "_rebuild_device_tensor_from_cpu_tensor _rebuild_device_tensor_from_numpy _rebuild_meta_tensor_no_storage "
        "_rebuild_nested_tensor _rebuild_parameter _rebuild_parameter_with_state _rebuild_qtensor "
        "_rebuild_sparse_tensor _rebuild_tensor _rebuild_tensor_v2 _rebuild_tensor_v3 _rebuild_wrapper_subclass"
    ),
    "torch.cuda": (
        "BFloat16Storage BFloat16Tensor BoolStorage BoolTensor ByteStorage ByteTensor CharStorage CharTensor "
        "ComplexDoubleStorage ComplexFloatStorage DoubleStorage DoubleTensor FloatStorage FloatTensor HalfStorage "
        "HalfTensor IntStorage IntTensor LongStorage LongTensor ShortStorage ShortTensor"
    ),
    "torch.cuda.sparse": (
        "BFloat16Tensor ByteTensor CharTensor DoubleTensor FloatTensor HalfTensor IntTensor LongTensor ShortTensor"
    ),
    "torch.nn.parameter": "Parameter",
    "torch.serialization": "_get_layout",
    "torch.sparse": (
        "BFloat16Tensor ByteTensor CharTensor DoubleTensor FloatTensor HalfTensor IntTensor LongTensor ShortTensor"
    ),
    "torch.storage": "TypedStorage UntypedStorage",
}
WEIGHTS_ONLY_GLOBALS: frozenset[str] = frozenset(
    f"{module}.{name}" for module, names in _ALLOWED_BY_MODULE.items() for name in names.split()
)

# What torch.distributed.checkpoint's FileSystemWriter pickles into a checkpoint's .metadata (torch 2.13): its
# dataclasses, torch.Size, dtypes, layouts, the memory format's encoding, and StorageMeta's checkpoint_id (a path);
# Megatron-Core's writer adds every rank's SavePlan (``all_local_plans``: torch's planner dataclasses) to reuse them.
# torch reads that file with pickle.load: anything else it names would be imported and called.
_DCP_METADATA = "torch.distributed.checkpoint.metadata"
DCP_GLOBALS: frozenset[str] = frozenset(
    (
        *(
            f"{_DCP_METADATA}.{name}"
            for name in (
                "Metadata",
                "TensorStorageMetadata",
                "ChunkStorageMetadata",
                "TensorProperties",
                "BytesStorageMetadata",
                "MetadataIndex",
                "StorageMeta",
                "_MEM_FORMAT_ENCODING",
            )
        ),
        "torch.distributed.checkpoint.filesystem._StorageInfo",
        *(
            f"torch.distributed.checkpoint.planner.{name}"
            for name in ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData", "BytesIOWriteData")
        ),
        "torch.Size",
        "torch.serialization._get_layout",
        *(f"torch.{dtype}" for dtype in TORCH_DTYPES),
        *(f"pathlib.{module}{name}" for module in ("", "_local.") for name in ("PosixPath", "WindowsPath")),
    )
)

# Python 2 names a protocol-2 pickle may hold, as torch's weights_only loader maps them (torch._utils'
# IMPORT_MAPPING and NAME_MAPPING, from the standard library's _compat_pickle) before looking a name up.
IMPORT_MAPPING: Mapping[str, str] = {
    "__builtin__": "builtins",
    "copy_reg": "copyreg",
    "Queue": "queue",
    "repr": "reprlib",
    "_abcoll": "collections.abc",
    "UserDict": "collections",
    "UserList": "collections",
    "UserString": "collections",
    "whichdb": "dbm",
    "StringIO": "io",
    "cStringIO": "io",
}
NAME_MAPPING: Mapping[tuple[str, str], tuple[str, str]] = {
    ("__builtin__", "xrange"): ("builtins", "range"),
    ("__builtin__", "reduce"): ("functools", "reduce"),
    ("__builtin__", "intern"): ("sys", "intern"),
    ("__builtin__", "unichr"): ("builtins", "chr"),
    ("__builtin__", "unicode"): ("builtins", "str"),
    ("__builtin__", "long"): ("builtins", "int"),
    ("itertools", "izip"): ("builtins", "zip"),
    ("itertools", "imap"): ("builtins", "map"),
    ("itertools", "ifilter"): ("builtins", "filter"),
    ("itertools", "ifilterfalse"): ("itertools", "filterfalse"),
    ("itertools", "izip_longest"): ("itertools", "zip_longest"),
    ("UserDict", "IterableUserDict"): ("collections", "UserDict"),
    ("UserList", "UserList"): ("collections", "UserList"),
    ("UserString", "UserString"): ("collections", "UserString"),
    ("__builtin__", "basestring"): ("builtins", "str"),
    ("exceptions", "StandardError"): ("builtins", "Exception"),
    ("UserDict", "UserDict"): ("collections", "UserDict"),
}
