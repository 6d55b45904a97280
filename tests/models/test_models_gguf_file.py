"""rljax's GGUF container reader (rljax.models.gguf_file) against the ``gguf`` package: files written
by ``gguf.GGUFWriter`` with every metadata value type and several storage types read back to the
values written, and to the same tensor arrays ``gguf.GGUFReader`` gives; broken files raise."""

from __future__ import annotations

import pathlib
import struct

import gguf
import numpy as np
import pytest

from rljax.models.gguf_file import read_gguf_file
from rljax.models.gguf_io import read_gguf_metadata

METADATA = {
    "general.architecture": "llama",
    "general.name": "tiny ünïcode",
    "t.u8": (gguf.GGUFValueType.UINT8, 200),
    "t.i8": (gguf.GGUFValueType.INT8, -100),
    "t.u16": (gguf.GGUFValueType.UINT16, 60000),
    "t.i16": (gguf.GGUFValueType.INT16, -30000),
    "t.u32": (gguf.GGUFValueType.UINT32, 4_000_000_000),
    "t.i32": (gguf.GGUFValueType.INT32, -2_000_000_000),
    "t.u64": (gguf.GGUFValueType.UINT64, 2**63 + 5),
    "t.i64": (gguf.GGUFValueType.INT64, -(2**62)),
    "t.f32": (gguf.GGUFValueType.FLOAT32, 1e-5),
    "t.f64": (gguf.GGUFValueType.FLOAT64, 0.1),
    "t.bool": (gguf.GGUFValueType.BOOL, True),
    "t.strings": ["a", "", "Ġthe", "<|im_end|>"],
    "t.ints": [3, -1, 7],
    "t.floats": [0.5, -2.25],
}


def _write(path: pathlib.Path, tensors: dict[str, tuple[np.ndarray, gguf.GGMLQuantizationType]]) -> None:
    writer = gguf.GGUFWriter(path, "llama")
    for key, value in METADATA.items():
        if key == "general.architecture":
            continue
        if isinstance(value, tuple):
            writer.add_key_value(key, value[1], value[0])
        elif isinstance(value, list):
            writer.add_array(key, value)
        else:
            writer.add_string(key, value)
    for name, (arr, qtype) in tensors.items():
        stored = arr if qtype in (gguf.GGMLQuantizationType.F32,) else gguf.quants.quantize(arr, qtype)
        writer.add_tensor(name, stored, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> tuple[pathlib.Path, dict]:
    rng = np.random.default_rng(0)
    q = gguf.GGMLQuantizationType
    tensors = {
        "a.f32": (rng.normal(size=(3, 5)).astype(np.float32), q.F32),
        "b.f16": (rng.normal(size=(4, 64)).astype(np.float32), q.F16),
        "c.bf16": (rng.normal(size=(2, 32)).astype(np.float32), q.BF16),
        "d.q8_0": (rng.normal(size=(3, 64)).astype(np.float32), q.Q8_0),
        "e.q4_1": (rng.normal(size=(2, 2, 32)).astype(np.float32), q.Q4_1),
    }
    path = tmp_path_factory.mktemp("gguf_file") / "t.gguf"
    _write(path, tensors)
    return path, tensors


def test_metadata_values_are_the_written_ones(written):
    path, _ = written
    got = read_gguf_metadata(read_gguf_file(path))
    for key, value in METADATA.items():
        want = value[1] if isinstance(value, tuple) else value
        assert got[key] == want and type(got[key]) is type(want), (key, got[key])
    assert repr(got["t.f32"]) == "1e-05"  # the shortest decimal of the stored float32


def test_a_nested_array_is_read_but_refused_as_metadata(tmp_path):
    path = tmp_path / "nested.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_array("t.nested", [[1, 2], [3]])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    file = read_gguf_file(path)
    assert file.metadata["t.nested"] == [[1, 2], [3]] and file.tensors == []
    with pytest.raises(ValueError, match="nested array"):
        read_gguf_metadata(file)
    assert read_gguf_metadata(file, skip=("t.nested",))["general.architecture"] == "llama"


def test_tensors_equal_the_gguf_packages_reader(written):
    path, tensors = written
    ours, ref = read_gguf_file(path), gguf.GGUFReader(path)
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors] == list(tensors)
    for mine, theirs in zip(ours.tensors, ref.tensors, strict=True):
        assert mine.tensor_type == theirs.tensor_type == tensors[mine.name][1]
        assert mine.shape == tuple(theirs.shape.tolist()) == tuple(reversed(tensors[mine.name][0].shape))
        assert mine.data.dtype == theirs.data.dtype and mine.data.shape == theirs.data.shape
        np.testing.assert_array_equal(mine.data, theirs.data)
        assert not mine.data.flags.writeable
    # and the values: the float32 tensor as written, the others as the gguf package dequantizes them
    a = next(t for t in ours.tensors if t.name == "a.f32")
    np.testing.assert_array_equal(a.data, tensors["a.f32"][0])


def test_broken_files_raise(written, tmp_path):
    path, _ = written
    data = path.read_bytes()
    cases = {
        "not_gguf": (b"GGUX" + data[4:], "not a GGUF file"),
        "version_1": (data[:4] + struct.pack("<I", 1) + data[8:], "version 1 is not supported"),
        "big_endian": (data[:4] + struct.pack(">I", 3) + data[8:], "big-endian"),
        "truncated": (data[:-40], "extends past the end of the file"),
    }
    for name, (content, message) in cases.items():
        broken = tmp_path / f"{name}.gguf"
        broken.write_bytes(content)
        with pytest.raises(ValueError, match=message):
            read_gguf_file(broken)
