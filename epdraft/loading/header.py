"""safetensors headers read without torch and without touching tensor data.

A safetensors file is an 8-byte little-endian header length, a JSON header (name -> dtype, shape,
data offsets) and the data. Reading only the header answers names, shapes and dtypes in
milliseconds, and comparing the offsets with the file size finds a truncated copy before any rank
memory-maps it (a truncated file otherwise fails deep inside a rank, or reads garbage).
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import msgspec
import torch

from epdraft.errors import LoadError

# A header is a few KB per thousand tensors; a bigger length is a corrupt or foreign file.
_MAX_HEADER_BYTES = 100 << 20
DTYPE_BYTES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1,
}  # fmt: skip
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")
# safetensors dtype names -> the torch dtypes a header-only load hands out (as meta tensors).
TORCH_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "F8_E8M0": torch.float8_e8m0fnu,
    "U8": torch.uint8, "I8": torch.int8,
    "I16": torch.int16, "I32": torch.int32, "I64": torch.int64, "BOOL": torch.bool,
}  # fmt: skip


class TensorHeader(msgspec.Struct, frozen=True):
    """One tensor's entry: safetensors dtype name (`F32`, `BF16`, ...), shape, and [begin, end) data offsets."""

    dtype: str
    shape: tuple[int, ...]
    data_offsets: tuple[int, int]


def read_header(path: str | Path) -> dict[str, TensorHeader]:
    """The tensors of one safetensors file by name, checked against the file's size.

    Raises LoadError naming the file when it cannot be read, is not safetensors, or is shorter
    than its header says (truncated).
    """
    path = Path(path)
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise LoadError(f"{path}: not a safetensors file ({size} bytes, no header)")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > min(_MAX_HEADER_BYTES, size - 8):
                raise LoadError(
                    f"{path}: truncated or not a safetensors file: header of {header_len} bytes, file of {size}"
                )
            raw = json.loads(f.read(header_len))
    except OSError as e:
        raise LoadError(f"{path}: cannot read: {e.strerror or e}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LoadError(f"{path}: not a safetensors file (header is not JSON: {e})") from None
    if not isinstance(raw, dict):
        raise LoadError(f"{path}: not a safetensors file (header is not a JSON object)")
    raw.pop("__metadata__", None)
    try:
        tensors = msgspec.convert(raw, dict[str, TensorHeader])
    except msgspec.ValidationError as e:
        raise LoadError(f"{path}: malformed safetensors header: {e}") from None
    data_bytes = size - 8 - header_len
    for name, t in tensors.items():
        begin, end = t.data_offsets
        itemsize = DTYPE_BYTES.get(t.dtype)
        if itemsize is None:
            raise LoadError(f"{path}: {name}: unknown dtype {t.dtype!r}")
        if end - begin != math.prod(t.shape) * itemsize or begin < 0:
            raise LoadError(f"{path}: {name}: data offsets {[begin, end]} do not fit {t.dtype} {list(t.shape)}")
        if end > data_bytes:
            raise LoadError(
                f"{path}: truncated: {name} ends at byte {end} of the data, the file holds {data_bytes} "
                "(copy the file again)"
            )
    return tensors
