"""The dtypes of safetensors 0.8, which every format's tensors are named by (a checkpoint's and an ONNX model's
map to them), and the ``DType`` of each: how its values are packed. A format may add dtypes of its own
(``Format.dtype``: GGML's quantized blocks); ``formats.dtype`` finds any of them."""

from __future__ import annotations

from collections.abc import Mapping

from .base import DType

# The 22 dtypes of safetensors 0.8 and their widths in bits.
DTYPE_BITS: Mapping[str, int] = {
    "BOOL": 8,
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
    "U8": 8,
    "I8": 8,
    "F8_E5M2": 8,
    "F8_E4M3": 8,
    "F8_E8M0": 8,
    "F8_E4M3FNUZ": 8,
    "F8_E5M2FNUZ": 8,
    "I16": 16,
    "U16": 16,
    "F16": 16,
    "BF16": 16,
    "I32": 32,
    "U32": 32,
    "F32": 32,
    "C64": 64,
    "F64": 64,
    "I64": 64,
    "U64": 64,
}


def standard(name: str) -> DType | None:
    """The ``DType`` of one of safetensors' dtypes; ``None`` for another name."""
    bits = DTYPE_BITS.get(name)
    if bits is None:
        return None
    values = {4: 2, 6: 4}.get(bits, 1)  # F4 two values a byte, F6 four in three bytes
    return DType(name, values, values * bits // 8, has_values=name != "C64")
