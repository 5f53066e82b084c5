"""Reading a GGUF file: its metadata as plain Python values and its tensors as memory-mapped numpy arrays.

gguf's GGUFReader reads the same, but builds numpy views for every part of every metadata value: on SmolLM2 (a
49,152-token vocabulary and 48,900 merges) it takes about 2 s, and a run reads the file twice (the weights, then the
tokenizer). This reads the metadata with `struct` in about 0.1 s. The tensors are what GGUFReader gives (the same
numpy dtypes and shapes), so dequantizing them stays the gguf package's (gguf.quants).

Layout (little-endian, versions 2 and 3): "GGUF", version u32, tensor count u64, metadata count u64; each metadata
entry a string key, a u32 value type and the value; then each tensor's name, n_dims u32, dims u64 (fastest first),
ggml type u32 and data offset u64; the tensor data starts at the next multiple of `general.alignment` (32).
"""
import mmap
import struct
from dataclasses import dataclass

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType, quant_shape_to_byte_shape

SCALARS = {GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H",
           GGUFValueType.INT16: "<h", GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i",
           GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?", GGUFValueType.UINT64: "<Q",
           GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d"}
# tensor types GGUFReader returns as numbers; every other type (BF16, the quantized blocks) as rows of bytes
NUMERIC = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
           GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
           GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32, GGMLQuantizationType.I64: np.int64}


@dataclass
class GGUFTensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # torch order (slowest dimension first)
    data: np.ndarray  # shape for numeric types; else uint8 with the last dimension in bytes (gguf's byte shape)


class Cursor:
    """Reads little-endian values from a buffer, front to back."""

    def __init__(self, buf):
        self.buf, self.pos = buf, 0

    def scalar(self, fmt: str):
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.scalar("<Q")
        if self.pos + n > len(self.buf):
            raise ValueError("a string runs past the end of the file")
        self.pos += n
        return bytes(self.buf[self.pos - n:self.pos]).decode("utf-8", errors="replace")

    def value(self, kind: int):
        kind = GGUFValueType(kind)
        if kind == GGUFValueType.STRING:
            return self.string()
        if kind != GGUFValueType.ARRAY:
            return self.scalar(SCALARS[kind])
        item, n = GGUFValueType(self.scalar("<I")), self.scalar("<Q")
        if item in SCALARS:  # numbers: one numpy read for the whole array
            dtype = np.dtype(SCALARS[item])
            end = self.pos + n * dtype.itemsize
            if end > len(self.buf):
                raise ValueError("an array runs past the end of the file")
            values = np.frombuffer(self.buf[self.pos:end], dtype=dtype).tolist()
            self.pos = end
            return values
        return [self.value(item) for _ in range(n)]


def read_gguf(path: str) -> tuple[dict, list[GGUFTensor]]:
    """(metadata {key: value}, tensors in file order). Arrays are lists, as GGUFReader's contents() gives them.
    A file that is not a little-endian GGUF of version 2 or 3, or that ends early, is a ValueError."""
    with open(path, "rb") as f:
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)  # stays mapped while the tensors' arrays use it
    cur = Cursor(memoryview(buf))
    try:
        magic, version = bytes(cur.buf[:4]), struct.unpack_from("<I", cur.buf, 4)[0]
        if magic != b"GGUF" or version not in (2, 3):
            raise ValueError(f"not a little-endian GGUF file of version 2 or 3 (magic {magic!r}, version {version})")
        cur.pos = 8
        n_tensors, n_meta = cur.scalar("<Q"), cur.scalar("<Q")
        meta = {}
        for _ in range(n_meta):
            key = cur.string()
            meta[key] = cur.value(cur.scalar("<I"))
        infos = []
        for _ in range(n_tensors):
            name, n_dims = cur.string(), cur.scalar("<I")
            dims = [cur.scalar("<Q") for _ in range(n_dims)]
            infos.append((name, GGMLQuantizationType(cur.scalar("<I")), tuple(reversed(dims)), cur.scalar("<Q")))
    except struct.error:
        raise ValueError("the file ends inside its header") from None
    alignment = meta.get("general.alignment", 32)
    if isinstance(alignment, bool) or not isinstance(alignment, int) or alignment < 1:
        raise ValueError(f"general.alignment must be a positive integer, got {alignment!r}")
    start = (cur.pos + alignment - 1) // alignment * alignment
    everything = np.frombuffer(buf, dtype=np.uint8)
    tensors = []
    for name, kind, shape, offset in infos:
        block, block_bytes = GGML_QUANT_SIZES[kind]
        n_bytes = int(np.prod(shape)) * block_bytes // block
        raw = everything[start + offset:start + offset + n_bytes]
        if len(raw) != n_bytes:
            raise ValueError(f"tensor {name!r} runs past the end of the file")
        data = raw.view(NUMERIC[kind]).reshape(shape) if kind in NUMERIC else \
            raw.reshape(quant_shape_to_byte_shape(shape, kind))
        tensors.append(GGUFTensor(name, kind, shape, data))
    return meta, tensors
