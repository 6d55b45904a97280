"""The GGUF container: header, metadata and tensor table read in one pass, tensors memory-mapped.

GGUF (llama.cpp's format, version 2 and 3, little-endian) is::

    "GGUF" | version u32 | tensor count u64 | metadata count u64
    metadata:  key (string) | value type u32 | value          (one per metadata entry)
    tensors:   name (string) | n_dims u32 | dims u64[n_dims] | storage type u32 | offset u64
    padding to ``general.alignment`` (default 32), then the tensor data (offsets count from there)

with strings as ``length u64 | UTF-8 bytes`` and arrays as ``item type u32 | count u64 | items``.
:func:`read_gguf_file` decodes the metadata to Python values once, with numeric arrays read as one
numpy block each: a tokenizer's 49k-150k entry lists take a fraction of a second, where the ``gguf``
package's reader builds a numpy view per list entry (4.3 s and 159 MB for SmolLM2-135M's file,
paid again by every reader of the file). Dequantization stays with ``gguf.quants``
(:func:`rljax.models.gguf_io.dequantize_tensor`), which this module feeds the same arrays its
reader would: float types as their numpy dtype, block types as the rows' raw bytes.
"""

from __future__ import annotations

import dataclasses
import os
import struct
from typing import Any

import numpy as np

__all__ = ["GGUFFile", "GGUFTensorInfo", "read_gguf_file"]

_MAGIC = b"GGUF"
_VERSIONS = (2, 3)
_DEFAULT_ALIGNMENT = 32
# GGUF metadata value types (the spec's numbering) -> little-endian numpy dtype.
_NUMERIC = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1",
            10: "<u8", 11: "<i8", 12: "<f8"}  # fmt: skip
_FLOAT32, _BOOL, _STRING, _ARRAY = 6, 7, 8, 9


@dataclasses.dataclass(frozen=True)
class GGUFTensorInfo:
    """One tensor of a GGUF file.

    ``shape``: GGUF's dimensions, fastest first (``ne[0]`` = a Linear's input features);
    ``tensor_type``: its ``gguf.GGMLQuantizationType``; ``data``: a read-only memory-mapped array,
    in numpy order (``shape`` reversed) for float and integer types, the raw bytes of each row for
    block-quantized types (what ``gguf.quants.dequantize`` takes).
    """

    name: str
    shape: tuple[int, ...]
    tensor_type: Any
    data: np.ndarray


@dataclasses.dataclass(frozen=True)
class GGUFFile:
    """A GGUF file's metadata (``{key: str | int | float | bool | list}``) and tensors, in file order."""

    path: str
    version: int
    metadata: dict[str, Any]
    tensors: list[GGUFTensorInfo]


class _Cursor:
    """Reads little-endian GGUF values from a buffer, advancing an offset."""

    def __init__(self, buffer: memoryview) -> None:
        self.buffer = buffer
        self.offset = 0

    def unpack(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.buffer, self.offset)
        self.offset += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.unpack("<Q")
        start, self.offset = self.offset, self.offset + n
        return bytes(self.buffer[start : self.offset]).decode("utf-8")

    def value(self, value_type: int) -> Any:
        if value_type == _STRING:
            return self.string()
        if value_type == _ARRAY:
            item_type, count = self.unpack("<I"), self.unpack("<Q")
            if item_type in _NUMERIC:
                return _python_values(self.block(_NUMERIC[item_type], count), item_type)
            return [self.value(item_type) for _ in range(count)]
        if value_type not in _NUMERIC:
            raise ValueError(f"unknown GGUF metadata value type {value_type} at byte {self.offset}")
        return _python_values(self.block(_NUMERIC[value_type], 1), value_type)[0]

    def block(self, dtype: str, count: int) -> np.ndarray:
        out = np.frombuffer(self.buffer, dtype=dtype, count=count, offset=self.offset)
        self.offset += out.nbytes
        return out


def _python_values(values: np.ndarray, value_type: int) -> list[Any]:
    """Numeric GGUF values as Python values: bools as ``bool``, float32 as the shortest decimal
    that rounds to it (``1e-05``, not ``9.999999747378752e-06``), the rest as ``int`` / ``float``."""
    if value_type == _BOOL:
        return [bool(v) for v in values.tolist()]
    if value_type == _FLOAT32:
        return [float(str(v)) for v in values]
    return values.tolist()


def _tensor_data(
    mm: np.ndarray, offset: int, dims: tuple[int, ...], tensor_type: Any, name: str
) -> np.ndarray:
    """A tensor's data as ``gguf.quants.dequantize`` takes it (see :class:`GGUFTensorInfo`)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quant_shape_to_byte_shape

    plain = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
             GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
             GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
             GGMLQuantizationType.I64: np.int64}  # fmt: skip
    np_dims = tuple(reversed(dims))
    block_size, type_size = GGML_QUANT_SIZES[tensor_type]
    nbytes = int(np.prod(dims, dtype=np.int64)) * type_size // block_size
    if offset + nbytes > mm.size:
        raise ValueError(
            f"tensor {name!r} ({nbytes} bytes at byte {offset}) extends past the end of the file"
        )
    raw = mm[offset : offset + nbytes]
    if tensor_type in plain:
        return raw.view(plain[tensor_type]).reshape(np_dims)
    return raw.reshape(quant_shape_to_byte_shape(np_dims, tensor_type))


def read_gguf_file(path: str | os.PathLike) -> GGUFFile:
    """Reads a GGUF file's header, metadata and tensor table; tensor data stays memory-mapped.

    Raises ``ValueError`` for a file that is not GGUF, a version other than 2 or 3, a big-endian
    file, a duplicated tensor name or a tensor that extends past the end of the file.
    """
    from gguf import GGMLQuantizationType

    path = os.fspath(path)
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    cursor = _Cursor(memoryview(mm))
    if bytes(cursor.buffer[:4]) != _MAGIC:
        raise ValueError(f"{path} is not a GGUF file (its first bytes are not 'GGUF')")
    cursor.offset = 4
    version = cursor.unpack("<I")
    if version not in _VERSIONS:
        swapped = version & 0xFFFF == 0
        raise ValueError(
            f"{path}: GGUF {'big-endian files are' if swapped else f'version {version} is'} not supported "
            f"(rljax reads little-endian versions {_VERSIONS})"
        )
    tensor_count, metadata_count = cursor.unpack("<Q"), cursor.unpack("<Q")
    metadata = {}
    for _ in range(metadata_count):
        key = cursor.string()
        metadata[key] = cursor.value(cursor.unpack("<I"))
    table = []
    for _ in range(tensor_count):
        name = cursor.string()
        dims = tuple(int(cursor.unpack("<Q")) for _ in range(cursor.unpack("<I")))
        table.append((name, dims, GGMLQuantizationType(cursor.unpack("<I")), cursor.unpack("<Q")))
    alignment = int(metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
    if alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"{path}: general.alignment {alignment} is not a power of two")
    data_start = -(-cursor.offset // alignment) * alignment
    tensors, names = [], set()
    for name, dims, tensor_type, offset in table:
        if name in names:
            raise ValueError(f"{path}: tensor {name!r} appears twice")
        names.add(name)
        data = _tensor_data(mm, data_start + offset, dims, tensor_type, name)
        tensors.append(GGUFTensorInfo(name=name, shape=dims, tensor_type=tensor_type, data=data))
    return GGUFFile(path=path, version=version, metadata=metadata, tensors=tensors)
