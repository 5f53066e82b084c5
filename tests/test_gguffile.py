"""gguffile.read_gguf against gguf's own GGUFReader (the oracle): the same metadata values and the same tensors
(name, type, shape, bytes) for a file with every value type and several tensor types, and for the shipped SmolLM2
file; a damaged file is a ValueError, never another exception."""
import numpy as np
import pytest

from formats.gguffile import read_gguf


def reference(path: str) -> tuple[dict, list]:
    import gguf

    reader = gguf.GGUFReader(path)
    meta = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}  # GGUF.*: the header
    return meta, reader.tensors


def assert_same_as_gguf(path: str) -> None:
    meta, tensors = read_gguf(path)
    ref_meta, ref_tensors = reference(path)
    assert meta.keys() == ref_meta.keys()
    for key, value in meta.items():
        assert type(value) is type(ref_meta[key]) and value == ref_meta[key], key
    assert [t.name for t in tensors] == [t.name for t in ref_tensors]
    for ours, ref in zip(tensors, ref_tensors):
        assert ours.tensor_type == ref.tensor_type and ours.shape == tuple(reversed(ref.shape.tolist())), ours.name
        assert ours.data.dtype == ref.data.dtype and ours.data.shape == ref.data.shape, ours.name
        assert np.array_equal(ours.data, ref.data, equal_nan=True), ours.name


@pytest.fixture(scope="module")
def every_kind(tmp_path_factory) -> str:
    """A GGUF with one metadata value of each type (and arrays of numbers, strings and booleans), a custom data
    alignment, and F32, F16, I32, Q8_0, Q4_0 and Q4_1 tensors of 1 to 3 dimensions."""
    import gguf

    path = str(tmp_path_factory.mktemp("gguf") / "every_kind.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_custom_alignment(64)
    writer.add_uint8("t.u8", 200)
    writer.add_int8("t.i8", -100)
    writer.add_uint16("t.u16", 60000)
    writer.add_int16("t.i16", -30000)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -2_000_000_000)
    writer.add_float32("t.f32", 0.1)
    writer.add_uint64("t.u64", 2**63 + 5)
    writer.add_int64("t.i64", -2**62)
    writer.add_float64("t.f64", 1 / 3)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "héllo ▁ wörld \n")
    writer.add_string("t.empty", "")
    writer.add_array("t.ints", [1, -2, 3])
    writer.add_array("t.floats", [0.5, -1.25, 3e-8])
    writer.add_array("t.strs", ["a", "", "Ġthe", "<0x0A>"])
    writer.add_array("t.bools", [True, False])
    rng = np.random.default_rng(0)
    writer.add_tensor("f32", rng.standard_normal((3, 5, 7)).astype(np.float32))
    writer.add_tensor("f16", rng.standard_normal((4, 6)).astype(np.float16))
    writer.add_tensor("i32", rng.integers(-9, 9, (11,)).astype(np.int32))
    w = rng.standard_normal((8, 64)).astype(np.float32)
    for kind in ("Q8_0", "Q4_0", "Q4_1"):
        raw = gguf.GGMLQuantizationType[kind]
        writer.add_tensor(kind.lower(), gguf.quants.quantize(w, raw), raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_every_value_and_tensor_kind_reads_as_gguf_reads_it(every_kind):
    assert_same_as_gguf(every_kind)
    meta, tensors = read_gguf(every_kind)
    assert meta["t.strs"] == ["a", "", "Ġthe", "<0x0A>"] and meta["t.u64"] == 2**63 + 5
    assert [t.shape for t in tensors] == [(3, 5, 7), (4, 6), (11,), (8, 64), (8, 64), (8, 64)]


@pytest.mark.slow
def test_smollm2_reads_as_gguf_reads_it(smollm2_gguf):
    assert_same_as_gguf(smollm2_gguf)


def test_a_damaged_file_is_a_value_error(every_kind, tmp_path):
    data = open(every_kind, "rb").read()
    cuts = sorted({6, 12, 30, 100, 300, 600, len(data) // 2, len(data) - 1})
    for cut in cuts:
        path = tmp_path / f"cut{cut}.gguf"
        path.write_bytes(data[:cut])
        with pytest.raises(ValueError):
            read_gguf(str(path))
    big_endian = tmp_path / "big.gguf"
    big_endian.write_bytes(data[:4] + (3).to_bytes(4, "big") + data[8:])
    with pytest.raises(ValueError, match="version 2 or 3"):
        read_gguf(str(big_endian))
    bad_type = bytearray(data)
    bad_type[24 + 8 + len("general.architecture")] = 99  # the first value's type: no such GGUF value type
    (tmp_path / "bad.gguf").write_bytes(bytes(bad_type))
    with pytest.raises(ValueError):
        read_gguf(str(tmp_path / "bad.gguf"))
